"""The memory traffic of a chunk op's PyTorch glue: every tensor that the torch operations around the kernels write
in one chunk's forward + backward, by source line, in units of one [B, L, H, D] tensor of the inputs' dtype.

    python benchmarks/op_traffic.py [--rows 2 --tokens 512 --heads 4 --head-dim 32 --budget 64] [--top 25]

The glue (key layout, feature maps, linear sums' inputs, casts, gradient buffers and their sums) runs as many
small memory-bound kernels on a GPU, where its time is about the bytes it moves; this counts them on the CPU,
so a change to the glue can be measured without a GPU (issue 38: SparseK+Linear+SW's copies took ~20 ms of a
12 x 768 step). Counted: the outputs of every aten operation that writes memory (views and uninitialised
allocations excluded), outside the Triton kernels (run by the interpreter) and outside the causal linear sums
(fla's kernels on the GPU; here a stand-in with their shapes). The op runs from the cache that two earlier chunks
of random keys left, as in a fit. Writes nothing; prints a table per op.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import: the kernels run on the CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# aten operations that write no memory: views, and allocations whose bytes the next writer counts
NO_WRITE = {"permute", "view", "squeeze", "unsqueeze", "transpose", "slice", "_unsafe_view", "detach", "alias",
            "expand", "t", "select", "split", "unbind", "as_strided", "empty", "empty_like", "new_empty",
            "empty_strided", "_reshape_alias", "lift_fresh"}


class Uncounted:
    """A context (re-entrant) inside which nothing is counted: the kernels and the linear sums' stand-in."""

    depth = 0

    def __enter__(self):
        Uncounted.depth += 1

    def __exit__(self, *exc):
        Uncounted.depth -= 1


class WriteCounter(TorchDispatchMode):
    """Bytes written per (aten op, the innermost longtrain source line that called it, as path:line under
    longtrain/; 'autograd' in backward)."""

    def __init__(self):
        super().__init__()
        self.rows: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if Uncounted.depth or name in NO_WRITE:
            return out
        written = sum(t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else [out])
                      if isinstance(t, torch.Tensor))
        frames = [f for f in traceback.extract_stack() if "/longtrain/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/longtrain/', 1)[1]}:{frames[-1].lineno}" if frames else "autograd"
        self.rows[(name, where)][0] += 1
        self.rows[(name, where)][1] += written
        return out


class _LinearSumsStandIn(torch.autograd.Function):
    """causal_linear_attention's outputs and gradients with their shapes, computing nothing (fla's on the GPU)."""

    @staticmethod
    def forward(ctx, phq, phk, v, state_kv, state_k):
        ctx.like = [(x.shape, x.dtype) for x in (phq, phk, v, state_kv, state_k)]
        B, L, H, _ = phq.shape
        return phq.new_zeros(B, L, H, v.shape[-1], dtype=torch.float32), phq.new_ones(B, L, H, dtype=torch.float32)

    @staticmethod
    def backward(ctx, dnum, dden):
        return tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in ctx.like)


def uncount_kernels_and_linear_sums() -> None:
    import triton.runtime.interpreter as interpreter

    from longtrain.ops.sparsek_attention import linear as linear_op

    launch = interpreter.GridExecutor.__call__

    def quiet_launch(self, *a, **kw):
        with Uncounted():
            return launch(self, *a, **kw)

    def linear_sums(phq, phk, v, state_kv, state_k, backend="auto"):
        with Uncounted():
            return _LinearSumsStandIn.apply(phq, phk, v, state_kv, state_k)

    interpreter.GridExecutor.__call__ = quiet_launch
    linear_op.causal_linear_attention = linear_sums


def measure(op: str, B: int, L: int, H: int, D: int, K: int, dtype: torch.dtype = torch.bfloat16) -> WriteCounter:
    """The counter after one chunk of `op` (sparsek+sw or sparsek+linear+sw, Triton cores), forward + backward."""
    from longtrain.ops.sparsek_attention.cache import SparseKCache
    from longtrain.ops.sparsek_attention.linear import SparseKLinearCache, sparsek_linear_attention_chunk
    from longtrain.ops.sparsek_attention.op import sparsek_attention_chunk

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, L, H, D, dtype=dtype, requires_grad=True) for _ in range(3))
    u = torch.randn(B, L, requires_grad=True)
    phi = (torch.eye(D) + 0.1 * torch.randn(H, D, D)).requires_grad_()  # [Hkv, D, F]
    if op == "sparsek+linear+sw":
        cache = SparseKLinearCache.empty(B, K, K, H, D, dtype=dtype, features=D)
        chunk, extra, leaves = sparsek_linear_attention_chunk, (phi,), (q, k, v, u, phi)
    elif op == "sparsek+sw":
        cache = SparseKCache.empty(B, K, K, H, D, dtype=dtype)
        chunk, extra, leaves = sparsek_attention_chunk, (), (q, k, v, u)
    else:
        raise SystemExit(f"unknown op {op!r}: sparsek+sw or sparsek+linear+sw")
    with torch.no_grad(), Uncounted():
        for _ in range(2):
            cache = chunk(*(torch.randn_like(x) for x in (q, k, v, u)), *extra, cache, backend="triton")[1]
    counter = WriteCounter()
    do = torch.randn_like(q)  # [B, L, H, D] the output's gradient
    with counter:
        o = chunk(q, k, v, u, *extra, cache, backend="triton")[0]
        torch.autograd.grad(o, leaves, do)
    return counter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64, help="k = w")
    ap.add_argument("--ops", default="sparsek+sw,sparsek+linear+sw")
    ap.add_argument("--top", type=int, default=25, help="rows printed per op")
    a = ap.parse_args()
    uncount_kernels_and_linear_sums()
    unit = a.rows * a.tokens * a.heads * a.head_dim * 2  # one [B, L, H, D] bfloat16 tensor
    print(f"B {a.rows}, L {a.tokens}, H = Hkv {a.heads}, D = F {a.head_dim}, k = w {a.budget}, bfloat16; "
          f"unit: one [B, L, H, D] tensor ({unit} B)")
    for op in a.ops.split(","):
        rows = measure(op, a.rows, a.tokens, a.heads, a.head_dim, a.budget).rows
        total = sum(b for _, b in rows.values())
        print(f"\n{op}: {total / unit:.1f} units written by {sum(n for n, _ in rows.values())} operations")
        print("| units | ops | aten op | where |\n|---|---|---|---|")
        for (name, where), (n, b) in sorted(rows.items(), key=lambda r: -r[1][1])[:a.top]:
            print(f"| {b / unit:.2f} | {n} | {name} | {where} |")


if __name__ == "__main__":
    main()
