"""Stable pool slots: relabel per-block pool snapshots so that a key keeps one slot while pooled.

The backward's pool walk sums each pool key's gradient along its slot, block after block, so a key
must not move between slots. Two facts of the selection scan make a relabelling exist: a key's pool
membership is one interval of blocks [first, last], and the pool only grows until it is full (then
it can only empty at once, after a ragged row's last block). At each block boundary the r-th key to
enter takes the slot of the r-th key to leave; surplus entrants take fresh slots. Slots follow the
chains of predecessors by pointer jumping: O(log nb) gathers, no host synchronisation.

`slots_from_intervals` is the relabelling given each key's interval (the device scan knows them);
`stable_slots` first reads the intervals off snapshots (what the kernels get from the host scan).
"""

from __future__ import annotations

import math

import torch


def slots_from_intervals(
    first: torch.Tensor,  # [B, N] first block a key is pooled in (any value where not pooled)
    last: torch.Tensor,  # [B, N] last block it is pooled in
    inpool: torch.Tensor,  # [B, N] bool: pooled in some block
    count: torch.Tensor,  # [B, nb] pool size per block
) -> torch.Tensor:
    """[B, N] int64: the slot each pooled key keeps (garbage where not pooled)."""
    B, N = first.shape
    nb = count.shape[1]
    dev = first.device
    ar = torch.arange(N, device=dev).expand(B, N)
    first = torch.where(inpool, first, nb)
    # Entrants in order (first block, index); leavers in order (last block, index).
    f_sorted, f_order = (first * N + ar).sort(1)
    l_sorted, l_order = (torch.where(inpool, last, nb) * N + ar).sort(1)
    f_sorted, l_sorted = f_sorted // N, l_sorted // N
    place = torch.empty_like(ar).scatter_(1, f_order, ar)  # position of each key among entrants
    rank = place - torch.searchsorted(f_sorted, first)  # rank among the keys entering with it
    x_lo = torch.searchsorted(l_sorted, first - 1)  # keys leaving as it enters: last == first - 1
    n_exit = torch.searchsorted(l_sorted, first - 1, right=True) - x_lo
    has_pred = inpool & (rank < n_exit)
    pred = l_order.gather(1, (x_lo + rank).clamp(max=N - 1))
    before = torch.where(first > 0, count.gather(1, (first - 1).clamp(0, nb - 1)), 0)
    fresh = before + rank - n_exit  # a new slot, for keys with no predecessor
    root = torch.where(has_pred, pred, ar)
    for _ in range(max(1, math.ceil(math.log2(nb + 1)))):
        root = root.gather(1, root)
    return fresh.gather(1, root)


def stable_slots(block_pool: torch.Tensor, n_ext: int) -> torch.Tensor:
    """Relabel pool snapshots [B, nb, K] (ext indices, -1 empty) into stable slots; same sets per block."""
    B, nb, K = block_pool.shape
    if K == 0 or nb == 0:
        return block_pool
    dev = block_pool.device
    N = n_ext
    bp = block_pool.to(torch.int64)
    ok = bp >= 0
    blk = torch.arange(nb, device=dev).view(1, nb, 1).expand(B, nb, K).reshape(B, -1)
    flat = torch.where(ok, bp, N).reshape(B, -1)  # slot N is a dump for empty entries
    first = torch.full((B, N + 1), nb, device=dev).scatter_reduce(1, flat, blk, "amin")[:, :N].contiguous()  # [B, N]
    last = torch.full((B, N + 1), -1, device=dev).scatter_reduce(1, flat, blk, "amax")[:, :N].contiguous()
    slot = slots_from_intervals(first, last, last >= 0, ok.sum(-1))  # [B, N]
    slot_of = torch.where(ok, slot.gather(1, bp.clamp(min=0).reshape(B, -1)).reshape(B, nb, K), K)
    out = torch.full((B, nb, K + 1), -1, dtype=torch.int64, device=dev)
    out.scatter_(2, slot_of, bp)
    return out[:, :, :K].to(block_pool.dtype)
