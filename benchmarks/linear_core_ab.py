"""Launch settings of the SparseK+Linear+SW Triton core (linear_triton.LAUNCH), and the naive core, timed on one
chunk of the op, forward + backward (issue 38): the chunk op as the model calls it, so the numbers include the
selection scan, the key layout and the causal linear sums that every setting shares.

    python benchmarks/linear_core_ab.py --out DIR                                   # LAUNCH as it is, and naive
    python benchmarks/linear_core_ab.py --out DIR --try bwd.QB=32,bwd.num_warps=4 --try bwd.QB=64,bwd.BN=16

Each --try is one variant of LAUNCH[D] (kernel.field=value, comma-separated); the first row is LAUNCH unchanged.
The shape is fit_throughput's 12 x 768 case: bf16, 4 rows x 4096 tokens, 12 heads of 64, k = w = 512 (against
SparseK+SW's own chunk op in the same run), continuing from the cache that --warm-chunks earlier chunks left (a
full pool and tail, and for the linear types a non-empty linear state, as in a fit; 0: an empty cache, as the rows
before 2026-11-27 05:00 UTC were timed). Writes DIR/linear_core_ab.json. `--small` runs tiny shapes on the
CPU (TRITON_INTERPRET=1) to check the script; its times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import triton.testing

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse(text: str) -> dict:
    """'bwd.QB=64,bwd.num_warps=8' -> {'bwd': {'QB': 64, 'num_warps': 8}}."""
    out: dict = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=", 1)
        kernel, field = name.split(".", 1)
        out.setdefault(kernel, {})[field] = int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--try", dest="tries", action="append", default=[], help="a LAUNCH variant (module doc)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512, help="k = w = budget")
    ap.add_argument("--warm-chunks", type=int, default=2, help="chunks run before the timed one, to fill the cache")
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU: checks the script")
    args = ap.parse_args()
    if args.small:
        args.rows, args.tokens, args.heads, args.head_dim, args.budget = 1, 128, 2, 16, 32
    elif not torch.cuda.is_available():
        sys.exit("linear_core_ab.py times CUDA kernels: run it on a GPU (or --small on the CPU)")
    from longtrain.ops.sparsek_attention import linear_triton as LT
    from longtrain.ops.sparsek_attention.cache import SparseKCache
    from longtrain.ops.sparsek_attention.linear import SparseKLinearCache, sparsek_linear_attention_chunk
    from longtrain.ops.sparsek_attention.op import sparsek_attention_chunk

    B, T, H, D, K = args.rows, args.tokens, args.heads, args.head_dim, args.budget
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    u = torch.randn(B, T, device=dev, requires_grad=True)
    phi = (torch.eye(D, device=dev) + 0.1 * torch.randn(H, D, D, device=dev)).requires_grad_()  # [Hkv, D, F]
    do = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    leaves = (q, k, v, u, phi)

    @torch.no_grad()
    def warmed(cache, chunk_op, *extra):  # the cache after --warm-chunks chunks of fresh random keys
        for _ in range(args.warm_chunks):
            x = [torch.randn_like(t) for t in (q, k, v, u)]
            cache = chunk_op(*x, *extra, cache, backend="triton")[1]
        return cache

    lin_start = warmed(SparseKLinearCache.empty(B, K, K, H, D, dtype=torch.bfloat16, device=dev, features=D),
                       sparsek_linear_attention_chunk, phi)
    sk_start = warmed(SparseKCache.empty(B, K, K, H, D, dtype=torch.bfloat16, device=dev), sparsek_attention_chunk)

    def linear(backend: str):
        def step():
            o, _, _ = sparsek_linear_attention_chunk(q, k, v, u, phi, lin_start, backend=backend)
            torch.autograd.grad(o, leaves, do)
        return step

    def sparsek_sw():
        o, _, _ = sparsek_attention_chunk(q, k, v, u, sk_start, backend="triton")
        torch.autograd.grad(o, (q, k, v, u), do)

    key = max([x for x in LT.LAUNCH if x <= D], default=min(LT.LAUNCH))
    base = copy.deepcopy(LT.LAUNCH[key])
    rows = []

    def bench(fn) -> float:  # ms per call
        if dev.type == "cuda":
            return triton.testing.do_bench(fn, warmup=5, rep=40)
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def timed(name: str, fn) -> None:
        try:
            ms = bench(fn)
            rows.append(dict(name=name, ms=ms, tokens_per_s=B * T / ms * 1e3))
        except Exception as e:  # a setting that does not compile is a result, not the end of the run
            rows.append(dict(name=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
        print(rows[-1], flush=True)

    timed("sparsek+sw chunk op (triton)", sparsek_sw)
    timed(f"triton core, LAUNCH[{key}] {base}", linear("triton"))
    for text in args.tries:
        LT.LAUNCH[key] = copy.deepcopy(base)
        for kernel, fields in parse(text).items():
            if kernel not in base or set(fields) - set(base[kernel]):
                sys.exit(f"--try {text}: LAUNCH[{key}] has {', '.join(f'{n}.{f}' for n, c in base.items() for f in c)}")
            LT.LAUNCH[key][kernel].update(fields)
        timed(f"triton core, {text}", linear("triton"))
    LT.LAUNCH[key] = base
    timed("naive core", linear("naive"))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rows=B, tokens=T, heads=H, head_dim=D, k=K, w=K,
                warm_chunks=args.warm_chunks)
    (args.out / "linear_core_ab.json").write_text(json.dumps(dict(meta, results=rows), indent=1))


if __name__ == "__main__":
    main()
