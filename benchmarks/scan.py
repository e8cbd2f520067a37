"""The selection scan: plain-Python heaps (the reference) against the numba-compiled scan.

    python benchmarks/scan.py [--json benchmarks/scan.json]

One row of scores per call (u ~ N(0, 1) plus the paper's position slope 1e-3 * i), k = w = 512,
query blocks of 64, as the trainer calls it; the median of 3 warm runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from longtrain.ops.selection import SelectionState, lay_out_scores
from longtrain.ops.selection.host import scan_chunk_host
from longtrain.ops.selection.naive import scan_chunk_naive


def time_scan(scan, u, k, w, repeats=3) -> float:
    state = SelectionState.empty(1, k, w, score_dtype=torch.float64)  # a fresh cache
    keys = lay_out_scores(state, torch.from_numpy(u))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scan(keys, state, window=w, block=64)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"))
    a = ap.parse_args()
    k = w = 512
    time_scan(scan_chunk_host, np.zeros((1, 100)), k, w, repeats=1)  # compile (or load the cache) first
    rows = []
    for T in (16384, 65536, 262144):
        u = np.random.default_rng(0).normal(size=(1, T)) + np.arange(T) * 1e-3
        py, nb = time_scan(scan_chunk_naive, u, k, w), time_scan(scan_chunk_host, u, k, w)
        rows.append({"tokens": T, "python_ms": py * 1e3, "numba_ms": nb * 1e3, "speedup": py / nb})
    table = Table(title="selection scan, one row, k = w = 512, blocks of 64 (median of 3)")
    for col in ("tokens", "Python heaps (ms)", "numba (ms)", "speed-up"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['tokens']:,}", f"{r['python_ms']:.1f}", f"{r['numba_ms']:.2f}", f"{r['speedup']:.0f}x")
    Console().print(table)
    a.json.write_text(json.dumps({"k": k, "w": w, "block": 64, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
