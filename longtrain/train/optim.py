"""AdamW, its parameter groups and the learning-rate schedule.

Steps are counted from 1: `lr_at(step)` is the rate used by optimizer step
`step` (1..train.steps), the same number that `metrics.jsonl` and the
checkpoint directory `step-XXXXXXXX` carry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch
from torch import nn

from longtrain.train.recipe import TrainConfig


SCORE_PARAMS = "*scorer.weight"  # the SparseK scoring vectors (train.score_lr_scale)


def build_optimizer(model: nn.Module, cfg: TrainConfig, *, fused: bool = False) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (nanoGPT's split).

    Weights with 2+ dimensions (linear layers, embeddings) decay; biases,
    norm gains and scoring vectors do not. `fused` (the trainer's choice on CUDA) is torch's fused
    kernel: one launch for all parameters, no host sync, and it skips a step on the device when a
    loss scaler found inf gradients; otherwise the for-each implementation. Either is deterministic,
    so a resumed run takes bitwise the same steps (as long as it resumes on the same kind of device).

    Fine-tuning adds groups, only when asked (so older checkpoints resume): the scoring vectors
    under `train.score_lr_scale` (`lr_scale`), and the parameters that `train.freeze` holds
    still for its first steps (`frozen_until`; see set_lr for how they thaw).
    """
    freeze = cfg.freeze if cfg.freeze is not None and cfg.freeze.steps > 0 else None
    groups: dict[tuple, dict] = {
        (True, 1.0, 0): {"params": [], "weight_decay": cfg.weight_decay},
        (False, 1.0, 0): {"params": [], "weight_decay": 0.0},
    }
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.dim() >= 2
        scale = cfg.score_lr_scale if fnmatchcase(name, SCORE_PARAMS) else 1.0
        frozen_until = freeze.steps if freeze and not any(fnmatchcase(name, g) for g in freeze.trainable) else 0
        group = groups.setdefault((decay, scale, frozen_until), {
            "params": [], "weight_decay": cfg.weight_decay if decay else 0.0, "lr_scale": scale, "frozen_until": frozen_until,
        })
        group["params"].append(p)
    groups = [g for key, g in groups.items() if g["params"] or key[1:] == (1.0, 0)]
    optimizer = torch.optim.AdamW(groups, lr=lr_at(1, cfg), betas=tuple(cfg.betas), foreach=not fused, fused=fused)
    optimizer.register_load_state_dict_pre_hook(_keep_implementation)
    return optimizer


def _keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A checkpoint's groups carry the implementation that saved them (a CPU run's for-each, a GPU's
    fused); the resuming optimizer keeps its own, and torch then places the step counters for it."""
    impl = {key: optimizer.defaults[key] for key in ("fused", "foreach")}
    return {**state_dict, "param_groups": [{**g, **impl} for g in state_dict["param_groups"]]}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from lr·warmup_start_ratio to `lr` over `cfg.warmup()` steps, then `cfg.schedule`:
    cosine or linear down to lr·min_lr_ratio at the last step, wsd (lr, then linear down over the last
    `decay_fraction` of the steps after the warmup), or constant."""
    warmup = cfg.warmup()
    if step <= warmup:
        start = cfg.lr * cfg.warmup_start_ratio  # the paper's fine-tuning warms up from 10% of the peak
        return start + (cfg.lr - start) * step / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    min_lr = cfg.lr * cfg.min_lr_ratio
    after = max(1, cfg.steps - warmup)  # steps after the warmup
    progress = min(1.0, (step - warmup) / after)  # 0 at the end of the warmup, 1 at the last step
    if cfg.schedule == "cosine":
        return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":  # stable until the decay starts, then the linear decay over what is left
        stable = 1.0 - cfg.decay_fraction
        progress = max(0.0, progress - stable) / cfg.decay_fraction
    return cfg.lr - (cfg.lr - min_lr) * progress  # linear


def set_lr(optimizer: torch.optim.Optimizer, lr: float, *, step: int | None = None, cfg: TrainConfig | None = None) -> None:
    """Every group at `lr` times its `lr_scale`.

    A group that `train.freeze` held still until step N has no AdamW moments when it thaws (AdamW
    skips parameters without a gradient: no update, no decay, no state), so its first steps would
    take full-size, sign-like updates at whatever rate the schedule has reached. It warms up again
    instead: over `warmup_steps` after N, from lr·warmup_start_ratio, as the whole run did.
    """
    for group in optimizer.param_groups:
        scale = group.get("lr_scale", 1.0)
        thaw = group.get("frozen_until", 0)
        if thaw and step is not None and cfg is not None and cfg.warmup():
            r = cfg.warmup_start_ratio
            scale *= r + (1 - r) * min(1.0, max(step - thaw, 0) / cfg.warmup())
        group["lr"] = lr * scale


def clip_grad_norms(model: nn.Module, max_norm: float, *, scorer_apart: bool) -> torch.Tensor:
    """clip_grad_norm over the model's parameters, or (scorer_apart, `train.clip_scorer_apart`) over the SparseK
    scoring vectors and over the rest separately, each to max_norm, so that a large scorer gradient (score
    distillation's: a norm of 48-141 against the LM's 0.4 on books, benchmarks/README.md) does not set the clip
    factor of the model's gradient: AdamW is indifferent to a steady factor, not to one that swings from step to
    step with the scorer. Returns the norm of the whole gradient before clipping."""
    if not scorer_apart:
        return clip_grad_norm(model.parameters(), max_norm)
    scorer, rest = scorer_split(p for p in model.named_parameters() if p[1].grad is not None)
    if not scorer or not rest:  # (no SparseK scorer, or all frozen): one group, and no empty one on the CPU
        return clip_grad_norm(scorer or rest, max_norm)
    return torch.linalg.vector_norm(torch.stack([clip_grad_norm(rest, max_norm), clip_grad_norm(scorer, max_norm)]))


@torch.no_grad()
def normalize_scorers(model: nn.Module) -> None:
    """train.scorer_unit_norm: each SparseK scoring vector (a row of `*scorer.weight` [G, d]) back to length 1.
    Under TimestepNorm the scores do not depend on the length (up to its epsilon), so this changes no output; it
    keeps the gradient, which scales as 1 / length, from growing as the vector shrinks."""
    for p in scorer_split(model.named_parameters())[0]:
        p.div_(torch.linalg.vector_norm(p, dim=-1, keepdim=True).clamp(min=1e-12))


def scorer_split(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the SparseK scoring vectors, every other parameter) of named parameters, by SCORE_PARAMS."""
    scorer, rest = [], []
    for name, p in named:
        (scorer if fnmatchcase(name, SCORE_PARAMS) else rest).append(p)
    return scorer, rest


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (0 turns clipping off); returns the norm before clipping, a 0-d
    tensor on the gradients' device (reading it is a host sync: the trainer does so at its log lines).

    With FSDP the gradients are shards (DTensors): their norm is a partial sum that `full_tensor`
    completes over the ranks, so every rank clips by the norm of the whole gradient.
    """
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if hasattr(total, "full_tensor"):  # a DTensor
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
