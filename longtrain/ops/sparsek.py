"""The SparseK operator: Euclidean projection onto {0 <= p <= 1, sum p = k}.

    SparseK(z, k) = argmin_{0<=p<=1, sum p = k} ||p - z||^2 = clamp(z - tau(z), 0, 1)

tau is found exactly from the sorted scores (the paper's Algorithm 1): sum_j clamp(z_j - tau, 0, 1)
is piecewise linear and non-increasing in tau with breakpoints at z_j and z_j - 1, so we evaluate it
at every breakpoint with prefix sums and solve the linear piece that crosses k. For k much smaller
than the number of scores a partial sort (top-k') suffices: the answer on the top k' scores is exact
as soon as every score left out lies at or below tau; k' doubles until that holds.

Gradients are analytic (Appendix A.3), never autograd through a sort: with the active set
A = {j : 0 < p_j < 1} and s its indicator, d tau / d z_j = s_j / |A| and J v = s * (v - mean_A v).

Conventions: entries equal to -inf are never selected (they mask variable-length sets); k <= 0
gives p = 0 (tau = max z); k >= the number of finite entries gives p = 1 on them (tau = -inf).
"""

from __future__ import annotations

import torch

__all__ = ["sparsek", "sparsek_threshold"]


def _threshold_sorted(zs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """tau for rows of ascending-sorted scores zs [N, m] (may hold -inf) and budgets k [N]."""
    n, m = zs.shape
    finite = torch.isfinite(zs)
    n_finite = finite.sum(-1)  # [N]
    z0 = torch.where(finite, zs, torch.zeros((), dtype=zs.dtype, device=zs.device))
    csum = torch.nn.functional.pad(z0.cumsum(-1), (1, 0))  # [N, m+1], csum[i] = sum of zs[:i]

    # Every breakpoint b (z_j and z_j - 1). Saturation is tested as z - 1 > b, never z > b + 1:
    # (z - 1) + 1 need not equal z in floating point, and b itself was computed as z - 1.
    zs1 = zs - 1

    def piece(b):  # the partition just above b: fractional [lo, hi), saturated [hi, m)
        lo = torch.searchsorted(zs, b, right=True)  # first index with z > b
        hi = torch.searchsorted(zs1, b, right=True)  # first index with z - 1 > b
        n_frac = (hi - lo).to(zs.dtype)
        s_frac = csum.gather(-1, hi) - csum.gather(-1, lo)
        return (m - hi).to(zs.dtype), n_frac, s_frac

    bps = torch.cat([zs, zs1], dim=-1)  # [N, 2m]
    bps = torch.where(torch.isfinite(bps), bps, torch.full_like(bps, float("inf")))
    n_sat, n_frac, s_frac = piece(bps)
    f = n_sat + s_frac - bps * n_frac  # f(b), continuous, non-increasing
    f = torch.where(torch.isfinite(bps), f, torch.full_like(f, -float("inf")))

    # b_lo: the largest breakpoint with f(b_lo) > k; tau lies on the linear piece just above it.
    # (Where f is flat at k, tau is not unique though p is; this picks the smallest tau.)
    # f(b) carries rounding of order eps * (|b| n_frac + |s_frac|): read "f > k" beyond that.
    kk = k.to(zs.dtype)[:, None]
    tol = 32 * torch.finfo(zs.dtype).eps * (1 + bps.abs() * n_frac + s_frac.abs() + n_sat)
    b_lo = torch.where(f > kk + tol, bps, torch.full_like(bps, -float("inf"))).amax(-1)  # [N]
    n1, n2, s2 = (x.squeeze(-1) for x in piece(b_lo[:, None]))
    tau = torch.where(n2 > 0, (s2 + n1 - k.to(zs.dtype)) / n2.clamp(min=1), b_lo)
    tau = torch.maximum(tau, b_lo)  # guard rounding: tau never falls below its piece

    kf = k.to(zs.dtype)
    zmax = zs[:, -1]
    tau = torch.where(kf <= 0, zmax, tau)
    tau = torch.where(kf >= n_finite.to(zs.dtype), torch.full_like(tau, -float("inf")), tau)
    return tau


def _threshold(z2: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """tau for rows z2 [N, m]; partial sort on the top k' scores while that is cheaper."""
    n, m = z2.shape
    kmax = int(k.max().item()) if k.numel() else 0
    kp = max(2 * kmax + 8, 16)
    while kp < m:
        top = torch.topk(z2, kp, dim=-1, sorted=True).values.flip(-1)  # ascending [N, k']
        tau = _threshold_sorted(top, k)
        # Exact iff every score left out has p = 0, i.e. lies at or below tau.
        if bool((top[:, 0] <= tau).all()):
            return tau
        kp *= 2
    return _threshold_sorted(torch.sort(z2, dim=-1).values, k)


def _prepare(z: torch.Tensor, k, dim: int):
    """Move dim last and flatten the batch; broadcast k to the batch."""
    zt = z.movedim(dim, -1)
    batch_shape = zt.shape[:-1]
    z2 = zt.reshape(-1, zt.shape[-1])
    kt = torch.as_tensor(k, device=z.device)
    kt = torch.broadcast_to(kt, batch_shape).reshape(-1)
    return z2, kt, batch_shape


@torch.no_grad()
def _tau(z: torch.Tensor, k, dim: int) -> torch.Tensor:
    """tau over `dim`, shaped like z without `dim`."""
    z2, kt, batch_shape = _prepare(z, k, dim)
    if z2.shape[-1] == 0:
        return torch.full(batch_shape, -float("inf"), dtype=z.dtype, device=z.device)
    return _threshold(z2, kt).reshape(batch_shape)


class _SparseKThreshold(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, k, dim: int):
        tau = _tau(z, k, dim)
        ctx.dim = dim
        ctx.save_for_backward(z, tau, torch.broadcast_to(torch.as_tensor(k, device=z.device), tau.shape))
        return tau

    @staticmethod
    def backward(ctx, g_tau: torch.Tensor):
        z, tau, k = ctx.saved_tensors
        t = tau.unsqueeze(ctx.dim)
        active = (z > t) & (z < t + 1)  # A: 0 < p < 1
        # k = 0 sets tau = max z: its derivative picks the maximum.
        active = torch.where(k.unsqueeze(ctx.dim) <= 0, z == t, active).to(z.dtype)
        n_active = active.sum(ctx.dim, keepdim=True).clamp(min=1)
        return active * (g_tau.unsqueeze(ctx.dim) / n_active), None, None


class _SparseK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, k, dim: int):
        with torch.no_grad():
            tau = _tau(z, k, dim).unsqueeze(dim)
            p = torch.where(torch.isneginf(z), torch.zeros_like(z), (z - tau).clamp(0, 1))
        ctx.dim = dim
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g_p: torch.Tensor):
        (p,) = ctx.saved_tensors
        active = ((p > 0) & (p < 1)).to(p.dtype)
        n_active = active.sum(ctx.dim, keepdim=True).clamp(min=1)
        mean_a = (active * g_p).sum(ctx.dim, keepdim=True) / n_active
        return active * (g_p - mean_a), None, None


def sparsek(z: torch.Tensor, k, dim: int = -1) -> torch.Tensor:
    """SparseK(z, k) along `dim`: p with 0 <= p <= 1, sum p = k, p = clamp(z - tau, 0, 1).

    k is an int or a tensor broadcastable to z's shape without `dim`. -inf entries get p = 0.
    """
    return _SparseK.apply(z, k, dim)


def sparsek_threshold(z: torch.Tensor, k, dim: int = -1) -> torch.Tensor:
    """The SparseK threshold tau(z, k) along `dim` (that dim removed); differentiable."""
    return _SparseKThreshold.apply(z, k, dim)
