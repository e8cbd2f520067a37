"""The selection scan (the paper's Algorithm 2): exact prefix thresholds on the CPU with heaps.

For scores u and window w, query i has candidates C_i = {j : j <= i - w}. For every query the scan
gives the k-th largest candidate (theta_i, as a value and a position: ties go to the larger
position), the SparseK threshold tau_i over C_i, and the active-set size |A_i|; at the start of
every query block it gives the top-k set (the block's pool).

Irreversibility makes one pass enough: tau and theta never decrease, so a score at or below tau is
dropped for good, and a candidate evicted from the top-k never returns. The state kept between
steps is a min-heap of the top-k (value, position) pairs and the scores still above tau, split into
saturated (p = 1) and fractional (0 < p < 1) min-heaps with the running sum of the fractional ones.
Each new candidate costs O(log k) amortised; the state can be carried across chunks exactly.

tau's gradient (Appendix A.3): d tau_i / d u_j = 1 / |A_i| for j in the active set A_i. Because tau
is non-decreasing, the queries whose active set holds a key j form one interval, so the backward is
a prefix sum over queries, not a scatter.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch

_MASK63 = (1 << 63) - 1
INF = math.inf


def position_hash(pos: int) -> int:
    """splitmix64 of a position, as a non-negative int64: their sum mod 2**63 fingerprints a set.

    A sum (not XOR) so that a set's fingerprint is a prefix-sum difference on the GPU scan."""
    x = (pos + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _MASK63


def default_threshold_cap(topk: int) -> int:
    """Room for the scores above tau: at most k are saturated, the fractional set is a few k."""
    return max(8 * topk, 1024)


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


@dataclass
class ScanResult:
    """Per query of a chunk (padded queries: nothing selected) and per query block."""

    theta_u: torch.Tensor  # [B, L] float64, the k-th largest candidate score (-inf: all selected)
    theta_pos: torch.Tensor  # [B, L] int64, its position (ties: larger position wins)
    tau: np.ndarray  # [B, L] float64, SparseK threshold over C_i (-inf while |C_i| <= k)
    n_active: np.ndarray  # [B, L] int64, |A_i|
    fingerprint: torch.Tensor  # [B, L] int64, hash of S_i
    block_pool: torch.Tensor  # [B, n_blocks, K] int64, pool at each block start (ext indices, -1 empty), stable slots
    final_pool: list  # per row: ext indices of the top-k after the chunk
    states: list  # per row: RowState after the chunk


@dataclass
class ScanOutputs:
    """The per-query and per-block arrays a scan fills (padded queries keep: nothing selected)."""

    theta_u: np.ndarray  # [B, L]
    theta_pos: np.ndarray  # [B, L]
    tau: np.ndarray  # [B, L]
    n_active: np.ndarray  # [B, L]
    fingerprint: np.ndarray  # [B, L]
    block_pool: np.ndarray  # [B, n_blocks, K]
    final_pool: list

    @classmethod
    def empty(cls, B: int, L: int, topk: int, block: int) -> "ScanOutputs":
        nb = -(-L // block)
        return cls(
            theta_u=np.full((B, L), INF),
            theta_pos=np.full((B, L), np.iinfo(np.int64).max, dtype=np.int64),
            tau=np.zeros((B, L)),
            n_active=np.zeros((B, L), dtype=np.int64),
            fingerprint=np.zeros((B, L), dtype=np.int64),
            block_pool=np.full((B, nb, topk), -1, dtype=np.int64),
            final_pool=[],
        )

    def arrays(self):
        return self.theta_u, self.theta_pos, self.tau, self.n_active, self.fingerprint, self.block_pool

    def result(self, states: list[RowState]) -> ScanResult:
        return ScanResult(
            theta_u=torch.from_numpy(self.theta_u),
            theta_pos=torch.from_numpy(self.theta_pos),
            tau=self.tau,
            n_active=self.n_active,
            fingerprint=torch.from_numpy(self.fingerprint),
            block_pool=torch.from_numpy(self.block_pool),
            final_pool=self.final_pool,
            states=states,
        )


@dataclass
class DeviceScan:
    """What the op needs from either scan, on the call's device: per-query arrays, pools, next threshold state."""

    theta_u: torch.Tensor  # [B, L] float64
    theta_pos: torch.Tensor  # [B, L] int64
    tau: torch.Tensor  # [B, L] float64
    n_active: torch.Tensor  # [B, L] int64
    fingerprint: torch.Tensor  # [B, L] int64
    block_pool: torch.Tensor  # [B, n_blocks, K] int64 ext indices (-1 empty) in stable slots: a key never moves while pooled
    final_pool: torch.Tensor  # [B, K] int64 ext indices of the top-k after the chunk, ascending (-1 empty)
    threshold: dict  # thr_u, thr_saturated, thr_count, tau, thr_sum, overflow of the next cache


def scan_chunk(
    u_ext: np.ndarray,  # [B, N] float64 scores in the extended layout
    pos_ext: np.ndarray,  # [B, N] int64 positions (-1: empty slot)
    states: list[RowState],
    *,
    seen: np.ndarray,  # [B] tokens processed before this chunk
    lengths: np.ndarray,  # [B] valid queries in this chunk
    n_queries: int,  # L
    topk: int,
    window: int,
    cap: int,
    block: int,
    ext_of_first_chunk_token: int,  # ext index of position `seen` (K + tail slots)
) -> ScanResult:
    """Run the scan over one chunk for every row, continuing from `states`."""
    B = u_ext.shape[0]
    out = ScanOutputs.empty(B, n_queries, topk, block)
    theta_u, theta_pos, tau, n_active, fps, block_pool = out.arrays()
    lag = max(window, 1)  # after [0, t) the candidates are the positions <= t - lag
    for b in range(B):
        t0, n = int(seen[b]), int(lengths[b])
        sc = RowScanner(topk, cap, states[b])
        base = ext_of_first_chunk_token - t0  # ext index = base + position, for tail and chunk
        u_row = u_ext[b].tolist()
        nxt = max(0, t0 - lag + 1)  # next candidate position
        for c in range(n):
            last = t0 + c - window  # query t0 + c sees candidates <= last
            while nxt <= last:
                e = base + nxt
                sc.insert(u_row[e], nxt, e)
                nxt += 1
            if c % block == 0:
                for _, _, e, slot in sc.s.topk_heap:  # stable slots: a key never moves while pooled
                    block_pool[b, c // block, slot] = e
            theta_u[b, c], theta_pos[b, c] = sc.theta()
            tau[b, c] = sc.s.tau if topk > 0 else INF
            n_active[b, c] = len(sc.s.frac) if topk > 0 else 0  # k = 0: nothing is selected
            fps[b, c] = sc.s.fingerprint
        # Prepare for the next chunk: candidates up to t - lag join now.
        while nxt <= t0 + n - lag:
            e = base + nxt
            sc.insert(u_row[e], nxt, e)
            nxt += 1
        out.final_pool.append([e for (_, _, e, _) in sc.s.topk_heap])
    return out.result(states)


class ThresholdFn(torch.autograd.Function):
    """tau as a differentiable function of the chunk's scores u [B, L].

    Forward returns the scan's tau; backward sends dL/dtau_i to the active keys of query i with
    weight 1/|A_i|. Cached keys (previous chunks) are detached, so only this chunk's keys get a
    gradient: key c (a chunk position) is active for the queries q >= c + window with
    tau_q < u_c < tau_q + 1, one interval of queries because tau is non-decreasing.
    """

    @staticmethod
    def forward(ctx, u: torch.Tensor, tau: torch.Tensor, n_active: torch.Tensor, lengths: torch.Tensor, window: int):
        ctx.window = window
        ctx.save_for_backward(u, tau, n_active, lengths)
        return tau.to(u.dtype)

    @staticmethod
    def backward(ctx, g_tau: torch.Tensor):
        u, tau, n_active, lengths = ctx.saved_tensors
        B, L = u.shape
        idx = torch.arange(L, device=u.device)
        qvalid = idx[None, :] < lengths[:, None]
        tau64 = torch.where(qvalid, tau, torch.full_like(tau, INF))  # padded queries never match
        tau64 = torch.cummax(tau64, dim=1).values  # exact arithmetic already has it sorted
        w = torch.where(n_active > 0, g_tau.to(torch.float64) / n_active.clamp(min=1), torch.zeros_like(tau64))
        w = torch.where(qvalid, w, torch.zeros_like(w))
        csum = torch.nn.functional.pad(w.cumsum(1), (1, 0))  # [B, L+1]
        u64 = u.detach().to(torch.float64)
        start = torch.searchsorted(tau64, u64 - 1, right=True)  # first q with tau_q > u - 1
        end = torch.searchsorted(tau64, u64, right=False)  # first q with tau_q >= u
        n = lengths[:, None].expand(B, L)
        start = torch.minimum(torch.maximum(start, idx[None, :] + ctx.window), n)
        end = torch.maximum(torch.minimum(end, n), start)
        g_u = csum.gather(1, end) - csum.gather(1, start)
        return g_u.to(u.dtype), None, None, None, None
