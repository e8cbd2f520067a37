"""The decode step's Triton kernels per layer: the admission of one candidate (two programs per row: the
threshold state and the pool) and the query against the cache (`attend_kernel`, below: one program per row, KV head and split of the
keys, then `combine_kernel` merging the splits).

decode.py's torch admission (`_admit_pool`, `_admit_threshold`) is ~120 small operations: on a GPU
each is a launch of a few microseconds, more than the work. This kernel does the same in one launch:

  - the pool: the worst pooled (value, position), evict or grow, and the source slot of every new
    slot (the keys' K/V rows are then gathered by torch: they are [K, Hkv, D] per row); for the decoder's
    ring cache (RING) instead the slot the candidate takes, and the same program writes the cache in place:
    the candidate's K/V into that pool slot, the new token into the ring slot it leaves (no launch of its
    own for the ring write, and thr_saturated is written as bool, no cast kernel: 216 -> 206 launches
    in the compiled 12-layer step, benchmarks/README.md 2026-12-07 from 22:35);
  - the threshold state: kept sorted ascending (+inf after the count; a state the chunk op wrote is
    sorted on its first decode step), the candidate inserted, the lowest fractional score dropped
    when out of room, then the scan's own walk over the breakpoints (RowScanner._solve: two
    pointers into the sorted scores instead of two heaps; amortised O(1) steps), and the scores at
    or below the new tau dropped.

The sequence the steps above describe (inserted, dropped, cut) is never written: every scalar the state
needs (where x goes, whether the lowest goes, the fractional count and sum, how many leave) is a reduction
over the scores, in tiles of ADMIT_TILE up to the row's count (a state holds a few k of its 8 k cap), the
walk reads single elements of the virtual sequence by index arithmetic, and the output is one gather from
the scores. A scratch copy is written only where the scores arrive unsorted (then sorted once in registers
over the whole cap), with one barrier. (Earlier versions: shifted sequences materialised through a scratch
buffer, ~10 passes of 2·cap elements and 5 barriers; then the whole cap in registers, one program a row for
both parts: 9.0 us a layer at 1 row on an H200, 5.9 now, benchmarks/README.md 2026-12-07.)

The same results as the torch admission (tests run both under TRITON_INTERPRET): pool exactly,
threshold scores as sets, tau to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_min(a0, a1, b0, b1):
    return a0 + b0, tl.minimum(a1, b1)


@triton.jit
def _count_min_count_sum(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, tl.minimum(a1, b1), a2 + b2, a3 + b3


@triton.jit
def _count_count_min_count_sum(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    return a0 + b0, a1 + b1, tl.minimum(a2, b2), a3 + b3, a4 + b4


@triton.jit
def _score(THR, SCR, p, n0, unsorted):
    """Element p of the row's sorted scores (+inf past the count n0): from THR_U itself, or from the scratch
    copy where the state arrived unsorted and the kernel sorted it."""
    ok = (p >= 0) & (p < n0)
    from_thr = tl.load(THR + p, mask=tl.where(unsorted, False, ok), other=float("inf"))
    from_scr = tl.load(SCR + p, mask=tl.where(unsorted, ok, False), other=float("inf"))
    return tl.where(unsorted, from_scr, from_thr)


@triton.jit
def _merged(THR, SCR, s, n0, unsorted, at, x):
    """Element s of the sorted scores with x inserted at position at (before the scores equal to it)."""
    return tl.where(s == at, x, _score(THR, SCR, tl.where(s < at, s, s - 1), n0, unsorted))


@triton.jit
def admit_kernel(
    THR_U, THR_COUNT, TAU, OVERFLOW,  # in: [B, CAP] float64, [B] int64, [B] float64, [B] int64
    POOL_U, POOL_POS,  # in: [B, K] scores, [B, K] int64
    CU, CPOS,  # in: [B] float64 candidate score, [B] int64 its position (< 0: none)
    OUT_U, OUT_SAT, OUT_COUNT, OUT_TAU, OUT_SUM, OUT_OVER,  # out: the next threshold state
    OUT_PU, OUT_PPOS, SRC,  # out: [B, K] pool scores and positions, source slot in [pool K][candidate]
    OUT_SLOT,  # out: [B] the slot the candidate takes where the pool's slots keep no order (a ring cache), -1: none
    SCR,  # scratch [B, BLOCK] float64: the sorted scores, written only where a state arrives unsorted
    PK, PV, TK, TV, TU, NK, NV, NU, LEAVING,  # RING: a ring cache's K/V, the new token and its ring slot (ring_write_kernel's)
    CAP, K, Wt,
    BLOCK: tl.constexpr, KB: tl.constexpr, TILE: tl.constexpr,
    RING: tl.constexpr, HD: tl.constexpr, HDB: tl.constexpr,
):
    """Program (b, 0) updates row b's threshold state, program (b, 1) its pool: the two read nothing of each
    other's, so a step waits for the longer of the two chains of loads and reductions, not their sum.

    RING (a SparseKRingCache, whose pool slots keep no order): the pool program writes the cache in place instead
    of the chunk op's layout: the candidate (the key leaving the window, ring slot LEAVING) into its pool slot,
    then the new token into that ring slot; the decode step's ring write needs no launch of its own."""
    b = tl.program_id(0).to(tl.int64)
    x = tl.load(CU + b)
    cpos = tl.load(CPOS + b)
    cand = cpos >= 0
    if tl.program_id(1) == 1:
        slot = _admit_pool(POOL_U, POOL_POS, OUT_PU, OUT_PPOS, SRC, OUT_SLOT, b, x, cpos, cand, K, KB, not RING)
        if RING:
            _write_ring_row(PK, PV, POOL_U, POOL_POS, TK, TV, TU, NK, NV, NU, b, slot, tl.load(LEAVING + b), cpos,
                            K, Wt, HD, HDB, True)
    else:
        _admit_threshold(THR_U, THR_COUNT, TAU, OVERFLOW, OUT_U, OUT_SAT, OUT_COUNT, OUT_TAU, OUT_SUM, OUT_OVER, SCR,
                         b, x, cpos, cand, CAP, K, BLOCK, TILE)


@triton.jit
def _admit_pool(POOL_U, POOL_POS, OUT_PU, OUT_PPOS, SRC, OUT_SLOT, b, x, cpos, cand, K, KB: tl.constexpr,
                LAYOUT: tl.constexpr):
    """The pool: evict the worst (value, position) or grow; returns (and stores) the slot the candidate takes
    (-1: none). LAYOUT: also the pool in the chunk op's layout, valid keys first, ascending positions. A slot's
    new key is its own, its right neighbour's (the keys after an evicted one move left) or the candidate,
    so both are loaded up front: no gather waits on the reductions."""
    s = tl.arange(0, KB)
    sm = s < K
    nm = s + 1 < K
    pp = tl.load(POOL_POS + b * K + s, mask=sm, other=-1)
    pu = tl.load(POOL_U + b * K + s, mask=sm, other=0.0).to(tl.float64)
    pp1 = tl.load(POOL_POS + b * K + s + 1, mask=nm, other=-1)
    pu1 = tl.load(POOL_U + b * K + s + 1, mask=nm, other=0.0).to(tl.float64)
    ok = pp >= 0
    n_pool, umin = tl.reduce((ok.to(tl.int32), tl.where(ok, pu, float("inf"))), 0, _sum_min)
    n_pool = n_pool.to(tl.int64)
    pmin = tl.min(tl.where(ok & (pu == umin), pp, 9223372036854775807), axis=0)
    evict = cand & (n_pool == K) & (x >= umin)  # the candidate's position beats every pooled one
    grow = cand & (n_pool < K)
    if LAYOUT:
        past = (ok & (pp >= pmin)).to(tl.int64)
        src = tl.where(evict, s + past, tl.where(grow & (s == n_pool), K, s))  # s, s + 1 or K (the candidate)
        new_pu = tl.where(src == s, pu, tl.where(src < K, pu1, x))
        new_pp = tl.where(src == s, pp, tl.where(src < K, pp1, cpos))
        tl.store(OUT_PU + b * K + s, new_pu, mask=sm)
        tl.store(OUT_PPOS + b * K + s, new_pp, mask=sm)
        tl.store(SRC + b * K + s, src, mask=sm)
    worst_slot = tl.sum(tl.where(ok & (pp == pmin), s, 0), axis=0).to(tl.int64)  # positions are unique
    slot = tl.where(evict, worst_slot, tl.where(grow, n_pool, -1))
    tl.store(OUT_SLOT + b, slot)
    return slot


@triton.jit
def _first_terms(vals, i, x, c):
    """(how many scores are below x, the lowest score, how many are below c, the sum of those past element 0)."""
    return tl.reduce(((vals < x).to(tl.int32), vals, (vals < c).to(tl.int32), tl.where((vals < c) & (i > 0), vals, 0.0)),
                     0, _count_min_count_sum)


@triton.jit
def _admit_threshold(THR_U, THR_COUNT, TAU, OVERFLOW, OUT_U, OUT_SAT, OUT_COUNT, OUT_TAU, OUT_SUM, OUT_OVER, SCR,
                     b, x, cpos, cand, CAP, K, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """The threshold state's update, in tiles of TILE scores up to the row's count (a state holds a few k scores of
    its cap of 8 k: the work follows the count, not the cap); a sort over the whole block only where a state
    arrives unsorted."""
    tau0 = tl.load(TAU + b)
    n0 = tl.load(THR_COUNT + b)
    over = tl.load(OVERFLOW + b)
    thr = THR_U + b * CAP
    scr = SCR + b * BLOCK
    t = tl.arange(0, TILE)

    # The sequence Z the steps work on, never written: the scores sorted, x inserted at `at` (S), less its
    # lowest element when out of room (drop): Z[m] = S[m + drop]. Each scalar below is a reduction over the scores.
    ins = cand & (x > tau0)  # a score at or below tau never matters again
    c = tau0 + 1  # fractional: below c
    # one pass: whether the scores are sorted (a state the chunk op wrote is not; the decode step's are), and
    # S = sorted[:at], x, sorted[at:]; sorted[0]; the scores below c, their sum past sorted[0]
    n_desc = tl.zeros([], tl.int32)
    at = tl.zeros([], tl.int32)
    v0 = tl.full([], float("inf"), tl.float64)
    below = tl.zeros([], tl.int32)
    sum_past_v0 = tl.zeros([], tl.float64)
    for start in range(0, n0, TILE):
        i = start + t
        vals = tl.load(thr + i, mask=i < n0, other=float("inf"))
        nxt = tl.load(thr + i + 1, mask=i + 1 < n0, other=float("inf"))
        t_desc, t_at, t_v0, t_below, t_sum = tl.reduce(
            (((nxt < vals) & (i + 1 < n0)).to(tl.int32), (vals < x).to(tl.int32), vals, (vals < c).to(tl.int32),
             tl.where((vals < c) & (i > 0), vals, 0.0)), 0, _count_count_min_count_sum)
        n_desc += t_desc
        at += t_at
        v0 = tl.minimum(v0, t_v0)
        below += t_below
        sum_past_v0 += t_sum
    unsorted = n_desc > 0
    if unsorted:  # the chunk op's order: sort once, read the sorted copy below, take the terms in sorted order
        i = tl.arange(0, BLOCK)
        vals = tl.sort(tl.load(thr + i, mask=i < n0, other=float("inf")))
        tl.store(scr + i, vals)
        tl.debug_barrier()
        at, v0, below, sum_past_v0 = _first_terms(vals, i, x, c)
    at = at.to(tl.int64)
    lowest = tl.minimum(v0, x)  # S[0]: sorted[0], or x where at == 0
    drop = (n0 + 1 > CAP) & (lowest < c)  # out of room: the lowest fractional score goes
    d = drop.to(tl.int64)
    n = n0 + 1 - d
    drop_x = drop & (at == 0)  # the dropped element: x itself, or sorted[0]
    drop_v0 = drop & (at > 0)

    # ---- the scan's walk: raise tau over the breakpoints while f(b) > k (scan.RowScanner._solve)
    j = below.to(tl.int64) + (x < c).to(tl.int64) - d  # Z[:j]: fractional, Z[j:n]: saturated
    fsum = sum_past_v0 + tl.where((v0 < c) & ~drop_v0, v0, 0.0) + tl.where((x < c) & ~drop_x, x, 0.0)
    lo = j * 0
    n_frac = j
    n_sat = n - j
    tau = tau0
    walk = ins & (cpos + 1 > K)
    go = walk
    while go:
        b_frac = tl.where(n_frac > 0, _merged(thr, scr, lo + d, n0, unsorted, at, x), float("inf"))
        b_sat = tl.where(n_sat > 0, _merged(thr, scr, j + d, n0, unsorted, at, x), float("inf")) - 1
        bb = tl.minimum(b_frac, b_sat)
        f_b = tl.where(n_frac > 0, n_sat + fsum - n_frac * bb, n_sat.to(tl.float64))
        step = (bb < float("inf")) & (f_b > K)
        take_frac = step & (b_frac <= b_sat)
        take_sat = step & (b_frac > b_sat)
        solved = tl.where(n_frac > 0, tl.maximum(tau, (fsum + n_sat - K) / tl.maximum(n_frac, 1)), tau)
        tau = tl.where(step, tl.maximum(tau, bb), solved)
        fsum = fsum - tl.where(take_frac, b_frac, 0.0) + tl.where(take_sat, b_sat + 1, 0.0)
        lo += take_frac.to(tl.int64)
        j += take_sat.to(tl.int64)
        n_frac += take_sat.to(tl.int64) - take_frac.to(tl.int64)
        n_sat -= take_sat.to(tl.int64)
        go = step
    tau = tl.where(walk, tau, tau0)
    # the fractional scores at or below tau leave: Z is sorted, so they are Z[:gone]
    n_le = tl.zeros([], tl.int32)
    for start in range(0, tl.where(walk, n0, 0), TILE):
        n_le += tl.sum((_score(thr, scr, start + t, n0, unsorted) <= tau).to(tl.int32), axis=0)
    at_or_below = n_le.to(tl.int64) + (x <= tau).to(tl.int64) - (drop & (lowest <= tau)).to(tl.int64)
    gone = tl.where(walk, tl.minimum(j, at_or_below), 0)

    # ---- the next state: Z[gone:n] (rows with nothing inserted keep theirs), +inf after the count
    count = tl.where(ins, n - gone, n0)
    tau_out = tl.where(ins, tau, tau0)
    shift = tl.where(ins, d + gone, 0)
    at_out = tl.where(ins, at, CAP + 1)  # beyond every index: no insertion
    total = tl.zeros([], tl.float64)
    for start in range(0, count, TILE):
        i = start + t
        valid = i < count
        out = tl.where(valid, _merged(thr, scr, i + shift, n0, unsorted, at_out, x), float("inf"))
        sat = valid & (out >= tau_out + 1)
        tl.store(OUT_U + b * CAP + i, out, mask=i < CAP)
        tl.store(OUT_SAT + b * CAP + i, sat, mask=i < CAP)
        total += tl.sum(tl.where(valid & ~sat, out, 0.0), axis=0)
    for start in range(tl.cdiv(count, TILE) * TILE, CAP, TILE):  # the rest of the cap: +inf, not saturated
        i = start + t
        tl.store(OUT_U + b * CAP + i, tl.full([TILE], float("inf"), tl.float64), mask=i < CAP)
        tl.store(OUT_SAT + b * CAP + i, t < 0, mask=i < CAP)  # False
    tl.store(OUT_COUNT + b, count)
    tl.store(OUT_TAU + b, tau_out)
    tl.store(OUT_SUM + b, total)
    tl.store(OUT_OVER + b, over + (ins & drop).to(tl.int64))


ADMIT_TILE = 1024  # scores per step of the admission's passes over a threshold state


def admit_triton(cache, cu: torch.Tensor, cpos: torch.Tensor, *, ring_write: tuple | None = None,
                 tile: int | None = None, num_warps: int | None = None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """(the next threshold fields and pool_u, pool_pos, src [B, K], slot [B]): the kernel's outputs for decode.py
    (src: the chunk op's pool layout; slot: where the candidate goes in a pool whose slots keep no order).

    ring_write = (leaving, k, v, u), a SparseKRingCache's decode step: the candidate is the key in ring slot
    `leaving` [B]; the same launch writes it into its pool slot and the new token (k, v [B, Hkv, D], u [B]) into
    that ring slot, in place (decode._ring_write's result); then the fields are the threshold state's only and src
    is None. tile (scores per step of the threshold's passes; a power of two) and num_warps: the launch's (None:
    ADMIT_TILE and a warp per 128 scores of the tile), for benchmarks/decode_kernels.py's sweep."""
    B, cap = cache.thr_u.shape
    K = cache.topk
    dev = cu.device
    block = triton.next_power_of_2(cap)
    tile = min(tile or ADMIT_TILE, block)
    ring = ring_write is not None
    out = dict(
        thr_u=torch.empty(B, cap, dtype=torch.float64, device=dev),
        # bool, written by the kernel as bytes (a bool viewed as int8 tripped torch 2.11's Inductor: c098422)
        thr_saturated=torch.empty(B, cap, dtype=torch.bool, device=dev),
        thr_count=torch.empty(B, dtype=torch.int64, device=dev),
        tau=torch.empty(B, dtype=torch.float64, device=dev),
        thr_sum=torch.empty(B, dtype=torch.float64, device=dev),
        overflow=torch.empty(B, dtype=torch.int64, device=dev),
    )
    slot = torch.empty(B, dtype=torch.int64, device=dev)
    if ring:  # the pool is written in place: no chunk-layout copy
        pool_u = pool_pos = src = slot  # not written
        leaving, k, v, u = ring_write
        _check_in_place(cache)
        Wt, Hkv, D = cache.tail_k.shape[1:]
        writes = dict(PK=cache.pool_k, PV=cache.pool_v, TK=cache.tail_k, TV=cache.tail_v, TU=cache.tail_u,
                      **_new_token(cache, k, v, u), LEAVING=leaving.contiguous())
    else:
        pool_u, pool_pos = torch.empty_like(cache.pool_u), torch.empty_like(cache.pool_pos)
        src = torch.empty(B, K, dtype=torch.int64, device=dev)
        Wt = Hkv = D = 1
        writes = dict.fromkeys(("PK", "PV", "TK", "TV", "TU", "NK", "NV", "NU"), slot) | dict(LEAVING=slot)  # not read
    scratch = torch.empty(B, block, dtype=torch.float64, device=dev)
    admit_kernel[(B, 2)](
        THR_U=cache.thr_u.contiguous(), THR_COUNT=cache.thr_count.contiguous(), TAU=cache.tau.contiguous(),
        OVERFLOW=cache.overflow.contiguous(),
        POOL_U=cache.pool_u if ring else cache.pool_u.contiguous(), POOL_POS=cache.pool_pos if ring else cache.pool_pos.contiguous(),
        CU=cu.to(torch.float64).contiguous(), CPOS=cpos.contiguous(),
        OUT_U=out["thr_u"], OUT_SAT=out["thr_saturated"], OUT_COUNT=out["thr_count"], OUT_TAU=out["tau"],
        OUT_SUM=out["thr_sum"], OUT_OVER=out["overflow"], OUT_PU=pool_u, OUT_PPOS=pool_pos, SRC=src,
        OUT_SLOT=slot, SCR=scratch, **writes, CAP=cap, K=K, Wt=Wt,
        # tile / warps: 1,024 / 8 measured fastest at 1, 8 and 64 rows (decode_kernels.py --admit-launch, H200)
        BLOCK=block, KB=triton.next_power_of_2(max(K, 1)), TILE=tile,
        RING=ring, HD=Hkv * D, HDB=triton.next_power_of_2(Hkv * D), num_warps=num_warps or max(4, tile // 128),
    )
    if ring:
        return out, None, slot
    return out | dict(pool_u=pool_u, pool_pos=pool_pos), src, slot


# ----------------------------------------------------------------------------- the ring's writes


@triton.jit
def _write_ring_row(PK, PV, PU, PPOS, TK, TV, TU, NK, NV, NU, b, slot, leave, cpos, K, Wt, HD: tl.constexpr,
                    HDB: tl.constexpr, HAS_POOL: tl.constexpr):
    """Row b of a ring cache, in place: the key in ring slot `leave` (position cpos) into pool slot `slot` when
    admitted (>= 0), then the new token (NK, NV [B, HD], NU [B]) into that ring slot."""
    e = tl.arange(0, HDB)
    em = e < HD
    at = (b * Wt + leave) * HD + e
    nk = tl.load(NK + b * HD + e, mask=em)
    nv = tl.load(NV + b * HD + e, mask=em)
    nu = tl.load(NU + b)
    if HAS_POOL:
        if slot >= 0:
            ok = tl.load(TK + at, mask=em)
            ov = tl.load(TV + at, mask=em)
            ou = tl.load(TU + b * Wt + leave)
            to = (b * K + slot) * HD + e
            tl.store(PK + to, ok.to(PK.dtype.element_ty), mask=em)
            tl.store(PV + to, ov.to(PV.dtype.element_ty), mask=em)
            tl.store(PU + b * K + slot, ou.to(PU.dtype.element_ty))
            tl.store(PPOS + b * K + slot, cpos)
        tl.debug_barrier()  # every thread has read the leaving key before any overwrites it
    tl.store(TK + at, nk.to(TK.dtype.element_ty), mask=em)
    tl.store(TV + at, nv.to(TV.dtype.element_ty), mask=em)
    tl.store(TU + b * Wt + leave, nu.to(TU.dtype.element_ty))


@triton.jit
def ring_write_kernel(
    PK, PV, PU, PPOS,  # pool [B, K, Hkv, D] K/V, [B, K] scores and positions: written in place
    TK, TV, TU,  # ring tail [B, Wt, Hkv, D] K/V, [B, Wt] scores: written in place
    NK, NV, NU,  # the new token's K/V [B, Hkv, D] and score [B]
    SLOT, LEAVING, CPOS,  # [B] int64: the pool slot the leaving key takes (-1: none), its ring slot, its position
    K, Wt, HD: tl.constexpr, HDB: tl.constexpr, HAS_POOL: tl.constexpr,
):
    """One program per row: the key leaving the window (ring slot LEAVING) into pool slot SLOT when admitted, then
    the new token into that ring slot. What decode.py's torch path does with ~25 small operations per layer (a
    decode step with a pool does it in admit_kernel's launch; this one serves a sliding window's eager step)."""
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + b)  # (without a pool: not read)
    _write_ring_row(PK, PV, PU, PPOS, TK, TV, TU, NK, NV, NU, b, slot, tl.load(LEAVING + b), tl.load(CPOS + b),
                    K, Wt, HD, HDB, HAS_POOL)


def _check_in_place(cache) -> None:
    for t in (cache.tail_k, cache.tail_v, cache.tail_u, cache.pool_k, cache.pool_v, cache.pool_u, cache.pool_pos):
        if not t.is_contiguous():
            raise ValueError("a ring cache's decode step writes it in place: its tensors must be contiguous")


def _new_token(cache, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """The new token's K/V and score as the ring keeps them: cast by torch (a no-op where the layer computes in the
    cache's dtype), so rounded as the reference rounds."""
    return dict(NK=k.to(cache.tail_k.dtype).contiguous(), NV=v.to(cache.tail_v.dtype).contiguous(),
                NU=u.to(cache.tail_u.dtype).contiguous())


def ring_write_triton(cache, slot: torch.Tensor | None, leaving: torch.Tensor, cpos: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, u: torch.Tensor) -> None:
    """decode._ring_write's result in one launch (the same signature): in a SparseKRingCache, the key in ring slot
    `leaving` [B] (position cpos [B]) into pool slot `slot` [B] (-1 or None: not admitted), then the new token
    (k, v [B, Hkv, D], u [B]) into its ring slot; in place."""
    B, Wt, Hkv, D = cache.tail_k.shape
    _check_in_place(cache)
    has_pool = slot is not None and cache.topk > 0
    ring_write_kernel[(B,)](
        PK=cache.pool_k, PV=cache.pool_v, PU=cache.pool_u, PPOS=cache.pool_pos,
        TK=cache.tail_k, TV=cache.tail_v, TU=cache.tail_u, **_new_token(cache, k, v, u),
        SLOT=slot.contiguous() if has_pool else leaving, LEAVING=leaving.contiguous(), CPOS=cpos.contiguous(),
        K=cache.topk, Wt=Wt, HD=Hkv * D, HDB=triton.next_power_of_2(Hkv * D), HAS_POOL=has_pool,
        num_warps=4,
    )


# ----------------------------------------------------------------------------- the query against the cache


@triton.jit
def _online_softmax(m, l, acc, s, gate, v, PREC: tl.constexpr):
    """One block of an online softmax: logits s [RB, BN] (-inf: masked) over values v [BN, DB] weighted by the keys'
    gates [BN] into the running max m and sum l [RB] and the output acc [RB, DB] (a row masked so far keeps
    m = -inf). The weighted sum is a matrix product (a broadcast-and-sum over [RB, BN, DB] kept an H100 at
    ~1.2 TB/s of K/V reads at 64 rows)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p * gate[None, :], v, input_precision=PREC, out_dtype=acc.dtype)
    return m_new, l, acc


@triton.jit
def attend_kernel(
    Q, PK, PV, TK, TV, NK, NV,  # q [B, H, D]; pool K/V [B, K, Hkv, D]; tail K/V [B, Wt, Hkv, D]; the token's K/V [B, Hkv, D]
    PPOS, PU, TAU, SEEN,  # [B, K] int64 pool positions (-1: empty), [B, K] pool scores, [B] float64 tau, [B] int64 t
    O,  # out: [B, H, D] (one split)
    PART_M, PART_L, PART_ACC,  # out with several splits: [B, H, S] running max and sum, [B, H, S, D] unnormalised output
    SCALE,  # float, or [1] float64 in memory (SCALE_IN_MEMORY: a float argument would be rounded to float32)
    K, Wt, Hkv, H, K_PER, T_PER,  # pool and tail slots per split
    R: tl.constexpr, RB: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, BN: tl.constexpr,
    GATED: tl.constexpr, SOFT_KV: tl.constexpr, SELF_OK: tl.constexpr, CDT: tl.constexpr,
    SPLIT: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr, TAIL_RING: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (row, KV head, split): its R query heads against its split's share of the pool and of
    the tail (the last split also takes the token itself), read where the cache keeps them (no concatenated
    copy), an online softmax in CDT, the pool's gate on the values. One split writes o; several write their
    partial softmax for combine_kernel (one row has only Hkv programs: without splits each walks ~1k keys
    alone, ~50 us per layer on an H200). The R query heads are padded to RB >= 16 rows, so that q k^T and p v
    are tensor-core products in CDT at PREC: tf32 for half-precision caches (exact for q and the keys and values,
    which are bf16 or fp16 values; p keeps 10 bits), ieee for float32 and float64 (no rounding). In CDT rather
    than in bf16: Triton's interpreter (CI) multiplies bf16 tiles wrongly (Triton 3.9)."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    n_splits = tl.num_programs(2)
    r = tl.arange(0, RB)
    d = tl.arange(0, DB)
    rm = r < R
    dm = d < D
    q = tl.load(Q + (b * H + g * R + r)[:, None] * D + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    q = q.to(CDT)  # [RB, DB]
    m = tl.full([RB], float("-inf"), CDT)
    l = tl.zeros([RB], CDT)
    acc = tl.zeros([RB, DB], CDT)
    tau = tl.load(TAU + b)
    t = tl.load(SEEN + b)
    if SCALE_IN_MEMORY:
        scale = tl.load(SCALE).to(CDT)
    else:  # a float argument: float32 from Triton's launcher, float64 from Inductor's (under torch.compile)
        scale = tl.full([], SCALE, CDT)

    # the pool: gated by clamp(u - tau, 0, 1) (empty slots: masked)
    p_end = tl.minimum(K, (sp + 1) * K_PER)
    for j0 in range(sp * K_PER, p_end, BN):
        j = j0 + tl.arange(0, BN)
        jm = j < p_end
        pos = tl.load(PPOS + b * K + j, mask=jm, other=-1)
        ok = pos >= 0
        at = ((b * K + j) * Hkv + g)[:, None] * D + d[None, :]
        kv_mask = jm[:, None] & dm[None, :]
        kk = tl.load(PK + at, mask=kv_mask, other=0.0).to(CDT)  # [BN, DB]
        vv = tl.load(PV + at, mask=kv_mask, other=0.0)
        if GATED:
            u = tl.load(PU + b * K + j, mask=jm, other=0.0).to(tl.float64)
            gate = tl.where(ok, tl.minimum(tl.maximum(u - tau, 0.0), 1.0), 0.0).to(CDT)
        else:
            gate = tl.full([BN], 1.0, CDT)
        s = tl.dot(q, tl.trans(kk), input_precision=PREC, out_dtype=CDT) * scale  # [RB, BN]
        if SOFT_KV:
            s = s * gate[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m, l, acc = _online_softmax(m, l, acc, s, gate, vv.to(CDT), PREC)

    # the tail: positions t - Wt .. t - 1 (those below 0 do not exist yet); slot j holds t - Wt + j, or in a
    # ring (TAIL_RING) position p sits in slot p mod Wt: slot j holds t - Wt + (j - t) mod Wt, which is >= 0
    # exactly when j < t (before t = Wt the ring's slots are the positions themselves; after, all are filled)
    t_end = tl.minimum(Wt, (sp + 1) * T_PER)
    for j0 in range(sp * T_PER, t_end, BN):
        j = j0 + tl.arange(0, BN)
        jm = j < t_end
        if TAIL_RING:
            ok = jm & (j < t)
        else:
            ok = jm & (t - Wt + j >= 0)
        at = ((b * Wt + j) * Hkv + g)[:, None] * D + d[None, :]
        kv_mask = jm[:, None] & dm[None, :]
        kk = tl.load(TK + at, mask=kv_mask, other=0.0).to(CDT)
        vv = tl.load(TV + at, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(kk), input_precision=PREC, out_dtype=CDT) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m, l, acc = _online_softmax(m, l, acc, s, tl.full([BN], 1.0, CDT), vv.to(CDT), PREC)

    # the token itself (in its own window when w > 0), in the last split
    if SELF_OK:
        if sp == n_splits - 1:
            at = (b * Hkv + g) * D + d
            kk = tl.load(NK + at, mask=dm, other=0.0).to(CDT)
            vv = tl.load(NV + at, mask=dm, other=0.0).to(CDT)
            s = tl.sum(q * kk[None, :], axis=1) * scale  # [RB]
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            l = l * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * vv[None, :]
            m = m_new

    h = b * H + g * R + r  # [RB] flat (row, head)
    if SPLIT:
        tl.store(PART_M + h * n_splits + sp, m, mask=rm)
        tl.store(PART_L + h * n_splits + sp, l, mask=rm)
        tl.store(PART_ACC + (h * n_splits + sp)[:, None] * D + d[None, :], acc, mask=rm[:, None] & dm[None, :])
    else:
        o = acc / l[:, None]
        tl.store(O + h[:, None] * D + d[None, :], o.to(O.dtype.element_ty), mask=rm[:, None] & dm[None, :])


@triton.jit
def combine_kernel(
    PART_M, PART_L, PART_ACC,  # [B, H, S], [B, H, S], [B, H, S, D] from attend_kernel's splits
    O,  # out: [B, H, D]
    S, D: tl.constexpr, SB: tl.constexpr, DB: tl.constexpr,
):
    """One program per (row, head): the splits' partial softmaxes merged (a split with no key: m = -inf, weight 0)."""
    h = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SB)
    d = tl.arange(0, DB)
    sm = s < S
    m = tl.load(PART_M + h * S + s, mask=sm, other=float("-inf"))
    l = tl.load(PART_L + h * S + s, mask=sm, other=0.0)
    acc = tl.load(PART_ACC + (h * S + s)[:, None] * D + d[None, :], mask=sm[:, None] & (d < D)[None, :], other=0.0)
    mm = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - mm))  # [SB]
    o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(O + h * D + d, o.to(O.dtype.element_ty), mask=d < D)


# Programs one layer's attention aims for: a few per SM of a current GPU (B * Hkv programs without splits).
ATTEND_PROGRAMS = 512
MAX_SPLITS = 32


def attend_splits(batch: int, kv_heads: int, topk: int, tail_slots: int) -> int:
    """Splits of each (row, KV head)'s keys: enough programs to fill the GPU, at least 16 keys of pool or tail
    per split; fixed by the shapes (not the device), so every GPU sums the same way."""
    useful = max(1, triton.cdiv(max(topk, tail_slots), 16))
    return max(1, min(useful, MAX_SPLITS, triton.cdiv(ATTEND_PROGRAMS, batch * kv_heads)))


def attend_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, *, window: int, variant: str,
                  scale: float, tail_ring: bool = False, splits: int | None = None, block_n: int | None = None,
                  num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """o [B, H, D]: decode.attend_torch's result (the same signature; `splits`: attend_splits' choice by default;
    block_n (keys per block), num_warps, num_stages: the launch's, for benchmarks/decode_kernels.py's sweep)."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    K, Wt = cache.topk, cache.tail_slots
    S = splits or attend_splits(B, Hkv, K, Wt)
    o = torch.empty_like(q)
    f64 = q.dtype == torch.float64
    cdt = tl.float64 if f64 else tl.float32
    # a tensor-core product's sides: at least 16 (query heads padded with masked rows, head dims with masked columns)
    RB, DB = max(16, triton.next_power_of_2(H // Hkv)), max(16, triton.next_power_of_2(D))
    k_per, t_per = triton.cdiv(K, S), triton.cdiv(Wt, S)
    # Keys per block: the split's share, 16 to 128, with at most 16 KB of each K and V tile as the cache stores them
    # (the pipeline keeps a few of each in shared memory: D = 128 in float32 at 128 keys asked for 275 KB, over an H200's 227)
    fit = 16384 // (DB * cache.pool_k.element_size())
    BN = block_n or max(16, min(128, fit, triton.next_power_of_2(max(k_per, t_per, 1))))
    launch = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    part_dtype = torch.float64 if f64 else torch.float32
    if S > 1:
        part_m = torch.empty(B, H, S, dtype=part_dtype, device=q.device)
        part_l = torch.empty(B, H, S, dtype=part_dtype, device=q.device)
        part_acc = torch.empty(B, H, S, D, dtype=part_dtype, device=q.device)
    else:
        part_m = part_l = part_acc = o  # not written
    attend_kernel[(B, Hkv, S)](
        Q=q.contiguous(), PK=cache.pool_k.contiguous(), PV=cache.pool_v.contiguous(), TK=cache.tail_k.contiguous(),
        TV=cache.tail_v.contiguous(), NK=k.contiguous(), NV=v.contiguous(),
        PPOS=cache.pool_pos.contiguous(), PU=cache.pool_u.contiguous(), TAU=cache.tau.contiguous(), SEEN=cache.seen.contiguous(),
        O=o, PART_M=part_m, PART_L=part_l, PART_ACC=part_acc,
        # float64 needs the scale's float64 bits; a float32 softmax takes it as an argument (no fill kernel per call)
        SCALE=torch.full((1,), scale, dtype=torch.float64, device=q.device) if f64 else float(scale),
        K=K, Wt=Wt, Hkv=Hkv, H=H, K_PER=k_per, T_PER=t_per,
        R=H // Hkv, RB=RB, D=D, DB=DB, BN=BN,
        GATED=K > 0 and variant != "straight_through", SOFT_KV=variant == "soft_kv", SELF_OK=window > 0, CDT=cdt,
        SPLIT=S > 1, SCALE_IN_MEMORY=f64, TAIL_RING=tail_ring,
        PREC="ieee" if cache.pool_k.dtype in (torch.float32, torch.float64) else "tf32", **launch,
    )
    if S > 1:
        combine_kernel[(B * H,)](PART_M=part_m, PART_L=part_l, PART_ACC=part_acc, O=o, S=S, D=D,
                                 SB=triton.next_power_of_2(S), DB=DB, num_warps=1)
    return o
