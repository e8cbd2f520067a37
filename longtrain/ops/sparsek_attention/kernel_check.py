"""The Triton kernels against the naive core in float32 at realistic shapes, bf16 / fp16 with NaN-poisoned outputs.

Used by tests/gpu/test_kernels_gpu.py and by benchmarks/attention.py's correctness pass (and its timing, which
runs the same prepared inputs); needs CUDA and Triton to run, nothing to import. The inputs come from the op's
own stages: lay_out_keys and select on a fresh cache.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from longtrain.ops.sparsek_attention import SparseKCache, attend, lay_out_keys, select

H, K, W, G = 12, 512, 512, 64
TOKENS = 16384


def prepare(q, k, v, u, *, topk, window, block=G):
    """The op's first two stages on a fresh cache: the extended layout and the selection scan (the GPU scan
    on CUDA, as the op picks it), run twice (the first compiles); returns (keys, scan, the second's seconds)."""
    for _ in range(2):
        cache = SparseKCache.empty(k.shape[0], topk, window, k.shape[2], k.shape[3], dtype=k.dtype,
                                   score_dtype=u.dtype, device=q.device)
        if q.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        keys = lay_out_keys(cache, k, v, u)
        scan = select(keys, cache, window=window, block=block)
        if q.is_cuda:
            torch.cuda.synchronize()
    return keys, scan, time.perf_counter() - t0


def leaves(q, keys, scan, dtype=None):
    """Detached differentiable copies of the core's float inputs: q, the keys' k, v and u, and tau (q, k and v
    in `dtype` if given). Returns (q, keys, tau); their gradients are the core's."""
    def leaf(x, cast=True):
        x = x.detach()
        return (x.to(dtype) if cast and dtype is not None else x).clone().requires_grad_()

    keys = replace(keys, k=leaf(keys.k), v=leaf(keys.v), u=leaf(keys.u, cast=False))
    return leaf(q), keys, leaf(scan.tau.to(keys.u.dtype), cast=False)


def grads_of(q, keys, tau):
    return [q, keys.k, keys.v, keys.u, tau]


def core(q, keys, scan, tau, *, window, variant, backend):
    """Stage 3, the attention core alone, on the prepared inputs."""
    return attend(q, keys, scan, tau, window=window, variant=variant, block=G, backend=backend)


def rel_rms(x, ref):
    err = torch.linalg.vector_norm(x.float() - ref.float())
    return (err / torch.linalg.vector_norm(ref.float()).clamp(min=1e-30)).item()


def check(T=4096, B=1, Hq=12, Hkv=12, D=64, topk=K, window=W, variant="hard_k_soft_v", dtype=torch.bfloat16, seed=0,
          dev="cuda"):
    """Relative RMS errors of o, dq, dk, dv, du, dtau: bf16 kernels vs the naive core in float32."""
    torch.manual_seed(seed)
    q = torch.randn(B, T, Hq, D, device=dev, dtype=dtype)
    k = torch.randn(B, T, Hkv, D, device=dev, dtype=dtype)
    v = torch.randn(B, T, Hkv, D, device=dev, dtype=dtype)
    u = torch.randn(B, T, device=dev) + torch.arange(T, device=dev) * 1e-4
    keys, scan, _ = prepare(q, k, v, u, topk=topk, window=window)
    from longtrain.ops.sparsek_attention import triton_core  # needs Triton

    triton_core.POISON = True
    try:
        a = leaves(q, keys, scan)
        o = core(*a[:2], scan, a[2], window=window, variant=variant, backend="triton")
        do = torch.randn_like(o)
        o.backward(do)
    finally:
        triton_core.POISON = False
    r = leaves(q, keys, scan, torch.float32)
    with torch.device(dev):  # naive.block_key_indices builds its band on the default device
        o_ref = core(*r[:2], scan, r[2], window=window, variant=variant, backend="naive")
    o_ref.backward(do.float())
    names = ["o", "dq", "dk", "dv", "du", "dtau"]
    got = [o] + [x.grad for x in grads_of(*a)]
    want = [o_ref] + [x.grad for x in grads_of(*r)]
    errs = {}
    for n, x, y in zip(names, got, want):
        errs[n] = float("nan") if not torch.isfinite(x).all() else rel_rms(x, y)
    return errs


CHECKS = [
    dict(T=4096, variant="hard_k_soft_v"),
    dict(T=3000, Hq=12, Hkv=4, D=128, variant="soft_kv"),  # GQA, D = 128, T not a multiple of 64
    dict(T=2500, variant="straight_through", dtype=torch.float16),
    dict(T=2048, B=2, topk=0, window=W),  # sliding window only
    dict(T=2048, topk=K, window=0, variant="soft_kv"),  # SparseK only
]


