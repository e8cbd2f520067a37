"""The decode step's Triton kernels alone, timed at a model's shapes: where a decode step's time per layer goes.

    PYTHONPATH=. python benchmarks/decode_kernels.py --out OUT_DIR        # on a GPU (under a minute)
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/decode_kernels.py --small --out /tmp/dk   # checks the script

For rows B in --batches, a cache of 12 KV heads x 64 (12 x 768's), k = w = 512 (threshold capacity 8·k = 4096) filled
with random keys and scores, one query per row: `attend_triton` with every split count in --splits (and the
count `attend_splits` picks), against `attend_torch`'s result; `admit_triton` (the candidate admission), and
the torch reference of both. Times are medians over CUDA-graph replays of 20 calls each (no launch
overhead: what the calls cost inside the decoder's whole-step graph), in microseconds per call (one layer).
Writes OUT/decode_kernels.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longtrain.ops.sparsek_attention.cache import SparseKCache, to_ring  # noqa: E402
from longtrain.ops.sparsek_attention.decode import _admit_pool, _admit_threshold, attend_torch  # noqa: E402
from longtrain.ops.sparsek_attention.decode_triton import admit_triton, attend_splits, attend_triton  # noqa: E402


# keys per block, warps, pipeline stages (--sweep)
SWEEP = [(bn, w, st) for bn in (32, 64, 128, 256) for w in (2, 4, 8) for st in (1, 2, 3, 4)]


def filled_cache(B: int, topk: int, window: int, Hkv: int, D: int, dtype, dev, seen: int) -> SparseKCache:
    """A cache as after `seen` tokens: a full pool and tail, and a consistent threshold state at tau = 0 (k/2
    saturated scores and fractional ones summing to k/2: f(tau) = k), so an admission walks as far as in a real step."""
    cache = SparseKCache.empty(B, topk, window, Hkv, D, dtype=dtype, score_dtype=torch.float32, device=dev)
    for t in (cache.pool_k, cache.pool_v, cache.tail_k, cache.tail_v):
        t.normal_()
    cache.pool_u.copy_(torch.randn(B, topk, device=dev) + 1.0)
    cache.pool_pos.copy_(torch.sort(torch.randperm(seen - window, device=dev)[:topk]).values.expand(B, -1))
    cache.seen.fill_(seen)
    cap = cache.thr_u.shape[1]
    n_sat, n_frac = topk // 2, min(cap // 2, topk + topk // 4)
    frac = torch.rand(B, n_frac, device=dev, dtype=torch.float64)
    frac = frac * ((topk - n_sat) / frac.sum(1, keepdim=True))  # sums to k - n_sat (each stays below 1)
    sat = 1.0 + 2.0 * torch.rand(B, n_sat, device=dev, dtype=torch.float64)
    above = torch.sort(torch.cat([frac, sat], 1)).values
    n = n_sat + n_frac
    cache.thr_u.fill_(float("inf"))
    cache.thr_u[:, :n] = above
    cache.thr_count.fill_(n)
    cache.tau.fill_(0.0)
    cache.thr_saturated.copy_(cache.thr_u >= 1.0)
    cache.thr_sum.copy_(torch.where(cache.thr_u < 1.0, cache.thr_u, 0.0).sum(1))
    return cache


def timed(fn, iters: int, dev, per_graph: int = 20) -> float:
    """Median device microseconds per call: `per_graph` calls captured in one CUDA graph, the replays timed
    (a call launched from Python alone would time the launch, ~20 us, not the kernel)."""
    for _ in range(3 if dev.type == "cuda" else 1):  # on the CPU (the interpreter) a call checks the script
        fn()
    if dev.type != "cuda":
        return float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(max(3, iters // per_graph)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_graph)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--splits", default="1,2,4,8,16,32")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU, under TRITON_INTERPRET=1)")
    ap.add_argument("--admit-launch", default="", help="also time the admission at these TILE/WARPS launches, e.g. "
                    "512/4,1024/8 (admit_triton's tile and num_warps; default: ADMIT_TILE and its warp rule)")
    ap.add_argument("--sweep", action="store_true", help="also time the ring-tail attention at attend_splits' count over "
                    "keys per block x warps x pipeline stages (SWEEP) and print the fastest per row count")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    H, Hkv, D, topk, window, seen = (12, 12, 64, 512, 512, 65536) if not args.small else (4, 2, 16, 16, 16, 200)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        torch.manual_seed(B)
        cache = filled_cache(B, topk, window, Hkv, D, dtype, dev, seen)
        q = torch.randn(B, H, D, device=dev, dtype=dtype)
        k, v = torch.randn(B, Hkv, D, device=dev, dtype=dtype), torch.randn(B, Hkv, D, device=dev, dtype=dtype)
        kw = dict(window=window, variant="hard_k_soft_v", scale=D**-0.5)
        want = attend_torch(q, k, v, cache, **kw).float()
        row = {"rows": B, "auto_splits": attend_splits(B, Hkv, topk, cache.tail_slots),
               "attend_torch_us": timed(lambda: attend_torch(q, k, v, cache, **kw), args.iters, dev), "attend_us": {}}
        for s in [int(x) for x in args.splits.split(",")]:
            got = attend_triton(q, k, v, cache, **kw, splits=s).float()
            row["attend_us"][s] = timed(lambda s=s: attend_triton(q, k, v, cache, **kw, splits=s), args.iters, dev)
            row.setdefault("attend_max_abs_diff", {})[s] = float((got - want).abs().max())
        # the in-place decoder's layout (Decoder(in_place=True)): the tail a ring, read at the rule's split count
        ring = to_ring(cache)
        got = attend_triton(q, k, v, ring, **kw, tail_ring=True).float()
        row["attend_ring_max_abs_diff"] = float((got - attend_torch(q, k, v, ring, **kw, tail_ring=True).float()).abs().max())
        row["attend_ring_us"] = timed(lambda: attend_triton(q, k, v, ring, **kw, tail_ring=True), args.iters, dev)
        if args.sweep:
            row["sweep_us"] = {}
            for bn, warps, stages in SWEEP if not args.small else SWEEP[:2]:
                f = lambda bn=bn, warps=warps, stages=stages: attend_triton(  # noqa: E731
                    q, k, v, ring, **kw, tail_ring=True, block_n=bn, num_warps=warps, num_stages=stages)
                err = float((f().float() - want).abs().max())
                row["sweep_us"][f"{bn}/{warps}/{stages}"] = timed(f, args.iters, dev) if err < 0.05 else f"wrong ({err})"
        cu = torch.rand(B, device=dev, dtype=torch.float64) * 3.0
        cpos = torch.full((B,), seen - window + 1, device=dev, dtype=torch.int64)
        ok = torch.ones(B, dtype=torch.bool, device=dev)
        row["admit_us"] = timed(lambda: admit_triton(cache, cu, cpos), args.iters, dev)
        want_pool = _admit_pool(cache, cache.tail_k[:, 0], cache.tail_v[:, 0], cu, cpos, ok)
        want_thr = _admit_threshold(cache, cu, cpos, ok, topk)
        for launch in [x for x in args.admit_launch.split(",") if x]:
            tile, warps = (int(y) for y in launch.split("/"))
            got, _, _ = admit_triton(cache, cu, cpos, tile=tile, num_warps=warps)  # the torch admission's results?
            row.setdefault("admit_launch_agrees", {})[launch] = bool(
                torch.equal(got["pool_pos"], want_pool["pool_pos"]) and torch.equal(got["thr_count"], want_thr["thr_count"])
                and torch.allclose(got["tau"], want_thr["tau"], atol=1e-9, rtol=0))
            row.setdefault("admit_launch_us", {})[launch] = timed(
                lambda tile=tile, warps=warps: admit_triton(cache, cu, cpos, tile=tile, num_warps=warps), args.iters, dev)
        row["admit_torch_us"] = timed(lambda: (_admit_pool(cache, cache.tail_k[:, 0], cache.tail_v[:, 0], cu, cpos, ok),
                                               _admit_threshold(cache, cu, cpos, ok, topk)), max(10, args.iters // 10), dev)
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "commit": os.environ.get("LONGTRAIN_COMMIT"), "shape": dict(H=H, Hkv=Hkv, D=D, topk=topk, window=window,
                                                                           cap=int(cache.thr_u.shape[1])), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_kernels.json").write_text(json.dumps(report, indent=1))
    print(f"\n{report['device']}, H = {H}, Hkv = {Hkv}, D = {D}, k = {topk}, w = {window}; us per call (one layer)")
    splits = list(rows[0]["attend_us"]) if rows else []
    for r in rows:
        if "sweep_us" in r:
            ok = {c: t for c, t in r["sweep_us"].items() if isinstance(t, float)}
            best = sorted(ok, key=ok.get)[:5]
            print(f"rows {r['rows']}: ring attention, fastest keys per block / warps / stages: "
                  + ", ".join(f"{c} {ok[c]:.1f} us" for c in best) + f" (default {r['attend_ring_us']:.1f})")
    print("| rows | " + " | ".join(f"attend S={s}" for s in splits)
          + " | auto S | attend, ring tail (auto S) | admit | attend (torch) | admit (torch) |")
    print("|---" * (len(splits) + 6) + "|")
    for r in rows:
        print(f"| {r['rows']} | " + " | ".join(f"{r['attend_us'][s]:.1f}" for s in splits)
              + f" | {r['auto_splits']} | {r['attend_ring_us']:.1f} | {r['admit_us']:.1f} | {r['attend_torch_us']:.1f} |"
              f" {r['admit_torch_us']:.1f} |")
        if r.get("admit_launch_us"):
            print(f"  rows {r['rows']}: admit by tile/warps: "
                  + ", ".join(f"{w} {t:.1f} us" for w, t in r["admit_launch_us"].items()))


if __name__ == "__main__":
    main()
