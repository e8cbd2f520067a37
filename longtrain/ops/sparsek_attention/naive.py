"""Plain-PyTorch SparseK attention over one chunk: the reference every kernel is tested against.

Keys live in an extended layout [pool slots K][tail slots W-1][chunk L] with absolute positions.
Queries are processed in blocks of G: a block needs only the pool selected at its start plus one
contiguous band of positions (i0 - w, i0 + G - 1] (DESIGN.md section 2, fact 2), so time and memory
are O(L * (k + w + G)) and no L x L matrix is ever formed.

For query i and key j (positions p_i, p_j):
  window    p_i - w < p_j <= p_i                      gate g = 1
  selected  p_j <= p_i - w and (u_j, p_j) >= theta_i    gate g = m = clamp(u_j - tau_i, 0, 1)
  variants  hard_k_soft_v: softmax(q.k) over S u W, values scaled by g
            soft_kv:       logits g * q.k (keys scaled by g), values scaled by g
            straight_through: g = m - sg(m) + 1 on selected keys (forward value 1)

With `linear` (SparseK+Linear+SW, paper Appendix B.1) every causal key j also contributes through
linear attention, weighted by 1 - g_ij (g = 0 for keys neither selected nor in the window), and the
gate weighs exp(q.k) in the denominator too, as in the paper's formula:

    o_i = sum_j (g_ij e^{s_ij} + (1 - g_ij) phi(q_i).phi(k_j)) v_j / sum_j (g_ij e^{s_ij} + (1 - g_ij) phi(q_i).phi(k_j))

The linear sums over the causal keys outside query i's window come in precomputed (LinearTerms.num,
.den: causal linear attention, ops/linear_attention); the core adds the exp part and takes the
g-weighted linear part of the selected keys back out (the window's keys, g = 1, are not in the sums:
adding and removing them cancelled to rounding noise). Both parts are scaled by e^{-M_i},
M_i = max(0, max_j s_ij), so neither exp overflows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

VARIANTS = ("hard_k_soft_v", "soft_kv", "straight_through")


class LinearTerms(NamedTuple):
    """The linear-attention inputs of the SparseK+Linear+SW core (module doc)."""

    phq: torch.Tensor  # [B, L, H, F] phi of the queries
    phk: torch.Tensor  # [B, N, Hkv, F] phi of the extended keys (0 in empty slots)
    num: torch.Tensor  # [B, L, H, D] phi(q_i) . sum_j phi(k_j) v_j^T over the causal keys with p_j <= p_i - w
    den: torch.Tensor  # [B, L, H] phi(q_i) . sum_j phi(k_j) over the same keys


def position_order(block_pool: torch.Tensor, pos_ext: torch.Tensor) -> torch.Tensor:
    """The permutation [B, nb, K] that puts each block's pool (ext indices, -1 empty) in ascending key
    position, empty slots first: the order a block's pool keys are summed in must not depend on the
    scan's slot history, which differs between a chunked and an unchunked pass (issue 24). The naive
    core and the Triton forward both order their pool tiles by it."""
    B, nb, K = block_pool.shape
    idx = block_pool.long().clamp(0, pos_ext.shape[1] - 1)
    kpos = pos_ext.gather(1, idx.reshape(B, nb * K)).view(B, nb, K)
    return torch.where(block_pool >= 0, kpos, -1).argsort(dim=-1, stable=True)


def pools_by_position(block_pool: torch.Tensor, pos_ext: torch.Tensor) -> torch.Tensor:
    """Each block's pool [B, nb, K] in ascending key position (position_order)."""
    return block_pool.gather(-1, position_order(block_pool, pos_ext))


def block_key_indices(block_pool: torch.Tensor, n_ext: int, topk: int, window: int, tail_slots: int, block: int, n_blocks: int,
                      pos_ext: torch.Tensor | None = None):
    """Ext indices [B, nb, K + w + G - 1] of each query block's keys (-1: none); with pos_ext, each
    block's pool in ascending position."""
    B, dev = block_pool.shape[0], block_pool.device
    band = window + block - 1
    # Ext index of position p is topk + tail_slots + (p - t0); the band starts at i0 - w + 1.
    start = topk + tail_slots - window + 1 + torch.arange(n_blocks, device=dev) * block  # [nb]
    band_idx = start[:, None] + torch.arange(band, device=dev)[None, :]  # [nb, band]
    band_idx = torch.where((band_idx >= topk) & (band_idx < n_ext), band_idx, -1)
    pool = block_pool[:, :n_blocks]
    if pos_ext is not None:
        pool = pools_by_position(pool, pos_ext.to(dev))
    return torch.cat([pool, band_idx.expand(B, -1, -1)], dim=-1)


def sparsek_attention_core_naive(
    q: torch.Tensor,  # [B, L, H, D]
    k_ext: torch.Tensor,  # [B, N, Hkv, D]
    v_ext: torch.Tensor,  # [B, N, Hkv, D]
    u_ext: torch.Tensor,  # [B, N] scores (the chunk part may carry gradient)
    pos_ext: torch.Tensor,  # [B, N] int64 positions (-1: empty)
    q_pos: torch.Tensor,  # [B, L] int64 query positions (-1: padding)
    theta_u: torch.Tensor,  # [B, L] float64
    theta_pos: torch.Tensor,  # [B, L] int64
    tau: torch.Tensor,  # [B, L] (differentiable)
    block_pool: torch.Tensor,  # [B, nb, K] int64 ext indices
    *,
    topk: int,
    window: int,
    tail_slots: int,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    block: int = 64,
    max_scores: int = 1 << 24,
    linear: LinearTerms | None = None,
) -> torch.Tensor:
    B, L, H, D = q.shape
    N, Hkv = k_ext.shape[1], k_ext.shape[2]
    R = H // Hkv
    scale = D**-0.5 if scale is None else scale
    nb = -(-L // block)
    Lp = nb * block
    dev = q.device

    keys = block_key_indices(block_pool.to(dev), N, topk, window, tail_slots, block, nb, pos_ext=pos_ext)  # [B, nb, Kb]
    Kb = keys.shape[-1]

    def pad_q(x, value):  # [B, L] -> [B, Lp]
        return torch.nn.functional.pad(x, (0, Lp - L), value=value)

    qb = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, Lp - L)).reshape(B, nb, block, Hkv, R, D)
    qpos_b = pad_q(q_pos, -1).reshape(B, nb, block)
    th_u = pad_q(theta_u, float("inf")).reshape(B, nb, block)
    th_pos = pad_q(theta_pos, 0).reshape(B, nb, block)
    tau_b = pad_q(tau, 0.0).reshape(B, nb, block)
    if linear is not None:  # exp and linear weights in at least float32 (they share one denominator)
        cdt = torch.promote_types(q.dtype, torch.float32)
        qb = qb.to(cdt)
        phq_b = torch.nn.functional.pad(linear.phq, (0, 0, 0, 0, 0, Lp - L)).to(cdt).reshape(B, nb, block, Hkv, R, -1)
        num_b = torch.nn.functional.pad(linear.num, (0, 0, 0, 0, 0, Lp - L)).to(cdt).reshape(B, nb, block, Hkv, R, D)
        den_b = torch.nn.functional.pad(linear.den, (0, 0, 0, Lp - L)).to(cdt).reshape(B, nb, block, Hkv, R)

    # Blocks per step, so the [B, nbs, Hkv, R, G, Kb] scores stay under max_scores elements.
    step = max(1, max_scores // max(1, B * H * block * Kb))
    rows = torch.arange(B, device=dev)[:, None, None]
    outs = []
    for s in range(0, nb, step):
        e = min(nb, s + step)
        idx = keys[:, s:e]  # [B, n, Kb]
        safe = idx.clamp(min=0)
        kk = k_ext[rows, safe]  # [B, n, Kb, Hkv, D]
        vv = v_ext[rows, safe]
        uu = u_ext[rows, safe]  # [B, n, Kb]
        pp = torch.where(idx >= 0, pos_ext[rows, safe], -1)  # [B, n, Kb]

        qp = qpos_b[:, s:e, :, None]  # [B, n, G, 1]
        kp = pp[:, :, None, :]  # [B, n, 1, Kb]
        live = (kp >= 0) & (qp >= 0) & (kp <= qp)
        in_window = live & (kp > qp - window)
        cand = live & (kp <= qp - window)
        tu = th_u[:, s:e, :, None]
        uu64 = uu.detach().to(torch.float64)[:, :, None, :]
        selected = cand & ((uu64 > tu) | ((uu64 == tu) & (kp >= th_pos[:, s:e, :, None]))) if topk > 0 else torch.zeros_like(cand)
        attend = in_window | selected  # [B, n, G, Kb]

        m = (uu[:, :, None, :] - tau_b[:, s:e, :, None]).clamp(0, 1)  # [B, n, G, Kb]
        if variant == "straight_through":
            m = m - m.detach() + 1
        gate = torch.where(selected, m, torch.ones_like(m))

        logits = torch.einsum("bngkrd,bnjkd->bnkrgj", qb[:, s:e], kk.to(qb.dtype)) * scale  # [B, n, Hkv, R, G, Kb]
        gate_h = gate[:, :, None, None].to(logits.dtype)  # [B, n, 1, 1, G, Kb]
        if variant == "soft_kv":
            logits = logits * gate_h
        logits = logits.masked_fill(~attend[:, :, None, None], -float("inf"))
        if linear is not None:
            # S holds every key beyond the window (a document's first w + k positions, tau = -inf)?
            complete = selected.sum(-1) == (qpos_b[:, s:e] - window + 1).clamp(min=0)  # [B, n, G]
            outs.append(_mix_linear(logits, gate_h, attend, selected, complete, vv, linear.phk[rows, safe],
                                    phq_b[:, s:e], num_b[:, s:e], den_b[:, s:e]))
            continue
        # Padded queries attend to nothing: give them a harmless row, then zero it.
        any_key = attend.any(-1)[:, :, None, None, :, None]  # [B, n, 1, 1, G, 1]
        p = torch.softmax(torch.where(any_key, logits, torch.zeros_like(logits)), dim=-1) * any_key
        o = torch.einsum("bnkrgj,bnjkd->bngkrd", p * gate_h, vv)  # [B, n, G, Hkv, R, D]
        outs.append(o)
    o = torch.cat(outs, dim=1).reshape(B, Lp, H, D)[:, :L]
    return o.to(q.dtype)


def _mix_linear(logits, gate, attend, selected, complete, v, phk, phq, num_lin, den_lin) -> torch.Tensor:
    """o [B, n, G, Hkv, R, D] of the SparseK+Linear+SW formula (module doc) for one step of query blocks.

    logits [B, n, Hkv, R, G, Kb] (-inf off S u W), gate [B, n, 1, 1, G, Kb], attend (S u W) and selected
    (S) [B, n, G, Kb], complete [B, n, G] (S is every key beyond the window), v [B, n, Kb, Hkv, D],
    phk [B, n, Kb, Hkv, F] of the gathered keys; phq [B, n, G, Hkv, R, F], num_lin [B, n, G, Hkv, R, D],
    den_lin [B, n, G, Hkv, R] over the causal keys outside the window.
    """
    M = logits.detach().amax(-1, keepdim=True).clamp(min=0)  # [B, n, Hkv, R, G, 1]: a stabiliser only
    lin_w = torch.einsum("bngkrf,bnjkf->bnkrgj", phq, phk.to(phq.dtype))  # phi(q_i).phi(k_j)
    on, sel = attend[:, :, None, None], selected[:, :, None, None]  # [B, n, 1, 1, G, Kb]
    # The linear part over S, two exact forms: when S is every key beyond the window, (1 - g) phi.phi over S
    # alone (the sums beyond the window hold S only: their difference would be rounding noise); otherwise
    # those sums minus g phi.phi over S. The choice is made on the gates, which have no head axes.
    full = complete[:, :, None, None, :, None]  # [B, n, 1, 1, G, 1]
    lin_gate = torch.where(sel, torch.where(full, 1 - gate, -gate), 0)  # [B, n, 1, 1, G, Kb]
    w = torch.where(on, gate * torch.exp(logits - M), 0) + lin_gate * torch.exp(-M) * lin_w
    eM = torch.exp(-M)[..., 0].permute(0, 1, 4, 2, 3)  # [B, n, G, Hkv, R]
    eM = torch.where(complete[..., None, None], 0, eM)  # the sums beyond the window are S's, counted above
    num = torch.einsum("bnkrgj,bnjkd->bngkrd", w, v.to(w.dtype)) + eM[..., None] * num_lin
    den = w.sum(-1).permute(0, 1, 4, 2, 3) + eM * den_lin  # [B, n, G, Hkv, R]
    any_key = attend.any(-1)[:, :, :, None, None]  # padded queries: no keys, output 0
    return torch.where(any_key[..., None], num / torch.where(any_key, den, 1)[..., None], 0)
