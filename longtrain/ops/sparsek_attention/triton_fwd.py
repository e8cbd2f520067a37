"""Triton forward kernel of SparseK attention: FlashAttention-2 online softmax over pool + band.

One program per (query tile of G, batch x head). G is the kernels' own query tile, a multiple of the
op's block: fact 2 of DESIGN.md holds for any run of consecutive queries, so a tile needs only the
pool snapshot at its first query (the op's block_pool row of its first block) plus one contiguous
band of ext indices (i0 - w, i0 + G - 1]. Both are visited as tiles of BN keys. Masks (causal,
window, selected, gate) are recomputed per tile from positions, u, theta and tau, exactly as in
naive.py. On pool tiles the selection test is one integer compare: `_cut_kernel` counts, per tile
and pool slot, the tile's queries that select the key; since theta never decreases, they are the
tile's first `cut` queries (DESIGN.md fact 1). Only O and the log-sum-exp (base 2, of the unweighted
softmax normaliser) are stored. Index, position and theta inputs arrive in the scan's dtypes
(int64, float64) and are cast in the kernels.
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
    """Band tiles [0, e0): the general rules; [e0, f0): the window's edge (real keys at or before every
    query: reach_logits); [f0, f1): inside every query's window (no masks); [f1, n_tiles): the causal
    mask alone. All general when a query of the tile is padding.

    With every query of the block valid (positions i0..i0+G-1), band key j has position
    i0 - w + 1 + j, so tile t is inside every window when t BN >= G - 1, its first position is >= 0
    and its last is <= i0, i.e. t < w // BN; before that, tiles whose first position is >= 0 hold
    real keys at or before every query. Tiles from t BN >= G - 1 on hold no key below the last
    query's window (no candidates either), so past f1 only j's position <= the query's matters.
    """
    p0 = qp_min - WINDOW + 1  # position of band key 0
    e0 = (tl.maximum(-p0, 0) + BN - 1) // BN
    lo = tl.maximum((G - 1 + BN - 1) // BN, e0)
    hi = WINDOW // BN
    ok = (qp_min >= 0) & (lo < hi)
    f0 = tl.where(ok, lo, n_tiles)
    f1 = tl.where(ok, tl.minimum(hi, n_tiles), n_tiles)
    return tl.where(ok, e0, n_tiles), f0, f1


@triton.jit
def band_mode(kp, kvalid, qp_min, WINDOW, G: tl.constexpr, BN: tl.constexpr):
    """1 when a band key tile lies inside the window of every query of a block (all valid), else 0."""
    full = (tl.sum(kvalid.to(tl.int32), 0) == BN) & (qp_min >= 0)
    kmin = tl.min(tl.where(kvalid, kp, 2147483647), 0)
    kmax = tl.max(tl.where(kvalid, kp, -1), 0)
    return tl.where(full & (kmin >= 0) & (kmax <= qp_min) & (kmin > qp_min + G - 1 - WINDOW), 1, 0)


@triton.jit
def masked_logits(mode, s, qp, thu, thp, tau, kp, u, kvalid, WINDOW, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr):
    """Band tiles: logits z (-inf where not attended; times the gate for soft_kv), the gate g and the
    mask of pairs whose gate has a gradient (selected, 0 <= u_j - tau_i <= 1, as torch's clamp).

    One body for both orientations: s is [G, BN] (query-major) or [BN, G] (key-major) and the
    per-query (qp, thu, thp, tau) and per-key (kp, u, kvalid) operands come expanded to broadcast
    against it. mode 0: the general rules; 1: keys inside every query's window (nothing to mask).
    """
    if mode == 1:
        z = s
        g = tl.full(s.shape, 1.0, tl.float32)
        dmask = tl.full(s.shape, 0, tl.int1)
    else:
        live = kvalid & (kp >= 0) & (qp >= 0) & (kp <= qp)
        in_win = live & (kp > qp - WINDOW)
        if HAS_TOPK:
            above = (u > thu) | ((u == thu) & (kp >= thp))
            sel = live & (kp <= qp - WINDOW) & above
        else:
            sel = live & False
        diff = u.to(tl.float32) - tau
        g = tl.where(sel, tl.minimum(tl.maximum(diff, 0.0), 1.0), 1.0)  # NaN-free: empty slots are not selected
        z = s * g if VARIANT == 1 else s
        z = tl.where(in_win | sel, z, float("-inf"))
        dmask = sel & (diff >= 0.0) & (diff <= 1.0)
    return z, g, dmask


@triton.jit
def causal_logits(s, qe, ke):
    """masked_logits for band tiles past interior_tiles' f1 (and the dk/dv band pass's diagonal tiles):
    no key below any query's window and consecutive positions, so only the causal mask, by ext index:
    key ke at or before the query's own key qe (ext index TOPK + TAIL + query index); gate 1, no gate
    gradient. No positions, scores or theta are loaded for these tiles."""
    z = tl.where(ke <= qe, s, float("-inf"))
    return z, tl.full(s.shape, 1.0, tl.float32), tl.full(s.shape, 0, tl.int1)


@triton.jit
def reach_logits(s, rows, jj, reach, u, tau, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, WIN_MASK: tl.constexpr = False):
    """masked_logits for band tiles at the window's edge (interior_tiles' [e0, f0): real keys at or before
    every query). With the tile's queries at positions i0 + r, band key jj (position i0 - w + 1 + jj) is in
    the window of queries r <= jj and a candidate of the later ones, which select it while r < the cut
    kernel's count of the tile's queries with u at or above theta (a prefix: theta never decreases). So
    queries r < reach = max(jj + 1, count) attend it (load_reach). Gate 1 in the window; on a selected
    candidate u >= theta > tau, so min(u - tau, 1) with gradient mask u - tau <= 1 (p = 0 on the other
    pairs: neither needs the selection). Operands expanded as in masked_logits (rows per query, jj and
    reach per key). WIN_MASK: the same values with the in-window mask kept as a mask (the key-major dk/dv
    pass spills less so; the query-major dq kernel spills less with a gate of 2 standing for the window)."""
    if HAS_TOPK and WIN_MASK:
        inwin = rows <= jj
        diff = u - tau
        g = tl.where(inwin, 1.0, tl.minimum(diff, 1.0))
        z = s * g if VARIANT == 1 else s
        dmask = (~inwin) & (diff <= 1.0)
    elif HAS_TOPK:
        diff = tl.where(rows <= jj, 2.0, u - tau)  # in the window: as a gate of 1 with no gradient
        g = tl.minimum(diff, 1.0)
        z = s * g if VARIANT == 1 else s
        dmask = diff <= 1.0
    else:  # the window alone: reach = jj + 1
        g = tl.full(s.shape, 1.0, tl.float32)
        z = s
        dmask = tl.full(s.shape, 0, tl.int1)
    return tl.where(rows < reach, z, float("-inf")), g, dmask


@triton.jit
def load_reach(REACH, ro, jj, G: tl.constexpr, HAS_TOPK: tl.constexpr):
    """reach_logits' reach of band keys jj of one query tile (REACH row ro, from the cut kernel): jj < 0
    (keys below the tile's band, the pool's candidates): 0; jj >= G - 1 (in every query's window): G."""
    if HAS_TOPK:
        r = tl.load(REACH + ro + jj, mask=(jj >= 0) & (jj < G), other=G)
    else:
        r = tl.minimum(jj + 1, G)
    return tl.where(jj < 0, 0, r)


@triton.jit
def pool_logits(s, rows, cut, u, tau, VARIANT: tl.constexpr, SEL_DMASK: tl.constexpr = False):
    """masked_logits for pool tiles (keys that are candidates of every query of the tile): key j is
    selected by the tile's first cut_j queries (rows < cut). Operands expanded as in masked_logits.

    On a selected pair u_j >= theta_i > tau_i (tau in float32 rounds at most onto theta), so the gate
    clamp(u - tau, 0, 1) is min(u - tau, 1) and its gradient mask is u - tau <= 1. Elsewhere p = 0,
    so neither needs the selection (empty slots carry u = +inf: g = 1, NaN-free). SEL_DMASK ands the
    selection into the mask anyway: same results, and the key-major dk/dv kernel spills less with it."""
    sel = rows < cut
    diff = u - tau
    g = tl.minimum(diff, 1.0)
    z = s * g if VARIANT == 1 else s
    z = tl.where(sel, z, float("-inf"))
    dmask = diff <= 1.0
    if SEL_DMASK:
        dmask = dmask & sel
    return z, g, dmask


@triton.jit
def load_theta(THU, THP, row, qm, UTY: tl.constexpr):
    """theta (value in u's dtype, exact: it is one of the u values or +-inf; position as int32)."""
    thu = tl.load(THU + row, mask=qm, other=float("inf")).to(tl.float32).to(UTY)
    thp = tl.load(THP + row, mask=qm, other=0)
    thp = tl.minimum(tl.maximum(thp, -2147483648), 2147483647).to(tl.int32)
    return thu, thp


@triton.jit
def band_origin(TOPK, TAIL, WINDOW):
    """Ext row of query tile 0's band key 0 (position 1 - w): the ext layout is the cache pool (TOPK
    slots), its tail (TAIL = w - 1 rows) and the chunk, so query tile t's band starts t G rows later."""
    return TOPK + TAIL - WINDOW + 1


@triton.jit
def load_scores(idx, valid, Ub, Pb):
    """Scores u and positions (int32) of the keys at ext indices idx (-inf and -1 where not valid)."""
    safe = tl.where(valid, idx, 0)
    u = tl.load(Ub + safe, mask=valid, other=float("-inf"))
    kp = tl.load(Pb + safe, mask=valid, other=-1).to(tl.int32)
    return u, kp


@triton.jit
def count_selecting(u, kp, valid, QPOS, THU, THP, b, t, L, G: tl.constexpr, NK: tl.constexpr):
    """Per key [NK] (score u, position kp): how many valid queries of query tile t have (u, kp) at or above
    their theta (for valid keys; 0 otherwise). Those queries are a prefix of the tile (theta never
    decreases, DESIGN.md fact 1; padding is a suffix), so a binary search finds the count: G.bit_length()
    steps of one theta gather per key (from L1: the tile's G thetas) instead of G compares."""
    lo = tl.zeros([NK], tl.int32)  # queries [0, lo) select the key, [hi, G) do not
    hi = tl.full([NK], G, tl.int32)
    for _ in tl.static_range(G.bit_length()):
        mid = (lo + hi) // 2
        i = t * G + mid
        qm = (mid < hi) & (i < L)
        row = b * L + i
        qp = tl.load(QPOS + row, mask=qm, other=-1)
        thu, thp = load_theta(THU, THP, row, qm, u.dtype)
        sel = qm & (qp >= 0) & ((u > thu) | ((u == thu) & (kp >= thp)))
        lo = tl.where(sel, mid + 1, lo)
        hi = tl.where(sel | (mid >= hi), hi, mid)
    return tl.where(valid, lo, 0)


@triton.jit
def _edge_reach(U, POS, QPOS, THU, THP, REACH, b, t, L, N, NBQ, TOPK, TAIL, WINDOW, G: tl.constexpr):
    """REACH[b, t, j] = max(j + 1, count) for query tile t's band keys j < G (reach_logits)."""
    j = tl.arange(0, G)
    e = band_origin(TOPK, TAIL, WINDOW) + t * G + j  # band key j's ext row
    ev = (e >= TOPK) & (e < N)
    u, kp = load_scores(e, ev, U + b * N, POS + b * N)
    cnt = count_selecting(u, kp, ev & (kp >= 0), QPOS, THU, THP, b, t, L, G, G)
    tl.store(REACH + (b * NBQ + t) * G + j, tl.maximum(cnt, j + 1))


@triton.jit
def _cut_kernel(SP, U, POS, QPOS, THU, THP, CUT, PI, PU, FLUSH, REACH, sspb, sspn, L, N, NBQ, TOPK, TAIL, WINDOW,
                G: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr):
    """Programs s < cdiv(TOPK, BK) of query tile t: CUT[b, t, s] = how many queries of the tile select
    pool slot s of snapshot SP[b, t] (sel = valid key, valid query, (u, pos) >= theta; pool keys are
    candidates of every query of the tile). Also the snapshot compacted for the kernels' pool tiles:
    PI = ext index (int32, -1 empty) and PU = its score (float32, +inf empty), so they read contiguous
    rows instead of gathering u. FLUSH[b, t, g] = 1 when a key of slots [g BW, (g + 1) BW) leaves its slot
    after tile t (the pool walk's groups of BW slots write their sums then; BK is a multiple of BW).
    The last program: REACH[b, t, j] = max(j + 1, count) for the tile's band keys j < G, the keys at the
    window's edge (reach_logits)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    if tl.program_id(2) == tl.num_programs(2) - 1:
        _edge_reach(U, POS, QPOS, THU, THP, REACH, b, t, L, N, NBQ, TOPK, TAIL, WINDOW, G)
    else:
        s = tl.program_id(2) * BK + tl.arange(0, BK)
        sm = s < TOPK
        idx = tl.load(SP + b * sspb + t * sspn + s, mask=sm, other=-1).to(tl.int32)
        valid = idx >= 0
        u, kp = load_scores(idx, valid, U + b * N, POS + b * N)
        cnt = count_selecting(u, kp, valid, QPOS, THU, THP, b, t, L, G, BK)
        o = (b * NBQ + t) * TOPK + s
        tl.store(CUT + o, cnt, mask=sm)
        tl.store(PI + o, idx, mask=sm)
        tl.store(PU + o, tl.where(valid, u.to(tl.float32), float("inf")), mask=sm)
        nxt = tl.load(SP + b * sspb + (t + 1) * sspn + s, mask=sm & (s * 0 + t + 1 < NBQ), other=-1).to(tl.int32)
        leave = tl.reshape((valid & (nxt != idx)).to(tl.int32), [BK // BW, BW])
        grp = tl.program_id(2) * (BK // BW) + tl.arange(0, BK // BW)
        ng = tl.cdiv(TOPK, BW)
        tl.store(FLUSH + (b * NBQ + t) * ng + grp, tl.max(leave, 1), mask=grp < ng)


@triton.jit
def gather_kv(idx, valid, Kb, Vb, skn, svn, D: tl.constexpr):
    """k, v rows [BN, D] at ext indices idx (zeros where not valid)."""
    safe = tl.where(valid, idx, 0)
    d = tl.arange(0, D)
    k = tl.load(Kb + safe[:, None] * skn + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(Vb + safe[:, None] * svn + d[None, :], mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def load_keys(idx, valid, Kb, Vb, Ub, Pb, skn, svn, D: tl.constexpr):
    """Gather BN key rows (k, v [BN, D], u [BN], positions [BN] int32) at ext indices idx."""
    k, v = gather_kv(idx, valid, Kb, Vb, skn, svn, D)
    u, kp = load_scores(idx, valid, Ub, Pb)
    return k, v, u, kp


@triton.jit
def load_pool_keys(PI, PU, CUT, o, jj, TOPK, Kb, Vb, skn, svn, D: tl.constexpr):
    """Pool slots jj of one tile's snapshot (row o of the cut kernel's outputs): gathered k, v [BN, D],
    contiguous scores u (float32) and cuts [BN]."""
    m = jj < TOPK
    idx = tl.load(PI + o + jj, mask=m, other=-1)
    k, v = gather_kv(idx, idx >= 0, Kb, Vb, skn, svn, D)
    u = tl.load(PU + o + jj, mask=m, other=float("inf"))
    cut = tl.load(CUT + o + jj, mask=m, other=0)
    return k, v, u, cut


@triton.jit
def load_queries(QPOS, THU, THP, TAU, row, qm, UTY: tl.constexpr):
    """Per-query positions (int32, -1: padding), theta and tau (float32) of one query tile."""
    qp = tl.load(QPOS + row, mask=qm, other=-1).to(tl.int32)
    thu, thp = load_theta(THU, THP, row, qm, UTY)
    tau = tl.load(TAU + row, mask=qm, other=0.0).to(tl.float32)
    return qp, thu, thp, tau


@triton.jit
def _fwd_tile(q, m_i, l_i, acc, idx, valid, Kb, Vb, Ub, Pb, skn, svn, qp, thu, thp, tau, rows, jj, reach, WINDOW,
              scale2, MODE: tl.constexpr, D: tl.constexpr, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr,
              PREC: tl.constexpr):
    """One band tile (per-query operands expanded to [G, 1]); MODE: masked_logits' 0 or 1, 2 (causal_logits:
    qp is then the query's own ext index) or 3 (reach_logits: band keys jj, their reach)."""
    if MODE == 2:
        k, v = gather_kv(idx, valid, Kb, Vb, skn, svn, D)
    else:
        k, v, u, kp = load_keys(idx, valid, Kb, Vb, Ub, Pb, skn, svn, D)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [G, BN] unscaled logits
    if MODE == 2:
        s, g, _ = causal_logits(s, qp, idx[None, :])
    elif MODE == 3:
        s, g, _ = reach_logits(s, rows, jj[None, :], reach[None, :], u[None, :], tau, VARIANT, HAS_TOPK)
    else:
        s, g, _ = masked_logits(MODE, s, qp, thu, thp, tau, kp[None, :], u[None, :], valid[None, :], WINDOW,
                                VARIANT, HAS_TOPK)
    return _fwd_update(m_i, l_i, acc, s, g, v, scale2, (MODE == 1) or (MODE == 2), VARIANT, PREC)


@triton.jit
def _fwd_update(m_i, l_i, acc, s, g, v, scale2, NO_GATE: tl.constexpr, VARIANT: tl.constexpr,
                PREC: tl.constexpr):
    """Online softmax step with masked unscaled logits s [G, BN] and gates g; m_i, the log-sum-exp
    and scale2 (scale * log2 e) in log2 units: the scale goes into exp2's argument (one FMA)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay NaN-free
    p = tl.exp2(s * scale2 - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if VARIANT != 2 and not NO_GATE:
        p = p * g  # the gate scales values after normalisation
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(
    Q, Kx, Vx, U, POS, QPOS, THU, THP, TAU, CUT, PI, PU, REACH, O, LSE,
    sqb, sql, sqh, skb, skn, skh, svb, svn, svh, sob, sol, soh,
    L, N, H, R, NBQ, TOPK, WINDOW, TAIL, scale2,
    G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, PREC: tl.constexpr,
):
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
    row = b * L + i  # per-query arrays are [B, L] contiguous
    qp, thu, thp, tau = load_queries(QPOS, THU, THP, TAU, row, qm, U.dtype.element_ty)
    qp_min = tl.min(qp, 0)
    Kb = Kx + b * skb + kvh * skh
    Vb = Vx + b * svb + kvh * svh
    Ub = U + b * N
    Pb = POS + b * N

    m_i = tl.full([G], float("-inf"), tl.float32)
    l_i = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    if HAS_TOPK:  # (1) the pool snapshot at the tile start: gathered rows, selected by the per-slot cut
        po = (b * NBQ + blk) * TOPK  # this tile's row of the cut kernel's outputs
        jj = tl.arange(0, BN)
        for t in range(0, TOPK, BN):  # (loads go through cp.async: a register prefetch measured slower)
            k, v, u, cut = load_pool_keys(PI, PU, CUT, po, t + jj, TOPK, Kb, Vb, skn, svn, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            s, g, _ = pool_logits(s, rows[:, None], cut[None, :], u[None, :], tau[:, None], VARIANT)
            m_i, l_i, acc = _fwd_update(m_i, l_i, acc, s, g, v, scale2, False, VARIANT, PREC)
    # (2) the band (i0 - w, i0 + G - 1]: contiguous ext indices; its interior tiles need no masks
    qp2, thu2, thp2, tau2 = qp[:, None], thu[:, None], thp[:, None], tau[:, None]
    start = band_origin(TOPK, TAIL, WINDOW) + blk * G
    band = WINDOW + G - 1
    nt = tl.cdiv(band, BN)
    e0, f0, f1 = interior_tiles(qp_min, nt, WINDOW, G, BN)
    rows2 = rows[:, None]
    ro = (b * NBQ + blk) * G  # this tile's row of REACH
    for t in range(0, e0):
        jj = t * BN + tl.arange(0, BN)
        valid = (jj < band) & (start + jj >= TOPK) & (start + jj < N)
        m_i, l_i, acc = _fwd_tile(q, m_i, l_i, acc, start + jj, valid, Kb, Vb, Ub, Pb, skn, svn, qp2, thu2, thp2, tau2,
                                  rows2, jj, jj, WINDOW, scale2, 0, D, VARIANT, HAS_TOPK, PREC)
    for t in range(e0, f0):
        jj = t * BN + tl.arange(0, BN)
        reach = load_reach(REACH, ro, jj, G, HAS_TOPK)
        m_i, l_i, acc = _fwd_tile(q, m_i, l_i, acc, start + jj, jj >= 0, Kb, Vb, Ub, Pb, skn, svn, qp2, thu2, thp2, tau2,
                                  rows2, jj, reach, WINDOW, scale2, 3, D, VARIANT, HAS_TOPK, PREC)
    for t in range(f0, f1):
        jj = t * BN + tl.arange(0, BN)
        m_i, l_i, acc = _fwd_tile(q, m_i, l_i, acc, start + jj, jj >= 0, Kb, Vb, Ub, Pb, skn, svn, qp2, thu2, thp2, tau2,
                                  rows2, jj, jj, WINDOW, scale2, 1, D, VARIANT, HAS_TOPK, PREC)
    qe2 = (start + WINDOW - 1 + rows)[:, None]  # each query's own ext index, for the causal tiles
    for t in range(f1, nt):
        jj = t * BN + tl.arange(0, BN)
        valid = (jj < band) & (start + jj < N)
        m_i, l_i, acc = _fwd_tile(q, m_i, l_i, acc, start + jj, valid, Kb, Vb, Ub, Pb, skn, svn, qe2, thu2, thp2, tau2,
                                  rows2, jj, jj, WINDOW, scale2, 2, D, VARIANT, HAS_TOPK, PREC)

    has = l_i > 0  # padded queries attend to nothing: o = 0, lse = +inf (p = 0 in the backward)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + b * sob + i[:, None] * sol + h * soh + d[None, :], o.to(O.dtype.element_ty), mask=qm[:, None])
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(LSE + bh * L + i, lse, mask=qm)
