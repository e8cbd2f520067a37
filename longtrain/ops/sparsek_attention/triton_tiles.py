"""What the SparseK attention kernels (triton_fwd.py, triton_bwd.py) share: the kinds of key tiles and their
masks, the band's geometry and the loads.

A query tile of G queries (positions i0 .. i0 + G - 1) attends the pool snapshot at its first query and the
band of ext rows for positions (i0 - w, i0 + G - 1] (DESIGN.md fact 2). Each tile of BN keys is of one kind
(MODE), which decides how its logits are masked and gated (naive.py states the rules for every pair):

  GENERAL   band keys anywhere: positions, the window and theta tested per pair (masked_logits)
  EDGE      band keys at the window's edge: the tile's first `reach` queries attend (edge_logits)
  INTERIOR  band keys inside every query's window: nothing to mask, gate 1 (masked_logits)
  CAUSAL    band keys past the interior: the causal mask alone, by ext index (causal_logits)
  POOL      pool keys: the tile's first `cut` queries select (pool_logits)
The band's kinds are numbered in the order a query tile meets them (band_segments), so a static loop over
them is a loop over the band.

Names: pointers end in _ptr (a tensor's start; xb_ptr: batch row b's, and kv head's for K and V); strides are
stride_<tensor><dim>; runtime integers are lower case (n_queries L, n_ext N, n_heads H, group H / Hkv, n_tiles,
topk, window, tail = w - 1); compile-time constants (tl.constexpr) upper case. Per key: kp its position, ke its
ext index, kj its index in the query tile's band; per query: qp its position, qe its own ext index; cut: how
many of the tile's first queries select a pool key; reach: how many attend a band key at the window's edge.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)

# Variants (VARIANT): the gate multiplies values in all three; soft_kv also scales logits; straight_through
# has forward gate 1 on selected keys.
HARD_K_SOFT_V = tl.constexpr(0)
SOFT_KV = tl.constexpr(1)
STRAIGHT_THROUGH = tl.constexpr(2)
VARIANT_CODE = {"hard_k_soft_v": HARD_K_SOFT_V.value, "soft_kv": SOFT_KV.value,
                "straight_through": STRAIGHT_THROUGH.value}

# Kinds of key tiles (MODE), as above.
GENERAL = tl.constexpr(0)
EDGE = tl.constexpr(1)
INTERIOR = tl.constexpr(2)
CAUSAL = tl.constexpr(3)
POOL = tl.constexpr(4)


@triton.jit
def band_origin(topk, tail, window):
    """Ext row of query tile 0's band key 0 (position 1 - w): the ext layout is the cache pool (topk slots),
    its tail (tail = w - 1 rows) and the chunk, so query tile t's band starts t G rows later."""
    return topk + tail - window + 1


@triton.jit
def band_segments(qp_min, n_band_tiles, window, G: tl.constexpr, BN: tl.constexpr):
    """The band's key tiles by kind: [0, e0) GENERAL, [e0, f0) EDGE (real keys at or before every query),
    [f0, f1) INTERIOR, [f1, n_band_tiles) CAUSAL. All GENERAL when a query of the tile is padding.

    With every query of the block valid (positions i0..i0+G-1), band key j has position
    i0 - w + 1 + j, so tile t is inside every window when t BN >= G - 1, its first position is >= 0
    and its last is <= i0, i.e. t < w // BN; before that, tiles whose first position is >= 0 hold
    real keys at or before every query. Tiles from t BN >= G - 1 on hold no key below the last
    query's window (no candidates either), so past f1 only j's position <= the query's matters.
    """
    p0 = qp_min - window + 1  # position of band key 0
    e0 = (tl.maximum(-p0, 0) + BN - 1) // BN
    lo = tl.maximum((G - 1 + BN - 1) // BN, e0)
    hi = window // BN
    ok = (qp_min >= 0) & (lo < hi)
    f0 = tl.where(ok, lo, n_band_tiles)
    f1 = tl.where(ok, tl.minimum(hi, n_band_tiles), n_band_tiles)
    return tl.where(ok, e0, n_band_tiles), f0, f1


@triton.jit
def band_keys(kj, start, band, topk, n_ext, MODE: tl.constexpr):
    """Ext rows ke of the band keys kj of a query tile whose band starts at ext row `start`, and which are keys
    (band_segments' EDGE and INTERIOR tiles hold real keys only)."""
    if MODE == GENERAL:
        valid = (kj < band) & (start + kj >= topk) & (start + kj < n_ext)
        ke = start + kj
    elif MODE == CAUSAL:
        valid = (kj < band) & (start + kj < n_ext)
        ke = start + kj
    else:
        ke = start + kj
        valid = kj >= 0
    return ke, valid


@triton.jit
def masked_logits(s, qp, thu, thp, tau, kp, u, kvalid, window, MODE: tl.constexpr, VARIANT: tl.constexpr,
                  HAS_TOPK: tl.constexpr):
    """GENERAL and INTERIOR band tiles: logits z (-inf where not attended; times the gate for soft_kv), the gate
    g and the mask of pairs whose gate has a gradient (selected, 0 <= u_j - tau_i <= 1, as torch's clamp).

    One body for both orientations: s is [G, BN] (query-major) or [BN, G] (key-major) and the per-query
    (qp, thu, thp, tau) and per-key (kp, u, kvalid) operands come expanded to broadcast against it."""
    if MODE == INTERIOR:
        z = s
        g = tl.full(s.shape, 1.0, tl.float32)
        dmask = tl.full(s.shape, 0, tl.int1)
    else:
        live = kvalid & (kp >= 0) & (qp >= 0) & (kp <= qp)
        in_win = live & (kp > qp - window)
        if HAS_TOPK:
            above = (u > thu) | ((u == thu) & (kp >= thp))
            sel = live & (kp <= qp - window) & above
        else:
            sel = live & False
        diff = u.to(tl.float32) - tau
        g = tl.where(sel, tl.minimum(tl.maximum(diff, 0.0), 1.0), 1.0)  # NaN-free: empty slots are not selected
        z = s * g if VARIANT == SOFT_KV else s
        z = tl.where(in_win | sel, z, float("-inf"))
        dmask = sel & (diff >= 0.0) & (diff <= 1.0)
    return z, g, dmask


@triton.jit
def causal_logits(s, qe, ke):
    """masked_logits for CAUSAL band tiles (and the dk/dv band pass's diagonal query tiles): no key below any
    query's window and consecutive positions, so only the causal mask, by ext index: key ke at or before the
    query's own key qe (ext index topk + tail + query index); gate 1, no gate gradient. No positions, scores
    or theta are loaded for these tiles."""
    z = tl.where(ke <= qe, s, float("-inf"))
    return z, tl.full(s.shape, 1.0, tl.float32), tl.full(s.shape, 0, tl.int1)


@triton.jit
def edge_logits(s, rows, kj, reach, u, tau, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr,
                WIN_MASK: tl.constexpr = False):
    """masked_logits for EDGE band tiles (real keys at or before every query). With the tile's queries at
    positions i0 + r, band key kj (position i0 - w + 1 + kj) is in the window of queries r <= kj and a candidate
    of the later ones, which select it while r < the cut kernel's count of the tile's queries with u at or
    above theta (a prefix: theta never decreases). So queries r < reach = max(kj + 1, count) attend it
    (load_reach). Gate 1 in the window; on a selected candidate u >= theta > tau, so min(u - tau, 1) with
    gradient mask u - tau <= 1 (p = 0 on the other pairs: neither needs the selection). Operands expanded as
    in masked_logits (rows per query, kj and reach per key). WIN_MASK: the same values with the in-window mask
    kept as a mask (the key-major dk/dv pass spills less so; the query-major dq kernel spills less with a
    gate of 2 standing for the window)."""
    if HAS_TOPK and WIN_MASK:
        inwin = rows <= kj
        diff = u - tau
        g = tl.where(inwin, 1.0, tl.minimum(diff, 1.0))
        z = s * g if VARIANT == SOFT_KV else s
        dmask = (~inwin) & (diff <= 1.0)
    elif HAS_TOPK:
        diff = tl.where(rows <= kj, 2.0, u - tau)  # in the window: as a gate of 1 with no gradient
        g = tl.minimum(diff, 1.0)
        z = s * g if VARIANT == SOFT_KV else s
        dmask = diff <= 1.0
    else:  # the window alone: reach = kj + 1
        g = tl.full(s.shape, 1.0, tl.float32)
        z = s
        dmask = tl.full(s.shape, 0, tl.int1)
    return tl.where(rows < reach, z, float("-inf")), g, dmask


@triton.jit
def pool_logits(s, rows, cut, u, tau, VARIANT: tl.constexpr):
    """masked_logits for POOL tiles (keys that are candidates of every query of the tile): key j is selected by
    the tile's first cut_j queries (rows < cut). Operands expanded as in masked_logits.

    On a selected pair u_j >= theta_i > tau_i (tau in float32 rounds at most onto theta), so the gate
    clamp(u - tau, 0, 1) is min(u - tau, 1) and its gradient mask is u - tau <= 1. Elsewhere p = 0,
    so neither needs the selection (empty slots carry u = +inf: g = 1, NaN-free)."""
    sel = rows < cut
    diff = u - tau
    g = tl.minimum(diff, 1.0)
    z = s * g if VARIANT == SOFT_KV else s
    z = tl.where(sel, z, float("-inf"))
    dmask = diff <= 1.0
    return z, g, dmask


@triton.jit
def load_reach(reach_ptr, kj, G: tl.constexpr, HAS_TOPK: tl.constexpr):
    """edge_logits' reach of band keys kj of one query tile (reach_ptr: its row of the cut kernel's REACH):
    kj < 0 (keys below the tile's band, the pool's candidates): 0; kj >= G - 1 (in every query's window): G."""
    if HAS_TOPK:
        r = tl.load(reach_ptr + kj, mask=(kj >= 0) & (kj < G), other=G)
    else:
        r = tl.minimum(kj + 1, G)
    return tl.where(kj < 0, 0, r)


@triton.jit
def load_theta(theta_u_ptr, theta_pos_ptr, row, qm, UTY: tl.constexpr):
    """theta (value in u's dtype, exact: it is one of the u values or +-inf; position as int32)."""
    thu = tl.load(theta_u_ptr + row, mask=qm, other=float("inf")).to(tl.float32).to(UTY)
    thp = tl.load(theta_pos_ptr + row, mask=qm, other=0)
    thp = tl.minimum(tl.maximum(thp, -2147483648), 2147483647).to(tl.int32)
    return thu, thp


@triton.jit
def load_queries(q_pos_ptr, theta_u_ptr, theta_pos_ptr, tau_ptr, row, qm, UTY: tl.constexpr):
    """Per-query positions (int32, -1: padding), theta and tau (float32) of one query tile."""
    qp = tl.load(q_pos_ptr + row, mask=qm, other=-1).to(tl.int32)
    thu, thp = load_theta(theta_u_ptr, theta_pos_ptr, row, qm, UTY)
    tau = tl.load(tau_ptr + row, mask=qm, other=0.0).to(tl.float32)
    return qp, thu, thp, tau


@triton.jit
def load_scores(ke, valid, ub_ptr, posb_ptr):
    """Scores u and positions (int32) of the keys at ext rows ke (-inf and -1 where not valid)."""
    safe = tl.where(valid, ke, 0)
    u = tl.load(ub_ptr + safe, mask=valid, other=float("-inf"))
    kp = tl.load(posb_ptr + safe, mask=valid, other=-1).to(tl.int32)
    return u, kp


@triton.jit
def gather_kv(ke, valid, kb_ptr, vb_ptr, stride_kn, stride_vn, D: tl.constexpr):
    """k, v rows [BN, D] at ext rows ke (zeros where not valid)."""
    safe = tl.where(valid, ke, 0)
    d = tl.arange(0, D)
    k = tl.load(kb_ptr + safe[:, None] * stride_kn + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(vb_ptr + safe[:, None] * stride_vn + d[None, :], mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def load_keys(ke, valid, kb_ptr, vb_ptr, ub_ptr, posb_ptr, stride_kn, stride_vn, D: tl.constexpr):
    """Gather BN key rows (k, v [BN, D], u [BN], positions [BN] int32) at ext rows ke."""
    k, v = gather_kv(ke, valid, kb_ptr, vb_ptr, stride_kn, stride_vn, D)
    u, kp = load_scores(ke, valid, ub_ptr, posb_ptr)
    return k, v, u, kp


@triton.jit
def load_pool_keys(pool_idx_ptr, pool_u_ptr, cut_ptr, o, slots, topk, kb_ptr, vb_ptr, stride_kn, stride_vn,
                   D: tl.constexpr):
    """Pool slots of one tile's snapshot (row o of the cut kernel's outputs): gathered k, v [BN, D],
    contiguous scores u (float32) and cuts [BN]."""
    m = slots < topk
    ke = tl.load(pool_idx_ptr + o + slots, mask=m, other=-1)
    k, v = gather_kv(ke, ke >= 0, kb_ptr, vb_ptr, stride_kn, stride_vn, D)
    u = tl.load(pool_u_ptr + o + slots, mask=m, other=float("inf"))
    cut = tl.load(cut_ptr + o + slots, mask=m, other=0)
    return k, v, u, cut


@triton.jit
def query_tile(q_ptr, stride_qb, stride_ql, stride_qh, n_queries, n_heads, group, G: tl.constexpr,
               D: tl.constexpr):
    """The program's query tile (grid: query tiles, batch x head): its batch row b, head h, kv head, the queries'
    indices i and tile rows, the head dims, the valid queries, and q [G, D]."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    kvh = h // group
    rows = tl.arange(0, G)
    i = blk * G + rows
    d = tl.arange(0, D)
    qm = i < n_queries
    q = tl.load(q_ptr + b * stride_qb + i[:, None] * stride_ql + h * stride_qh + d[None, :], mask=qm[:, None],
                other=0.0)  # [G, D]
    return blk, bh, b, h, kvh, rows, i, d, qm, q


@triton.jit
def per_query(x, KEY_MAJOR: tl.constexpr):
    """A per-query vector expanded against a tile: [1, n] in a key-major tile [keys, queries], else [n, 1]
    (None stays None)."""
    y = x
    if x is not None:
        if KEY_MAJOR:
            y = x[None, :]
        else:
            y = x[:, None]
    return y


@triton.jit
def per_key(x, KEY_MAJOR: tl.constexpr):
    """A per-key vector expanded against a tile: [n, 1] in a key-major tile, else [1, n] (None stays None)."""
    y = x
    if x is not None:
        if KEY_MAJOR:
            y = x[:, None]
        else:
            y = x[None, :]
    return y


@triton.jit
def tile_logits(s, MODE: tl.constexpr, VARIANT: tl.constexpr, HAS_TOPK: tl.constexpr, KEY_MAJOR: tl.constexpr = False,
                rows=None, qp=None, qe=None, thu=None, thp=None, tau=None,
                u=None, kp=None, ke=None, kj=None, kvalid=None, cut=None, reach=None, window=None):
    """Masked logits z, gates g and the gate-gradient mask of a tile of unscaled logits s ([queries, keys], or
    [keys, queries] when KEY_MAJOR) by its kind MODE, from per-query (rows .. tau) and per-key (u .. reach)
    vectors; a kind reads only its own operands (the others may be None). KEY_MAJOR tiles keep edge_logits'
    window as a mask (WIN_MASK)."""
    if MODE == POOL:
        z, g, dmask = pool_logits(s, per_query(rows, KEY_MAJOR), per_key(cut, KEY_MAJOR), per_key(u, KEY_MAJOR),
                                  per_query(tau, KEY_MAJOR), VARIANT)
    elif MODE == CAUSAL:
        z, g, dmask = causal_logits(s, per_query(qe, KEY_MAJOR), per_key(ke, KEY_MAJOR))
    elif MODE == EDGE:
        z, g, dmask = edge_logits(s, per_query(rows, KEY_MAJOR), per_key(kj, KEY_MAJOR), per_key(reach, KEY_MAJOR),
                                  per_key(u, KEY_MAJOR), per_query(tau, KEY_MAJOR), VARIANT, HAS_TOPK, KEY_MAJOR)
    else:
        z, g, dmask = masked_logits(s, per_query(qp, KEY_MAJOR), per_query(thu, KEY_MAJOR), per_query(thp, KEY_MAJOR),
                                    per_query(tau, KEY_MAJOR), per_key(kp, KEY_MAJOR), per_key(u, KEY_MAJOR),
                                    per_key(kvalid, KEY_MAJOR), window, MODE, VARIANT, HAS_TOPK)
    return z, g, dmask


@triton.jit
def pool_pass(acc0, acc1, acc2, q, do, lse2, delta, rows, tau, pool_idx_ptr, pool_u_ptr, cut_ptr, po, kb_ptr, vb_ptr,
              stride_kn, stride_vn, topk, scale, STEP: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
              VARIANT: tl.constexpr, PREC: tl.constexpr):
    """A query tile (query-major, the forward and dq) over its pool snapshot (row po of the cut kernel's outputs),
    BN slots at a time: STEP (the forward's online softmax or dq's gradient) updates acc0..acc2 per key tile.
    Per-query operands (rows, tau; dq's lse2, delta) are [G] vectors."""
    slots = tl.arange(0, BN)
    for t in range(0, topk, BN):  # (loads go through cp.async: a register prefetch measured slower)
        k, v, u, cut = load_pool_keys(pool_idx_ptr, pool_u_ptr, cut_ptr, po, t + slots, topk, kb_ptr, vb_ptr,
                                      stride_kn, stride_vn, D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [G, BN] unscaled logits
        z, g, dmask = tile_logits(s, POOL, VARIANT, True, rows=rows, cut=cut, u=u, tau=tau)
        acc0, acc1, acc2 = STEP(acc0, acc1, acc2, s, z, g, dmask, k, v, do, lse2, delta, scale, POOL, VARIANT, PREC)
    return acc0, acc1, acc2


@triton.jit
def band_pass(acc0, acc1, acc2, q, do, lse2, delta, rows, qp, thu, thp, tau, qp_min, start, reach_ptr, tile_id,
              kb_ptr, vb_ptr, ub_ptr, posb_ptr, stride_kn, stride_vn, n_ext, topk, window, scale,
              STEP: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, VARIANT: tl.constexpr,
              HAS_TOPK: tl.constexpr, PREC: tl.constexpr):
    """A query tile (query-major, the forward and dq; tile_id = b n_tiles + blk) over its band (i0 - w, i0 + G - 1]
    from ext row `start`, key tile by key tile, each kind with its own masks (band_segments); STEP updates
    acc0..acc2 as in pool_pass; per-query operands are [G] vectors."""
    band = window + G - 1
    n_band_tiles = tl.cdiv(band, BN)
    e0, f0, f1 = band_segments(qp_min, n_band_tiles, window, G, BN)
    reach_row = tile_id * G  # this tile's row of the cut kernel's reach
    for MODE in tl.static_range(GENERAL, CAUSAL + 1):  # the kinds in band order
        qe = None
        if MODE == GENERAL:
            lo = 0
            hi = e0
        elif MODE == EDGE:
            lo = e0
            hi = f0
        elif MODE == INTERIOR:
            lo = f0
            hi = f1
        else:
            lo = f1
            hi = n_band_tiles
            qe = start + window - 1 + rows  # each query's own ext row
        for t in range(lo, hi):
            kj = t * BN + tl.arange(0, BN)  # band indices
            reach = None
            if MODE == EDGE:
                reach = load_reach(reach_ptr + reach_row, kj, G, HAS_TOPK)
            ke, valid = band_keys(kj, start, band, topk, n_ext, MODE)
            u = None
            kp = None
            if MODE == CAUSAL:  # no positions, scores or theta for these
                k, v = gather_kv(ke, valid, kb_ptr, vb_ptr, stride_kn, stride_vn, D)
            else:
                k, v, u, kp = load_keys(ke, valid, kb_ptr, vb_ptr, ub_ptr, posb_ptr, stride_kn, stride_vn, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [G, BN] unscaled logits
            z, g, dmask = tile_logits(s, MODE, VARIANT, HAS_TOPK, rows=rows, qp=qp, qe=qe, thu=thu, thp=thp, tau=tau,
                                      u=u, kp=kp, ke=ke, kj=kj, kvalid=valid, reach=reach, window=window)
            acc0, acc1, acc2 = STEP(acc0, acc1, acc2, s, z, g, dmask, k, v, do, lse2, delta, scale, MODE, VARIANT,
                                    PREC)
    return acc0, acc1, acc2
