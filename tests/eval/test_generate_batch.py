"""Batched generation: rows of different lengths prefilled and decoded together equal each row alone
(the cache's pool, threshold state, tail, statistics and position exactly in float64; greedy tokens in
float32), per-row sampling and stop conditions, and the device sampler's distribution."""

import pytest
import torch

from longtrain.generate import Sampler, Sampling, gumbel_noise, generate_batch, prefill, sample
from longtrain.model import LM, LMConfig

SMALL = dict(vocab_size=61, layers=2, d_model=32, heads=4)
CASES = {
    "sparsek+sw": dict(attention="sparsek+sw", topk=6, window=5),
    "sw": dict(attention="sw", window=7),
    "sparsek only": dict(attention="sparsek", topk=5),
    "full": dict(attention="full"),
    "sparsek+linear+sw": dict(attention="sparsek+linear+sw", topk=4, window=5),
    "llama gqa per-kv-head": dict(style="llama", kv_heads=2, score_groups="per_kv_head", attention="sparsek+sw", topk=5, window=4),
}
LENGTHS = (37, 5, 20, 16)  # a row that ends mid-chunk, one that ends in the first chunk, one on a chunk edge


def _model(kw, dtype=torch.float64):
    torch.manual_seed(0)
    return LM(LMConfig(**{**SMALL, **kw})).to(dtype).eval()


def _prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SMALL["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]


def _row(t: torch.Tensor, row: int, batch: int) -> torch.Tensor:
    """Row `row` of a cache tensor with B or B·G rows (per-KV-head groups folded into the batch)."""
    G = t.shape[0] // batch
    return t[row * G : (row + 1) * G]


@pytest.mark.parametrize("name", CASES)
def test_rows_of_different_lengths_keep_the_cache_of_their_prompt_alone(name):
    model = _model(CASES[name])
    prompts = _prompts()
    cache, logits = prefill(model, prompts, chunk_size=8)
    both = cache.state_dict()
    for r, p in enumerate(prompts):
        alone, alone_logits = prefill(model, [p], chunk_size=8)
        assert torch.allclose(logits[r], alone_logits[0], atol=1e-12, rtol=0), r  # the head batched: rounding
        for key, want in alone.state_dict().items():
            got = _row(both[key], r, len(prompts))
            if key.split(".")[-1] in ("full_k", "full_v", "full_pos"):
                # full attention: the rows share one key axis, padding at position -1; the real keys are the row's own
                real = _row(both[key.rsplit(".", 1)[0] + ".full_pos"], r, len(prompts))[0] >= 0
                got = got[:, real]
                if key.endswith(("full_k", "full_v")):  # SDPA with a mask (padding) and without: rounding
                    assert torch.allclose(got, want, atol=1e-12, rtol=0), (r, key)
                    continue
            if key.split(".")[-1] in ("thr_u", "thr_saturated"):  # a set: its order is the scan's business
                got, want = got.sort(-1).values, want.sort(-1).values
            if want.is_floating_point():  # BLAS may round a 4-row and a 1-row product apart (seen: K, V, u
                assert torch.allclose(got, want, atol=1e-12, rtol=1e-12), (r, key)  # by 1e-16 on an AMD EPYC)
            else:  # positions, counts, flags: the row's own selection, exactly
                assert torch.equal(got, want), (r, key)


@pytest.mark.parametrize("name", ["sparsek+sw", "sw", "full", "llama gqa per-kv-head"])
def test_each_rows_greedy_text_is_its_text_alone(name):
    """float32 on the CPU: batched rows decode at their own positions, with their own pools."""
    model = _model(CASES[name], torch.float32)
    prompts = _prompts(2)
    batch = generate_batch(model, prompts, max_new_tokens=[9, 12, 5, 8], chunk_size=8)
    assert batch.decode_steps == 12 and batch.cache_grows == (name == "full")
    for r, p in enumerate(prompts):
        alone = generate_batch(model, [p], max_new_tokens=[9, 12, 5, 8][r], chunk_size=8)
        assert batch.rows[r].tokens == alone.rows[0].tokens, r
        assert batch.rows[r].stopped == "max_new_tokens" and batch.rows[r].prompt_tokens == len(p)
    # and the greedy tokens are the forward pass's argmax over prompt + output
    p, out = prompts[1], batch.rows[1].tokens
    with torch.no_grad():
        want = model(torch.tensor([p + out])).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
    assert out == want


def test_sampled_rows_draw_the_same_tokens_alone_and_in_a_batch():
    model = _model(CASES["sparsek+sw"], torch.float32)
    prompts = _prompts(3)
    settings = [Sampling(temperature=1.0, seed=5), Sampling(), Sampling(temperature=0.7, top_k=8, seed=1),
                Sampling(temperature=1.3, top_p=0.6, seed=2)]
    batch = generate_batch(model, prompts, max_new_tokens=10, sampling=settings, chunk_size=8)
    for r, p in enumerate(prompts):
        alone = generate_batch(model, [p], max_new_tokens=10, sampling=settings[r], chunk_size=8)
        assert batch.rows[r].tokens == alone.rows[0].tokens, r
    assert batch.rows[0].tokens != batch.rows[1].tokens  # sampling did something
    other = generate_batch(model, prompts[:1], max_new_tokens=10, sampling=Sampling(temperature=1.0, seed=6), chunk_size=8)
    assert other.rows[0].tokens != batch.rows[0].tokens  # the seed matters


def test_stop_conditions_per_row(tokenizer):
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=tokenizer.get_vocab_size(), layers=2, d_model=32, heads=4, attention="sparsek+sw",
                        topk=6, window=5)).eval()
    prompts = [tokenizer.encode(t).ids for t in ("the river and the", "a quiet evening", "the captain of the ship was")]
    free = generate_batch(model, prompts, max_new_tokens=24, tokenizer=tokenizer, chunk_size=8)
    text0, toks1 = free.rows[0].text, free.rows[1].tokens
    stop_text = text0[len(text0) // 2 : len(text0) // 2 + 3]  # three characters from the middle of row 0's text
    eod = toks1[7]  # row 1 stops at its 8th token when it is the end-of-document token
    out = generate_batch(model, prompts, max_new_tokens=[24, 24, 5], stop=[[stop_text], [], []], eod_id=eod,
                         tokenizer=tokenizer, chunk_size=8)
    r0, r1, r2 = out.rows
    assert r0.stopped == "stop_text" and r0.text == text0[: text0.find(stop_text)]
    assert r0.tokens == free.rows[0].tokens[: len(r0.tokens)] and len(r0.tokens) < 24
    assert stop_text in tokenizer.decode(r0.tokens)  # the tokens run through the one that completed it
    first_eod = toks1.index(eod)
    assert r1.stopped == "end_of_document" and r1.tokens == toks1[: first_eod + 1]
    assert r2.tokens == free.rows[2].tokens[: len(r2.tokens)]  # row 2: its limit of 5, unless the eod token comes first
    within = free.rows[2].tokens[:5]
    if eod in within:
        assert r2.stopped == "end_of_document" and r2.tokens == within[: within.index(eod) + 1]
    else:
        assert r2.stopped == "max_new_tokens" and r2.tokens == within
    with pytest.raises(ValueError, match="stop texts need the tokenizer"):
        generate_batch(model, prompts, max_new_tokens=3, stop=["x"])


def test_sampler_settings_and_distribution():
    logits = torch.randn(3, 50)
    step = torch.zeros(3, dtype=torch.int64)
    a = sample(logits, Sampling(temperature=1.0, top_p=0.9, seed=1))
    assert torch.equal(a, sample(logits, Sampling(temperature=1.0, top_p=0.9, seed=1)))
    assert torch.equal(sample(logits, Sampling(temperature=2.0, top_k=1)), logits.argmax(-1))
    assert torch.equal(sample(logits, Sampling(temperature=0.0)), logits.argmax(-1))
    mixed = Sampler([Sampling(), Sampling(temperature=1.0, top_k=1), Sampling(temperature=5.0, seed=3)], "cpu")
    assert mixed(logits, step)[:2].tolist() == logits[:2].argmax(-1).tolist()
    # Gumbel-max draws follow softmax(logits / T): 4,000 steps of one row against the probabilities
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    s = Sampler([Sampling(temperature=0.8, seed=9)], "cpu")
    draws = torch.tensor([int(s(z, torch.tensor([i]))) for i in range(4000)])
    freq = torch.bincount(draws, minlength=5).double() / 4000
    assert (freq - (z[0] / 0.8).double().softmax(-1)).abs().max() < 0.03, freq
    # top_p: only the likeliest tokens holding the mass are ever drawn; top_k: only the k likeliest
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    p = Sampler([Sampling(temperature=1.0, top_p=0.5, seed=4)], "cpu")
    assert {int(p(logits[:1], torch.tensor([i]))) for i in range(300)} <= nucleus
    k = Sampler([Sampling(temperature=3.0, top_k=3, seed=4)], "cpu")
    assert {int(k(logits[:1], torch.tensor([i]))) for i in range(300)} == set(order[:3].tolist())
    # the noise depends on (seed, step) only
    g = gumbel_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 7)
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert torch.equal(g[1], gumbel_noise(torch.tensor([1]), torch.tensor([1]), 7)[0])
    with pytest.raises(ValueError, match="top_p must be in"):
        Sampler([Sampling(top_p=0.0)], "cpu")


@pytest.mark.parametrize("name,compile", [("sparsek+sw", False), ("sw", False), ("sparsek only", False),
                                          ("llama gqa per-kv-head", False), ("sparsek+sw", True)])
@torch.no_grad()
def test_the_in_place_decoder_equals_the_functional_one(name, compile):
    """Decoder(in_place=True): the cache in the ring layout, K/V written in place; the same tokens as the
    functional decoder, logits to rounding (keys summed in another order), and (back in the chunk layout)
    the same cache; the caller's cache untouched (float64; compile: the step through torch.compile on the CPU)."""
    from longtrain.generate import Decoder

    model = _model(CASES[name])
    cache, logits = prefill(model, _prompts(), chunk_size=8)
    before = {k: v.clone() for k, v in cache.state_dict().items()}
    one = Decoder(model, cache, cuda_graph=False, in_place=False)
    ring = Decoder(model, cache, cuda_graph=False, in_place=True, compile=compile)
    assert not one.in_place and ring.in_place
    assert torch.equal(one.start(logits), ring.start(logits))
    for step in range(12):
        a, b = one.advance(), ring.advance()
        assert torch.equal(a, b), step
        assert torch.allclose(one.logits, ring.logits, atol=1e-10, rtol=0), step
    want, got = one.cache.state_dict(), ring.cache.state_dict()
    for key in want:  # (a layer's scores read its input, which the layers below computed to rounding)
        if key.split(".")[-1] in ("thr_u", "thr_saturated"):  # a set: its order is the scan's business
            g, w = got[key].sort(-1).values, want[key].sort(-1).values
            assert torch.allclose(g.double(), w.double(), atol=1e-10, rtol=0), key
        elif want[key].is_floating_point():
            assert torch.allclose(got[key], want[key], atol=1e-10, rtol=0), key
        else:
            assert torch.equal(got[key], want[key]), key
    for key, t in cache.state_dict().items():
        assert torch.equal(t, before[key]), key


@torch.no_grad()
def test_the_compiled_cpu_decoder_equals_the_eager_one():
    """The functional (not in-place) decoder compiled on the CPU gives the eager decoder's logits. Guards the host
    branch in decode._admit: without its graph break, Inductor's CPU code for the whole step admitted the wrong
    threshold state in layer 1 here (logits off by up to 0.025 in float64 within 4 steps; aot_eager exact; the
    admission compiled alone exact), found when that branch was made compile-free."""
    from longtrain.generate import Decoder

    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=61, layers=2, d_model=64, heads=4, style="llama", attention="sparsek+sw", topk=6,
                        window=5)).double().eval()
    cache, logits = prefill(model, [list(range(1, 14))], chunk_size=8)
    compiled = Decoder(model, cache, cuda_graph=False, compile=True, in_place=False)
    eager = Decoder(model, cache, cuda_graph=False, in_place=False)
    assert compiled.compiled and torch.equal(compiled.start(logits), eager.start(logits))
    for step in range(4):
        assert torch.equal(compiled.advance(), eager.advance()), step
        assert torch.allclose(compiled.logits, eager.logits, atol=1e-10, rtol=0), step


def test_the_decoder_is_in_place_by_default_on_cuda():
    from longtrain.generate import Decoder, in_place_by_default

    for attention in ("sparsek+sw", "sparsek", "sw"):
        assert in_place_by_default(attention, "cuda")
        assert not in_place_by_default(attention, "cpu")  # not measured at a real size on the CPU
    for attention in ("full", "sparsek+linear+sw", "linear+sw"):  # no ring layout
        assert not in_place_by_default(attention, "cuda")
    model = _model(CASES["sparsek+sw"])
    cache, _ = prefill(model, _prompts(), chunk_size=8)
    assert not Decoder(model, cache, cuda_graph=False).in_place  # the CPU
    assert Decoder(model, cache, cuda_graph=False, in_place=True).in_place


def test_in_place_needs_a_ring_capable_attention():
    from longtrain.generate import Decoder

    model = _model(CASES["full"])
    cache, _ = prefill(model, _prompts(), chunk_size=8)
    with pytest.raises(ValueError, match="in_place needs"):
        Decoder(model, cache, cuda_graph=False, in_place=True)


def test_the_prefill_chunk_grows_on_a_gpu_for_a_fixed_size_cache_only():
    """Longer prefill chunks where a prefill is launch-bound (a GPU) and the cache has a fixed size; full attention
    (an L x T mask) and the CPU keep the floor; an asked-for chunk is always taken."""
    from longtrain.model.chunks import PREFILL_CHUNK, prefill_chunk_size

    gpu = dict(attention="sparsek+sw", device_type="cuda")
    assert prefill_chunk_size(None, 2048, rows=1, d_model=768, **gpu) == 65536
    assert prefill_chunk_size(None, 2048, rows=1, d_model=4096, **gpu) == 16384
    assert prefill_chunk_size(None, 2048, rows=4, d_model=768, **gpu) == 16384
    assert prefill_chunk_size(None, 2048, rows=64, d_model=768, **gpu) == PREFILL_CHUNK  # the floor
    assert prefill_chunk_size(None, 8192, rows=64, d_model=768, **gpu) == 8192  # the training chunk, if longer
    assert prefill_chunk_size(None, 2048, rows=1, d_model=768, attention="full", device_type="cuda") == PREFILL_CHUNK
    assert prefill_chunk_size(None, 2048, rows=1, d_model=768, attention="sw", device_type="cpu") == PREFILL_CHUNK
    assert prefill_chunk_size(300, 2048, rows=1, d_model=768, **gpu) == 300
    for d in (64, 96, 768, 1000, 5120):  # a power of two, at least the floor
        c = prefill_chunk_size(None, 0, rows=1, d_model=d, **gpu)
        assert c >= PREFILL_CHUNK and c & (c - 1) == 0 and c * d <= 65536 * 1024


def test_prefill_without_a_chunk_asks_prefill_chunk_size_for_its_rows(monkeypatch):
    """prefill(chunk_size=None) reads in the chunks prefill_chunk_size gives for its rows, model and device."""
    import longtrain.generate as gen

    asked = {}

    def fake(requested, trained, **kw):
        asked.update(kw, requested=requested)
        return 8

    model, prompts = _model(CASES["sparsek+sw"]), _prompts()
    monkeypatch.setattr(gen, "prefill_chunk_size", fake)
    cache, logits = prefill(model, prompts)
    assert asked == dict(requested=None, rows=4, d_model=SMALL["d_model"], attention="sparsek+sw", device_type="cpu")
    ref_cache, ref_logits = prefill(model, prompts, chunk_size=8)
    other_cache, other_logits = prefill(model, prompts, chunk_size=16)
    assert torch.equal(logits, ref_logits) and torch.equal(cache.seen, ref_cache.seen)
    assert torch.allclose(logits, other_logits)  # another chunk: the same result (float64), not the same path


def test_a_long_prefill_holds_one_chunks_activations_at_a_time(earlier_chunks_alive):
    """When a chunk runs, the last chunk's hidden states [B, L, d] are gone (prefill and read_prompts drop them),
    so a long prompt's peak memory is one chunk's, as a prompt of one chunk's; the logits stay the same."""
    model = _model(CASES["sparsek+sw"], torch.float32)
    prompt = [torch.randint(0, SMALL["vocab_size"], (70,), generator=torch.Generator().manual_seed(3)).tolist()]
    want_cache, want = prefill(model, prompt, chunk_size=16)
    alive_at_call = earlier_chunks_alive(model)
    cache, got = prefill(model, prompt, chunk_size=16)
    assert alive_at_call == [0] * 5 and torch.equal(got, want) and torch.equal(cache.seen, want_cache.seen)
