"""Triton forward kernel of SparseK attention: FlashAttention-2 online softmax over pool + band.

One program per (query block of G, batch x head). Its keys are the block's pool snapshot (gathered
rows of the extended layout) and one contiguous band of ext indices; both are visited as tiles of
BN keys. Masks (causal, window, selected, gate) are recomputed per tile from positions, u, theta
and tau, exactly as in naive.py. Only O and the log-sum-exp (base 2, of the unweighted softmax
normaliser) are stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Variant codes (constexpr): the gate multiplies values in all three; soft_kv also scales logits;
# straight_through has forward gate 1 on selected keys.
HARD_K_SOFT_V, SOFT_KV, STRAIGHT_THROUGH = 0, 1, 2
VARIANT_CODE = {"hard_k_soft_v": HARD_K_SOFT_V, "soft_kv": SOFT_KV, "straight_through": STRAIGHT_THROUGH}


@triton.jit
def interior_tiles(qp_min, n_tiles, WINDOW, G: tl.constexpr, BN: tl.constexpr):
    """Band tiles [f0, f1) lie inside every query's window (no masks needed); others are general.

    With every query of the block valid (positions i0..i0+G-1), band key j has position
    i0 - w + 1 + j, so tile t is inside every window when t BN >= G - 1, its first position is >= 0
    and its last is <= i0, i.e. t < w // BN.
    """
    p0 = qp_min - WINDOW + 1  # position of band key 0
    lo = tl.maximum((G - 1 + BN - 1) // BN, (tl.maximum(-p0, 0) + BN - 1) // BN)
    hi = WINDOW // BN
    ok = (qp_min >= 0) & (lo < hi)
    return tl.where(ok, lo, n_tiles), tl.where(ok, tl.minimum(hi, n_tiles), n_tiles)


@triton.jit
def band_mode(kp, kvalid, qp_min, WINDOW, G: tl.constexpr, BN: tl.constexpr):
    """1 when a band key tile lies inside the window of every query of a block (all valid), else 0."""
    full = (tl.sum(kvalid.to(tl.int32), 0) == BN) & (qp_min >= 0)
    kmin = tl.min(tl.where(kvalid, kp, 2147483647), 0)
    kmax = tl.max(tl.where(kvalid, kp, -1), 0)
    return tl.where(full & (kmin >= 0) & (kmax <= qp_min) & (kmin > qp_min + G - 1 - WINDOW), 1, 0)


@triton.jit
def masked_logits(mode, s, qp, thu, thp, tau, kp, u, kvalid, WINDOW,
                  G: tl.constexpr, BN: tl.constexpr, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr):
    """Logits z [G, BN] (-inf where not attended; times the gate for soft_kv), the gate g and the mask
    of pairs whose gate has a gradient (selected, 0 <= u_j - tau_i <= 1, as torch's clamp).

    mode 0: band keys, the general rules; 1: band keys inside every window (nothing to mask);
    3: pool keys, candidates of every query of the block (positions <= i0 - w), selected by theta.
    """
    # s [G, BN] float32; qp, thp [G] int32; thu [G] (u dtype); tau [G] float32; kp [BN] int32; u [BN]
    if mode == 1:
        z = s
        g = tl.full([G, BN], 1.0, tl.float32)
        dmask = tl.full([G, BN], 0, tl.int1)
    else:
        if mode == 3:
            live = kvalid[None, :] & (qp[:, None] >= 0)
            in_win = live & False
            cand = live
        else:
            live = kvalid[None, :] & (kp[None, :] >= 0) & (qp[:, None] >= 0) & (kp[None, :] <= qp[:, None])
            in_win = live & (kp[None, :] > qp[:, None] - WINDOW)
            cand = live & (kp[None, :] <= qp[:, None] - WINDOW)
        if HAS_TOPK:
            above = (u[None, :] > thu[:, None]) | ((u[None, :] == thu[:, None]) & (kp[None, :] >= thp[:, None]))
            sel = cand & above
        else:
            sel = live & False
        diff = u.to(tl.float32)[None, :] - tau[:, None]
        g = tl.where(sel, tl.minimum(tl.maximum(diff, 0.0), 1.0), 1.0)  # NaN-free: empty slots are not selected
        z = s * g if VARIANT == 1 else s
        z = tl.where(in_win | sel, z, float("-inf"))
        dmask = sel & (diff >= 0.0) & (diff <= 1.0)
    return z, g, dmask


@triton.jit
def load_keys(idx, valid, Kb, Vb, Ub, Pb, skn, svn, D: tl.constexpr):
    """Gather BN key rows (k, v [BN, D], u [BN], positions [BN]) at ext indices idx."""
    safe = tl.where(valid, idx, 0)
    d = tl.arange(0, D)
    k = tl.load(Kb + safe[:, None] * skn + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(Vb + safe[:, None] * svn + d[None, :], mask=valid[:, None], other=0.0)
    u = tl.load(Ub + safe, mask=valid, other=float("-inf"))
    kp = tl.load(Pb + safe, mask=valid, other=-1)
    return k, v, u, kp


@triton.jit
def _fwd_tile(q, m_i, l_i, acc, idx, valid, Kb, Vb, Ub, Pb, skn, svn, qp, thu, thp, tau, WINDOW, scale2,
              MODE: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, VARIANT: tl.constexpr,
              HAS_TOPK: tl.constexpr, PREC: tl.constexpr):
    k, v, u, kp = load_keys(idx, valid, Kb, Vb, Ub, Pb, skn, svn, D)
    return _fwd_keys(q, m_i, l_i, acc, k, v, u, kp, valid, qp, thu, thp, tau, WINDOW, scale2,
                     MODE, G, BN, VARIANT, HAS_TOPK, PREC)


@triton.jit
def _fwd_keys(q, m_i, l_i, acc, k, v, u, kp, valid, qp, thu, thp, tau, WINDOW, scale2,
              MODE: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, VARIANT: tl.constexpr,
              HAS_TOPK: tl.constexpr, PREC: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale2  # [G, BN] logits in log2 units
    s, g, _ = masked_logits(MODE, s, qp, thu, thp, tau, kp, u, valid, WINDOW, G, BN, VARIANT, HAS_TOPK)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay NaN-free
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if VARIANT != 2 and MODE != 1:
        p = p * g  # the gate scales values after normalisation
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(
    Q, Kx, Vx, U, POS, QPOS, THU, THP, TAU, BP, O, LSE,
    sqb, sql, sqh, skb, skn, skh, svb, svn, svh, sob, sol, soh, sbpb, sbpn,
    L, N, H, R, TOPK, WINDOW, TAIL, scale2,
    G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr,
):
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // R
    i = blk * G + tl.arange(0, G)
    d = tl.arange(0, D)
    qm = i < L
    q = tl.load(Q + b * sqb + i[:, None] * sql + h * sqh + d[None, :], mask=qm[:, None], other=0.0)  # [G, D]
    row = b * L + i  # per-query arrays are [B, L] contiguous
    qp = tl.load(QPOS + row, mask=qm, other=-1)
    thu = tl.load(THU + row, mask=qm, other=float("inf"))
    thp = tl.load(THP + row, mask=qm, other=0)
    tau = tl.load(TAU + row, mask=qm, other=0.0).to(tl.float32)
    Kb = Kx + b * skb + kvh * skh
    Vb = Vx + b * svb + kvh * svh
    Ub = U + b * N
    Pb = POS + b * N

    m_i = tl.full([G], float("-inf"), tl.float32)
    l_i = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    if HAS_TOPK:  # (1) the pool snapshot at the block start: gathered rows, the next tile prefetched
        bpb = BP + b * sbpb + blk * sbpn + tl.arange(0, BN)
        idx = tl.load(bpb, mask=tl.arange(0, BN) < TOPK, other=-1)
        k, v, u, kp = load_keys(idx, idx >= 0, Kb, Vb, Ub, Pb, skn, svn, D)
        for t in range(0, TOPK, BN):
            jn = t + BN + tl.arange(0, BN)
            idn = tl.load(bpb + t + BN, mask=jn < TOPK, other=-1)
            kn, vn, un, kpn = load_keys(idn, idn >= 0, Kb, Vb, Ub, Pb, skn, svn, D)
            m_i, l_i, acc = _fwd_keys(q, m_i, l_i, acc, k, v, u, kp, idx >= 0, qp, thu, thp, tau,
                                      WINDOW, scale2, 3, G, BN, VARIANT, HAS_TOPK, PREC)
            idx, k, v, u, kp = idn, kn, vn, un, kpn
    # (2) the band (i0 - w, i0 + G - 1]: contiguous ext indices; its interior tiles need no masks
    start = TOPK + TAIL - WINDOW + 1 + blk * G
    band = WINDOW + G - 1
    nt = tl.cdiv(band, BN)
    f0, f1 = interior_tiles(tl.min(qp, 0), nt, WINDOW, G, BN)
    for t in range(0, f0):
        jj = t * BN + tl.arange(0, BN)
        valid = (jj < band) & (start + jj >= TOPK) & (start + jj < N)
        m_i, l_i, acc = _fwd_tile(q, m_i, l_i, acc, start + jj, valid, Kb, Vb, Ub, Pb, skn, svn, qp, thu, thp, tau,
                                  WINDOW, scale2, 0, G, BN, D, VARIANT, HAS_TOPK, PREC)
    for t in range(f0, f1):
        jj = t * BN + tl.arange(0, BN)
        m_i, l_i, acc = _fwd_tile(q, m_i, l_i, acc, start + jj, jj >= 0, Kb, Vb, Ub, Pb, skn, svn, qp, thu, thp, tau,
                                  WINDOW, scale2, 1, G, BN, D, VARIANT, HAS_TOPK, PREC)
    for t in range(f1, nt):
        jj = t * BN + tl.arange(0, BN)
        valid = (jj < band) & (start + jj >= TOPK) & (start + jj < N)
        m_i, l_i, acc = _fwd_tile(q, m_i, l_i, acc, start + jj, valid, Kb, Vb, Ub, Pb, skn, svn, qp, thu, thp, tau,
                                  WINDOW, scale2, 0, G, BN, D, VARIANT, HAS_TOPK, PREC)

    has = l_i > 0  # padded queries attend to nothing: o = 0, lse = +inf (p = 0 in the backward)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + b * sob + i[:, None] * sol + h * soh + d[None, :], o.to(O.dtype.element_ty), mask=qm[:, None])
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(LSE + bh * L + i, lse, mask=qm)
