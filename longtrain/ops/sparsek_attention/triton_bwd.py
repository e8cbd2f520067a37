"""Triton backward kernels of SparseK attention.

Math per (query i, key j), with P the softmax, g the gate (1 on window keys), x = scale q.k and
logits z = x (hard_k_soft_v, straight_through) or g x (soft_kv):
    dPg_ij = dO_i . v_j                     dV_j += P_ij g_ij dO_i
    dz_ij  = P_ij (g_ij dPg_ij - Delta_i),  Delta_i = dO_i . o_i
    dQ_i  += dz_ij (g_ij) scale k_j         dK_j += dz_ij (g_ij) scale q_i      ((g) for soft_kv)
    dg_ij  = P_ij dPg_ij (+ dz_ij x_ij for soft_kv)
    dm_ij  = dg_ij on selected keys where 0 <= u_j - tau_i <= 1 (torch's clamp gradient)
    du_j  += sum_i dm_ij (direct term),     dtau_i -= sum_j dm_ij (tau term, chained by ThresholdFn)
straight_through uses g = 1 everywhere except dg.

Three kernels:
- dq: query-major like the forward (the same pool_pass and band_pass, another step); also gives dtau
  per query and stores Delta for the key-major kernels. Its pool tiles follow the stable slots below
  (any order of a tile's pool keys gives the same sums) and their per-slot cut.
- dkv pool (the pool walk): key-major over pool *slots*. Both selection scans keep each key in one
  slot from entering the pool to leaving it (it never returns: irreversibility); a program owns BN
  slots and walks the query tiles in order, so a key's sums stay in registers and are written when it
  leaves its slot. Deterministic mode walks all tiles in one program (each key written once with
  plain stores); the fast mode cuts the walk into segments for parallelism and adds each segment's
  sums with atomic adds (a few per key, not one per query tile). Extra memory O(T).
- dkv band: key-major over ext rows, FA2 style: each program visits the few query tiles whose band
  holds its keys, adds the pool walk's sums and writes the final dK, dV, du.
"""

from __future__ import annotations

import triton
import triton.language as tl

from longtrain.ops.sparsek_attention.triton_tiles import (
    CAUSAL, EDGE, GENERAL, INTERIOR, LOG2E, POOL, SOFT_KV, STRAIGHT_THROUGH, band_origin, band_pass, gather_kv,
    load_keys, load_queries, load_reach, per_query, pool_pass, query_tile, tile_logits,
)


@triton.jit
def tile_grads(s, z, g, dmask, v, do, lse2, delta, scale, VARIANT: tl.constexpr, PREC: tl.constexpr,
               KEY_MAJOR: tl.constexpr):
    """One tile's P g (for dV), dz times the key scale (for dQ/dK) and dm (for du, dtau), from its unscaled
    logits s and masked logits z, gates g and gate-gradient mask (tile_logits): [queries, keys], or
    [keys, queries] when KEY_MAJOR (the dK/dV accumulators' rows are keys, so P and dz feed the next
    dots without a transpose). lse2 and delta: per-query vectors."""
    z2 = z * (scale * LOG2E)  # log2 units, as the forward's log-sum-exp (fused into exp2's FMA)
    p = tl.exp2(z2 - per_query(lse2, KEY_MAJOR))
    if KEY_MAJOR:
        dpg = tl.dot(v, tl.trans(do), input_precision=PREC)
    else:
        dpg = tl.dot(do, tl.trans(v), input_precision=PREC)
    if VARIANT == STRAIGHT_THROUGH:
        dz = p * (dpg - per_query(delta, KEY_MAJOR))
        pg = p
    else:
        dz = p * (g * dpg - per_query(delta, KEY_MAJOR))
        pg = p * g
    dg = p * dpg
    if VARIANT == SOFT_KV:
        dg += dz * (s * scale)
        dz = dz * g
    dm = tl.where(dmask, dg, 0.0)
    return pg, dz, dm


@triton.jit
def dq_step(dq, dtau, unused, s, z, g, dmask, k, v, do, lse2, delta, scale, MODE: tl.constexpr,
            VARIANT: tl.constexpr, PREC: tl.constexpr):
    """pool_pass / band_pass's step for dq: the tile's dq and dtau terms."""
    pg, dz, dm = tile_grads(s, z, g, dmask, v, do, lse2, delta, scale, VARIANT, PREC, False)
    dq += tl.dot(dz.to(k.dtype), k, input_precision=PREC)
    dtau -= tl.sum(dm, 1)
    return dq, dtau, unused


@triton.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr,
    cut_ptr, pool_idx_ptr, pool_u_ptr, reach_ptr,  # the cut kernel's outputs
    do_ptr, o_ptr, lse_ptr, delta_ptr, dq_ptr, dtau_ptr, dk_pool_ptr, dv_pool_ptr, du_pool_ptr,  # out: delta ..
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dol, stride_doh,
    n_queries, n_ext, n_heads, group, n_tiles, topk, window, tail, scale, zero_rows,
    G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr,
):
    """Query-major dq and dtau (and Delta) for query tile blk and one head. With a pool it also zeroes
    the pool walk's fp32 sums (dk_pool, dv_pool [B, N, Hkv, D], du_pool [B, Hkv, N]; the walk runs after
    this kernel): ext rows [blk zero_rows, (blk + 1) zero_rows) of its kv head, by the kv head's first query head."""
    blk, bh, b, h, kvh, rows, i, d, qm, q = query_tile(q_ptr, stride_qb, stride_ql, stride_qh, n_queries, n_heads,
                                                        group, G, D)
    do = tl.load(do_ptr + b * stride_dob + i[:, None] * stride_dol + h * stride_doh + d[None, :], mask=qm[:, None],
                 other=0.0)
    row = b * n_queries + i
    qp, thu, thp, tau = load_queries(q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, row, qm, u_ptr.dtype.element_ty)
    qp_min = tl.min(qp, 0)
    lse2 = tl.load(lse_ptr + bh * n_queries + i, mask=qm, other=float("inf"))
    # Delta_i = dO_i . o_i, stored for the key-major kernels (o has dO's strides: both [B, L, H, D] contiguous)
    o = tl.load(o_ptr + b * stride_dob + i[:, None] * stride_dol + h * stride_doh + d[None, :], mask=qm[:, None],
                other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(delta_ptr + bh * n_queries + i, delta, mask=qm)
    kb_ptr = k_ptr + b * stride_kb + kvh * stride_kh
    vb_ptr = v_ptr + b * stride_vb + kvh * stride_vh
    ub_ptr = u_ptr + b * n_ext
    posb_ptr = pos_ptr + b * n_ext


    dq = tl.zeros([G, D], tl.float32)
    dtau = tl.zeros([G], tl.float32)
    if HAS_TOPK:  # pool snapshot: gathered rows, selected by the per-slot cut
        dq, dtau, _ = pool_pass(dq, dtau, dtau, q, do, lse2, delta, rows, tau, pool_idx_ptr, pool_u_ptr, cut_ptr,
                                (b * n_tiles + blk) * topk, kb_ptr, vb_ptr, stride_kn, stride_vn, topk, scale, dq_step,
                                BN, D, VARIANT, PREC)
    # band: contiguous ext rows; its interior tiles need no masks
    start = band_origin(topk, tail, window) + blk * G
    dq, dtau, _ = band_pass(dq, dtau, dtau, q, do, lse2, delta, rows, qp, thu, thp, tau, qp_min, start, reach_ptr,
                            b * n_tiles + blk, kb_ptr, vb_ptr, ub_ptr, posb_ptr, stride_kn, stride_vn, n_ext, topk,
                            window, scale, dq_step, G, BN, D, VARIANT, HAS_TOPK, PREC)
    tl.store(dq_ptr + b * stride_dob + i[:, None] * stride_dol + h * stride_doh + d[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=qm[:, None])
    tl.store(dtau_ptr + bh * n_queries + i, dtau, mask=qm)
    if HAS_TOPK:
        if h % group == 0:
            n_kv_heads = n_heads // group
            zr = tl.arange(0, 16)
            zero = tl.zeros([16, D], tl.float32)
            end = tl.minimum((blk + 1) * zero_rows, n_ext)
            for r0 in range(blk * zero_rows, end, 16):
                e = r0 + zr
                em = e < end
                ptr = ((b * n_ext + e[:, None]) * n_kv_heads + kvh) * D + d[None, :]
                tl.store(dk_pool_ptr + ptr, zero, mask=em[:, None])
                tl.store(dv_pool_ptr + ptr, zero, mask=em[:, None])
                tl.store(du_pool_ptr + (b * n_kv_heads + kvh) * n_ext + e, tl.zeros([16], tl.float32), mask=em)


@triton.jit
def _dkv_block(
    dk, dv, du, blk, b, kvh,
    k, v, u, kp, kvalid, ke, kj, cut, reach,  # the key tile [BN]; the operands of its kind MODE (others: None)
    q_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, do_ptr, lse_ptr, delta_ptr,
    stride_qb, stride_ql, stride_qh, stride_dob, stride_dol, stride_doh,
    n_queries, n_heads, group, window, scale, qe0,
    MODE: tl.constexpr, G: tl.constexpr, MQ: tl.constexpr, D: tl.constexpr, VARIANT: tl.constexpr,
    HAS_TOPK: tl.constexpr, PREC: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    """Add query tile `blk`'s contributions (all `group` query heads of kv head kvh) to one key tile, MQ
    queries at a time, as [BN, MQ] tiles (KEY_MAJOR) or [MQ, BN] tiles with transposed dots. MODE is the key
    tile's kind for the whole query tile (qe0: query 0's own ext row, for CAUSAL tiles)."""
    d = tl.arange(0, D)
    for c in range(0, G, MQ):
        rows = c + tl.arange(0, MQ)
        i = blk * G + rows
        qm = i < n_queries
        row = b * n_queries + i
        qp = None
        qe = None
        thu = None
        thp = None
        tau = None
        if (MODE == POOL) or (MODE == EDGE):  # the selection is in cut or reach: no positions or theta
            tau = tl.load(tau_ptr + row, mask=qm, other=0.0).to(tl.float32)
        elif MODE == CAUSAL:  # by ext row: no loads
            qe = qe0 + i
        else:
            qp, thu, thp, tau = load_queries(q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, row, qm, u.dtype)
        for r in range(0, group):
            h = kvh * group + r
            bh = b * n_heads + h
            q = tl.load(q_ptr + b * stride_qb + i[:, None] * stride_ql + h * stride_qh + d[None, :], mask=qm[:, None],
                        other=0.0)
            do = tl.load(do_ptr + b * stride_dob + i[:, None] * stride_dol + h * stride_doh + d[None, :],
                         mask=qm[:, None], other=0.0)
            lse2 = tl.load(lse_ptr + bh * n_queries + i, mask=qm, other=float("inf"))
            delta = tl.load(delta_ptr + bh * n_queries + i, mask=qm, other=0.0)
            if KEY_MAJOR:
                s = tl.dot(k, tl.trans(q), input_precision=PREC)  # [BN, MQ] unscaled logits
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [MQ, BN]
            z, g, dmask = tile_logits(s, MODE, VARIANT, HAS_TOPK, KEY_MAJOR, rows=rows, qp=qp, qe=qe, thu=thu, thp=thp,
                                      tau=tau, u=u, kp=kp, ke=ke, kj=kj, kvalid=kvalid, cut=cut, reach=reach,
                                      window=window)
            pg, dz, dm = tile_grads(s, z, g, dmask, v, do, lse2, delta, scale, VARIANT, PREC, KEY_MAJOR)
            if KEY_MAJOR:
                dv += tl.dot(pg.to(do.dtype), do, input_precision=PREC)
                dk += tl.dot(dz.to(q.dtype), q, input_precision=PREC)
                du += tl.sum(dm, 1)
            else:
                dv += tl.dot(tl.trans(pg.to(do.dtype)), do, input_precision=PREC)
                dk += tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision=PREC)
                du += tl.sum(dm, 0)
    return dk, dv, du


@triton.jit
def _kv_head(bk, k_ptr, v_ptr, stride_kb, stride_kh, stride_vb, stride_vh, n_heads, group, D: tl.constexpr):
    """A key-major program's batch row and kv head (bk = b Hkv + kvh), its head dims and its K, V base pointers."""
    n_kv_heads = n_heads // group
    b = bk // n_kv_heads
    kvh = bk % n_kv_heads
    d = tl.arange(0, D)
    kb_ptr = k_ptr + b * stride_kb + kvh * stride_kh
    vb_ptr = v_ptr + b * stride_vb + kvh * stride_vh
    return n_kv_heads, b, kvh, d, kb_ptr, vb_ptr


@triton.jit
def _dkv_pool_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr,
    cut_ptr, pool_idx_ptr, pool_u_ptr, flush_ptr,  # the cut kernel's outputs
    do_ptr, lse_ptr, delta_ptr,
    dk_pool_ptr, dv_pool_ptr, du_pool_ptr,  # out: sums, zeroed by the dq kernel
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dol, stride_doh,
    n_queries, n_ext, n_heads, group: tl.constexpr, n_tiles, topk, window, scale, segment,
    G: tl.constexpr, MQ: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, PREC: tl.constexpr, ATOMIC: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    """Pool slots s0..s0+BN over query tiles [seg segment, (seg+1) segment): a key's sums are written when it
    leaves its slot or the segment ends. One segment: plain stores (each key once, deterministic);
    several: atomic adds, a few per key, into the zeroed fp32 buffers dk_pool, dv_pool [B, N, Hkv, D],
    du_pool [B, Hkv, N]. The loop body's loads sit at its top level (no block-wide branch around them) so
    they can be pipelined; whether any of the BN slots changes after a tile is the cut kernel's flush flag
    (one scalar load instead of a block-wide reduction per step)."""
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    n_kv_heads, b, kvh, d, kb_ptr, vb_ptr = _kv_head(tl.program_id(2), k_ptr, v_ptr, stride_kb, stride_kh, stride_vb,
                                                     stride_vh, n_heads, group, D)
    okv = (b * n_ext * n_kv_heads + kvh) * D
    ou = (b * n_kv_heads + kvh) * n_ext
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    du = tl.zeros([BN], tl.float32)
    s = tile * BN + tl.arange(0, BN)
    sm = s < topk
    ng = tl.cdiv(topk, BN)
    b0 = seg * segment
    b1 = tl.minimum(b0 + segment, n_tiles)
    for blk in range(b0, b1):
        po = (b * n_tiles + blk) * topk  # this tile's row of the cut kernel's outputs
        ke = tl.load(pool_idx_ptr + po + s, mask=sm, other=-1)
        valid = ke >= 0  # (empty slots: zero rows, cut 0, so they add nothing)
        k, v = gather_kv(ke, valid, kb_ptr, vb_ptr, stride_kn, stride_vn, D)
        u = tl.load(pool_u_ptr + po + s, mask=sm, other=float("inf"))
        cut = tl.load(cut_ptr + po + s, mask=sm, other=0)
        dk, dv, du = _dkv_block(dk, dv, du, blk, b, kvh, k, v, u, None, None, None, None, cut, None,
                                q_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, do_ptr, lse_ptr, delta_ptr,
                                stride_qb, stride_ql, stride_qh, stride_dob, stride_dol, stride_doh,
                                n_queries, n_heads, group, window, scale, 0, POOL, G, MQ, D, VARIANT, True, PREC,
                                KEY_MAJOR)
        flush = tl.load(flush_ptr + (b * n_tiles + blk) * ng + tile)
        if (flush != 0) | (blk + 1 == b1):  # few keys leave per tile: skip the masked writes
            not_last = s * 0 + blk + 1 < b1  # (as a vector: the interpreter takes no scalar in a mask)
            nxt = tl.load(pool_idx_ptr + po + topk + s, mask=sm & not_last, other=-1)
            done = valid & (nxt != ke)
            safe = tl.where(done, ke, 0)
            ptr = okv + safe[:, None] * (n_kv_heads * D) + d[None, :]
            if ATOMIC:
                tl.atomic_add(dk_pool_ptr + ptr, dk * scale, mask=done[:, None], sem="relaxed")
                tl.atomic_add(dv_pool_ptr + ptr, dv, mask=done[:, None], sem="relaxed")
                tl.atomic_add(du_pool_ptr + ou + safe, du, mask=done, sem="relaxed")
            else:
                tl.store(dk_pool_ptr + ptr, dk * scale, mask=done[:, None])
                tl.store(dv_pool_ptr + ptr, dv, mask=done[:, None])
                tl.store(du_pool_ptr + ou + safe, du, mask=done)
            dk = tl.where(done[:, None], 0.0, dk)
            dv = tl.where(done[:, None], 0.0, dv)
            du = tl.where(done, 0.0, du)


@triton.jit
def _dkv_band_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, pos_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, reach_ptr,
    do_ptr, lse_ptr, delta_ptr, dk_pool_ptr, dv_pool_ptr, du_pool_ptr,
    dk_ptr, dv_ptr, du_ptr,  # out
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dol, stride_doh, stride_dkb, stride_dkn, stride_dkh,
    n_queries, n_ext, n_heads, group, n_tiles, topk, window, tail, scale,
    G: tl.constexpr, MQ: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    """Ext rows e0..e0+BN (all of [0, N)): visit the query tiles whose band holds them, add the pool walk's
    sums (dk_pool, dv_pool, du_pool, written before this launch) and write the final dK, dV [B, N, Hkv, D] and
    du per kv head [B, Hkv, N]."""
    pid = tl.program_id(0)
    n_kv_heads, b, kvh, d, kb_ptr, vb_ptr = _kv_head(tl.program_id(1), k_ptr, v_ptr, stride_kb, stride_kh, stride_vb,
                                                     stride_vh, n_heads, group, D)
    ub_ptr = u_ptr + b * n_ext
    posb_ptr = pos_ptr + b * n_ext
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    du = tl.zeros([BN], tl.float32)
    ke = pid * BN + tl.arange(0, BN)
    valid = (ke >= topk) & (ke < n_ext)
    a = ke - band_origin(topk, tail, window)  # tile blk's band holds a in [blk G, blk G + w + G - 1)
    band = window + G - 1
    a0 = pid * BN - band_origin(topk, tail, window)
    lo = (tl.maximum(a0 - band + 1, 0) + G - 1) // G
    a1 = a0 + BN - 1
    hi = tl.where(a1 >= 0, tl.minimum(tl.maximum(a1, 0) // G, n_tiles - 1), -1)
    k, v, u, kp = load_keys(ke, valid, kb_ptr, vb_ptr, ub_ptr, posb_ptr, stride_kn, stride_vn, D)
    # Query tiles [lo, c1): keys ahead of or on the diagonal, none below any window (causal mask only);
    # [c1, c2): keys inside every query's window (no mask); [c2, c3): the window's edge (edge_logits: every
    # key is at or before every query); [c3, hi]: the general rules.
    # Needs a tile of real, consecutive key positions and consecutive queries from a valid first one
    # (query tile t holds positions q0 + t G ...); any other tile takes the general rules throughout.
    kmin = tl.min(kp, 0)
    kmax = tl.max(kp, 0)
    q0 = tl.load(q_pos_ptr + b * n_queries).to(tl.int32)
    regular = (tl.sum(valid.to(tl.int32), 0) == BN) & (kmin >= 0) & (kmax - kmin == BN - 1) & (q0 >= 0)
    regular &= BN + G - 2 < window  # then no tile before c1 holds a key below a window
    c1 = (tl.maximum(kmax - q0, 0) + G - 1) // G  # first tile with kmax <= its first query
    c2 = (tl.maximum(kmin - q0 - G + 1 + window, 0) + G - 1) // G  # first tile with a key below a window
    c1 = tl.minimum(tl.maximum(c1, lo), hi + 1)
    c2 = tl.minimum(tl.minimum(tl.maximum(c2, c1), hi + 1), n_queries // G)  # interior tiles: whole tiles of queries
    last_q = tl.load(q_pos_ptr + b * n_queries + tl.maximum(c2 * G - 1, 0), mask=c2 > c1, other=0)
    c2 = tl.where(last_q >= 0, c2, c1)  # padded queries (a suffix) in them: the general rules
    c1 = tl.where(regular, c1, lo)
    c2 = tl.where(regular, tl.maximum(c2, c1), lo)
    qe0 = topk + tail  # query 0's own ext row
    for MODE in tl.static_range(CAUSAL, GENERAL - 1, -1):  # the band's kinds, met in reverse by a key tile
        if MODE == CAUSAL:  # (regular tiles: every key of the tile is in the query tile's band or after it)
            t0 = lo
            t1 = c1
        elif MODE == INTERIOR:
            t0 = c1
            t1 = c2
        elif MODE == EDGE:
            c3 = tl.where(regular, hi + 1, lo)  # [c2, c3): edge tiles; [c3, hi]: the general rules (irregular tiles)
            t0 = c2
            t1 = c3
        else:
            t0 = c3
            t1 = hi + 1
        for blk in range(t0, t1):
            kj = a - blk * G  # the keys' band index in query tile blk (< 0: below its band, the pool's candidates)
            kvalid = valid
            reach = None
            if MODE == EDGE:
                reach = load_reach(reach_ptr + (b * n_tiles + blk) * G, kj, G, HAS_TOPK)
            elif MODE == GENERAL:
                kvalid = valid & (kj >= 0) & (kj < band)
            dk, dv, du = _dkv_block(dk, dv, du, blk, b, kvh, k, v, u, kp, kvalid, ke, kj, None, reach,
                                    q_ptr, q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, do_ptr, lse_ptr, delta_ptr,
                                    stride_qb, stride_ql, stride_qh, stride_dob, stride_dol, stride_doh,
                                    n_queries, n_heads, group, window, scale, qe0, MODE, G, MQ, D, VARIANT, HAS_TOPK,
                                    PREC, KEY_MAJOR)
    em = ke < n_ext
    dk = dk * scale
    ou = (b * n_kv_heads + kvh) * n_ext + ke
    if HAS_TOPK:
        pp = (b * n_ext * n_kv_heads + kvh) * D + ke[:, None] * (n_kv_heads * D) + d[None, :]
        dk += tl.load(dk_pool_ptr + pp, mask=em[:, None], other=0.0)
        dv += tl.load(dv_pool_ptr + pp, mask=em[:, None], other=0.0)
        du += tl.load(du_pool_ptr + ou, mask=em, other=0.0)
    ptr = b * stride_dkb + ke[:, None] * stride_dkn + kvh * stride_dkh + d[None, :]
    tl.store(dk_ptr + ptr, dk.to(dk_ptr.dtype.element_ty), mask=em[:, None])
    tl.store(dv_ptr + ptr, dv.to(dv_ptr.dtype.element_ty), mask=em[:, None])
    tl.store(du_ptr + ou, du, mask=em)
