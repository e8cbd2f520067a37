"""The SparseK+Linear+SW Triton core (linear_triton.py) against the naive core with `linear=`, on the CPU
through Triton's interpreter (issue 38).

Fresh random inputs at awkward shapes: L not a multiple of the block, chunks continuing from a cache (pool,
tail and linear state non-empty), GQA, padded rows, Linear+SW (k = 0), the three variants, a document start
where S is complete; forward and every input's gradient in float32, a bfloat16 forward, and a model step; the
deterministic backward (no atomic adds) against the atomic one and the naive core, and its bitwise repeats.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

triton = pytest.importorskip("triton")

from longtrain.model import LM, LMConfig  # noqa: E402
from longtrain.ops.sparsek_attention import linear as linear_op  # noqa: E402
from longtrain.ops.sparsek_attention.linear import SparseKLinearCache, sparsek_linear_attention_chunk  # noqa: E402
from longtrain.ops.sparsek_attention.linear_triton import _theta32, sparsek_linear_attention_core_triton  # noqa: E402
from longtrain.ops.sparsek_attention.naive import LinearTerms, sparsek_attention_core_naive  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(B, T, H, Hkv, D, dtype=torch.float32):
    """q, k, v, u (rising, so the pool turns over) and phi's head-wise map near the identity."""
    q = torch.randn(B, T, H, D, device=DEV)
    k = torch.randn(B, T, Hkv, D, device=DEV)
    v = torch.randn(B, T, Hkv, D, device=DEV)
    u = torch.randn(B, T, device=DEV) * 0.7 + torch.arange(T, device=DEV) * 1e-2
    phi = torch.eye(D, device=DEV).expand(Hkv, D, D) + 0.3 * torch.randn(Hkv, D, D, device=DEV)
    return [x.to(dtype) for x in (q, k, v)] + [u, phi]


def run_chunks(backend, args, chunks, *, topk, window, variant, block, lengths=None):
    """Forward through consecutive chunks (cache carried), then backward of a fixed projection:
    o and the gradients of q, k, v, u and phi's map."""
    a = [x.clone().requires_grad_() for x in args]
    q, k, v, u, phi = a
    B, T, Hkv, D = k.shape
    cache = SparseKLinearCache.empty(B, topk, window, Hkv, D, dtype=k.dtype, device=DEV, features=phi.shape[-1])
    outs, s = [], 0
    for c in chunks:
        sl = slice(s, s + c)
        o, cache, _ = sparsek_linear_attention_chunk(q[:, sl], k[:, sl], v[:, sl], u[:, sl], phi, cache,
                                                     variant=variant, backend=backend, block=block, lengths=lengths)
        outs.append(o)
        s += c
    o = torch.cat(outs, 1)
    if not o.requires_grad:
        return [o]
    g = torch.sin(torch.arange(o.numel(), device=DEV, dtype=torch.float32)).reshape(o.shape)
    (o.float() * g).sum().backward()
    return [o.detach()] + [x.grad for x in a]


def assert_close(got, want, names, tol=2e-5):
    for x, y, name in zip(got, want, names):
        assert torch.isfinite(x).all(), name
        err = (x.double() - y.double()).abs().max().item()
        assert err <= tol * max(1.0, y.abs().max().item()), f"{name}: max error {err:.2e}"


CASES = [
    # T, chunks, topk, window, H, Hkv, D, variant, block
    (37, [20, 17], 5, 4, 4, 2, 16, "hard_k_soft_v", 16),  # GQA, chunks not multiples of the block
    (50, [50], 0, 7, 2, 1, 16, "hard_k_soft_v", 16),  # Linear+SW (k = 0), MQA
    (45, [25, 20], 3, 9, 2, 2, 16, "soft_kv", 16),
    (45, [13, 32], 3, 9, 2, 2, 32, "straight_through", 16),
    (30, [18, 12], 40, 5, 2, 2, 16, "hard_k_soft_v", 16),  # k above every candidate count: S complete throughout
    (70, [38, 32], 6, 20, 3, 1, 16, "soft_kv", 32),  # window longer than a block, several blocks
    (90, [50, 40], 10, 40, 2, 1, 16, "hard_k_soft_v", 16),  # a band tile inside every query's window
]


@pytest.mark.parametrize("T,chunks,topk,window,H,Hkv,D,variant,block", CASES)
def test_chunks_follow_the_naive_core(T, chunks, topk, window, H, Hkv, D, variant, block):
    args = inputs(2, T, H, Hkv, D)
    kw = dict(topk=topk, window=window, variant=variant, block=block)
    want = run_chunks("naive", args, chunks, **kw)
    got = run_chunks("triton", args, chunks, **kw)
    assert_close(got, want, "o dq dk dv du dphi".split())


def test_padded_rows_follow_the_naive_core():
    args = inputs(3, 41, 4, 2, 16)
    lengths = torch.tensor([41, 17, 3], device=DEV)  # (every chunk sees the same lengths: the first chunk only)
    kw = dict(topk=4, window=5, variant="hard_k_soft_v", block=16, lengths=lengths)
    want = run_chunks("naive", args, [41], **kw)
    got = run_chunks("triton", args, [41], **kw)
    assert (want[0][1, 17:] == 0).all() and (got[0][1, 17:] == 0).all()
    assert_close(got, want, "o dq dk dv du dphi".split())


def core_inputs(monkeypatch, args, chunks, *, topk, window, block):
    """The naive core's inputs in the last chunk (pool, tail and linear sums from the earlier ones)."""
    seen = {}

    def record(*a, **kw):
        seen["args"], seen["kw"] = a, kw
        return sparsek_attention_core_naive(*a, **kw)

    monkeypatch.setattr(linear_op, "linear_core", lambda *a: record)
    with torch.no_grad():
        run_chunks("naive", args, chunks, topk=topk, window=window, variant="hard_k_soft_v", block=block)
    return seen["args"], seen["kw"]


def at_gate_edges(tau, u, pos, qpos, thu, thp, *, window, topk):
    """tau [B, L] moved so that gates and their gradients are not all 1 and 0: on the queries that select a
    cache pool key j, u_j - tau_i is exactly 0 or 1 (clamp's edges, where torch passes the gradient);
    elsewhere tau - 0.3."""
    up, pp = u[:, None, :topk].double(), pos[:, None, :topk]  # [B, 1, K] the cache pool
    above = (up > thu[..., None]) | ((up == thu[..., None]) & (pp >= thp[..., None]))
    sel = (pp >= 0) & (pp <= qpos[..., None] - window) & above  # [B, L, K]
    uj = u.gather(1, sel.int().argmax(-1))  # [B, L] a selected pool key's score
    even = torch.arange(tau.shape[1], device=tau.device) % 2 == 0
    tau = torch.where(sel.any(-1), torch.where(even, uj, uj - 1), tau - 0.3)
    diff = (uj - tau)[sel.any(-1)]
    assert (diff == 0).any() and (diff == 1).any()
    return tau


@pytest.mark.parametrize("variant", ["hard_k_soft_v", "soft_kv", "straight_through"])
def test_every_input_gradient_of_the_core(monkeypatch, variant):
    """The cores on the same inputs: o and the gradients of q, k_ext, v_ext, u_ext, tau, phi(q), phi(k), num, den."""
    a, kw = core_inputs(monkeypatch, inputs(2, 53, 4, 2, 16), [30, 23], topk=6, window=5, block=16)
    kw = dict(kw, variant=variant)
    (q, k, v, u, pos, qpos, thu, thp, tau, pool), lin = a, kw.pop("linear")
    tau = at_gate_edges(tau, u, pos, qpos, thu, thp, window=5, topk=6)
    leaves = [q, k, v, u, tau, *lin]
    outs = []
    for core in (sparsek_attention_core_naive, sparsek_linear_attention_core_triton):
        x = [t.detach().clone().requires_grad_() for t in leaves]
        o = core(x[0], x[1], x[2], x[3], pos, qpos, thu, thp, x[4], pool, linear=LinearTerms(*x[5:]), **kw)
        g = torch.cos(torch.arange(o.numel(), dtype=torch.float32, device=DEV)).reshape(o.shape)
        (o * g).sum().backward()
        outs.append([o.detach()] + [t.grad for t in x])
    names = "o q k_ext v_ext u_ext tau phq phk num den".split()
    assert outs[0][4].abs().sum() > 0 and outs[0][5].abs().sum() > 0  # the gates' gradients are exercised
    assert_close(outs[1], outs[0], names)


def test_bfloat16_forward():
    args = inputs(2, 45, 4, 2, 16, dtype=torch.bfloat16)
    kw = dict(topk=5, window=6, variant="hard_k_soft_v", block=16)
    with torch.no_grad():
        want = run_chunks("naive", args, [25, 20], **kw)[0]
        got = run_chunks("triton", args, [25, 20], **kw)[0]
    assert got.dtype == torch.bfloat16
    assert_close([got], [want], ["o"], tol=2e-2)


@pytest.mark.parametrize("native", [0, 1], ids=["float32 tiles", "native tiles"])
@pytest.mark.parametrize("variant", ["hard_k_soft_v", "soft_kv"])
def test_bfloat16_core_and_its_gradients(monkeypatch, native, variant):
    """bfloat16 inputs, LAUNCH's native off (float32 tiles, TF32 dots) and on (bfloat16 tiles and dots, the weights
    and gradient terms rounded to bfloat16 before their dots; the interpreter rounds them and dots in float32): o and
    every input's gradient against the naive core in float32 on the same rounded inputs. Measured: at most 2.0e-3
    (off) and 4.4e-3 (on) of each tensor's largest entry (or 1); dv without dO's 1 / den: 37."""
    from longtrain.ops.sparsek_attention import linear_triton as LT

    for entry in LT.LAUNCH.values():
        for kernel in ("fwd", "bwd"):
            monkeypatch.setitem(entry, kernel, dict(entry[kernel], native=native))
    a, kw = core_inputs(monkeypatch, inputs(2, 53, 4, 2, 16), [30, 23], topk=6, window=5, block=16)
    kw = dict(kw, variant=variant)
    (q, k, v, u, pos, qpos, thu, thp, tau, pool), lin = a, kw.pop("linear")
    half = [t.to(torch.bfloat16) for t in (q, k, v, *lin)]  # q, k, v, phq, phk, num, den
    g = torch.cos(torch.arange(q.numel(), dtype=torch.float32, device=DEV)).reshape(q.shape)
    outs = []
    for core, cast in ((sparsek_attention_core_naive, torch.float32), (sparsek_linear_attention_core_triton, torch.bfloat16)):
        x = [t.detach().to(c).clone().requires_grad_() for t, c in zip((*half, u, tau), [cast] * 7 + [u.dtype, tau.dtype])]
        o = core(x[0], x[1], x[2], x[7], pos, qpos, thu, thp, x[8], pool, linear=LinearTerms(*x[3:7]), **kw)
        (o.float() * g).sum().backward()
        outs.append([o.detach().float()] + [t.grad.float() for t in x])
    names = "o q k_ext v_ext phq phk num den u_ext tau".split()
    assert outs[1][0].abs().max() > 0 and outs[0][8].abs().sum() > 0
    assert_close(outs[1], outs[0], names, tol=1e-2)


def test_unsupported_shapes_and_float64_run_the_naive_core():
    args = inputs(1, 20, 2, 2, 8)  # head dim 8: below the kernels' 16
    kw = dict(topk=3, window=4, variant="hard_k_soft_v", block=16)
    want = run_chunks("naive", args, [20], **kw)
    with pytest.warns(UserWarning, match="naive core"):
        got = run_chunks("triton", args, [20], **kw)
    assert_close(got, want, "o dq dk dv du dphi".split(), tol=0)
    args = [x.double() for x in inputs(1, 20, 2, 2, 16)]  # float64: the reference path
    want = run_chunks("naive", args, [20], **kw)
    with pytest.warns(UserWarning, match="naive core"):
        got = run_chunks("triton", args, [20], **kw)
    assert_close(got, want, "o dq dk dv du dphi".split(), tol=0)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic algorithms"])
def test_model_steps_with_the_triton_core(monkeypatch, deterministic):
    """A tiny sparsek+linear+sw model: loss and gradients with backend triton equal backend naive's; under torch's
    deterministic algorithms (train.deterministic) backend triton runs the Triton core, its backward without atomic
    adds (linear.runs_triton_core): two chunks, two launches."""
    rec = launches(monkeypatch)
    torch.manual_seed(0)
    tokens = torch.randint(0, 61, (2, 40), device=DEV)
    grads = []
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for backend in ("naive", "triton"):
            grads.append(model_step(backend, tokens))
    finally:
        torch.use_deterministic_algorithms(before)
    assert rec.atomic == [not deterministic] * 2
    assert grads[1][0] == pytest.approx(grads[0][0].item(), rel=1e-5)
    assert_close(grads[1], grads[0], ["loss"] + [f"grad {i}" for i in range(len(grads[0]) - 1)], tol=1e-4)


def model_step(backend, tokens):
    """The loss of two chunks of a tiny sparsek+linear+sw model on `backend` and its parameters' gradients."""
    torch.manual_seed(1)
    model = LM(LMConfig(vocab_size=61, layers=1, d_model=32, heads=2, attention="sparsek+linear+sw", topk=4,
                        window=6, backend=backend)).to(DEV)
    cache = model.empty_cache(2)
    loss = 0
    for s in (0, 22):  # two chunks: the second reads the first's pool, tail and linear state
        out = model(tokens[:, s:s + 22], cache=cache)
        cache = out.cache
        loss = loss + out.logits.float().logsumexp(-1).mean()
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]


def test_float32_follows_float64_where_s_is_complete_and_the_exp_part_is_tiny():
    """A document start (k above every candidate count: S complete, gates 1), logits far below 0 and
    phi(q).phi(k) large: the kernels must take S's linear part as (1 - g) phi.phi (0 here), not as the sums
    beyond the window minus g phi.phi over S, a difference of large sums that rounds to noise."""
    q, k, v, u, phi = inputs(1, 64, 2, 2, 16)
    q, k, phi = -3 * q.abs(), 3 * k.abs(), 4 * phi  # logits about -23 .. -60
    kw = dict(topk=40, window=8, variant="hard_k_soft_v", block=16)
    want = run_chunks("naive", [x.double() for x in (q, k, v, u, phi)], [64], **kw)
    got = run_chunks("triton", [q, k, v, u, phi], [64], **kw)
    assert_close(got[:1], want[:1], ["o"], tol=1e-4)


def test_theta32_gives_float32_scores_the_naive_cores_float64_test():
    """The kernels test (u, pos) >= theta in 32 bits; for float32 scores that equals the naive core's float64
    test, theta a score or not (between two float32 values, beyond float32's range, infinite)."""
    u = torch.randn(4000).mul(3).to(torch.float32)
    kp = torch.randint(0, 50, (4000,))
    pick = u[torch.randint(0, 4000, (300,))].double()
    thu = torch.cat([pick, pick + 1e-12, pick - 1e-12, torch.tensor([-float("inf"), float("inf"), 1e300, -1e300])])
    thp = torch.randint(0, 50, thu.shape)
    t, p = _theta32(thu, thp)
    want = (u.double()[None] > thu[:, None]) | ((u.double()[None] == thu[:, None]) & (kp[None] >= thp[:, None]))
    got = (u[None] > t[:, None]) | ((u[None] == t[:, None]) & (kp[None] >= p[:, None]))
    assert t.dtype == torch.float32 and p.dtype == torch.int32 and torch.equal(got, want)


# The deterministic backward (linear_triton.deterministic_backward: DETERMINISTIC, or torch's deterministic algorithms): no atomic adds, the
# key-side gradients stored per (query tile, head, key-list slot) and summed by _key_sum_kernel in a fixed order.


def test_the_backward_goes_without_atomics_under_its_flag_or_torchs_deterministic_algorithms(monkeypatch):
    from longtrain.ops.sparsek_attention import linear_triton as LT

    before = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (False, True):
            monkeypatch.setattr(LT, "DETERMINISTIC", flag)
            for mode in (False, True):
                torch.use_deterministic_algorithms(mode)
                assert LT.deterministic_backward() == (flag or mode)
    finally:
        torch.use_deterministic_algorithms(before)


class Launches:
    """Wraps _bwd_kernel (monkeypatched into linear_triton) and records each launch's ATOMIC switch."""

    def __init__(self, kernel):
        self.kernel, self.atomic = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*a, **kw):
            self.atomic.append(kw["ATOMIC"])
            return launch(*a, **kw)

        return run


def launches(monkeypatch):
    from longtrain.ops.sparsek_attention import linear_triton as LT

    rec = Launches(LT._bwd_kernel)
    monkeypatch.setattr(LT, "_bwd_kernel", rec)
    return rec


def core_grads(core, leaves, pos, qpos, thu, thp, pool, kw, cast=None):
    """o and every leaf's gradient (q, k_ext, v_ext, u_ext, tau, phq, phk, num, den), float32, through `core`;
    cast: the dtype of q, k, v and the linear terms (else the leaves')."""
    x = [t.detach().clone() for t in leaves]
    x = [t.to(cast) if cast is not None and i not in (3, 4) else t for i, t in enumerate(x)]
    x = [t.requires_grad_() for t in x]
    o = core(x[0], x[1], x[2], x[3], pos, qpos, thu, thp, x[4], pool, linear=LinearTerms(*x[5:]), **kw)
    g = torch.cos(torch.arange(o.numel(), dtype=torch.float32, device=DEV)).reshape(o.shape)
    (o.float() * g).sum().backward()
    return [o.detach().float()] + [t.grad.float() for t in x]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["hard_k_soft_v", "soft_kv", "straight_through"])
def test_deterministic_backward_follows_the_atomic_one_and_the_naive_core(monkeypatch, variant, dtype):
    """Every input's gradient (GQA, gates at clamp's edges) with the deterministic backward equals the atomic
    backward's and the naive core's (float32 on the same rounded inputs for bfloat16) to their tolerances."""
    from longtrain.ops.sparsek_attention import linear_triton as LT

    a, kw = core_inputs(monkeypatch, inputs(2, 53, 4, 2, 16), [30, 23], topk=6, window=5, block=16)
    kw = dict(kw, variant=variant)
    (q, k, v, u, pos, qpos, thu, thp, tau, pool), lin = a, kw.pop("linear")
    tau = at_gate_edges(tau, u, pos, qpos, thu, thp, window=5, topk=6)
    leaves = [q, k, v, u, tau, *lin]
    if dtype != torch.float32:  # the naive core on the rounded inputs, in float32
        leaves = [t.to(dtype).float() if i not in (3, 4) else t for i, t in enumerate(leaves)]
    ctx = (pos, qpos, thu, thp, pool, kw)
    want = core_grads(sparsek_attention_core_naive, leaves, *ctx)
    rec = launches(monkeypatch)
    atomic = core_grads(sparsek_linear_attention_core_triton, leaves, *ctx, cast=dtype)
    monkeypatch.setattr(LT, "DETERMINISTIC", True)
    got = core_grads(sparsek_linear_attention_core_triton, leaves, *ctx, cast=dtype)
    assert rec.atomic == [True, False]
    names = "o q k_ext v_ext u_ext tau phq phk num den".split()
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert want[4].abs().sum() > 0 and want[5].abs().sum() > 0  # the gates' gradients (u_ext, tau: o comes first) are exercised
    assert_close(got, atomic, names, tol=tol)
    assert_close(got, want, names, tol=tol)


DET_CASES = [
    # T, chunks, topk, window, H, Hkv, D, variant, block, lengths, scratch bytes
    (50, [50], 0, 7, 4, 2, 16, "soft_kv", 16, None, None),  # Linear+SW (k = 0), GQA
    (41, [41], 4, 5, 4, 2, 16, "hard_k_soft_v", 16, [41, 17, 3], None),  # padding queries
    (70, [38, 32], 6, 20, 3, 1, 16, "straight_through", 32, None, None),  # two query tiles a block, MQA
    (70, [38, 32], 6, 20, 3, 1, 16, "hard_k_soft_v", 32, None, 1),  # a slab a block (the scratch's cap)
]


@pytest.mark.parametrize("T,chunks,topk,window,H,Hkv,D,variant,block,lengths,cap", DET_CASES)
def test_deterministic_chunks_follow_the_naive_core(monkeypatch, T, chunks, topk, window, H, Hkv, D, variant, block,
                                                   lengths, cap):
    from longtrain.ops.sparsek_attention import linear_triton as LT

    args = inputs(len(lengths) if lengths else 2, T, H, Hkv, D)
    lengths = torch.tensor(lengths, device=DEV) if lengths else None
    kw = dict(topk=topk, window=window, variant=variant, block=block, lengths=lengths)
    want = run_chunks("naive", args, chunks, **kw)
    monkeypatch.setattr(LT, "DETERMINISTIC", True)
    if cap is not None:
        monkeypatch.setattr(LT, "SCRATCH_BYTES", cap)
        tiles, slab, _ = LT.scratch_tiles(2, chunks[0], H, topk + window + block - 1, D, D, block)
        assert slab == block // LT.launch_settings(D, block)["bwd"]["QB"] < tiles  # several slabs
    rec = launches(monkeypatch)
    got = run_chunks("triton", args, chunks, **kw)
    assert rec.atomic and not any(rec.atomic)
    assert_close(got, want, "o dq dk dv du dphi".split())


@pytest.mark.skipif(DEV == "cuda", reason="counts the interpreter's atomic operations")
def test_deterministic_backward_repeats_bit_for_bit_without_atomic_adds(monkeypatch):
    """With DETERMINISTIC the backward launches with ATOMIC off, runs no atomic operation (the interpreter's,
    counted; it runs atomics in order, so equal results alone would not show it) and two runs give the same
    gradients bit for bit. Without it, the atomic launch (its adds counted)."""
    from triton.runtime import interpreter

    from longtrain.ops.sparsek_attention import linear_triton as LT

    monkeypatch.setattr(LT, "DETERMINISTIC", True)
    count = [0]
    rmw = interpreter.InterpreterBuilder.create_atomic_rmw

    def counted(self, *a, **kw):
        count[0] += 1
        return rmw(self, *a, **kw)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_atomic_rmw", counted)
    rec = launches(monkeypatch)
    args = inputs(2, 37, 4, 2, 16)
    kw = dict(topk=5, window=4, variant="soft_kv", block=16)
    first = run_chunks("triton", args, [20, 17], **kw)
    second = run_chunks("triton", args, [20, 17], **kw)
    assert rec.atomic == [False] * 4 and count[0] == 0
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    monkeypatch.setattr(LT, "DETERMINISTIC", False)
    atomic = run_chunks("triton", args, [20, 17], **kw)
    assert rec.atomic[4:] == [True] * 2 and count[0] > 0
    assert_close(first, atomic, "o dq dk dv du dphi".split())


def test_a_learned_linear_gain_gets_the_naive_cores_gradient_through_the_triton_core():
    """attention.linear_gain scales phi(q) before the cores: the Triton core's phi(q) gradient carries it."""
    torch.manual_seed(5)
    args = inputs(2, 37, 4, 2, 16)
    res = {}
    for backend in ("triton", "naive"):
        gain = torch.linspace(0.02, 0.9, 4, device=DEV).requires_grad_()
        a = [x.clone().requires_grad_() for x in args]
        cache = SparseKLinearCache.empty(2, 5, 4, 2, 16, device=DEV)
        outs = []
        for sl in (slice(0, 20), slice(20, 37)):
            o, cache, _ = sparsek_linear_attention_chunk(*(x[:, sl] for x in a[:4]), a[4], cache, backend=backend,
                                                         block=16, linear_norm="mean", linear_gain=gain)
            outs.append(o)
        o = torch.cat(outs, 1)
        (o * torch.sin(torch.arange(o.numel(), device=DEV, dtype=torch.float32)).reshape(o.shape)).sum().backward()
        res[backend] = [o.detach(), *(x.grad for x in a), gain.grad]
    assert res["triton"][-1].abs().min() > 0
    assert_close(res["triton"], res["naive"], ["o", "q", "k", "v", "u", "phi", "gain"])
