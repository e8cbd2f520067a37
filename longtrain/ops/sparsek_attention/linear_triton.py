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
  _fwd_kernel      per (QB queries of a block, batch x head): w with an online running max M (from 0), the sums
                   num and den; stores o and per query and head M and the denominator (+inf for queries with
                   no key, so their gradients come out 0);
  _bwd_kernel      per (QB queries of a block, batch x head), recomputing w (no stored scores): with
                   dw_ij = dO_i.(v_j - o_i) / den_i it writes the query-side gradients (q, phi(q), tau, num,
                   den) and adds the key-side ones (k, v, phi(k), u) with atomic adds into float32 buffers:
                   keys are shared between blocks through the pool and between the query heads of a KV head;
  _key_sum_kernel  the deterministic backward (DETERMINISTIC, or torch's deterministic algorithms, which
                   train.deterministic sets; tests/gpu/test_linear_gpu.py runs it on an H100, issue 38):
                   _bwd_kernel (ATOMIC off) stores each program's key-side gradients in a float32 scratch
                   row per (query tile, head, slot of its block's key list), each written once, and this
                   kernel sums them per ext row and KV head in a fixed order (the row's slots in
                   ascending order, from a stable sort of their ext rows; then tiles and heads in order): bit for
                   bit the same every run, whatever the scheduling. Slabs of whole blocks keep the scratch under
                   SCRATCH_BYTES (scratch_tiles).
The linear types are not bitwise chunk-invariant (docs/CONTRACTS.md), so the atomics' order is no loss outside
deterministic runs; the atomic and deterministic sums differ by rounding only.
Inputs float32, bfloat16 or float16, computed in float32 (dots in IEEE float32 for float32 inputs, TF32 for half
ones, whose values TF32 holds exactly; with LAUNCH's native, bfloat16 tiles and dots); float64 (inputs or scores)
goes to the naive core. The scan's outputs are cast in torch before the launches, so the kernels test in 32 bits:
int32 ext rows and positions, and theta as _theta32 makes it, with which the float32 test on the scores is the
naive core's float64 one.
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
# a step with Triton's default acq_rel atomic adds (a fence each) and 51.6 ms with relaxed ones; a whole block per
# program (QB = 64, BN = 16, 8 warps: half the adds, no spills) took 149 ms under acq_rel, so the fences, not the
# count of adds, were the cost (benchmarks/README.md).
# The interpreter (CPU tests) takes small tiles.
# native: half inputs stay half in the tiles and the dots take them as they are, with the weights and gradient
# terms rounded to the inputs' dtype before their dots (as flash attention does), instead of float32 tiles with
# TF32 dots: half the shared memory and tensor-core instructions (registers stay near 255: kernels_aot.py). Off:
# on an H100 (linear_core_ab.py, D = 64, 4 x 4096 tokens) the op took 11.31 ms with it against 10.18 without, and
# 10.26-10.32 with smaller backward tiles; tests/gpu/test_linear_gpu.py passes with it. No change for float32 inputs.
# Backward without atomics (bitwise reproducible; linear_bwd); also on under torch.use_deterministic_algorithms.
DETERMINISTIC = False
# The deterministic backward's scratch per slab of query tiles (scratch_tiles; at least one block's tiles): at
# 1 x 4096 tokens, 12 heads, D = F = 64, k = w = 128 (Kb = 319) the 128 tiles of 32 queries take 378 MB, one slab.
SCRATCH_BYTES = 512 << 20
_INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
LAUNCH = {
    64: dict(fwd=dict(QB=64, BN=32, num_warps=4, num_stages=1, native=0),
             bwd=dict(QB=32, BN=32, num_warps=4, num_stages=1, native=0)),
    128: dict(fwd=dict(QB=32, BN=32, num_warps=4, num_stages=1, native=0),
              bwd=dict(QB=16, BN=32, num_warps=4, num_stages=1, native=0)),
}


def launch_settings(D: int, block: int) -> dict:
    """LAUNCH's entry for head dim D and the op's block: {kernel: settings} (copies; QB at most the block)."""
    key = max([x for x in LAUNCH if x <= D], default=min(LAUNCH))
    cfg = {name: dict(c) for name, c in LAUNCH[key].items()}
    for c in cfg.values():
        if _INTERP:  # small tiles, the same code paths (a block takes two programs where it can)
            c.update(BN=16, QB=max(16, block // 2))
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
def _dot_operand(x, DOTS: tl.constexpr):
    """x as a dot's operand: as it is (DOTS 0: float32 tiles), in bfloat16 (1: native), or rounded through bfloat16
    (2: native as the interpreter runs it, whose bfloat16 dots are wrong: float32 dots of the rounded values)."""
    if DOTS == 1:
        x = x.to(tl.bfloat16)
    elif DOTS == 2:
        x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _tile(ptrs, mask, DOTS: tl.constexpr):
    """A [rows, cols] input tile as a dot's operand (_dot_operand): loaded as stored, in float32 unless native."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if DOTS != 1:
        x = x.to(tl.float32)
    return _dot_operand(x, DOTS)


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
             tile0, G: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, F: tl.constexpr, DOTS: tl.constexpr):
    """What a forward or backward program (QB queries of a block, one head; query tile tile0 + its first program
    index) knows of its queries: the block, the batch x head index, the row b, the KV head, their count, the query
    rows (_query_rows), tau, whether S is complete, the D and F ranges, the rows qh [QB] of the [B, L, H, .]
    tensors, q [QB, D] and phi(q) [QB, F]."""
    first = (tile0 + tl.program_id(0)) * QB  # the program's queries: QB of block blk's G
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
    q = _tile(q_ptr + qh[:, None] * D + d[None, :], qm[:, None], DOTS)
    phq = _tile(phq_ptr + qh[:, None] * F + f[None, :], qm[:, None], DOTS)
    return blk, bh, b, h // group, n_heads // group, i, qm, qp, thu, thp, tau, complete, d, f, qh, q, phq


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, phq_ptr, phk_ptr, num_ptr, den_ptr,
    keys_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr,
    o_ptr, m_ptr, l_ptr,  # out
    n_queries, n_ext, n_heads, group, n_blocks, n_keys, topk, window, scale,
    G: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr, DOTS: tl.constexpr,
):
    """o of query block blk and one head over the block's keys, and its M and denominator (module doc).
    Every tensor is contiguous: q, o, num [B, L, H, D], phq [B, L, H, F], k, v [B, N, Hkv, D], phk [B, N, Hkv, F]."""
    blk, bh, b, kvh, n_kv, i, qm, qp, thu, thp, tau, complete, d, f, qh, q, phq = _program(
        q_ptr, phq_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, n_queries, n_heads, group, topk, window,
        0, G, QB, D, F, DOTS)

    M = tl.zeros([QB], tl.float32)  # the running max of the attended logits, from 0 (naive: max(0, max s))
    acc = tl.zeros([QB, D], tl.float32)  # sum_j w_ij v_j at the running M
    den = tl.zeros([QB], tl.float32)  # sum_j w_ij
    has = tl.zeros([QB], tl.int32)  # queries with a key (padding has none)
    for j0 in range(0, n_keys, BN):
        ke, kv, safe, u, kp = _key_rows(keys_ptr, u_ptr, pos_ptr, b, blk, j0, n_blocks, n_keys, n_ext, BN)
        kh = (b * n_ext + safe) * n_kv + kvh  # [BN] rows of the [B, N, Hkv, .] tensors
        k = _tile(k_ptr + kh[:, None] * D + d[None, :], kv[:, None], DOTS)  # [BN, D]
        v = _tile(v_ptr + kh[:, None] * D + d[None, :], kv[:, None], DOTS)
        phk = _tile(phk_ptr + kh[:, None] * F + f[None, :], kv[:, None], DOTS)  # [BN, F]

        in_win, sel = _masks(qp, thu, thp, kp, u, window, HAS_TOPK)
        g, _ = _gate(sel, u, tau, VARIANT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [QB, BN]
        if VARIANT == SOFT_KV:
            s = s * g
        att = in_win | sel
        m_new = tl.maximum(M, tl.max(tl.where(att, s, float("-inf")), 1))
        alpha = tl.exp(M - m_new)
        e = tl.exp(tl.where(att, s - m_new[:, None], float("-inf")))  # 0 off S u W
        lin = tl.dot(phq, tl.trans(phk), input_precision=PREC)  # phi(q_i).phi(k_j)
        c = tl.where(sel, tl.where(complete[:, None], 1.0 - g, -g), 0.0)
        w = g * e + c * tl.exp(-m_new)[:, None] * lin
        acc = acc * alpha[:, None] + tl.dot(_dot_operand(w, DOTS), v, input_precision=PREC)
        den = den * alpha + tl.sum(w, 1)
        has = tl.maximum(has, tl.max(att.to(tl.int32), 1))
        M = m_new

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
def _bwd_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, phq_ptr, phk_ptr,
    keys_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr,
    o_ptr, m_ptr, l_ptr, do_ptr,
    dq_ptr, dphq_ptr, dtau_ptr, dnum_ptr, dden_ptr,  # out, query-side: written
    dk_ptr, dv_ptr, dphk_ptr, du_ptr,  # out, key-side: float32, added to (ATOMIC)
    scratch_ptr,  # out, key-side (not ATOMIC): float32 [slab tiles, B, H, Kb, 2D + F + 1], written
    n_queries, n_ext, n_heads, group, n_blocks, n_keys, topk, window, scale, tile0,
    G: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr, DOTS: tl.constexpr, ATOMIC: tl.constexpr,
):
    """Gradients of query tile tile0 + program_id(0) (QB queries of block blk) and one head, recomputing w per key
    tile (module doc); dtau is [B, H, L]. ATOMIC: dk, dv [B, N, Hkv, D], dphk [B, N, Hkv, F] and du [B, N] sum over
    blocks and heads by atomic adds. Not ATOMIC (deterministic): the program stores its key-side gradients, each
    slot j of the block's key list once, in the row (tile - tile0, b, h, j) of scratch (dk | dv | dphk | du), which
    _key_sum_kernel sums in a fixed order."""
    blk, bh, b, kvh, n_kv, i, qm, qp, thu, thp, tau, complete, d, f, qh, q, phq = _program(
        q_ptr, phq_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, n_queries, n_heads, group, topk, window,
        tile0, G, QB, D, F, DOTS)
    do_t = _tile(do_ptr + qh[:, None] * D + d[None, :], qm[:, None], DOTS)  # dO as the dots take it
    do = do_t.to(tl.float32)
    o = tl.load(o_ptr + qh[:, None] * D + d[None, :], mask=qm[:, None], other=0.0).to(tl.float32)
    M = tl.load(m_ptr + bh * n_queries + i, mask=qm, other=0.0)
    inv = 1.0 / tl.load(l_ptr + bh * n_queries + i, mask=qm, other=float("inf"))  # 0: no key, no gradient
    delta = tl.sum(do * o, 1)  # dO_i . o_i
    e_m = tl.exp(-M)
    do_n = do * inv[:, None]  # dO_i / den_i: d num_i

    dq = tl.zeros([QB, D], tl.float32)
    dphq = tl.zeros([QB, F], tl.float32)
    dtau = tl.zeros([QB], tl.float32)
    for j0 in range(0, n_keys, BN):
        ke, kv, safe, u, kp = _key_rows(keys_ptr, u_ptr, pos_ptr, b, blk, j0, n_blocks, n_keys, n_ext, BN)
        kh = (b * n_ext + safe) * n_kv + kvh
        k = _tile(k_ptr + kh[:, None] * D + d[None, :], kv[:, None], DOTS)  # [BN, D]
        v = _tile(v_ptr + kh[:, None] * D + d[None, :], kv[:, None], DOTS)
        phk = _tile(phk_ptr + kh[:, None] * F + f[None, :], kv[:, None], DOTS)

        in_win, sel = _masks(qp, thu, thp, kp, u, window, HAS_TOPK)
        g, dmask = _gate(sel, u, tau, VARIANT)
        r = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [QB, BN] the ungated logits
        s = r
        if VARIANT == SOFT_KV:
            s = r * g
        att = in_win | sel
        e = tl.exp(tl.where(att, s - M[:, None], float("-inf")))
        lin = tl.dot(phq, tl.trans(phk), input_precision=PREC)
        c = tl.where(sel, tl.where(complete[:, None], 1.0 - g, -g), 0.0)
        w = g * e + c * e_m[:, None] * lin

        dw = (tl.dot(do_t, tl.trans(v), input_precision=PREC) - delta[:, None]) * inv[:, None]  # dO_i.(v_j - o_i) / den_i
        ds = dw * g * e  # through e^{s - M}
        dr = ds
        if VARIANT == SOFT_KV:
            dr = ds * g
        dq += tl.dot(_dot_operand(dr, DOTS), k, input_precision=PREC) * scale
        dlin = dw * c * e_m[:, None]
        dphq += tl.dot(_dot_operand(dlin, DOTS), phk, input_precision=PREC)
        dg = dw * (e - e_m[:, None] * lin)  # c = -g or 1 - g: dc/dg = -1
        if VARIANT == SOFT_KV:
            dg += ds * r
        dm = tl.where(dmask, dg, 0.0)  # window keys' gate is the constant 1
        dtau -= tl.sum(dm, 1)

        dk = tl.dot(tl.trans(_dot_operand(dr, DOTS)), q, input_precision=PREC) * scale  # [BN, D]
        if DOTS:  # dO / den in the weights, so that the dot takes dO as loaded
            dv = tl.dot(tl.trans(_dot_operand(w * inv[:, None], DOTS)), do_t, input_precision=PREC)
        else:
            dv = tl.dot(tl.trans(w), do_n, input_precision=PREC)
        dphk = tl.dot(tl.trans(_dot_operand(dlin, DOTS)), phq, input_precision=PREC)  # [BN, F]
        if ATOMIC:
            # relaxed: plain atomic adds, never read back here (Triton's default acq_rel fences every one; the
            # SparseK pool walk's adds are relaxed too)
            tl.atomic_add(dk_ptr + kh[:, None] * D + d[None, :], dk, mask=kv[:, None], sem="relaxed")
            tl.atomic_add(dv_ptr + kh[:, None] * D + d[None, :], dv, mask=kv[:, None], sem="relaxed")
            tl.atomic_add(dphk_ptr + kh[:, None] * F + f[None, :], dphk, mask=kv[:, None], sem="relaxed")
            tl.atomic_add(du_ptr + b * n_ext + safe, tl.sum(dm, 0), mask=kv, sem="relaxed")
        else:  # scratch rows (tile - tile0, b, h, slot j): each written by this program only (int64: large slabs)
            W = 2 * D + F + 1
            j = j0 + tl.arange(0, BN)
            sr = ((tl.program_id(0).to(tl.int64) * tl.num_programs(1) + bh) * n_keys + j) * W  # [BN]
            tl.store(scratch_ptr + sr[:, None] + d[None, :], dk, mask=kv[:, None])
            tl.store(scratch_ptr + sr[:, None] + D + d[None, :], dv, mask=kv[:, None])
            tl.store(scratch_ptr + sr[:, None] + 2 * D + f[None, :], dphk, mask=kv[:, None])
            tl.store(scratch_ptr + sr + 2 * D + F, tl.sum(dm, 0), mask=kv)

    e_lin = tl.where(complete, 0.0, e_m)  # the linear sums' factor (0 when S is complete)
    tl.store(dq_ptr + qh[:, None] * D + d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=qm[:, None])
    tl.store(dphq_ptr + qh[:, None] * F + f[None, :], dphq.to(dphq_ptr.dtype.element_ty), mask=qm[:, None])
    tl.store(dnum_ptr + qh[:, None] * D + d[None, :], (e_lin[:, None] * do_n).to(dnum_ptr.dtype.element_ty),
             mask=qm[:, None])
    tl.store(dden_ptr + qh, (-e_lin * delta * inv).to(dden_ptr.dtype.element_ty), mask=qm)
    tl.store(dtau_ptr + bh * n_queries + i, dtau, mask=qm)


@triton.jit
def _key_sum_kernel(
    scratch_ptr, order_ptr, start_ptr,
    dk_ptr, dv_ptr, dphk_ptr, du_ptr,  # out: float32 dk, dv [B, N, Hkv, D], dphk [B, N, Hkv, F], du [B, Hkv, N]
    n_ext, n_heads, group, n_bh, slab_blocks, n_keys, tile0, n_tiles, tiles_per_block,
    D: tl.constexpr, F: tl.constexpr, ACCUM: tl.constexpr,
):
    """The deterministic backward's sum (linear_bwd): ext row e of batch row b (r = b N + e, program_id(0)) and KV
    head kvh (program_id(1)). Its entries in the slab's key lists are order[start[r] : start[r + 1]] (flat indices
    into keys[:, slab blocks] [B, slab_blocks, Kb], ascending); for each, in that order, the block's query tiles
    in order and the KV head's query heads in order, it adds the scratch rows _bwd_kernel stored. A fixed order:
    the same sums, bit for bit, every run. ACCUM: add to the outputs (a later slab); else write them."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    n_kv = n_heads // group
    W = 2 * D + F + 1
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    acc_k = tl.zeros([D], tl.float32)
    acc_v = tl.zeros([D], tl.float32)
    acc_p = tl.zeros([F], tl.float32)
    acc_u = tl.zeros([1], tl.float32)
    one = tl.arange(0, 1)
    s0 = tl.load(start_ptr + r)
    s1 = tl.load(start_ptr + r + 1)
    for p in range(s0, s1):
        ent = tl.load(order_ptr + p)
        j = ent % n_keys
        rel = (ent // n_keys) % slab_blocks  # the block within the slab
        b = ent // n_keys // slab_blocks
        t_first = rel * tiles_per_block  # its first query tile within the slab
        for t in range(t_first, tl.minimum(t_first + tiles_per_block, n_tiles - tile0)):  # (the last block: fewer)
            for hh in range(0, group):  # (sr in int64: ent, hence b and j, is)
                sr = ((t * n_bh + b * n_heads + kvh * group + hh) * n_keys + j) * W
                acc_k += tl.load(scratch_ptr + sr + d)
                acc_v += tl.load(scratch_ptr + sr + D + d)
                acc_p += tl.load(scratch_ptr + sr + 2 * D + f)
                acc_u += tl.load(scratch_ptr + sr + 2 * D + F + one)
    ok = (r * n_kv + kvh).to(tl.int64)  # the row of the [B, N, Hkv, .] outputs
    ou = ((r // n_ext) * n_kv + kvh) * n_ext + r % n_ext + one  # du [B, Hkv, N]
    if ACCUM:
        acc_k += tl.load(dk_ptr + ok * D + d)
        acc_v += tl.load(dv_ptr + ok * D + d)
        acc_p += tl.load(dphk_ptr + ok * F + f)
        acc_u += tl.load(du_ptr + ou)
    tl.store(dk_ptr + ok * D + d, acc_k)
    tl.store(dv_ptr + ok * D + d, acc_v)
    tl.store(dphk_ptr + ok * F + f, acc_p)
    tl.store(du_ptr + ou, acc_u)


def _theta32(theta_u: torch.Tensor, theta_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """theta [B, L] as float32 and int32 giving float32 (or half) scores u the naive core's float64 test
    (u, pos) >= (theta_u, theta_pos): the largest float32 t <= theta_u, and where t < theta_u (no float32
    score lies strictly between them, and u == t means u < theta_u) a position no key reaches."""
    t = theta_u.to(torch.float32)
    t = torch.where(t.double() > theta_u, torch.nextafter(t, torch.full_like(t, -float("inf"))), t)
    big = torch.iinfo(torch.int32).max
    thp = torch.where(t.double() == theta_u, theta_pos.clamp(-big - 1, big), big).to(torch.int32)
    return t.contiguous(), thp.contiguous()


def _dots(cfg: dict, dtype: torch.dtype) -> int:
    """The kernels' DOTS (_dot_operand): native for bfloat16 inputs where LAUNCH asks, emulated under the interpreter."""
    return 0 if not cfg["native"] or dtype != torch.bfloat16 else 2 if _INTERP else 1


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
        n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_blocks=nb, n_keys=Kb, topk=topk, window=window, scale=scale,
        G=block, QB=cfg["QB"], BN=cfg["BN"], D=D, F=F, VARIANT=variant, HAS_TOPK=topk > 0, PREC=_precision(q.dtype),
        DOTS=_dots(cfg, q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, M, den_o


def deterministic_backward() -> bool:
    """Whether linear_bwd sums the key-side gradients without atomic adds: DETERMINISTIC, or torch's deterministic
    algorithms (train.deterministic, whose runs take this core: linear.runs_triton_core)."""
    return DETERMINISTIC or torch.are_deterministic_algorithms_enabled()


def scratch_tiles(B: int, L: int, H: int, Kb: int, D: int, F: int, block: int) -> tuple[int, int, int]:
    """The deterministic backward's slabs: (query tiles of QB queries, tiles per slab, scratch bytes of a slab).
    A slab is whole blocks (at least one) whose scratch, B H Kb (2D + F + 1) float32 per tile, fits
    SCRATCH_BYTES."""
    QB = launch_settings(D, block)["bwd"]["QB"]
    tiles, per_block = triton.cdiv(L, QB), block // QB
    tile_bytes = B * H * Kb * (2 * D + F + 1) * 4
    slab = min(max(1, SCRATCH_BYTES // (tile_bytes * per_block)) * per_block, tiles)
    return tiles, slab, slab * tile_bytes


def linear_bwd(q, k_ext, v_ext, u, pos, phq, phk, keys, q_pos, theta_u, theta_pos, tau, o, M, den_o,
               do: torch.Tensor,  # [B, L, H, D] contiguous
               *, topk: int, window: int, scale: float, block: int, variant: int,
               num_dtype: torch.dtype = torch.float32, den_dtype: torch.dtype = torch.float32):
    """The backward kernel (arguments as linear_fwd's and its outputs): dq [B, L, H, D] in q's dtype, dphq
    [B, L, H, F] in phq's, dnum [B, L, H, D] in num_dtype, dden [B, L, H] in den_dtype (the kernel writes them
    in their inputs' dtypes: no float32 copies to cast), dtau [B, L] and, float32, dk, dv [B, N, Hkv, D],
    dphk [B, N, Hkv, F], du [B, N]: atomic adds, or under DETERMINISTIC or torch's deterministic algorithms
    the kernel's scratch rows summed by _key_sum_kernel in a fixed order, one slab of query tiles at a time
    (scratch_tiles)."""
    B, L, H, D = q.shape
    N, Hkv, F = k_ext.shape[1], k_ext.shape[2], phk.shape[-1]
    nb, Kb = keys.shape[1], keys.shape[2]
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    det = deterministic_backward()
    dq, dnum = torch.empty_like(q), torch.empty(B, L, H, D, dtype=num_dtype, device=dev)
    dphq, dden = torch.empty_like(phq), torch.empty(B, L, H, dtype=den_dtype, device=dev)
    dtau = torch.empty(B, H, L, **f32)
    new = torch.empty if det else torch.zeros  # atomic adds: zeroed
    dk, dv = new(B, N, Hkv, D, **f32), new(B, N, Hkv, D, **f32)
    dphk, du = new(B, N, Hkv, F, **f32), new((B, Hkv, N) if det else (B, N), **f32)
    cfg = launch_settings(D, block)["bwd"]
    kernel_args = dict(
        q_ptr=q, k_ptr=k_ext, v_ptr=v_ext, u_ptr=u, pos_ptr=pos, phq_ptr=phq, phk_ptr=phk,
        keys_ptr=keys, q_pos_ptr=q_pos, theta_u_ptr=theta_u, theta_pos_ptr=theta_pos, tau_ptr=tau,
        o_ptr=o, m_ptr=M, l_ptr=den_o, do_ptr=do,
        dq_ptr=dq, dphq_ptr=dphq, dtau_ptr=dtau, dnum_ptr=dnum, dden_ptr=dden,
        dk_ptr=dk, dv_ptr=dv, dphk_ptr=dphk, du_ptr=du,
        n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_blocks=nb, n_keys=Kb, topk=topk, window=window, scale=scale,
        G=block, QB=cfg["QB"], BN=cfg["BN"], D=D, F=F, VARIANT=variant, HAS_TOPK=topk > 0, PREC=_precision(q.dtype),
        DOTS=_dots(cfg, q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if not det:
        _bwd_kernel[(triton.cdiv(L, cfg["QB"]), B * H)](scratch_ptr=dk, tile0=0, ATOMIC=True, **kernel_args)
        return dq, dphq, dtau.sum(1), dnum, dden, dk, dv, dphk, du  # dtau: summed over the heads
    # Deterministic: per slab of query tiles (whole blocks), the kernel stores each program's key-side gradients
    # in scratch [slab tiles, B, H, Kb, 2D + F + 1] float32 (scratch_tiles: at most SCRATCH_BYTES unless one block
    # takes more), and _key_sum_kernel adds them into each ext row and KV head in a fixed order: the key lists'
    # entries of the row, ascending (a stable sort of their destinations), then tiles and heads in order.
    tiles, slab, _ = scratch_tiles(B, L, H, Kb, D, F, block)
    per_block = block // cfg["QB"]
    scratch = torch.empty(slab * B * H * Kb * (2 * D + F + 1), **f32)
    rows = torch.arange(B, device=dev)[:, None, None] * N
    ext_rows = torch.arange(B * N + 1, device=dev)  # each ext row's start in the sorted destinations (searchsorted)
    for t0 in range(0, tiles, slab):
        t1 = min(t0 + slab, tiles)
        _bwd_kernel[(t1 - t0, B * H)](scratch_ptr=scratch, tile0=t0, ATOMIC=False, **kernel_args)
        b0, b1 = t0 // per_block, triton.cdiv(t1, per_block)
        dest = keys[:, b0:b1].long()  # [B, slab blocks, Kb]: each entry's key slot, then its ext row (one buffer
        # less alive through the sort: what memory.linear_triton_scratch_bytes counts, 3 int64 an entry)
        dest = torch.where(dest >= 0, rows + dest, B * N).flatten()  # B N: no key (sorted last, never visited)
        dest, order = torch.sort(dest, stable=True)  # a stable sort: one result, whatever the algorithm
        start = torch.searchsorted(dest, ext_rows)
        _key_sum_kernel[(B * N, Hkv)](
            scratch_ptr=scratch, order_ptr=order, start_ptr=start, dk_ptr=dk, dv_ptr=dv, dphk_ptr=dphk, du_ptr=du,
            n_ext=N, n_heads=H, group=H // Hkv, n_bh=B * H, slab_blocks=b1 - b0, n_keys=Kb, tile0=t0, n_tiles=tiles,
            tiles_per_block=per_block, D=D, F=F, ACCUM=t0 > 0, num_warps=1,
        )
    return dq, dphq, dtau.sum(1), dnum, dden, dk, dv, dphk, du.sum(1)  # dtau, du: summed over the heads


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
        ctx.save_for_backward(q, k_ext, v_ext, u, pos, phq, phk, keys, qpos, thu, thp, tau_c, o, M, den_o)
        ctx.args = args
        ctx.dtypes = [x.dtype for x in (q, phq, tau, num, den, k_ext, v_ext, phk, u_ext)]
        return o

    @staticmethod
    def backward(ctx, do):
        grads = linear_bwd(*ctx.saved_tensors, do.contiguous(), **ctx.args, num_dtype=ctx.dtypes[3], den_dtype=ctx.dtypes[4])
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
