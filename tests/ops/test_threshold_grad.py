"""tau's gradient (selection/threshold.py): the two-launch Triton version against the torch reference, on the CPU
through Triton's interpreter (and on the GPU where there is one), and the reference against the definition."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

pytest.importorskip("triton")

from longtrain.ops.selection.threshold import threshold_grad_torch  # noqa: E402
from longtrain.ops.selection.threshold_triton import threshold_grad_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def case(B, L, seed, *, integer_weights=False):
    """Scores, the scan's taus (non-decreasing but for a few float64 ulps, as prefix sums leave them), |A|, lengths
    and g_tau. integer_weights: |A| = 1 and whole-number g_tau, so every prefix sum is exact in float64."""
    gen = torch.Generator().manual_seed(seed)
    u = (torch.randn(B, L, generator=gen) + torch.arange(L) * 2e-3).float()  # [B, L]
    tau = (torch.randn(B, L, generator=gen, dtype=torch.float64) * 0.5).cumsum(1).abs().sort(1).values / L * 40 - 1
    tau[:, 5::7] -= 1e-15  # small dips that the running max takes out
    if L >= 60:  # keys exactly at a tau, and at tau + 1: the interval's closed and open ends
        tau[0, 10:30] = u[0, 3].double()
        tau[0, 40:60] = u[0, 4].double() - 1
    n_active = torch.randint(0, 9, (B, L), generator=gen)
    n_active[:, ::5] = 0  # queries with nothing active: no weight
    g_tau = torch.randn(B, L, generator=gen)
    if integer_weights:
        n_active = torch.ones_like(n_active)
        g_tau = torch.randint(-4, 5, (B, L), generator=gen).float()
    lengths = torch.tensor([L] + [max(1, L - 37 * (b + 1)) for b in range(B - 1)])
    return [t.to(DEV) for t in (u, tau, n_active, lengths, g_tau)]


@pytest.mark.parametrize("B,L,window", [(1, 1, 0), (2, 100, 3), (3, 1500, 64), (2, 2049, 0)])
def test_the_kernels_equal_the_torch_gradient(B, L, window):
    args = case(B, L, seed=L)
    fast = threshold_grad_triton(*args, window)
    ref = threshold_grad_torch(*args, window)
    assert fast.dtype == ref.dtype == torch.float32 and fast.shape == (B, L)
    assert torch.allclose(fast, ref, rtol=1e-6, atol=1e-6)  # float32 results of float64 sums in another order
    if L > 1:
        assert ref.abs().sum() > 0  # some keys are active somewhere
    exact = case(B, L, seed=L + 1, integer_weights=True)  # exact sums: the same intervals show bit for bit
    assert torch.equal(threshold_grad_triton(*exact, window), threshold_grad_torch(*exact, window))


def test_the_torch_gradient_is_the_definition():
    """g_u_j = sum over valid queries i >= j + window with tau_i < u_j < tau_i + 1 of g_tau_i / |A_i|, by loops; row 0's
    taus pass exactly through u_3 - 1 and u_3, where key 3 is not active (both ends are open)."""
    u, tau, n_active, lengths, g_tau = (t.cpu() for t in case(2, 90, seed=7))
    a = u[0, 3].double() - 1  # exact: u is float32
    tau[0] = torch.linspace(float(a) - 0.5, float(a) + 1.5, 90, dtype=torch.float64)
    tau[0, 20:25], tau[0, 60:65] = a, a + 1
    n_active[0, 15:70] = 1
    window = 4
    got = threshold_grad_torch(u, tau, n_active, lengths, g_tau, window)
    want = torch.zeros(2, 90, dtype=torch.float64)
    for b in range(2):
        up = tau[b].cummax(0).values
        for j in range(90):
            for i in range(j + window, int(lengths[b])):
                if n_active[b, i] > 0 and up[i] < u[b, j] < up[i] + 1:
                    want[b, j] += g_tau[b, i].double() / n_active[b, i]
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    assert (want != 0).sum() > 20
    ends = g_tau[0, 20:25].sum() + g_tau[0, 60:65].sum()  # what key 3 would get if either end were closed
    assert abs(float(ends)) > 1e-3  # (so the check above tells open ends from closed ones)
    fast = threshold_grad_triton(*(t.to(DEV) for t in (u, tau, n_active, lengths, g_tau)), window)
    assert torch.allclose(fast.cpu(), got, rtol=1e-6, atol=1e-6)
