"""The Python API: `from longtrain import load` -> generate (batched, stop texts), score (per-token loss), tokenizer."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import longtrain
from longtrain.errors import UsageError


def test_import_longtrain_stays_light():
    code = "import sys, longtrain; print(sorted(m for m in ('torch', 'typer', 'tokenizers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_load_generate_and_score(runs):
    lm = longtrain.load(runs["sparsek"], device="cpu", dtype="float64")
    prompts = ["the captain and the river", "a quiet morning. the"]
    out = lm.generate(prompts, max_new_tokens=[6, 9], stop_at_end_of_document=False)
    assert [len(c.tokens) for c in out] == [6, 9] and all(c.stopped == "max_new_tokens" for c in out)
    assert out[1].text == lm.tokenizer.decode(out[1].tokens) and out[1].prompt_tokens == len(lm.encode(prompts[1]))
    alone = lm.generate(prompts[1], max_new_tokens=9, stop_at_end_of_document=False)[0]
    assert alone.tokens == out[1].tokens  # greedy: the same alone and in a batch
    assert lm.last.new_tokens == 9 and lm.last.decode_tokens_per_s > 0
    # greedy tokens are the forward pass's argmax
    ids = lm.encode(prompts[0])
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids + out[0].tokens])).logits[0]
    assert out[0].tokens == logits[len(ids) - 1 : -1].argmax(-1).tolist()
    # a stop text cuts the text and stops the row
    stop = out[1].text[2:5]
    cut = lm.generate(prompts[1], max_new_tokens=9, stop=stop, stop_at_end_of_document=False)[0]
    assert cut.stopped == "stop_text" and cut.text == out[1].text[: out[1].text.find(stop)]

    # score: each token's loss given those before it, as the unchunked forward pass computes it
    texts = ["the river was quiet and the house was", "the ship"]
    losses = lm.score(texts, chunk_size=4)
    for text, loss in zip(texts, losses):
        ids = torch.tensor([lm.encode(text)])
        with torch.no_grad():
            want = F.cross_entropy(lm.model(ids).logits[0, :-1], ids[0, 1:], reduction="none")
        assert loss.shape == (ids.shape[1] - 1,) and torch.allclose(loss.double(), want, atol=1e-5), text
    with pytest.raises(UsageError, match="text 1 is empty"):
        lm.score(["the", ""])
    with pytest.raises(UsageError, match="prompt 1 is empty"):
        lm.generate(["the", ""])
    with pytest.raises(UsageError, match="top_p must be in"):
        lm.generate("the", top_p=0.0)


def test_the_readmes_python_example_runs(runs, capsys):
    """README's five lines, as a user pastes them, on a tiny trained run in place of runs/quickstart."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("```python\nfrom longtrain import load\n", 1)[1].split("```", 1)[0]
    assert "runs/quickstart" in block
    exec("from longtrain import load\n" + block.replace("runs/quickstart", str(runs["sparsek"])), {})
    printed = capsys.readouterr().out
    assert any(line.endswith(("max_new_tokens", "stop_text", "end_of_document")) for line in printed.splitlines()), printed
    assert "tensor([" in printed  # the first text's per-token losses


def test_load_names_a_bad_path_as_a_usage_error(runs, tmp_path):
    from longtrain.errors import CheckpointError

    with pytest.raises(UsageError, match="does not exist"):
        longtrain.load(tmp_path / "nowhere", device="cpu")
    with pytest.raises(UsageError, match="is a file, not a folder: give its checkpoint folder"):
        longtrain.load(next((runs["sparsek"] / "checkpoints").iterdir()) / "meta.json", device="cpu")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        longtrain.load(tmp_path, device="cpu")
