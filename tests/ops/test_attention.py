import pytest
import torch
import torch.nn.functional as F

from longtrain.ops.sparsek_attention import SparseKCache, sparsek_attention, sparsek_attention_chunk
from tests.ops.dense_reference import dense_sparsek_attention

CASES = [
    # T, topk, window, H, Hkv, variant
    (37, 5, 4, 4, 2, "hard_k_soft_v"),  # GQA, T not a multiple of the block
    (70, 8, 0, 2, 2, "soft_kv"),  # SparseK only (w = 0)
    (50, 0, 7, 2, 1, "hard_k_soft_v"),  # sliding window only (k = 0), MQA
    (45, 3, 9, 2, 2, "straight_through"),
    (20, 40, 3, 2, 2, "hard_k_soft_v"),  # k larger than any candidate set
    (130, 9, 70, 3, 1, "soft_kv"),  # window longer than a query block
]


def inputs(T, H, Hkv, D=8, B=2, dtype=torch.float64, u_scale=0.7):
    return (
        torch.randn(B, T, H, D, dtype=dtype),
        torch.randn(B, T, Hkv, D, dtype=dtype),
        torch.randn(B, T, Hkv, D, dtype=dtype),
        torch.randn(B, T, dtype=dtype) * u_scale + torch.arange(T, dtype=dtype) * 1e-2,
    )


@pytest.mark.parametrize("T,k,w,H,Hkv,variant", CASES)
def test_forward_and_backward_equal_dense(T, k, w, H, Hkv, variant):
    args = inputs(T, H, Hkv)
    a1 = [x.clone().requires_grad_() for x in args]
    a2 = [x.clone().requires_grad_() for x in args]
    o1 = sparsek_attention(*a1, topk=k, window=w, variant=variant, backend="naive")
    o2 = dense_sparsek_attention(*a2, topk=k, window=w, variant=variant)
    assert torch.allclose(o1, o2, atol=1e-12, rtol=0)
    g = torch.randn_like(o1)
    (o1 * g).sum().backward()
    (o2 * g).sum().backward()
    for x, y, name in zip(a1, a2, "qkvu"):
        want = torch.zeros_like(x) if y.grad is None else y.grad  # k = 0: u is unused
        assert torch.allclose(x.grad, want, atol=1e-10, rtol=0), name


def test_full_budget_equals_sdpa_causal():
    q, k, v, u = inputs(50, 4, 2)
    o = sparsek_attention(q, k, v, u, topk=30, window=20)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    assert torch.allclose(o, ref, atol=1e-12)


@pytest.mark.parametrize("variant", ["hard_k_soft_v", "soft_kv"])
@pytest.mark.parametrize("k,w", [(3, 2), (4, 0), (0, 3)])
def test_gradcheck(variant, k, w):
    T = 13
    args = [x.requires_grad_() for x in inputs(T, 2, 1, D=4, B=1, u_scale=0.4)]
    assert torch.autograd.gradcheck(lambda *a: sparsek_attention(*a, topk=k, window=w, variant=variant), args)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64, 100])
@pytest.mark.parametrize("k,w", [(6, 5), (6, 0), (0, 4), (20, 33)])
def test_chunked_forward_equals_unchunked(chunk, k, w):
    T = 150
    q, kk, v, u = inputs(T, 4, 2)
    whole = sparsek_attention(q, kk, v, u, topk=k, window=w)
    cache = SparseKCache.empty(2, k, w, 2, 8, dtype=torch.float64, score_dtype=torch.float64)
    outs = []
    for s in range(0, T, chunk):
        sl = slice(s, s + chunk)
        o, cache, sel = sparsek_attention_chunk(q[:, sl], kk[:, sl], v[:, sl], u[:, sl], cache)
        outs.append(o)
        assert not sel.overflowed
    assert torch.allclose(torch.cat(outs, 1), whole, atol=1e-12, rtol=0)
    assert int(cache.seen[0]) == T


def test_ragged_lengths_and_row_reset():
    q, kk, v, u = inputs(40, 2, 2)
    cache = SparseKCache.empty(2, 4, 3, 2, 8, dtype=torch.float64, score_dtype=torch.float64)
    lengths = torch.tensor([40, 25])
    o, cache, _ = sparsek_attention_chunk(q, kk, v, u, cache, lengths=lengths)
    # row 1 equals an unpadded run over its 25 tokens
    ref = sparsek_attention(q[1:, :25], kk[1:, :25], v[1:, :25], u[1:, :25], topk=4, window=3)
    assert torch.allclose(o[1:, :25], ref, atol=1e-12)
    assert cache.seen.tolist() == [40, 25]
    fresh = cache.reset_rows(torch.tensor([False, True]))
    assert fresh.seen.tolist() == [40, 0]
    assert (fresh.pool_pos[1] == -1).all() and torch.equal(fresh.pool_k[0], cache.pool_k[0])


def test_cache_is_detached_and_fixed_size():
    q, kk, v, u = [x.requires_grad_() for x in inputs(32, 2, 1)]
    cache = SparseKCache.empty(2, 4, 6, 1, 8, dtype=torch.float64, score_dtype=torch.float64)
    sizes = {n: t.shape for n, t in cache.state_dict().items()}
    for _ in range(3):
        _, cache, _ = sparsek_attention_chunk(q, kk, v, u, cache)
        assert all(not t.requires_grad for t in cache.state_dict().values())
        assert {n: t.shape for n, t in cache.state_dict().items()} == sizes


@pytest.mark.parametrize("bad", [dict(topk=0, window=0), dict(topk=-1, window=2), dict(topk=2, window=2, variant="nope")])
def test_bad_arguments_are_named(bad):
    q, k, v, u = inputs(8, 2, 1)
    with pytest.raises(ValueError):
        sparsek_attention(q, k, v, u, **bad)


def test_the_cache_carries_its_window_through_resets_moves_and_state_dicts():
    """w = 0 and w = 1 keep the same tensors (no tail): the cache's own `window` tells them apart."""
    for topk, window in ((3, 0), (3, 1), (0, 1), (2, 4)):
        cache = SparseKCache.empty(2, topk, window, 1, 4)
        for again in (cache.reset_rows(torch.tensor([True, False])), cache.to("cpu"),
                      SparseKCache.from_state_dict(cache.state_dict())):
            assert (again.topk, again.window) == (topk, window)
    legacy = {n: t for n, t in SparseKCache.empty(2, 3, 0, 1, 4).state_dict().items() if n != "window"}
    assert SparseKCache.from_state_dict(legacy).window == 0  # saved before the cache carried it
    with pytest.raises(ValueError, match="tail slots"):
        SparseKCache(**SparseKCache.empty(1, 2, 3, 1, 4).tensors(), window=5)
