"""Decoding equals the forward pass: token-by-token logits equal the chunked forward's (float64, same selections)."""

import pytest
import torch

from longtrain.model import LM, LMConfig

SMALL = dict(vocab_size=61, layers=2, d_model=32, heads=4)
CASES = [
    ("sparsek+sw", dict(attention="sparsek+sw", topk=6, window=5)),
    ("sw", dict(attention="sw", window=7)),
    ("sparsek only", dict(attention="sparsek", topk=5)),
    ("full", dict(attention="full")),
    ("llama gqa per-kv-head", dict(style="llama", kv_heads=2, score_groups="per_kv_head", attention="sparsek+sw", topk=5, window=4)),
    ("soft_kv, no tsn", dict(attention="sparsek+sw", topk=4, window=3, variant="soft_kv", timestep_norm=False)),
    ("sparsek+linear+sw", dict(attention="sparsek+linear+sw", topk=6, window=5)),
    ("linear+sw llama gqa", dict(style="llama", kv_heads=2, attention="linear+sw", window=4)),
    ("sparsek+linear+sw sum", dict(attention="sparsek+linear+sw", topk=6, window=5, linear_norm="sum")),
    ("sparsek+linear+sw fixed gain", dict(attention="sparsek+linear+sw", topk=6, window=5, linear_gain="fixed")),
    ("sparsek+linear+sw unrotated", dict(attention="sparsek+linear+sw", topk=6, window=5, linear_rope="unrotated")),
]


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
@torch.no_grad()
def test_decoding_equals_the_chunked_forward(name, kw):
    torch.manual_seed(0)
    model = LM(LMConfig(**{**SMALL, **kw})).double().eval()
    B, prompt, steps, chunk = 2, 37, 30, 16
    tokens = torch.randint(0, SMALL["vocab_size"], (B, prompt + steps))

    # The reference: the whole sequence through the chunked forward.
    cache = model.empty_cache(B)
    ref_logits, ref_sels = [], []
    for s in range(0, tokens.shape[1], chunk):
        out = model(tokens[:, s : s + chunk], cache=cache)
        cache = out.cache
        ref_logits.append(out.logits)
        ref_sels.append(out.selections)
    ref_logits = torch.cat(ref_logits, 1)

    # Decoding: the prompt through the forward in chunks, then one token at a time.
    cache = model.empty_cache(B)
    for s in range(0, prompt, chunk):
        cache = model(tokens[:, s : min(s + chunk, prompt)], cache=cache).cache
    for t in range(prompt, prompt + steps):
        out = model.decode(tokens[:, t], cache, selections=True)
        cache = out.cache
        assert out.logits.shape == (B, 1, SMALL["vocab_size"])
        assert (out.logits[:, 0] - ref_logits[:, t]).abs().max() <= 1e-9, t
        for layer, sel in enumerate(out.selections):
            ref = ref_sels[t // chunk][layer]
            if ref is None:
                assert sel is None
                continue
            assert torch.equal(sel.fingerprint[:, 0], ref.fingerprint[:, t % chunk]), (t, layer)
    assert cache.seen.tolist() == [prompt + steps] * B
    assert not cache.overflowed()
    if kw.get("topk"):  # the pools really turned over while decoding
        first = ref_sels[prompt // chunk][0].fingerprint[0, prompt % chunk]
        assert (ref_sels[-1][0].fingerprint[0] != first).all()
