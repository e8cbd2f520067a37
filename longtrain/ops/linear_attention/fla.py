"""Causal linear attention on the GPU with flash-linear-attention's chunked kernels (the `fla-core`
package, optional extra `linear`): the same signature and results as naive.causal_linear_attention_naive.

fla's `chunk_linear_attn` computes the numerator with an initial state (its kernels take q, k, v of
one head count, so the key heads are repeated per query head); the denominator is one cumulative sum
of phi(k), done here in PyTorch.
"""

from __future__ import annotations

import torch


def fla_available() -> bool:
    try:
        from fla.ops.linear_attn import chunk_linear_attn  # noqa: F401
    except ImportError:
        return False
    return True


def causal_linear_attention_fla(
    phq: torch.Tensor,  # [B, L, H, F]
    phk: torch.Tensor,  # [B, L, Hkv, F]
    v: torch.Tensor,  # [B, L, Hkv, D]
    state_kv: torch.Tensor,  # [B, Hkv, F, D]
    state_k: torch.Tensor,  # [B, Hkv, F]
    block: int = 64,  # unused: fla picks its own chunk size
) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.linear_attn import chunk_linear_attn

    R = phq.shape[2] // phk.shape[2]
    kr, vr = phk.repeat_interleave(R, 2), v.repeat_interleave(R, 2)  # [B, L, H, .]
    init = state_kv.repeat_interleave(R, 1).float()  # [B, H, F, D]
    num, _ = chunk_linear_attn(phq, kr, vr, scale=1.0, initial_state=init, output_final_state=False, normalize=False)
    z = state_k[:, None].repeat_interleave(R, 2).float() + kr.float().cumsum(1)  # [B, L, H, F]
    den = (phq.float() * z).sum(-1)  # [B, L, H]
    return num, den
