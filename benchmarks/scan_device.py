"""The selection scan on the GPU (wavelet, scan_device.py) against the compiled CPU heaps (numba).

    python benchmarks/scan_device.py [--json benchmarks/scan_device.json] [--profile]

Scores as benchmarks/scan.py: u ~ N(0, 1) + 1e-3 * i, k = w = 512, query blocks of 64, a fresh
cache, rows x tokens per call as the trainer calls it. Times are medians of 5 warm calls, with the
device synchronised; the host column includes the copies to and from the CPU, as the op pays them;
"graph" replays the scan as one CUDA graph (the default), "eager" launches op by op.
Each row also checks the two scans agree: theta and the block pools exactly, tau to rounding.
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

from longtrain.ops.selection import SelectionState, lay_out_scores, select
from longtrain.ops.selection import device as scan_device
from longtrain.ops.selection.device import scan_chunk_device

K = W = 512
BLOCK = 64


def inputs(B: int, T: int, dev: str):
    """A chunk's keys in the extended layout after a fresh state, and the state."""
    rng = np.random.default_rng(T + B)
    u = torch.from_numpy(rng.normal(size=(B, T)) + np.arange(T) * 1e-3).float().to(dev)
    state = SelectionState.empty(B, K, W, device=dev)
    return lay_out_scores(state, u), state


def device_scan(keys, state):
    return scan_chunk_device(keys, state, window=W, block=BLOCK)


def timed(fn, repeats=5):
    fn()  # warm (compiles the kernel once)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def profile(dev: str) -> None:
    """Top CUDA kernels of one eager scan (no graph, so the profiler sees each kernel's device time)."""
    scan_device.CUDA_GRAPHS = False
    for B, T in ((1, 4096), (1, 16384)):
        keys, state = inputs(B, T, dev)
        call = lambda: device_scan(keys, state)  # noqa: E731
        call()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            call()
            torch.cuda.synchronize()
        print(f"profile {B} x {T} (eager)")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"))
    ap.add_argument("--profile", action="store_true", help="only print the top CUDA kernels of one eager call at 4k and 16k")
    a = ap.parse_args()
    dev = "cuda"
    if a.profile:
        return profile(dev)
    rows = []
    for B, T in ((1, 4096), (4, 4096), (1, 16384), (8, 16384), (1, 65536), (1, 262144)):
        keys, state = inputs(B, T, dev)
        dev_ms, d = timed(lambda: device_scan(keys, state))
        scan_device.CUDA_GRAPHS = False
        eager_ms, _ = timed(lambda: device_scan(keys, state))
        scan_device.CUDA_GRAPHS = True
        host_ms, h = timed(lambda: select(keys, state, window=W, block=BLOCK, scan="host"), repeats=3)
        fin = torch.isfinite(h.tau)
        rows.append({
            "rows": B, "tokens": T, "host_ms": host_ms, "device_ms": dev_ms, "device_eager_ms": eager_ms, "speedup": host_ms / dev_ms,
            "theta_equal": bool(torch.equal(d.theta_u, h.theta_u) and torch.equal(d.theta_pos, h.theta_pos)),
            "pools_equal": bool(torch.equal(d.block_pool.sort(-1).values, h.block_pool.sort(-1).values)
                                and torch.equal(d.final_pool, h.final_pool)),
            "fingerprints_equal": bool(torch.equal(d.fingerprint, h.fingerprint)),
            "n_active_equal": float((d.n_active == h.n_active).double().mean()),
            "max_abs_tau_diff": float((d.tau[fin] - h.tau[fin]).abs().max()) if fin.any() else 0.0,
        })
        print(rows[-1], flush=True)
    table = Table(title=f"selection scan: GPU wavelet vs CPU heaps (numba), k = w = {K}, blocks of {BLOCK} "
                        f"({torch.cuda.get_device_name()})")
    for col in ("rows x tokens", "CPU heaps ms", "GPU ms (graph)", "GPU ms (eager)", "speed-up", "theta, pools, fp equal",
                "max |dtau|"):
        table.add_column(col, justify="right")
    for r in rows:
        same = r["theta_equal"] and r["pools_equal"] and r["fingerprints_equal"]
        table.add_row(f"{r['rows']} x {r['tokens']:,}", f"{r['host_ms']:.2f}", f"{r['device_ms']:.2f}",
                      f"{r['device_eager_ms']:.2f}",
                      f"{r['speedup']:.1f}x", "yes" if same else "NO", f"{r['max_abs_tau_diff']:.1e}")
    Console(width=160).print(table)  # wide: the table stays one line a row in logs
    a.json.write_text(json.dumps({"k": K, "w": W, "block": BLOCK, "device": torch.cuda.get_device_name(),
                                  "results": rows}, indent=2))

if __name__ == "__main__":
    main()
