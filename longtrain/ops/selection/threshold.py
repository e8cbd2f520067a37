"""tau's gradient (Appendix A.3): d tau_i / d u_j = 1 / |A_i| for j in the active set A_i.

Because tau is non-decreasing, the queries whose active set holds a key j form one interval, so the
backward is a prefix sum over queries, not a scatter.
"""

from __future__ import annotations

import math

import torch

INF = math.inf


class ThresholdFn(torch.autograd.Function):
    """tau as a differentiable function of the chunk's scores u [B, L].

    Forward returns the scan's tau; backward sends dL/dtau_i to the active keys of query i with
    weight 1/|A_i|. Cached keys (previous chunks) are detached, so only this chunk's keys get a
    gradient: key c (a chunk position) is active for the queries q >= c + window with
    tau_q < u_c < tau_q + 1, one interval of queries because tau is non-decreasing.
    """

    @staticmethod
    def forward(ctx, u: torch.Tensor, tau: torch.Tensor, n_active: torch.Tensor, lengths: torch.Tensor, window: int):
        ctx.window = window
        ctx.save_for_backward(u, tau, n_active, lengths)
        return tau.to(u.dtype)

    @staticmethod
    def backward(ctx, g_tau: torch.Tensor):
        u, tau, n_active, lengths = ctx.saved_tensors
        grad = threshold_grad_torch
        if u.is_cuda:  # two launches instead of some twenty (threshold_triton.py)
            from longtrain.ops.selection.threshold_triton import threshold_grad_triton as grad
        return grad(u.detach(), tau, n_active, lengths, g_tau, ctx.window), None, None, None, None


def threshold_grad_torch(
    u: torch.Tensor,  # [B, L] the chunk's scores
    tau: torch.Tensor,  # [B, L] float64 the scan's thresholds
    n_active: torch.Tensor,  # [B, L] int64 |A_i|
    lengths: torch.Tensor,  # [B] int64 valid queries per row
    g_tau: torch.Tensor,  # [B, L] dL/dtau
    window: int,
) -> torch.Tensor:
    """dL/du [B, L] in u's dtype: g_tau_i / |A_i| summed over the queries i whose active set holds key j (the plain
    reference of threshold_triton.threshold_grad_triton, same signature)."""
    B, L = u.shape
    idx = torch.arange(L, device=u.device)
    qvalid = idx[None, :] < lengths[:, None]
    tau64 = torch.where(qvalid, tau, torch.full_like(tau, INF))  # padded queries never match
    tau64 = torch.cummax(tau64, dim=1).values  # exact arithmetic already has it sorted
    w = torch.where(n_active > 0, g_tau.to(torch.float64) / n_active.clamp(min=1), torch.zeros_like(tau64))
    w = torch.where(qvalid, w, torch.zeros_like(w))
    csum = torch.nn.functional.pad(w.cumsum(1), (1, 0))  # [B, L+1]
    u64 = u.to(torch.float64)
    start = torch.searchsorted(tau64, u64 - 1, right=True)  # first q with tau_q > u - 1
    end = torch.searchsorted(tau64, u64, right=False)  # first q with tau_q >= u
    n = lengths[:, None].expand(B, L)
    start = torch.minimum(torch.maximum(start, idx[None, :] + window), n)
    end = torch.maximum(torch.minimum(end, n), start)
    g_u = csum.gather(1, end) - csum.gather(1, start)
    return g_u.to(u.dtype)
