"""`longtrain generate` through the CLI: greedy text equals the forward pass's argmax, fixed memory, bad input."""

import json

import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.generate import Sampling, TextStream, generate
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
            assert len(g.rows[0].tokens) == n  # no end-of-document stop (eod_id=None)
            sizes[name, n] = (g.kv_entries_per_layer, g.cache_bytes, g.cache_grows)
    assert sizes["sparsek", 5] == sizes["sparsek", 40] == (15, sizes["sparsek", 5][1], False)
    assert sizes["sw", 5] == sizes["sw", 40] == (15, sizes["sw", 5][1], False)
    assert sizes["full", 40][0] == sizes["full", 5][0] + 35 and sizes["full", 40][1] > sizes["full", 5][1]
    assert sizes["full", 5][2]
    res = gen(str(runs["full"]), "--prompt", PROMPT, "--max-new-tokens", "2")
    assert res.exit_code == 0 and "memory grows" in res.output, res.output


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


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_several_prompts_are_decoded_together_as_jsonl(runs, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(PROMPT)
    b.write_text("a quiet evening by the river")
    res = gen(str(runs["sparsek"]), "--prompt-file", str(a), "--prompt-file", str(b), "--max-new-tokens", "12",
              "--temperature", "0", "--json", str(tmp_path / "all.json"))
    assert res.exit_code == 0, res.output
    rows = _jsonl(res.stdout)
    assert [r["index"] for r in rows] == [0, 1] and [r["source"] for r in rows] == [str(a), str(b)]
    assert "2 prompts" in res.stderr and "2 rows together" in res.stderr
    for r, f in zip(rows, (a, b)):  # each row's text is its text alone
        alone = gen(str(runs["sparsek"]), "--prompt-file", str(f), "--max-new-tokens", "12", "--temperature", "0",
                    "--json", str(tmp_path / "one.json"))
        one = json.loads((tmp_path / "one.json").read_text())
        assert alone.exit_code == 0 and r["tokens"] == one["tokens"] and r["text"] == one["text"]
        assert r["stopped"] in ("max_new_tokens", "end_of_document") and r["prompt_tokens"] == one["prompt_tokens"]
    summary = json.loads((tmp_path / "all.json").read_text())
    assert [r["tokens"] for r in summary["rows"]] == [r["tokens"] for r in rows] and summary["decode"]["tokens_per_s"] > 0
    assert summary["decode"]["in_place"] is False  # the CPU keeps the rebuilt cache (in place: CUDA, several rows)


def test_prompts_jsonl_with_settings_per_row(runs, tmp_path):
    first = gen(str(runs["sparsek"]), "--prompt", PROMPT, "--max-new-tokens", "20", "--temperature", "0",
                "--json", str(tmp_path / "free.json"))
    assert first.exit_code == 0, first.output
    free = json.loads((tmp_path / "free.json").read_text())
    stop = free["text"][4:7]
    lines = [json.dumps(PROMPT), json.dumps({"prompt": PROMPT, "stop": stop}), "",
             json.dumps({"prompt": "the garden", "max_new_tokens": 3, "temperature": 1.0, "seed": 4})]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    res = gen(str(runs["sparsek"]), "--prompts", str(f), "--max-new-tokens", "20", "--temperature", "0", "--output", str(out))
    assert res.exit_code == 0, res.output
    rows = _jsonl(out.read_text())
    assert [r["source"] for r in rows] == ["line 1", "line 2", "line 4"] and not _jsonl(res.stdout)
    assert rows[0]["tokens"] == free["tokens"] and rows[0]["stopped"] == free["stopped"]
    assert rows[1]["stopped"] == "stop_text" and rows[1]["text"] == free["text"][: free["text"].find(stop)]
    assert rows[1]["tokens"] == free["tokens"][: len(rows[1]["tokens"])] and len(rows[1]["tokens"]) < 20
    assert len(rows[2]["tokens"]) <= 3
    for content, message in [
        ("{not json\n", "line 1: not JSON"),
        (json.dumps({"text": "x"}) + "\n", 'line 1: give a string or an object with a "prompt"'),
        (json.dumps({"prompt": "x", "temprature": 1}) + "\n", "unknown key 'temprature'"),
        (json.dumps({"prompt": "x", "top_p": 2}) + "\n", "line 1: top_p must be in (0, 1]"),
        (json.dumps({"prompt": "x", "max_new_tokens": "5"}) + "\n", "line 1: max_new_tokens must be an integer; got '5'"),
        (json.dumps({"prompt": "x", "temperature": "hot"}) + "\n", "line 1: temperature must be a number; got 'hot'"),
        (json.dumps({"prompt": "x", "top_k": 2.5}) + "\n", "line 1: top_k must be an integer; got 2.5"),
        (json.dumps({"prompt": "x", "stop": 5}) + "\n", "line 1: stop must be a string or a list; got 5"),
        (json.dumps({"prompt": "x", "stop": ["a", ""]}) + "\n", "line 1: stop must be a non-empty string"),
        ("\n\n", "no prompts in it"),
    ]:
        f.write_text(content)
        res = gen(str(runs["sparsek"]), "--prompts", str(f))
        assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, (content, res.output)
    res = gen(str(runs["sparsek"]), "--prompt", "x", "--output", str(out))
    assert res.exit_code == 2 and "--output is for several prompts" in res.output
    res = gen(str(runs["sparsek"]), "--prompt", "x", "--stop", "")
    assert res.exit_code == 2 and "--stop '' would stop nowhere" in res.output


def _boundaries(tokenizer, tokens: list[int]) -> list[int]:
    """The character offsets in decode(tokens) where one token's text ends and the next one's begins."""
    return [len(tokenizer.decode(tokens[:n])) for n in range(1, len(tokens))]


def test_the_stream_is_the_final_text_when_a_stop_text_spans_tokens(runs, tmp_path):
    """Streamed stdout is exactly the returned text: nothing of the stop text, nor of its token, is shown; text
    that might start a stop text is held back, and shown at the end when it did not."""
    ckpt = str(runs["sparsek"])
    common = ["--prompt", PROMPT, "--max-new-tokens", "30", "--temperature", "0", "--dtype", "float64"]
    free = gen(ckpt, *common, "--json", str(tmp_path / "free.json"))
    assert free.exit_code == 0, free.output
    g = json.loads((tmp_path / "free.json").read_text())
    text, tokenizer = g["text"], load_checkpoint(runs["sparsek"]).tokenizer
    # a stop text from the last character of one token into the next one, at its first occurrence
    stop = next(text[b - 1 : b + 1] for b in _boundaries(tokenizer, g["tokens"])
                if b >= 1 and text.find(text[b - 1 : b + 1]) == b - 1)
    res = gen(ckpt, *common, "--stop", stop, "--json", str(tmp_path / "stop.json"))
    assert res.exit_code == 0, res.output
    cut = json.loads((tmp_path / "stop.json").read_text())
    assert cut["stopped"] == "stop_text" and cut["text"] == text[: text.find(stop)]
    assert res.stdout == cut["text"] + "\n" and stop not in res.stdout  # before the fix: the stop's token too
    # a stop text that never comes, but whose start ends the text: held back at every token, then shown
    never = text[-1] + "\u00a7\u00a7"
    res = gen(ckpt, *common, "--stop", never, "--json", str(tmp_path / "never.json"))
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "never.json").read_text())["stopped"] != "stop_text" and res.stdout == text + "\n"


def test_shown_text_holds_back_what_may_be_a_stop_text(tokenizer):
    from longtrain.data.tokenizer import eod_id
    from longtrain.generate import ShownText

    text = "the river and the house of the captain"
    ids = tokenizer.encode(text).ids
    stop = "r and the h"  # starts inside "river", ends inside "house"
    shown = ShownText(tokenizer, [stop])
    pieces = [shown.push(i) for i in ids]
    final = text[: text.find(stop)]
    for n in range(len(pieces)):  # at every token, what was shown is the start of the final text
        assert final.startswith("".join(pieces[: n + 1]))
    assert "".join(pieces) == final == "the rive" and shown.finish(final) == ""
    # no stop text: everything, the end-of-document token's text left out (as in the returned text)
    shown = ShownText(tokenizer, ["captain."])
    pieces = [shown.push(i) for i in ids + [eod_id(tokenizer)]]
    assert "".join(pieces) == text[: -len("captain")]  # "captain" may start the stop text: held back
    assert shown.finish(tokenizer.decode(ids + [eod_id(tokenizer)])) == "captain"


def test_prompt_paths_that_are_folders_or_missing(runs, tmp_path):
    ckpt = str(runs["sparsek"])
    (tmp_path / "prompt.txt").write_text(PROMPT)
    cases = [
        (["--prompt-file", str(tmp_path)], f"--prompt-file {tmp_path} is a folder, not a file"),
        (["--prompt-file", str(tmp_path / "promt.txt")], f"--prompt-file {tmp_path / 'promt.txt'}: no such file"),
        (["--prompts", str(tmp_path)], f"--prompts {tmp_path} is a folder, not a file"),
        (["--prompts", str(tmp_path / "none.jsonl")], f"--prompts {tmp_path / 'none.jsonl'}: no such file"),
    ]
    for args, message in cases:
        res = gen(ckpt, *args, "--max-new-tokens", "2")
        assert res.exit_code == 2, (args, res.output)
        assert message in " ".join(res.output.split()) and "Traceback" not in res.output, (args, res.output)
    assert "did you mean" in gen(ckpt, "--prompt-file", str(tmp_path / "promt.txt")).output  # a near name
