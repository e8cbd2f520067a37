"""Optimizer parameter groups, the learning-rate schedule and clipping."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from longtrain.train.optim import build_optimizer, clip_grad_norm, clip_grad_norms, lr_at, normalize_scorers, set_lr
from longtrain.train.recipe import TrainConfig


def test_schedule_warmup_peak_cosine_floor():
    cfg = TrainConfig(steps=110, lr=1e-3, min_lr_ratio=0.1, warmup_steps=10)
    assert lr_at(1, cfg) == pytest.approx(1e-4)
    assert lr_at(5, cfg) == pytest.approx(5e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway down the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_schedule_without_warmup_starts_at_peak():
    cfg = TrainConfig(steps=100, lr=2e-3, warmup_steps=0)
    assert lr_at(1, cfg) == pytest.approx(2e-4 + 0.5 * 1.8e-3 * (1 + math.cos(math.pi / 100)))


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, TrainConfig(steps=10, weight_decay=0.1, warmup_steps=0))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.dim() for p in decay["params"]} == {2} and len(decay["params"]) == 2
    assert {p.dim() for p in no_decay["params"]} == {1} and len(no_decay["params"]) == 3
    set_lr(opt, 0.5)
    assert all(g["lr"] == 0.5 for g in opt.param_groups)


def test_clip_grad_norm_reports_the_norm_before_clipping():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)  # norm 4
    assert float(clip_grad_norm([p], 0.0)) == pytest.approx(4.0)
    assert torch.equal(p.grad, torch.full((4,), 2.0))  # 0 = off
    assert float(clip_grad_norm([p], 1.0)) == pytest.approx(4.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_clip_scorer_apart_clips_the_scoring_vectors_and_the_rest_each_to_the_limit():
    """train.clip_scorer_apart: a scorer gradient of norm 30 is clipped to 1 without touching the model's 0.6 (the
    global clip would scale the model's by 1/30); the returned norm is the whole gradient's before clipping."""

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(3, 1, bias=False)
            self.scorer = torch.nn.Module()
            self.scorer.weight = torch.nn.Parameter(torch.zeros(1, 4))

    def with_grads():
        m = Tiny()
        m.proj.weight.grad = torch.tensor([[0.6, 0.0, 0.0]])  # norm 0.6
        m.scorer.weight.grad = torch.full((1, 4), 15.0)  # norm 30
        return m

    apart = with_grads()
    total = clip_grad_norms(apart, 1.0, scorer_apart=True)
    assert float(total) == pytest.approx((0.6**2 + 30**2) ** 0.5)
    assert apart.proj.weight.grad[0, 0].item() == pytest.approx(0.6)
    assert apart.scorer.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    no_scorer = with_grads()
    no_scorer.scorer.weight.grad = None  # e.g. a window model: the model's group alone
    assert float(clip_grad_norms(no_scorer, 1.0, scorer_apart=True)) == pytest.approx(0.6)
    together = with_grads()
    assert float(clip_grad_norms(together, 1.0, scorer_apart=False)) == pytest.approx(float(total))
    assert together.proj.weight.grad[0, 0].item() == pytest.approx(0.6 / float(total), rel=1e-5)


def test_a_warmup_longer_than_the_run_warms_up_over_its_first_tenth():
    cfg = TrainConfig(steps=20, lr=1e-3, warmup_steps=100)
    assert cfg.warmup() == 2
    assert [lr_at(s, cfg) for s in (1, 2)] == pytest.approx([5e-4, 1e-3])
    assert lr_at(20, cfg) == pytest.approx(1e-4)
    assert TrainConfig(steps=5, warmup_steps=100).warmup() == 0  # shorter than 10 steps: none
    assert lr_at(1, TrainConfig(steps=5, lr=1e-3, warmup_steps=100)) > 0
    assert TrainConfig(steps=200, warmup_steps=100).warmup() == 100  # a warmup that fits is kept


def test_fused_adamw_steps_like_foreach_and_resumes_either_way():
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))  # noqa: E731
    a, b = make(), make()
    b.load_state_dict(a.state_dict())
    cfg = TrainConfig(steps=10, lr=1e-2, warmup_steps=0)
    opt_a, opt_b = build_optimizer(a, cfg), build_optimizer(b, cfg, fused=True)
    x = torch.randn(4, 6)
    for _ in range(3):
        for m, opt in ((a, opt_a), (b, opt_b)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p - q).abs().max() <= 1e-6

    def resume(source, source_opt, fused):
        """source_opt's state loaded by the other implementation over a bitwise copy of `source`: every parameter's
        moments and step come back as saved, and one more step of each lands on the same parameters."""
        saved = copy.deepcopy(source_opt.state_dict())
        clone = make()
        clone.load_state_dict(source.state_dict())
        loaded = build_optimizer(clone, cfg, fused=fused)
        loaded.load_state_dict(copy.deepcopy(saved))  # as from a checkpoint file: a live state_dict shares its tensors
        params = list(clone.parameters())
        assert len(saved["state"]) == len(params) == len(loaded.state)
        for i, p in enumerate(params):
            state, want = loaded.state[p], saved["state"][i]
            assert set(state) >= {"exp_avg", "exp_avg_sq", "step"}, (i, set(state))
            assert torch.equal(state["exp_avg"], want["exp_avg"]) and torch.equal(state["exp_avg_sq"], want["exp_avg_sq"]), i
            assert state["step"].dtype == torch.float32 and float(state["step"]) == float(want["step"]) == 3.0, i
        for m, opt in ((source, source_opt), (clone, loaded)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        for p, q in zip(source.parameters(), params):
            assert (p - q).abs().max() <= 1e-6
        return loaded

    # a for-each checkpoint resumed by a fused optimizer (CPU run -> GPU run) stays fused, and back
    resumed = resume(a, opt_a, fused=True)
    assert all(g["fused"] and not g["foreach"] for g in resumed.param_groups)
    back = resume(b, opt_b, fused=False)
    assert all(g["foreach"] and not g["fused"] for g in back.param_groups)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_every_schedule_warms_up_the_same_then_follows_its_shape(schedule):
    cfg = TrainConfig(steps=110, lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, schedule=schedule, decay_fraction=0.3)
    lrs = {s: lr_at(s, cfg) for s in range(1, 111)}
    assert [lrs[s] for s in (1, 5, 10)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert all(lrs[s] >= lrs[s + 1] for s in range(10, 110))  # never rises after the warmup
    expected = {  # at the steps 60 (halfway after the warmup), 80 (where wsd starts to decay), 95 and 110
        "cosine": [1e-4 + 0.5 * 9e-4, 1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 0.7)), None, 1e-4],
        "linear": [1e-3 - 9e-4 * 0.5, 1e-3 - 9e-4 * 0.7, 1e-3 - 9e-4 * 0.85, 1e-4],
        "wsd": [1e-3, 1e-3, 1e-3 - 9e-4 * 0.5, 1e-4],
        "constant": [1e-3, 1e-3, 1e-3, 1e-3],
    }[schedule]
    for step, value in zip((60, 80, 95, 110), expected):
        if value is not None:
            assert lrs[step] == pytest.approx(value), step


def test_a_schedule_is_named_in_the_recipe_with_a_hint():
    from longtrain.train.recipe import RecipeError, load_recipe

    assert load_recipe("quickstart", ["train.schedule=wsd"]).train.schedule == "wsd"
    with pytest.raises(RecipeError, match="did you mean `wsd`"):
        load_recipe("quickstart", ["train.schedule=wds"])


def test_scorer_unit_norm_rescales_the_scoring_vectors_and_leaves_the_scores():
    """train.scorer_unit_norm: every scoring vector (row) back to length 1, other weights untouched, and the
    TimestepNorm'd scores the same up to its epsilon (float64, fresh random inputs)."""
    from longtrain.model.scoring import importance_scores

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(8, 8)
    model.attn = torch.nn.Module()
    model.attn.scorer = torch.nn.Module()
    lengths = torch.tensor([[0.01], [3.0]], dtype=torch.float64)
    model.attn.scorer.weight = torch.nn.Parameter(torch.randn(2, 8, dtype=torch.float64) * lengths)
    proj = model.proj.weight.detach().clone()
    B, L = 2, 37
    x = torch.randn(B, L, 8, dtype=torch.float64)
    args = (torch.arange(L).expand(B, L), torch.ones(B, L, dtype=torch.bool), torch.zeros(B, dtype=torch.long),
            torch.zeros(B, 2, dtype=torch.float64), torch.zeros(B, 2, dtype=torch.float64))
    before, _, _ = importance_scores(x, model.attn.scorer.weight.detach(), *args, timestep_norm=True, eps_slope=1e-3)
    normalize_scorers(model)
    after, _, _ = importance_scores(x, model.attn.scorer.weight.detach(), *args, timestep_norm=True, eps_slope=1e-3)
    assert torch.allclose(model.attn.scorer.weight.norm(dim=-1), torch.ones(2, dtype=torch.float64), atol=1e-12)
    assert torch.equal(model.proj.weight, proj)
    # TimestepNorm's epsilon (1e-5 beside the raw scores' variance) is the only difference: a few percent for the
    # 0.01-long vector, whose raw variance is ~1e-4, and ~1e-5 for the 3-long one (more at the first positions)
    assert (after[..., 0] - before[..., 0]).abs().max() < 0.1
    assert (after[..., 1] - before[..., 1]).abs().max() < 1e-4
