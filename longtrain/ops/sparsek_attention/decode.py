"""SparseK attention for one new token per row: the decode step, and the plain reference beside it.

A chunk call of one token (`sparsek_attention_chunk` with L = 1) lays out the extended keys, runs
the selection scan and the block-wise core: about 1 ms per layer of fixed overhead. Decoding needs
much less, because everything the new query sees is already in the cache (DESIGN.md section 3):

  - its window: the tail (positions t-w+1 .. t-1) and itself;
  - its selected keys S_t: the pool, which is the top-k of the candidates j <= t - w, and the
    SparseK threshold tau_t over the same candidates, which the cache holds.

So a step is one query against [pool K][tail W-1][itself], then one candidate admitted: the token
that leaves the window (position t-w+1; the new token itself when w <= 1; before the query when
w = 0, where a token is its own candidate). Admitting updates, on the cache's tensors:

  - the pool: the candidate replaces the worst pooled key (value, position) if it beats it; the
    pool stays in the layout the chunk op writes (valid keys first, ascending positions);
  - the threshold state: the candidate's score joins the scores above tau, and tau rises to the
    root of f(tau) = sum clamp(u - tau, 0, 1) = k. With the scores sorted, f at every breakpoint
    (u and u - 1) is two binary searches and a prefix sum away: O(cap log cap) per step, never a
    rescan of the history.

On CUDA the admission runs as one Triton kernel (decode_triton.py: the same steps, and the scan's
own walk over the breakpoints; for a ring cache it also writes the K/V in place); the torch version here
is its reference and the CPU path. Every
step is a fixed sequence of operations with static shapes and no host synchronisation on the GPU,
so a caller may capture it in a CUDA graph. Given a SparseKRingCache (cache.py: the decoder's layout, tail
slots by position mod w - 1, pool slots in no order) the step writes the new token's K/V and an admitted
key into their slots in place instead of rebuilding the tail and pool. The result equals the chunk op's
(the reference) in selection and output, and in the cache's pool, tail and threshold state as
sets, with tau up to rounding; tests compare the two over many steps. A decode step takes any
cache the chunk op writes, and the chunk op takes any cache a decode step writes.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from longtrain.ops.sparsek_attention.cache import SparseKCache, SparseKRingCache
from longtrain.ops.sparsek_attention.op import ChunkSelection, check_inputs, sparsek_attention_chunk

_MASK63 = (1 << 63) - 1
_U64 = 1 << 64


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - _U64 if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def position_hash(pos: torch.Tensor) -> torch.Tensor:
    """The selection scan's position hash (splitmix64 masked to 63 bits) of an int64 tensor."""
    x = pos + _i64(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _i64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _i64(0x94D049BB133111EB)
    return (x ^ _shr(x, 31)) & _MASK63


# ----------------------------------------------------------------------------- the decode step


def sparsek_attention_decode(
    q: torch.Tensor,  # [B, H, D] the new token's query
    k: torch.Tensor,  # [B, Hkv, D] its key (after RoPE)
    v: torch.Tensor,  # [B, Hkv, D]
    u: torch.Tensor,  # [B] its importance score
    cache: SparseKCache,  # after positions [0, t); its topk and window are the call's
    *,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    with_selection: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, SparseKCache, ChunkSelection | None]:
    """SparseK attention of one token per row at position cache.seen: (o [B, H, D], next cache, selection).

    Equals sparsek_attention_chunk on the same token (the reference below). `with_selection`
    also returns the query's ChunkSelection ([B, 1] fields) for comparisons; it costs a few ops.
    backend: how the query attends and a candidate is admitted: "torch" (tensor ops: attend_torch,
    _admit_pool, _admit_threshold), "triton" (two kernels, decode_triton.py) or "auto" (Triton for CUDA tensors).
    """
    check_inputs(q, k, v, u, variant, one_token=True)
    topk, window = cache.topk, cache.window
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be auto, torch or triton; got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.is_cuda and _triton_available() else "torch"
    t = cache.seen  # [B] this token's position
    ring = isinstance(cache, SparseKRingCache)  # the decoder's layout: K/V written in place (cache.py)
    if window == 0:  # SparseK only: the token is its own candidate, admitted before its query
        cache = _admit(cache, k, v, u, t, topk=topk, backend=backend)

    # 1. The query against [pool K][tail W-1][itself].
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attend = attend_torch
    if backend == "triton":
        from longtrain.ops.sparsek_attention.decode_triton import attend_triton as attend
    o = attend(q, k, v, cache, window=window, variant=variant, scale=scale, tail_ring=ring)

    selection = _selection(cache, topk) if with_selection else None

    # 2. The token that leaves the window becomes a candidate; the new token joins the tail.
    Wt = cache.tail_slots
    if ring and Wt > 0:  # in place: the leaving key into its pool slot if admitted, the new token into its ring slot
        leaving = t % Wt  # [B] the ring slot of position t - Wt, the one leaving the window (then t's)
        cpos = t - window + 1
        slot = None
        if topk > 0:
            # [B], a copy: the step overwrites the ring slot (in the kernel its pool program does, while the
            # threshold program, which runs beside it, reads the score from this copy)
            cu = cache.tail_u.gather(1, leaving[:, None])[:, 0]
            if backend == "triton":  # the admission and both writes in one launch (admit_kernel's RING)
                from longtrain.ops.sparsek_attention.decode_triton import admit_triton

                fields, _, _ = admit_triton(cache, cu, cpos, ring_write=(leaving, k, v, u))
                return o, replace(cache, **fields, seen=t + 1), selection
            cache, slot = _admit_ring(cache, cu, cpos, topk=topk, backend=backend)
        write = _ring_write
        # a window's writes: one launch eagerly; under torch.compile the torch writes, which Inductor fuses (the
        # compiled step was measured that way; the kernel inside a compiled sliding-window step was not tried)
        if backend == "triton" and not torch.compiler.is_compiling():
            from longtrain.ops.sparsek_attention.decode_triton import ring_write_triton as write
        write(cache, slot, leaving, cpos, k, v, u)
        return o, replace(cache, seen=t + 1), selection
    if window > 0:
        if Wt > 0:
            ck, cv, cu = cache.tail_k[:, 0], cache.tail_v[:, 0], cache.tail_u[:, 0]
        else:  # w = 1: the new token itself
            ck, cv, cu = k.to(cache.pool_k.dtype), v.to(cache.pool_v.dtype), u
        cache = _admit(cache, ck, cv, cu, t - window + 1, topk=topk, backend=backend)
    if Wt > 0:
        cache = replace(
            cache,
            tail_k=torch.cat([cache.tail_k[:, 1:], k[:, None].to(cache.tail_k.dtype)], 1),
            tail_v=torch.cat([cache.tail_v[:, 1:], v[:, None].to(cache.tail_v.dtype)], 1),
            tail_u=torch.cat([cache.tail_u[:, 1:], u[:, None].to(cache.tail_u.dtype)], 1),
        )
    return o, replace(cache, seen=t + 1), selection


def attend_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: SparseKCache, *, window: int, variant: str,
                 scale: float, tail_ring: bool = False) -> torch.Tensor:
    """o [B, H, D]: each row's query (q [B, H, D]) against [pool K][tail W-1][itself] (k, v [B, Hkv, D]), with the
    pool's gate clamp(u - tau, 0, 1); tail_ring: the tail's slots as a SparseKRingCache keeps them. The reference of
    decode_triton.attend_triton (the same signature)."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    K, Wt = cache.topk, cache.tail_slots
    t = cache.seen  # [B] this token's position
    dev = q.device
    cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype  # softmax precision
    j = torch.arange(Wt, device=dev)[None]
    tail_pos = t[:, None] - Wt + ((j - t[:, None]) % max(Wt, 1) if tail_ring else j)  # [B, W-1] the position in slot j
    in_window = torch.full((B, 1), window > 0, device=dev)  # w = 0: the token sees itself only if pooled
    ok = torch.cat([cache.pool_pos >= 0, tail_pos >= 0, in_window], 1)  # [B, N]
    keys = torch.cat([cache.pool_k.to(cdt), cache.tail_k.to(cdt), k[:, None].to(cdt)], 1)  # [B, N, Hkv, D]
    vals = torch.cat([cache.pool_v.to(cdt), cache.tail_v.to(cdt), v[:, None].to(cdt)], 1)
    if K > 0 and variant != "straight_through":  # straight-through's gate is 1 in the forward pass
        tau = cache.tau.to(torch.float64)
        gate_pool = (cache.pool_u.to(torch.float64) - tau[:, None]).clamp(0, 1)  # [B, K]; tau = -inf: 1
        gate_pool = torch.where(cache.pool_pos >= 0, gate_pool, 0.0)  # empty slots: -inf - (-inf)
        gate = torch.cat([gate_pool.to(cdt), torch.ones(B, Wt + 1, dtype=cdt, device=dev)], 1)  # [B, N]
    else:
        gate = torch.ones(B, K + Wt + 1, dtype=cdt, device=dev)
    qh = q.to(cdt).view(B, Hkv, H // Hkv, D)  # [B, Hkv, R, D]
    logits = torch.einsum("bgrd,bngd->bgrn", qh, keys) * scale  # [B, Hkv, R, N]
    if variant == "soft_kv":
        logits = logits * gate[:, None, None]
    logits = logits.masked_fill(~ok[:, None, None], -torch.inf)
    p = torch.softmax(logits, dim=-1) * gate[:, None, None]
    return torch.einsum("bgrn,bngd->bgrd", p, vals).reshape(B, H, D).to(q.dtype)


def _selection(cache: SparseKCache, topk: int) -> ChunkSelection:
    """What the query selects: the pool (as the scan reports it: theta only once the pool is full)."""
    ok = cache.pool_pos >= 0  # [B, K]
    n = ok.sum(1)
    fp = torch.where(ok, position_hash(cache.pool_pos.clamp(min=0)), 0).sum(1) & _MASK63
    full = (n == topk) & (topk > 0)
    theta_pos = torch.where(full, _worst(cache.pool_u, cache.pool_pos)[1], -1) if topk else torch.full_like(n, -1)
    valid = torch.arange(cache.cap, device=ok.device)[None] < cache.thr_count[:, None]
    frac = valid & (cache.thr_u < cache.tau[:, None] + 1)
    tau = cache.tau if topk > 0 else torch.full_like(cache.tau, torch.inf)
    return ChunkSelection(
        fingerprint=fp[:, None], theta_pos=theta_pos[:, None], tau=tau[:, None],
        n_active=(frac.sum(1) if topk > 0 else torch.zeros_like(n))[:, None], overflow=cache.overflow,
    )


def _worst(pool_u: torch.Tensor, pool_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest pooled (value, position) per row: theta's value and position ([B] each)."""
    ok = pool_pos >= 0
    umin = torch.where(ok, pool_u, torch.inf).amin(1)  # [B]
    tied = ok & (pool_u == umin[:, None])
    pmin = torch.where(tied, pool_pos, torch.iinfo(torch.int64).max).amin(1)
    return umin, pmin


# ----------------------------------------------------------------------------- admitting a candidate


def _triton_available() -> bool:
    try:
        from longtrain.ops.sparsek_attention import decode_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _admit(cache: SparseKCache, ck, cv, cu, cpos, *, topk: int, backend: str = "torch") -> SparseKCache:
    """The cache after candidate (ck, cv [B, Hkv, D], cu [B], cpos [B]) joins; rows with cpos < 0 unchanged."""
    if topk == 0:  # a sliding window selects nothing: no pool, no threshold
        return cache
    if isinstance(cache, SparseKRingCache):  # the candidate into its pool slot, in place
        cache, slot = _admit_ring(cache, cu, cpos, topk=topk, backend=backend)
        if slot is not None:
            _write_slot(cache, slot, ck, cv, cu, cpos)
        return cache
    if backend == "triton":
        from longtrain.ops.sparsek_attention.decode_triton import admit_triton

        fields, src, _ = admit_triton(cache, cu, cpos)  # pool scores and positions, threshold state; K/V below
        rows = torch.arange(cu.shape[0], device=cu.device)[:, None]
        return replace(
            cache, **fields,
            pool_k=torch.cat([cache.pool_k, ck[:, None].to(cache.pool_k.dtype)], 1)[rows, src],
            pool_v=torch.cat([cache.pool_v, cv[:, None].to(cache.pool_v.dtype)], 1)[rows, src],
        )
    ok = cpos >= 0  # [B]
    if cu.device.type == "cpu" and not bool((ok & (cu.to(torch.float64) > cache.tau)).any()):
        # Nothing to update: the candidate is at or below tau, so below the pool's worst key too (a
        # host branch, free on the CPU; on a GPU every step runs the same ops, so a graph can hold it). Compiled on
        # the CPU it breaks the graph, and must: without the break Inductor's CPU code of the whole step admitted
        # a wrong threshold state (test_the_compiled_cpu_decoder_equals_the_eager_one).
        return cache
    return replace(cache, **_admit_pool(cache, ck, cv, cu, cpos, ok), **_admit_threshold(cache, cu, cpos, ok, topk))


def _admit_ring(cache: SparseKCache, cu, cpos, *, topk: int, backend: str) -> tuple[SparseKCache, torch.Tensor | None]:
    """A ring cache's admission of the candidate (score cu, position cpos [B]) without its K/V: the cache with the
    next threshold state, and the pool slot [B] the candidate takes (-1: none; None: no row admits it)."""
    if backend == "triton":
        from longtrain.ops.sparsek_attention.decode_triton import admit_triton

        fields, _, slot = admit_triton(cache, cu, cpos)  # its pool_u, pool_pos: the chunk op's layout, not the ring's
        return replace(cache, **{n: f for n, f in fields.items() if n not in ("pool_u", "pool_pos")}), slot
    ok = cpos >= 0  # [B]
    if cu.device.type == "cpu" and not bool((ok & (cu.to(torch.float64) > cache.tau)).any()):
        return cache, None  # nothing to update (as _admit: a host branch, free on the CPU)
    slot = _admit_slot(cache, cu, ok)
    return replace(cache, **_admit_threshold(cache, cu, cpos, ok, topk)), slot


def _ring_write(cache: SparseKCache, slot: torch.Tensor | None, leaving: torch.Tensor, cpos: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, u: torch.Tensor) -> None:
    """In a ring cache, in place: the key in ring slot `leaving` [B] (position cpos [B]) into pool slot `slot` [B]
    (-1 or None: not admitted), then the new token (k, v [B, Hkv, D], u [B]) into that ring slot
    (decode_triton.ring_write_triton does it in one launch)."""
    rows = torch.arange(leaving.shape[0], device=leaving.device)
    if slot is not None and cache.topk > 0:  # (indexing copies: the ring slot is overwritten below)
        ck, cv, cu = cache.tail_k[rows, leaving], cache.tail_v[rows, leaving], cache.tail_u[rows, leaving]
        _write_slot(cache, slot, ck, cv, cu, cpos)
    for buf, new in ((cache.tail_k, k), (cache.tail_v, v), (cache.tail_u, u)):
        buf[rows, leaving] = new.to(buf.dtype)


def _admission(cache: SparseKCache, cu, ok) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whether the candidate (score cu, admissible where ok [B]) joins the pool, whatever the slots' order:
    (n valid keys, evict the worst key, grow into an empty slot, the worst key's position pmin), each [B]."""
    K = cache.topk
    n = (cache.pool_pos >= 0).sum(1)
    umin, pmin = _worst(cache.pool_u, cache.pool_pos)
    # The candidate's position is larger than every pooled one, so it wins ties: (u, pos) > theta iff u >= umin.
    evict = ok & (cu.to(cache.pool_u.dtype) >= umin) & (n == K)
    return n, evict, ok & (n < K), pmin


def _admit_slot(cache: SparseKCache, cu, ok) -> torch.Tensor:
    """[B] the slot the candidate takes in a pool whose slots keep no order (valid ones first): the worst key's
    when it evicts it, the first empty one when the pool is not full, -1 when it stays out."""
    n, evict, grow, pmin = _admission(cache, cu, ok)
    worst = (cache.pool_pos == pmin[:, None]).to(torch.int64).argmax(1)  # positions are unique
    return torch.where(evict, worst, torch.where(grow, n, -1))


def _write_slot(cache: SparseKCache, slot: torch.Tensor, ck, cv, cu, cpos) -> None:
    """The candidate (ck, cv [B, Hkv, D], cu, cpos [B]) into pool slot `slot` [B] of each row, in place (-1: none)."""
    rows = torch.arange(slot.shape[0], device=slot.device)
    at = slot.clamp(min=0)
    keep = slot < 0
    for buf, new in ((cache.pool_k, ck), (cache.pool_v, cv), (cache.pool_u, cu), (cache.pool_pos, cpos)):
        old = buf[rows, at]
        buf[rows, at] = torch.where(keep.view(-1, *([1] * (old.dim() - 1))), old, new.to(buf.dtype))


def _admit_pool(cache: SparseKCache, ck, cv, cu, cpos, ok) -> dict[str, torch.Tensor]:
    """The top-k pool after the candidate, laid out as the chunk op does (valid first, ascending positions)."""
    K = cache.topk
    n, evict, grow, pmin = (x[:, None] for x in _admission(cache, cu, ok))  # [B, 1] each
    s = torch.arange(K, device=cu.device)[None]  # [1, K]
    past_worst = (cache.pool_pos >= pmin).to(torch.int64)  # [B, K]: the worst key and those after it
    # Source slot of each new slot in [pool K][candidate]: evicting shifts the keys after the worst
    # one left and appends the candidate; growing appends it after the valid keys.
    src = torch.where(evict, s + past_worst, torch.where(grow & (s == n), K, s))  # [B, K]
    rows = torch.arange(cu.shape[0], device=cu.device)[:, None]

    def pick(pool: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        return torch.cat([pool, cand[:, None].to(pool.dtype)], 1)[rows, src]

    return dict(
        pool_k=pick(cache.pool_k, ck), pool_v=pick(cache.pool_v, cv),
        pool_u=pick(cache.pool_u, cu), pool_pos=pick(cache.pool_pos, cpos),
    )


def _admit_threshold(cache: SparseKCache, cu, cpos, ok, topk: int) -> dict[str, torch.Tensor]:
    """The threshold state after score cu joins (the scan's RowScanner.insert, on tensors).

    The scores are kept sorted ascending, +inf past the count; a sort per step makes any order
    the chunk op left them in fine, and keeps the valid ones first.
    """
    cap = cache.cap
    x = cu.to(torch.float64)[:, None]  # [B, 1]
    tau0 = cache.tau[:, None]
    ins = ok[:, None] & (x > tau0)  # a score at or below tau never matters again
    valid = torch.arange(cap, device=x.device)[None] < cache.thr_count[:, None]
    X = torch.cat([torch.where(valid, cache.thr_u, torch.inf), torch.where(ins, x, torch.inf)], 1).sort(1).values
    n = cache.thr_count[:, None] + ins.to(torch.int64)  # [B, 1]
    # Out of room: the lowest fractional score goes (the lowest score, when it is below tau + 1).
    drop = (n > cap) & (X[:, :1] < tau0 + 1)
    X = torch.where(drop, X[:, 1:], X[:, :cap])  # [B, cap]
    n = n - drop.to(torch.int64)
    # Once there are more than k candidates, tau rises to the root of f(tau) = sum clamp(u - tau, 0, 1) = k
    # and the scores at or below it leave for good.
    tau = torch.where(ins & (cpos[:, None] >= topk), _solve_tau(X, tau0, topk), tau0)
    X = torch.where(X > tau, X, torch.inf).sort(1).values
    count = torch.isfinite(X).sum(1)
    sat = X >= tau + 1
    frac = torch.isfinite(X) & ~sat
    return dict(
        thr_u=X, thr_saturated=sat & torch.isfinite(X), thr_count=count, tau=tau[:, 0],
        thr_sum=torch.where(frac, X, 0.0).sum(1), overflow=cache.overflow + (ins & drop)[:, 0].to(torch.int64),
    )


def _solve_tau(X: torch.Tensor, tau0: torch.Tensor, k: int) -> torch.Tensor:
    """The smallest tau >= tau0 [B, 1] with f(tau) = sum_j clamp(X_j - tau, 0, 1) <= k, for sorted scores
    X [B, M] (+inf past the valid ones): the scan's walk over the breakpoints, all breakpoints at once.

    f is piecewise linear and non-increasing with breakpoints at every X_j and X_j - 1. The last
    breakpoint b >= tau0 with f(b) > k starts the piece that holds the root; on that piece
    f(tau) = f(b) - |A| (tau - b) with A = {X > b, X - 1 <= b} the fractional scores. X - 1 is
    compared as the breakpoints are computed, so a score whose X - 1 is b counts as fractional.
    """
    Xm1 = X - 1  # sorted too
    valid = torch.isfinite(X)
    n = valid.sum(1, keepdim=True)  # [B, 1]
    lo = X[:, :1]  # the smallest score: a reference point that keeps the prefix sums small
    P = torch.nn.functional.pad(torch.where(valid, X - lo, 0.0).cumsum(1), (1, 0))  # [B, M + 1]
    bp = torch.cat([X, Xm1], 1)  # [B, 2M] breakpoints (+inf past the valid ones)
    i = torch.searchsorted(X, bp, right=True).clamp(max=X.shape[1])  # scores <= b
    j = torch.searchsorted(Xm1, bp, right=True).clamp(max=X.shape[1])  # scores - 1 <= b (i <= j)
    f = (n - j) + P.gather(1, j) - P.gather(1, i) - (j - i) * (bp - lo)  # f at every breakpoint
    # Where f = k on a whole piece (no fractional scores) tau is not unique; the scan takes its left
    # end, so a breakpoint counts only if f is above k by more than the prefix sums' rounding.
    slack = 1e-12 * (1 + P[:, -1:])
    above = (bp >= tau0) & (f > k + slack) & torch.isfinite(bp)
    b = torch.maximum(torch.where(above, bp, -torch.inf).amax(1, keepdim=True), tau0)  # [B, 1] the root's piece
    active = (X > b) & (Xm1 <= b)
    n_active = active.sum(1, keepdim=True)
    f_b = (valid & (Xm1 > b)).sum(1, keepdim=True) + torch.where(active, X - b, 0.0).sum(1, keepdim=True)  # afresh
    root = b + (f_b - k) / n_active.clamp(min=1)
    return torch.maximum(torch.where(n_active > 0, root, b), tau0)


# ----------------------------------------------------------------------------- the reference


def sparsek_attention_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    cache: SparseKCache,
    *,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    with_selection: bool = False,
) -> tuple[torch.Tensor, SparseKCache, ChunkSelection | None]:
    """sparsek_attention_decode by definition: a chunk of one token through the chunk op (naive core, CPU scan)."""
    check_inputs(q, k, v, u, variant, one_token=True)
    o, nxt, sel = sparsek_attention_chunk(
        q[:, None], k[:, None], v[:, None], u[:, None], cache, variant=variant, scale=scale,
        backend="naive", scan="host",
    )
    return o[:, 0], nxt, sel if with_selection else None
