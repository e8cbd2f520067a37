"""A/B of the SparseK kernels between commits: core fwd and fwd+bwd (do_bench ms) at T = 4k, 16k, 64k.

    mkdir -p /tmp/old /tmp/new
    git archive OLD_REV | tar -x -C /tmp/old; git archive NEW_REV | tar -x -C /tmp/new
    (cd /tmp/old && PYTHONPATH=/tmp/old python /tmp/new/benchmarks/kernels_ab.py old /tmp/old)
    (cd /tmp/new && PYTHONPATH=/tmp/new python /tmp/new/benchmarks/kernels_ab.py new /tmp/new fwd.num_stages=3)

argv: a tag, the checkout whose benchmarks/attention.py and longtrain/ run, then optional
settings: D=128 (the head dim, 64 by default), triton_core globals NAME=int, launch settings
kernel.key=int (LAUNCH[D], e.g. fwd.num_warps=8; kernel.key=none removes the setting). Same inputs
per T (seeded); H = 12, k = w = 512, bf16, 16k tokens per batch (attention.sk_case: checkouts from
commit b916443 on; walk/band settings from cefde89 on). Run each side twice, alternating, in one
device call: compare only within it.
"""
import json
import sys

sys.path.insert(0, sys.argv[2] + "/benchmarks")
import attention as A  # noqa: E402

opts = dict(opt.split("=") for opt in sys.argv[3:])  # e.g. D=128 fwd.num_warps=8 POOL_SEGMENT=16
D = int(opts.pop("D", 64))
if opts:
    A.apply_settings({n: A._ABSENT if x == "none" else int(x) for n, x in opts.items()}, D)
tag = " ".join([sys.argv[1]] + sys.argv[3:])

res = {}
for T in (4096, 16384, 65536):
    c = A.sk_case(T, D, seed=T)
    res[T] = dict(fwd=round(A.bench(c.fwd), 4), fb=round(A.bench(c.fwd_bwd), 4))
    print(tag, T, res[T], flush=True)
    del c
print("AB", tag, json.dumps(res))
