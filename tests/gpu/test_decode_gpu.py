"""GPU checks of decoding (skipped without CUDA): the CUDA-graph decoder replays exactly what eager decoding
computes, and decoding follows the chunked forward (Triton kernels, device scan) in float32."""

import pytest
import torch

from longtrain.generate import Decoder, prefill
from longtrain.model import LM, LMConfig
from longtrain.ops.sparsek_attention import SparseKCache, sparsek_attention_chunk, sparsek_attention_decode
from longtrain.ops.sparsek_attention.cache import to_ring

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
CASES = [
    dict(attention="sparsek+sw", topk=64, window=64),
    dict(attention="sw", window=128),
    dict(style="llama", kv_heads=2, score_groups="per_kv_head", attention="sparsek+sw", topk=32, window=32),
]


@pytest.mark.parametrize("kw", CASES)
@torch.no_grad()
def test_graph_replay_equals_eager_decoding_and_the_forward(kw):
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=512, layers=2, d_model=128, heads=4, **kw)).cuda().eval()
    tokens = torch.randint(0, 512, (2, 700), device="cuda")
    cache, _ = prefill(model, tokens[:, :600], chunk_size=256)
    graph, eager = Decoder(model, cache, cuda_graph=True), Decoder(model, cache, cuda_graph=False)
    ref_cache, ref = cache, []
    for t in range(600, 700):
        out = model(tokens[:, t : t + 1], cache=ref_cache)  # the chunk op on one token
        ref_cache = out.cache
        ref.append(out.logits[:, 0])
    for i, t in enumerate(range(600, 700)):
        a, b = graph.step(tokens[:, t]), eager.step(tokens[:, t])
        assert torch.equal(a, b), t  # the same kernels, replayed
        assert (a - ref[i]).abs().max() < 1e-3, t
    assert torch.equal(graph.cache.seen, eager.cache.seen)
    for x, y in zip(graph.cache.layers, eager.cache.layers):
        assert torch.equal(x.attn.pool_pos.sort(1).values, y.attn.pool_pos.sort(1).values)


@pytest.mark.parametrize("topk,window,cap", [(512, 512, None), (64, 0, None), (16, 8, 24)])
@torch.no_grad()
def test_the_admission_kernel_equals_the_torch_admission(topk, window, cap):
    """The Triton step (the query and the admission, one launch each) and the torch one, step by step from a
    device-scan prefill."""
    torch.manual_seed(0)
    B, H, Hkv, D = 3, 8, 4, 64
    dev = "cuda"

    def rand(T, t0):
        u = torch.randn(B, T, device=dev) + torch.arange(t0, t0 + T, device=dev) * 1e-3
        return (torch.randn(B, T, H, D, device=dev), torch.randn(B, T, Hkv, D, device=dev),
                torch.randn(B, T, Hkv, D, device=dev), u)

    cache = SparseKCache.empty(B, topk, window, Hkv, D, device=dev, cap=cap)
    _, cache, _ = sparsek_attention_chunk(*rand(3000, 0), cache)
    a = b = cache
    for step in range(200):
        q, k, v, u = [x[:, 0] for x in rand(1, 3000 + step)]
        oa, a, _ = sparsek_attention_decode(q, k, v, u, a, backend="triton")
        ob, b, _ = sparsek_attention_decode(q, k, v, u, b, backend="torch")
        assert torch.allclose(oa, ob, atol=1e-5, rtol=0), step  # attend_triton against attend_torch: rounding
        assert torch.equal(a.pool_pos, b.pool_pos) and torch.equal(a.pool_k, b.pool_k), step
        assert torch.equal(a.thr_count, b.thr_count) and torch.equal(a.overflow, b.overflow), step
        assert torch.allclose(a.tau, b.tau, atol=1e-9, rtol=0), step


@pytest.mark.parametrize("B", [1, 64])
@torch.no_grad()
def test_the_split_attention_kernel_equals_attend_torch(B):
    """attend_triton over 1, 8 and attend_splits' number of key splits against attend_torch, at 12 x 768's decode
    shapes (k = w = 512, a full pool and tail, bf16), both tail layouts."""
    from longtrain.ops.sparsek_attention.decode import attend_torch
    from longtrain.ops.sparsek_attention.decode_triton import attend_triton

    torch.manual_seed(B)
    H, D, topk, window, dev = 12, 64, 512, 512, "cuda"
    cache = SparseKCache.empty(B, topk, window, H, D, dtype=torch.bfloat16, device=dev)
    for t in (cache.pool_k, cache.pool_v, cache.tail_k, cache.tail_v):
        t.normal_()
    cache.pool_u.copy_(torch.randn(B, topk, device=dev))
    cache.pool_pos.copy_(torch.arange(topk, device=dev) * 3)
    cache.tau.fill_(-0.5)
    cache.seen.fill_(5000)
    q, k, v = (torch.randn(B, n, D, device=dev, dtype=torch.bfloat16) for n in (H, H, H))
    kw = dict(window=window, variant="hard_k_soft_v", scale=D**-0.5)
    want = attend_torch(q, k, v, cache, **kw).float()
    for splits in (1, 8, None):
        got = attend_triton(q, k, v, cache, **kw, splits=splits).float()
        assert torch.allclose(got, want, atol=2e-2, rtol=0), (splits, (got - want).abs().max())
    ring = to_ring(cache)  # the in-place decoder's layout
    want = attend_torch(q, k, v, ring, **kw, tail_ring=True).float()
    got = attend_triton(q, k, v, ring, **kw, tail_ring=True).float()
    assert torch.allclose(got, want, atol=2e-2, rtol=0), ("ring", (got - want).abs().max())


@torch.no_grad()
def test_the_attention_kernel_equals_attend_torch_with_gqa_in_float32():
    """attend_triton at a GQA shape (16 query heads on 4 KV heads of 128), float32 (no tf32: to 1e-5), a pool
    with empty slots (tau = -inf: their u - tau is nan) and rows before the window fills, both tail layouts."""
    from longtrain.ops.sparsek_attention.decode import attend_torch
    from longtrain.ops.sparsek_attention.decode_triton import attend_triton

    torch.manual_seed(0)
    B, H, Hkv, D, topk, window, dev = 5, 16, 4, 128, 256, 256, "cuda"
    cache = SparseKCache.empty(B, topk, window, Hkv, D, device=dev)
    for t in (cache.pool_k, cache.pool_v, cache.tail_k, cache.tail_v):
        t.normal_()
    pos = (torch.arange(topk, device=dev) * 2).expand(B, -1).clone()
    pos[0, 100:] = -1
    cache.pool_pos.copy_(pos)
    cache.pool_u.copy_(torch.where(pos >= 0, torch.randn(B, topk, device=dev), -torch.inf))
    cache.tau.copy_(torch.tensor([-torch.inf, -0.5, 0.0, 0.3, 1.0], device=dev, dtype=torch.float64))
    cache.seen.copy_(torch.tensor([600, 100, 3, 2000, 255], device=dev))
    q = torch.randn(B, H, D, device=dev)
    k, v = torch.randn(B, Hkv, D, device=dev), torch.randn(B, Hkv, D, device=dev)
    for variant in ("hard_k_soft_v", "soft_kv", "straight_through"):
        kw = dict(window=window, variant=variant, scale=D**-0.5)
        for c, ring in ((cache, False), (to_ring(cache), True)):
            want = attend_torch(q, k, v, c, **kw, tail_ring=ring)
            for splits in (1, 5, None):
                got = attend_triton(q, k, v, c, **kw, tail_ring=ring, splits=splits)
                assert torch.allclose(got, want, atol=1e-5, rtol=0), (variant, ring, splits, (got - want).abs().max())


@pytest.mark.parametrize("kw", CASES[:2])
@pytest.mark.parametrize("compile", [False, True])
@torch.no_grad()
@pytest.mark.parametrize("mode", ["", "in_place"])
def test_the_whole_step_graph_equals_the_eager_step(kw, compile, mode):
    """Rows of different lengths, greedy and sampled side by side: the graph (every layer, the sampler, the
    cache written back, the token fed back) replays what the eager step computes; compiled: to rounding;
    in_place: the ring layout (against the eager in-place step)."""
    from longtrain.generate import Sampling

    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=512, layers=2, d_model=128, heads=4, **kw)).cuda().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (700, 65, 300)]
    cache, logits = prefill(model, prompts, chunk_size=256)
    settings = [Sampling(), Sampling(temperature=1.0, seed=2), Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)]
    graph = Decoder(model, cache, sampling=settings, cuda_graph=True, compile=compile, in_place=mode == "in_place")
    eager = Decoder(model, cache, sampling=settings, cuda_graph=False, in_place=mode == "in_place")  # the same arithmetic
    assert graph.graph is not None and graph.compiled == compile
    a, b = graph.start(logits), eager.start(logits)
    assert torch.equal(a, b)
    for t in range(100):
        a, b = graph.advance(), eager.advance()
        if compile:  # fused kernels round differently: the greedy row must still follow
            assert (graph.logits - eager.logits).abs().max() < 1e-3, t
            eager.tokens.copy_(graph.tokens)  # keep the two on the same tokens
            continue
        assert torch.equal(a, b), t
        assert torch.equal(graph.logits, eager.logits), t
    if not compile:
        assert torch.equal(graph.cache.seen, eager.cache.seen) and graph.cache.seen.tolist() == [800, 165, 400]
        for x, y in zip(graph.cache.layers, eager.cache.layers):
            assert torch.equal(x.attn.pool_pos, y.attn.pool_pos) and torch.equal(x.attn.tail_k, y.attn.tail_k)


@pytest.mark.parametrize("kw", CASES[:2])
@torch.no_grad()
def test_generate_batch_decodes_several_rows_in_place_by_default_as_the_rebuilt_cache_does(kw):
    """generate_batch's default on CUDA (several rows: Decoder in place, the cache a ring) gives the tokens the
    rebuilt cache gives (float32, greedy and sampled rows of different lengths; logits to rounding)."""
    from longtrain.generate import Sampling, generate_batch

    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=512, layers=2, d_model=128, heads=4, **kw)).cuda().eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (700, 65, 300)]
    settings = [Sampling(), Sampling(temperature=1.0, seed=2), Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)]
    ring = generate_batch(model, prompts, max_new_tokens=[120, 90, 150], sampling=settings, sync_every=5)
    plain = generate_batch(model, prompts, max_new_tokens=[120, 90, 150], sampling=settings, sync_every=5, in_place=False)
    assert ring.extra["in_place"] and ring.extra["cuda_graph"] and not plain.extra["in_place"]
    assert [r.tokens for r in ring.rows] == [r.tokens for r in plain.rows]
    assert [len(r.tokens) for r in ring.rows] == [120, 90, 150]


@pytest.mark.parametrize("kw", CASES[:2])
@torch.no_grad()
def test_the_default_long_prefill_chunks_give_the_short_chunks_cache(kw):
    """prefill's default chunks on a GPU (prefill_chunk_size: 262,144 tokens at d_model 128 and 2 rows, so the whole
    20k-token prompt in one chunk) against
    chunks of 4096: the same selections (pool positions) and logits within float32 rounding."""
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=512, layers=2, d_model=128, heads=4, **kw)).cuda().eval()
    tokens = torch.randint(0, 512, (2, 20_000))
    long_cache, long_logits = prefill(model, tokens)
    short_cache, short_logits = prefill(model, tokens, chunk_size=4096)
    assert torch.equal(long_cache.seen, short_cache.seen)
    assert (long_logits - short_logits).abs().max() < 1e-3
    for x, y in zip(long_cache.layers, short_cache.layers):
        assert torch.equal(x.attn.pool_pos.sort(1).values, y.attn.pool_pos.sort(1).values)


# (layers, width, heads, tokens decoded against one forward over them). At 768 wide an H200's cuBLAS rounded a
# one-row MLP down projection apart from a chunk's rows; padded to 1,024 rows (rows_padded) it still differed from a
# forward over 150 tokens (2026-12-02), so that case reads 1,100 tokens, a forward of rows as many as the padding's
# (not yet run on a GPU).
WIDTHS = {"3x128": (3, 128, 4, 150), "2x768": (2, 768, 12, 1100)}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kw", [CASES[0], CASES[2], dict(attention="sparsek+linear+sw", topk=32, window=32)])
@pytest.mark.parametrize("n_prompt", [1100, 1037])  # a prompt ending on a 64-token tile and one inside it
@torch.no_grad()
def test_exact_decoding_gives_the_forward_passes_bf16_logits_bit_for_bit(kw, n_prompt, width):
    """Decoder(exact=True) on CUDA in bf16 (the device scan, the chunk op's Triton kernels on a one-token chunk):
    every step's logits are those of one forward pass over the same tokens, bit for bit (WIDTHS)."""
    layers, d_model, heads, n = WIDTHS[width]
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=512, layers=layers, d_model=d_model, heads=heads, **{"style": "llama", **kw})
    model = LM(cfg).cuda().bfloat16().eval()
    tokens = torch.randint(0, 512, (1, n_prompt + n), device="cuda")
    cache, _ = prefill(model, tokens[:, :n_prompt], chunk_size=256)
    ref = model(tokens[:, n_prompt:], cache=cache)
    exact = Decoder(model, cache, exact=True)
    for t in range(n):
        assert torch.equal(exact.step(tokens[:, n_prompt + t]), ref.logits[:, t]), t


@torch.no_grad()
def test_decoders_one_after_another_keep_no_memory_behind():
    """Each Decoder's capture warms up on the one side stream per card (longtrain.device.warm_up_aside): a stream
    of its own would give each one its own cuBLAS workspace (32 MiB on Hopper), kept for the life of the process."""
    import gc

    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=512, layers=2, d_model=128, heads=4, attention="sparsek+sw", topk=64, window=64))
    model = model.cuda().eval()
    cache, logits = prefill(model, torch.randint(0, 512, (1, 600), device="cuda"), chunk_size=256)
    held = []
    for _ in range(4):
        dec = Decoder(model, cache, cuda_graph=True)
        dec.start(logits)
        for _ in range(3):
            dec.advance()
        torch.cuda.synchronize()
        del dec
        gc.collect()
        torch.cuda.empty_cache()
        held.append(torch.cuda.memory_allocated())
    assert max(held[1:]) - held[0] < 2**20, held  # the first Decoder's workspaces are the only ones
