"""train.deterministic repeats a run bit for bit; train.score_distill trains the scores, the forward unchanged."""

import torch

from longtrain.train.metrics import read_metrics

from .tiny import cli


def fit(tmp, path, name, *sets):
    r = cli("fit", path, "--run-dir", tmp / name, "--set", "train.steps=4", *[a for s in sets for a in ("--set", s)])
    assert r.exit_code == 0, r.output
    return r.output, {m["step"]: m for m in read_metrics(tmp / name / "metrics.jsonl")}


def test_deterministic_runs_repeat_every_logged_number_and_restore_torch_settings(workspace, monkeypatch):
    from longtrain.train.trainer import Trainer

    tmp, recipe = workspace
    path = recipe()
    seen = []  # torch's deterministic mode as each training step saw it
    step = Trainer.train_step

    def spied(self):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", spied)
    out, a = fit(tmp, path, "a", "train.deterministic=true")
    assert "deterministic" in out
    assert seen == [True] * 4  # on inside the run, every step
    assert not torch.are_deterministic_algorithms_enabled()  # the run's setting does not leak out of it
    seen.clear()
    fit(tmp, path, "plain")
    assert seen == [False] * 4  # and off in a run that does not ask for it
    _, b = fit(tmp, path, "b", "train.deterministic=true")
    keys = ("loss", "grad_norm", "valid_loss")
    assert [[r.get(k) for k in keys] for r in a.values()] == [[r.get(k) for k in keys] for r in b.values()]


def test_a_deterministic_run_keeps_the_linear_types_triton_core(workspace):
    """train.deterministic once moved the linear types to their naive core (the Triton backward added with atomics);
    its backward now sums without them, so no note, and a deterministic run repeats its gradient norm."""
    tmp, recipe = workspace
    path = recipe()
    sets = ["attention.type=sparsek+linear+sw", "attention.backend=triton", "train.steps=1"]
    out, a = fit(tmp, path, "det", *sets, "train.deterministic=true")
    assert "naive core" not in out
    _, b = fit(tmp, path, "det2", *sets, "train.deterministic=true")
    assert a[1]["grad_norm"] == b[1]["grad_norm"]
    out, _ = fit(tmp, path, "fast", *sets)
    assert "naive core" not in out


def test_score_distillation_is_logged_and_changes_training_not_the_first_forward(workspace):
    tmp, recipe = workspace
    path = recipe()
    _, plain = fit(tmp, path, "plain")
    out, distilled = fit(tmp, path, "distilled", "train.score_distill=1.0", "train.score_distill_queries=16")
    assert "score distillation: weight 1.0 over 16 sampled queries" in out
    assert all(r["score_distill"] > 0 for r in distilled.values())
    assert "score_distill" not in plain[1]
    assert distilled[1]["loss"] == plain[1]["loss"]  # the same weights, the same forward
    assert distilled[4]["loss"] != plain[4]["loss"]  # the scorer learned from it since


def test_clipping_the_scorer_apart_keeps_distillation_from_shrinking_the_model_update(workspace):
    """train.clip_scorer_apart: the same first forward, a named setting, and another training path once the
    distillation gradient is clipped on its own (the quickstart's global clip would otherwise take it in)."""
    tmp, recipe = workspace
    path = recipe()
    sets = ("train.score_distill=1.0", "train.score_distill_queries=16", "train.grad_clip=0.1")
    _, together = fit(tmp, path, "together", *sets)
    out, apart = fit(tmp, path, "apart", *sets, "train.clip_scorer_apart=true")
    assert "the scoring vectors' gradient clipped apart" in out
    assert apart[1]["loss"] == together[1]["loss"] and apart[1]["grad_norm"] == together[1]["grad_norm"]
    assert apart[4]["loss"] != together[4]["loss"]


def test_scorer_unit_norm_keeps_every_scoring_vector_at_length_one(workspace):
    from safetensors.torch import load_file

    tmp, recipe = workspace
    path = recipe()
    out, _ = fit(tmp, path, "unit", "train.score_distill=1.0", "train.score_distill_queries=16", "train.scorer_unit_norm=true")
    assert "the scoring vectors kept at length 1" in out
    weights = load_file(next((tmp / "unit" / "checkpoints").glob("step-*")) / "model.safetensors")
    scorers = [w for name, w in weights.items() if name.endswith("scorer.weight")]
    assert scorers and all(torch.allclose(w.float().norm(dim=-1), torch.ones(w.shape[0]), atol=1e-5) for w in scorers)
