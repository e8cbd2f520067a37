"""Triton kernels of the device selection scan (device.py): each a launch over tiles of a row.

Index spaces of a row: ext items s in [0, N); entries m in [0, NM) = the items, then the carried
threshold scores (m = N + c); ranks r in [0, NM) = the entries sorted best first (their sort keys);
queries c in [0, L] (c = L: the state after the chunk); blocks j in [0, nb).
Row prefix sums over a tile grid take two launches: one writes each tile's total, the next adds
the totals of the tiles before its own to an in-tile cumsum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from longtrain.ops.selection.wavelet import tree_count_below, tree_quantile

# Quantities with per-tile totals: TOT [B, N_TOT, NT] int32 (and TOTS [B, NT] float64 for T_OFFSET's scores):
# f's offsets, pooled items, their blocks, final-pool members, pooled entries by rank, kept scores.
T_OFFSET, T_POOLED, T_COUNT, T_MEMBER, T_POOLED_R, T_KEEP, N_TOT = (tl.constexpr(i) for i in range(7))


@triton.jit
def _position_hash(p):
    """naive.position_hash (splitmix64, masked to 63 bits) in wrapping int64 arithmetic."""
    x = p + -7046029254386353131  # 0x9E3779B97F4A7C15
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -4658895280553007687  # logical shifts; 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685  # 0x94D049BB133111EB
    return (x ^ ((x >> 31) & 0x1FFFFFFFF)) & 0x7FFFFFFFFFFFFFFF


@triton.jit
def _before_tile(TOT, q, b, t, NT, NTP: tl.constexpr):
    """The sum of quantity q's totals over the row's tiles before tile t, and over all of them."""
    i = tl.arange(0, NTP)
    v = tl.load(TOT + (b * N_TOT + q) * NT + i, mask=i < NT, other=0)
    return tl.sum(tl.where(i < t, v, 0), axis=0), tl.sum(v, axis=0)


@triton.jit
def keys_kernel(U, POS, THR, THR_COUNT, KEYS, N, NM, CAP, BLK: tl.constexpr):
    """int32 sort keys of the row's entries (u descending; invalid: INT32_MAX), written in reverse entry
    order: a stable ascending sort then ranks ties by the larger entry index first."""
    b = tl.program_id(1).to(tl.int64)
    m = tl.program_id(0) * BLK + tl.arange(0, BLK)  # [BLK] entries
    mm = m < NM
    item = m < N
    c = m - N  # carried index
    u_item = tl.load(U + b * N + m, mask=mm & item, other=0.0).to(tl.float32)
    pos = tl.load(POS + b * N + m, mask=mm & item, other=-1)
    u_thr = tl.load(THR + b * CAP + c, mask=mm & ~item, other=0.0).to(tl.float32)  # float32 values in float64
    valid = tl.where(item, pos >= 0, c < tl.load(THR_COUNT + b))
    u = tl.where(item, u_item, u_thr)
    u = tl.where(u == 0.0, 0.0, u)  # -0.0 -> +0.0: the CPU scan compares them as equal
    bits = u.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    mono = tl.where(bits < 0x80000000, bits + 0x80000000, 0xFFFFFFFF - bits)  # unsigned, monotone in u
    desc = tl.where(valid, 0xFFFFFFFF - mono, 0xFFFFFFFF)  # (a NaN with all bits set would pass as invalid)
    tl.store(KEYS + b * NM + (NM - 1 - m), (desc - 0x80000000).to(tl.int32), mask=mm)


@triton.jit
def _decode_key(key, index, NM):
    """(entry m, valid, float32 score) of a sorted key and its index in the keys as written."""
    desc = key.to(tl.int64) + 0x80000000
    mono = 0xFFFFFFFF - desc
    bits = tl.where(mono >= 0x80000000, mono - 0x80000000, 0xFFFFFFFF - mono)
    return (NM - 1 - index).to(tl.int32), desc != 0xFFFFFFFF, bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def ranked_kernel(
    SKEYS, SIDX, POS,  # [B, NM] sorted keys and their indices, [B, N] positions
    BY_RANK, RANK_OF, SCORE,  # out [B, NM]: entry at rank r, rank of entry m, score at rank r (-inf: invalid)
    ORD, SS, HS, LEAF_OFF, TREE_ROW,  # out: the wavelet tree's leaves (level LV)
    NVALID, TOT, TOTS,  # out: [B] valid entries, per-tile totals
    N, NM, K, NT, BLK: tl.constexpr,
):
    """Per rank: the entry there, its score and hash (the tree's leaves), and the row's valid count."""
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0)
    r = t * BLK + tl.arange(0, BLK)  # [BLK] ranks
    rm = r < NM
    row = b * NM
    m, valid, u32 = _decode_key(tl.load(SKEYS + row + r, mask=rm, other=0),
                                tl.load(SIDX + row + r, mask=rm, other=0), NM)
    valid = rm & valid
    valid_next = (r + 1 < NM) & (tl.load(SKEYS + row + r + 1, mask=r + 1 < NM, other=0) != 0x7FFFFFFF)
    score = tl.where(valid, u32.to(tl.float64), -float("inf"))
    item = valid & (m < N)
    pos = tl.load(POS + b * N + m, mask=item, other=0)
    h = tl.where(item, _position_hash(pos), 0)
    tl.store(BY_RANK + row + r, m, mask=rm)
    tl.store(RANK_OF + row + m, r, mask=rm)
    tl.store(SCORE + row + r, score, mask=rm)
    leaf = b * TREE_ROW + LEAF_OFF + r
    tl.store(ORD + leaf, m, mask=rm)
    tl.store(SS + leaf, tl.where(item, score, 0.0), mask=rm)
    tl.store(HS + leaf, h, mask=rm)
    # Valid entries come first: the last valid rank (or rank 0, when none is) knows their count.
    last = (valid & ~valid_next) | ((r == 0) & ~valid)
    tl.store(NVALID + b + r * 0, tl.where(valid, r + 1, 0), mask=last)
    # tau's candidates are the carried entries and the stream; the tree counts pool and stream.
    w = _offset_weight(m, valid, N, K)
    tl.store(TOT + (b * N_TOT + T_OFFSET) * NT + t, tl.sum(w, axis=0))
    tl.store(TOTS + b * NT + t, tl.sum(w.to(tl.float64) * tl.where(valid, score, 0.0), axis=0))


@triton.jit
def _offset_weight(m, valid, N, K):
    """+1 for a carried entry, -1 for a pool item: f's offsets from the tree's counts."""
    return (valid & (m >= N)).to(tl.int32) - (valid & (m < K)).to(tl.int32)


@triton.jit
def _search_step(SCORE, row, lo, hi, t, MODE: tl.constexpr):
    """One halving of [lo, hi) towards the ranks with (0) score > t, (1) score >= t, (2) score - 1 > t."""
    act = lo < hi
    mid = (lo + hi) >> 1
    v = tl.load(SCORE + row + mid, mask=act, other=0.0)
    if MODE == 0:
        ok = v > t
    elif MODE == 1:
        ok = v >= t
    else:
        ok = v - 1.0 > t
    return tl.where(act & ok, mid + 1, lo), tl.where(act & ~ok, mid, hi)


@triton.jit
def breakpoints_kernel(
    SCORE, BY_RANK, NVALID, TOT, TOTS,
    CC, CS,  # out [B, NM+1]: carried minus pool entries ranked above r (count, score sum)
    BPT, BPRV, BPRW,  # out [B, 2 NM]: breakpoints ascending, ranks with u > t, ranks with u - 1 > t
    N, NM, K, NT, ITERS, NTP: tl.constexpr, BLK: tl.constexpr,
):
    """tau's breakpoints (u and u - 1 of every valid entry) merged in order, and the offsets of f.

    The scores by rank descend, so both lists are sorted: an entry's place in the merge is its rank
    plus the other list's entries before it (a binary search); padding (invalid) goes last."""
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0)
    r = t * BLK + tl.arange(0, BLK)  # [BLK] ranks
    rm = r < NM
    row = b * NM
    nval = tl.load(NVALID + b)
    valid = r < nval
    u = tl.load(SCORE + row + r, mask=rm, other=-float("inf"))
    m = tl.load(BY_RANK + row + r, mask=rm, other=0)
    # Offsets: prefix sums over ranks, each tile's start from the earlier tiles' totals.
    w = _offset_weight(m, valid, N, K)
    wu = w.to(tl.float64) * tl.where(valid, u, 0.0)
    prev_c, _ = _before_tile(TOT, T_OFFSET, b, t, NT, NTP)
    i = tl.arange(0, NTP)
    prev_s = tl.sum(tl.load(TOTS + b * NT + i, mask=i < t, other=0.0), axis=0)
    crow = b * (NM + 1)
    tl.store(CC + crow + r + 1, prev_c + tl.cumsum(w, axis=0), mask=rm)
    tl.store(CS + crow + r + 1, prev_s + tl.cumsum(wu, axis=0), mask=rm)
    tl.store(CC + crow + r * 0, 0, mask=r == 0)
    tl.store(CS + crow + r * 0, 0.0, mask=r == 0)
    # Breakpoints: u (place r + #{u' - 1 > u}) and u - 1 (place r + #{u' >= u - 1}), descending.
    t1 = u
    t2 = u - 1.0
    # Five prefix lengths of the ranks, by binary searches interleaved in one loop (latency-bound).
    lo = tl.zeros_like(r)
    hi = lo + nval
    rv1, rw1, ge2, rv2, rw2 = lo, lo, lo, lo, lo
    h1, h2, h3, h4, h5 = hi, hi, hi, hi, hi
    for _ in range(ITERS):
        rv1, h1 = _search_step(SCORE, row, rv1, h1, t1, 0)  # u > t1
        rw1, h2 = _search_step(SCORE, row, rw1, h2, t1, 2)  # u - 1 > t1
        ge2, h3 = _search_step(SCORE, row, ge2, h3, t2, 1)  # u >= t2
        rv2, h4 = _search_step(SCORE, row, rv2, h4, t2, 0)  # u > t2
        rw2, h5 = _search_step(SCORE, row, rw2, h5, t2, 2)  # u - 1 > t2
    top = 2 * nval - 1  # ascending index = top - descending place
    a1 = tl.where(valid, top - (r + rw1), 2 * r)
    a2 = tl.where(valid, top - (r + ge2), 2 * r + 1)
    brow = b * 2 * NM
    dmax = 1.7976931348623157e308  # padding: finite, so f = 0 there (not NaN)
    tl.store(BPT + brow + a1, tl.where(valid, t1, dmax), mask=rm)
    tl.store(BPRV + brow + a1, tl.where(valid, rv1, 0), mask=rm)
    tl.store(BPRW + brow + a1, tl.where(valid, rw1, 0), mask=rm)
    tl.store(BPT + brow + a2, tl.where(valid, t2, dmax), mask=rm)
    tl.store(BPRV + brow + a2, tl.where(valid, rv2, 0), mask=rm)
    tl.store(BPRW + brow + a2, tl.where(valid, rw2, 0), mask=rm)


@triton.jit
def _f_at(LEFT, BPT, BPRV, BPRW, CC, CS, zrow, brow, crow, j, m, P, LV, NM):
    """f(t_j) = sum clamp(u - t_j, 0, 1) over the query's candidates, and the pieces that make it.

    j, m: [BQ, NP] breakpoints (probes) per query. The 2 NP tree descents (u > t and u - 1 > t at
    every probe) run as one descent over a [BQ, NP, 2] tensor: their loads overlap."""
    t = tl.load(BPT + brow + j, mask=m, other=0.0)  # [BQ, NP]
    rv = tl.load(BPRV + brow + j, mask=m, other=0)
    rw = tl.load(BPRW + brow + j, mask=m, other=0)
    sat = (tl.arange(0, 2) == 1)[None, None, :]  # [1, 1, 2]: u > t, u - 1 > t (saturated)
    rho = tl.where(sat, rw[:, :, None], rv[:, :, None])  # [BQ, NP, 2]
    m3 = m[:, :, None] & (rho >= 0)
    cnt, ssum = tree_count_below(LEFT, zrow, tl.where(m3, P[:, None, None], 0), rho, LV, NM)
    cnt += tl.load(CC + crow + rho, mask=m3, other=0)
    ssum += tl.load(CS + crow + rho, mask=m3, other=0.0)
    cv = tl.sum(tl.where(sat, 0, cnt), axis=2)
    cw = tl.sum(tl.where(sat, cnt, 0), axis=2)
    sv = tl.sum(tl.where(sat, 0.0, ssum), axis=2)
    sw = tl.sum(tl.where(sat, ssum, 0.0), axis=2)
    f = sv - sw + cw.to(tl.float64) - t * (cv - cw).to(tl.float64)
    return f, t, cv, sv, cw, sw


@triton.jit
def queries_kernel(
    LEFT, HS,  # the wavelet tree
    BPT, BPRV, BPRW, CC, CS,  # breakpoints [B, 2 NM] and offsets [B, NM+1]
    SCORE, BY_RANK, POS, NVALID, SEEN, LENGTHS, TAU_PREV,
    THETA_U, THETA_POS, TAU, NACT, FP,  # out [B, L], padded queries: nothing selected
    QRANK, TAU_END,  # out [B, L+1]: theta's rank (NM: everything selected), [B]: tau after the chunk
    N, NM, K, L, LV, NIT, DELTA, LAG,
    BQ: tl.constexpr, NP: tl.constexpr,
):
    """Every query c (c = L: after the chunk): theta from one tree descent, tau by an (NP+1)-ary search
    over the breakpoints for the last t_j with f(t_j) > K, then the linear piece after it."""
    b = tl.program_id(1).to(tl.int64)
    c = tl.program_id(0) * BQ + tl.arange(0, BQ)  # [BQ] queries
    qm = c < L + 1
    length = tl.load(LENGTHS + b).to(tl.int32)
    nval = tl.load(NVALID + b)
    zrow = b * LV * NM
    srow = b * (LV + 1) * NM
    row = b * NM
    zero = tl.zeros([BQ], tl.int32)
    # Query c sees the pool and the first c + DELTA stream items (tail, chunk); after it, `length`.
    n_vis = tl.minimum(tl.where(c < L, c + DELTA, length), N - K)
    P = tl.where(qm, K + n_vis, 0)
    # Candidates: those before the chunk's stream, plus the valid stream items seen (two prefixes).
    two = tl.arange(0, 2)[None, :]
    cnt, _ = tree_count_below(LEFT, zrow, tl.where(two == 0, P[:, None], K), two * 0 + nval, LV, NM)
    ncand = tl.maximum(tl.load(SEEN + b) - LAG + 1, 0) + tl.sum(tl.where(two == 0, cnt, -cnt), axis=1)

    # theta: the K-th best among the first P; the fingerprint sums the hashes at or above it.
    has = qm & (P >= K)  # (K > 0: the host handles k = 0)
    rank, hbelow = tree_quantile(LEFT, HS, zrow, srow, tl.where(has, P, 0), zero + K - 1, LV, NM)
    has = has & (rank < nval)  # else fewer than K valid items: all are selected
    rk = tl.where(has, rank, 0)
    theta_u = tl.where(has, tl.load(SCORE + row + rk, mask=has, other=0.0), -float("inf"))
    item = tl.load(BY_RANK + row + rk, mask=has, other=0)
    theta_pos = tl.where(has, tl.load(POS + b * N + item, mask=has, other=0), -1)
    all_hash = tl.load(HS + srow + P - 1, mask=qm & (P > 0), other=0)  # level 0: ext order
    own = tl.load(HS + srow + LV * NM + rk, mask=has, other=0)  # the leaves: rank order
    fp = tl.where(has, hbelow + own, all_hash) & 0x7FFFFFFFFFFFFFFF

    # tau: the last breakpoint t_j with f(t_j) > K, then the linear piece after it.
    NBP = 2 * NM
    brow = b * NBP
    crow = b * (NM + 1)
    need = qm & (ncand > K)
    Pn = tl.where(need, P, 0)
    jlo = zero - 1  # f(-inf) = #candidates > K
    jhi = zero + NBP
    p1 = tl.arange(0, NP)[None, :] + 1  # [1, NP]
    for _ in range(NIT):  # NP probes split (jlo, jhi) into NP + 1 parts: keep the one where f crosses K
        span = (jhi - jlo)[:, None]
        probe = tl.minimum(jlo[:, None] + tl.maximum(span * p1 // (NP + 1), 1), jhi[:, None] - 1)  # [BQ, NP]
        active = (need & (jhi - jlo > 1))[:, None] & (p1 > 0)
        f, _, _, _, _, _ = _f_at(LEFT, BPT, BPRV, BPRW, CC, CS, zrow, brow, crow, probe, active, Pn, LV, NM)
        gt = active & (f > K)  # f descends along the breakpoints
        jlo = tl.maximum(jlo, tl.max(tl.where(gt, probe, -1), axis=1))
        jhi = tl.minimum(jhi, tl.min(tl.where(active & ~gt, probe, NBP), axis=1))
    # The piece [t_j, t_j+1]; at j + 1 only the count above matters (|A| below).
    j = tl.maximum(jlo, 0)
    nxt = tl.arange(0, 2)[None, :]  # [1, 2]: j, j + 1
    jj = j[:, None] + nxt
    f, t, cv, sv, cw, sw = _f_at(LEFT, BPT, BPRV, BPRW, CC, CS, zrow, brow, crow, jj, need[:, None] & (jj < NBP),
                                 Pn, LV, NM)
    first = nxt == 0
    t_at = tl.sum(tl.where(first, t, 0.0), axis=1)
    cw = tl.sum(tl.where(first, cw, 0), axis=1)
    n_frac = tl.sum(tl.where(first, cv, 0), axis=1) - cw
    tau = (tl.sum(tl.where(first, sv - sw, 0.0), axis=1) + cw.to(tl.float64) - K) / tl.maximum(n_frac, 1).to(tl.float64)
    has_next = need & (j + 1 < NBP)
    t_next = tl.where(has_next, tl.sum(tl.where(first, 0.0, t), axis=1), float("inf"))
    tau = tl.minimum(tl.maximum(tau, t_at), t_next)
    # |A| = #{tau < u < tau + 1}: when tau lands on the next breakpoint, scores equal to it have
    # p = 0; the candidates with u > t_next are the fractional ones then.
    cv_next = tl.sum(tl.where(first, 0, cv), axis=1)
    n_act = tl.where(tau == t_next, cv_next - cw, n_frac)
    # Never below the carried tau, the CPU scan's start: below it only where f = k on a whole interval
    # (no fractional candidates: |A| stays) or by rounding.
    tau = tl.maximum(tau, tl.load(TAU_PREV + b + c * 0))
    tau = tl.where(need, tau, -float("inf"))
    n_act = tl.where(need, n_act, 0)

    out = qm & (c < L)
    ok = c < length  # padded queries: nothing selected
    o = b * L + c
    tl.store(THETA_U + o, tl.where(ok, theta_u, float("inf")), mask=out)
    tl.store(THETA_POS + o, tl.where(ok, theta_pos, 0x7FFFFFFFFFFFFFFF), mask=out)
    tl.store(TAU + o, tl.where(ok, tau, 0.0), mask=out)
    tl.store(NACT + o, tl.where(ok, n_act, 0).to(tl.int64), mask=out)
    tl.store(FP + o, tl.where(ok, fp, 0), mask=out)
    tl.store(QRANK + b * (L + 1) + c, tl.where(has, rank, NM), mask=qm)
    tl.store(TAU_END + b + c * 0, tau, mask=qm & (c == L))


@triton.jit
def _enter(s, K, DELTA, BLOCK):
    """The first block whose first query sees ext item s (the pool: block 0)."""
    first_q = tl.where(s < K, 0, tl.maximum(s - K - DELTA + 1, 0))
    return (first_q + BLOCK - 1) // BLOCK


@triton.jit
def _block_rank(QRANK, qrow, j, length, BLOCK, mask):
    """The worst rank in block j's pool: theta's at its first query (NM: all visible); -1 past the end."""
    return tl.load(QRANK + qrow + j * BLOCK, mask=mask & (j * BLOCK < length) & (j >= 0), other=-1)


@triton.jit
def _leave(QRANK, qrow, rank, length, NB, BLOCK, ITERS):
    """The first block whose pool ranks better than `rank` (block ranks never increase)."""
    lo = tl.zeros_like(rank)
    hi = lo + NB
    for _ in range(ITERS):
        act = lo < hi
        mid = (lo + hi) >> 1
        ok = _block_rank(QRANK, qrow, mid, length, BLOCK, act) >= rank
        lo = tl.where(act & ok, mid + 1, lo)
        hi = tl.where(act & ~ok, mid, hi)
    return lo


@triton.jit
def pool_flags_kernel(
    POS, RANK_OF, BY_RANK, SCORE, QRANK, NVALID, LENGTHS, TAU_END,
    COUNT, MEMBER,  # out [B, N]: blocks item s is pooled in; in the final pool
    FLAGS_R,  # out [B, NM]: bit 0 pooled, bit 1 kept in the threshold state (by rank)
    TOT,  # out: per-tile totals
    N, NM, K, L, NB, BLOCK, DELTA, NT, ITERS, BLK: tl.constexpr,
):
    """Item s is pooled in the blocks [enter, leave): from the first block that sees it to the first
    whose pool ranks better. Per ext item and per rank (the same tile grid): the flags to compact."""
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0)
    x = t * BLK + tl.arange(0, BLK)  # [BLK] ext items, and ranks
    length = tl.load(LENGTHS + b).to(tl.int32)
    qrow = b * (L + 1)
    # By ext index.
    sm = x < N
    valid = sm & (tl.load(POS + b * N + x, mask=sm, other=-1) >= 0)
    rank = tl.load(RANK_OF + b * NM + x, mask=sm, other=0)
    # Two searches in one loop: item x's leaving block, and that of the entry at rank x.
    two = tl.arange(0, 2)[None, :]
    leave2 = _leave(QRANK, qrow, tl.where(two == 0, rank[:, None], x[:, None]), length, NB, BLOCK, ITERS)
    leave = tl.sum(tl.where(two == 0, leave2, 0), axis=1)
    leave_r = tl.sum(tl.where(two == 1, leave2, 0), axis=1)
    count = tl.where(valid, tl.maximum(leave - _enter(x, K, DELTA, BLOCK), 0), 0)
    r_fin = tl.load(QRANK + qrow + L)  # the top-k after the chunk; the last w-1 form the next tail
    member = valid & (rank <= r_fin) & (x < K + length)
    tl.store(COUNT + b * N + x, count, mask=sm)
    tl.store(MEMBER + b * N + x, member.to(tl.int8), mask=sm)
    # By rank.
    rm = x < NM
    m = tl.load(BY_RANK + b * NM + x, mask=rm, other=0)
    real = rm & (x < tl.load(NVALID + b))
    pooled_r = real & (m < N) & (leave_r > _enter(m, K, DELTA, BLOCK))
    u = tl.load(SCORE + b * NM + x, mask=rm, other=0.0)
    new = (m >= N) | ((m >= K) & (m < K + length))  # carried, tail and the chunk's candidates
    keep = real & new & (u > tl.load(TAU_END + b)) & (u < float("inf"))  # k = 0: tau = +inf, none
    tl.store(FLAGS_R + b * NM + x, (pooled_r.to(tl.int32) + 2 * keep.to(tl.int32)).to(tl.int8), mask=rm)
    tot = TOT + b * N_TOT * NT + t
    tl.store(tot + T_POOLED * NT, tl.sum((count > 0).to(tl.int32), axis=0))
    tl.store(tot + T_COUNT * NT, tl.sum(count, axis=0))
    tl.store(tot + T_MEMBER * NT, tl.sum(member.to(tl.int32), axis=0))
    tl.store(tot + T_POOLED_R * NT, tl.sum(pooled_r.to(tl.int32), axis=0))
    tl.store(tot + T_KEEP * NT, tl.sum(keep.to(tl.int32), axis=0))


@triton.jit
def pool_scan_kernel(
    COUNT, MEMBER, FLAGS_R, BY_RANK, SCORE, TOT,
    PE, CP,  # out [B, N+1]: pooled items before ext s, their blocks (exclusive prefix sums)
    PR,  # out [B, NM+1]: pooled items ranked above r
    LSEQ,  # out [B, N]: the pooled items in leaving order (rank descending)
    FINAL, THR_U,  # out: the final pool (ascending ext indices), the kept scores (descending)
    N, NM, K, CAP, NT, NTP: tl.constexpr, BLK: tl.constexpr,
):
    """The prefix sums of pool_flags_kernel's flags, and the compactions they give."""
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0)
    x = t * BLK + tl.arange(0, BLK)
    first = x == 0
    # By ext index.
    sm = x < N
    count = tl.load(COUNT + b * N + x, mask=sm, other=0)
    pooled = (count > 0).to(tl.int32)
    member = tl.load(MEMBER + b * N + x, mask=sm, other=0).to(tl.int32)
    erow = b * (N + 1)
    p0, _ = _before_tile(TOT, T_POOLED, b, t, NT, NTP)
    tl.store(PE + erow + x + 1, p0 + tl.cumsum(pooled, axis=0), mask=sm)
    tl.store(PE + erow + x, 0, mask=first)
    c0, _ = _before_tile(TOT, T_COUNT, b, t, NT, NTP)
    tl.store(CP + erow + x + 1, c0 + tl.cumsum(count, axis=0), mask=sm)
    tl.store(CP + erow + x, 0, mask=first)
    m0, _ = _before_tile(TOT, T_MEMBER, b, t, NT, NTP)
    tl.store(FINAL + b * K + m0 + tl.cumsum(member, axis=0) - 1, x.to(tl.int64), mask=sm & (member > 0))
    # By rank.
    rm = x < NM
    flags = tl.load(FLAGS_R + b * NM + x, mask=rm, other=0).to(tl.int32)
    pooled_r = flags & 1
    keep = flags >> 1
    r0, n_pooled = _before_tile(TOT, T_POOLED_R, b, t, NT, NTP)
    above = r0 + tl.cumsum(pooled_r, axis=0)  # inclusive
    tl.store(PR + b * (NM + 1) + x + 1, above, mask=rm)
    tl.store(PR + b * (NM + 1) + x, 0, mask=first)
    m = tl.load(BY_RANK + b * NM + x, mask=rm, other=0)
    tl.store(LSEQ + b * N + n_pooled - above, m, mask=rm & (pooled_r > 0))  # items ranked worse leave first
    k0, _ = _before_tile(TOT, T_KEEP, b, t, NT, NTP)
    slot = k0 + tl.cumsum(keep, axis=0) - 1
    u = tl.load(SCORE + b * NM + x, mask=rm, other=0.0)
    tl.store(THR_U + b * CAP + slot, u, mask=rm & (keep > 0) & (slot < CAP))  # the lowest beyond the cap drop


@triton.jit
def _left_before(PR, prow, QRANK, qrow, j, length, NM, BLOCK):
    """Pooled items that left before block j: those ranked worse than block j-1's pool (none for j = 0)."""
    r = _block_rank(QRANK, qrow, j - 1, length, BLOCK, j > 0)
    worse = tl.load(PR + prow + NM) - tl.load(PR + prow + tl.minimum(r + 1, NM), mask=j > 0, other=0)
    return tl.where(j > 0, worse, 0)


@triton.jit
def slot_pred_kernel(
    COUNT, PE, PR, LSEQ, QRANK, LENGTHS,
    PTR, ROOT_SLOT,  # out [B, N]: the key whose slot item s takes (itself: a fresh slot), that slot
    N, NM, K, L, BLOCK, DELTA, BLK: tl.constexpr,
):
    """Stable slots: at each block boundary the r-th key to enter (ext order) takes the slot of the
    r-th key to leave (worst first); the others take fresh slots, the pool growing until full."""
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(0) * BLK + tl.arange(0, BLK)  # [BLK] ext items
    sm = s < N
    pooled = sm & (tl.load(COUNT + b * N + s, mask=sm, other=0) > 0)
    length = tl.load(LENGTHS + b).to(tl.int32)
    qrow = b * (L + 1)
    erow = b * (N + 1)
    prow = b * (NM + 1)
    j = _enter(s, K, DELTA, BLOCK)
    e = tl.load(PE + erow + s, mask=sm, other=0)  # pooled items before s: its place among entrants
    first = tl.where(j == 0, 0, tl.minimum((j - 1) * BLOCK + K + DELTA, N))  # the first item entering at j
    r = e - tl.load(PE + erow + first, mask=sm, other=0)  # its place among the keys entering with it
    left0 = _left_before(PR, prow, QRANK, qrow, j, length, NM, BLOCK)
    left1 = _left_before(PR, prow, QRANK, qrow, j + 1, length, NM, BLOCK)
    has_pred = pooled & (r < left1 - left0)
    pred = tl.load(LSEQ + b * N + left0 + r, mask=has_pred, other=0)
    tl.store(PTR + b * N + s, tl.where(has_pred, pred, s), mask=sm)
    tl.store(ROOT_SLOT + b * N + s, e - left1, mask=sm)  # keys in the pool so far, less those gone


@triton.jit
def slot_jump_kernel(COUNT, PTR_IN, PTR_OUT, ROOT_SLOT, SLOT, N, STEPS, FINAL: tl.constexpr, BLK: tl.constexpr):
    """STEPS links along each pooled key's chain of predecessors; FINAL: its root's slot."""
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(0) * BLK + tl.arange(0, BLK)
    sm = s < N
    pooled = sm & (tl.load(COUNT + b * N + s, mask=sm, other=0) > 0)
    p = s
    for _ in range(STEPS):
        p = tl.load(PTR_IN + b * N + p, mask=pooled, other=0)
    if FINAL:
        tl.store(SLOT + b * N + s, tl.load(ROOT_SLOT + b * N + p, mask=pooled, other=0), mask=pooled)
    else:
        tl.store(PTR_OUT + b * N + s, tl.where(pooled, p, s), mask=sm)


@triton.jit
def expand_pools_kernel(CP, SLOT, BLOCK_POOL, N, K, NB, BLOCK, DELTA, ITERS, BLK: tl.constexpr):
    """block_pool[b, j, slot(s)] = s for each block j of item s's interval, one (item, block) cell each."""
    b = tl.program_id(1).to(tl.int64)
    x = tl.program_id(0) * BLK + tl.arange(0, BLK)  # [BLK] cells: the row's intervals end to end
    erow = b * (N + 1)
    xm = x < tl.load(CP + erow + N)
    lo = tl.zeros_like(x)  # the item: CP[s] <= x < CP[s + 1]
    hi = lo + N
    for _ in range(ITERS):
        act = lo < hi
        mid = (lo + hi) >> 1
        ok = tl.load(CP + erow + mid + 1, mask=act, other=0) <= x
        lo = tl.where(act & ok, mid + 1, lo)
        hi = tl.where(act & ~ok, mid, hi)
    s = lo
    j = _enter(s, K, DELTA, BLOCK) + x - tl.load(CP + erow + s, mask=xm, other=0)
    slot = tl.load(SLOT + b * N + s, mask=xm, other=0)
    tl.store(BLOCK_POOL + (b * NB + j) * K + slot, s.to(tl.int64), mask=xm)


@triton.jit
def finish_kernel(
    TOT, TAU_END, OVERFLOW,
    THR_U, THR_SAT, THR_COUNT, THR_TAU, THR_SUM, OVERFLOW_OUT,  # the next threshold state
    FINAL,  # [B, K]: its empty tail
    K, CAP, NT, NTP: tl.constexpr, BLK: tl.constexpr,
):
    """Per row: the threshold state's fields around the kept scores, and the final pool's padding."""
    b = tl.program_id(0).to(tl.int64)
    _, n_keep = _before_tile(TOT, T_KEEP, b, 0, NT, NTP)
    _, n_member = _before_tile(TOT, T_MEMBER, b, 0, NT, NTP)
    count = tl.minimum(n_keep, CAP)
    tau = tl.load(TAU_END + b)
    frac = tl.zeros([BLK], tl.float64)
    for start in range(0, CAP, BLK):
        i = start + tl.arange(0, BLK)
        im = i < CAP
        kept = i < count
        v = tl.load(THR_U + b * CAP + i, mask=im & kept, other=0.0)
        sat = kept & (v - 1 >= tau)
        frac += tl.where(kept & ~sat, v, 0.0)
        tl.store(THR_U + b * CAP + i, v, mask=im)
        tl.store(THR_SAT + b * CAP + i, sat.to(tl.int8), mask=im)
    tl.store(THR_COUNT + b, count.to(tl.int64))
    tl.store(THR_TAU + b, tau)
    tl.store(THR_SUM + b, tl.sum(frac, axis=0))
    tl.store(OVERFLOW_OUT + b, tl.load(OVERFLOW + b) + tl.maximum(n_keep - CAP, 0))  # the lowest were dropped
    for start in range(0, K, BLK):
        i = start + tl.arange(0, BLK)
        tl.store(FINAL + b * K + i, -1, mask=(i < K) & (i >= n_member))
