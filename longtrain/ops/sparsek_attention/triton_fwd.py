"""Triton forward kernel of SparseK attention: FlashAttention-2 online softmax over pool + band.

One program per (query tile of G, batch x head). G is the kernels' own query tile, a multiple of the
op's block: fact 2 of DESIGN.md holds for any run of consecutive queries, so a tile needs only the
pool snapshot at its first query (the op's block_pool row of its first block) plus one contiguous
band of ext rows (i0 - w, i0 + G - 1]. Both are visited as tiles of BN keys. Masks (causal,
window, selected, gate) are recomputed per tile from positions, u, theta and tau, exactly as in
naive.py (triton_tiles.py: the kinds of tiles). On pool tiles the selection test is one integer
compare: `_cut_kernel` counts, per tile and pool slot, the tile's queries that select the key; since
theta never decreases, they are the tile's first `cut` queries (DESIGN.md fact 1). Only O and the
log-sum-exp (base 2, of the unweighted softmax normaliser) are stored. Index, position and theta
inputs arrive in the scan's dtypes (int64, float64) and are cast in the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from longtrain.ops.sparsek_attention.triton_tiles import (
    CAUSAL, INTERIOR, STRAIGHT_THROUGH, band_origin, band_pass, load_queries, load_scores, load_theta, pool_pass,
    query_tile,
)


@triton.jit
def count_selecting(u, kp, valid, q_pos_ptr, theta_u_ptr, theta_pos_ptr, b, t, n_queries, G: tl.constexpr,
                    NK: tl.constexpr):
    """Per key [NK] (score u, position kp): how many valid queries of query tile t have (u, kp) at or above
    their theta (for valid keys; 0 otherwise). Those queries are a prefix of the tile (theta never
    decreases, DESIGN.md fact 1; padding is a suffix), so a binary search finds the count: G.bit_length()
    steps of one theta gather per key (from L1: the tile's G thetas) instead of G compares."""
    lo = tl.zeros([NK], tl.int32)  # queries [0, lo) select the key, [hi, G) do not
    hi = tl.full([NK], G, tl.int32)
    for _ in tl.static_range(G.bit_length()):
        mid = (lo + hi) // 2
        i = t * G + mid
        qm = (mid < hi) & (i < n_queries)
        row = b * n_queries + i
        qp = tl.load(q_pos_ptr + row, mask=qm, other=-1)
        thu, thp = load_theta(theta_u_ptr, theta_pos_ptr, row, qm, u.dtype)
        sel = qm & (qp >= 0) & ((u > thu) | ((u == thu) & (kp >= thp)))
        lo = tl.where(sel, mid + 1, lo)
        hi = tl.where(sel | (mid >= hi), hi, mid)
    return tl.where(valid, lo, 0)


@triton.jit
def _edge_reach(u_ptr, pos_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, reach_ptr, b, t, n_queries, n_ext, n_tiles,
                topk, tail, window, G: tl.constexpr):
    """reach[b, t, kj] = max(kj + 1, count) for query tile t's band keys kj < G (edge_logits)."""
    kj = tl.arange(0, G)
    ke = band_origin(topk, tail, window) + t * G + kj  # band key kj's ext row
    ev = (ke >= topk) & (ke < n_ext)
    u, kp = load_scores(ke, ev, u_ptr + b * n_ext, pos_ptr + b * n_ext)
    cnt = count_selecting(u, kp, ev & (kp >= 0), q_pos_ptr, theta_u_ptr, theta_pos_ptr, b, t, n_queries, G, G)
    tl.store(reach_ptr + (b * n_tiles + t) * G + kj, tl.maximum(cnt, kj + 1))


@triton.jit
def _cut_kernel(
    snapshot_ptr, u_ptr, pos_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr,
    cut_ptr, pool_idx_ptr, pool_u_ptr, flush_ptr, reach_ptr,  # out
    stride_sb, stride_st, n_queries, n_ext, n_tiles, topk, tail, window,
    G: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
):
    """Programs s < cdiv(topk, BK) of query tile t: cut[b, t, s] = how many queries of the tile select
    pool slot s of the snapshot [b, t] (sel = valid key, valid query, (u, pos) >= theta; pool keys are
    candidates of every query of the tile). Also the snapshot compacted for the kernels' pool tiles:
    pool_idx = ext row (int32, -1 empty) and pool_u = its score (float32, +inf empty), so they read contiguous
    rows instead of gathering u. flush[b, t, g] = 1 when a key of slots [g BW, (g + 1) BW) leaves its slot
    after tile t (the pool walk's groups of BW slots write their sums then; BK is a multiple of BW).
    The last program: reach[b, t, kj] = max(kj + 1, count) for the tile's band keys kj < G, the keys at the
    window's edge (edge_logits)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    if tl.program_id(2) == tl.num_programs(2) - 1:
        _edge_reach(u_ptr, pos_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, reach_ptr, b, t, n_queries, n_ext,
                    n_tiles, topk, tail, window, G)
    else:
        s = tl.program_id(2) * BK + tl.arange(0, BK)
        sm = s < topk
        ke = tl.load(snapshot_ptr + b * stride_sb + t * stride_st + s, mask=sm, other=-1).to(tl.int32)
        valid = ke >= 0
        u, kp = load_scores(ke, valid, u_ptr + b * n_ext, pos_ptr + b * n_ext)
        cnt = count_selecting(u, kp, valid, q_pos_ptr, theta_u_ptr, theta_pos_ptr, b, t, n_queries, G, BK)
        o = (b * n_tiles + t) * topk + s
        tl.store(cut_ptr + o, cnt, mask=sm)
        tl.store(pool_idx_ptr + o, ke, mask=sm)
        tl.store(pool_u_ptr + o, tl.where(valid, u.to(tl.float32), float("inf")), mask=sm)
        not_last = s * 0 + t + 1 < n_tiles  # (as a vector: the interpreter takes no scalar in a mask)
        nxt = tl.load(snapshot_ptr + b * stride_sb + (t + 1) * stride_st + s, mask=sm & not_last, other=-1).to(tl.int32)
        leave = tl.reshape((valid & (nxt != ke)).to(tl.int32), [BK // BW, BW])
        grp = tl.program_id(2) * (BK // BW) + tl.arange(0, BK // BW)
        ng = tl.cdiv(topk, BW)
        tl.store(flush_ptr + (b * n_tiles + t) * ng + grp, tl.max(leave, 1), mask=grp < ng)


@triton.jit
def _by_position_kernel(
    cut_ptr, pool_idx_ptr, pool_u_ptr, pos_ptr,
    cut_out_ptr, pool_idx_out_ptr, pool_u_out_ptr,  # out
    n_ext, n_tiles, topk, KP: tl.constexpr,
):
    """Query tile t's pool row [b, t] of the cut kernel's outputs in ascending key position, empty slots first in
    slot order (naive.position_order's stable argsort): one sort of [KP] int64 keys (position + 1) KP + slot
    (0 for an empty slot's position, so empties come first; slots past topk sort last and are not written)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.arange(0, KP)
    sm = s < topk
    row = (b * n_tiles + t) * topk
    ke = tl.load(pool_idx_ptr + row + s, mask=sm, other=-1)
    kp = tl.load(pos_ptr + b * n_ext + ke, mask=sm & (ke >= 0), other=-1).to(tl.int64)
    key = tl.where(sm, (kp + 1) * KP + s, 1 << 62)  # unique per slot: the sort's order is the stable one
    slot = (tl.sort(key) % KP).to(tl.int32)  # [KP] the slot that goes to place s
    tl.store(cut_out_ptr + row + s, tl.load(cut_ptr + row + slot, mask=sm), mask=sm)
    tl.store(pool_idx_out_ptr + row + s, tl.load(pool_idx_ptr + row + slot, mask=sm), mask=sm)
    tl.store(pool_u_out_ptr + row + s, tl.load(pool_u_ptr + row + slot, mask=sm), mask=sm)


@triton.jit
def _fwd_update(m_i, l_i, acc, s, g, v, scale2, NO_GATE: tl.constexpr, VARIANT: tl.constexpr,
                PREC: tl.constexpr):
    """Online softmax step with masked unscaled logits s [G, BN] and gates g; m_i, the log-sum-exp
    and scale2 (scale * log2 e) in log2 units: the scale goes into exp2's argument (one FMA).

    The running max is rounded up to a whole number (log2 units): p is rounded to v's dtype (bf16:
    8 bits) before the value dot, and which running max a key meets depends on the tiles it was
    visited in, i.e. on where the chunk boundaries fall. With a whole-number max, two visits of the
    same key differ by a power of two, so p rounds to the same half-precision mantissa and the
    output no longer depends on the tiling beyond float32 accumulation order (issue 24)."""
    m_new = tl.maximum(m_i, tl.ceil(tl.max(s, 1) * scale2))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay NaN-free
    p = tl.exp2(s * scale2 - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if VARIANT != STRAIGHT_THROUGH and not NO_GATE:
        p = p * g  # the gate scales values after normalisation
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def fwd_step(m_i, l_i, acc, s, z, g, dmask, k, v, do, lse2, delta, scale2, MODE: tl.constexpr, VARIANT: tl.constexpr,
             PREC: tl.constexpr):
    """pool_pass / band_pass's step for the forward: the online softmax over one key tile's masked logits z."""
    return _fwd_update(m_i, l_i, acc, z, g, v, scale2, (MODE == INTERIOR) or (MODE == CAUSAL), VARIANT, PREC)


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr,
    cut_ptr, pool_idx_ptr, pool_u_ptr, reach_ptr,  # the cut kernel's outputs
    o_ptr, lse_ptr,  # out
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ob, stride_ol, stride_oh,
    n_queries, n_ext, n_heads, group, n_tiles, topk, window, tail, scale2,
    G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr,
):
    """o and the base-2 log-sum-exp of query tile blk and one head: the pool snapshot, then the band."""
    blk, bh, b, h, kvh, rows, i, d, qm, q = query_tile(q_ptr, stride_qb, stride_ql, stride_qh, n_queries, n_heads,
                                                        group, G, D)
    row = b * n_queries + i  # per-query arrays are [B, L] contiguous
    qp, thu, thp, tau = load_queries(q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, row, qm, u_ptr.dtype.element_ty)
    qp_min = tl.min(qp, 0)
    kb_ptr = k_ptr + b * stride_kb + kvh * stride_kh
    vb_ptr = v_ptr + b * stride_vb + kvh * stride_vh
    ub_ptr = u_ptr + b * n_ext
    posb_ptr = pos_ptr + b * n_ext

    m_i = tl.full([G], float("-inf"), tl.float32)
    l_i = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    if HAS_TOPK:  # (1) the pool snapshot at the tile start: gathered rows, selected by the per-slot cut
        m_i, l_i, acc = pool_pass(m_i, l_i, acc, q, None, None, None, rows, tau, pool_idx_ptr,
                                  pool_u_ptr, cut_ptr, (b * n_tiles + blk) * topk, kb_ptr, vb_ptr, stride_kn, stride_vn,
                                  topk, scale2, fwd_step, BN, D, VARIANT, PREC)
    # (2) the band (i0 - w, i0 + G - 1]: contiguous ext rows; its interior tiles need no masks
    start = band_origin(topk, tail, window) + blk * G
    m_i, l_i, acc = band_pass(m_i, l_i, acc, q, None, None, None, rows, qp, thu, thp, tau, qp_min, start, reach_ptr,
                              b * n_tiles + blk, kb_ptr, vb_ptr, ub_ptr, posb_ptr, stride_kn, stride_vn, n_ext, topk,
                              window, scale2, fwd_step, G, BN, D, VARIANT, HAS_TOPK, PREC)

    has = l_i > 0  # padded queries attend to nothing: o = 0, lse = +inf (p = 0 in the backward)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * stride_ob + i[:, None] * stride_ol + h * stride_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=qm[:, None])
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + bh * n_queries + i, lse, mask=qm)
