"""Time and peak memory of the naive (reference) SparseK+SW forward on the CPU.

    python benchmarks/reference_forward.py [--tokens 65536] [--json benchmarks/reference_forward.json]

Defaults are the operator issue's target: B=1, H=4, D=64, k=w=256, float32, 65,536 tokens.
Peak memory is the growth of resident memory over each part, sampled every 5 ms.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from longtrain.eval.equivalence import PeakMemory
from longtrain.ops.selection import prefix_thresholds
from longtrain.ops.sparsek_attention import sparsek_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"))
    a = ap.parse_args()

    torch.manual_seed(0)
    T, H, D = a.tokens, a.heads, a.head_dim
    q, k, v = (torch.randn(1, T, H, D) for _ in range(3))
    u = torch.randn(1, T) + torch.arange(T) * 1e-3  # scores with the paper's position slope

    rows = []
    prefix_thresholds(u[:, :100], a.topk, a.window)  # load the compiled scan before timing
    with torch.no_grad():
        with PeakMemory(torch.device("cpu")) as mem:
            t0 = time.perf_counter()
            prefix_thresholds(u, a.topk, a.window)
            scan_s = time.perf_counter() - t0
        rows.append(("selection scan (CPU heaps)", scan_s, mem.bytes))
        with PeakMemory(torch.device("cpu")) as mem:
            t0 = time.perf_counter()
            o = sparsek_attention(q, k, v, u, topk=a.topk, window=a.window, backend="naive")
            fwd_s = time.perf_counter() - t0
        rows.append(("SparseK+SW forward (naive, incl. scan)", fwd_s, mem.bytes))
    assert torch.isfinite(o).all()

    table = Table(title=f"reference forward: B=1 T={T} H={H} D={D} k={a.topk} w={a.window} float32, {torch.get_num_threads()} threads")
    for col in ("what", "seconds", "peak memory (MB)"):
        table.add_column(col)
    for name, s, b in rows:
        table.add_row(name, f"{s:.2f}", f"{b / 2**20:.0f}")
    Console().print(table)
    a.json.write_text(json.dumps({
        "config": vars(a) | {"json": str(a.json), "threads": torch.get_num_threads()},
        "results": [{"what": n, "seconds": s, "peak_mem_bytes": b} for n, s, b in rows],
    }, indent=2))


if __name__ == "__main__":
    main()
