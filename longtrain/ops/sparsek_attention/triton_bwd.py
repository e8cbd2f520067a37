"""Triton backward kernels of SparseK attention: deterministic, no atomics.

Math per (query i, key j), with P the softmax, g the gate (1 on window keys), x = scale q.k and
logits z = x (hard_k_soft_v, straight_through) or g x (soft_kv):
    dPg_ij = dO_i . v_j                     dV_j += P_ij g_ij dO_i
    dz_ij  = P_ij (g_ij dPg_ij - Delta_i),  Delta_i = dO_i . o_i
    dQ_i  += dz_ij (g_ij) scale k_j         dK_j += dz_ij (g_ij) scale q_i      ((g) for soft_kv)
    dg_ij  = P_ij dPg_ij (+ dz_ij x_ij for soft_kv)
    dm_ij  = dg_ij on selected keys where 0 <= u_j - tau_i <= 1 (torch's clamp gradient)
    du_j  += sum_i dm_ij (direct term),     dtau_i -= sum_j dm_ij (tau term, chained by ThresholdFn)
straight_through uses g = 1 everywhere except dg.

Two kernels:
- dq: query-major like the forward (pool tiles then band tiles); also gives dtau per query and
  stores Delta for the key-major kernels. Its pool tiles follow the stable slots below (any order of
  a tile's pool keys gives the same sums) and their per-slot cut.
- dkv pool: key-major over pool *slots*. Both selection scans keep each key in one slot from entering
  the pool to leaving it (it never returns: irreversibility); a program owns
  BN slots and walks the query blocks in order, so a key's sums stay in registers and are written
  when it leaves its slot. Deterministic mode walks all blocks in one program (each key written
  once, no atomics); the fast mode cuts the walk into segments for parallelism and adds each
  segment's sums atomically (a few adds per key, not one per query block). Extra memory O(T).
- dkv band: key-major over ext rows, FA2 style: each program visits the few query blocks whose band
  holds its keys, adds the pool sums and writes the final dK, dV, du.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from longtrain.ops.sparsek_attention.triton_fwd import (
    band_mode, band_origin, causal_logits, gather_kv, interior_tiles, load_keys, load_pool_keys, load_queries, load_reach,
    masked_logits, pool_logits, reach_logits,
)


@triton.jit
def _grad_tile(mode, q, do, lse2, delta, k, v, u, kp, kvalid, qp, thu, thp, tau, rows, cut, WINDOW, scale,
               VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr, IS_POOL: tl.constexpr,
               KEY_MAJOR: tl.constexpr, FIXED: tl.constexpr = -1):
    """One tile: P g (for dV), dz times the key scale (for dQ/dK) and dm (for du, dtau), [G, BN]
    query-major or [BN, G] key-major (KEY_MAJOR: the dK/dV accumulators' rows are keys, so P and dz
    feed the next dots without a transpose). The per-query (lse2, delta, qp, thu, thp, tau, rows) and
    per-key (u, kp, kvalid, cut) operands come expanded to broadcast against the tile. Pool tiles
    (IS_POOL) select by the per-key cut, band tiles by masked_logits' runtime mode (FIXED -1) or by a
    mode fixed at compile time: masked_logits' 0 or 1, causal_logits (2), reach_logits (3: kp holds the
    keys' band index in the query tile, cut their reach)."""
    if KEY_MAJOR:
        s = tl.dot(k, tl.trans(q), input_precision=PREC)  # [BN, G] unscaled logits
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [G, BN]
    if IS_POOL:
        z, g, dmask = pool_logits(s, rows, cut, u, tau, VARIANT)
    elif FIXED == 2:
        z, g, dmask = causal_logits(s, qp, kp)
    elif FIXED == 3:
        z, g, dmask = reach_logits(s, rows, kp, cut, u, tau, VARIANT, HAS_TOPK, KEY_MAJOR)
    else:  # (mode is FIXED itself where FIXED is 0 or 1)
        z, g, dmask = masked_logits(mode, s, qp, thu, thp, tau, kp, u, kvalid, WINDOW, VARIANT, HAS_TOPK)
    z2 = z * (scale * 1.4426950408889634)  # log2 units, as the forward's log-sum-exp (fused into exp2's FMA)
    p = tl.exp2(z2 - lse2)
    if KEY_MAJOR:
        dpg = tl.dot(v, tl.trans(do), input_precision=PREC)
    else:
        dpg = tl.dot(do, tl.trans(v), input_precision=PREC)
    if VARIANT == 2:
        dz = p * (dpg - delta)
        pg = p
    else:
        dz = p * (g * dpg - delta)
        pg = p * g
    dg = p * dpg
    if VARIANT == 1:
        dg += dz * (s * scale)
        dz = dz * g
    dm = tl.where(dmask, dg, 0.0)
    return pg, dz, dm


@triton.jit
def _dq_tile(mode, dq, dtau, k, v, u, kp, valid, q, do, lse2, delta, qp, thu, thp, tau, rows, cut, WINDOW, scale,
             VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr, IS_POOL: tl.constexpr):
    pg, dz, dm = _grad_tile(mode, q, do, lse2, delta, k, v, u[None, :], kp[None, :], valid[None, :], qp, thu, thp, tau,
                            rows, cut[None, :], WINDOW, scale, VARIANT, HAS_TOPK, PREC, IS_POOL, False, mode)
    dq += tl.dot(dz.to(k.dtype), k, input_precision=PREC)
    dtau -= tl.sum(dm, 1)
    return dq, dtau


@triton.jit
def _dq_band_tile(mode, dq, dtau, idx, valid, q, do, lse2, delta, Kb, Vb, Ub, Pb, skn, svn, qp, thu, thp, tau, rows,
                  jj, reach, WINDOW, scale, D: tl.constexpr, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr,
                  PREC: tl.constexpr):
    """mode 2 (causal_logits): qp is each query's own ext index and nothing but k, v is loaded; mode 3
    (reach_logits): the keys' band index jj and reach select."""
    if mode == 2:
        k, v = gather_kv(idx, valid, Kb, Vb, skn, svn, D)
        return _dq_tile(mode, dq, dtau, k, v, idx, idx, valid, q, do, lse2, delta, qp, thu, thp, tau, rows, idx,
                        WINDOW, scale, VARIANT, HAS_TOPK, PREC, False)
    k, v, u, kp = load_keys(idx, valid, Kb, Vb, Ub, Pb, skn, svn, D)
    if mode == 3:  # reach_logits reads the band index and reach where the others read positions
        kp = jj
        sel = reach
    else:
        sel = kp
    return _dq_tile(mode, dq, dtau, k, v, u, kp, valid, q, do, lse2, delta, qp, thu, thp, tau, rows, sel, WINDOW, scale,
                    VARIANT, HAS_TOPK, PREC, False)


@triton.jit
def _dq_kernel(
    Q, Kx, Vx, U, POS, QPOS, THU, THP, TAU, CUT, PI, PU, REACH, DO, O, LSE, DELTA, DQ, DTAU, DKP, DVP, DUP,
    sqb, sql, sqh, skb, skn, skh, svb, svn, svh, sdob, sdol, sdoh,
    L, N, H, R, NBQ, TOPK, WINDOW, TAIL, scale, ZROWS,
    G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr,
):
    """Query-major dq and dtau (and Delta) for query tile blk and one head. With a pool it also zeroes
    the pool walk's fp32 sums (DKP, DVP [B, N, Hkv, D], DUP [B, Hkv, N]; the walk runs after this
    kernel): ext rows [blk ZROWS, (blk + 1) ZROWS) of its kv head, by the kv head's first query head."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // R
    rows = tl.arange(0, G)
    i = blk * G + rows
    d = tl.arange(0, D)
    qm = i < L
    q = tl.load(Q + b * sqb + i[:, None] * sql + h * sqh + d[None, :], mask=qm[:, None], other=0.0)  # [G, D]
    do = tl.load(DO + b * sdob + i[:, None] * sdol + h * sdoh + d[None, :], mask=qm[:, None], other=0.0)
    row = b * L + i
    qp, thu, thp, tau = load_queries(QPOS, THU, THP, TAU, row, qm, U.dtype.element_ty)
    qp_min = tl.min(qp, 0)
    lse2 = tl.load(LSE + bh * L + i, mask=qm, other=float("inf"))
    # Delta_i = dO_i . o_i, stored for the key-major kernels (O has dO's strides: both [B, L, H, D] contiguous)
    o = tl.load(O + b * sdob + i[:, None] * sdol + h * sdoh + d[None, :], mask=qm[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + bh * L + i, delta, mask=qm)
    Kb = Kx + b * skb + kvh * skh
    Vb = Vx + b * svb + kvh * svh
    Ub = U + b * N
    Pb = POS + b * N
    rows2, lse22, delta2 = rows[:, None], lse2[:, None], delta[:, None]
    qp2, thu2, thp2, tau2 = qp[:, None], thu[:, None], thp[:, None], tau[:, None]

    dq = tl.zeros([G, D], tl.float32)
    dtau = tl.zeros([G], tl.float32)
    if HAS_TOPK:  # pool snapshot: gathered rows, selected by the per-slot cut
        po = (b * NBQ + blk) * TOPK
        for t in range(0, TOPK, BN):
            k, v, u, cut = load_pool_keys(PI, PU, CUT, po, t + tl.arange(0, BN), TOPK, Kb, Vb, skn, svn, D)
            dq, dtau = _dq_tile(3, dq, dtau, k, v, u, cut, cut >= 0, q, do, lse22, delta2, qp2, thu2, thp2, tau2, rows2,
                                cut, WINDOW, scale, VARIANT, HAS_TOPK, PREC, True)
    # band: contiguous ext indices; its interior tiles need no masks
    start = band_origin(TOPK, TAIL, WINDOW) + blk * G
    band = WINDOW + G - 1
    nt = tl.cdiv(band, BN)
    e0, f0, f1 = interior_tiles(qp_min, nt, WINDOW, G, BN)
    ro = (b * NBQ + blk) * G  # this tile's row of REACH
    for t in range(0, e0):
        jj = t * BN + tl.arange(0, BN)
        valid = (jj < band) & (start + jj >= TOPK) & (start + jj < N)
        dq, dtau = _dq_band_tile(0, dq, dtau, start + jj, valid, q, do, lse22, delta2, Kb, Vb, Ub, Pb, skn, svn,
                                 qp2, thu2, thp2, tau2, rows2, jj, jj, WINDOW, scale, D, VARIANT, HAS_TOPK, PREC)
    for t in range(e0, f0):
        jj = t * BN + tl.arange(0, BN)
        reach = load_reach(REACH, ro, jj, G, HAS_TOPK)
        dq, dtau = _dq_band_tile(3, dq, dtau, start + jj, jj >= 0, q, do, lse22, delta2, Kb, Vb, Ub, Pb, skn, svn,
                                 qp2, thu2, thp2, tau2, rows2, jj, reach, WINDOW, scale, D, VARIANT, HAS_TOPK, PREC)
    for t in range(f0, f1):
        jj = t * BN + tl.arange(0, BN)
        dq, dtau = _dq_band_tile(1, dq, dtau, start + jj, jj >= 0, q, do, lse22, delta2, Kb, Vb, Ub, Pb, skn, svn,
                                 qp2, thu2, thp2, tau2, rows2, jj, jj, WINDOW, scale, D, VARIANT, HAS_TOPK, PREC)
    qe2 = (start + WINDOW - 1 + rows)[:, None]  # each query's own ext index, for the causal tiles
    for t in range(f1, nt):
        jj = t * BN + tl.arange(0, BN)
        valid = (jj < band) & (start + jj < N)
        dq, dtau = _dq_band_tile(2, dq, dtau, start + jj, valid, q, do, lse22, delta2, Kb, Vb, Ub, Pb, skn, svn,
                                 qe2, thu2, thp2, tau2, rows2, jj, jj, WINDOW, scale, D, VARIANT, HAS_TOPK, PREC)
    tl.store(DQ + b * sdob + i[:, None] * sdol + h * sdoh + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=qm[:, None])
    tl.store(DTAU + bh * L + i, dtau, mask=qm)
    if HAS_TOPK:
        if h % R == 0:
            Hkv = H // R
            zr = tl.arange(0, 16)
            zero = tl.zeros([16, D], tl.float32)
            end = tl.minimum((blk + 1) * ZROWS, N)
            for r0 in range(blk * ZROWS, end, 16):
                e = r0 + zr
                em = e < end
                ptr = ((b * N + e[:, None]) * Hkv + kvh) * D + d[None, :]
                tl.store(DKP + ptr, zero, mask=em[:, None])
                tl.store(DVP + ptr, zero, mask=em[:, None])
                tl.store(DUP + (b * Hkv + kvh) * N + e, tl.zeros([16], tl.float32), mask=em)


@triton.jit
def _dkv_block(dk, dv, du, blk, b, kvh, k, v, u, kp, kvalid, cut,
               Q, QPOS, THU, THP, TAU, DO, LSE, DELTA, sqb, sql, sqh, sdob, sdol, sdoh,
               L, H, R, WINDOW, scale, QE0, UTY: tl.constexpr,
               G: tl.constexpr, MQ: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, VARIANT: tl.constexpr,
               HAS_TOPK: tl.constexpr, IS_POOL: tl.constexpr, PREC: tl.constexpr, KEY_MAJOR: tl.constexpr,
               MODE: tl.constexpr = -1):
    """Add query tile `blk`'s contributions (all R query heads of kv head kvh) to one key tile, MQ
    queries at a time, as [BN, MQ] tiles (KEY_MAJOR) or [MQ, BN] tiles with transposed dots.
    Band tiles: MODE -1 picks masked_logits' mode per step (and skips causally empty steps); 0 and 1
    are masked_logits' modes, 2 causal_logits (kp: the keys' ext indices; QE0: query 0's own ext index),
    3 reach_logits (kp: the keys' band index in the query tile, cut: their reach), fixed by the caller
    for the whole query tile."""
    d = tl.arange(0, D)
    u2, kp2, kvalid2, cut2 = u[:, None], kp[:, None], kvalid[:, None], cut[:, None]
    for c in range(0, G, MQ):
        rows = c + tl.arange(0, MQ)
        i = blk * G + rows
        qm = i < L
        row = b * L + i
        if IS_POOL or (MODE == 3):  # the selection is in cut; positions and theta are not needed
            tau = tl.load(TAU + row, mask=qm, other=0.0).to(tl.float32)
            qp = rows
            thu = tau
            thp = rows
            mode = 3
            live = c * 0 + 1
        elif MODE == 2:  # causal_logits by ext index (kp holds the keys' ext indices); no loads
            qp = QE0 + i
            thu = tl.zeros([MQ], tl.float32)
            thp = qp
            tau = thu
            mode = MODE
            live = c * 0 + 1
        elif MODE == -1:
            qp, thu, thp, tau = load_queries(QPOS, THU, THP, TAU, row, qm, UTY)
            mode = band_mode(kp, kvalid, tl.min(qp, 0), WINDOW, MQ, BN)
            kmin = tl.min(tl.where(kvalid, kp, 2147483647), 0)
            live = (kmin <= tl.max(qp, 0)) & (tl.max(kvalid.to(tl.int32), 0) > 0)  # else causally masked
        else:
            qp, thu, thp, tau = load_queries(QPOS, THU, THP, TAU, row, qm, UTY)
            mode = MODE
            live = c * 0 + 1
        if live:
            for r in range(0, R):
                h = kvh * R + r
                bh = b * H + h
                q = tl.load(Q + b * sqb + i[:, None] * sql + h * sqh + d[None, :], mask=qm[:, None], other=0.0)
                do = tl.load(DO + b * sdob + i[:, None] * sdol + h * sdoh + d[None, :], mask=qm[:, None], other=0.0)
                lse2 = tl.load(LSE + bh * L + i, mask=qm, other=float("inf"))
                delta = tl.load(DELTA + bh * L + i, mask=qm, other=0.0)
                if KEY_MAJOR:
                    pg, dz, dm = _grad_tile(mode, q, do, lse2[None, :], delta[None, :], k, v, u2, kp2, kvalid2,
                                            qp[None, :], thu[None, :], thp[None, :], tau[None, :], rows[None, :],
                                            cut2, WINDOW, scale, VARIANT, HAS_TOPK, PREC, IS_POOL, True, MODE)
                    dv += tl.dot(pg.to(do.dtype), do, input_precision=PREC)
                    dk += tl.dot(dz.to(q.dtype), q, input_precision=PREC)
                    du += tl.sum(dm, 1)
                else:
                    pg, dz, dm = _grad_tile(mode, q, do, lse2[:, None], delta[:, None], k, v, u[None, :],
                                            kp[None, :], kvalid[None, :], qp[:, None], thu[:, None], thp[:, None],
                                            tau[:, None], rows[:, None], cut[None, :], WINDOW, scale, VARIANT,
                                            HAS_TOPK, PREC, IS_POOL, False, MODE)
                    dv += tl.dot(tl.trans(pg.to(do.dtype)), do, input_precision=PREC)
                    dk += tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision=PREC)
                    du += tl.sum(dm, 0)
    return dk, dv, du


@triton.jit
def _dkv_pool_kernel(
    Q, Kx, Vx, U, POS, QPOS, THU, THP, TAU, CUT, PI, PU, FLUSH, DO, LSE, DELTA, DKP, DVP, DUP,
    sqb, sql, sqh, skb, skn, skh, svb, svn, svh, sdob, sdol, sdoh,
    L, N, H, R: tl.constexpr, NB, TOPK, WINDOW, scale, SEG,
    G: tl.constexpr, MQ: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, PREC: tl.constexpr, ATOMIC: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    """Pool slots s0..s0+BN over query tiles [seg SEG, (seg+1) SEG): a key's sums are written when it
    leaves its slot or the segment ends. One segment: plain stores (each key once, deterministic);
    several: atomic adds, a few per key, into the zeroed fp32 buffers DKP, DVP [B, N, Hkv, D], DUP [B, Hkv, N].
    The loop body's loads sit at its top level (no block-wide branch around them) so they can be
    pipelined; whether any of the BN slots changes after a tile is the cut kernel's FLUSH flag (one
    scalar load instead of a block-wide reduction per step)."""
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    bk = tl.program_id(2)
    Hkv = H // R
    b = bk // Hkv
    kvh = bk % Hkv
    d = tl.arange(0, D)
    Kb = Kx + b * skb + kvh * skh
    Vb = Vx + b * svb + kvh * svh
    okv = (b * N * Hkv + kvh) * D
    ou = (b * Hkv + kvh) * N
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    du = tl.zeros([BN], tl.float32)
    s = tile * BN + tl.arange(0, BN)
    sm = s < TOPK
    ng = tl.cdiv(TOPK, BN)
    b0 = seg * SEG
    b1 = tl.minimum(b0 + SEG, NB)
    for blk in range(b0, b1):
        po = (b * NB + blk) * TOPK  # this tile's row of the cut kernel's outputs
        idx = tl.load(PI + po + s, mask=sm, other=-1)
        valid = idx >= 0  # (empty slots: zero rows, cut 0, so they add nothing)
        k, v = gather_kv(idx, valid, Kb, Vb, skn, svn, D)
        u = tl.load(PU + po + s, mask=sm, other=float("inf"))
        cut = tl.load(CUT + po + s, mask=sm, other=0)
        dk, dv, du = _dkv_block(dk, dv, du, blk, b, kvh, k, v, u, cut, valid, cut,
                                Q, QPOS, THU, THP, TAU, DO, LSE, DELTA, sqb, sql, sqh, sdob, sdol, sdoh,
                                L, H, R, WINDOW, scale, 0, U.dtype.element_ty, G, MQ, BN, D, VARIANT, True, True, PREC,
                                KEY_MAJOR)
        flush = tl.load(FLUSH + (b * NB + blk) * ng + tile)
        if (flush != 0) | (blk + 1 == b1):  # few keys leave per tile: skip the masked writes
            nxt = tl.load(PI + po + TOPK + s, mask=sm & (s * 0 + blk + 1 < b1), other=-1)
            done = valid & (nxt != idx)
            safe = tl.where(done, idx, 0)
            ptr = okv + safe[:, None] * (Hkv * D) + d[None, :]
            if ATOMIC:
                tl.atomic_add(DKP + ptr, dk * scale, mask=done[:, None], sem="relaxed")
                tl.atomic_add(DVP + ptr, dv, mask=done[:, None], sem="relaxed")
                tl.atomic_add(DUP + ou + safe, du, mask=done, sem="relaxed")
            else:
                tl.store(DKP + ptr, dk * scale, mask=done[:, None])
                tl.store(DVP + ptr, dv, mask=done[:, None])
                tl.store(DUP + ou + safe, du, mask=done)
            dk = tl.where(done[:, None], 0.0, dk)
            dv = tl.where(done[:, None], 0.0, dv)
            du = tl.where(done, 0.0, du)


@triton.jit
def _dkv_band_kernel(
    Q, Kx, Vx, U, POS, QPOS, THU, THP, TAU, REACH, DO, LSE, DELTA, DKP, DVP, DUP, DK, DV, DU,
    sqb, sql, sqh, skb, skn, skh, svb, svn, svh, sdob, sdol, sdoh, sdkb, sdkn, sdkh,
    L, N, H, R, NB, TOPK, WINDOW, TAIL, scale,
    G: tl.constexpr, MQ: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    """Ext rows e0..e0+BN (all of [0, N)): visit the query tiles whose band holds them, add the pool
    sums (DKP, DVP, DUP, written before this launch) and write the final dK, dV [B, N, Hkv, D] and
    du per kv head [B, Hkv, N]."""
    pid = tl.program_id(0)
    bk = tl.program_id(1)
    Hkv = H // R
    b = bk // Hkv
    kvh = bk % Hkv
    d = tl.arange(0, D)
    Kb = Kx + b * skb + kvh * skh
    Vb = Vx + b * svb + kvh * svh
    Ub = U + b * N
    Pb = POS + b * N
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    du = tl.zeros([BN], tl.float32)
    e = pid * BN + tl.arange(0, BN)
    valid = (e >= TOPK) & (e < N)
    a = e - band_origin(TOPK, TAIL, WINDOW)  # tile blk's band holds a in [blk G, blk G + w + G - 1)
    band = WINDOW + G - 1
    a0 = pid * BN - band_origin(TOPK, TAIL, WINDOW)
    lo = (tl.maximum(a0 - band + 1, 0) + G - 1) // G
    a1 = a0 + BN - 1
    hi = tl.where(a1 >= 0, tl.minimum(tl.maximum(a1, 0) // G, NB - 1), -1)
    k, v, u, kp = load_keys(e, valid, Kb, Vb, Ub, Pb, skn, svn, D)
    # Query tiles [lo, c1): keys ahead of or on the diagonal, none below any window (causal mask only);
    # [c1, c2): keys inside every query's window (no mask); [c2, hi]: the window's edge (reach_logits: every
    # key is at or before every query).
    # Needs a tile of real, consecutive key positions and consecutive queries from a valid first one
    # (query tile t holds positions q0 + t G ...); any other tile takes the general rules throughout.
    kmin = tl.min(kp, 0)
    kmax = tl.max(kp, 0)
    q0 = tl.load(QPOS + b * L).to(tl.int32)
    regular = (tl.sum(valid.to(tl.int32), 0) == BN) & (kmin >= 0) & (kmax - kmin == BN - 1) & (q0 >= 0)
    regular &= BN + G - 2 < WINDOW  # then no tile before c1 holds a key below a window
    c1 = (tl.maximum(kmax - q0, 0) + G - 1) // G  # first tile with kmax <= its first query
    c2 = (tl.maximum(kmin - q0 - G + 1 + WINDOW, 0) + G - 1) // G  # first tile with a key below a window
    c1 = tl.minimum(tl.maximum(c1, lo), hi + 1)
    c2 = tl.minimum(tl.minimum(tl.maximum(c2, c1), hi + 1), L // G)  # interior tiles: whole tiles of queries
    last_q = tl.load(QPOS + b * L + tl.maximum(c2 * G - 1, 0), mask=c2 > c1, other=0)
    c2 = tl.where(last_q >= 0, c2, c1)  # padded queries (a suffix) in them: the general rules
    c1 = tl.where(regular, c1, lo)
    c2 = tl.where(regular, tl.maximum(c2, c1), lo)
    qe0 = TOPK + TAIL  # query 0's own ext index
    for blk in range(lo, c1):  # (regular tiles: every key of the tile is in the query tile's band or after it)
        dk, dv, du = _dkv_block(dk, dv, du, blk, b, kvh, k, v, u, e, valid, e,
                                Q, QPOS, THU, THP, TAU, DO, LSE, DELTA, sqb, sql, sqh, sdob, sdol, sdoh,
                                L, H, R, WINDOW, scale, qe0, U.dtype.element_ty, G, MQ, BN, D, VARIANT, HAS_TOPK, False,
                                PREC, KEY_MAJOR, 2)
    for blk in range(c1, c2):
        dk, dv, du = _dkv_block(dk, dv, du, blk, b, kvh, k, v, u, kp, valid, e,
                                Q, QPOS, THU, THP, TAU, DO, LSE, DELTA, sqb, sql, sqh, sdob, sdol, sdoh,
                                L, H, R, WINDOW, scale, qe0, U.dtype.element_ty, G, MQ, BN, D, VARIANT, HAS_TOPK, False,
                                PREC, KEY_MAJOR, 1)
    c3 = tl.where(regular, hi + 1, lo)  # [c2, c3): edge tiles; [c3, hi]: the general rules (irregular tiles)
    for blk in range(c2, c3):
        off = a - blk * G  # the keys' band index in query tile blk (< 0: below its band, the pool's candidates)
        reach = load_reach(REACH, (b * NB + blk) * G, off, G, HAS_TOPK)
        dk, dv, du = _dkv_block(dk, dv, du, blk, b, kvh, k, v, u, off, valid, reach,
                                Q, QPOS, THU, THP, TAU, DO, LSE, DELTA, sqb, sql, sqh, sdob, sdol, sdoh,
                                L, H, R, WINDOW, scale, qe0, U.dtype.element_ty, G, MQ, BN, D, VARIANT, HAS_TOPK, False,
                                PREC, KEY_MAJOR, 3)
    for blk in range(c3, hi + 1):
        off = a - blk * G
        inb = valid & (off >= 0) & (off < band)
        dk, dv, du = _dkv_block(dk, dv, du, blk, b, kvh, k, v, u, kp, inb, e,
                                Q, QPOS, THU, THP, TAU, DO, LSE, DELTA, sqb, sql, sqh, sdob, sdol, sdoh,
                                L, H, R, WINDOW, scale, qe0, U.dtype.element_ty, G, MQ, BN, D, VARIANT, HAS_TOPK, False,
                                PREC, KEY_MAJOR, 0)
    em = e < N
    dk = dk * scale
    ou = (b * Hkv + kvh) * N + e
    if HAS_TOPK:
        pp = (b * N * Hkv + kvh) * D + e[:, None] * (Hkv * D) + d[None, :]
        dk += tl.load(DKP + pp, mask=em[:, None], other=0.0)
        dv += tl.load(DVP + pp, mask=em[:, None], other=0.0)
        du += tl.load(DUP + ou, mask=em, other=0.0)
    ptr = b * sdkb + e[:, None] * sdkn + kvh * sdkh + d[None, :]
    tl.store(DK + ptr, dk.to(DK.dtype.element_ty), mask=em[:, None])
    tl.store(DV + ptr, dv.to(DV.dtype.element_ty), mask=em[:, None])
    tl.store(DU + ou, du, mask=em)
