import pytest
import torch

from longtrain.ops import sparsek_threshold
from longtrain.ops.selection import prefix_thresholds


def from_scratch(u, k, w):
    """theta and tau of every prefix, recomputed independently with the operator and a sort.

    Where sum_j clamp(u_j - tau, 0, 1) is flat at k, tau is not unique (p is): both pick the
    smallest, up to rounding, so tests compare the projections p that tau implies.
    """
    B, T = u.shape
    theta = torch.full((B, T), -float("inf"), dtype=torch.float64)
    tau = torch.full((B, T), -float("inf"), dtype=torch.float64)
    for i in range(T):
        c = i - w + 1
        if c >= k > 0:
            theta[:, i] = torch.topk(u[:, :c], k).values[:, -1]
        if c > k:
            tau[:, i] = sparsek_threshold(u[:, :c], k)
    return theta, tau


def close(a, b, atol):
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    return bool(torch.where(both_inf, True, (a - b).abs() <= atol).all())


@pytest.mark.parametrize("T,k,w", [(300, 7, 5), (257, 1, 0), (200, 40, 13), (64, 100, 3), (4096, 16, 32)])
def test_equals_recomputation_on_every_prefix(T, k, w):
    u = torch.randn(2, T, dtype=torch.float64) * 2 + torch.arange(T) * 1e-3
    r = prefix_thresholds(u, k, w)
    theta, tau = from_scratch(u, k, w)
    assert close(r.theta, theta, 0.0)
    assert close(r.tau, tau, 1e-6)
    for i in range(w + k, T, 7):  # the projection each tau implies
        z = u[:, : i - w + 1]
        assert torch.allclose((z - r.tau[:, i, None]).clamp(0, 1), (z - tau[:, i, None]).clamp(0, 1), atol=1e-9)
    assert not r.state.overflowed
    # theta_pos points at a score equal to theta (the k-th largest by value, then position)
    i = torch.arange(T)[None].expand(2, T)
    has = r.theta_pos >= 0
    assert torch.equal(u.gather(1, r.theta_pos.clamp(min=0))[has], r.theta[has])
    assert (r.theta_pos[has] <= (i - w)[has]).all()


def test_ties_go_to_the_larger_position():
    u = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    r = prefix_thresholds(u, 2, 1)
    # query 5 has candidates 0..4, all tied: the top-2 are positions 4 and 3, theta is position 3
    assert r.theta_pos[0, 5] == 3


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("k,w", [(8, 0), (8, 16), (30, 3)])
def test_chunked_equals_one_pass(chunk, k, w):
    u = torch.randn(3, 777, dtype=torch.float64)
    whole = prefix_thresholds(u, k, w)
    state, parts = None, []
    for s in range(0, 777, chunk):
        r = prefix_thresholds(u[:, s : s + chunk], k, w, state=state)
        state = r.state
        parts.append((r.theta, r.theta_pos, r.tau, r.n_active))
    for got, want in zip(zip(*parts), (whole.theta, whole.theta_pos, whole.tau, whole.n_active)):
        assert torch.equal(torch.cat(got, 1), want)


def test_overflow_is_reported_not_silent():
    # Scores packed into a band of width < 1 keep many fractional entries above tau.
    u = torch.rand(1, 3000, dtype=torch.float64) * 0.5
    r = prefix_thresholds(u, 4, 0, cap=8)
    assert r.state.overflowed
    assert not prefix_thresholds(u, 4, 0).state.overflowed
