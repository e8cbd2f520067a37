"""The RoPE rotation itself (model/rope.py makes its angles): the model applies it to q and k, and the linear types'
phi, under attention.linear_rope unrotated, takes it back (ops/sparsek_attention/linear.py's rotated_back)."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (GPT-NeoX / Llama layout) on the first R = 2·cos.shape[-1] dims of x [B, L, H, D]."""
    c, s = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)  # [B, L, 1, R/2]
    R = 2 * c.shape[-1]
    x1, x2 = x[..., : R // 2], x[..., R // 2 : R]
    rotated = [x1 * c - x2 * s, x2 * c + x1 * s]
    return torch.cat(rotated if R == x.shape[-1] else [*rotated, x[..., R:]], dim=-1)  # partial: the rest passes
