"""The selection scan on the tensors' own device (the GPU): naive.scan_chunk_naive's results without heaps.

The CPU scan (naive.py, compiled in host.py) walks the candidates one by one. Here every query
is answered on its own, in parallel, from structures built once per chunk, in a fixed sequence of
launches (device_kernels.py) and no host synchronisation:

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

import torch
import triton

from longtrain.ops.selection import device_kernels as kern
from longtrain.ops.selection.state import ExtendedScores, ScanResult, ThresholdState
from longtrain.ops.selection.wavelet import empty_wavelet_tree, merge_levels

TILE = 128  # entries (ranks, items) per program of the per-entry kernels: programs for every SM
PROBES = 1  # f evaluations per round of tau's search (a power of two; 1: binary, the least work)
INF = float("inf")
INT64_MAX = (1 << 63) - 1


# On CUDA the scan's launches cost more host time than GPU time: replay them as one CUDA graph per
# input shape (captured on first use; a trainer's chunks share one shape).
CUDA_GRAPHS = True
_MAX_GRAPHS = 8
_graphs: dict = {}


def scan_chunk_device(keys: ExtendedScores, state: ThresholdState, *, window: int, block: int) -> ScanResult:
    """naive.scan_chunk_naive for one chunk, on the keys' device; the same results (tau up to rounding)."""
    inputs = dict(u_ext=keys.u.detach(), pos_ext=keys.pos, thr_u=state.thr_u, thr_count=state.thr_count,
                  overflow=state.overflow, seen=keys.seen, lengths=keys.lengths, tau_prev=state.tau.to(torch.float64))
    static = dict(n_queries=keys.n_queries, topk=keys.topk, window=window, block=block)
    if not (CUDA_GRAPHS and keys.u.is_cuda) or torch.cuda.is_current_stream_capturing():
        return _scan(**inputs, **static)  # inside a capture (the trainer's chunk graph) the launches are recorded there
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
    return out.clone()  # the graph's next replay (the next layer) overwrites its outputs: one copy of them all


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
    kern.keys_kernel[(triton.cdiv(NM, TILE), B)](U=u_ext, POS=pos_ext, THR=thr_u, THR_COUNT=thr_count, KEYS=keys, N=N,
                                                 NM=NM, CAP=thr_u.shape[1], BLK=TILE)
    return keys.sort(dim=1, stable=True)


def _scan(u_ext, pos_ext, thr_u, thr_count, overflow, seen, lengths, tau_prev, n_queries, topk, window,
          block) -> ScanResult:
    """scan_chunk_device's work: a fixed sequence of launches, no host synchronisation."""
    B, N = u_ext.shape
    K, L, cap = topk, n_queries, thr_u.shape[1]
    nb = -(-L // block)
    dev = u_ext.device
    if K == 0:
        return _nothing_selected(B, L, nb, thr_u, overflow, lengths)
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
    tot, tots = new(B, kern.N_TOT.value, NT), new(B, NT, dtype=torch.float64)  # per-tile totals
    kern.ranked_kernel[grid](SKEYS=keys, SIDX=kidx, POS=pos_ext, BY_RANK=by_rank, RANK_OF=rank_of, SCORE=score,
                             ORD=tree.order, SS=tree.score_sum, HS=tree.hash_sum, LEAF_OFF=LV * NM,
                             TREE_ROW=(LV + 1) * NM, NVALID=nvalid, TOT=tot, TOTS=tots, N=N, NM=NM, K=K, NT=NT, BLK=TILE)
    merge_levels(tree)

    # tau's breakpoints and f's offsets (carried entries in, pool items out).
    cc, cs = new(B, NM + 1), new(B, NM + 1, dtype=torch.float64)
    bpt, bprv, bprw = new(B, 2 * NM, dtype=torch.float64), new(B, 2 * NM), new(B, 2 * NM)
    kern.breakpoints_kernel[grid](SCORE=score, BY_RANK=by_rank, NVALID=nvalid, TOT=tot, TOTS=tots, CC=cc, CS=cs, BPT=bpt,
                                  BPRV=bprv, BPRW=bprw, N=N, NM=NM, K=K, NT=NT, ITERS=NM.bit_length(), NTP=NTP,
                                  BLK=TILE)

    # Every query, and the state after the chunk (c = L).
    out = ScanResult.allocate(B, L, nb, K, cap, dev)
    thr = out.threshold
    theta_u, tau, theta_pos, n_active, fp = out.theta_u, out.tau, out.theta_pos, out.n_active, out.fingerprint
    qrank, tau_end = new(B, L + 1), new(B, dtype=torch.float64)
    bq = 64 if B * (L + 1) >= 64 * 256 else 32  # small rows: more, smaller programs
    kern.queries_kernel[(triton.cdiv(L + 1, bq), B)](
        LEFT=tree.left, HS=tree.hash_sum, BPT=bpt, BPRV=bprv, BPRW=bprw, CC=cc, CS=cs, SCORE=score, BY_RANK=by_rank,
        POS=pos_ext, NVALID=nvalid, SEEN=seen, LENGTHS=lengths, TAU_PREV=tau_prev, THETA_U=theta_u,
        THETA_POS=theta_pos, TAU=tau, NACT=n_active, FP=fp, QRANK=qrank, TAU_END=tau_end, N=N, NM=NM, K=K, L=L,
        LV=LV, NIT=_search_rounds(2 * NM, PROBES), DELTA=delta, LAG=lag, BQ=bq, NP=PROBES, num_warps=bq // 32,
    )

    # The pools: item s is pooled in the blocks [enter, leave); stable slots; then the expansion.
    count, member, flags_r = new(B, N), new(B, N, dtype=torch.int8), new(B, NM, dtype=torch.int8)
    kern.pool_flags_kernel[grid](POS=pos_ext, RANK_OF=rank_of, BY_RANK=by_rank, SCORE=score, QRANK=qrank, NVALID=nvalid,
                                 LENGTHS=lengths, TAU_END=tau_end, COUNT=count, MEMBER=member, FLAGS_R=flags_r, TOT=tot,
                                 N=N, NM=NM, K=K, L=L, NB=nb, BLOCK=block, DELTA=delta, NT=NT,
                                 ITERS=max(1, nb.bit_length()), BLK=TILE)
    pe, cp, pr, lseq = new(B, N + 1), new(B, N + 1), new(B, NM + 1), new(B, N)
    final_pool, thr_out = out.final_pool, thr.thr_u
    kern.pool_scan_kernel[grid](COUNT=count, MEMBER=member, FLAGS_R=flags_r, BY_RANK=by_rank, SCORE=score, TOT=tot,
                                PE=pe, CP=cp, PR=pr, LSEQ=lseq, FINAL=final_pool, THR_U=thr_out, N=N, NM=NM, K=K,
                                CAP=cap, NT=NT, NTP=NTP, BLK=TILE)
    grid_n = (triton.cdiv(N, TILE), B)
    ptr, root_slot, slot = new(B, N), new(B, N), new(B, N)
    kern.slot_pred_kernel[grid_n](COUNT=count, PE=pe, PR=pr, LSEQ=lseq, QRANK=qrank, LENGTHS=lengths, PTR=ptr,
                                  ROOT_SLOT=root_slot, N=N, NM=NM, K=K, L=L, BLOCK=block, DELTA=delta, BLK=TILE)
    jumps = 1  # a chain of keys sharing a slot has at most nb - 1 links: 16 per link of 16 per launch
    while 16**jumps < nb - 1:
        jumps += 1
    other = torch.empty_like(ptr)
    for i in range(jumps):
        kern.slot_jump_kernel[grid_n](COUNT=count, PTR_IN=ptr, PTR_OUT=other, ROOT_SLOT=root_slot, SLOT=slot, N=N,
                                      STEPS=16, FINAL=i == jumps - 1, BLK=TILE)
        ptr, other = other, ptr
    block_pool = out.block_pool.fill_(-1)
    if nb > 0:
        kern.expand_pools_kernel[(triton.cdiv(nb * K, TILE), B)](CP=cp, SLOT=slot, BLOCK_POOL=block_pool, N=N, K=K, NB=nb,
                                                                 BLOCK=block, DELTA=delta, ITERS=max(1, N.bit_length()),
                                                                 BLK=TILE)

    # The next threshold state: the carried and new scores above tau after the chunk, descending.
    kern.finish_kernel[(B,)](TOT=tot, TAU_END=tau_end, OVERFLOW=overflow.contiguous(), THR_U=thr_out,
                             THR_SAT=thr.thr_saturated.view(torch.uint8), THR_COUNT=thr.thr_count, THR_TAU=thr.tau,
                             THR_SUM=thr.thr_sum, OVERFLOW_OUT=thr.overflow, FINAL=final_pool, K=K, CAP=cap, NT=NT,
                             NTP=NTP, BLK=1024)
    return out


def _nothing_selected(B, L, nb, thr_u, overflow, lengths) -> ScanResult:
    """k = 0: a sliding window only; no theta, tau = +inf, empty pools, no threshold state."""
    dev = thr_u.device
    qvalid = torch.arange(L, device=dev)[None] < lengths[:, None]  # padded queries: as the host scans
    zeros = torch.zeros(B, L, dtype=torch.int64, device=dev)
    return ScanResult(
        theta_u=torch.where(qvalid, -INF, INF).to(torch.float64),
        theta_pos=torch.where(qvalid, -1, INT64_MAX),
        tau=torch.where(qvalid, INF, 0.0).to(torch.float64),
        n_active=zeros,
        fingerprint=zeros.clone(),
        block_pool=torch.full((B, nb, 0), -1, dtype=torch.int64, device=dev),
        final_pool=torch.full((B, 0), -1, dtype=torch.int64, device=dev),
        threshold=ThresholdState(
            thr_u=torch.zeros_like(thr_u, dtype=torch.float64),
            thr_saturated=torch.zeros(thr_u.shape, dtype=torch.bool, device=dev),
            thr_count=torch.zeros(B, dtype=torch.int64, device=dev),
            tau=torch.full((B,), INF, dtype=torch.float64, device=dev),
            thr_sum=torch.zeros(B, dtype=torch.float64, device=dev),
            overflow=overflow.clone(),
        ),
    )
