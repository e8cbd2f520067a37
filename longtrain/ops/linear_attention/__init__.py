"""Causal linear attention continuing from a state: the plain reference (naive.py, also the CPU path)
and flash-linear-attention's kernels (fla.py, CUDA, optional extra `linear`), one signature."""

from __future__ import annotations

import torch

from longtrain.ops.linear_attention.fla import causal_linear_attention_fla, fla_available
from longtrain.ops.linear_attention.naive import causal_linear_attention_naive, feature_map

BACKENDS = ("auto", "naive", "fla")


def causal_linear_attention(phq, phk, v, state_kv, state_k, *, backend: str = "auto"):
    """(num [B, L, H, D], den [B, L, H]) (naive.py); backend auto: fla on CUDA below float64 when installed and
    training. Without gradients (eval, generation's prefill, verify-equivalence) the naive sums run in float64
    (`wide`), which gives a position the same bits in any chunking; auto then takes them, not fla."""
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}; got {backend!r}")
    wide = not torch.is_grad_enabled()
    if backend == "auto":
        fast = phq.is_cuda and phq.dtype != torch.float64 and fla_available() and not wide
        backend = "fla" if fast else "naive"
    if backend == "fla":
        if not fla_available():
            raise ImportError("the fla linear backend needs flash-linear-attention: pip install 'longtrain[linear]'")
        return causal_linear_attention_fla(phq, phk, v, state_kv, state_k)
    return causal_linear_attention_naive(phq, phk, v, state_kv, state_k, wide=wide)


__all__ = ["BACKENDS", "causal_linear_attention", "causal_linear_attention_fla", "causal_linear_attention_naive",
           "feature_map", "fla_available"]
