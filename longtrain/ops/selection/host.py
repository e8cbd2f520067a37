"""The selection scan compiled with numba: naive.py's algorithm, about 19x faster (benchmarks/scan.py).

Same signature and result as `naive.scan_chunk_naive` (the plain-Python reference beside it, which the
tests compare this against). The heaps live in numpy arrays: the top-k as a min-heap of
(value, position, ext index, pool slot) ordered by (value, position), the saturated and fractional
scores as min-heaps of floats, all built from the state's arrays (state.py) at the chunk's start and
written back at its end. The arrays cross to the CPU and back in one copy each way.
"""

from __future__ import annotations

import numpy as np
import torch

from longtrain.paths import use_user_numba_cache

use_user_numba_cache()  # before the decorators below: they fix where the cache lives

from numba import njit  # noqa: E402

from longtrain.ops.selection.state import INF, ExtendedScores, ScanResult, ThresholdState, move_together  # noqa: E402

_MASK63 = np.uint64((1 << 63) - 1)


@njit(cache=True, inline="always")
def _hash(pos):
    """splitmix64, as naive.position_hash."""
    x = np.uint64(pos) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return x & _MASK63


# ---- top-k min-heap over (value, position), carrying the ext index and the key's pool slot


@njit(cache=True, inline="always")
def _before(v1, p1, v2, p2):
    return v1 < v2 or (v1 == v2 and p1 < p2)


@njit(cache=True, inline="always")
def _kv_swap(hv, hp, he, hs, i, j):
    hv[i], hv[j] = hv[j], hv[i]
    hp[i], hp[j] = hp[j], hp[i]
    he[i], he[j] = he[j], he[i]
    hs[i], hs[j] = hs[j], hs[i]


@njit(cache=True)
def _kv_sift_down(hv, hp, he, hs, n, i):
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _before(hv[c + 1], hp[c + 1], hv[c], hp[c]):
            c += 1
        if not _before(hv[c], hp[c], hv[i], hp[i]):
            return
        _kv_swap(hv, hp, he, hs, i, c)
        i = c


@njit(cache=True)
def _kv_push(hv, hp, he, hs, n, v, p, e):
    i = n
    hv[i], hp[i], he[i], hs[i] = v, p, e, n  # a fresh slot while the pool grows
    while i > 0:
        parent = (i - 1) // 2
        if not _before(hv[i], hp[i], hv[parent], hp[parent]):
            break
        _kv_swap(hv, hp, he, hs, i, parent)
        i = parent
    return n + 1


# ---- float min-heaps


@njit(cache=True)
def _f_push(h, n, v):
    i = n
    h[i] = v
    while i > 0:
        parent = (i - 1) // 2
        if h[parent] <= h[i]:
            break
        h[i], h[parent] = h[parent], h[i]
        i = parent
    return n + 1


@njit(cache=True)
def _f_pop(h, n):
    """Remove the minimum; returns (value, new size)."""
    top = h[0]
    n -= 1
    h[0] = h[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and h[c + 1] < h[c]:
            c += 1
        if h[i] <= h[c]:
            break
        h[i], h[c] = h[c], h[i]
        i = c
    return top, n


@njit(cache=True)
def _scan_row(
    u_row, base, t0, n, topk, window, cap, block,
    hv, hp, he, hs, n_heap, sat, n_sat, frac, n_frac, fsum, tau, n_cand, overflow, fp,
    theta_u, theta_pos, tau_out, n_active, fps, block_pool,
):
    """One row of naive.scan_chunk_naive; returns the scalar state after the chunk."""
    lag = window if window > 1 else 1
    nxt = t0 - lag + 1
    if nxt < 0:
        nxt = 0
    c = 0
    while True:
        # Queries 0..n-1 of the chunk, then one last pass that inserts the candidates
        # the next chunk's first query needs (c == n).
        last = t0 + c - window if c < n else t0 + n - lag
        while nxt <= last:
            e = base + nxt
            val = u_row[e]
            n_cand += 1
            # top-k by (value, position)
            if n_heap < topk:
                n_heap = _kv_push(hv, hp, he, hs, n_heap, val, nxt, e)
                fp = (fp + _hash(nxt)) & _MASK63
            elif topk > 0 and _before(hv[0], hp[0], val, nxt):
                fp = (fp - _hash(hp[0]) + _hash(nxt)) & _MASK63
                hv[0], hp[0], he[0] = val, nxt, e  # hs[0] kept: the newcomer takes the evicted key's slot
                _kv_sift_down(hv, hp, he, hs, n_heap, 0)
            # threshold state
            if val > tau:
                if val >= tau + 1:
                    n_sat = _f_push(sat, n_sat, val)
                else:
                    n_frac = _f_push(frac, n_frac, val)
                    fsum += val
                if n_sat + n_frac > cap and n_frac > 0:
                    dropped, n_frac = _f_pop(frac, n_frac)
                    fsum -= dropped
                    overflow += 1
                if n_cand > topk:
                    # raise tau to the root of sum clamp(u - tau, 0, 1) = k (naive.RowScanner._solve)
                    while True:
                        b_frac = frac[0] if n_frac > 0 else INF
                        b_sat = sat[0] - 1 if n_sat > 0 else INF
                        b = min(b_frac, b_sat)
                        f_b = n_sat + fsum - n_frac * b if n_frac > 0 else float(n_sat)
                        if b < INF and f_b > topk:
                            if b_frac <= b_sat:
                                v, n_frac = _f_pop(frac, n_frac)
                                fsum -= v
                            else:
                                v, n_sat = _f_pop(sat, n_sat)
                                n_frac = _f_push(frac, n_frac, v)
                                fsum += v
                            tau = max(tau, b)
                            continue
                        if n_frac > 0:
                            tau = max(tau, (fsum + n_sat - topk) / n_frac)
                        break
                    while n_frac > 0 and frac[0] <= tau:  # exactly at tau: p = 0 for good
                        v, n_frac = _f_pop(frac, n_frac)
                        fsum -= v
                    if n_frac == 0:
                        fsum = 0.0
            nxt += 1
        if c == n:
            break
        if c % block == 0:
            for s in range(n_heap):
                block_pool[c // block, hs[s]] = he[s]  # stable slots
        if n_heap < topk or topk == 0:
            theta_u[c], theta_pos[c] = -INF, -1
        else:
            theta_u[c], theta_pos[c] = hv[0], hp[0]
        tau_out[c] = tau if topk > 0 else INF
        n_active[c] = n_frac if topk > 0 else 0
        fps[c] = fp
        c += 1
    return n_heap, n_sat, n_frac, fsum, tau, n_cand, overflow, fp


@njit(cache=True)
def _scan_rows(
    u_ext, pool_pos, seen, lengths, thr_u, thr_sat, thr_count, thr_tau, thr_sum, overflow,  # inputs
    topk, window, cap, block, first_query,
    theta_u, theta_pos, tau_out, n_active, fps, block_pool, final_pool,  # outputs [B, ...]
    thr_u_out, thr_sat_out, thr_count_out, thr_tau_out, thr_sum_out, overflow_out,
):
    """Every row: its heaps from the state's arrays, the scan (_scan_row), the arrays after the chunk."""
    lag = window if window > 1 else 1
    kk = max(topk, 1)
    for b in range(u_ext.shape[0]):
        t0 = seen[b]
        # The pool sits in ext slots 0..K-1; its keys take pool slots 0..n-1 in that order.
        hv = np.empty(kk)
        hp = np.empty(kk, dtype=np.int64)
        he = np.empty(kk, dtype=np.int64)
        hs = np.empty(kk, dtype=np.int64)
        n_heap = 0
        fp = np.uint64(0)
        for s in range(topk):
            if pool_pos[b, s] >= 0:
                n_heap = _kv_push(hv, hp, he, hs, n_heap, u_ext[b, s], pool_pos[b, s], s)
                fp = (fp + _hash(pool_pos[b, s])) & _MASK63
        # The scores above tau, as sorted arrays (a sorted array is a heap).
        sat = np.empty(cap + 1)
        frac = np.empty(cap + 1)
        n_sat = 0
        n_frac = 0
        for i in range(thr_count[b]):
            if thr_sat[b, i]:
                sat[n_sat] = thr_u[b, i]
                n_sat += 1
            else:
                frac[n_frac] = thr_u[b, i]
                n_frac += 1
        sat[:n_sat] = np.sort(sat[:n_sat])
        frac[:n_frac] = np.sort(frac[:n_frac])
        n_heap, n_sat, n_frac, fsum, t, n_cand, over, fp = _scan_row(
            u_ext[b], first_query - t0, t0, lengths[b], topk, window, cap, block,
            hv, hp, he, hs, n_heap, sat, n_sat, frac, n_frac, thr_sum[b], thr_tau[b], max(0, t0 - lag + 1),
            overflow[b], fp, theta_u[b], theta_pos[b], tau_out[b], n_active[b], fps[b], block_pool[b],
        )
        final_pool[b, :n_heap] = np.sort(he[:n_heap])
        thr_u_out[b, :n_sat] = sat[:n_sat]
        thr_u_out[b, n_sat: n_sat + n_frac] = frac[:n_frac]
        thr_sat_out[b, :n_sat] = True
        thr_count_out[b] = n_sat + n_frac
        thr_tau_out[b] = t
        thr_sum_out[b] = fsum
        overflow_out[b] = over


def scan_chunk_host(keys: ExtendedScores, state: ThresholdState, *, window: int, block: int) -> ScanResult:
    """naive.scan_chunk_naive, compiled. Same arguments, same result."""
    B, L, K, cap = keys.u.shape[0], keys.n_queries, keys.topk, state.cap
    inputs = move_together([keys.u.detach().to(torch.float64), keys.pos[:, :K], keys.seen, keys.lengths, state.thr_u,
                            state.thr_saturated, state.thr_count, state.tau, state.thr_sum, state.overflow], "cpu")
    out = ScanResult.allocate(B, L, -(-L // block), K, cap, "cpu")
    outputs = [x.numpy() for x in out._flat()]
    theta_u, theta_pos, tau, n_active, fps, block_pool, final_pool, thr_u, thr_sat = outputs[:9]
    theta_u.fill(INF)  # padded queries: nothing selected
    theta_pos.fill(np.iinfo(np.int64).max)
    for x in (tau, n_active, fps, thr_u, thr_sat):
        x.fill(0)
    block_pool.fill(-1)
    final_pool.fill(-1)
    _scan_rows(*(np.ascontiguousarray(x.numpy()) for x in inputs), K, window, cap, block, keys.first_query,
               *outputs)
    return out.to(keys.u.device)
