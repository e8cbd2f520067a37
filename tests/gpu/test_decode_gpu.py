"""GPU checks of decoding (skipped without CUDA): the CUDA-graph decoder replays exactly what eager decoding
computes, and decoding follows the chunked forward (Triton kernels, device scan) in float32."""

import warnings

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
        assert torch.equal(a.pool_u, b.pool_u) and torch.equal(a.pool_v, b.pool_v), step
        assert torch.equal(a.thr_count, b.thr_count) and torch.equal(a.overflow, b.overflow), step
        assert torch.allclose(a.tau, b.tau, atol=1e-9, rtol=0), step
        for r in range(B):  # the threshold's scores as sets (the kernel keeps them sorted, the torch step need not)
            n = int(a.thr_count[r])
            sa, sb = a.thr_u[r, :n].sort(), b.thr_u[r, :n].sort()
            assert torch.allclose(sa.values, sb.values, atol=1e-9, rtol=0), (step, r)
            assert torch.equal(a.thr_saturated[r, :n][sa.indices], b.thr_saturated[r, :n][sb.indices]), (step, r)
    if cap is not None:
        assert (a.overflow > 0).all()  # a state of 24 scores overflowed: the dropping path ran in both


@pytest.mark.parametrize("B", [1, 64])
@torch.no_grad()
def test_the_split_attention_kernel_equals_attend_torch(B):
    """attend_triton over 1, 8 and attend_splits' number of key splits against the float64 attention of the same
    bf16 inputs, at 12 x 768's decode shapes (k = w = 512, a full pool and tail), both tail layouts: within 2e-3
    (outputs below 0.2: the bf16 output rounds by up to ~4e-4, float32 sums of 1,024 keys add little), and
    within twice the error of attend_torch in bf16 (float32 softmax, one rounding at the end) plus 5e-4."""
    from dataclasses import replace

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

    def in_float64(c):
        return replace(c, **{n: getattr(c, n).double() for n in ("pool_k", "pool_v", "tail_k", "tail_v")})

    for c, ring in ((cache, False), (to_ring(cache), True)):  # ring: the in-place decoder's layout
        truth = attend_torch(q.double(), k.double(), v.double(), in_float64(c), **kw, tail_ring=ring)
        ref_err = (attend_torch(q, k, v, c, **kw, tail_ring=ring).double() - truth).abs().max().item()
        for splits in (1, 8, None):
            err = (attend_triton(q, k, v, c, **kw, splits=splits, tail_ring=ring).double() - truth).abs().max().item()
            assert err <= min(2e-3, 2 * ref_err + 5e-4), (ring, splits, err, ref_err)


# Model-level decoding of every attention type with the CUDA defaults (graph; the ring written in place where the
# type has one), in bf16, the dtype generate runs in on a GPU
BF16_CASES = [
    *CASES,
    dict(attention="sparsek", topk=64),
    dict(attention="linear+sw", window=64),
    dict(attention="sparsek+linear+sw", topk=32, window=32),
    dict(attention="full"),
]


@pytest.mark.parametrize("kw", BF16_CASES, ids=lambda kw: kw["attention"] + ("-gqa" if "kv_heads" in kw else ""))
@torch.no_grad()
def test_the_default_decoder_in_bf16_follows_the_chunked_forward(kw):
    """Decoder's defaults in bf16 against the model fed one token at a time (the chunk op): logits to bf16
    rounding over 300 steps after a 600-token prompt, the greedy token mostly the same (a flip needs a near tie)."""
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=512, layers=2, d_model=128, heads=4, **kw)).cuda().bfloat16().eval()
    tokens = torch.randint(0, 512, (2, 900), device="cuda")
    cache, _ = prefill(model, tokens[:, :600], chunk_size=256)
    ref_cache, ref = cache, []
    for t in range(600, 900):
        out = model(tokens[:, t : t + 1], cache=ref_cache)
        ref_cache = out.cache
        ref.append(out.logits[:, 0].float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture that failed and fell back to eager decoding fails here
        dec = Decoder(model, cache)
    assert (dec.graph is not None) == (kw["attention"] != "full")  # the CUDA default: a graph (a fixed-size cache)
    worst, same = 0.0, 0
    for i, t in enumerate(range(600, 900)):
        got = dec.step(tokens[:, t]).float()
        worst = max(worst, (got - ref[i]).abs().max().item())
        same += int((got.argmax(-1) == ref[i].argmax(-1)).sum())
    scale = torch.stack(ref).abs().max().item()
    assert worst < 0.05 * scale, (worst, scale)
    assert same >= 0.95 * 2 * 300, same


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
