"""FSDP at world size 1 on one GPU against the plain run: the first steps of a 24 × 1024 model.

    python benchmarks/fsdp_check.py --out DIR [--steps 8]
    python benchmarks/fsdp_check.py --out DIR --small     # a tiny CPU version, to check the script

Runs `longtrain fit` twice on one recipe (llama 24 × 1024, SparseK+SW k = w = 512, chunk 4096, 2 rows):
  ddp   one process, no torchrun: fp32 weights under bf16 autocast (what `longtrain fit` does on a GPU);
  fsdp  `torchrun --nproc_per_node 1 -m longtrain.cli fit ... --set train.parallel=fsdp`: FSDP2's
        fully_shard over one rank (NCCL), bf16 parameters and fp32 gradient reduction through its
        MixedPrecisionPolicy, the SparseK scorers in fp32.
It writes DIR/fsdp_check.json: per-step losses and gradient norms of both, their relative
differences, tokens/s over steps 3..N and the peak memory, and DIR/fit-*.log. The runs start from
the same weights and read the same rows; they round differently (bf16 parameters against bf16
matmuls over fp32 weights), so their losses agree to bf16 rounding, not bitwise.

NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set for every run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from fit_throughput import SHAPES, rate, recipe_yaml, train_tokenizer, write_corpus  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)


def run_stopping_on_timeout(cmd: list[str], log, env: dict, timeout: int, cwd: Path) -> int | str:
    """Run `cmd`; past `timeout`, SIGTERM it (torchrun passes that on to its ranks and kills them 30 s later)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        return "timeout"


def run(name: str, cmd: list[str], work: Path, out: Path, timeout: int) -> list[dict]:
    """One fit command; returns the run's metrics.jsonl records ([] if it wrote none)."""
    env = dict(os.environ, **NO_MULTICAST, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               LONGTRAIN_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    with open(out / f"fit-{name}.log", "w") as log:
        rc = run_stopping_on_timeout(cmd, log, env, timeout, work)
    print(f"  {name}: exit {rc}, {time.monotonic() - t0:.0f} s", flush=True)
    metrics = work / f"run-{name}" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    shutil.rmtree(work / f"run-{name}" / "checkpoints", ignore_errors=True)  # not needed; GiBs of disk
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per fit run")
    ap.add_argument("--small", action="store_true", help="a tiny CPU configuration that checks the script")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("FSDP_CHECK_WORK", "/tmp/fsdp_check"))
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape, attention, chunk, rows, vocab, words = SHAPES[1024], {"type": "sparsek+sw", "topk": 512, "window": 512}, 4096, 2, 8192, 60_000
    if args.small:
        shape, attention, chunk, vocab, words = dict(layers=2, d_model=64, heads=2), {"type": "sparsek+sw", "topk": 16,
            "window": 16}, 128, 512, 3000

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"device {gpu}, commit {commit or '?'}", flush=True)
    corpus, tokenizer = work / "corpus", work / "tokenizer.json"
    if not corpus.is_dir():
        write_corpus(corpus, n_docs=4, words_per_doc=words, seed=0)
    if not tokenizer.is_file():
        train_tokenizer(corpus, tokenizer, vocab)
    recipe = work / "check.yaml"
    recipe.write_text(recipe_yaml(shape, attention, chunk=chunk, rows=rows, steps=args.steps, corpus=corpus,
                                  tokenizer=tokenizer, device=device))

    fit = ["fit", str(recipe), "--resume", "never"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "longtrain.cli"]
    results = {"device": gpu, "commit": commit, "model": f"{shape['layers']}x{shape['d_model']}", "attention": attention,
               "chunk": chunk, "rows": rows, "steps": args.steps}
    recs = {
        "ddp": run("ddp", [sys.executable, "-m", "longtrain.cli", *fit, "--run-dir", str(work / "run-ddp")], work, args.out, args.timeout),
        "fsdp": run("fsdp", [*torchrun, *fit, "--run-dir", str(work / "run-fsdp"), "--set", "train.parallel=fsdp"], work, args.out,
            args.timeout),
    }
    for name, r in recs.items():
        results[name] = {
            "loss": [x["loss"] for x in r], "grad_norm": [x["grad_norm"] for x in r],
            "tokens_per_s": rate(r, 3, args.steps) if len(r) >= args.steps else None,
            "peak_mem_bytes": max((x.get("memory_bytes") or 0 for x in r), default=None),
        }
    a, b = results["ddp"]["loss"], results["fsdp"]["loss"]
    results["loss_rel_diff"] = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    ga, gb = results["ddp"]["grad_norm"], results["fsdp"]["grad_norm"]
    results["grad_norm_rel_diff"] = [abs(x - y) / abs(x) for x, y in zip(ga, gb)]
    (args.out / "fsdp_check.json").write_text(json.dumps(results, indent=1))

    print(f"\n{results['model']} on {gpu} at {commit}: per-step loss, ddp (1 process) vs fsdp (torchrun, world size 1)")
    print("| step | ddp loss | fsdp loss | rel. diff | ddp gnorm | fsdp gnorm |")
    print("|---|---|---|---|---|---|")
    for i, (x, y) in enumerate(zip(a, b)):
        print(f"| {i + 1} | {x:.5f} | {y:.5f} | {results['loss_rel_diff'][i]:.2e} | {ga[i]:.4f} | {gb[i]:.4f} |")
    for name in ("ddp", "fsdp"):
        r = results[name]
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "?"
        mem = f"{r['peak_mem_bytes'] / 2**30:.1f} GiB" if r["peak_mem_bytes"] else "?"
        print(f"{name}: {tps} tokens/s (steps 3..{args.steps}), peak memory {mem}")


if __name__ == "__main__":
    main()
