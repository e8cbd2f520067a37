"""The decode step (one query against the cache, incremental threshold) equals the chunk op on one token.

The Triton cases run their kernels on DEV: the GPU where there is one (compiled kernels), else the CPU under
TRITON_INTERPRET=1. Their reference stays on the CPU, so a GPU run compares the compiled kernel against it."""

import os
from dataclasses import replace

import pytest
import torch

from longtrain.ops.selection.naive import position_hash as scan_position_hash
from longtrain.ops.sparsek_attention import (
    SparseKCache,
    sparsek_attention_chunk,
    sparsek_attention_decode,
    sparsek_attention_decode_reference,
)
from longtrain.ops.sparsek_attention.cache import SparseKRingCache, from_ring, to_ring
from longtrain.ops.sparsek_attention.decode import position_hash

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _on(device, *xs):
    """The tensors and caches xs on device (None stays None)."""
    out = [x if x is None else x.to(device) for x in xs]
    return out[0] if len(out) == 1 else out

CASES = [
    # topk, window, H, Hkv, variant, cap, prefill, steps, u_spread
    (5, 4, 4, 2, "hard_k_soft_v", None, 23, 40, 0.7),  # GQA, a prefill that is no multiple of anything
    (6, 0, 2, 2, "soft_kv", None, 9, 35, 0.7),  # SparseK only: a token is its own candidate
    (0, 7, 2, 1, "hard_k_soft_v", None, 5, 20, 0.7),  # sliding window only, MQA
    (3, 1, 2, 2, "straight_through", None, 0, 30, 0.7),  # w = 1 (no tail), from an empty cache
    (40, 3, 2, 2, "hard_k_soft_v", None, 11, 15, 0.7),  # k larger than every candidate set
    (4, 3, 3, 1, "hard_k_soft_v", 6, 30, 50, 0.02),  # scores within 0.05: many fractional, the cap overflows
    (7, 5, 2, 2, "soft_kv", None, 2, 50, 3.0),  # widely spread scores: mostly saturated
]


def _rand(B, T, H, Hkv, D, dtype, spread, t0=0):
    pos = torch.arange(t0, t0 + T, dtype=dtype)
    return (
        torch.randn(B, T, H, D, dtype=dtype), torch.randn(B, T, Hkv, D, dtype=dtype), torch.randn(B, T, Hkv, D, dtype=dtype),
        torch.randn(B, T, dtype=dtype) * spread + pos * 1e-3,
    )


def _sets_equal(a: SparseKCache, b: SparseKCache, topk: int, atol: float):
    """Two caches hold the same state: tail exactly, pool and threshold state as sets, tau to rounding."""
    assert torch.equal(a.seen, b.seen)
    for name in ("tail_k", "tail_v", "tail_u"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for r in range(a.seen.shape[0]):
        ia, ib = [c.pool_pos[r].argsort() for c in (a, b)]  # same set, maybe in another slot order
        assert torch.equal(a.pool_pos[r, ia], b.pool_pos[r, ib])
        for name in ("pool_k", "pool_v", "pool_u"):
            assert torch.equal(getattr(a, name)[r, ia], getattr(b, name)[r, ib]), name
        if topk == 0:
            continue  # a sliding window keeps no threshold state worth comparing
        # The scores above tau, as sets. A score that tau lands on (a root at a breakpoint) may stay in
        # one state and not the other: the two compute tau in different orders, a rounding apart.
        va, sa = _scores(a, r, atol)
        vb, sb = _scores(b, r, atol)
        assert torch.equal(va, vb) and torch.equal(sa, sb)
    if topk:
        assert torch.allclose(a.tau, b.tau, atol=atol, rtol=0)
        for c in (a, b):  # the running sum of the fractional scores is theirs
            valid = torch.arange(c.cap)[None] < c.thr_count[:, None]
            frac_sum = torch.where(valid & ~c.thr_saturated, c.thr_u, 0.0).sum(1)
            assert torch.allclose(c.thr_sum, frac_sum, atol=1e-9, rtol=0)
        assert torch.equal(a.overflow, b.overflow)


def _scores(c: SparseKCache, r: int, atol: float):
    """Row r's threshold scores clear of tau by more than atol, and the saturated ones, sorted."""
    n = int(c.thr_count[r])
    u, sat = c.thr_u[r, :n], c.thr_saturated[r, :n]
    keep = u > c.tau[r] + atol
    return u[keep].sort().values, u[keep & sat].sort().values


@pytest.mark.parametrize("ring", [False, True], ids=["chunk layout", "ring layout"])
@pytest.mark.parametrize(
    "topk,window,H,Hkv,variant,cap,prefill,steps,spread,backend",
    [(*c, "torch") for c in CASES] + [(*c, "triton") for c in CASES if c[0] and c[0] < 40 and c[1] != 1],
)
def test_decode_equals_the_chunk_op(topk, window, H, Hkv, variant, cap, prefill, steps, spread, backend, ring):
    """ring: the decoder's layout (SparseKRingCache), which the step updates in place; compared through from_ring."""
    if backend == "triton":
        pytest.importorskip("triton")  # on the CPU: the kernel under TRITON_INTERPRET=1
        cap = cap or 64  # a small state keeps the interpreted kernel quick (it may overflow: both sides count it)
        steps = steps // 2 + 10
    torch.manual_seed(topk * 100 + window)
    B, D, dtype = 2, 8, torch.float64
    cache = SparseKCache.empty(B, topk, window, Hkv, D, dtype=dtype, score_dtype=dtype, cap=cap)
    kw = dict(variant=variant)
    if prefill:  # rows at different positions: the second row's prefill is 3 tokens shorter
        q, k, v, u = _rand(B, prefill, H, Hkv, D, dtype, spread)
        lengths = torch.tensor([prefill, max(prefill - 3, 0)])
        _, cache, _ = sparsek_attention_chunk(q, k, v, u, cache, lengths=lengths, backend="naive", scan="host", **kw)
    dev = DEV if backend == "triton" else "cpu"  # the reference always on the CPU
    fast, ref = _on(dev, to_ring(cache) if ring else cache), cache
    _sets_equal(_on("cpu", from_ring(fast)), ref, topk, 0.0)
    pooled_changes = 0
    for step in range(steps):
        q, k, v, u = [x[:, 0] for x in _rand(B, 1, H, Hkv, D, dtype, spread, t0=prefill + step)]
        o1, fast, s1 = sparsek_attention_decode(*_on(dev, q, k, v, u), fast, with_selection=True, backend=backend, **kw)
        o1, s1 = o1.cpu(), replace(s1, **{f: getattr(s1, f).cpu() for f in ("fingerprint", "theta_pos", "n_active", "tau")})
        o2, nxt, s2 = sparsek_attention_decode_reference(q, k, v, u, ref, with_selection=True, **kw)
        pooled_changes += int((nxt.pool_pos.sort(1).values != ref.pool_pos.sort(1).values).any())
        ref = nxt
        assert torch.allclose(o1, o2, atol=1e-12, rtol=0), step
        assert torch.equal(s1.fingerprint, s2.fingerprint), step
        assert torch.equal(s1.theta_pos, s2.theta_pos), step
        assert (s1.n_active - s2.n_active).abs().max() <= 1, step  # a score exactly at tau: see _scores
        assert torch.allclose(s1.tau, s2.tau, atol=1e-12, rtol=0), step
        assert isinstance(fast, SparseKRingCache) == ring and fast.seen.device.type == torch.device(dev).type
        _sets_equal(_on("cpu", from_ring(fast)), ref, topk, 1e-12)
    if topk:
        assert pooled_changes >= 3  # the pool really turned over
    if spread < 0.1:
        assert (fast.overflow > 0).all()  # the overflow path ran (and matched the scan's count)


def test_float32_and_bfloat16_follow_the_reference():
    torch.manual_seed(1)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        B, H, Hkv, D, topk, window = 2, 4, 2, 16, 6, 5
        cache = SparseKCache.empty(B, topk, window, Hkv, D, dtype=dtype, score_dtype=torch.float32)
        q, k, v, u = _rand(B, 20, H, Hkv, D, torch.float32, 0.7)
        _, cache, _ = sparsek_attention_chunk(q.to(dtype), k.to(dtype), v.to(dtype), u, cache, backend="naive",
                                              scan="host")
        fast, ref = cache, cache
        for step in range(20):
            q, k, v, u = [x[:, 0] for x in _rand(B, 1, H, Hkv, D, torch.float32, 0.7, t0=20 + step)]
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            o1, fast, _ = sparsek_attention_decode(q, k, v, u, fast)
            o2, ref, _ = sparsek_attention_decode_reference(q, k, v, u, ref)
            assert o1.dtype == dtype
            assert torch.allclose(o1.float(), o2.float(), atol=atol, rtol=0), (dtype, step)
            assert torch.equal(fast.pool_pos.sort(1).values, ref.pool_pos.sort(1).values)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_pool_keeps_the_chunk_ops_layout(backend):
    """Valid keys first, ascending positions: the layout the device scan's tie-breaking relies on."""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(2)
    dev = DEV if backend == "triton" else "cpu"
    cache = SparseKCache.empty(1, 4, 2, 1, 4, dtype=torch.float64, score_dtype=torch.float64, cap=16, device=dev)
    for t in range(40):
        q, k, v, u = [x[:, 0] for x in _rand(1, 1, 1, 1, 4, torch.float64, 1.0, t0=t)]
        _, cache, _ = sparsek_attention_decode(*_on(dev, q, k, v, u), cache, backend=backend)
        pos = cache.pool_pos[0].cpu()
        n = int((pos >= 0).sum())
        assert (pos[n:] == -1).all() and torch.equal(pos[:n], pos[:n].sort().values)


@pytest.mark.parametrize("tile", [None, 4])  # one tile for the whole cap, and several (passes up to the count)
@pytest.mark.parametrize("cap", [12, 16])  # no power of 2, and one (the kernel's block is then the cap itself)
def test_the_admission_kernel_on_edge_states(cap, tile, monkeypatch):
    """admit_triton against the torch admission on states the chunk op left full and unsorted: a row that must
    drop its lowest fractional score, a row with no candidate, one sorted on arrival that admits a saturated
    score (tau rises past its lowest ones), one with fewer scores and garbage past its count; then steps from the
    kernel's sorted states."""
    pytest.importorskip("triton")  # on the CPU: the kernel under TRITON_INTERPRET=1
    from longtrain.ops.sparsek_attention import decode_triton
    from longtrain.ops.sparsek_attention.decode import _admit

    if tile:
        monkeypatch.setattr(decode_triton, "ADMIT_TILE", tile)

    torch.manual_seed(5)
    B, K, D = 4, 4, 4
    cache = SparseKCache.empty(B, K, 3, 1, D, dtype=torch.float64, score_dtype=torch.float64, cap=cap)
    q, k, v, u = _rand(B, 40, 2, 1, D, torch.float64, 0.02)  # close scores: many fractional, the cap overflows
    _, cache, _ = sparsek_attention_chunk(q, k, v, u, cache, backend="naive", scan="host")
    assert (cache.thr_count == cap).all()
    assert not (cache.thr_u[0, 1:] >= cache.thr_u[0, :-1]).all()  # the chunk op's order: unsorted
    thr_u, count = cache.thr_u.clone(), cache.thr_count.clone()
    thr_u[2] = thr_u[2].sort().values  # row 2 arrives sorted
    count[3] = cap - 3  # row 3: three scores fewer, garbage after them
    thr_u[3, cap - 3 :] = -7.0
    cache = replace(cache, thr_u=thr_u, thr_count=count)
    fast = ref = cache
    left = 0
    for step in range(6):
        tau = fast.tau
        cu = torch.stack([tau[0] + 0.3, tau[1] + 0.5, tau[2] + 5.0, tau[3] + 0.2 if step else tau[3] - 0.1])
        cpos = fast.seen - 2 + step
        cpos[1] = -1  # row 1: no candidate
        ck, cv = torch.randn(B, 1, D, dtype=torch.float64), torch.randn(B, 1, D, dtype=torch.float64)
        a = _on("cpu", _admit(*_on(DEV, fast, ck, cv, cu, cpos), topk=K, backend="triton"))  # the kernel on DEV
        b = _admit(ref, ck, cv, cu, cpos, topk=K, backend="torch")
        assert torch.equal(a.pool_pos, b.pool_pos) and torch.equal(a.pool_u, b.pool_u) and torch.equal(a.pool_k, b.pool_k)
        assert torch.equal(a.thr_count, b.thr_count) and torch.equal(a.overflow, b.overflow), step
        _sets_equal(a, b, K, 1e-12)
        for r in range(B):  # the kernel's state: sorted, +inf after the count
            n = int(a.thr_count[r])
            assert (a.thr_u[r, 1:n] >= a.thr_u[r, : n - 1]).all() and torch.isinf(a.thr_u[r, n:]).all()
        grew = (a.overflow - fast.overflow).tolist()
        full = (fast.thr_count == cap).tolist()
        assert grew[0] == full[0] and grew[2] == full[2] and grew[1] == 0  # full rows drop their lowest fractional score
        assert torch.equal(a.thr_u[1], fast.thr_u[1].sort().values)  # no candidate: the scores, sorted
        left += int(a.thr_count[2] < cap)  # row 2's saturated candidates raise tau past its lowest scores
        fast, ref = a, b
    assert left > 0


def test_position_hash_is_the_scans():
    pos = torch.tensor([0, 1, 2, 17, 4096, 10**6, 2**40])
    assert position_hash(pos).tolist() == [scan_position_hash(int(p)) for p in pos]


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(q=torch.zeros(2, 3, 4)), "multiple of kv heads"),
        (dict(u=torch.zeros(3)), "u must be [B]"),
        (dict(variant="soft"), "variant must be"),
        (dict(backend="cuda"), "backend must be"),
    ],
)
def test_bad_arguments(args, message):
    cache = SparseKCache.empty(2, 3, 2, 2, 4)
    kw = dict(q=torch.zeros(2, 4, 4), k=torch.zeros(2, 2, 4), v=torch.zeros(2, 2, 4), u=torch.zeros(2), cache=cache,
              variant="hard_k_soft_v")
    kw.update(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        sparsek_attention_decode(**kw)


@pytest.mark.parametrize("topk,window,H,Hkv,D,variant,t", [
    (5, 4, 6, 2, 12, "hard_k_soft_v", 9),  # 3 query heads per KV head, D no power of 2, a pool not yet full
    (140, 3, 2, 2, 8, "soft_kv", 300),  # K above the kernel's block of keys (128 here)
    (0, 150, 4, 1, 16, "hard_k_soft_v", 100),  # sliding window only, a tail longer than the block, partly before 0
    (6, 0, 2, 2, 8, "straight_through", 30),  # SparseK only: the token sees itself only through the pool
    (3, 1, 4, 4, 8, "soft_kv", 5),  # w = 1: no tail
    (8, 16, 6, 3, 12, "hard_k_soft_v", 3),  # a few tokens seen: most pool slots empty, most of the tail before 0; Hkv = 3
])
def test_the_attention_kernel_equals_attend_torch(topk, window, H, Hkv, D, variant, t):
    """decode_triton.attend_triton against attend_torch (its reference, the same signature), float64 and bf16."""
    pytest.importorskip("triton")  # on the CPU: the kernel under TRITON_INTERPRET=1
    from longtrain.ops.sparsek_attention.decode import attend_torch
    from longtrain.ops.sparsek_attention.decode_triton import attend_triton

    torch.manual_seed(topk + window)
    B = 3
    for dtype, atol in ((torch.float64, 1e-12), (torch.bfloat16, 1e-2)):
        cache = SparseKCache.empty(B, topk, window, Hkv, D, dtype=dtype, score_dtype=torch.float32)
        cache.pool_k.normal_(), cache.pool_v.normal_(), cache.tail_k.normal_(), cache.tail_v.normal_()
        cache.pool_u.copy_(torch.randn(B, topk))
        pos = torch.randperm(max(t, topk))[:topk].expand(B, -1).clone()
        pos[0, topk // 2 :] = -1  # row 0: a pool with empty slots
        pos[pos >= t] = -1  # fewer tokens seen than k: only positions before t pooled
        cache.pool_pos.copy_(pos)
        cache.pool_u.masked_fill_(pos < 0, -torch.inf)  # empty slots as the cache keeps them (row 0: u - tau is nan)
        cache.tau.copy_(torch.tensor([-torch.inf, 0.3, -0.5], dtype=torch.float64)[:B])  # tau = -inf: gate 1
        cache.seen.copy_(torch.tensor([t, max(t - 25, 0), t + 3]))  # rows at different positions, some before Wt
        q = torch.randn(B, H, D, dtype=dtype)
        k, v = torch.randn(B, Hkv, D, dtype=dtype), torch.randn(B, Hkv, D, dtype=dtype)
        kw = dict(window=window, variant=variant, scale=D**-0.5)
        want = attend_torch(q, k, v, cache, **kw)
        # the keys of each (row, KV head) in one program, split in 3 and 7 (some splits hold no key), and as the shapes choose
        for splits in (1, 3, 7, None):
            got = attend_triton(*_on(DEV, q, k, v, cache), **kw, splits=splits).cpu()
            assert got.dtype == dtype and got.shape == (B, H, D)
            err = (got.double() - want.double()).abs().max()
            assert torch.allclose(got.double(), want.double(), atol=atol, rtol=0), (dtype, splits, err)
        # the in-place decoder's ring tail (slot p mod Wt; rows before Wt have empty slots): the same keys, read
        # where the ring keeps them
        ring = to_ring(cache)
        want_ring = attend_torch(q, k, v, ring, **kw, tail_ring=True)
        assert torch.allclose(want_ring.double(), want.double(), atol=atol, rtol=0)  # the reference: the same attention
        for splits in (1, 3, None):
            got = attend_triton(*_on(DEV, q, k, v, ring), **kw, splits=splits, tail_ring=True).cpu()
            err = (got.double() - want_ring.double()).abs().max()
            assert torch.allclose(got.double(), want_ring.double(), atol=atol, rtol=0), (dtype, splits, "ring", err)


def test_the_ring_layout_round_trips_and_the_chunk_op_refuses_it():
    """to_ring then from_ring gives the cache back exactly; the chunk op refuses a ring cache with the fix."""
    torch.manual_seed(0)
    B, H, Hkv, D, topk, window = 3, 2, 1, 8, 5, 6
    cache = SparseKCache.empty(B, topk, window, Hkv, D, dtype=torch.float64, score_dtype=torch.float64)
    q, k, v, u = _rand(B, 17, H, Hkv, D, torch.float64, 0.7)
    _, cache, _ = sparsek_attention_chunk(q, k, v, u, cache, lengths=torch.tensor([17, 3, 9]), backend="naive", scan="host")
    ring = to_ring(cache)
    assert isinstance(ring, SparseKRingCache) and not torch.equal(ring.tail_k, cache.tail_k)  # rows at 17 and 9 rotate
    back = from_ring(ring)
    for name, t in cache.tensors().items():
        assert torch.equal(getattr(back, name), t), name
    with pytest.raises(TypeError, match="from_ring"):
        sparsek_attention_chunk(q, k, v, u, ring, backend="naive", scan="host")


@pytest.mark.parametrize("topk,window,Hkv,D,dtype", [
    (5, 7, 3, 12, torch.float64),  # Hkv * D no power of 2
    (0, 9, 2, 8, torch.float32),  # sliding window only: no pool
    (4, 3, 1, 16, torch.bfloat16),  # the new token arrives in float32, the cache keeps bf16
])
def test_the_ring_write_kernel_equals_the_torch_ring_write(topk, window, Hkv, D, dtype):
    """decode_triton.ring_write_triton against decode._ring_write (its reference, the same signature): rows
    admitted into a slot, a row not admitted (-1), and no admission at all (None)."""
    pytest.importorskip("triton")  # on the CPU: the kernel under TRITON_INTERPRET=1
    from longtrain.ops.sparsek_attention.decode import _ring_write
    from longtrain.ops.sparsek_attention.decode_triton import ring_write_triton

    torch.manual_seed(topk + window)
    B = 3
    cache = SparseKCache.empty(B, topk, window, Hkv, D, dtype=dtype, score_dtype=torch.float32)
    for t in (cache.pool_k, cache.pool_v, cache.tail_k, cache.tail_v, cache.pool_u, cache.tail_u):
        t.normal_()
    cache.pool_pos.copy_(torch.arange(topk).expand(B, -1))
    cache.seen.copy_(torch.tensor([40, 41, 57]))
    ring = to_ring(cache)
    Wt = cache.tail_slots
    leaving = ring.seen % Wt
    cpos = ring.seen - window + 1
    k, v = torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)  # float32, as the layer computes them
    u = torch.randn(B, dtype=torch.float64)
    for slot in ([1, -1, topk - 1] if topk else [-1, -1, -1], None):
        slot = None if slot is None else torch.tensor(slot)
        want, got = to_ring(from_ring(ring)), _on(DEV, to_ring(from_ring(ring)))  # two copies of the same state
        _ring_write(want, slot, leaving, cpos, k, v, u)
        ring_write_triton(got, *_on(DEV, slot, leaving, cpos, k, v, u))  # in place, on DEV
        got = _on("cpu", got)
        for name in ("pool_k", "pool_v", "pool_u", "pool_pos", "tail_k", "tail_v", "tail_u"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, slot)
        assert not torch.equal(got.tail_k, ring.tail_k)  # the new token went in


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ring_steps_one_launch_equals_the_torch_admission_and_writes(dtype):
    """A ring cache's Triton step (admit_kernel admits and writes K/V in place, one launch) leaves the cache the
    torch step leaves (_admit_ring, then _ring_write), slot for slot: rows evicting, growing into empty slots, and
    before their first candidate; the new token in float32 into a cache of another dtype."""
    pytest.importorskip("triton")  # on the CPU: the kernel under TRITON_INTERPRET=1
    torch.manual_seed(7)
    B, H, Hkv, D, topk, window = 3, 4, 2, 8, 4, 5
    cache = SparseKCache.empty(B, topk, window, Hkv, D, dtype=dtype, score_dtype=torch.float32, cap=32)
    q, k, v, u = _rand(B, 9, H, Hkv, D, torch.float32, 0.7)
    lengths = torch.tensor([9, 2, 6])  # row 1 has no candidate for its first steps, row 2's pool is not full
    _, cache, _ = sparsek_attention_chunk(q.to(dtype), k.to(dtype), v.to(dtype), u, cache, lengths=lengths,
                                          backend="naive", scan="host")
    fast, ref = _on(DEV, to_ring(cache)), to_ring(cache)
    changed = 0
    for step in range(12):
        q, k, v, u = [x[:, 0] for x in _rand(B, 1, H, Hkv, D, torch.float32, 0.7, t0=9 + step)]
        q = q.to(dtype)
        _, fast, _ = sparsek_attention_decode(*_on(DEV, q, k, v, u), fast, backend="triton")
        before = ref.pool_pos.clone()
        _, ref, _ = sparsek_attention_decode(q, k, v, u, ref, backend="torch")
        changed += int((ref.pool_pos != before).any())
        got = _on("cpu", fast)
        for name in ("pool_k", "pool_v", "pool_u", "pool_pos", "tail_k", "tail_v", "tail_u", "seen", "thr_count",
                     "overflow"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (name, step)
        assert torch.allclose(got.tau, ref.tau, atol=1e-12, rtol=0), step
    assert changed >= 3  # keys really entered the pool
