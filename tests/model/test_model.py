"""The model reads a document in chunks exactly as in one pass (float64), with a detached, fixed-size cache."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from longtrain.model import LM, LMConfig, ModelCache, ThresholdOverflowWarning
from longtrain.model.scoring import Scorer, mimic_score_weight, one_token_scores, prefix_scores

SMALL = dict(vocab_size=61, layers=2, d_model=32, heads=4)

CASES = [
    # name, config overrides, T, chunk
    ("sparsek+sw", dict(attention="sparsek+sw", topk=8, window=16), 230, 100),  # chunk not a multiple of the 64-query block
    ("chunk<w", dict(attention="sparsek+sw", topk=6, window=24), 150, 10),  # chunk shorter than the window
    ("token-by-token", dict(attention="sparsek+sw", topk=4, window=5), 40, 1),  # decoding
    ("sparsek only", dict(attention="sparsek", topk=7), 160, 37),
    ("sw only", dict(attention="sw", window=9), 120, 50),
    ("full", dict(attention="full"), 90, 31),
    ("llama gqa per-kv-head", dict(style="llama", kv_heads=2, score_groups="per_kv_head", attention="sparsek+sw", topk=5, window=8),
        170, 64),
    ("no tsn, soft_kv, mimic", dict(attention="sparsek+sw", topk=5, window=6, timestep_norm=False, variant="soft_kv",
        score_init="mimic"), 140, 45),
    ("gptneox partial rotary", dict(style="gptneox", rotary_pct=0.5, intermediate_size=40, attention="sparsek+sw", topk=5, window=8),
        150, 40),
    ("sparsek+linear+sw", dict(attention="sparsek+linear+sw", topk=6, window=8), 150, 37),
    ("linear+sw llama gqa", dict(style="llama", kv_heads=2, attention="linear+sw", window=9), 120, 50),
    ("sparsek+linear+sw sum", dict(attention="sparsek+linear+sw", topk=6, window=8, linear_norm="sum"), 150, 37),
    ("linear+sw fixed gain", dict(attention="linear+sw", window=9, linear_gain="fixed"), 120, 50),
    ("sparsek+linear+sw unrotated", dict(attention="sparsek+linear+sw", topk=6, window=8, linear_rope="unrotated"), 150, 37),
    ("linear+sw gptneox partial rotary unrotated", dict(style="gptneox", rotary_pct=0.5, intermediate_size=40,
        attention="linear+sw", window=9, linear_rope="unrotated"), 120, 50),
]


def make(**kw) -> LM:
    return LM(LMConfig(**{**SMALL, **kw})).double().eval()


def chunked(model, tokens, chunk, cache=None, lengths_fn=None):
    cache = cache or model.empty_cache(tokens.shape[0], dtype=torch.float64)
    logits, sels = [], []
    for s in range(0, tokens.shape[1], chunk):
        out = model(tokens[:, s : s + chunk], cache=cache)
        cache = out.cache
        logits.append(out.logits)
        sels.append(out.selections)
    return torch.cat(logits, 1), sels, cache


@pytest.mark.parametrize("name,kw,T,chunk", CASES, ids=[c[0] for c in CASES])
@torch.no_grad()
def test_chunked_equals_unchunked_float64(name, kw, T, chunk):
    model = make(**kw)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, T))
    ref = model(tokens)
    logits, sels, cache = chunked(model, tokens, chunk)
    assert (logits - ref.logits).abs().max() <= 1e-9
    for layer, ref_sel in enumerate(ref.selections):
        if ref_sel is None:
            assert all(s[layer] is None for s in sels)
            continue
        got = torch.cat([s[layer].fingerprint for s in sels], 1)
        assert torch.equal(got, ref_sel.fingerprint)
        assert len(set(ref_sel.fingerprint[0].tolist())) > 10  # the selection really changes along the document
    assert cache.seen.tolist() == [T, T]
    assert not ref.overflowed


RAGGED = [
    dict(attention="sparsek+sw", topk=6, window=8),
    dict(style="llama", kv_heads=2, score_groups="per_kv_head", attention="sparsek+sw", topk=6, window=8),
    dict(attention="full"),
    dict(attention="sparsek+linear+sw", topk=6, window=8),
]


@pytest.mark.parametrize("kw", RAGGED, ids=["shared", "per-kv-head", "full", "sparsek+linear+sw"])
@torch.no_grad()
def test_ragged_rows_and_reset_match_their_own_documents(kw):
    # Row 0 reads 70 tokens per chunk, row 1 only 23 (lengths); then row 1 starts a new document.
    model = make(**kw)
    doc = torch.randint(0, 61, (2, 140))
    cache = model.empty_cache(2, dtype=torch.float64)
    got0, got1 = [], []
    for s0, s1 in ((0, 0), (70, 23)):
        toks = torch.stack([doc[0, s0 : s0 + 70], torch.cat([doc[1, s1 : s1 + 23], torch.zeros(47, dtype=torch.long)])])
        out = model(toks, cache=cache, lengths=torch.tensor([70, 23]))
        cache = out.cache
        got0.append(out.logits[0])
        got1.append(out.logits[1, :23])
    assert (torch.cat(got0) - model(doc[:1]).logits[0]).abs().max() <= 1e-9
    assert (torch.cat(got1) - model(doc[1:, :46]).logits[0]).abs().max() <= 1e-9
    cache = cache.reset_rows(torch.tensor([False, True]))
    assert cache.seen.tolist() == [140, 0]
    out = model(doc[:, :30], cache=cache)
    assert (out.logits[1] - model(doc[1:, :30]).logits[0]).abs().max() <= 1e-9


def test_cache_is_detached_and_backward_stops_at_the_chunk_boundary():
    model = LM(LMConfig(**SMALL, attention="sparsek+sw", topk=4, window=6)).double()
    t1, t2 = torch.randint(0, 61, (2, 2, 40))
    out1 = model(t1, cache=model.empty_cache(2, dtype=torch.float64))
    assert all(not t.requires_grad and t.grad_fn is None for t in out1.cache.state_dict().values())
    out2 = model(t2, cache=out1.cache)
    out2.logits.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out1.logits.square().mean().backward()  # chunk 1's graph was not consumed by chunk 2's backward

    # Chunk 2's gradient is the same as with a cache built without any graph at all.
    model.zero_grad()
    with torch.no_grad():
        cache = model(t1, cache=model.empty_cache(2, dtype=torch.float64)).cache
    model(t2, cache=cache).logits.square().mean().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-12, rtol=0), n
    assert grads["blocks.0.attn.scorer.weight"].abs().sum() > 0  # scores learn through the SparseK mask


@torch.no_grad()
def test_cache_size_is_fixed_and_state_dict_round_trips(tmp_path):
    model = LM(LMConfig(vocab_size=17, layers=1, d_model=16, heads=2, attention="sparsek+sw", topk=4, window=4)).eval()
    tokens = torch.randint(0, 17, (2, 100 * 8))
    cache = model.empty_cache(2, dtype=torch.float32)
    for i in range(100):
        cache = model(tokens[:, i * 8 : (i + 1) * 8], cache=cache).cache
        if i == 9:
            at10 = {k: (tuple(v.shape), v.dtype) for k, v in cache.state_dict().items()}
    assert {k: (tuple(v.shape), v.dtype) for k, v in cache.state_dict().items()} == at10
    assert cache.kv_entries_per_layer == 4 + 4 - 1
    assert cache.fill() == 1.0 and model.empty_cache(2).fill() == 0.0

    save_file(cache.state_dict(), tmp_path / "cache.safetensors")
    back = ModelCache.from_state_dict(load_file(tmp_path / "cache.safetensors"))
    nxt = torch.randint(0, 17, (2, 8))
    assert torch.equal(model(nxt, cache=back).logits, model(nxt, cache=cache).logits)


@torch.no_grad()
def test_threshold_overflow_is_reported():
    model = make(attention="sparsek", topk=4, threshold_cap=1)  # the op raises the cap to k + 2
    tokens = torch.randint(0, 61, (1, 400))
    with pytest.warns(ThresholdOverflowWarning):
        out = model(tokens)
    assert out.overflowed
    assert not make(attention="sparsek", topk=4)(tokens).overflowed


def test_scores_stay_float32_under_bf16_autocast():
    scorer = Scorer(16, 1, timestep_norm=True, eps_slope=1e-3)
    x = torch.randn(2, 10, 16, dtype=torch.bfloat16)
    zeros = torch.zeros(2, 1, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        u, _, _ = scorer(x, torch.arange(10).expand(2, 10), torch.ones(2, 10, dtype=torch.bool), torch.zeros(2, dtype=torch.long),
            zeros, zeros)
    assert u.dtype == torch.float32


@pytest.mark.parametrize("timestep_norm", [True, False])
def test_one_token_scores_are_the_chunk_scores_bits(timestep_norm):
    """The decode step's scorer (no scan) gives a one-token chunk's u and totals bit for bit, padded rows too."""
    g = torch.Generator().manual_seed(7)
    B, G = 5, 3
    r64 = torch.randn(B, 1, G, generator=g, dtype=torch.float64) * 3
    valid = torch.tensor([[True], [False], [True], [True], [True]])
    r64 = torch.where(valid[..., None], r64, 0.0)
    seen = torch.tensor([0, 9, 1, 4_000_017, 333])
    pos = seen[:, None].clone()
    ssum = torch.randn(B, G, generator=g, dtype=torch.float64) * 50
    ssq = ssum.square() / seen.clamp(min=1)[:, None] + torch.rand(B, G, generator=g, dtype=torch.float64) * 40
    kw = dict(timestep_norm=timestep_norm, eps_slope=1e-3)
    want = prefix_scores(r64, pos, valid, seen, ssum, ssq, **kw)
    got = one_token_scores(r64, pos, valid, seen, ssum, ssq, **kw)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)


def test_mimic_init_is_wq_wk_transpose_ones_normalised():
    model = LM(LMConfig(**SMALL, attention="sparsek+sw", topk=4, window=4, score_init="mimic"))
    a = model.blocks[1].attn
    W_Q, W_K = a.q_proj.weight.t().double(), a.k_proj.weight.t().double()  # row convention: q = x W_Q
    w = W_Q @ W_K.t() @ torch.ones(SMALL["d_model"], dtype=torch.float64)
    assert torch.allclose(a.scorer.weight[0].double(), w / w.norm(), atol=1e-6)
    # Per-KV-head groups: one unit vector per group, from that group's heads only.
    g = mimic_score_weight(torch.randn(4 * 8, 32), torch.randn(2 * 8, 32), 4, 2, 2)
    assert g.shape == (2, 32) and torch.allclose(g.norm(dim=-1), torch.ones(2))


def test_styles_and_recipe_config():
    from longtrain.train.recipe import load_recipe

    r = load_recipe("quickstart")
    cfg = LMConfig.from_recipe(r.model, r.attention, vocab_size=2048)
    assert (cfg.topk, cfg.window, cfg.attention, cfg.vocab_size) == (64, 64, "sparsek+sw", 2048)
    gpt2 = LM(LMConfig(**SMALL, attention="sw", window=4))
    llama = LM(LMConfig(**SMALL, style="llama", attention="sw", window=4))
    assert gpt2.unembed is None and llama.unembed is not None  # tied vs untied head
    assert isinstance(llama.blocks[0].norm1, torch.nn.RMSNorm)
    neox = LM(LMConfig(**SMALL, style="gptneox", rotary_pct=0.25, norm_eps=1e-6, intermediate_size=24, attention="full"))
    assert neox.unembed is not None and neox.blocks[0].parallel and neox.cfg.rotary_dim == 2
    assert neox.blocks[0].mlp.up.weight.shape == (24, 32) and neox.blocks[0].attn.q_proj.bias is not None
    assert neox.norm_f.eps == 1e-6 and LM(LMConfig(**SMALL, style="gptneox", tied_embeddings=True, attention="full")).unembed is None
    with pytest.raises(ValueError):
        LMConfig(**SMALL, attention="sparsek+sw", topk=4)  # no window


def params_from_config(cfg: LMConfig) -> int:
    """The parameter count the config implies, written out per module (not by walking the model)."""
    d, V, H, Hkv, D, hidden = cfg.d_model, cfg.vocab_size, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate_size
    layer_norm = cfg.style in ("gpt2", "gptneox")  # LayerNorm (weight, bias), biased linears, GELU MLP
    norm = 2 * d if layer_norm else d  # llama: RMSNorm (weight), no biases, SwiGLU (three matrices)
    attention = d * H * D + 2 * d * Hkv * D + H * D * d + ((H + 2 * Hkv) * D + d if layer_norm else 0)
    mlp = 2 * d * hidden + hidden + d if layer_norm else 3 * d * hidden
    scorer = cfg.score_group_count * d  # one w_score per selection group
    head = 0 if cfg.tied_embeddings else V * d
    return V * d + cfg.layers * (2 * norm + attention + mlp + scorer) + norm + head


@pytest.mark.parametrize("cfg", [
    dict(style="gpt2", attention="sw", window=4),
    dict(style="llama", attention="sw", window=4),
    dict(style="gpt2", kv_heads=2, attention="sparsek+sw", topk=4, window=4),
    dict(style="llama", kv_heads=2, attention="sparsek", topk=4, score_groups="per_kv_head", mlp_ratio=2.5),
    dict(style="gptneox", rotary_pct=0.5, intermediate_size=40, attention="sparsek+sw", topk=4, window=4),
    dict(style="gptneox", tied_embeddings=True, attention="full"),
])
def test_num_params_follows_the_config(cfg):
    cfg = LMConfig(**SMALL, **cfg)
    assert LM(cfg).num_params() == params_from_config(cfg)


def test_num_params_of_published_models():
    """GPT-2 small without its learned positions (RoPE here), Pythia-160M and Llama-2-7B, on the meta device."""
    with torch.device("meta"):
        gpt2 = LM(LMConfig(vocab_size=50257, layers=12, d_model=768, heads=12, attention="sw", window=1024))
        pythia = LM(LMConfig(vocab_size=50304, layers=12, d_model=768, heads=12, style="gptneox", rotary_pct=0.25,
                             attention="sw", window=1024))
        llama = LM(LMConfig(vocab_size=32000, layers=32, d_model=4096, heads=32, style="llama",
                            intermediate_size=11008, attention="sw", window=1024))
    assert gpt2.num_params() == 124_439_808 - 1024 * 768  # 124M less the 1024 x 768 position table
    assert pythia.num_params() == 162_322_944
    assert llama.num_params() == 6_738_415_616


def test_linear_types_learn_phi_and_carry_a_fixed_size_state(tmp_path):
    """sparsek+linear+sw: phi's head-wise map gets gradients, starts as the identity (phi = elu(x) + 1), its
    cache holds the linear state (fixed size, float32 under a bf16 KV dtype) and round-trips through safetensors."""
    model = LM(LMConfig(**SMALL, attention="sparsek+linear+sw", topk=4, window=6)).double()
    assert torch.equal(model.blocks[0].attn.phi_weight[0], torch.eye(8, dtype=torch.float64))
    tokens = torch.randint(0, 61, (2, 90))
    cache = model.empty_cache(2, dtype=torch.float64)
    sizes = {k: v.shape for k, v in cache.state_dict().items()}
    for s in range(0, 90, 30):
        out = model(tokens[:, s:s + 30], cache=cache)
        cache = out.cache
    out.logits.square().mean().backward()
    assert model.blocks[0].attn.phi_weight.grad.abs().sum() > 0
    assert {k: v.shape for k, v in cache.state_dict().items()} == sizes
    assert sizes["layers.0.lin_kv"] == (2, 4, 8, 8) and cache.state_dict()["layers.0.lin_kv"].abs().sum() > 0
    assert cache.with_kv_dtype(torch.bfloat16).layers[0].attn.lin_kv.dtype == torch.float64
    save_file(cache.state_dict(), tmp_path / "cache.safetensors")
    back = ModelCache.from_state_dict(load_file(tmp_path / "cache.safetensors"))
    with torch.no_grad():
        nxt = torch.randint(0, 61, (2, 8))
        assert torch.equal(model(nxt, cache=back).logits, model(nxt, cache=cache).logits)
    with pytest.raises(ValueError, match="attention.score_groups shared"):
        LMConfig(**SMALL, kv_heads=2, attention="sparsek+linear+sw", topk=4, window=6, score_groups="per_kv_head")
    assert LMConfig(**SMALL, attention="linear+sw", window=6, backend="triton").backend == "triton"  # issue 38


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("autocast", [False, True])
def test_cpu_half_precision_linear_gives_a_row_the_same_bits_in_any_chunk(threads, autocast):
    """Issue 31: oneDNN's bf16 GEMM rounds a row by the row count (here K = 1024 at 41-100 rows: always),
    so a chunked pass drifted from the unchunked one. `chunk_invariant_linear` (float64 sums rounded to bf16) does not;
    it equals F.linear to bf16 rounding, and with gradients it is F.linear itself."""
    from longtrain.model.model import chunk_invariant_linear as linear

    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for K, N in [(1024, 256), (512, 128), (128, 512)]:
            w = torch.randn(N, K) / K**0.5  # [N, K]
            b = torch.randn(N)
            x = torch.randn(400, K)  # [T, K]
            if not autocast:
                w, b, x = w.bfloat16(), b.bfloat16(), x.bfloat16()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                full = linear(x, w, b)  # [T, N]
                assert full.dtype == torch.bfloat16
                for c in (1, 7, 61, 100, 300):
                    for s in (0, 5):
                        assert torch.equal(linear(x[s : s + c], w, b), full[s : s + c]), (K, N, c, s)
                plain = torch.nn.functional.linear(x, w, b)
            assert (full.float() - plain.float()).abs().max() <= 2 * 2**-8 * plain.float().abs().max()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))  # gradients: the fast kernel
    finally:
        torch.set_num_threads(before)


def test_rows_padded_runs_few_rows_as_the_first_rows_of_a_padded_product():
    """Issue 33: the exact decoder's one-row products inside rows_padded are the first rows of a product of
    `rows` rows (zeros below), any leading shape; outside it, and with gradients, the plain product."""
    from longtrain.model.attention import chunk_invariant_linear as linear, rows_padded

    torch.manual_seed(0)
    w, b = torch.randn(24, 40), torch.randn(24)  # [N, K]
    x = torch.randn(2, 3, 40)  # [B, T, K]: 6 rows
    padded = torch.cat([x.reshape(6, 40), torch.zeros(58, 40)])  # [64, K]
    with torch.no_grad():
        want = torch.nn.functional.linear(padded, w, b)[:6].reshape(2, 3, 24)
        with rows_padded(64):
            got = linear(x, w, b)
            assert linear(torch.randn(70, 40), w, b).shape == (70, 24)  # 70 rows: not padded, nothing cut
        assert torch.equal(got, want) and got.shape == (2, 3, 24)
        assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))  # off outside
    with rows_padded(64):
        xg, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = linear(xg, w, b)  # gradients: F.linear itself (no padding in the graph)
        y.sum().backward()
        torch.nn.functional.linear(xf, w, b).sum().backward()
        assert torch.equal(y, torch.nn.functional.linear(x, w, b)) and torch.equal(xg.grad, xf.grad)


AC_CASES = [
    ("sparsek+sw", dict(attention="sparsek+sw", topk=6, window=8), 60, 23),
    ("full", dict(attention="full"), 70, 31),
    ("dropout", dict(attention="sparsek+sw", topk=6, window=8, dropout=0.1), 45, 23),
]


@pytest.mark.parametrize("name,kw,T,chunk", AC_CASES, ids=[c[0] for c in AC_CASES])
def test_activation_checkpointing_changes_no_output_and_no_gradient(name, kw, T, chunk):
    """Recomputing each block in the backward (train.activation_checkpointing) gives the same losses,
    caches and gradients bit for bit, chunk by chunk; and the chunked read still equals one pass."""
    tokens = torch.randint(0, SMALL["vocab_size"], (2, T + 1))
    runs = []
    for on in (False, True):
        torch.manual_seed(0)
        model = make(**kw).train()
        model.activation_checkpointing = on
        cache, losses, kept = model.empty_cache(2, dtype=torch.float64), [], []
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            # what the forward keeps for the backward (a checkpointed block keeps its input only)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
                out = model(tokens[:, s:e], cache=cache, targets=tokens[:, s + 1 : e + 1])
            out.loss_sum.backward()
            cache = out.cache
            losses.append(out.loss_sum.detach())
        runs.append((torch.stack(losses), cache, {n: p.grad.clone() for n, p in model.named_parameters()}, sum(kept)))
    (plain, plain_cache, plain_grads, plain_kept), (ac, ac_cache, ac_grads, ac_kept) = runs
    assert ac_kept < plain_kept / 2  # the blocks' activations are recomputed, not kept
    assert torch.equal(plain, ac)
    assert all(torch.equal(a, b) for a, b in zip(plain_cache.layers[-1].attn.__dict__.values(), ac_cache.layers[-1].attn.__dict__.values())
               if isinstance(a, torch.Tensor))
    assert plain_grads.keys() == ac_grads.keys() and all(torch.equal(plain_grads[n], ac_grads[n]) for n in plain_grads)
    if not kw.get("dropout"):
        torch.manual_seed(0)
        with torch.no_grad():
            whole = make(**kw)(tokens[:, :T], targets=tokens[:, 1 : T + 1]).loss_sum
        assert abs(float(whole) - float(ac.sum())) <= 1e-9 * abs(float(whole))


def test_learned_linear_gain_starts_at_one_over_F_learns_and_is_not_decayed():
    """attention.linear_gain learned: one log-gain per query head, from -log F (one key's weight at init), with a
    gradient from the loss, outside weight decay; a type without a linear part refuses it with the fix."""
    import math

    from longtrain.train.optim import build_optimizer
    from longtrain.train.recipe import TrainConfig

    model = LM(LMConfig(**{**SMALL, "attention": "sparsek+linear+sw", "topk": 6, "window": 5, "linear_gain": "learned"}))
    gains = [blk.attn.linear_log_gain for blk in model.blocks]
    H, D = model.cfg.heads, model.cfg.head_dim
    assert all(g.shape == (H,) and torch.equal(g, torch.full((H,), -math.log(D))) for g in gains)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 40))
    model(tokens, targets=tokens).loss_sum.backward()
    assert all(g.grad is not None and g.grad.abs().min() > 0 for g in gains)
    decayed = {id(p) for grp in build_optimizer(model, TrainConfig(steps=10)).param_groups if grp["weight_decay"] for p in grp["params"]}
    assert not decayed & {id(g) for g in gains}
    model.reset_parameters()  # as a meta-device build materialises it
    assert torch.equal(gains[0], torch.full((H,), -math.log(D)))
    with pytest.raises(ValueError, match="linear_gain learned scales a linear part"):
        LMConfig(**{**SMALL, "attention": "sparsek+sw", "topk": 4, "window": 4, "linear_gain": "learned"})
