"""Exact decoding (`Decoder(exact=True)`, `generate --exact`): every new token read as a one-token chunk of the
chunked forward, so its logits and selections are bit for bit those of one forward pass over the same tokens, in
bf16 too (the default step computes its one query's attention in float32 and rounds apart there). Full attention is
left out: SDPA rounds a one-query chunk apart from a longer one, so its chunked forward is not bitwise either."""

import json

import pytest
import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.generate import Decoder, generate_batch, prefill
from longtrain.model import LM, LMConfig
from longtrain.train.checkpoint import load_checkpoint

CASES = {
    "sparsek+sw": dict(attention="sparsek+sw", topk=12, window=8),
    "sparsek only": dict(attention="sparsek", topk=10),
    "sw": dict(attention="sw", window=9),
    "sparsek+linear+sw": dict(attention="sparsek+linear+sw", topk=8, window=6),
    "gqa per-kv-head": dict(kv_heads=2, score_groups="per_kv_head", attention="sparsek+sw", topk=9, window=7),
}


def _model(kw, dtype=torch.bfloat16):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=97, layers=3, d_model=64, heads=4, style="llama", **kw)
    return LM(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_exact_steps_give_the_forward_passes_logits_and_selections_bit_for_bit(name, dtype):
    """On the CPU, 48 tokens after a 67-token prompt prefilled in chunks of 16 (positions off every block). float32
    needs rows_padded: MKL's one-row float32 product (a gemv) rounds apart from the same row in a chunk's GEMM."""
    model = _model(CASES[name], dtype)
    ids = torch.randint(0, 97, (1, 67 + 48), generator=torch.Generator().manual_seed(3))
    cache, _ = prefill(model, ids[:, :67], chunk_size=16)
    ref = model(ids[:, 67:], cache=cache)  # one forward pass over the 48 tokens
    exact = Decoder(model, cache, exact=True)
    assert exact.exact and exact.graph is None and not exact.in_place
    step_cache = cache
    for t in range(48):
        assert torch.equal(exact.step(ids[:, 67 + t]), ref.logits[:, t]), t
        out = model(ids[:, 67 + t : 68 + t], cache=step_cache)  # what the step ran, for its selections
        step_cache = out.cache
        for layer, (sel, want) in enumerate(zip(out.selections, ref.selections)):
            if want is not None:
                assert torch.equal(sel.fingerprint[:, 0], want.fingerprint[:, t]), (t, layer)


@pytest.mark.parametrize("name", ["sparsek+sw", "sw", "sparsek+linear+sw"])
def test_exact_greedy_rows_together_are_each_row_alone_and_the_forward_argmax(name):
    model = _model(CASES[name])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (37, 5, 20)]
    batch = generate_batch(model, prompts, max_new_tokens=[14, 9, 11], chunk_size=8, exact=True)
    assert batch.extra["exact"] and not batch.extra["cuda_graph"]
    for r, p in enumerate(prompts):
        alone = generate_batch(model, [p], max_new_tokens=[14, 9, 11][r], chunk_size=8, exact=True)
        assert batch.rows[r].tokens == alone.rows[0].tokens, r
        with torch.no_grad():  # the greedy tokens: the argmax of the chunked forward over prompt + output
            cache, _ = prefill(model, [p], chunk_size=8)
            logits = model(torch.tensor([alone.rows[0].tokens[:-1]]), cache=cache).logits[0]
        assert alone.rows[0].tokens[1:] == logits.argmax(-1).tolist(), r


def test_exact_refuses_what_it_cannot_do():
    model = _model(CASES["sparsek+sw"], torch.float32)
    cache, _ = prefill(model, [[1, 2, 3]], chunk_size=8)
    for bad in (dict(compile=True), dict(cuda_graph=True), dict(in_place=True)):
        with pytest.raises(ValueError, match="exact decoding steps the chunked forward"):
            Decoder(model, cache, exact=True, **bad)


def test_generate_exact_through_the_cli(runs, tmp_path):
    runner = CliRunner()
    out = tmp_path / "gen.json"
    prompt = "the captain and the river were quiet. the morning"
    res = runner.invoke(app, ["generate", str(runs["sparsek"]), "--prompt", prompt, "--max-new-tokens", "12",
                              "--temperature", "0", "--chunk-size", "5", "--exact", "--json", str(out)])
    assert res.exit_code == 0, res.output
    g = json.loads(out.read_text())
    assert g["decode"]["exact"] is True and g["decode"]["cuda_graph"] is False
    ckpt = load_checkpoint(runs["sparsek"], dtype=torch.float32)
    ids = ckpt.tokenizer.encode(prompt).ids
    with torch.no_grad():
        cache, last = prefill(ckpt.model, [ids], chunk_size=5)
        logits = ckpt.model(torch.tensor([g["tokens"][:-1]]), cache=cache).logits[0]
    assert g["tokens"] == [int(last.argmax())] + logits.argmax(-1).tolist()[: len(g["tokens"]) - 1]

    res = runner.invoke(app, ["generate", str(runs["sparsek"]), "--prompt", prompt, "--exact", "--compile"])
    assert res.exit_code != 0 and "drop --compile" in res.output
