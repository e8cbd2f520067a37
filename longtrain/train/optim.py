"""AdamW, its parameter groups and the learning-rate schedule.

Steps are counted from 1: `lr_at(step)` is the rate used by optimizer step
`step` (1..train.steps), the same number that `metrics.jsonl` and the
checkpoint directory `step-XXXXXXXX` carry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from longtrain.train.recipe import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (nanoGPT's split).

    Weights with 2+ dimensions (linear layers, embeddings) decay; biases,
    norm gains and scoring vectors do not. The for-each implementation is
    used everywhere so a resumed run takes bitwise the same steps.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=lr_at(1, cfg), betas=tuple(cfg.betas), foreach=True, fused=False
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then a cosine down to lr·min_lr_ratio."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip the global gradient norm (0 turns clipping off); returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
    return float(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))
