"""GPU checks of the Triton kernels (skipped without CUDA): bf16/fp16 at realistic shapes against the
naive core in float32, relative RMS <= 5e-3 on o, dq, dk, dv, du, dtau, with NaN-poisoned buffers; and a
chunk call on the default CUDA path without a host synchronisation."""

import pytest
import torch

from longtrain.ops.sparsek_attention.kernel_check import CHECKS, check

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@pytest.mark.parametrize("case", CHECKS)
def test_kernels_match_float32_reference(case):
    errs = check(**case)
    bad = {n: e for n, e in errs.items() if not e <= 5e-3}  # NaN fails too
    assert not bad, f"{case}: {errs}"


def test_chunk_call_makes_no_host_sync():
    """The default CUDA path of a chunk call (device scan, Triton kernels, next cache), forward and backward,
    runs under torch's sync debug mode set to raise (tests/ops/test_host_sync.py is its CPU twin)."""
    from longtrain.ops.sparsek_attention import SparseKCache, sparsek_attention_chunk

    torch.manual_seed(0)
    B, L, H, D, k, w = 2, 1024, 4, 64, 64, 64
    q, kk, v = (torch.randn(B, 2 * L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    u = torch.randn(B, 2 * L, device="cuda", requires_grad=True)
    lengths = torch.tensor([L, L - 100], device="cuda")

    def chunk(cache, s):
        o, cache, _ = sparsek_attention_chunk(q[:, s], kk[:, s], v[:, s], u[:, s], cache, lengths=lengths)
        o.float().square().sum().backward()
        return cache

    cache = chunk(SparseKCache.empty(B, k, w, H, D, dtype=torch.bfloat16, device="cuda"), slice(0, L))  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache = chunk(cache, slice(L, 2 * L))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.seen.tolist() == [2 * L, 2 * L - 200]
