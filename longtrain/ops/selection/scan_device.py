"""The selection scan on the tensors' own device (the GPU): scan.scan_chunk's results without heaps.

The CPU scan (scan.py, compiled in scan_numba.py) walks the candidates one by one. Here every query
is answered on its own, in parallel, from structures built once per chunk, in a fixed sequence of
launches (scan_device_kernels.py) and no host synchronisation:

  - Entries: the row's items in the extended layout [pool K][tail W-1][chunk L], then the carried
    threshold scores. One stable sort of int32 keys (u descending) gives the rank order; ties go to
    the larger ext index, which is the larger position (the op lays the pool out ascending).
  - A wavelet tree over the ranks (wavelet.py), built by bottom-up merges of the rank order:
    theta_i, the k-th best item among the first K + n_i (pool plus the candidates query i sees), is
    one descent, O(log N); the top-k set S_i is the items ranked at or above it, so its fingerprint
    is a hash sum read on the way down.
  - tau_i solves f_i(t) = sum_{j in C_i} clamp(u_j - t, 0, 1) = k. f_i is piecewise linear with
    breakpoints at every u and u - 1 (items and carried scores): both lists are sorted by rank, so
    their merge is a binary search per entry, not a float64 sort. A binary search over the
    breakpoints finds the last t with f_i(t) > k, each f_i(t) being one tree descent of two prefix
    counts (u > t, u - 1 > t); the carried scores enter (and the pool leaves) f as prefix sums over
    the ranks. On that piece tau = (sum of fractional u + #saturated - k) / #fractional, the CPU
    scan's formula. O(log^2 N) per query.
  - The pools: item s is pooled in one interval of blocks [enter, leave); at each block start the
    r-th key to enter (ext order) takes the slot of the r-th to leave (worst first), the others
    fresh slots: stable slots from prefix sums and a few pointer-jumping launches. The threshold
    state after the chunk is the kept scores in rank order: a compaction, no sort.

Selection (theta, pools, fingerprints, |A|) is exact: integer ranks. tau agrees with the CPU scan up
to rounding (prefix sums instead of running sums), which the tests bound. Scores must be float32 or
narrower: a key holds the float32 bits (float64 scores use the CPU scan); the carried scores are
float32 values. Where f_i equals k on a whole interval (no fractional candidates) tau is not unique;
as the CPU scan, tau never goes below the carried tau (tau_prev), which keeps it non-decreasing
across chunks after the carried state has dropped the scores below it.
"""

from __future__ import annotations

import math

import torch
import triton

from longtrain.ops.selection import scan_device_kernels as kern
from longtrain.ops.selection.scan import DeviceScan
from longtrain.ops.selection.wavelet import empty_wavelet_tree, merge_levels

TILE = 128  # entries (ranks, items) per program of the per-entry kernels: programs for every SM
PROBES = 1  # f evaluations per round of tau's search (a power of two; 1: binary, the least work)
INF = float("inf")
MASK63 = (1 << 63) - 1
INT64_MAX = (1 << 63) - 1
_U64 = 1 << 64


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - _U64 if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def position_hash_tensor(pos: torch.Tensor) -> torch.Tensor:
    """scan.position_hash (splitmix64, masked to 63 bits) of an int64 tensor, wrapping arithmetic
    (the torch twin of the kernels' _position_hash)."""
    x = pos.to(torch.int64) + _i64(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _i64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _i64(0x94D049BB133111EB)
    return (x ^ _shr(x, 31)) & MASK63


def pack_keys(u: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(u, position) as one int64 whose order is (u, position)'s; invalid (pos < 0) -> INT64_MIN.

    The selection's order in one key; sort_keys gets the same order from u alone and a stable sort."""
    u32 = u.to(torch.float32) + 0.0  # -0.0 -> +0.0: the CPU scan compares them as equal
    bits = u32.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in u, still signed
    key = ordered * (1 << 32) + pos.clamp(min=0)
    return torch.where(pos >= 0, key, torch.iinfo(torch.int64).min)


# On CUDA the scan's launches cost more host time than GPU time: replay them as one CUDA graph per
# input shape (captured on first use; a trainer's chunks share one shape).
CUDA_GRAPHS = True
_MAX_GRAPHS = 8
_graphs: dict = {}


def scan_chunk_device(
    u_ext: torch.Tensor,  # [B, N] scores in the extended layout [pool K][tail W-1][chunk L]
    pos_ext: torch.Tensor,  # [B, N] int64 positions (-1: empty)
    *,
    thr_u: torch.Tensor,  # [B, cap] float64: the carried scores above tau
    thr_count: torch.Tensor,  # [B] int64
    overflow: torch.Tensor,  # [B] int64
    seen: torch.Tensor,  # [B] tokens processed before this chunk
    lengths: torch.Tensor,  # [B] valid queries in this chunk
    n_queries: int,  # L
    topk: int,
    window: int,
    block: int,
    tau_prev: torch.Tensor | None = None,  # [B] float64: the carried tau (None: -inf, a fresh cache)
) -> DeviceScan:
    """scan.scan_chunk for one chunk, on u_ext's device; same results (tau up to rounding)."""
    if tau_prev is None:
        tau_prev = torch.full((u_ext.shape[0],), -INF, dtype=torch.float64, device=u_ext.device)
    inputs = dict(u_ext=u_ext.detach(), pos_ext=pos_ext, thr_u=thr_u, thr_count=thr_count, overflow=overflow,
                  seen=seen, lengths=lengths, tau_prev=tau_prev.to(torch.float64))
    static = dict(n_queries=n_queries, topk=topk, window=window, block=block)
    if not (CUDA_GRAPHS and u_ext.is_cuda):
        return _scan(**inputs, **static)
    key = (tuple(static.values()), tuple((t.shape, t.dtype, t.device) for t in inputs.values()))
    if key not in _graphs:
        if len(_graphs) >= _MAX_GRAPHS:
            _graphs.pop(next(iter(_graphs)))  # the oldest shape
        bufs = {name: t.clone() for name, t in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture: compiles the kernel, primes the allocator
            _scan(**bufs, **static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _scan(**bufs, **static)
        _graphs[key] = (graph, bufs, out)
    graph, bufs, out = _graphs[key]
    torch._foreach_copy_(list(bufs.values()), list(inputs.values()))  # a few launches, not one per input
    graph.replay()
    # The graph's outputs are overwritten by its next replay (the next layer): hand out copies.
    if out.flat is not None:  # one buffer holds them all: one copy
        return _output_views(out.flat.clone(), **out.dims)
    return DeviceScan(
        **{f: getattr(out, f).clone() for f in ("theta_u", "theta_pos", "tau", "n_active", "fingerprint",
                                                "block_pool", "final_pool")},
        threshold={name: t.clone() for name, t in out.threshold.items()},
    )


def _output_fields(B, L, nb, K, cap):
    """DeviceScan's tensors in one flat buffer: (name, shape, dtype), the 8-byte ones first."""
    f64, i64 = torch.float64, torch.int64
    return (("theta_u", (B, L), f64), ("theta_pos", (B, L), i64), ("tau", (B, L), f64), ("n_active", (B, L), i64),
            ("fingerprint", (B, L), i64), ("block_pool", (B, nb, K), i64), ("final_pool", (B, K), i64),
            ("thr_u", (B, cap), f64), ("thr_count", (B,), i64), ("thr_tau", (B,), f64), ("thr_sum", (B,), f64),
            ("overflow", (B,), i64), ("thr_saturated", (B, cap), torch.bool))


def _output_views(flat: torch.Tensor | None, B, L, nb, K, cap, device=None) -> DeviceScan:
    """A DeviceScan whose tensors are views of `flat` (uint8; allocated when None), in _output_fields' layout."""
    fields = _output_fields(B, L, nb, K, cap)
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in fields]
    if flat is None:
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    t, off = {}, 0
    for (name, shape, dtype), size in zip(fields, sizes):
        t[name] = flat[off: off + size].view(dtype).view(shape)
        off += size
    scan = DeviceScan(
        **{f: t[f] for f in ("theta_u", "theta_pos", "tau", "n_active", "fingerprint", "block_pool", "final_pool")},
        threshold=dict(thr_u=t["thr_u"], thr_saturated=t["thr_saturated"], thr_count=t["thr_count"], tau=t["thr_tau"],
                       thr_sum=t["thr_sum"], overflow=t["overflow"]),
    )
    scan.flat, scan.dims = flat, dict(B=B, L=L, nb=nb, K=K, cap=cap)  # for the graph's one copy
    return scan


def _search_rounds(n: int, probes: int) -> int:
    """Rounds of queries_kernel's search to shrink (-1, n) to two neighbours, NP probes a round."""
    span, rounds = n + 1, 0
    while span > 1:
        cuts = [min(max(span * p // (probes + 1), 1), span - 1) for p in range(1, probes + 1)]
        span = max(b - a for a, b in zip([0] + cuts, cuts + [span]))
        rounds += 1
    return rounds


def sort_keys(u_ext: torch.Tensor, pos_ext: torch.Tensor, thr_u: torch.Tensor, thr_count: torch.Tensor):
    """The row's entries (items in ext order, then the carried scores) in rank order: [B, N + cap] sorted
    int32 keys and their int64 indices (entry m = N + cap - 1 - index).

    A key is u descending (32 bits; invalid entries last); the keys are written in reverse entry
    order, so the stable sort ranks ties by the larger ext index, which is the larger position
    (the op's layout: pool ascending, then tail and chunk). Four radix passes, not the eight of
    (u, position) in one int64."""
    B, N = u_ext.shape
    NM = N + thr_u.shape[1]
    keys = torch.empty(B, NM, dtype=torch.int32, device=u_ext.device)
    kern.keys_kernel[(triton.cdiv(NM, TILE), B)](u_ext, pos_ext, thr_u, thr_count, keys, N, NM, thr_u.shape[1],
                                                 BLK=TILE)
    return keys.sort(dim=1, stable=True)


def sort_keys_reference(u_ext, pos_ext, thr_u, thr_count):
    """sort_keys in plain torch (the same keys, the same order)."""
    B, N = u_ext.shape
    cap = thr_u.shape[1]
    dev = u_ext.device
    u = torch.cat([u_ext.float(), thr_u.float()], 1)
    u = torch.where(u == 0, 0.0, u)
    bits = u.view(torch.int32).long() & 0xFFFFFFFF
    mono = torch.where(bits < 1 << 31, bits + (1 << 31), 0xFFFFFFFF - bits)
    valid = torch.cat([pos_ext >= 0, torch.arange(cap, device=dev)[None] < thr_count[:, None]], 1)
    desc = torch.where(valid, 0xFFFFFFFF - mono, 0xFFFFFFFF)
    return (desc - (1 << 31)).int().flip(1).sort(dim=1, stable=True)


def breakpoints_reference(score: torch.Tensor, nvalid: torch.Tensor):
    """breakpoints_kernel's (t, #{u > t}, #{u - 1 > t}) by a sort and searchsorted, from the scores by rank."""
    B, NM = score.shape
    valid = torch.arange(NM, device=score.device)[None] < nvalid[:, None]
    bp = torch.where(valid, score, INF)
    bpt = torch.cat([bp, bp - 1], 1).sort(1).values.nan_to_num(posinf=torch.finfo(torch.float64).max)
    neg = -score  # ascending
    rv = torch.searchsorted(neg.contiguous(), -bpt.contiguous())
    rw = torch.searchsorted((neg + 1).contiguous(), -bpt.contiguous())
    pad = bpt == torch.finfo(torch.float64).max
    return bpt, torch.where(pad, 0, rv).int(), torch.where(pad, 0, rw).int()


def _scan(u_ext, pos_ext, thr_u, thr_count, overflow, seen, lengths, tau_prev, n_queries, topk, window,
          block) -> DeviceScan:
    """scan_chunk_device's work: a fixed sequence of launches, no host synchronisation."""
    B, N = u_ext.shape
    K, L, cap = topk, n_queries, thr_u.shape[1]
    nb = -(-L // block)
    dev = u_ext.device
    if K == 0:
        scan = _nothing_selected(B, L, nb, thr_u, overflow, lengths)
        scan.flat = None
        return scan
    u_ext, pos_ext = u_ext.contiguous(), pos_ext.contiguous().to(torch.int64)
    thr_u, thr_count = thr_u.contiguous().to(torch.float64), thr_count.contiguous().to(torch.int64)
    seen, lengths = seen.contiguous().to(torch.int64), lengths.contiguous().to(torch.int64)
    NM = N + cap
    NT = triton.cdiv(NM, TILE)
    NTP = triton.next_power_of_2(NT)
    grid = (NT, B)
    delta = 1 if window == 0 else 0  # query c sees the first c + delta stream items (tail, chunk)
    lag = max(window, 1)

    def new(*shape, dtype=torch.int32):
        return torch.empty(*shape, dtype=dtype, device=dev)

    # Entries in rank order; per rank the entry, its score and hash: the tree's leaves, then the tree.
    keys, kidx = sort_keys(u_ext, pos_ext, thr_u, thr_count)  # [B, NM]
    tree = empty_wavelet_tree(B, NM, dev)
    LV = tree.levels
    by_rank, rank_of, score = new(B, NM), new(B, NM), new(B, NM, dtype=torch.float64)
    nvalid = new(B)
    tot, tots = new(B, kern.N_TOT, NT), new(B, NT, dtype=torch.float64)  # per-tile totals
    kern.ranked_kernel[grid](keys, kidx, pos_ext, by_rank, rank_of, score, tree.order, tree.score_sum, tree.hash_sum,
                             LV * NM, (LV + 1) * NM, nvalid, tot, tots, N, NM, K, NT, BLK=TILE)
    merge_levels(tree)

    # tau's breakpoints and f's offsets (carried entries in, pool items out).
    cc, cs = new(B, NM + 1), new(B, NM + 1, dtype=torch.float64)
    bpt, bprv, bprw = new(B, 2 * NM, dtype=torch.float64), new(B, 2 * NM), new(B, 2 * NM)
    kern.breakpoints_kernel[grid](score, by_rank, nvalid, tot, tots, cc, cs, bpt, bprv, bprw, N, NM, K, NT,
                                  NM.bit_length(), NTP=NTP, BLK=TILE)

    # Every query, and the state after the chunk (c = L).
    out = _output_views(None, B, L, nb, K, cap, device=dev)
    thr = out.threshold
    theta_u, tau, theta_pos, n_active, fp = out.theta_u, out.tau, out.theta_pos, out.n_active, out.fingerprint
    qrank, tau_end = new(B, L + 1), new(B, dtype=torch.float64)
    bq = 64 if B * (L + 1) >= 64 * 256 else 32  # small rows: more, smaller programs
    kern.queries_kernel[(triton.cdiv(L + 1, bq), B)](
        tree.left, tree.hash_sum, bpt, bprv, bprw, cc, cs, score, by_rank, pos_ext, nvalid, seen,
        lengths, tau_prev, theta_u, theta_pos, tau, n_active, fp, qrank, tau_end,
        N, NM, K, L, LV, _search_rounds(2 * NM, PROBES), delta, lag, BQ=bq, NP=PROBES, num_warps=bq // 32,
    )

    # The pools: item s is pooled in the blocks [enter, leave); stable slots; then the expansion.
    count, member, flags_r = new(B, N), new(B, N, dtype=torch.int8), new(B, NM, dtype=torch.int8)
    kern.pool_flags_kernel[grid](pos_ext, rank_of, by_rank, score, qrank, nvalid, lengths, tau_end, count, member,
                                 flags_r, tot, N, NM, K, L, nb, block, delta, NT, max(1, nb.bit_length()), BLK=TILE)
    pe, cp, pr, lseq = new(B, N + 1), new(B, N + 1), new(B, NM + 1), new(B, N)
    final_pool, thr_out = out.final_pool, thr["thr_u"]
    kern.pool_scan_kernel[grid](count, member, flags_r, by_rank, score, tot, pe, cp, pr, lseq, final_pool, thr_out,
                                N, NM, K, cap, NT, NTP=NTP, BLK=TILE)
    grid_n = (triton.cdiv(N, TILE), B)
    ptr, root_slot, slot = new(B, N), new(B, N), new(B, N)
    kern.slot_pred_kernel[grid_n](count, pe, pr, lseq, qrank, lengths, ptr, root_slot, N, NM, K, L, block, delta,
                                  BLK=TILE)
    jumps = 1  # a chain of keys sharing a slot has at most nb - 1 links: 16 per link of 16 per launch
    while 16**jumps < nb - 1:
        jumps += 1
    other = torch.empty_like(ptr)
    for i in range(jumps):
        kern.slot_jump_kernel[grid_n](count, ptr, other, root_slot, slot, N, 16, FINAL=i == jumps - 1, BLK=TILE)
        ptr, other = other, ptr
    block_pool = out.block_pool.fill_(-1)
    if nb > 0:
        kern.expand_pools_kernel[(triton.cdiv(nb * K, TILE), B)](cp, slot, block_pool, N, K, nb, block, delta,
                                                                 max(1, N.bit_length()), BLK=TILE)

    # The next threshold state: the carried and new scores above tau after the chunk, descending.
    kern.finish_kernel[(B,)](tot, tau_end, overflow.contiguous(), thr_out, thr["thr_saturated"].view(torch.uint8),
                             thr["thr_count"], thr["tau"], thr["thr_sum"], thr["overflow"], final_pool, K, cap, NT,
                             NTP=NTP, BLK=1024)
    return out


def _nothing_selected(B, L, nb, thr_u, overflow, lengths) -> DeviceScan:
    """k = 0: a sliding window only; no theta, tau = +inf, empty pools, no threshold state."""
    dev = thr_u.device
    qvalid = torch.arange(L, device=dev)[None] < lengths[:, None]  # padded queries: ScanOutputs.empty
    zeros = torch.zeros(B, L, dtype=torch.int64, device=dev)
    return DeviceScan(
        theta_u=torch.where(qvalid, -INF, INF).to(torch.float64),
        theta_pos=torch.where(qvalid, -1, INT64_MAX),
        tau=torch.where(qvalid, INF, 0.0).to(torch.float64),
        n_active=zeros,
        fingerprint=zeros.clone(),
        block_pool=torch.full((B, nb, 0), -1, dtype=torch.int64, device=dev),
        final_pool=torch.full((B, 0), -1, dtype=torch.int64, device=dev),
        threshold=dict(
            thr_u=torch.zeros_like(thr_u, dtype=torch.float64),
            thr_saturated=torch.zeros(thr_u.shape, dtype=torch.bool, device=dev),
            thr_count=torch.zeros(B, dtype=torch.int64, device=dev),
            tau=torch.full((B,), INF, dtype=torch.float64, device=dev),
            thr_sum=torch.zeros(B, dtype=torch.float64, device=dev),
            overflow=overflow.clone(),
        ),
    )
