"""SparseK+Linear+SW attention core on Triton kernels: same signature and results as naive.py's core with
`linear=` (the linear types' SparseK part), forward and backward.

For query i and key j of its block's keys (gate g_ij, logits s_ij = scale q_i.k_j, times g for soft_kv;
naive.py's module doc gives the masks and variants):

    w_ij = g_ij e^{s_ij - M_i} [j in S_i u W_i] + c_ij e^{-M_i} phi(q_i).phi(k_j)
    c_ij = -g_ij on S_i (1 - g_ij when S_i is complete: every key beyond the window), 0 elsewhere
    o_i  = (sum_j w_ij v_j + e^{-M_i} num_i) / (sum_j w_ij + e^{-M_i} den_i)

with (num, den) the linear sums over the causal keys beyond the window (LinearTerms; not added when S_i is
complete: the sums then hold S_i only, counted through c) and M_i = max(0, max_j s_ij), a stabiliser only
(o does not depend on it).

Design. Each query block of G (the op's block) needs its pool at the block start plus one band of ext rows
(DESIGN.md fact 2): block_key_indices lists those Kb = K + w + G - 1 ext rows (-1: none) in torch, and the
kernels gather them in tiles of BN keys, recomputing the naive core's masks per tile from positions, u,
theta and tau. S_i is complete exactly when query i has at most k keys beyond its window (p_i - w + 1 <= k):
until the pool has seen k candidates it keeps and selects them all, and after it selects k of more (the naive
core counts the selected keys; the tests compare). Kernels:
  _fwd_kernel    per (QB queries of a block, batch x head): w with an online running max M (from 0), the sums
                 num and den; stores o and per query and head M and the denominator (+inf for queries with
                 no key, so their gradients come out 0);
  _bwd_kernel    per (QB queries of a block, batch x head), recomputing w (no stored scores): with
                 dw_ij = dO_i.(v_j - o_i) / den_i it writes the query-side gradients (q, phi(q), tau, num,
                 den) and adds the key-side ones (k, v, phi(k), u) with atomic adds into float32 buffers:
                 keys are shared between blocks through the pool and between the query heads of a KV head;
  _pool_walk_kernel  (LAUNCH's walk.on) the pool keys' key-side gradients instead, key-major: per (pool slots,
                 batch x KV head, segment of blocks) it walks the blocks, sums each slot's key while the slot holds
                 it and adds the sum once, where _bwd_kernel adds every pool key once per block and head, all into
                 the same rows (its backward took 51.6 ms a step at 12 x 768 on an H100, SparseK+SW's ~11).
The linear types are not bitwise chunk-invariant (docs/CONTRACTS.md), so the atomics' order is no loss.
Inputs float32, bfloat16 or float16, computed in float32 (dots in IEEE float32 for float32 inputs, TF32 for
half ones, whose values TF32 holds exactly); float64 (inputs or scores) goes to the naive core. The scan's
outputs are cast in torch before the launches, so the kernels test in 32 bits: int32 ext rows and positions,
and theta as _theta32 makes it, with which the float32 test on the scores is the naive core's float64 one.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from longtrain.ops.sparsek_attention.naive import LinearTerms, block_key_indices, sparsek_attention_core_naive
from longtrain.ops.sparsek_attention.triton_tiles import SOFT_KV, STRAIGHT_THROUGH, VARIANT_CODE

# Launch settings per head dim (the entry of the largest key <= D): per kernel the queries per program QB (a
# power of two; a block of G queries takes G / QB programs, min(QB, G)), the key tile BN and warps. Chosen so
# that every kernel compiled for sm_90 (benchmarks/kernels_aot.py --linear, bf16) fits two programs per SM,
# spilling a few registers in the D = 128 backward only. On an H100 at 12 x 768 the D = 64 backward took 146 ms
# a step with Triton's default acq_rel atomic adds (a fence each) and 52 ms with relaxed ones (benchmarks/README.md);
# a whole block per program (QB = 64, BN = 16, 8 warps: half the adds, no spills) took 149 ms under acq_rel, so
# the fences, not the count of adds, were the cost.
# The interpreter (CPU tests) takes small tiles.
_INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Kernel variants, off until a GPU has timed them against off (`benchmarks/linear_core_ab.py --try
# fwd.interior=1,bwd.interior=1 --try walk.on=1`); the CPU tests compare both ways with the naive core:
#   fwd.interior, bwd.interior  the key tiles inside every query's window without the masks, the gate and the
#                 linear part (_interior);
#   walk.on       the pool keys' gradients by _pool_walk_kernel (SB slots, SEG blocks and QB queries a step per
#                 program) instead of the query-major kernel's atomic adds.
LAUNCH = {
    64: dict(fwd=dict(QB=64, BN=32, num_warps=4, num_stages=1, interior=0),
             bwd=dict(QB=32, BN=32, num_warps=4, num_stages=1, interior=0),
             walk=dict(on=0, QB=16, SB=32, SEG=16, num_warps=4, num_stages=1)),
    128: dict(fwd=dict(QB=32, BN=32, num_warps=4, num_stages=1, interior=0),
              bwd=dict(QB=16, BN=32, num_warps=4, num_stages=1, interior=0),
              walk=dict(on=0, QB=16, SB=16, SEG=16, num_warps=8, num_stages=1)),
}


def launch_settings(D: int, block: int) -> dict:
    """LAUNCH's entry for head dim D and the op's block: {kernel: settings} (copies; QB at most the block)."""
    key = max([x for x in LAUNCH if x <= D], default=min(LAUNCH))
    cfg = {name: dict(c) for name, c in LAUNCH[key].items()}
    for c in cfg.values():
        if _INTERP:  # small tiles, the same code paths (a block takes two programs where it can)
            c.update(BN=16, QB=max(16, block // 2))
            if "SB" in c:
                c.update(SB=16, SEG=2)  # slot tiles and segments that the tests' pools and chunks span
        if "QB" in c:
            c["QB"] = min(c["QB"], block)
    return cfg


def unsupported(block: int, D: int, F: int, dtype: torch.dtype, score_dtype: torch.dtype = torch.float32) -> str | None:
    """Why the kernels cannot take this call (None: they can)."""
    if block < 16 or block & (block - 1):
        return f"the query block must be a power of two >= 16; got {block}"
    for name, n in (("head dim", D), ("feature dim", F)):
        if n < 16 or n & (n - 1) or n > 256:
            return f"the {name} must be a power of two in [16, 256]; got {n}"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"q/k/v must be float16, bfloat16 or float32; got {dtype}"
    if score_dtype == torch.float64:
        return "the scores must be float32 or half precision; got float64"
    return None


@triton.jit
def _query_rows(q_pos_ptr, theta_u_ptr, theta_pos_ptr, b, first, n_queries, QB: tl.constexpr):
    """Queries first .. first + QB of batch row b: indices i [QB], valid rows, positions (-1: padding) and
    theta (_theta32)."""
    i = first + tl.arange(0, QB)
    qm = i < n_queries
    row = b * n_queries + i  # per-query arrays are [B, L] contiguous
    qp = tl.load(q_pos_ptr + row, mask=qm, other=-1)
    thu = tl.load(theta_u_ptr + row, mask=qm, other=float("inf"))
    thp = tl.load(theta_pos_ptr + row, mask=qm, other=0)
    return i, qm, row, qp, thu, thp


@triton.jit
def _key_rows(keys_ptr, u_ptr, pos_ptr, b, blk, j0, n_blocks, n_keys, n_ext, BN: tl.constexpr):
    """Keys j0 .. j0 + BN of the block's list: ext rows ke (-1: none), whether they are keys, u, positions."""
    j = j0 + tl.arange(0, BN)
    ke = tl.load(keys_ptr + (b * n_blocks + blk) * n_keys + j, mask=j < n_keys, other=-1)
    kv = ke >= 0
    safe = tl.where(kv, ke, 0)
    u = tl.load(u_ptr + b * n_ext + safe, mask=kv, other=0.0).to(tl.float32)
    kp = tl.load(pos_ptr + b * n_ext + safe, mask=kv, other=-1)
    return ke, kv, safe, u, kp


@triton.jit
def _masks(qp, thu, thp, kp, u, window, HAS_TOPK: tl.constexpr):
    """[QB, BN] the naive core's masks: in the window, and selected (a candidate with (u, pos) >= theta; theta as
    _theta32 gives it, so the float32 test is the naive core's float64 one)."""
    live = (kp[None, :] >= 0) & (qp[:, None] >= 0) & (kp[None, :] <= qp[:, None])
    in_win = live & (kp[None, :] > qp[:, None] - window)
    if HAS_TOPK:
        above = (u[None, :] > thu[:, None]) | ((u[None, :] == thu[:, None]) & (kp[None, :] >= thp[:, None]))
        sel = live & (kp[None, :] <= qp[:, None] - window) & above
    else:
        sel = live & False
    return in_win, sel


@triton.jit
def _gate(sel, u, tau, VARIANT: tl.constexpr):
    """[QB, BN] gate g (m = clamp(u - tau, 0, 1) on selected keys, forward value 1 for straight_through, 1 off S)
    and where dg reaches u and tau (selected, 0 <= u - tau <= 1: torch.clamp passes the boundaries)."""
    diff = u[None, :] - tau[:, None]
    m = tl.minimum(tl.maximum(diff, 0.0), 1.0)
    if VARIANT == STRAIGHT_THROUGH:
        m = tl.full(diff.shape, 1.0, tl.float32)
    g = tl.where(sel, m, 1.0)
    return g, sel & (diff >= 0.0) & (diff <= 1.0)


@triton.jit
def _program(q_ptr, phq_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, n_queries, n_heads, group, topk, window,
             G: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, F: tl.constexpr):
    """What a forward or backward program (QB queries of a block, one head) knows of its queries: the block, the
    batch x head index, the row b, the KV head, their count, the query rows (_query_rows), tau, whether S is
    complete, the D and F ranges, the rows qh [QB] of the [B, L, H, .] tensors, q [QB, D] and phi(q) [QB, F]."""
    first = tl.program_id(0) * QB  # the program's queries: QB of block blk's G
    blk = first // G
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    i, qm, row, qp, thu, thp = _query_rows(q_pos_ptr, theta_u_ptr, theta_pos_ptr, b, first, n_queries, QB)
    tau = tl.load(tau_ptr + row, mask=qm, other=0.0).to(tl.float32)
    complete = tl.maximum(qp - window + 1, 0) <= topk  # (module doc; padding: True, as it has no key)
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    qh = row * n_heads + h
    q = tl.load(q_ptr + qh[:, None] * D + d[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
    phq = tl.load(phq_ptr + qh[:, None] * F + f[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
    return blk, bh, b, h // group, n_heads // group, i, qm, qp, thu, thp, tau, complete, d, f, qh, q, phq


@triton.jit
def _interior(n_pool, blk, window, G: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr):
    """[lo, hi): the key tiles of the block's list inside the window of every query of this program (band entry e
    holds position i0 - w + 1 + e for block start i0, so e is in query i0 + t's window iff t <= e <= t + w - 1).
    There the gate is 1 and the linear part 0 (block_key_indices' layout; the positions agree, as in the
    SparseK+SW kernels' band tiles), so these tiles skip the masks, the gate and phi(q).phi(k)."""
    t0 = tl.program_id(0) * QB - blk * G  # the program's first query, in its block
    lo = (n_pool + t0 + QB - 1 + BN - 1) // BN * BN
    return lo, tl.maximum(lo, (n_pool + t0 + window) // BN * BN)


@triton.jit
def _outside_end(lo, hi, n_keys, BN: tl.constexpr):
    """The tiles outside [lo, hi) (the pool, the band's start and its end at the diagonal) run as one loop over
    [0, _outside_end) with _outside's index: with a loop for each side the kernels spilled registers (sm_90)."""
    return lo + (n_keys - hi + BN - 1) // BN * BN


@triton.jit
def _outside(t, lo, hi):
    return t + (hi - lo) * (t >= lo)


@triton.jit
def _fwd_tile(M, acc, den, has, q, phq, qp, thu, thp, tau, complete, d, f, b, blk, kvh, n_kv, j0,
              k_ptr, v_ptr, u_ptr, pos_ptr, phk_ptr, keys_ptr, n_blocks, n_keys, n_ext, window, scale,
              BN: tl.constexpr, D: tl.constexpr, F: tl.constexpr, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr,
              PREC: tl.constexpr, INTERIOR: tl.constexpr):
    """_fwd_kernel's running max, sums and key flags after key tile j0 (INTERIOR: inside every query's window)."""
    ke, kv, safe, u, kp = _key_rows(keys_ptr, u_ptr, pos_ptr, b, blk, j0, n_blocks, n_keys, n_ext, BN)
    kh = (b * n_ext + safe) * n_kv + kvh  # [BN] rows of the [B, N, Hkv, .] tensors
    k = tl.load(k_ptr + kh[:, None] * D + d[None, :], mask=kv[:, None], other=0.0).to(tl.float32)  # [BN, D]
    v = tl.load(v_ptr + kh[:, None] * D + d[None, :], mask=kv[:, None], other=0.0).to(tl.float32)
    if not INTERIOR:  # (loaded with k and v, as the kernel always did: its schedule stays)
        phk = tl.load(phk_ptr + kh[:, None] * F + f[None, :], mask=kv[:, None], other=0.0).to(tl.float32)  # [BN, F]
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [QB, BN]
    if INTERIOR:
        att = (kp[None, :] >= 0) & (qp[:, None] >= 0)
        m_new = tl.maximum(M, tl.max(tl.where(att, s, float("-inf")), 1))
        w = tl.exp(tl.where(att, s - m_new[:, None], float("-inf")))  # gate 1, no linear part
    else:
        in_win, sel = _masks(qp, thu, thp, kp, u, window, HAS_TOPK)
        g, _ = _gate(sel, u, tau, VARIANT)
        if VARIANT == SOFT_KV:
            s = s * g
        att = in_win | sel
        m_new = tl.maximum(M, tl.max(tl.where(att, s, float("-inf")), 1))
        e = tl.exp(tl.where(att, s - m_new[:, None], float("-inf")))  # 0 off S u W
        lin = tl.dot(phq, tl.trans(phk), input_precision=PREC)  # phi(q_i).phi(k_j)
        c = tl.where(sel, tl.where(complete[:, None], 1.0 - g, -g), 0.0)
        w = g * e + c * tl.exp(-m_new)[:, None] * lin
    alpha = tl.exp(M - m_new)
    acc = acc * alpha[:, None] + tl.dot(w, v, input_precision=PREC)
    den = den * alpha + tl.sum(w, 1)
    has = tl.maximum(has, tl.max(att.to(tl.int32), 1))
    return m_new, acc, den, has


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, phq_ptr, phk_ptr, num_ptr, den_ptr,
    keys_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr,
    o_ptr, m_ptr, l_ptr,  # out
    n_queries, n_ext, n_heads, group, n_blocks, n_keys, n_pool, topk, window, scale,
    G: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr, INTERIOR: tl.constexpr,
):
    """o of query block blk and one head over the block's keys, and its M and denominator (module doc).
    Every tensor is contiguous: q, o, num [B, L, H, D], phq [B, L, H, F], k, v [B, N, Hkv, D], phk [B, N, Hkv, F]."""
    blk, bh, b, kvh, n_kv, i, qm, qp, thu, thp, tau, complete, d, f, qh, q, phq = _program(
        q_ptr, phq_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, n_queries, n_heads, group, topk, window,
        G, QB, D, F)

    M = tl.zeros([QB], tl.float32)  # the running max of the attended logits, from 0 (naive: max(0, max s))
    acc = tl.zeros([QB, D], tl.float32)  # sum_j w_ij v_j at the running M
    den = tl.zeros([QB], tl.float32)  # sum_j w_ij
    has = tl.zeros([QB], tl.int32)  # queries with a key (padding has none)
    if INTERIOR:  # (compiled only then, LAUNCH's fwd.interior: the default kernel's code stays as it was)
        lo, hi = _interior(n_pool, blk, window, G, QB, BN)
        for t in range(0, _outside_end(lo, hi, n_keys, BN), BN):  # every mask outside [lo, hi) (_outside_end)
            M, acc, den, has = _fwd_tile(M, acc, den, has, q, phq, qp, thu, thp, tau, complete, d, f, b, blk, kvh,
                                         n_kv, _outside(t, lo, hi), k_ptr, v_ptr, u_ptr, pos_ptr, phk_ptr, keys_ptr,
                                         n_blocks, n_keys, n_ext, window, scale, BN, D, F, VARIANT, HAS_TOPK, PREC, False)
        for j0 in range(lo, hi, BN):
            M, acc, den, has = _fwd_tile(M, acc, den, has, q, phq, qp, thu, thp, tau, complete, d, f, b, blk, kvh,
                                         n_kv, j0, k_ptr, v_ptr, u_ptr, pos_ptr, phk_ptr, keys_ptr,
                                         n_blocks, n_keys, n_ext, window, scale, BN, D, F, VARIANT, HAS_TOPK, PREC, True)
    else:
        for j0 in range(0, n_keys, BN):
            M, acc, den, has = _fwd_tile(M, acc, den, has, q, phq, qp, thu, thp, tau, complete, d, f, b, blk, kvh,
                                         n_kv, j0, k_ptr, v_ptr, u_ptr, pos_ptr, phk_ptr, keys_ptr,
                                         n_blocks, n_keys, n_ext, window, scale, BN, D, F, VARIANT, HAS_TOPK, PREC, False)

    # The linear sums beyond the window, unless S is complete (then they hold S only, counted above).
    e_lin = tl.where(complete, 0.0, tl.exp(-M))
    num_lin = tl.load(num_ptr + qh[:, None] * D + d[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
    den_lin = tl.load(den_ptr + qh, mask=qm, other=0.0).to(tl.float32)
    acc += e_lin[:, None] * num_lin
    den += e_lin * den_lin
    ok = has > 0
    o = tl.where(ok[:, None], acc / tl.where(ok, den, 1.0)[:, None], 0.0)
    tl.store(o_ptr + qh[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=qm[:, None])
    tl.store(m_ptr + bh * n_queries + i, M, mask=qm)
    tl.store(l_ptr + bh * n_queries + i, tl.where(ok, den, float("inf")), mask=qm)  # +inf: 1 / den = 0


@triton.jit
def _pair_weights(q, phq, e_m, M, qp, thu, thp, tau, complete, k, phk, u, kp, window, scale,
                  VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr):
    """[QB, BN] per (query, key) pair, recomputed as the forward made it: the weight w and what its gradient needs
    (the gate g, where dg reaches u and tau, the ungated logits r, e^{s - M}, phi(q).phi(k) and the linear factor c)."""
    in_win, sel = _masks(qp, thu, thp, kp, u, window, HAS_TOPK)
    g, dmask = _gate(sel, u, tau, VARIANT)
    r = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # the ungated logits
    s = r
    if VARIANT == SOFT_KV:
        s = r * g
    att = in_win | sel
    e = tl.exp(tl.where(att, s - M[:, None], float("-inf")))
    lin = tl.dot(phq, tl.trans(phk), input_precision=PREC)
    c = tl.where(sel, tl.where(complete[:, None], 1.0 - g, -g), 0.0)
    return g * e + c * e_m[:, None] * lin, g, dmask, r, e, lin, c


@triton.jit
def _bwd_tile(dq, dphq, dtau, q, phq, do, do_n, delta, inv, e_m, M, qp, thu, thp, tau, complete, d, f, b, blk, kvh, n_kv,
              j0, key_from, k_ptr, v_ptr, u_ptr, pos_ptr, phk_ptr, keys_ptr, dk_ptr, dv_ptr, dphk_ptr, du_ptr,
              n_blocks, n_keys, n_ext, window, scale,
              BN: tl.constexpr, D: tl.constexpr, F: tl.constexpr, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr,
              PREC: tl.constexpr, KEY_SIDE: tl.constexpr, FROM: tl.constexpr):
    """One key tile j0 of _bwd_kernel: dq [QB, D], dphq [QB, F] and dtau [QB] plus the tile's terms and, if KEY_SIDE,
    the key-side gradients of the tile's keys (if FROM, those at list index >= key_from) added into the float32
    buffers. The gradient terms are written out in this order (the walk has them too) because ptxas spilled
    registers here when they came from one helper before dq's and dphq's dots (kernels_aot.py, sm_90)."""
    ke, kv, safe, u, kp = _key_rows(keys_ptr, u_ptr, pos_ptr, b, blk, j0, n_blocks, n_keys, n_ext, BN)
    kh = (b * n_ext + safe) * n_kv + kvh
    k = tl.load(k_ptr + kh[:, None] * D + d[None, :], mask=kv[:, None], other=0.0).to(tl.float32)  # [BN, D]
    v = tl.load(v_ptr + kh[:, None] * D + d[None, :], mask=kv[:, None], other=0.0).to(tl.float32)
    phk = tl.load(phk_ptr + kh[:, None] * F + f[None, :], mask=kv[:, None], other=0.0).to(tl.float32)

    w, g, dmask, r, e, lin, c = _pair_weights(q, phq, e_m, M, qp, thu, thp, tau, complete, k, phk, u, kp, window,
                                              scale, VARIANT, HAS_TOPK, PREC)  # [QB, BN]
    dw = (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None]) * inv[:, None]  # dO_i.(v_j - o_i) / den_i
    ds = dw * g * e  # through e^{s - M}
    dr = ds
    if VARIANT == SOFT_KV:
        dr = ds * g
    dq += tl.dot(dr, k, input_precision=PREC) * scale
    dlin = dw * c * e_m[:, None]
    dphq += tl.dot(dlin, phk, input_precision=PREC)
    dg = dw * (e - e_m[:, None] * lin)  # c = -g or 1 - g: dc/dg = -1
    if VARIANT == SOFT_KV:
        dg += ds * r
    dm = tl.where(dmask, dg, 0.0)  # window keys' gate is the constant 1
    dtau -= tl.sum(dm, 1)
    if KEY_SIDE:
        dk = tl.dot(tl.trans(dr), q, input_precision=PREC) * scale  # [BN, D]
        dv = tl.dot(tl.trans(w), do_n, input_precision=PREC)
        dphk = tl.dot(tl.trans(dlin), phq, input_precision=PREC)  # [BN, F]
        add = kv
        if FROM:
            add = add & (j0 + tl.arange(0, BN) >= key_from)
        # relaxed: plain atomic adds, never read back here (Triton's default acq_rel fences every one)
        tl.atomic_add(dk_ptr + kh[:, None] * D + d[None, :], dk, mask=add[:, None], sem="relaxed")
        tl.atomic_add(dv_ptr + kh[:, None] * D + d[None, :], dv, mask=add[:, None], sem="relaxed")
        tl.atomic_add(dphk_ptr + kh[:, None] * F + f[None, :], dphk, mask=add[:, None], sem="relaxed")
        tl.atomic_add(du_ptr + b * n_ext + safe, tl.sum(dm, 0), mask=add, sem="relaxed")
    return dq, dphq, dtau


@triton.jit
def _bwd_interior_tile(dq, q, do, do_n, delta, inv, M, qp, d, b, blk, kvh, n_kv, j0, k_ptr, v_ptr, u_ptr, pos_ptr,
                       keys_ptr, dk_ptr, dv_ptr, n_blocks, n_keys, n_ext, scale,
                       BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    """_bwd_tile on a tile inside every query's window (_interior): gate 1 and no linear part, so only dq, dk and dv
    (whatever the variant: soft_kv's logits times a gate of 1 are the logits)."""
    ke, kv, safe, u, kp = _key_rows(keys_ptr, u_ptr, pos_ptr, b, blk, j0, n_blocks, n_keys, n_ext, BN)
    kh = (b * n_ext + safe) * n_kv + kvh
    k = tl.load(k_ptr + kh[:, None] * D + d[None, :], mask=kv[:, None], other=0.0).to(tl.float32)  # [BN, D]
    v = tl.load(v_ptr + kh[:, None] * D + d[None, :], mask=kv[:, None], other=0.0).to(tl.float32)
    att = (kp[None, :] >= 0) & (qp[:, None] >= 0)
    w = tl.exp(tl.where(att, tl.dot(q, tl.trans(k), input_precision=PREC) * scale - M[:, None], float("-inf")))
    dr = (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None]) * inv[:, None] * w
    dq += tl.dot(dr, k, input_precision=PREC) * scale
    tl.atomic_add(dk_ptr + kh[:, None] * D + d[None, :], tl.dot(tl.trans(dr), q, input_precision=PREC) * scale,
                  mask=kv[:, None], sem="relaxed")
    tl.atomic_add(dv_ptr + kh[:, None] * D + d[None, :], tl.dot(tl.trans(w), do_n, input_precision=PREC),
                  mask=kv[:, None], sem="relaxed")
    return dq


@triton.jit
def _bwd_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, phq_ptr, phk_ptr,
    keys_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr,
    o_ptr, m_ptr, l_ptr, do_ptr,
    dq_ptr, dphq_ptr, dtau_ptr, dnum_ptr, dden_ptr, delta_ptr,  # out, query-side: written (delta if POOL_WALK)
    dk_ptr, dv_ptr, dphk_ptr, du_ptr,  # out, key-side: float32, added to
    n_queries, n_ext, n_heads, group, n_blocks, n_keys, n_pool, topk, window, scale, key_from,
    G: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr, POOL_WALK: tl.constexpr,
    INTERIOR: tl.constexpr,
):
    """Gradients of query block blk and one head, recomputing w per key tile (module doc). dk, dv [B, N, Hkv, D],
    dphk [B, N, Hkv, F] and du [B, N] sum over blocks and heads by atomic adds, of the keys at list index >=
    key_from (topk: the pool's are _pool_walk_kernel's; 0: every key's); dtau is [B, H, L]."""
    blk, bh, b, kvh, n_kv, i, qm, qp, thu, thp, tau, complete, d, f, qh, q, phq = _program(
        q_ptr, phq_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, n_queries, n_heads, group, topk, window,
        G, QB, D, F)
    do = tl.load(do_ptr + qh[:, None] * D + d[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
    o = tl.load(o_ptr + qh[:, None] * D + d[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
    M = tl.load(m_ptr + bh * n_queries + i, mask=qm, other=0.0)
    inv = 1.0 / tl.load(l_ptr + bh * n_queries + i, mask=qm, other=float("inf"))  # 0: no key, no gradient
    delta = tl.sum(do * o, 1)  # dO_i . o_i
    e_m = tl.exp(-M)
    do_n = do * inv[:, None]  # dO_i / den_i: d num_i

    dq = tl.zeros([QB, D], tl.float32)
    dphq = tl.zeros([QB, F], tl.float32)
    dtau = tl.zeros([QB], tl.float32)
    band_from = 0
    if POOL_WALK:  # (compiled only then: the loop's code costs the other path registers, kernels_aot.py showed)
        tl.store(delta_ptr + bh * n_queries + i, delta, mask=qm)  # read by the walk: it need not load o
        # Two loops, not a branch per tile around the key-side dots (Triton 3.6 crashed on a dot inside a branch,
        # gpu_notes.md v12b): the tiles wholly below key_from add nothing to the keys.
        band_from = key_from // BN * BN
        for j0 in range(0, band_from, BN):
            dq, dphq, dtau = _bwd_tile(
                dq, dphq, dtau, q, phq, do, do_n, delta, inv, e_m, M, qp, thu, thp, tau, complete, d, f, b, blk, kvh,
                n_kv, j0, key_from, k_ptr, v_ptr, u_ptr, pos_ptr, phk_ptr, keys_ptr, dk_ptr, dv_ptr, dphk_ptr, du_ptr,
                n_blocks, n_keys, n_ext, window, scale, BN, D, F, VARIANT, HAS_TOPK, PREC, False, False)
    if INTERIOR:  # the tiles outside [lo, hi) in one loop (_outside_end), then the window's interior
        lo, hi = _interior(n_pool, blk, window, G, QB, BN)
        for t in range(band_from, _outside_end(lo, hi, n_keys, BN), BN):
            dq, dphq, dtau = _bwd_tile(
                dq, dphq, dtau, q, phq, do, do_n, delta, inv, e_m, M, qp, thu, thp, tau, complete, d, f, b, blk, kvh,
                n_kv, _outside(t, lo, hi), key_from, k_ptr, v_ptr, u_ptr, pos_ptr, phk_ptr, keys_ptr, dk_ptr,
                dv_ptr, dphk_ptr, du_ptr, n_blocks, n_keys, n_ext, window, scale, BN, D, F, VARIANT, HAS_TOPK, PREC,
                True, POOL_WALK)
        for j0 in range(lo, hi, BN):
            dq = _bwd_interior_tile(dq, q, do, do_n, delta, inv, M, qp, d, b, blk, kvh, n_kv, j0, k_ptr, v_ptr, u_ptr,
                                    pos_ptr, keys_ptr, dk_ptr, dv_ptr, n_blocks, n_keys, n_ext, scale, BN, D, PREC)
    else:
        for j0 in range(band_from, n_keys, BN):
            dq, dphq, dtau = _bwd_tile(
                dq, dphq, dtau, q, phq, do, do_n, delta, inv, e_m, M, qp, thu, thp, tau, complete, d, f, b, blk, kvh,
                n_kv, j0, key_from, k_ptr, v_ptr, u_ptr, pos_ptr, phk_ptr, keys_ptr, dk_ptr, dv_ptr, dphk_ptr, du_ptr,
                n_blocks, n_keys, n_ext, window, scale, BN, D, F, VARIANT, HAS_TOPK, PREC, True, POOL_WALK)

    e_lin = tl.where(complete, 0.0, e_m)  # the linear sums' factor (0 when S is complete)
    tl.store(dq_ptr + qh[:, None] * D + d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=qm[:, None])
    tl.store(dphq_ptr + qh[:, None] * F + f[None, :], dphq.to(dphq_ptr.dtype.element_ty), mask=qm[:, None])
    tl.store(dnum_ptr + qh[:, None] * D + d[None, :], (e_lin[:, None] * do_n).to(dnum_ptr.dtype.element_ty),
             mask=qm[:, None])
    tl.store(dden_ptr + qh, (-e_lin * delta * inv).to(dden_ptr.dtype.element_ty), mask=qm)
    tl.store(dtau_ptr + bh * n_queries + i, dtau, mask=qm)


@triton.jit
def _flush(dk_ptr, dv_ptr, dphk_ptr, du_ptr, held, out, dk, dv, dphk, du, b, kvh, n_kv, n_ext, d, f,
           D: tl.constexpr, F: tl.constexpr):
    """Add the walk's sums of the keys `held` (ext rows, -1: none) where `out` into the float32 buffers."""
    m = out & (held >= 0)
    kh = (b * n_ext + tl.where(m, held, 0)) * n_kv + kvh
    tl.atomic_add(dk_ptr + kh[:, None] * D + d[None, :], dk, mask=m[:, None], sem="relaxed")
    tl.atomic_add(dv_ptr + kh[:, None] * D + d[None, :], dv, mask=m[:, None], sem="relaxed")
    tl.atomic_add(dphk_ptr + kh[:, None] * F + f[None, :], dphk, mask=m[:, None], sem="relaxed")
    tl.atomic_add(du_ptr + b * n_ext + tl.where(m, held, 0), du, mask=m, sem="relaxed")


@triton.jit
def _pool_walk_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, phq_ptr, phk_ptr,
    pool_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr,
    delta_ptr, m_ptr, l_ptr, do_ptr,  # delta: dO . o [B, H, L] (_bwd_kernel's)
    dk_ptr, dv_ptr, dphk_ptr, du_ptr,  # out, key-side: float32, added to
    n_queries, n_ext, n_heads, group, n_blocks, n_slots, topk, window, scale,
    G: tl.constexpr, QB: tl.constexpr, SB: tl.constexpr, SEG: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
    VARIANT: tl.constexpr, PREC: tl.constexpr,
):
    """The pool keys' gradients (dk, dv, dphk, du), key-major: one program per SB pool slots, batch row x KV head and
    SEG query blocks walks the blocks in order, summing each slot's key over the blocks' queries and heads while the
    slot holds it, and adds the sum once (atomic add) when the key leaves the slot or the segment ends: the
    query-major kernel would add every key once per block and query head, all blocks into the same rows. Slots are
    the scan's (block_pool unsorted): stable, so a kept key stays in its slot (any order is correct, only slower)."""
    slot = tl.program_id(0) * SB + tl.arange(0, SB)
    bk = tl.program_id(1)
    n_kv = n_heads // group
    b = bk // n_kv
    kvh = bk % n_kv
    blk_first = tl.program_id(2) * SEG
    blk_end = tl.minimum(blk_first + SEG, n_blocks)
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    held = tl.full([SB], -1, tl.int32)  # the ext row each slot's sums belong to
    dk = tl.zeros([SB, D], tl.float32)
    dv = tl.zeros([SB, D], tl.float32)
    dphk = tl.zeros([SB, F], tl.float32)
    du = tl.zeros([SB], tl.float32)
    for blk in range(blk_first, blk_end):
        ke = tl.load(pool_ptr + (b * n_blocks + blk) * n_slots + slot, mask=slot < n_slots, other=-1)
        out = ke != held
        _flush(dk_ptr, dv_ptr, dphk_ptr, du_ptr, held, out, dk, dv, dphk, du, b, kvh, n_kv, n_ext, d, f, D, F)
        dk = tl.where(out[:, None], 0.0, dk)
        dv = tl.where(out[:, None], 0.0, dv)
        dphk = tl.where(out[:, None], 0.0, dphk)
        du = tl.where(out, 0.0, du)
        held = ke
        kv = ke >= 0
        safe = tl.where(kv, ke, 0)
        u = tl.load(u_ptr + b * n_ext + safe, mask=kv, other=0.0).to(tl.float32)
        kp = tl.load(pos_ptr + b * n_ext + safe, mask=kv, other=-1)
        kh = (b * n_ext + safe) * n_kv + kvh
        k = tl.load(k_ptr + kh[:, None] * D + d[None, :], mask=kv[:, None], other=0.0).to(tl.float32)  # [SB, D]
        v = tl.load(v_ptr + kh[:, None] * D + d[None, :], mask=kv[:, None], other=0.0).to(tl.float32)
        phk = tl.load(phk_ptr + kh[:, None] * F + f[None, :], mask=kv[:, None], other=0.0).to(tl.float32)
        for r in range(0, group):
            h = kvh * group + r
            bh = b * n_heads + h
            for q0 in range(0, G, QB):
                i, qm, row, qp, thu, thp = _query_rows(q_pos_ptr, theta_u_ptr, theta_pos_ptr, b, blk * G + q0,
                                                       n_queries, QB)
                tau = tl.load(tau_ptr + row, mask=qm, other=0.0).to(tl.float32)
                complete = tl.maximum(qp - window + 1, 0) <= topk
                qh = row * n_heads + h
                q = tl.load(q_ptr + qh[:, None] * D + d[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
                phq = tl.load(phq_ptr + qh[:, None] * F + f[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
                do = tl.load(do_ptr + qh[:, None] * D + d[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
                M = tl.load(m_ptr + bh * n_queries + i, mask=qm, other=0.0)
                inv = 1.0 / tl.load(l_ptr + bh * n_queries + i, mask=qm, other=float("inf"))
                delta = tl.load(delta_ptr + bh * n_queries + i, mask=qm, other=0.0)
                e_m = tl.exp(-M)
                w, g, dmask, rr, e, lin, c = _pair_weights(q, phq, e_m, M, qp, thu, thp, tau, complete, k, phk, u, kp,
                                                           window, scale, VARIANT, True, PREC)  # [QB, SB]
                dw = (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None]) * inv[:, None]
                dr = dw * g * e
                dg = dw * (e - e_m[:, None] * lin)
                if VARIANT == SOFT_KV:
                    dg += dr * rr
                    dr = dr * g
                dlin = dw * c * e_m[:, None]
                dm = tl.where(dmask, dg, 0.0)
                dk += tl.dot(tl.trans(dr), q, input_precision=PREC) * scale
                dv += tl.dot(tl.trans(w), do * inv[:, None], input_precision=PREC)
                dphk += tl.dot(tl.trans(dlin), phq, input_precision=PREC)
                du += tl.sum(dm, 0)
    _flush(dk_ptr, dv_ptr, dphk_ptr, du_ptr, held, held >= 0, dk, dv, dphk, du, b, kvh, n_kv, n_ext, d, f, D, F)


def _theta32(theta_u: torch.Tensor, theta_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """theta [B, L] as float32 and int32 giving float32 (or half) scores u the naive core's float64 test
    (u, pos) >= (theta_u, theta_pos): the largest float32 t <= theta_u, and where t < theta_u (no float32
    score lies strictly between them, and u == t means u < theta_u) a position no key reaches."""
    t = theta_u.to(torch.float32)
    t = torch.where(t.double() > theta_u, torch.nextafter(t, torch.full_like(t, -float("inf"))), t)
    big = torch.iinfo(torch.int32).max
    thp = torch.where(t.double() == theta_u, theta_pos.clamp(-big - 1, big), big).to(torch.int32)
    return t.contiguous(), thp.contiguous()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 checks want exact fp32 dots


def linear_fwd(
    q: torch.Tensor,  # [B, L, H, D] contiguous
    k_ext: torch.Tensor,  # [B, N, Hkv, D] contiguous
    v_ext: torch.Tensor,  # [B, N, Hkv, D] contiguous
    u: torch.Tensor,  # [B, N] float32 or half (detached)
    pos: torch.Tensor,  # [B, N] int32
    phq: torch.Tensor,  # [B, L, H, F] contiguous
    phk: torch.Tensor,  # [B, N, Hkv, F] contiguous
    num: torch.Tensor,  # [B, L, H, D] contiguous
    den: torch.Tensor,  # [B, L, H] contiguous
    keys: torch.Tensor,  # [B, nb, Kb] int32 each block's ext rows (-1: none)
    q_pos: torch.Tensor,  # [B, L] int32
    theta_u: torch.Tensor,  # [B, L] float32 (_theta32)
    theta_pos: torch.Tensor,  # [B, L] int32
    tau: torch.Tensor,  # [B, L] (detached)
    *,
    topk: int,
    window: int,
    scale: float,
    block: int,
    variant: int,  # VARIANT_CODE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel: o [B, L, H, D] in q's dtype, and per query and head M and the denominator [B, H, L]
    float32 (+inf: no key)."""
    B, L, H, D = q.shape
    N, Hkv, F = k_ext.shape[1], k_ext.shape[2], phk.shape[-1]
    nb, Kb = keys.shape[1], keys.shape[2]
    o = torch.empty_like(q)
    M = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    den_o = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    cfg = launch_settings(D, block)["fwd"]
    _fwd_kernel[(triton.cdiv(L, cfg["QB"]), B * H)](
        q_ptr=q, k_ptr=k_ext, v_ptr=v_ext, u_ptr=u, pos_ptr=pos, phq_ptr=phq, phk_ptr=phk, num_ptr=num, den_ptr=den,
        keys_ptr=keys, q_pos_ptr=q_pos, theta_u_ptr=theta_u, theta_pos_ptr=theta_pos, tau_ptr=tau,
        o_ptr=o, m_ptr=M, l_ptr=den_o,
        n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_blocks=nb, n_keys=Kb, n_pool=_pool_len(keys, window, block),
        topk=topk, window=window, scale=scale,
        G=block, QB=cfg["QB"], BN=cfg["BN"], D=D, F=F, VARIANT=variant, HAS_TOPK=topk > 0, PREC=_precision(q.dtype),
        INTERIOR=bool(cfg["interior"]), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, M, den_o


def _pool_len(keys: torch.Tensor, window: int, block: int) -> int:
    """K: the block lists [B, nb, K + w + G - 1] hold the pool first, then the band (block_key_indices)."""
    return keys.shape[-1] - (window + block - 1)


def linear_bwd(q, k_ext, v_ext, u, pos, phq, phk, keys, q_pos, theta_u, theta_pos, tau, o, M, den_o,
               block_pool: torch.Tensor,  # [B, nb, K] each block's pool in the scan's slots (-1: none), any int dtype
               do: torch.Tensor,  # [B, L, H, D] contiguous
               *, topk: int, window: int, scale: float, block: int, variant: int):
    """The backward kernels (arguments as linear_fwd's and its outputs): dq [B, L, H, D], dphq [B, L, H, F],
    dtau [B, L], dnum [B, L, H, D], dden [B, L, H] (float32) and, float32, dk, dv [B, N, Hkv, D],
    dphk [B, N, Hkv, F], du [B, N]."""
    B, L, H, D = q.shape
    N, Hkv, F = k_ext.shape[1], k_ext.shape[2], phk.shape[-1]
    nb, Kb = keys.shape[1], keys.shape[2]
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    dq, dnum = torch.empty(B, L, H, D, **f32), torch.empty(B, L, H, D, **f32)
    dphq, dden, dtau = torch.empty(B, L, H, F, **f32), torch.empty(B, L, H, **f32), torch.empty(B, H, L, **f32)
    dk, dv = torch.zeros(B, N, Hkv, D, **f32), torch.zeros(B, N, Hkv, D, **f32)  # atomic adds: zeroed
    dphk, du = torch.zeros(B, N, Hkv, F, **f32), torch.zeros(B, N, **f32)
    cfgs = launch_settings(D, block)
    cfg, walk = cfgs["bwd"], cfgs["walk"]
    n_slots = _pool_len(keys, window, block)
    walking = bool(walk["on"]) and n_slots > 0
    delta = torch.empty(B, H, L if walking else 0, **f32)  # dO . o per query and head: the walk reads it
    _bwd_kernel[(triton.cdiv(L, cfg["QB"]), B * H)](
        q_ptr=q, k_ptr=k_ext, v_ptr=v_ext, u_ptr=u, pos_ptr=pos, phq_ptr=phq, phk_ptr=phk,
        keys_ptr=keys, q_pos_ptr=q_pos, theta_u_ptr=theta_u, theta_pos_ptr=theta_pos, tau_ptr=tau,
        o_ptr=o, m_ptr=M, l_ptr=den_o, do_ptr=do,
        dq_ptr=dq, dphq_ptr=dphq, dtau_ptr=dtau, dnum_ptr=dnum, dden_ptr=dden, delta_ptr=delta,
        dk_ptr=dk, dv_ptr=dv, dphk_ptr=dphk, du_ptr=du,
        n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_blocks=nb, n_keys=Kb, topk=topk, window=window, scale=scale,
        key_from=n_slots if walking else 0, n_pool=n_slots,
        G=block, QB=cfg["QB"], BN=cfg["BN"], D=D, F=F, VARIANT=variant, HAS_TOPK=topk > 0, PREC=_precision(q.dtype),
        POOL_WALK=walking, INTERIOR=bool(cfg["interior"]), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if walking:
        _pool_walk_kernel[(triton.cdiv(n_slots, walk["SB"]), B * Hkv, triton.cdiv(nb, walk["SEG"]))](
            q_ptr=q, k_ptr=k_ext, v_ptr=v_ext, u_ptr=u, pos_ptr=pos, phq_ptr=phq, phk_ptr=phk,
            pool_ptr=block_pool.to(dev, torch.int32).contiguous(), q_pos_ptr=q_pos, theta_u_ptr=theta_u,
            theta_pos_ptr=theta_pos, tau_ptr=tau, delta_ptr=delta, m_ptr=M, l_ptr=den_o, do_ptr=do,
            dk_ptr=dk, dv_ptr=dv, dphk_ptr=dphk, du_ptr=du,
            n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_blocks=nb, n_slots=n_slots, topk=topk, window=window,
            scale=scale, G=block, QB=walk["QB"], SB=walk["SB"], SEG=walk["SEG"], D=D, F=F, VARIANT=variant, PREC=_precision(q.dtype),
            num_warps=walk["num_warps"], num_stages=walk["num_stages"],
        )
    return dq, dphq, dtau.sum(1), dnum, dden, dk, dv, dphk, du  # dtau: summed over the heads


class _SparseKLinearTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ext, v_ext, u_ext, pos_ext, q_pos, theta_u, theta_pos, tau, block_pool, phq, phk, num, den,
                meta):
        topk, window, tail_slots, variant, scale, block = meta
        B, L = q.shape[:2]
        N = k_ext.shape[1]
        dev = q.device
        nb = -(-L // block)
        keys = block_key_indices(block_pool.to(dev), N, topk, window, tail_slots, block, nb, pos_ext=pos_ext)
        keys = keys.to(torch.int32).contiguous()  # [B, nb, Kb]
        # Positions in int32 (documents below 2^31 tokens) and theta as _theta32: 32-bit tests in the kernels.
        pos = pos_ext.to(dev, torch.int32).contiguous()
        q, k_ext, v_ext = q.contiguous(), k_ext.contiguous(), v_ext.contiguous()
        phq, phk, num, den = phq.contiguous(), phk.contiguous(), num.contiguous(), den.contiguous()
        u = u_ext.detach().contiguous()  # [B, N]
        qpos = q_pos.to(dev, torch.int32).contiguous()
        thu, thp = _theta32(theta_u.to(dev), theta_pos.to(dev))
        tau_c = tau.detach().contiguous()
        args = dict(topk=topk, window=window, scale=scale, block=block, variant=VARIANT_CODE[variant])
        o, M, den_o = linear_fwd(q, k_ext, v_ext, u, pos, phq, phk, num, den, keys, qpos, thu, thp, tau_c,
                                           **args)
        # block_pool as the scan gave it (stable slots), for the pool walk: cast only where it runs
        ctx.save_for_backward(q, k_ext, v_ext, u, pos, phq, phk, keys, qpos, thu, thp, tau_c, o, M, den_o,
                              block_pool[:, :nb])
        ctx.args = args
        ctx.dtypes = [x.dtype for x in (q, phq, tau, num, den, k_ext, v_ext, phk, u_ext)]
        return o

    @staticmethod
    def backward(ctx, do):
        grads = linear_bwd(*ctx.saved_tensors, do.contiguous(), **ctx.args)
        dq, dphq, dtau, dnum, dden, dk, dv, dphk, du = (g.to(t) for g, t in zip(grads, ctx.dtypes))
        return dq, dk, dv, du, None, None, None, None, dtau, None, dphq, dphk, dnum, dden, None


def sparsek_linear_attention_core_triton(
    q: torch.Tensor,  # [B, L, H, D]
    k_ext: torch.Tensor,  # [B, N, Hkv, D]
    v_ext: torch.Tensor,  # [B, N, Hkv, D]
    u_ext: torch.Tensor,  # [B, N] (the chunk part may carry gradient)
    pos_ext: torch.Tensor,  # [B, N] int64 (-1: empty)
    q_pos: torch.Tensor,  # [B, L] int64 (-1: padding)
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
    linear: LinearTerms,
) -> torch.Tensor:
    """Same contract as naive.sparsek_attention_core_naive with `linear`; o [B, L, H, D] in q's dtype.

    Shapes or dtypes the kernels do not take (float64 among them) go to the naive core, with a warning."""
    why = unsupported(block, q.shape[-1], linear.phq.shape[-1], q.dtype, u_ext.dtype)
    if why is not None:
        warnings.warn(f"SparseK+Linear Triton kernels: {why}; using the naive core", stacklevel=2)
        return sparsek_attention_core_naive(
            q, k_ext, v_ext, u_ext, pos_ext, q_pos, theta_u, theta_pos, tau, block_pool, topk=topk, window=window,
            tail_slots=tail_slots, variant=variant, scale=scale, block=block, linear=linear,
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    meta = (topk, window, tail_slots, variant, float(scale), block)
    return _SparseKLinearTriton.apply(q, k_ext, v_ext, u_ext, pos_ext, q_pos, theta_u, theta_pos, tau, block_pool,
                                      *linear, meta)
