"""`longtrain export` writes only folders that compute what longtrain does (bar the attention type, which
config.json's note names), records longtrain's settings so that `longtrain import` restores them, and
refuses the rest without writing anything."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.model import LM, LMConfig
from longtrain.train.checkpoint import CheckpointManager, checkpoint_files, load_checkpoint
from longtrain.train.recipe import load_recipe
from tests.interop import hf_models as hf

runner = CliRunner()
FULL = ["attention.type=full", "attention.topk=null", "attention.window=null"]


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tok():
    return hf.tokenizer()


def checkpoint(run: Path, tok, *sets: str, recipe: str = "quickstart") -> Path:
    """A run dir with one checkpoint of a random 2 x 32 model (2 heads of 16 dims). init_std 0.3: attention logits
    far from 0, so that which dims RoPE rotates changes the logits."""
    r = load_recipe(recipe, ["model.layers=2", "model.d_model=32", "model.heads=2", "model.mlp_ratio=2.0", "model.init_std=0.3",
                             "tokenizer.vocab_size=300", *sets])
    torch.manual_seed(0)
    model = LM(LMConfig.from_recipe(r.model, r.attention, vocab_size=tok.get_vocab_size()))
    CheckpointManager(run, keep=1).save(0, tensors={"model": model.state_dict()}, meta={"step": 0}, files=checkpoint_files(r, tok))
    return run


def nothing_written(out: Path) -> bool:
    """Neither the folder nor a temporary sibling of it."""
    return not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


def exported(run: Path, out: Path) -> dict:
    import json

    result = cli("export", run, "--out", out)
    assert result.exit_code == 0, result.output
    return json.loads((out / "config.json").read_text())


def other_rotary(lt: LM) -> LM:
    """The same weights rotating another fraction of each head: how far off a wrong rotary fraction is."""
    other = LM(replace(lt.cfg, rotary_pct=1.0 if lt.cfg.rotary_pct != 1.0 else 0.5)).eval()
    other.load_state_dict(lt.state_dict())
    return other


@pytest.mark.parametrize("style,rotary,architecture", [
    ("llama", 1.0, "LlamaForCausalLM"),
    ("gpt2", 0.5, "GPTNeoXForCausalLM"),  # GPT-NeoX rotates the first rotary_pct of each head, as longtrain does
])
@torch.no_grad()
def test_full_attention_export_gives_longtrains_logits_and_loss_in_transformers_and_imports_back(tok, tmp_path, style, rotary,
                                                                                                architecture):
    from transformers import AutoModelForCausalLM

    run = checkpoint(tmp_path / "run", tok, f"model.style={style}", f"model.rotary_pct={rotary}", *FULL)
    lt = load_checkpoint(run).model
    config = exported(run, tmp_path / "out")
    assert config["architectures"] == [architecture]
    saved = config["longtrain_sparsek"]
    assert (saved["attention"], saved["rotary_pct"]) == ("full", rotary) and "computes what longtrain does" in saved["note"]
    assert "auto_map" not in config and not (tmp_path / "out/modeling_longtrain.py").exists()

    tokens = torch.randint(0, 298, (2, 40))
    want = lt(tokens).logits
    loss = F.cross_entropy(want[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    got = plain(tokens, labels=tokens)
    assert hf.rel_diff(got.logits, want) <= 1e-5
    assert abs(float(got.loss) - float(loss)) <= 1e-5
    assert hf.rel_diff(other_rotary(lt)(tokens).logits, want) > 1e-3  # a dropped fraction would show

    # Imported back without flags: the rotary fraction and full attention, not the import's defaults (sparsek+sw, 512).
    back = cli("import", tmp_path / "out", "--out", tmp_path / "back")
    assert back.exit_code == 0, back.output
    loaded = load_checkpoint(tmp_path / "back")
    assert loaded.recipe.model.rotary_pct == rotary
    att = loaded.recipe.attention
    assert (att.type, att.topk, att.window, att.max_context) == ("full", 0, 0, None)
    assert hf.rel_diff(loaded.model(tokens).logits, want) <= 1e-5


@torch.no_grad()
def test_llama_sparsek_with_partial_rotary_runs_in_remote_code_and_imports_back(tok, tmp_path):
    """recall-sparsek's shape: the remote code rotates what longtrain rotates; the note says plain transformers does not."""
    from transformers import AutoModelForCausalLM

    sparsek = ["attention.type=sparsek+sw", "attention.topk=6", "attention.window=5"]
    run = checkpoint(tmp_path / "run", tok, "model.style=llama", "model.rotary_pct=0.5", *sparsek)
    lt = load_checkpoint(run).model
    config = exported(run, tmp_path / "out")
    assert config["architectures"] == ["LlamaForCausalLM"] and config["longtrain_sparsek"]["rotary_pct"] == 0.5
    assert "rotates all of each head's dims instead of the first 8 of 16" in config["longtrain_sparsek"]["note"]

    tokens = torch.randint(0, 298, (2, 30))
    want = lt(tokens).logits
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True, dtype=torch.float32).eval()
    assert hf.rel_diff(remote(tokens).logits, want) <= 1e-5
    assert hf.rel_diff(other_rotary(lt)(tokens).logits, want) > 1e-3

    back = cli("import", tmp_path / "out", "--out", tmp_path / "back")
    assert back.exit_code == 0, back.output
    loaded = load_checkpoint(tmp_path / "back")
    att = loaded.recipe.attention
    assert loaded.recipe.model.rotary_pct == 0.5 and (att.type, att.topk, att.window) == ("sparsek+sw", 6, 5)
    assert hf.rel_diff(loaded.model(tokens).logits, want) <= 1e-6
    # An explicit --attention still wins; the rotary fraction stays.
    flags = cli("import", tmp_path / "out", "--out", tmp_path / "full", "--attention", "full")
    assert flags.exit_code == 0, flags.output
    loaded = load_checkpoint(tmp_path / "full")
    assert loaded.recipe.attention.type == "full" and loaded.recipe.model.rotary_pct == 0.5


REFUSED = {  # name: (recipe, overrides, the problem the error names)
    # the recall-circuit recipe itself (at a tiny size): Llama, full attention, RoPE on half of each head
    "recall-circuit": ("recall-circuit", [], "model.rotary_pct 0.5: LlamaForCausalLM rotates all of each head's dims"),
    "llama-parallel-residual": ("quickstart", ["model.style=llama", "model.parallel_residual=true", *FULL],
                                "model.parallel_residual true: LlamaForCausalLM has no parallel residual"),
    "gpt2-no-qkv-bias": ("quickstart", ["model.qkv_bias=false", *FULL], "model.qkv_bias false: GPT-NeoX has biases on q, k and v"),
    "gpt2-max-context": ("quickstart", [*FULL, "attention.max_context=16"], "attention.max_context 16: GPT-NeoX has no sliding window"),
    "qwen2-max-context": ("quickstart", ["model.style=llama", "model.qkv_bias=true", *FULL, "attention.max_context=16"],
                          "attention.max_context 16: a model with q/k/v biases is written as Qwen2ForCausalLM"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_family_cannot_say_is_refused_and_nothing_is_written(tok, tmp_path, name):
    recipe, sets, message = REFUSED[name]
    run = checkpoint(tmp_path / "run", tok, *sets, recipe=recipe)
    result = cli("export", run, "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error: ") and message in text and "Nothing was written" in text, text
    assert nothing_written(tmp_path / "out")


@pytest.mark.parametrize("case", ["missing", "file", "empty", "int8", "max-positions"])
def test_bad_export_inputs_name_the_problem_and_the_fix(tok, tmp_path, case):
    """A checkpoint path that cannot be used exits 1 (CheckpointError, as in every verb: errors.py); a flag
    value that cannot work exits 2 (UsageError), before the checkpoint is read."""
    run = checkpoint(tmp_path / "run", tok, *FULL)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    args, code, message = {
        "missing": ([tmp_path / "no-such-run"], 2, "no-such-run does not exist: give a checkpoint folder"),
        "file": ([tmp_path / "a-file"], 2, "a-file is a file, not a folder: give a checkpoint folder"),
        "empty": ([tmp_path / "empty"], 1, "is neither a checkpoint (no meta.json) nor a run dir with checkpoints"),
        "int8": ([run, "--dtype", "int8"], 2, "--dtype 'int8' is not a weight dtype of a Hugging Face folder: choose one of "
                 "float32, bfloat16, float16"),
        "max-positions": ([run, "--max-positions", 0], 2, "--max-positions must be at least 1; got 0"),
    }[case]
    result = cli("export", *args, "--out", tmp_path / "out")
    assert result.exit_code == code, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error: ") and message in text and "Traceback" not in text, text
    assert nothing_written(tmp_path / "out")


def test_a_write_that_fails_halfway_leaves_nothing(tok, tmp_path, monkeypatch):
    import longtrain.interop.hf_export as hf_export

    def half(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "save_file", half)
    run = checkpoint(tmp_path / "run", tok, *FULL)
    result = cli("export", run, "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert "No space left on device" in result.output and nothing_written(tmp_path / "out")
    (tmp_path / "empty").mkdir()  # an empty folder given as --out stays as it was
    assert cli("export", run, "--out", tmp_path / "empty").exit_code == 1
    assert list((tmp_path / "empty").iterdir()) == [] and not list(tmp_path.glob(".empty.*"))
