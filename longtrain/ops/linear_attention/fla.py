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
    return num, linear_denominator(phq, phk, state_k)


def linear_denominator(
    phq: torch.Tensor,  # [B, L, H, F]
    phk: torch.Tensor,  # [B, L, Hkv, F]
    state_k: torch.Tensor,  # [B, Hkv, F]
) -> torch.Tensor:
    """den [B, L, H] float32: phi(q_i) . (state_k + sum_{j <= i} phi(k_j)). The prefix sum runs along the
    last, contiguous dimension: torch's scan along an outer dimension took 1.5 ms per call for [4, 4096, 12, 64]
    on an H100 (36 ms of a 403 ms step, forward and backward; benchmarks/README.md), and over the key heads,
    before they are repeated for the query heads of their group."""
    B, L, H, Fd = phq.shape
    Hkv = phk.shape[2]
    z = phk.float().permute(0, 2, 3, 1).contiguous().cumsum(-1)  # [B, Hkv, F, L]
    z = z.permute(0, 3, 1, 2) + state_k[:, None].float()  # [B, L, Hkv, F]
    # elementwise and a sum, not an einsum (a batched matmul with one output column): with the einsum, two
    # gemmk1 kernels of 4.8 ms a step appeared in the H100 profile; not yet profiled this way
    return (phq.float().view(B, L, Hkv, H // Hkv, Fd) * z[:, :, :, None]).sum(-1).reshape(B, L, H)
