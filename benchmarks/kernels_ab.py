"""A/B of the SparseK kernels between commits: core fwd and fwd+bwd (do_bench ms) at T = 4k, 16k, 64k.

    mkdir -p /tmp/old /tmp/new
    git archive OLD_REV | tar -x -C /tmp/old; git archive NEW_REV | tar -x -C /tmp/new
    (cd /tmp/old && PYTHONPATH=/tmp/old python /tmp/new/benchmarks/kernels_ab.py old /tmp/old)
    (cd /tmp/new && PYTHONPATH=/tmp/new python /tmp/new/benchmarks/kernels_ab.py new /tmp/new FWD_PREFETCH=0)

argv: a tag, the checkout whose benchmarks/attention.py and longtrain/ run, then optional
triton_core settings NAME=int. Same inputs per T (seeded); H = 12, D = 64, k = w = 512, bf16, 16k
tokens per batch. Run each side twice, alternating, in one device call: compare only within it.
"""
import json
import sys

import torch

sys.path.insert(0, sys.argv[2] + "/benchmarks")
import attention as A  # noqa: E402
from longtrain.ops.attention import triton_core  # noqa: E402

for opt in sys.argv[3:]:  # e.g. FWD_PREFETCH=0 DQ_STAGES=2
    name, val = opt.split("=")
    setattr(triton_core, name, type(getattr(triton_core, name))(int(val)))
tag = " ".join([sys.argv[1]] + sys.argv[3:])

res = {}
for T in (4096, 16384, 65536):
    B = max(1, A.TOKENS // T)
    torch.manual_seed(T)
    q, k, v = (torch.randn(B, T, A.H, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    args, kw, _ = A.core_args(q, k, v, torch.randn(B, T, device="cuda"), topk=A.K, window=A.W, variant="hard_k_soft_v")
    a = A.leaves(args)
    do = torch.randn_like(q)

    def f():
        with torch.no_grad():
            triton_core.sparsek_attention_core_triton(*a, **kw)

    def fb():
        o = triton_core.sparsek_attention_core_triton(*a, **kw)
        torch.autograd.grad(o, [a[0], a[1], a[2], a[3], a[8]], do)

    res[T] = dict(fwd=round(A.bench(f), 4), fb=round(A.bench(fb), 4))
    print(tag, T, res[T], flush=True)
print("AB", tag, json.dumps(res))
