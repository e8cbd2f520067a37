"""LoRA (Hu et al. 2021): fine-tune low-rank adapters on the frozen projections of a model (`train.lora`).

    y = W x + (alpha / rank) · B A dropout(x)      A [rank, in], B [out, rank] (B starts at 0)

`add_lora` gives each targeted nn.Linear of every block a `lora` submodule and a forward hook that adds
its output, so every existing name stays (blocks.0.attn.q_proj.weight) and the adapters appear beside
it (blocks.0.attn.q_proj.lora.a / .b / .scale). Everything else is frozen except the SparseK scoring
vectors: they are new parameters, so they train in full.

Checkpoints hold the adapters (a resumed run continues them). `merge_lora` folds them into the weights
(W + scale · B A) and drops them: load_checkpoint does so for eval, generate and export, and
train.init_from does so for a recipe without train.lora (a LoRA run's source with its own adapters
keeps them instead).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from longtrain.errors import RecipeError

# train.lora.targets -> the module of a block it names
TARGETS = {
    "q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.o_proj",
    "gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down",
}
ADAPTER_KEYS = (".lora.a", ".lora.b", ".lora.scale")


class LoRA(nn.Module):
    """The low-rank update of one linear layer: x [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, linear.in_features, device=linear.weight.device))  # [r, in]
        self.b = nn.Parameter(torch.zeros(linear.out_features, rank, device=linear.weight.device))  # [out, r]
        self.register_buffer("scale", torch.tensor(alpha / rank, device=linear.weight.device))  # kept for merge_lora
        self.drop = nn.Dropout(dropout)
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))  # as nn.Linear (and PEFT); B = 0: the model starts unchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.drop(x) @ self.a.t().to(x.dtype)) @ self.b.t().to(x.dtype) * self.scale.to(x.dtype)


def _add_adapter_output(linear: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + linear.lora(args[0])


def available_targets(model: nn.Module) -> list[str]:
    """The targets this model's blocks have (gate: SwiGLU MLPs only)."""

    def linear(path: str) -> bool:
        try:
            return isinstance(model.blocks[0].get_submodule(path), nn.Linear)
        except AttributeError:
            return False

    return [t for t, path in TARGETS.items() if linear(path)]


def add_lora(model: nn.Module, lora) -> str:
    """Adapters on `lora.targets` of every block, everything but them and the scoring vectors frozen;
    returns a line for the run's summary. `lora` is the recipe's train.lora."""
    missing = [t for t in lora.targets if t not in available_targets(model)]
    if missing:
        raise RecipeError(
            f"train.lora.targets {missing} are not projections of this {model.cfg.style} model; "
            f"it has {', '.join(available_targets(model))}"
        )
    for blk in model.blocks:
        for target in lora.targets:
            linear = blk.get_submodule(TARGETS[target])
            linear.lora = LoRA(linear, lora.rank, lora.alpha, lora.dropout)
            linear.register_forward_hook(_add_adapter_output)
    for name, p in model.named_parameters():
        p.requires_grad_(trains(name))
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora." in n)
    scores = sum(p.numel() for n, p in model.named_parameters() if n.endswith("scorer.weight"))
    total = sum(p.numel() for p in model.parameters())
    return (
        f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.targets)}: {adapters / 1e6:.2f}M adapter "
        f"parameters and {scores / 1e6:.3f}M scoring vectors train, {(total - adapters - scores) / 1e6:.2f}M are frozen"
    )


def trains(name: str) -> bool:
    """Whether a parameter learns in a LoRA run: the adapters and the SparseK scoring vectors."""
    return ".lora." in name or name.endswith("scorer.weight")


def has_adapters(state: dict) -> bool:
    return any(k.endswith(ADAPTER_KEYS) for k in state)


@torch.no_grad()
def merge_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every adapter folded into its weight (W + scale · B A, in float32 at least) and removed."""
    out = {k: v for k, v in state.items() if not k.endswith(ADAPTER_KEYS)}
    for key in state:
        if key.endswith(".lora.a"):
            prefix = key.removesuffix(".lora.a")
            a, b, scale = state[key], state[prefix + ".lora.b"], state[prefix + ".lora.scale"]
            w = out[prefix + ".weight"]
            dt = torch.promote_types(w.dtype, torch.float32)
            out[prefix + ".weight"] = (w.to(dt) + scale.to(dt) * (b.to(dt) @ a.to(dt))).to(w.dtype)
    return out
