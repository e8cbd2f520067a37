"""Fine-tuning an imported model: train.init_from, the finetune recipes, the scorer-first warm-up."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.model import LM, LMConfig
from longtrain.model.scoring import mimic_score_weight
from longtrain.train.init import apply_freeze, init_from_checkpoint, load_fit_recipe
from longtrain.train.metrics import read_metrics
from longtrain.train.optim import build_optimizer, lr_at, set_lr
from longtrain.train.recipe import RecipeError, TrainConfig, load_recipe, recipe_to_yaml
from tests.interop import hf_models as hf


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny Llama saved by transformers, imported with full attention; a corpus of its words."""
    root = tmp_path_factory.mktemp("ft")
    torch.manual_seed(0)
    hf.save(hf.llama(max_position_embeddings=4096), root / "hf", hf.tokenizer())
    result = CliRunner().invoke(app, ["import", str(root / "hf"), "--out", str(root / "base"), "--attention", "full"])
    assert result.exit_code == 0, result.output
    hf.write_corpus(root / "train", n_docs=3, words=1200)
    (root / "valid").mkdir()
    (root / "valid/v.txt").write_text(hf.text(99, 1200))
    return root


def overrides(root, *extra):
    sets = [
        f"train.init_from={root / 'base'}", f"data.path={root / 'train'}", f"data.valid={root / 'valid'}",
        "data.min_doc_tokens=300", "attention.topk=8", "attention.window=8", "train.steps=4", "train.warmup_steps=2",
        "train.chunk_size=32", "train.batch_docs=2", "train.grad_accum=1", "train.device=cpu", "train.valid_every=4",
        "train.valid_docs=1", "train.valid_tokens=64", "checkpoint.every=2", "checkpoint.keep=3", "logging.every=1",
        "logging.progress=false", *extra,
    ]
    return [a for s in sets for a in ("--set", s)]


def sets(args):
    return args[1::2]


def fit(root, run, *extra, env=None):
    cmd = [sys.executable, "-m", "longtrain.cli", "fit", "finetune-llama", "--run-dir", str(run), *overrides(root, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, **(env or {})))


def base_weights(root):
    return load_file(root / "base/checkpoints/step-00000000/model.safetensors")


def test_finetune_recipe_takes_model_and_tokenizer_from_the_source(imported, tmp_path):
    r = load_fit_recipe("finetune-llama", sets(overrides(imported, "model.dropout=0.1")))
    m = r.model
    assert (m.style, m.layers, m.d_model, m.heads, m.kv_heads, m.intermediate_size, m.rope_theta, m.norm_eps) == (
        "llama", 2, 32, 4, 2, 40, 5000.0, 1e-6)
    assert m.dropout == 0.1 and m.vocab_size == hf.VOCAB and m.tied_embeddings is False
    assert r.tokenizer.path == str(imported / "base/checkpoints/step-00000000/tokenizer.json")
    assert (r.train.lr, r.train.warmup_start_ratio, r.train.weight_decay, r.train.grad_clip) == (1e-4, 0.1, 0.1, 1.0)

    # The saved (complete) recipe never reads the source again.
    saved = tmp_path / "recipe.yaml"
    saved.write_text(recipe_to_yaml(r))
    hidden = imported.with_name(imported.name + "-away")
    imported.rename(hidden)
    try:
        assert load_recipe(saved).model == m
        with pytest.raises(RecipeError, match="train.init_from: .* does not exist.*Train or import that model first"):
            load_fit_recipe("finetune-llama", sets(overrides(imported)))
        with pytest.raises(RecipeError, match="which `longtrain fit` reads"):  # the parser itself reads no checkpoint
            load_recipe("finetune-llama", sets(overrides(imported)))
    finally:
        hidden.rename(imported)
    with pytest.raises(RecipeError, match="train.init_from is not set"):
        load_recipe("finetune-pythia")

    # Weights: the source's, bitwise; the new scoring vectors mimic its attention.
    model = LM(LMConfig.from_recipe(r.model, r.attention))
    notes = init_from_checkpoint(model, r.train.init_from, r)
    state, base = model.state_dict(), base_weights(imported)
    assert all(torch.equal(state[k], v) for k, v in base.items())
    for blk in model.blocks:
        a = blk.attn
        assert torch.equal(a.scorer.weight, mimic_score_weight(a.q_proj.weight, a.k_proj.weight, 4, 2, 1))
    assert "2 scoring vectors are new (not in the source): initialised mimic" in notes
    assert not any("computes differently" in n for n in notes)  # dropout is training-only


def test_init_from_says_where_the_model_computes_differently(imported):
    """Settings that keep the shapes (so the weights load) but change what the model computes are named."""
    r = load_fit_recipe("finetune-llama", sets(overrides(imported, "model.rotary_pct=0.5", "model.rope_theta=20000")))
    notes = init_from_checkpoint(LM(LMConfig.from_recipe(r.model, r.attention)), r.train.init_from, r)
    changed = [n for n in notes if "computes differently" in n]
    assert len(changed) == 1 and "rope_theta 5000.0 → 20000.0" in changed[0] and "rotary_pct 1.0 → 0.5" in changed[0], notes


def test_fit_with_scorer_first_warmup_then_resume_after_a_kill(imported, tmp_path):
    freeze = "train.freeze={steps: 2}"
    straight = fit(imported, tmp_path / "straight", freeze)
    assert straight.returncode == 0, straight.stderr + straight.stdout
    assert "initialised from" in straight.stdout and "scoring vectors are new" in straight.stdout
    ckpts = tmp_path / "straight/checkpoints"
    base = base_weights(imported)
    at2, at4 = load_file(ckpts / "step-00000002/model.safetensors"), load_file(ckpts / "step-00000004/model.safetensors")
    # Steps 1-2: only the scoring vectors moved (no update, no weight decay on the rest).
    assert all(torch.equal(at2[k], v) for k, v in base.items())
    scorers = [k for k in at2 if k.endswith("scorer.weight")]
    assert len(scorers) == 2 and set(at2) == set(base) | set(scorers)
    r = load_fit_recipe("finetune-llama", sets(overrides(imported, freeze)))  # the run's start: the source + mimic scorers
    start = LM(LMConfig.from_recipe(r.model, r.attention))
    init_from_checkpoint(start, r.train.init_from, r)
    start = start.state_dict()
    for k in scorers:  # every scoring vector (row) of every layer learned in the warm-up
        assert at2[k].shape == start[k].shape and (at2[k] != start[k]).any(dim=-1).all(), k
    # Steps 3-4: everything trains.
    assert all(not torch.equal(at4[k], v) for k, v in base.items() if k.endswith(".weight"))
    metrics = {r["step"]: r for r in read_metrics(tmp_path / "straight/metrics.jsonl")}
    assert metrics[1]["lr"] == pytest.approx(1e-4 * (0.1 + 0.9 / 2))  # warm-up from 10% of the peak
    assert "valid_loss" in metrics[4]
    groups = json.loads((ckpts / "step-00000004/meta.json").read_text())["optimizer"]["param_groups"]
    assert {(g.get("lr_scale", 1.0), g.get("frozen_until", 0)) for g in groups} >= {(6.0, 0), (1.0, 2)}

    # Exported after fine-tuning: the imported model's config (family, max_position_embeddings) comes back,
    # and model.safetensors has the folder's mode (safetensors alone creates it 0600).
    assert CliRunner().invoke(app, ["export", str(tmp_path / "straight"), "--out", str(tmp_path / "hf")]).exit_code == 0
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["max_position_embeddings"] == 4096 and config["architectures"] == ["LlamaForCausalLM"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044, modes

    # A run killed inside the warm-up resumes its own checkpoint (not the source) and ends bitwise equal.
    killed = fit(imported, tmp_path / "resumed", freeze, env={"LONGTRAIN_TEST_KILL_AFTER": "2"})
    assert killed.returncode == -signal.SIGKILL
    resumed = fit(imported, tmp_path / "resumed", freeze)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert "resuming from" in resumed.stdout and "initialised from" not in resumed.stdout
    final = load_file(tmp_path / "resumed/checkpoints/step-00000004/model.safetensors")
    assert all(torch.equal(final[k], at4[k]) for k in at4)


def test_init_from_a_checkpoint_of_another_shape_names_the_key(imported, tmp_path):
    result = CliRunner().invoke(app, ["fit", "finetune-llama", "--run-dir", str(tmp_path / "run"), *overrides(imported,
        "model.intermediate_size=44")])
    assert result.exit_code == 1
    msg = " ".join(result.output.split())
    assert "blocks.0.mlp.gate.weight: checkpoint (40, 32) vs model (44, 32)" in msg and "train.init_from" in msg
    assert not (tmp_path / "run/checkpoints").exists()
    small = CliRunner().invoke(app, ["fit", "finetune-llama", "--run-dir", str(tmp_path / "r3"), *overrides(imported,
        "model.vocab_size=100")])
    assert small.exit_code == 1 and "tokens but model.vocab_size is 100" in " ".join(small.output.split())
    into_source = CliRunner().invoke(app, ["fit", "finetune-llama", "--run-dir", str(imported / "base"), *overrides(imported)])
    assert into_source.exit_code == 1 and "holds imported weights only" in " ".join(into_source.output.split())
    bad_freeze = CliRunner().invoke(app, ["fit", "finetune-llama", "--run-dir", str(tmp_path / "r2"), *overrides(imported,
        "attention.type=full", "attention.topk=0", "attention.window=0", "train.freeze={steps: 1}")])
    assert bad_freeze.exit_code == 2 and "has no scoring vectors" in " ".join(bad_freeze.output.split())


def test_frozen_parameters_get_no_update_and_thaw_with_fresh_moments():
    model = LM(LMConfig(vocab_size=50, layers=1, d_model=16, heads=2, attention="sparsek+sw", topk=4, window=4))
    cfg = TrainConfig(steps=6, lr=1e-2, warmup_steps=2, weight_decay=0.1, score_lr_scale=3.0, freeze={"steps": 3})
    opt = build_optimizer(model, cfg)
    scorer = model.blocks[0].attn.scorer.weight
    frozen = [(n, p) for n, p in model.named_parameters() if "scorer" not in n]
    start = {n: p.detach().clone() for n, p in frozen}
    tokens = torch.randint(0, 50, (2, 24))
    for step in range(1, 7):
        set_lr(opt, lr_at(step, cfg), step=step, cfg=cfg)
        assert apply_freeze(model, cfg.freeze, step) == (len(frozen) if step <= 3 else 0)
        before = scorer.detach().clone()
        model(tokens).logits.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert not torch.equal(scorer, before)
        if step <= 3:
            assert all(torch.equal(p, start[n]) for n, p in frozen) and not any(opt.state[p] for _, p in frozen)
        if step == 4:  # thawed: fresh AdamW moments, and the warm-up again (halfway at the first step)
            assert all(int(opt.state[p]["step"]) == 1 for _, p in frozen)
            assert all(not torch.equal(p, start[n]) for n, p in frozen if p.dim() >= 2)
    rates = {(g.get("lr_scale", 1.0), g.get("frozen_until", 0)): g["lr"] for g in opt.param_groups}
    assert rates[(3.0, 0)] == pytest.approx(3 * lr_at(6, cfg))  # the scoring vectors' multiplier
    assert rates[(1.0, 3)] == pytest.approx(lr_at(6, cfg))  # warmed up again by step 3 + 2
    set_lr(opt, lr_at(4, cfg), step=4, cfg=cfg)
    assert {(g.get("frozen_until", 0)): g["lr"] for g in opt.param_groups}[3] == pytest.approx(lr_at(4, cfg) / 2)


def test_default_optimizer_groups_and_schedule_are_unchanged():
    model = LM(LMConfig(vocab_size=50, layers=1, d_model=16, heads=2, attention="sparsek+sw", topk=4, window=4))
    opt = build_optimizer(model, TrainConfig(steps=10, warmup_steps=2))
    assert [set(g) - {"params"} >= {"weight_decay"} and "lr_scale" not in g for g in opt.param_groups] == [True, True]
    cfg = TrainConfig(steps=10, lr=1e-3, warmup_steps=4, warmup_start_ratio=0.1)
    assert lr_at(1, cfg) == pytest.approx(1e-4 + 9e-4 / 4) and lr_at(4, cfg) == pytest.approx(1e-3)
    assert lr_at(1, TrainConfig(steps=10, lr=1e-3, warmup_steps=4)) == 1e-3 * 1 / 4


def test_model_hash_of_existing_recipes_is_unchanged():
    """The new model fields stay out of the hash at their defaults: runs saved before them still resume."""
    from longtrain.train.recipe import recipe_hash

    assert recipe_hash(load_recipe("quickstart"), ("model",)) == "de235a4e9353dc803d7026594d8f19b583552679e27b8d6a5d33e3e7a735049c"
    assert recipe_hash(load_recipe("gutenberg-sparsek"), ("model",)) == "6109fdbec2cca71b197a3b9a88d8748de24aa506a7e11606a025a2570d3d8ad7"
    assert recipe_hash(load_recipe("quickstart", ["model.norm_eps=1e-6"]),
        ("model",)) != "de235a4e9353dc803d7026594d8f19b583552679e27b8d6a5d33e3e7a735049c"


def test_a_missing_init_source_is_named_before_its_tokenizer(tmp_path):
    """recall-sparsek takes its weights and tokenizer from recall-circuit's run: when that run is missing,
    the error names train.init_from and what to do (not the tokenizer file), and the run dir stays absent."""
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["fit", "recall-sparsek", "--run-dir", str(run),
                                      "--set", f"train.init_from={tmp_path / 'circuit'}",
                                      "--set", f"tokenizer.path={tmp_path / 'circuit' / 'tokenizer.json'}"])
    msg = " ".join(result.output.split())
    assert result.exit_code == 2, result.output  # a path that is not there: the recipe cannot work as it is
    assert f"train.init_from: {tmp_path / 'circuit'} does not exist" in msg and "longtrain fit RECIPE" in msg
    assert "tokenizer" not in msg and not run.exists()
    # A recipe that takes its model from the source (no `model:` section): the same error, from where fit starts.
    result = CliRunner().invoke(app, ["fit", "finetune-llama", "--run-dir", str(run), "--dry-run",
                                      "--set", f"train.init_from={tmp_path / 'circuit'}"])
    assert result.exit_code == 2, result.output
    assert f"train.init_from: {tmp_path / 'circuit'} does not exist" in " ".join(result.output.split())


def test_finetune_keeps_the_imports_k_and_w_unless_the_recipe_sets_them(imported, tmp_path):
    r = CliRunner().invoke(app, ["import", str(imported / "hf"), "--out", str(tmp_path / "sk"), "--topk", "4", "--window", "6"])
    assert r.exit_code == 0, r.output
    own = [s for s in sets(overrides(imported)) if not s.startswith(("attention.", "train.init_from"))]
    source = [f"train.init_from={tmp_path / 'sk'}"]
    recipe = load_fit_recipe("finetune-llama", [*own, *source])
    assert (recipe.attention.topk, recipe.attention.window) == (4, 6)
    recipe = load_fit_recipe("finetune-llama", [*own, *source, "attention.topk=8"])
    assert (recipe.attention.topk, recipe.attention.window) == (8, 6)
    with pytest.raises(RecipeError, match=r"attention.topk comes from train.init_from, and .* \(attention full\) has none"):
        load_fit_recipe("finetune-llama", [*own, f"train.init_from={imported / 'base'}"])
    args = [a for s in [*own, *source, "attention.topk=8"] for a in ("--set", s)]
    dry = CliRunner().invoke(app, ["fit", "finetune-llama", "--run-dir", str(tmp_path / "run"), "--dry-run", *args])
    assert dry.exit_code == 0, dry.output
    assert "attention: sparsek+sw (k=8, w=6, hard_k_soft_v); k from the recipe, w from train.init_from;" in dry.output


def test_lora_fit_keeps_the_base_frozen_merges_on_export_and_resumes(imported, tmp_path):
    from longtrain.train.lora import add_lora, merge_lora
    from longtrain.train.recipe import LoraConfig

    lora = "train.lora={rank: 4, alpha: 8}"
    straight = fit(imported, tmp_path / "lora", lora)
    assert straight.returncode == 0, straight.stderr + straight.stdout
    assert "LoRA rank 4 (alpha 8) on q_proj, k_proj, v_proj, o_proj, gate, up, down" in straight.stdout
    at4 = load_file(tmp_path / "lora/checkpoints/step-00000004/model.safetensors")
    base = base_weights(imported)
    assert all(torch.equal(at4[k], v) for k, v in base.items())  # every pretrained weight frozen
    assert all(at4[f"blocks.{i}.mlp.down.lora.b"].abs().max() > 0 for i in range(2))  # the adapters learned
    assert {k for k in at4 if k.endswith("scorer.weight")} == {"blocks.0.attn.scorer.weight", "blocks.1.attn.scorer.weight"}

    # Export merges the adapters into the weights.
    assert CliRunner().invoke(app, ["export", str(tmp_path / "lora"), "--out", str(tmp_path / "hf")]).exit_code == 0
    exported, merged = load_file(tmp_path / "hf/model.safetensors"), merge_lora(at4)
    assert not any(".lora." in k for k in exported)
    q = exported["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(q, merged["blocks.1.attn.q_proj.weight"]) and not torch.equal(q, base["blocks.1.attn.q_proj.weight"])

    # Killed after step 2, the run resumes its adapters and ends bitwise equal.
    killed = fit(imported, tmp_path / "resumed", lora, env={"LONGTRAIN_TEST_KILL_AFTER": "2"})
    assert killed.returncode == -signal.SIGKILL
    resumed = fit(imported, tmp_path / "resumed", lora)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    final = load_file(tmp_path / "resumed/checkpoints/step-00000004/model.safetensors")
    assert all(torch.equal(final[k], at4[k]) for k in at4)

    # init_from the LoRA run: a full fine-tune starts from the merged weights, a LoRA one from its adapters.
    r = load_fit_recipe("finetune-llama", sets(overrides(imported)) + [f"train.init_from={tmp_path / 'lora'}"])
    full = LM(LMConfig.from_recipe(r.model, r.attention))
    assert "merged into its weights" in " ".join(init_from_checkpoint(full, r.train.init_from, r))
    assert all(torch.equal(full.state_dict()[k], v) for k, v in merged.items())
    adapters = LM(LMConfig.from_recipe(r.model, r.attention))
    add_lora(adapters, LoraConfig(rank=4, alpha=8))
    assert "adapters are loaded" in " ".join(init_from_checkpoint(adapters, r.train.init_from, r))
    assert all(torch.equal(adapters.state_dict()[k], v) for k, v in at4.items())
