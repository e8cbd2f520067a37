"""`longtrain verify-equivalence`: passes on a correct cache, fails (exit 1) on a broken one, exit 2 on bad usage."""

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.model import LM, LMConfig
from longtrain.train.recipe import load_recipe, recipe_to_yaml

runner = CliRunner()
SMALL_RECIPE = ["model.layers=1", "model.d_model=32", "model.heads=2", "attention.topk=8", "attention.window=8", "tokenizer.vocab_size=300"]


def verify(*args, env=None):
    return runner.invoke(app, ["verify-equivalence", *args], env=env)


def test_passes_on_the_default_model_and_writes_json(tmp_path):
    out = tmp_path / "out.json"
    res = verify("--tokens", "2500", "--chunk-size", "700", "--chunk-size", "61", "--json", str(out))
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert [r["chunk_size"] for r in report["runs"]] == [700, 61]
    for r in report["runs"]:
        assert r["selection_agreement"] == 1.0 and r["max_abs_logit_diff"] <= 1e-9
        assert r["loss_diff"] <= 1e-9 and r["peak_mem_bytes"] >= 0 and r["seconds"] > 0
    assert "PASSED" in res.output


def test_a_broken_cache_fails(tmp_path):
    out = tmp_path / "out.json"
    res = verify("--tokens", "1500", "--chunk-size", "500", "--json", str(out), env={"LONGTRAIN_FAULT": "drop_pool"})
    assert res.exit_code == 1, res.output
    run = json.loads(out.read_text())["runs"][0]
    assert run["selection_agreement"] < 1.0 and run["max_abs_logit_diff"] > 1e-9


def test_float32_thresholds_can_be_set():
    assert verify("--tokens", "1200", "--chunk-size", "300", "--dtype", "float32").exit_code == 0
    # An impossible threshold fails: float32 passes round differently.
    res = verify("--tokens", "1200", "--chunk-size", "300", "--dtype", "float32", "--max-logit-diff", "0")
    assert res.exit_code == 1, res.output


def test_recipe_checkpoint_and_text(tmp_path):
    recipe = load_recipe("quickstart", SMALL_RECIPE)
    step = tmp_path / "run" / "checkpoints" / "step-00000007"
    step.mkdir(parents=True)
    (tmp_path / "run" / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    torch.manual_seed(3)
    model = LM(LMConfig.from_recipe(recipe.model, recipe.attention, vocab_size=300))
    save_file(model.state_dict(), step / "model.safetensors")
    text = tmp_path / "doc.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 40)

    res = verify("--checkpoint", str(step), "--text", str(text), "--tokens", "900", "--chunk-size", "100")
    assert res.exit_code == 0, res.output
    assert "900 tokens" in res.output.replace(",", "")
    res = verify("--recipe", str(tmp_path / "run" / "recipe.yaml"), "--tokens", "600", "--chunk-size", "250")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tokens", "1"], "--tokens"),
        (["--chunk-size", "0"], "--chunk-size"),
        (["--dtype", "float16"], "--dtype"),
        (["--device", "tpu"], "--device"),
        (["--text", "/nonexistent/doc.txt"], "no such file"),
        (["--recipe", "/nonexistent/r.yaml"], "not found"),
        (["--checkpoint", "/nonexistent/step-1"], "model.safetensors"),
        (["--recipe", "quickstart", "--checkpoint", "x"], "not both"),
        (["--json", "/nonexistent/dir/out.json"], "does not exist"),
        (["--tokens", "many"], "Invalid value"),
    ],
)
def test_bad_usage_exits_2_with_a_message(args, message):
    res = verify(*args)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "Traceback" not in res.output
