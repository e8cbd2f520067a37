"""`longtrain generate` through the CLI: greedy text equals the forward pass's argmax, fixed memory, bad input."""

import json

import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.generate import Sampling, TextStream, generate, sample
from longtrain.train.checkpoint import load_checkpoint

runner = CliRunner()
PROMPT = "the captain and the river were quiet. the morning"


def gen(*args):
    return runner.invoke(app, ["generate", *args])


def test_greedy_generation_is_the_forward_passes_argmax(runs, tmp_path):
    out = tmp_path / "gen.json"
    res = gen(str(runs["sparsek"]), "--prompt", PROMPT, "--max-new-tokens", "40", "--temperature", "0",
              "--dtype", "float64", "--chunk-size", "7", "--json", str(out))
    assert res.exit_code == 0, res.output
    g = json.loads(out.read_text())
    ckpt = load_checkpoint(runs["sparsek"], dtype=torch.float64)
    prompt = ckpt.tokenizer.encode(PROMPT).ids
    assert g["prompt_tokens"] == len(prompt) and g["stopped"] in ("max_new_tokens", "end_of_document")
    seq = torch.tensor([prompt + g["tokens"]])
    with torch.no_grad():
        logits = ckpt.model(seq).logits[0]  # one unchunked pass over prompt and output
    want = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert g["tokens"] == want[: len(g["tokens"])]
    assert g["text"] == ckpt.tokenizer.decode(g["tokens"]) and g["text"] in res.output  # streamed to the terminal
    assert g["prefill"]["tokens_per_s"] > 0 and g["decode"]["tokens_per_s"] > 0 and g["peak_memory_bytes"] > 0
    assert g["kv_cache"] == {"entries_per_layer": 15, "bytes": g["kv_cache"]["bytes"], "grows": False}
    assert "15 entries per layer" in res.output


def test_memory_stays_fixed_with_sparsek_and_grows_with_full_attention(runs):
    sizes = {}
    for name in ("sparsek", "sw", "full"):
        ckpt = load_checkpoint(runs[name])
        prompt = ckpt.tokenizer.encode(PROMPT * 3).ids
        for n in (5, 40):
            g = generate(ckpt.model, prompt, max_new_tokens=n, sampling=Sampling(temperature=1.0, seed=3), chunk_size=16)
            assert len(g.tokens) == n  # no end-of-document stop (eod_id=None)
            sizes[name, n] = (g.kv_entries_per_layer, g.cache_bytes, g.cache_grows)
    assert sizes["sparsek", 5] == sizes["sparsek", 40] == (15, sizes["sparsek", 5][1], False)
    assert sizes["sw", 5] == sizes["sw", 40] == (15, sizes["sw", 5][1], False)
    assert sizes["full", 40][0] == sizes["full", 5][0] + 35 and sizes["full", 40][1] > sizes["full", 5][1]
    assert sizes["full", 5][2]
    res = gen(str(runs["full"]), "--prompt", PROMPT, "--max-new-tokens", "2")
    assert res.exit_code == 0 and "memory grows" in res.output, res.output


def test_sampling_is_seeded():
    logits = torch.randn(3, 50)
    a = sample(logits, Sampling(temperature=1.0, top_p=0.9, seed=1), torch.Generator().manual_seed(1))
    b = sample(logits, Sampling(temperature=1.0, top_p=0.9, seed=1), torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert torch.equal(sample(logits, Sampling(temperature=2.0, top_k=1), torch.Generator()), logits.argmax(-1))
    assert torch.equal(sample(logits, Sampling(temperature=0.0)), logits.argmax(-1))
    # top_p: only the likeliest tokens holding the mass are ever drawn
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    keep = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample(logits[:1], Sampling(temperature=1.0, top_p=0.5), g)) for _ in range(200)}
    assert drawn <= keep


def test_text_stream_holds_back_split_characters(tokenizer):
    text = "the river é and ☃ more"
    ids = tokenizer.encode(text).ids
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_a_prompt_file_that_is_not_utf8_is_read_with_a_warning(runs, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_bytes(b"the river \xff\xfe and the")
    res = gen(str(runs["sparsek"]), "--prompt-file", str(f), "--max-new-tokens", "3")
    assert res.exit_code == 0, res.output
    assert "2 bytes of invalid UTF-8" in res.output and "replaced by U+FFFD" in res.output


def test_bad_input(runs, tmp_path):
    ckpt = str(runs["sparsek"])
    cases = [
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--max-new-tokens", "5"], "--prompt TEXT or --prompt-file"),
        (["--prompt", "x", "--prompt-file", str(tmp_path / "p.txt")], "one of them"),
        (["--prompt-file", str(tmp_path / "missing.txt")], "no such file"),
        (["--prompt", "x", "--top-p", "0"], "--top-p"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["--prompt", "", "--max-new-tokens", "2"], "the prompt is empty"),
    ]
    for args, message in cases:
        res = gen(ckpt, *args)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output and "Traceback" not in res.output, (args, res.output)
    res = gen(str(tmp_path), "--prompt", "x")
    assert res.exit_code == 1 and "neither a checkpoint" in res.output
