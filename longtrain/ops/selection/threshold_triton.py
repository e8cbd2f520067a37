"""ThresholdFn's backward (threshold.py) in two launches: the plain version is some twenty small torch kernels a layer.

  _query_sums_kernel  per row: the queries' taus made non-decreasing (a running max) and the prefix sums of their
                      weights g_tau / |A| (float64), in tiles carried along the row;
  _key_grads_kernel   per key: the interval of queries whose active set holds it, by two binary searches over those
                      taus, and its gradient as a difference of two prefix sums.

The same arithmetic as threshold_grad_torch (threshold.py), which the CPU tests compare it with: the interval ends
are exact, the prefix sums float64 in another association (so the gradients agree to float64 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 1024  # queries per step of a row's running max and prefix sum (one program per row walks them)
KEYS = 256  # keys per program of the key kernel: programs for every SM at a chunk of 4096 x 4 rows


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _query_sums_kernel(tau_ptr, n_active_ptr, g_tau_ptr, lengths_ptr, tau_up_ptr, csum_ptr, n_queries,
                       BLOCK: tl.constexpr):
    """Row b: tau_up[b, i] = max(tau[b, :i + 1]) over valid queries (+inf from the row's length on) and
    csum[b, i + 1] = sum over queries q <= i of g_tau / |A| (0 for a padded query or an empty active set)."""
    b = tl.program_id(0)
    length = tl.load(lengths_ptr + b)
    run_max = tl.full([], float("-inf"), tl.float64)
    run_sum = tl.zeros([], tl.float64)
    tl.store(csum_ptr + b * (n_queries + 1), run_sum)
    for start in range(0, n_queries, BLOCK):
        i = start + tl.arange(0, BLOCK)
        im = i < n_queries
        qvalid = i < length
        tau = tl.load(tau_ptr + b * n_queries + i, mask=im, other=float("inf")).to(tl.float64)
        tau = tl.where(qvalid, tau, float("inf"))
        up = tl.maximum(tl.associative_scan(tau, 0, _max_combine), run_max)
        tl.store(tau_up_ptr + b * n_queries + i, up, mask=im)
        run_max = tl.max(up, 0)
        na = tl.load(n_active_ptr + b * n_queries + i, mask=im, other=0)
        g = tl.load(g_tau_ptr + b * n_queries + i, mask=im, other=0.0).to(tl.float64)
        w = tl.where(qvalid & (na > 0), g / tl.maximum(na, 1).to(tl.float64), 0.0)
        c = tl.cumsum(w, 0) + run_sum
        tl.store(csum_ptr + b * (n_queries + 1) + 1 + i, c, mask=im)
        run_sum = tl.sum(tl.where(i == start + BLOCK - 1, c, 0.0), 0)  # the tile's last sum (a partial tile is the last)


@triton.jit
def _first_above(tau_up_row_ptr, x, n_queries, STRICT: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Per key [BLOCK]: the first query q of the non-decreasing tau_up row with tau_up[q] > x (STRICT) or >= x,
    n_queries where there is none (torch.searchsorted with right=STRICT)."""
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + n_queries
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        live = lo < hi
        t = tl.load(tau_up_row_ptr + mid, mask=live, other=0.0)
        below = (t <= x) if STRICT else (t < x)
        lo = tl.where(live & below, mid + 1, lo)
        hi = tl.where(live & ~below, mid, hi)
    return lo


@triton.jit
def _key_grads_kernel(u_ptr, tau_up_ptr, csum_ptr, lengths_ptr, g_u_ptr, n_queries, window, STEPS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """g_u[b, c] = csum[end] - csum[start]: key c is active for the queries q in [start, end), those at least
    `window` after it whose tau_q < u_c < tau_q + 1 (one interval: tau_up does not decrease)."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1)
    cm = c < n_queries
    n = tl.load(lengths_ptr + b).to(tl.int32)
    u = tl.load(u_ptr + b * n_queries + c, mask=cm, other=0.0).to(tl.float64)
    row = tau_up_ptr + b * n_queries
    start = _first_above(row, u - 1.0, n_queries, True, STEPS, BLOCK)  # first q with tau_q > u - 1
    end = _first_above(row, u, n_queries, False, STEPS, BLOCK)  # first q with tau_q >= u
    start = tl.minimum(tl.maximum(start, c + window), n)
    end = tl.maximum(tl.minimum(end, n), start)
    crow = csum_ptr + b * (n_queries + 1)
    g = tl.load(crow + end, mask=cm, other=0.0) - tl.load(crow + start, mask=cm, other=0.0)
    tl.store(g_u_ptr + b * n_queries + c, g.to(g_u_ptr.dtype.element_ty), mask=cm)


def threshold_grad_triton(u: torch.Tensor, tau: torch.Tensor, n_active: torch.Tensor, lengths: torch.Tensor,
                          g_tau: torch.Tensor, window: int) -> torch.Tensor:
    """threshold.threshold_grad_torch in two launches: g_u [B, L] in u's dtype."""
    B, L = u.shape
    dev = u.device
    u, tau, n_active, g_tau = (t.contiguous() for t in (u, tau, n_active, g_tau))
    lengths = lengths.to(dev, torch.int64).contiguous()
    tau_up = torch.empty(B, L, dtype=torch.float64, device=dev)
    csum = torch.empty(B, L + 1, dtype=torch.float64, device=dev)
    g_u = torch.empty(B, L, dtype=u.dtype, device=dev)
    if L == 0:
        return g_u
    block, keys = min(TILE, triton.next_power_of_2(L)), min(KEYS, triton.next_power_of_2(L))
    _query_sums_kernel[(B,)](tau_ptr=tau, n_active_ptr=n_active, g_tau_ptr=g_tau, lengths_ptr=lengths,
                             tau_up_ptr=tau_up, csum_ptr=csum, n_queries=L, BLOCK=block, num_warps=4)
    _key_grads_kernel[(triton.cdiv(L, keys), B)](u_ptr=u, tau_up_ptr=tau_up, csum_ptr=csum, lengths_ptr=lengths,
                                                 g_u_ptr=g_u, n_queries=L, window=window, STEPS=L.bit_length(),
                                                 BLOCK=keys, num_warps=4)
    return g_u
