"""SparseK+Linear+SW and Linear+SW: the chunk op against the paper's formula on the dense T x T matrix,
gradients in float64, chunked == unchunked, decode == the chunk op."""

import pytest
import torch

from longtrain.ops.linear_attention import causal_linear_attention_naive, feature_map
from longtrain.ops.sparsek_attention.linear import (
    SparseKLinearCache,
    sparsek_linear_attention,
    sparsek_linear_attention_chunk,
    sparsek_linear_attention_decode,
)
from tests.ops.dense_reference import dense_sparsek_linear_attention
from tests.ops.test_attention import inputs as sparsek_inputs

CASES = [
    # T, topk, window, H, Hkv, variant
    (37, 5, 4, 4, 2, "hard_k_soft_v"),  # GQA, T not a multiple of the block
    (50, 0, 7, 2, 1, "hard_k_soft_v"),  # Linear+SW (k = 0), MQA
    (45, 3, 9, 2, 2, "straight_through"),
    (70, 6, 1, 2, 2, "soft_kv"),  # window of one: the query itself
    (130, 9, 70, 3, 1, "hard_k_soft_v"),  # window longer than a query block
]


def inputs(T, H, Hkv, D=8, B=2, dtype=torch.float64, u_scale=0.7):
    """q, k, v, u as the SparseK tests make them, and phi's head-wise map (near the identity)."""
    phi = torch.eye(D, dtype=dtype).expand(Hkv, D, D) + 0.3 * torch.randn(Hkv, D, D, dtype=dtype)
    return (*sparsek_inputs(T, H, Hkv, D=D, B=B, dtype=dtype, u_scale=u_scale), phi)


def assert_same_gradients(o1, o2, a1, a2, names):
    """Backward of the same random cotangent through o1 (of inputs a1) and o2 (of a2): every input's gradient
    agrees (an input o2 does not reach must get 0 from o1)."""
    g = torch.randn_like(o1)
    (o1 * g).sum().backward()
    (o2 * g).sum().backward()
    for x, y, name in zip(a1, a2, names):
        want = torch.zeros_like(x) if y.grad is None else y.grad
        assert torch.allclose(x.grad, want, atol=1e-10, rtol=0), name


def streamed(q, kk, v, u, phi, *, k, w, chunk, prefix, **kw):
    """o [B, T, H, D] of the chunk op over positions [0, prefix) in chunks of `chunk`, then the decode step one token
    at a time to the end, continuing one cache (kw: the op's linear options)."""
    B, T, Hkv, D = kk.shape
    cache = SparseKLinearCache.empty(B, k, w, Hkv, D, dtype=q.dtype, score_dtype=u.dtype)
    outs = []
    for s in range(0, prefix, chunk):
        sl = slice(s, min(s + chunk, prefix))
        o, cache, _ = sparsek_linear_attention_chunk(q[:, sl], kk[:, sl], v[:, sl], u[:, sl], phi, cache, **kw)
        outs.append(o)
    for t in range(prefix, T):
        o, cache, _ = sparsek_linear_attention_decode(q[:, t], kk[:, t], v[:, t], u[:, t], phi, cache, **kw)
        outs.append(o[:, None])
    return torch.cat(outs, 1)


def test_causal_linear_equals_the_sum_over_every_key():
    B, L, H, Hkv, F, D = 2, 70, 4, 2, 5, 3
    phq, phk = torch.rand(B, L, H, F, dtype=torch.float64), torch.rand(B, L, Hkv, F, dtype=torch.float64)
    v = torch.randn(B, L, Hkv, D, dtype=torch.float64)
    s_kv, s_k = torch.randn(B, Hkv, F, D, dtype=torch.float64), torch.rand(B, Hkv, F, dtype=torch.float64)
    num, den = causal_linear_attention_naive(phq, phk, v, s_kv, s_k, block=16)
    kr, vr = phk.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    w = torch.einsum("bihf,bjhf->bhij", phq, kr).tril()  # [B, H, L, L]
    want_num = torch.einsum("bhij,bjhd->bihd", w, vr) + torch.einsum("bihf,bhfd->bihd", phq, s_kv.repeat_interleave(2, 1))
    want_den = w.sum(-1).transpose(1, 2) + torch.einsum("bihf,bhf->bih", phq, s_k.repeat_interleave(2, 1))
    assert torch.allclose(num, want_num, atol=1e-12) and torch.allclose(den, want_den, atol=1e-12)


def test_fla_paths_denominator_equals_the_reference_with_its_gradients():
    """fla.py's denominator (a prefix sum along the contiguous last dimension, before the heads are repeated)
    against the reference's, values and gradients, on fresh random float32 inputs (fla runs below float64)."""
    from longtrain.ops.linear_attention.fla import linear_denominator

    B, L, H, Hkv, F, D = 2, 77, 6, 2, 5, 3
    phq, phk = torch.rand(B, L, H, F, requires_grad=True), torch.rand(B, L, Hkv, F, requires_grad=True)
    s_k = torch.rand(B, Hkv, F, requires_grad=True)
    v, s_kv = torch.randn(B, L, Hkv, D), torch.randn(B, Hkv, F, D)
    den = linear_denominator(phq, phk, s_k)
    ref_in = [x.detach().double().requires_grad_() for x in (phq, phk, s_k)]
    _, want = causal_linear_attention_naive(ref_in[0], ref_in[1], v.double(), s_kv.double(), ref_in[2], block=16)
    assert den.dtype == torch.float32 and den.shape == (B, L, H)
    assert torch.allclose(den.double(), want, rtol=1e-5)
    g = torch.randn(B, L, H)
    got = torch.autograd.grad(den, (phq, phk, s_k), g)
    wanted = torch.autograd.grad(want, ref_in, g.double())
    for a, b in zip(got, wanted):
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_feature_map_is_elu_of_a_head_wise_linear_plus_one():
    x, w = torch.randn(2, 3, 4, 5, dtype=torch.float64), torch.randn(2, 5, 5, dtype=torch.float64)
    want = torch.nn.functional.elu(torch.einsum("bthd,hdf->bthf", x, w.repeat_interleave(2, 0))) + 1
    assert torch.allclose(feature_map(x, w), want, atol=1e-14) and (feature_map(x, w) > 0).all()


@pytest.mark.parametrize("T,k,w,H,Hkv,variant", CASES)
def test_forward_and_backward_equal_the_dense_formula(T, k, w, H, Hkv, variant):
    args = inputs(T, H, Hkv)
    a1 = [x.clone().requires_grad_() for x in args]
    a2 = [x.clone().requires_grad_() for x in args]
    o1 = sparsek_linear_attention(*a1, topk=k, window=w, variant=variant)
    o2 = dense_sparsek_linear_attention(*a2, topk=k, window=w, variant=variant)
    assert torch.allclose(o1, o2, atol=1e-12, rtol=0)
    g = torch.randn_like(o1)
    (o1 * g).sum().backward()
    (o2 * g).sum().backward()
    for x, y, name in zip(a1, a2, ["q", "k", "v", "u", "phi"]):
        want = torch.zeros_like(x) if y.grad is None else y.grad  # k = 0: u is unused
        assert torch.allclose(x.grad, want, atol=1e-10, rtol=0), name


def test_linear_part_matters():
    """The formula is not plain SparseK+SW: the keys outside S u W change the output."""
    from longtrain.ops.sparsek_attention import sparsek_attention

    q, k, v, u, w = inputs(40, 2, 2)
    o = sparsek_linear_attention(q, k, v, u, w, topk=3, window=4)
    assert (o - sparsek_attention(q, k, v, u, topk=3, window=4)).abs().max() > 1e-3


@pytest.mark.parametrize("k,w", [(0, 32), (16, 16)])
def test_float32_follows_float64_when_the_exp_part_is_tiny_beside_the_linear_sums(k, w):
    """Every logit far below 0 (q.k < 0, exp ~ e^-40) and phi(q).phi(k) large: the window's keys must not enter the
    linear sums to be taken out again (a difference of large sums that rounds to noise: NaN in bf16 training)."""
    T, D = 300, 16
    q, kk, v, u, phi = inputs(T, 2, 2, D=D)
    q, kk = -3 * q.abs(), 3 * kk.abs()  # [B, T, H, D]: logits about -9 * 16 * 0.64 / 4 = -23 .. -60
    phi = 4 * phi
    want = sparsek_linear_attention(q, kk, v, u, phi, topk=k, window=w)
    got = sparsek_linear_attention(*(x.float() for x in (q, kk, v, u, phi)), topk=k, window=w)
    assert torch.isfinite(got).all() and (got.double() - want).abs().max() < 1e-3


@pytest.mark.parametrize("k,w,variant", [(3, 2, "hard_k_soft_v"), (0, 3, "hard_k_soft_v"), (2, 2, "soft_kv")])
def test_gradcheck(k, w, variant):
    args = [x.requires_grad_() for x in inputs(11, 2, 1, D=3, B=1, u_scale=0.4)]
    assert torch.autograd.gradcheck(
        lambda *a: sparsek_linear_attention(*a, topk=k, window=w, variant=variant, block=4), args, fast_mode=True)


@pytest.mark.parametrize("k,w,variant", [(3, 2, "hard_k_soft_v"), (0, 3, "hard_k_soft_v"), (2, 2, "soft_kv")])
def test_gradcheck_of_a_chunk_from_a_filled_cache(k, w, variant):
    """The chunk op's own backward (phi of the queries and keys, the lagged rows, the start state from the carried
    state and the pool) in float64, from a cache that a first chunk filled: pool, tail and state all in play."""
    q, kk, v, u, phi = inputs(20, 2, 1, D=3, B=1, u_scale=0.4)
    cache = SparseKLinearCache.empty(1, k, w, 1, 3, dtype=torch.float64, score_dtype=torch.float64)
    with torch.no_grad():
        _, cache, _ = sparsek_linear_attention_chunk(q[:, :12], kk[:, :12], v[:, :12], u[:, :12], phi, cache,
                                                     variant=variant, block=4)
    assert (cache.lin_k != 0).any() and (k == 0 or (cache.pool_pos >= 0).any())  # a state (and a pool) to start from
    args = [x[:, 12:].clone().requires_grad_() for x in (q, kk, v, u)] + [phi.clone().requires_grad_()]
    assert torch.autograd.gradcheck(
        lambda q2, k2, v2, u2, p: sparsek_linear_attention_chunk(q2, k2, v2, u2, p, cache, variant=variant, block=4)[0],
        args, fast_mode=True)


@pytest.mark.parametrize("chunk", [7, 32])
@pytest.mark.parametrize("k,w", [(6, 5), (0, 4), (20, 33)])
def test_chunked_forward_equals_unchunked(chunk, k, w):
    T = 90
    q, kk, v, u, phi = inputs(T, 4, 2)
    whole = sparsek_linear_attention(q, kk, v, u, phi, topk=k, window=w)
    cache = SparseKLinearCache.empty(2, k, w, 2, 8, dtype=torch.float64, score_dtype=torch.float64)
    sizes = {n: t.shape for n, t in cache.state_dict().items()}
    outs = []
    for s in range(0, T, chunk):
        sl = slice(s, s + chunk)
        o, cache, sel = sparsek_linear_attention_chunk(q[:, sl], kk[:, sl], v[:, sl], u[:, sl], phi, cache)
        outs.append(o)
        assert not sel.overflowed
    assert torch.allclose(torch.cat(outs, 1), whole, atol=1e-12, rtol=0)
    assert {n: t.shape for n, t in cache.state_dict().items()} == sizes  # fixed size
    # The state holds exactly the keys outside the final pool and tail.
    phk = feature_map(kk, phi)  # [B, T, Hkv, F]
    out = torch.ones(2, T, dtype=torch.bool)
    out[:, T - (w - 1):] = False
    for b in range(2):
        out[b, cache.pool_pos[b][cache.pool_pos[b] >= 0]] = False
    want = torch.einsum("btgf,btgd->bgfd", phk * out[:, :, None, None], v)
    assert torch.allclose(cache.lin_kv, want, atol=1e-10)


def test_ragged_lengths_and_row_reset():
    q, kk, v, u, phi = inputs(40, 2, 2)
    cache = SparseKLinearCache.empty(2, 4, 3, 2, 8, dtype=torch.float64, score_dtype=torch.float64)
    lengths = torch.tensor([40, 25])
    o, cache, _ = sparsek_linear_attention_chunk(q, kk, v, u, phi, cache, lengths=lengths)
    ref = sparsek_linear_attention(q[1:, :25], kk[1:, :25], v[1:, :25], u[1:, :25], phi, topk=4, window=3)
    assert torch.allclose(o[1:, :25], ref, atol=1e-12)
    fresh = cache.reset_rows(torch.tensor([False, True]))
    assert fresh.seen.tolist() == [40, 0] and isinstance(fresh, SparseKLinearCache)
    assert (fresh.lin_kv[1] == 0).all() and torch.equal(fresh.lin_kv[0], cache.lin_kv[0])


@pytest.mark.parametrize("k,w,variant", [(4, 3, "hard_k_soft_v"), (0, 5, "hard_k_soft_v"), (3, 1, "straight_through"),
                                         (3, 2, "soft_kv")])
def test_decode_equals_the_chunk_op(k, w, variant):
    T, prefix = 24, 9
    q, kk, v, u, phi = inputs(T, 4, 2)
    cache = SparseKLinearCache.empty(2, k, w, 2, 8, dtype=torch.float64, score_dtype=torch.float64)
    _, cache, _ = sparsek_linear_attention_chunk(q[:, :prefix], kk[:, :prefix], v[:, :prefix], u[:, :prefix], phi, cache,
                                                 variant=variant)
    ref = cache
    for t in range(prefix, T):
        o, cache, _ = sparsek_linear_attention_decode(q[:, t], kk[:, t], v[:, t], u[:, t], phi, cache, variant=variant)
        o_ref, ref, _ = sparsek_linear_attention_chunk(q[:, t:t + 1], kk[:, t:t + 1], v[:, t:t + 1], u[:, t:t + 1], phi,
                                                       ref, variant=variant)
        assert torch.allclose(o, o_ref[:, 0], atol=1e-12, rtol=0), t
        assert torch.allclose(cache.lin_kv, ref.lin_kv, atol=1e-12) and torch.allclose(cache.lin_k, ref.lin_k, atol=1e-12)
    whole = sparsek_linear_attention(q, kk, v, u, phi, topk=k, window=w, variant=variant)
    assert torch.allclose(o, whole[:, -1], atol=1e-12)


def test_bad_arguments_are_named():
    q, k, v, u, phi = inputs(8, 2, 1)
    with pytest.raises(ValueError, match="window"):
        sparsek_linear_attention(q, k, v, u, phi, topk=2, window=0)


def test_deterministic_algorithms_keep_the_triton_core():
    """train.deterministic must repeat a run bit for bit: the Triton core's backward then sums the keys' gradients
    without atomic adds (tests/ops/test_sparsek_linear_triton.py; on an H100, tests/gpu/test_linear_gpu.py), so
    backend triton keeps it; it took the naive core there until that backward had run on a GPU. auto runs the kernels
    on CUDA where they take the call (not float64, not an odd head dim) and the naive core on the CPU; naive never."""
    from longtrain.ops.sparsek_attention.linear import linear_core, runs_triton_core
    from longtrain.ops.sparsek_attention.naive import sparsek_attention_core_naive

    assert runs_triton_core("triton", "cpu") and runs_triton_core("triton", "cuda")
    assert runs_triton_core("auto", "cuda") and not runs_triton_core("auto", "cpu")
    assert not runs_triton_core("naive", "cuda") and not runs_triton_core("naive", "cpu")

    class OnCuda:  # the core picked for a call on CUDA (its device and shape is all linear_core reads)
        def __init__(self, d, dtype):
            self.device, self.shape, self.dtype = torch.device("cuda"), (1, 8, 2, d), dtype

    q = torch.zeros(1, 8, 2, 16)
    before = torch.are_deterministic_algorithms_enabled()
    for mode in (False, True):
        torch.use_deterministic_algorithms(mode)
        try:
            assert linear_core("triton", q, 16, torch.float32) is not sparsek_attention_core_naive
            assert linear_core("auto", q, 16, torch.float32) is sparsek_attention_core_naive  # the CPU
            assert linear_core("naive", q, 16, torch.float32) is sparsek_attention_core_naive
            assert linear_core("auto", OnCuda(16, torch.bfloat16), 16, torch.float32) is not sparsek_attention_core_naive
            assert linear_core("auto", OnCuda(16, torch.float64), 16, torch.float64) is sparsek_attention_core_naive
            assert linear_core("auto", OnCuda(12, torch.bfloat16), 12, torch.float32) is sparsek_attention_core_naive
        finally:
            torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunk_ops_query_features_are_feature_map_bitwise(dtype):
    """_QueryFeatures writes phi(q) contiguous for the core; its values are feature_map's, bit for bit."""
    from longtrain.ops.sparsek_attention.linear import _QueryFeatures

    q = torch.randn(2, 13, 6, 8).to(dtype)  # [B, L, H, D], 3 query heads per KV head
    w = torch.randn(2, 8, 5)  # [Hkv, D, F]
    got = _QueryFeatures.apply(q, w)
    assert got.is_contiguous() and torch.equal(got, feature_map(q, w))


@pytest.mark.parametrize("T,k,w,H,Hkv,variant", [CASES[0], CASES[1], CASES[4]])
def test_mean_norm_equals_the_dense_formula(T, k, w, H, Hkv, variant):
    """linear_norm mean: each query's linear sums over its count of keys beyond the window, forward and backward."""
    args = inputs(T, H, Hkv)
    a1 = [x.clone().requires_grad_() for x in args]
    a2 = [x.clone().requires_grad_() for x in args]
    o1 = sparsek_linear_attention(*a1, topk=k, window=w, variant=variant, linear_norm="mean")
    o2 = dense_sparsek_linear_attention(*a2, topk=k, window=w, variant=variant, linear_norm="mean")
    assert torch.allclose(o1, o2, atol=1e-12, rtol=0)
    assert (o1 - sparsek_linear_attention(*args, topk=k, window=w, variant=variant)).abs().max() > 1e-3  # not sum's
    assert_same_gradients(o1, o2, a1, a2, ["q", "k", "v", "u", "phi"])


@pytest.mark.parametrize("k,w", [(6, 5), (0, 4)])
def test_mean_norm_chunked_equals_unchunked_and_decode_equals_forward(k, w):
    T, chunk, prefix = 61, 13, 40
    q, kk, v, u, phi = inputs(T, 4, 2)
    whole = sparsek_linear_attention(q, kk, v, u, phi, topk=k, window=w, linear_norm="mean")
    got = streamed(q, kk, v, u, phi, k=k, w=w, chunk=chunk, prefix=prefix, linear_norm="mean")
    assert torch.allclose(got, whole, atol=1e-12, rtol=0)


def test_mean_norm_gradcheck_and_bad_names():
    args = [x.requires_grad_() for x in inputs(11, 2, 1, D=3, B=1, u_scale=0.4)]
    assert torch.autograd.gradcheck(
        lambda *a: sparsek_linear_attention(*a, topk=3, window=2, block=4, linear_norm="mean"), args, fast_mode=True)
    with pytest.raises(ValueError, match="linear_norm must be one of"):
        sparsek_linear_attention(*inputs(8, 2, 1), topk=2, window=2, linear_norm="avg")



def gain_of(H, dtype=torch.float64):
    """A per-head linear gain away from 1 (attention.linear_gain learned), different per head."""
    return 0.05 + torch.rand(H, dtype=dtype)


@pytest.mark.parametrize("norm", ["sum", "mean"])
@pytest.mark.parametrize("T,k,w,H,Hkv,variant", [CASES[0], CASES[1], CASES[3]])
def test_linear_gain_equals_the_dense_formula_with_its_gradient(T, k, w, H, Hkv, variant, norm):
    """linear_gain: head h's linear part times a_h, forward and every gradient, the gain's included."""
    args = inputs(T, H, Hkv)
    gain = gain_of(H)
    a1 = [x.clone().requires_grad_() for x in (*args, gain)]
    a2 = [x.clone().requires_grad_() for x in (*args, gain)]
    o1 = sparsek_linear_attention(*a1[:5], topk=k, window=w, variant=variant, linear_norm=norm, linear_gain=a1[5])
    o2 = dense_sparsek_linear_attention(*a2[:5], topk=k, window=w, variant=variant, linear_norm=norm,
                                        linear_gain=a2[5])
    assert torch.allclose(o1, o2, atol=1e-12, rtol=0)
    ungained = sparsek_linear_attention(*args, topk=k, window=w, variant=variant, linear_norm=norm)
    assert (o1 - ungained).abs().max() > 1e-3  # the gain changes the output
    assert_same_gradients(o1, o2, a1, a2, ["q", "k", "v", "u", "phi", "gain"])
    assert a1[5].grad.abs().min() > 0  # every head's gain learns


@pytest.mark.parametrize("k,w", [(6, 5), (0, 4)])
def test_linear_gain_chunked_equals_unchunked_and_decode_equals_forward(k, w):
    T, chunk, prefix = 61, 13, 40
    q, kk, v, u, phi = inputs(T, 4, 2)
    gain = gain_of(4)
    whole = sparsek_linear_attention(q, kk, v, u, phi, topk=k, window=w, linear_norm="mean", linear_gain=gain)
    got = streamed(q, kk, v, u, phi, k=k, w=w, chunk=chunk, prefix=prefix, linear_norm="mean", linear_gain=gain)
    assert torch.allclose(got, whole, atol=1e-12, rtol=0)


def test_linear_gain_gradcheck():
    args = [x.requires_grad_() for x in inputs(11, 2, 1, D=3, B=1, u_scale=0.4)]
    assert torch.autograd.gradcheck(
        lambda *a: sparsek_linear_attention(*a[:5], topk=3, window=2, block=4, linear_norm="mean", linear_gain=a[5]),
        [*args, gain_of(2).requires_grad_()], fast_mode=True)


def rope_pair(T, R, D, B=2, theta=100.0):
    """RoPE's inverse frequencies [R/2] (a small base: every pair turns within T) and apply_rope at positions 0..T-1."""
    from longtrain.model.rope import apply_rope, inverse_frequencies, rope_angles

    inv_freq = inverse_frequencies(R, theta, None)[0]
    cos, sin = rope_angles(torch.arange(T)[None].expand(B, T), R, theta)
    return inv_freq, lambda x: apply_rope(x, cos, sin)


@pytest.mark.parametrize("R", [8, 4])  # all dims rotated, and a partial rotary (rotary_pct 0.5)
def test_rotated_back_undoes_rope(R):
    from longtrain.ops.sparsek_attention.linear import rotated_back

    T, D = 29, 8
    inv_freq, rope = rope_pair(T, R, D)
    x = torch.randn(2, T, 3, D, dtype=torch.float64)
    pos = torch.arange(T)[None].expand(2, T)
    assert torch.allclose(rotated_back(rope(x), pos, inv_freq), x, atol=1e-13, rtol=0)
    assert rotated_back(x, pos, None) is x


@pytest.mark.parametrize("T,k,w,H,Hkv,variant", [CASES[0], CASES[1], CASES[2]])
def test_unrotated_features_equal_the_dense_formula_on_the_keys_before_rope_with_their_gradients(T, k, w, H, Hkv, variant):
    """phi_inv_freq: the op's phi reads q and k rotated back, which is the dense formula with phi of the
    projections before RoPE (attention.linear_rope unrotated); forward and every gradient, through RoPE."""
    q0, k0, v, u, phi = inputs(T, H, Hkv)
    inv_freq, rope = rope_pair(T, 8, 8)
    gain = gain_of(H)
    a1 = [x.clone().requires_grad_() for x in (q0, k0, v, u, phi)]
    a2 = [x.clone().requires_grad_() for x in (q0, k0, v, u, phi)]
    o1 = sparsek_linear_attention(rope(a1[0]), rope(a1[1]), *a1[2:], topk=k, window=w, variant=variant,
                                  linear_norm="mean", linear_gain=gain, phi_inv_freq=inv_freq)
    o2 = dense_sparsek_linear_attention(rope(a2[0]), rope(a2[1]), *a2[2:], topk=k, window=w, variant=variant,
                                        linear_norm="mean", linear_gain=gain, phi_q=a2[0], phi_k=a2[1])
    assert torch.allclose(o1, o2, atol=1e-12, rtol=0)
    rotated = sparsek_linear_attention(rope(q0), rope(k0), v, u, phi, topk=k, window=w, variant=variant,
                                       linear_norm="mean", linear_gain=gain)
    assert (o1 - rotated).abs().max() > 1e-4  # what phi reads changes the output
    assert_same_gradients(o1, o2, a1, a2, ["q", "k", "v", "u", "phi"])


@pytest.mark.parametrize("k,w", [(6, 5), (0, 4)])
def test_unrotated_features_chunked_equal_unchunked_and_decode_equals_forward(k, w):
    T, chunk, prefix = 61, 13, 40
    q, kk, v, u, phi = inputs(T, 4, 2)
    inv_freq, rope = rope_pair(T, 8, 8)
    q, kk = rope(q), rope(kk)
    kw = dict(linear_norm="mean", linear_gain=gain_of(4), phi_inv_freq=inv_freq)
    whole = sparsek_linear_attention(q, kk, v, u, phi, topk=k, window=w, **kw)
    assert torch.allclose(streamed(q, kk, v, u, phi, k=k, w=w, chunk=chunk, prefix=prefix, **kw), whole, atol=1e-12, rtol=0)


def test_unrotated_features_gradcheck():
    args = [x.requires_grad_() for x in inputs(11, 2, 1, D=4, B=1, u_scale=0.4)]
    inv_freq, _ = rope_pair(11, 4, 4, B=1)
    assert torch.autograd.gradcheck(
        lambda *a: sparsek_linear_attention(*a, topk=3, window=2, block=4, linear_norm="mean", phi_inv_freq=inv_freq),
        args, fast_mode=True)
