"""The selection scan on the tensors' own device (the GPU): scan.scan_chunk's results without heaps.

The CPU scan (scan.py, compiled in scan_numba.py) walks the candidates one by one. Here every query
is answered on its own, in parallel, from structures built once per chunk:

  - Items: the row's extended layout [pool K][tail W-1][chunk L] in order, each with a key
    (u, position) packed into one int64, so sorting keys is the strict total order of the
    selection (ties to the larger position). Ranks come from one sort.
  - theta_i is the k-th best item among the first K + n_i items (pool plus the candidates query i
    sees): a quantile in a wavelet matrix over the ranks (wavelet.py), O(log N) per query. The top-k
    set S_i is exactly the items ranked at or above it, so its fingerprint is a hash prefix sum.
  - tau_i solves f_i(t) = sum_{j in C_i} clamp(u_j - t, 0, 1) = k. f_i is piecewise linear with
    breakpoints at every u and u - 1; a binary search over all breakpoints of the chunk finds the
    last t with f_i(t) > k, each f_i(t) being two wavelet prefix sums (the items with u > t and those
    with u - 1 > t). On that piece tau = (sum of fractional u + #saturated - k) / #fractional, the
    CPU scan's formula. O(log^2 N) per query.
  - The carried threshold state (scores above the previous tau, no positions) enters f as
    per-breakpoint offsets, and the pool at each block start is the items ranked at or above that
    block's first theta: one interval of blocks per item, expanded without a host sync.

Selection (theta, pools, fingerprints) is exact: integer ranks. tau agrees with the CPU scan up to
rounding (prefix sums instead of running sums), which the tests bound. No host synchronisation.
Scores must be float32 or narrower: a key holds the float32 bits (float64 scores use the CPU scan).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from longtrain.ops.attention.scan import DeviceScan
from longtrain.ops.attention.wavelet import WaveletMatrix, build_wavelet

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
    """scan.position_hash (splitmix64, masked to 63 bits) of an int64 tensor, wrapping arithmetic."""
    x = pos.to(torch.int64) + _i64(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _i64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _i64(0x94D049BB133111EB)
    return (x ^ _shr(x, 31)) & MASK63


def pack_keys(u: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(u, position) as one int64 whose order is (u, position)'s; invalid (pos < 0) -> INT64_MIN."""
    u32 = u.to(torch.float32) + 0.0  # -0.0 -> +0.0: the CPU scan compares them as equal
    bits = u32.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in u, still signed
    key = ordered * (1 << 32) + pos.clamp(min=0)
    return torch.where(pos >= 0, key, torch.iinfo(torch.int64).min)


@triton.jit
def _rank_less(Z, VS, NZ, zrow, nzrow, rho, hi, LV, NP1):
    """Count and score sum of the items ranked better than rho among the first `hi` of the row."""
    lo = tl.zeros_like(hi)
    cnt = tl.zeros_like(hi)
    s = tl.zeros(hi.shape, tl.float64)
    for level in range(LV):
        off = zrow + level * NP1
        zlo = tl.load(Z + off + lo)
        zhi = tl.load(Z + off + hi)
        right = ((rho >> (LV - 1 - level)) & 1) == 1  # the 0-bit items here all rank better
        cnt += tl.where(right, zhi - zlo, 0)
        s += tl.load(VS + off + hi, mask=right, other=0.0) - tl.load(VS + off + lo, mask=right, other=0.0)
        nz = tl.load(NZ + nzrow + level)
        lo = tl.where(right, nz + lo - zlo, zlo)
        hi = tl.where(right, nz + hi - zhi, zhi)
    return cnt, s


@triton.jit
def _f_at(Z, VS, NZ, BPT, BPRV, BPRW, OCV, OSV, OCW, OSW, zrow, nzrow, brow, j, m, P, LV, NP1):
    """f(t_j) = sum clamp(u - t_j, 0, 1) over the query's candidates, and the pieces that make it."""
    t = tl.load(BPT + brow + j, mask=m, other=0.0)
    rv = tl.load(BPRV + brow + j, mask=m, other=0)
    rw = tl.load(BPRW + brow + j, mask=m, other=0)
    cv, sv = _rank_less(Z, VS, NZ, zrow, nzrow, rv, P, LV, NP1)  # u > t
    cw, sw = _rank_less(Z, VS, NZ, zrow, nzrow, rw, P, LV, NP1)  # u - 1 > t (saturated)
    cv += tl.load(OCV + brow + j, mask=m, other=0)
    sv += tl.load(OSV + brow + j, mask=m, other=0.0)
    cw += tl.load(OCW + brow + j, mask=m, other=0)
    sw += tl.load(OSW + brow + j, mask=m, other=0.0)
    f = sv - sw + cw.to(tl.float64) - t * (cv - cw).to(tl.float64)
    return f, t, cv, sv, cw, sw


@triton.jit
def _scan_queries_kernel(
    Z, VS, HS, NZ,  # wavelet matrix
    BPT, BPRV, BPRW, OCV, OSV, OCW, OSW,  # breakpoints [B, NBP]
    PREF, NCAND,  # per query [B, NQ]: visible prefix length, candidate count
    RANK, TAU, NACT, HBELOW,  # outputs [B, NQ]
    NQ, NP1, LV, NBP, NIT, TOPK,
    BQ: tl.constexpr,
):
    b = tl.program_id(1)
    qs = tl.program_id(0) * BQ + tl.arange(0, BQ)
    qm = qs < NQ
    row = b.to(tl.int64) * NQ
    P = tl.load(PREF + row + qs, mask=qm, other=0)
    ncand = tl.load(NCAND + row + qs, mask=qm, other=0)
    zrow = b.to(tl.int64) * LV * NP1
    nzrow = b * LV
    brow = b.to(tl.int64) * NBP

    # theta: the TOPK-th best rank among the first P items.
    has = qm & (P >= TOPK)  # (TOPK > 0: the host skips k = 0)
    hi = tl.where(has, P, 0)
    lo = tl.zeros_like(hi)
    r = tl.zeros_like(hi) + TOPK - 1
    res = tl.zeros_like(hi)
    hsum = tl.zeros([BQ], tl.int64)
    for level in range(LV):
        off = zrow + level * NP1
        zlo = tl.load(Z + off + lo)
        zhi = tl.load(Z + off + hi)
        zc = zhi - zlo
        right = r >= zc
        r = tl.where(right, r - zc, r)
        res = res | (right.to(tl.int32) << (LV - 1 - level))
        hsum += tl.load(HS + off + hi, mask=right, other=0) - tl.load(HS + off + lo, mask=right, other=0)
        nz = tl.load(NZ + nzrow + level)
        lo = tl.where(right, nz + lo - zlo, zlo)
        hi = tl.where(right, nz + hi - zhi, zhi)
    tl.store(RANK + row + qs, tl.where(has, res, -1), mask=qm)
    tl.store(HBELOW + row + qs, hsum, mask=qm)

    # tau: the last breakpoint t_j with f(t_j) > TOPK, then the linear piece after it.
    need = qm & (ncand > TOPK)
    Pn = tl.where(need, P, 0)
    jlo = tl.zeros_like(P) - 1  # f(-inf) = #candidates > TOPK
    jhi = tl.zeros_like(P) + NBP
    for _ in range(NIT):
        active = need & (jhi - jlo > 1)
        mid = (jlo + jhi) // 2
        f, t, cv, sv, cw, sw = _f_at(Z, VS, NZ, BPT, BPRV, BPRW, OCV, OSV, OCW, OSW, zrow, nzrow, brow,
                                     mid, active, Pn, LV, NP1)
        gt = f > TOPK
        jlo = tl.where(active & gt, mid, jlo)
        jhi = tl.where(active, tl.where(gt, jhi, mid), jhi)
    j = tl.maximum(jlo, 0)
    f, t, cv, sv, cw, sw = _f_at(Z, VS, NZ, BPT, BPRV, BPRW, OCV, OSV, OCW, OSW, zrow, nzrow, brow,
                                 j, need, Pn, LV, NP1)
    n_frac = cv - cw
    tau = (sv - sw + cw.to(tl.float64) - TOPK) / tl.maximum(n_frac, 1).to(tl.float64)
    has_next = need & (j + 1 < NBP)
    t_next = tl.load(BPT + brow + j + 1, mask=has_next, other=float("inf"))
    tau = tl.minimum(tl.maximum(tau, t), t_next)
    # |A| = #{tau < u < tau + 1}: when tau lands on the next breakpoint, scores equal to it have
    # p = 0; the candidates with u > t_next are the fractional ones then.
    cv_next, _ = _rank_less(Z, VS, NZ, zrow, nzrow, tl.load(BPRV + brow + j + 1, mask=has_next, other=0), Pn, LV, NP1)
    cv_next += tl.load(OCV + brow + j + 1, mask=has_next, other=0)
    n_act = tl.where(tau == t_next, cv_next - cw, n_frac)
    tl.store(TAU + row + qs, tau, mask=qm)
    tl.store(NACT + row + qs, n_act.to(tl.int64), mask=qm)


def _count_sum_above(sorted_asc: torch.Tensor, csum: torch.Tensor, total_n: torch.Tensor, t: torch.Tensor):
    """How many of each row's sorted values (+inf padded) exceed t, and their sum."""
    idx = torch.minimum(torch.searchsorted(sorted_asc, t, right=True), total_n[:, None])  # values <= t
    return total_n[:, None] - idx, csum[:, -1:] - csum.gather(1, idx)


# On CUDA the scan's ~150 small launches cost more host time than GPU time: replay them as one CUDA
# graph per input shape (captured on first use; a trainer's chunks share one shape).
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
) -> DeviceScan:
    """scan.scan_chunk for one chunk, on u_ext's device; same results (tau up to rounding)."""
    inputs = dict(u_ext=u_ext.detach(), pos_ext=pos_ext, thr_u=thr_u, thr_count=thr_count, overflow=overflow,
                  seen=seen, lengths=lengths)
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
    for name, t in inputs.items():
        bufs[name].copy_(t)
    graph.replay()
    # The graph's outputs are overwritten by its next replay (the next layer): hand out copies.
    return DeviceScan(
        **{f: getattr(out, f).clone() for f in ("theta_u", "theta_pos", "tau", "n_active", "fingerprint",
                                                "block_pool", "final_pool")},
        threshold={name: t.clone() for name, t in out.threshold.items()},
    )


def _scan(u_ext, pos_ext, thr_u, thr_count, overflow, seen, lengths, n_queries, topk, window, block) -> DeviceScan:
    """scan_chunk_device's work, launch by launch."""
    B, N = u_ext.shape
    K, L = topk, n_queries
    dev = u_ext.device
    i64 = dict(dtype=torch.int64, device=dev)
    cap = thr_u.shape[1]
    ar_n = torch.arange(N, **i64)

    # Items: keys, ranks, scores, hashes.
    valid = pos_ext >= 0  # [B, N]
    keys = pack_keys(u_ext.detach(), pos_ext)
    _, by_rank = keys.sort(dim=1, descending=True)  # [B, N]: item at each rank
    rank = torch.empty_like(by_rank).scatter_(1, by_rank, ar_n.expand(B, N))  # [B, N]
    n_real = valid.sum(1)  # [B]
    score = torch.where(valid, u_ext.detach().to(torch.float32).to(torch.float64), 0.0)  # [B, N]
    hashes = torch.where(valid, position_hash_tensor(pos_ext), 0)
    wm: WaveletMatrix = build_wavelet(rank, score, hashes)
    real_rank = ar_n[None] < n_real[:, None]  # [B, N]: ranks held by real items
    s_score = torch.where(real_rank, score.gather(1, by_rank), -INF)  # [B, N] descending
    s_pos = pos_ext.gather(1, by_rank)
    s_hash = hashes.gather(1, by_rank)

    # Breakpoints of every f_i: u and u - 1 of the items and of the carried state, ascending.
    thr_ok = torch.arange(cap, **i64)[None] < thr_count[:, None]  # [B, cap]
    carried = torch.where(thr_ok, thr_u, INF)
    items = torch.where(valid, score, INF)
    bpt = torch.cat([items, items - 1, carried, carried - 1], 1).sort(dim=1).values  # [B, NBP]
    bpt = bpt.nan_to_num(posinf=torch.finfo(torch.float64).max)  # padding: finite, so f = 0 there (not NaN)
    NBP = bpt.shape[1]
    neg = -s_score  # ascending, +inf on empty ranks
    bprv = torch.searchsorted(neg.contiguous(), -bpt, right=False)  # items with u > t: ranks < bprv
    bprw = torch.searchsorted((neg + 1).contiguous(), -bpt, right=False)  # items with u - 1 > t
    # The wavelet counts the pool (for theta); tau's candidates are the carried state instead.
    pool_ok = valid[:, :K]
    pool_s = torch.where(pool_ok, score[:, :K], INF).sort(dim=1).values
    carried_s = carried.sort(dim=1).values
    ocv, osv, ocw, osw = 0, 0, 0, 0
    for sorted_s, n, sign in ((carried_s, thr_count, 1), (pool_s, pool_ok.sum(1), -1)):
        csum = torch.nn.functional.pad(torch.where(sorted_s < INF, sorted_s, 0.0).cumsum(1), (1, 0))
        cv, sv = _count_sum_above(sorted_s.contiguous(), csum, n, bpt)
        cw, sw = _count_sum_above((sorted_s - 1).contiguous(), csum, n, bpt)
        ocv, osv, ocw, osw = ocv + sign * cv, osv + sign * sv, ocw + sign * cw, osw + sign * sw

    # Queries: c = 0..L-1 of the chunk, then c = L for the state after it.
    delta = 1 if window == 0 else 0  # query c sees the first c + delta stream items (tail, chunk)
    c = torch.arange(L + 1, **i64)
    n_vis = torch.where(c[None] < L, c[None] + delta, lengths[:, None])  # [B, L+1]
    n_vis = torch.minimum(n_vis, torch.full_like(n_vis, N - K))
    stream_real = torch.nn.functional.pad(valid[:, K:].to(torch.int64).cumsum(1), (1, 0))  # [B, N-K+1]
    lag = max(window, 1)
    ncand0 = (seen - lag + 1).clamp(min=0)
    ncand = ncand0[:, None] + stream_real.gather(1, n_vis)
    prefix = (K + n_vis).to(torch.int32)

    NQ = L + 1
    q_rank = torch.empty(B, NQ, dtype=torch.int32, device=dev)
    q_tau = torch.empty(B, NQ, dtype=torch.float64, device=dev)
    q_nact = torch.empty(B, NQ, **i64)
    q_hbelow = torch.empty(B, NQ, **i64)
    BQ = 128
    nit = max(1, int(NBP).bit_length())  # halvings of the interval (-1, NBP)
    if K == 0:  # nothing is selected: no theta, tau = +inf
        q_rank.fill_(-1), q_hbelow.zero_(), q_nact.zero_(), q_tau.fill_(INF)
    else:
        _scan_queries_kernel[(triton.cdiv(NQ, BQ), B)](
            wm.zeros, wm.score_sum, wm.hash_sum, wm.n_zeros,
            bpt, bprv.to(torch.int32), bprw.to(torch.int32),
            ocv.to(torch.int32), osv, ocw.to(torch.int32), osw,
            prefix.contiguous(), ncand.contiguous(),
            q_rank, q_tau, q_nact, q_hbelow,
            NQ, N + 1, wm.levels, NBP, nit, K,
            BQ=BQ,
        )

    # theta, tau, |A|, fingerprint per query.
    q_rank = q_rank.to(torch.int64)
    has_theta = (q_rank >= 0) & (q_rank < n_real[:, None])
    rk = q_rank.clamp(0, N - 1)
    theta_u = torch.where(has_theta, s_score.gather(1, rk), -INF)
    theta_pos = torch.where(has_theta, s_pos.gather(1, rk), -1)
    all_hash = torch.nn.functional.pad(hashes.cumsum(1), (1, 0)).gather(1, prefix.to(torch.int64))
    fp = torch.where(has_theta, q_hbelow + s_hash.gather(1, rk), all_hash) & MASK63
    if K == 0:
        fp = torch.zeros_like(fp)
        tau = torch.full_like(q_tau, INF)
    else:
        tau = torch.where(ncand > K, q_tau, -INF)
    n_active = torch.where(ncand > K, q_nact, 0) if K > 0 else torch.zeros_like(q_nact)

    # The pool at each block start: the items ranked at or above that block's theta.
    nb = -(-L // block)
    block_pool, final_pool = _pools(rank, valid, q_rank, has_theta, lengths, K, L, N, nb, block, delta)

    # The threshold state after the chunk: carried and new scores above the final tau.
    thr = _next_threshold(score, valid, carried, lengths, tau[:, L], overflow, K, cap)

    qvalid = c[None, :L] < lengths[:, None]  # padded queries: nothing selected (ScanOutputs.empty)
    return DeviceScan(
        theta_u=torch.where(qvalid, theta_u[:, :L], INF),
        theta_pos=torch.where(qvalid, theta_pos[:, :L], INT64_MAX),
        tau=torch.where(qvalid, tau[:, :L], 0.0),
        n_active=torch.where(qvalid, n_active[:, :L], 0),
        fingerprint=torch.where(qvalid, fp[:, :L], 0),
        block_pool=block_pool,
        final_pool=final_pool,
        threshold=thr,
    )


def _pools(rank, valid, q_rank, has_theta, lengths, K, L, N, nb, block, delta):
    """Pools at block starts [B, nb, K] and after the chunk [B, K], as ext indices (-1 empty)."""
    B = rank.shape[0]
    dev = rank.device
    i64 = dict(dtype=torch.int64, device=dev)
    if K == 0:
        return torch.full((B, nb, 0), -1, **i64), torch.full((B, 0), -1, **i64)
    # Worst rank in each block's pool (everything visible when theta is undefined); -1 past the end.
    starts = torch.arange(nb, **i64) * block
    r_blk = torch.where(has_theta[:, starts], q_rank[:, starts], N)  # [B, nb]
    r_blk = torch.where(starts[None] < lengths[:, None], r_blk, -1)  # non-increasing along blocks
    # Item s joins the pool at the first block whose first query sees it, and leaves at the first
    # block whose pool ranks better than it: one interval of blocks [enter, leave).
    s = torch.arange(N, **i64)
    first_q = torch.where(s < K, 0, (s - K - delta + 1).clamp(min=0))  # [N]
    enter = (-(-first_q // block))[None].expand(B, N)
    leave = torch.searchsorted((-r_blk).contiguous(), (-rank).contiguous(), right=True)  # [B, N]
    count = torch.where(valid, (leave - enter).clamp(min=0), 0)  # [B, N] blocks in the pool
    # Stable slots, as the CPU scan's heap keeps them: a key keeps one slot while pooled, so the
    # kernels' backward walks the pool slot by slot.
    pooled = count > 0
    one = pooled.to(torch.int64)
    size = torch.zeros(B, nb + 1, **i64).scatter_add_(1, torch.where(pooled, enter, nb), one)
    size = size - torch.zeros(B, nb + 1, **i64).scatter_add_(1, torch.where(pooled, leave, nb), one)
    size = size.cumsum(1)[:, :nb]  # [B, nb] keys in the pool of each block: +1 at enter, -1 at leave
    slot = _slots_from_intervals(enter, leave - 1, pooled, size)  # [B, N]
    # Expand (item, block) pairs with a static size (a dummy item takes the slack: no host sync).
    count = count.reshape(-1)  # [B*N]
    total = B * nb * K
    reps = torch.cat([count, (total - count.sum()).reshape(1)])
    item = torch.repeat_interleave(torch.arange(B * N + 1, **i64), reps, output_size=total)
    start = torch.nn.functional.pad(reps.cumsum(0), (1, 0))[:-1]
    real = item < B * N
    it = item.clamp(max=B * N - 1)
    blk = enter.reshape(-1)[it] + torch.arange(total, **i64) - start[item]
    group = torch.where(real, (it // N) * nb + blk, B * nb)  # (row, block); the dummy to a spare row
    flat = torch.full((B * nb + 1, K), -1, **i64)
    flat[group, torch.where(real, slot.reshape(-1)[it], 0)] = it % N
    block_pool = flat[: B * nb].view(B, nb, K)
    # After the chunk: the top-k of everything, ascending ext indices.
    r_fin = torch.where(has_theta[:, L], q_rank[:, L], N)  # [B]
    member = valid & (rank <= r_fin[:, None]) & (s[None] < K + lengths[:, None])  # the last w-1: next tail
    slot = torch.where(member, member.cumsum(1) - 1, K)  # members in ext order; the rest to column K
    final_pool = torch.full((B, K + 1), -1, **i64).scatter_(1, slot, s[None].expand(B, N))[:, :K]
    return block_pool, final_pool


def _slots_from_intervals(
    first: torch.Tensor,  # [B, N] first block a key is pooled in (any value where not pooled)
    last: torch.Tensor,  # [B, N] last block it is pooled in
    inpool: torch.Tensor,  # [B, N] bool: pooled in some block
    count: torch.Tensor,  # [B, nb] pool size per block
) -> torch.Tensor:
    """[B, N] int64: the slot each pooled key keeps (garbage where not pooled).

    The slots the CPU heap hands out, from each key's block interval: at each block boundary the
    r-th key to enter takes the slot of the r-th key to leave, surplus entrants take fresh slots
    (the pool only grows until full). Slots follow the chains of predecessors by pointer jumping:
    O(log nb) gathers, no host synchronisation.
    """
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


def _next_threshold(score, valid, carried, lengths, tau_end, overflow, K, cap):
    """The next cache's threshold fields: every carried or new candidate score above tau_end."""
    B, N = score.shape
    s = torch.arange(N, device=score.device)
    new = valid & (s[None] >= K) & (s[None] < K + lengths[:, None])  # tail + valid chunk tokens
    cand = torch.cat([carried, torch.where(new, score, INF)], 1)  # +inf: no score
    keep = (cand < INF) & (cand > tau_end[:, None])  # k = 0: tau_end = +inf, nothing kept
    vals = torch.where(keep, cand, -INF).sort(dim=1, descending=True).values  # kept first
    count = keep.sum(1)
    width = max(cap, vals.shape[1])
    vals = torch.nn.functional.pad(vals, (0, width - vals.shape[1]), value=-INF)[:, :cap]
    kept = torch.arange(cap, device=score.device)[None] < count.clamp(max=cap)[:, None]
    thr_u = torch.where(kept, vals, 0.0)
    sat = kept & (thr_u - 1 >= tau_end[:, None])
    frac_sum = torch.where(kept & ~sat, thr_u, 0.0).sum(1)
    return dict(
        thr_u=thr_u,
        thr_saturated=sat,
        thr_count=count.clamp(max=cap),
        tau=tau_end if K > 0 else torch.full_like(tau_end, INF),
        thr_sum=frac_sum,
        overflow=overflow + (count - cap).clamp(min=0),  # the lowest scores were dropped: reported
    )
