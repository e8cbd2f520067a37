"""Where the time of a `longtrain fit` step goes: torch.profiler around a few steps of the real Trainer.

    python benchmarks/fit_profile.py --out DIR                 # 12 x 768 llama, SparseK+SW k = w = 512, chunk 4096 x 4 rows
    python benchmarks/fit_profile.py --out DIR --set train.compile=true --set attention.type=sw ...
    python benchmarks/fit_profile.py --out DIR --small         # a tiny CPU version, to check the script
    torchrun --nproc_per_node 2 benchmarks/fit_profile.py --out DIR --set train.parallel=fsdp   # every rank profiles

It builds the same recipe and synthetic corpus as benchmarks/fit_throughput.py, runs the Trainer
in this process for --warmup steps, profiles the next --steps (the last of them reads the losses
back, as a log line does), and prints one table, per step:
  attention kernels  the op's Triton kernels (forward and backward; SDPA/flash for full attention)
  scan               the selection scan (its kernels, and the host scan on the CPU path)
  cache updates      the rest of the op: the key layout, gathers of the next cache, cache resets
  host syncs         the host waiting for the device (cudaStreamSynchronize and friends, DtoH copies)
  optimizer          clipping, AdamW, zeroing the gradients
  communication      collectives between ranks: NCCL kernels on the device; on the host, FSDP's hooks and
                     the c10d calls (ddp's one gradient all-reduce per step; gloo's collectives run there)
  matmuls            every other GEMM (projections, MLPs, the head)
  other kernels      elementwise, norms, RoPE, the loss's softmax, ...
  GPU idle           wall time minus the device's busy time: Python, launches, host work
Device time is attributed by where a kernel was launched (record_function ranges this script wraps
around longtrain's functions), falling back to the kernel's name (always, for the kernels a CUDA graph
replays: they have no launching host op; `--set train.cuda_graphs=false` attributes by range). The
ranges' own device-side spans are not kernels and are not counted (before 2026-11-24 they were,
which made "other kernels" and "device busy" too large). Writes DIR/fit_profile.json, the
top kernels and host ops as DIR/fit_profile.txt and, with --trace, DIR/fit_profile_trace.json
(a Chrome/Perfetto trace). Under torchrun every rank profiles its own steps and writes
DIR/fit_profile-rank<R>.json (and .txt); rank 0 prints its table. Takes about a minute on an H100 (most of it building the corpus and the
token cache, shared with fit_throughput.py's work folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GROUPS = ["attention kernels", "linear sums", "scan", "cache updates", "host syncs", "optimizer", "communication",
          "matmuls", "other kernels"]
# record_function ranges wrapped around longtrain's functions (module, attribute) -> group
RANGES = {
    "lt.attention_core": "attention kernels",
    "lt.scan": "scan",
    "lt.attention_op": "cache updates",
    "lt.cache": "cache updates",
    "lt.linear": "linear sums",
    "lt.optimizer": "optimizer",
}
TORCH_RANGES = {"Optimizer.step#": "optimizer", "Optimizer.zero_grad#": "optimizer"}
ATTENTION_KERNELS = re.compile(r"_fwd_kernel|_dq_kernel|_dkv_|_cut_kernel|_edge_reach|flash|fmha|efficient_attention|attention"
                               r"|^_bwd_kernel$|^_key_sum_kernel$", re.I)  # the last two: the linear types' core
LINEAR_KERNELS = re.compile(r"^chunk_\w*kernel|^fused_recurrent")  # fla's causal linear sums (a graph replays them
# unlaunched: without a range they are known by name)
SCAN_KERNELS = re.compile(r"keys_kernel|ranked_kernel|breakpoints_kernel|queries_kernel|pool_flags|pool_scan|slot_pred|slot_jump"
                          r"|expand_pools|finish_kernel")
MATMUL_KERNELS = re.compile(r"gemm|cutlass|sm90_|sm80_|xmma|cublas|matmul|nvjet|wgmma", re.I)
SYNC_CALLS = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$|^cuStreamSynchronize$|^cuCtxSynchronize$")
DTOH = re.compile(r"Memcpy DtoH|Memcpy Device -> Host|DtoH", re.I)
OPTIMIZER_KERNELS = re.compile(r"adam|multi_tensor_apply|foreach", re.I)
COMM_KERNELS = re.compile(r"nccl", re.I)
COMM_HOST = re.compile(r"^(FSDP::|c10d::|nccl:|gloo:|record_param_comms)")  # host ops of collectives (not a wrapping
# module's forward range, which would take every kernel launched inside it)


def load_fit_throughput():
    spec = importlib.util.spec_from_file_location("fit_throughput", REPO / "benchmarks" / "fit_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- ranges around longtrain


def wrap_ranges() -> list[str]:
    """Put record_function ranges around longtrain's functions (those that exist in this checkout)."""
    targets = [  # (module, class or None, function, range); names this checkout lacks are skipped
        ("longtrain.model.attention", None, "sparsek_attention_chunk", "lt.attention_op"),
        ("longtrain.model.attention", None, "sparsek_linear_attention_chunk", "lt.attention_op"),
        ("longtrain.ops.sparsek_attention.op", None, "select", "lt.scan"),  # the op's stages (ops/ layout of issue 23)
        ("longtrain.ops.sparsek_attention.op", None, "attend", "lt.attention_core"),
        ("longtrain.ops.sparsek_attention.op", None, "lay_out_keys", "lt.cache"),
        ("longtrain.ops.sparsek_attention.op", None, "next_cache", "lt.cache"),
        # the linear types' op (issue 38): its own imports of the stages, the causal linear sums and the state
        ("longtrain.ops.sparsek_attention.linear", None, "select", "lt.scan"),
        ("longtrain.ops.sparsek_attention.linear", None, "lay_out_keys", "lt.cache"),
        ("longtrain.ops.sparsek_attention.linear", None, "next_cache", "lt.cache"),
        ("longtrain.ops.sparsek_attention.linear", None, "_phi_and_beyond_window_sums", "lt.linear"),
        ("longtrain.ops.sparsek_attention.linear", None, "_add_state", "lt.linear"),
        ("longtrain.ops.sparsek_attention.linear", None, "sparsek_attention_core_naive", "lt.attention_core"),
        ("longtrain.ops.sparsek_attention.linear_triton", None, "sparsek_linear_attention_core_triton", "lt.attention_core"),
        ("longtrain.model.cache", "ModelCache", "reset_rows", "lt.cache"),
        ("longtrain.model.cache", "ModelCache", "keep_last", "lt.cache"),
        ("longtrain.train.trainer", "Trainer", "optimizer_step", "lt.optimizer"),
    ]
    wrapped = []
    for module_name, cls, attr, label in targets:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # e.g. no Triton on this machine
            continue
        owner = getattr(module, cls) if cls else module
        real = getattr(owner, attr, None)
        if real is None:
            continue

        def ranged(*args, _real=real, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _real(*args, **kwargs)

        setattr(owner, attr, ranged)
        wrapped.append(f"{module_name}.{cls + '.' if cls else ''}{attr}")
    return wrapped


# ----------------------------------------------------------------------------- attribution


def group_of_range(name: str) -> str | None:
    if name in RANGES:
        return RANGES[name]
    if COMM_HOST.search(name):
        return "communication"
    return next((g for prefix, g in TORCH_RANGES.items() if name.startswith(prefix)), None)


def innermost_group(evt) -> str | None:
    """The group of the innermost longtrain range around a host event (None outside them all)."""
    e = evt
    while e is not None:
        g = group_of_range(e.name)
        if g is not None:
            return g
        e = e.cpu_parent
    return None


def kernel_group(name: str, launched_in: str | None) -> str:
    if COMM_KERNELS.search(name):
        return "communication"
    if LINEAR_KERNELS.search(name) and launched_in in (None, "linear sums"):  # before the core's "_fwd_kernel"
        return "linear sums"
    if ATTENTION_KERNELS.search(name) and launched_in in (None, "attention kernels", "cache updates"):
        return "attention kernels"
    if SCAN_KERNELS.search(name):
        return "scan"
    if launched_in is not None:
        return launched_in
    if DTOH.search(name):
        return "host syncs"
    if OPTIMIZER_KERNELS.search(name):
        return "optimizer"
    if MATMUL_KERNELS.search(name):
        return "matmuls"
    return "other kernels"


def attribute(events, steps: int, wall_s: float) -> dict:
    """Per-step milliseconds by group: device time of kernels, host time of syncs, GPU idle."""
    device_ms, host_ms, sync_calls = defaultdict(float), defaultdict(float), Counter()
    attributed = Counter()  # kernel name -> µs already attributed through its launching host op
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    for e in cpu_events:
        g = innermost_group(e)
        if SYNC_CALLS.search(e.name):
            host_ms["host syncs"] += e.cpu_time_total / 1e3
            sync_calls[e.name] += 1
        else:
            host_ms[g or "other / Python"] += e.self_cpu_time_total / 1e3
        for k in e.kernels:
            device_ms[kernel_group(k.name, g)] += k.duration / 1e3
            attributed[k.name] += k.duration
    kernels = Counter()
    for e in events:  # kernels (and copies): not the device-side spans of the record_function ranges
        if e.device_type == DeviceType.CUDA and group_of_range(e.name) is None:
            us = e.time_range.end - e.time_range.start
            kernels[e.name] += us
    for name, us in kernels.items():  # launched without a linked host op (e.g. some Triton launches)
        rest = us - attributed.get(name, 0)
        if rest > 0:
            device_ms[kernel_group(name, None)] += rest / 1e3
    busy = sum(kernels.values()) / 1e3
    per = lambda d: {k: round(v / steps, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return {
        "steps": steps,
        "wall_ms_per_step": round(1e3 * wall_s / steps, 3),
        "device_busy_ms_per_step": round(busy / steps, 3),
        "gpu_idle_ms_per_step": round(max(1e3 * wall_s - busy, 0.0) / steps, 3) if kernels else None,
        "device_ms_per_step": per(device_ms),
        "host_ms_per_step": per(host_ms),
        "host_syncs_per_step": {k: v / steps for k, v in sync_calls.items()},
        "top_kernels_ms_per_step": {k: round(v / 1e3 / steps, 3) for k, v in kernels.most_common(60)},
    }


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3, help="steps profiled (the last one reads back, as a log line does)")
    ap.add_argument("--warmup", type=int, default=4, help="steps before the profile (compiles, autotuning, caches)")
    ap.add_argument("--width", type=int, default=768, choices=[768, 1024, 2048])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--attention", default="sparsek+sw", help="sparsek+sw | sw | sparsek | sparsek+linear+sw | linear+sw")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a recipe override, as fit's --set")
    ap.add_argument("--trace", action="store_true", help="also write a Chrome trace (large)")
    ap.add_argument("--small", action="store_true", help="a tiny CPU configuration that checks the script")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ft = load_fit_throughput()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(os.environ.get("FIT_THROUGHPUT_WORK", "/tmp/fit_throughput"))
    shapes, attentions, vocab, words, tokens = ft.SHAPES, ft.ATTENTIONS, 8192, 120_000, ft.TOKENS_PER_STEP
    if args.small:
        work = work / "small"
        shapes = {768: dict(layers=2, d_model=64, heads=2)}
        attentions = {"sparsek+sw": {"type": "sparsek+sw", "topk": 16, "window": 16}, "sw": {"type": "sw", "window": 32},
                      "sparsek": {"type": "sparsek", "topk": 32},
                      "sparsek+linear+sw": {"type": "sparsek+linear+sw", "topk": 16, "window": 16},
                      "linear+sw": {"type": "linear+sw", "window": 32}}
        args.width, args.chunk, vocab, words, tokens = 768, 128, 512, 3000, 256
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    suffix = f"-rank{rank}" if world > 1 else ""
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LONGTRAIN_CACHE", str(work / "cache"))
    corpus, tokenizer, ready = work / "corpus", work / "tokenizer.json", work / "corpus.ready"
    if rank == 0:  # one rank writes the corpus and the tokenizer; the others wait for them
        if not corpus.is_dir():
            ft.write_corpus(corpus, n_docs=max(8, 2 * world), words_per_doc=words, seed=0)
        if not tokenizer.is_file():
            ft.train_tokenizer(corpus, tokenizer, vocab)
        ready.touch()
    while not ready.exists():
        time.sleep(0.5)

    from longtrain.train.recipe import load_recipe
    from longtrain.train.trainer import Trainer

    rows = max(1, tokens // args.chunk)
    total = args.warmup + args.steps
    yaml_text = ft.recipe_yaml(shapes[args.width], attentions[args.attention], chunk=args.chunk, rows=rows, steps=total,
                               corpus=corpus, tokenizer=tokenizer, device=device)
    recipe_path = work / f"profile{suffix}.yaml"
    recipe_path.write_text(yaml_text)
    # the profiled steps end with the run's only log line (one read-back), as the steps between log lines do
    recipe = load_recipe(recipe_path, [f"logging.every={total}", *args.overrides])
    wrapped = wrap_ranges()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = torch.profiler.profile(activities=activities)
    clock = {}
    real_step = Trainer.train_step

    def step(self):
        n = self.state.step + 1
        if n == args.warmup + 1:
            if device == "cuda":
                torch.cuda.synchronize()
            prof.start()
            clock["start"] = time.perf_counter()
        record = real_step(self)
        if n == total:
            if device == "cuda":
                torch.cuda.synchronize()
            clock["end"] = time.perf_counter()
            prof.stop()
        return record

    Trainer.train_step = step
    Trainer(recipe, run_dir=work / "profile-run", resume="never").train()
    wall = clock["end"] - clock["start"]
    summary = attribute(prof.events(), args.steps, wall)
    summary |= {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rank": rank, "world_size": world,
                "recipe": yaml_text,
                "commit": os.environ.get("LONGTRAIN_COMMIT"),  # the device's copy of the tree has no git history
                "overrides": args.overrides, "ranges": wrapped, "tokens_per_step": rows * args.chunk,
                "tokens_per_s": round(rows * args.chunk * args.steps / wall, 1)}
    (args.out / f"fit_profile{suffix}.json").write_text(json.dumps(summary, indent=1))
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    (args.out / f"fit_profile{suffix}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    if args.trace:
        prof.export_chrome_trace(str(args.out / f"fit_profile_trace{suffix}.json"))
    if rank == 0:
        print_table(summary)


def print_table(s: dict) -> None:
    ranks = f" (rank {s['rank']} of {s['world_size']})" if s.get("world_size", 1) > 1 else ""
    print(f"\none step of {s['tokens_per_step']:,} tokens on {s['device']}{ranks}: {s['wall_ms_per_step']:.1f} ms wall "
          f"({s['tokens_per_s'] / 1e3:.1f}k tokens/s), device busy {s['device_busy_ms_per_step']:.1f} ms")
    print("| group | device ms/step | host ms/step |")
    print("|---|---|---|")
    dev, host = s["device_ms_per_step"], s["host_ms_per_step"]
    for g in GROUPS + ["other / Python"]:
        d, h = dev.get(g), host.get(g)
        if d is None and h is None:
            continue
        print(f"| {g} | {d if d is not None else '—'} | {h if h is not None else '—'} |")
    if s["gpu_idle_ms_per_step"] is not None:
        print(f"| GPU idle (Python, launches, host work) | {s['gpu_idle_ms_per_step']} | |")
    print(f"host syncs per step: {s['host_syncs_per_step'] or 'none'}")
    print("top kernels (ms/step): " + ", ".join(f"{k[:60]} {v}" for k, v in list(s["top_kernels_ms_per_step"].items())[:10]))


if __name__ == "__main__":
    main()
