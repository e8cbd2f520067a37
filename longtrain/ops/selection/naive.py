"""The selection scan's reference (the paper's Algorithm 2): plain-Python heaps, one candidate at a time.

For scores u and window w, query i has candidates C_i = {j : j <= i - w}. For every query the scan
gives the k-th largest candidate (theta_i, as a value and a position: ties go to the larger
position), the SparseK threshold tau_i over C_i, and the active-set size |A_i|; at the start of
every query block it gives the top-k set (the block's pool).

Irreversibility makes one pass enough: tau and theta never decrease, so a score at or below tau is
dropped for good, and a candidate evicted from the top-k never returns. The state kept between
steps is a min-heap of the top-k (value, position) pairs and the scores still above tau, split into
saturated (p = 1) and fractional (0 < p < 1) min-heaps with the running sum of the fractional ones.
Each new candidate costs O(log k) amortised; the state can be carried across chunks exactly.

host.py compiles the same algorithm (numba) and device.py computes the same results without heaps;
all three take and return the same arrays (state.py), and the tests hold them equal to this one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from longtrain.ops.selection.state import ExtendedScores, ScanResult, ThresholdState

_MASK63 = (1 << 63) - 1
INF = math.inf
INT64_MAX = (1 << 63) - 1


def position_hash(pos: int) -> int:
    """splitmix64 of a position, as a non-negative int64: their sum mod 2**63 fingerprints a set.

    A sum (not XOR) so that a set's fingerprint is a prefix-sum difference on the GPU scan."""
    x = (pos + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _MASK63


@dataclass
class RowState:
    """One row's selection state, ready for the next candidate."""

    topk_heap: list  # min-heap of (u, pos, ext_index, slot): the current top-k candidates
    sat: list  # min-heap of saturated scores (u >= tau + 1)
    frac: list  # min-heap of fractional scores (tau < u < tau + 1)
    frac_sum: float
    tau: float
    n_cand: int  # candidates inserted so far
    overflow: int  # scores dropped because the state was full
    fingerprint: int  # sum mod 2**63 of position_hash over the top-k set


class RowScanner:
    """Inserts candidates one at a time and reads theta / tau / |A| after each."""

    def __init__(self, topk: int, cap: int, state: RowState):
        self.k = topk
        self.cap = cap
        self.s = state

    def insert(self, val: float, pos: int, ext: int) -> None:
        s, k = self.s, self.k
        s.n_cand += 1
        # Top-k by (value, position): the heap's minimum is theta.
        h = s.topk_heap
        if len(h) < k:
            heapq.heappush(h, (val, pos, ext, len(h)))  # a fresh slot while the pool grows
            s.fingerprint = (s.fingerprint + position_hash(pos)) & _MASK63
        elif k > 0 and (val, pos) > (h[0][0], h[0][1]):
            old = heapq.heapreplace(h, (val, pos, ext, h[0][3]))  # the newcomer takes the evicted key's slot
            s.fingerprint = (s.fingerprint - position_hash(old[1]) + position_hash(pos)) & _MASK63
        # Threshold state: scores at or below tau never matter again.
        if val <= s.tau:
            return
        if val >= s.tau + 1:
            heapq.heappush(s.sat, val)
        else:
            heapq.heappush(s.frac, val)
            s.frac_sum += val
        if len(s.sat) + len(s.frac) > self.cap:
            # Out of room: drop the lowest fractional score. tau is no longer exact; counted.
            if s.frac:
                s.frac_sum -= heapq.heappop(s.frac)
                s.overflow += 1
        if s.n_cand > k:
            self._solve()

    def _solve(self) -> None:
        """Raise tau until sum_j clamp(u_j - tau, 0, 1) = k, walking the breakpoints upwards."""
        s, k = self.s, self.k
        sat, frac = s.sat, s.frac
        tau = s.tau
        while True:
            n1, n2 = len(sat), len(frac)
            b_frac = frac[0] if frac else INF  # a fractional score drops to 0 at tau = u
            b_sat = sat[0] - 1 if sat else INF  # a saturated score turns fractional at tau = u - 1
            b = min(b_frac, b_sat)
            f_b = n1 + s.frac_sum - n2 * b if n2 else float(n1)
            if b < INF and f_b > k:
                if b_frac <= b_sat:
                    s.frac_sum -= heapq.heappop(frac)
                else:
                    v = heapq.heappop(sat)
                    heapq.heappush(frac, v)
                    s.frac_sum += v
                tau = max(tau, b)
                continue
            if n2:
                tau = max(tau, (s.frac_sum + n1 - k) / n2)
            break
        s.tau = tau
        while frac and frac[0] <= tau:  # exactly at tau: p = 0, and never again above it
            s.frac_sum -= heapq.heappop(frac)
        if not frac:
            s.frac_sum = 0.0  # re-anchor the running sum so rounding never accumulates

    def theta(self) -> tuple[float, int]:
        h = self.s.topk_heap
        if len(h) < self.k or self.k == 0:
            return -INF, -1  # every candidate is selected (or none exist)
        return h[0][0], h[0][1]


def _row_state(pool_u: list, pool_pos: list, thr_u: list, saturated: list, count: int, tau: float,
               thr_sum: float, overflow: int, n_cand: int) -> RowState:
    """One row's heaps from the state's arrays. The pool sits in ext slots 0..K-1; its keys take pool
    slots 0..n-1 in that order (the scan hands out n, n+1, ... while the pool grows)."""
    valid = [s for s in range(len(pool_pos)) if pool_pos[s] >= 0]
    heap = sorted((pool_u[s], pool_pos[s], s, slot) for slot, s in enumerate(valid))  # a sorted list is a heap
    fingerprint = 0
    for _, p, _, _ in heap:
        fingerprint = (fingerprint + position_hash(p)) & _MASK63
    vals, flags = thr_u[:count], saturated[:count]
    return RowState(
        topk_heap=heap,
        sat=sorted(v for v, f in zip(vals, flags) if f),
        frac=sorted(v for v, f in zip(vals, flags) if not f),
        frac_sum=thr_sum,
        tau=tau,
        n_cand=n_cand,
        overflow=overflow,
        fingerprint=fingerprint,
    )


def scan_chunk_naive(keys: ExtendedScores, state: ThresholdState, *, window: int, block: int) -> ScanResult:
    """theta, tau, |A| and the fingerprint of every query of the chunk, the pool at every block start,
    and the threshold state after the chunk, continuing from `state`; on the keys' device."""
    B, L, K = keys.u.shape[0], keys.n_queries, keys.topk
    u_ext = keys.u.detach().to("cpu", torch.float64).tolist()
    pool_pos = keys.pos[:, :K].tolist()
    seen, lengths = keys.seen.tolist(), keys.lengths.tolist()
    thr_u, saturated = state.thr_u.tolist(), state.thr_saturated.tolist()
    count, tau0, thr_sum, overflow = (x.tolist() for x in (state.thr_count, state.tau, state.thr_sum, state.overflow))
    out = ScanResult.allocate(B, L, -(-L // block), K, state.cap, "cpu")
    nxt_state = out.threshold
    # numpy views of the outputs; padded queries keep: nothing selected
    theta_u, theta_pos, tau, n_active, fps, block_pool, final_pool, thr_next, sat_next = (
        x.numpy() for x in (out.theta_u, out.theta_pos, out.tau, out.n_active, out.fingerprint, out.block_pool,
                            out.final_pool, nxt_state.thr_u, nxt_state.thr_saturated))
    theta_u.fill(INF)
    theta_pos.fill(INT64_MAX)
    for x in (tau, n_active, fps, thr_next, sat_next):
        x.fill(0)
    block_pool.fill(-1)
    final_pool.fill(-1)
    lag = max(window, 1)  # after [0, t) the candidates are the positions <= t - lag
    for b in range(B):
        t0, n = int(seen[b]), int(lengths[b])
        st = _row_state(u_ext[b][:K], pool_pos[b], thr_u[b], saturated[b], count[b], tau0[b], thr_sum[b],
                        overflow[b], n_cand=max(0, t0 - lag + 1))
        sc = RowScanner(K, state.cap, st)
        base = keys.first_query - t0  # ext index = base + position, for tail and chunk
        u_row = u_ext[b]
        nxt = max(0, t0 - lag + 1)  # next candidate position
        for c in range(n):
            last = t0 + c - window  # query t0 + c sees candidates <= last
            while nxt <= last:
                e = base + nxt
                sc.insert(u_row[e], nxt, e)
                nxt += 1
            if c % block == 0:
                for _, _, e, slot in st.topk_heap:  # stable slots: a key never moves while pooled
                    block_pool[b, c // block, slot] = e
            theta_u[b, c], theta_pos[b, c] = sc.theta()
            tau[b, c] = st.tau if K > 0 else INF
            n_active[b, c] = len(st.frac) if K > 0 else 0  # k = 0: nothing is selected
            fps[b, c] = st.fingerprint
        # Prepare for the next chunk: candidates up to t - lag join now.
        while nxt <= t0 + n - lag:
            e = base + nxt
            sc.insert(u_row[e], nxt, e)
            nxt += 1
        final = sorted(e for (_, _, e, _) in st.topk_heap)
        final_pool[b, : len(final)] = final
        kept = st.sat + st.frac
        thr_next[b, : len(kept)] = kept
        sat_next[b, : len(st.sat)] = True
        nxt_state.thr_count[b] = len(kept)
        nxt_state.tau[b], nxt_state.thr_sum[b], nxt_state.overflow[b] = st.tau, st.frac_sum, st.overflow
    return out.to(keys.u.device)
