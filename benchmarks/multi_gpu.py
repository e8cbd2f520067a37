"""`longtrain fit` on several GPUs of one host (torchrun, NCCL): scaling, a ~1B model under FSDP, exact resume.

    python benchmarks/multi_gpu.py --out DIR --parts scaling          # first 10-minute call (--models 12x768 | 24x1024 halves it)
    python benchmarks/multi_gpu.py --out DIR --parts large,resume     # second call
    python benchmarks/multi_gpu.py --out DIR --parts regroup          # save on N GPUs, resume on 1, and back
    python benchmarks/multi_gpu.py --out DIR --small --gpus 2         # a tiny CPU version (gloo), to check the script

Parts (each writes DIR/multi_gpu-<part>.json and its runs' logs in DIR/multi_gpu-<part>.log, and prints a table):
  scaling  12 × 768 and 24 × 1024 llama, SparseK+SW k = w = 512, chunk 4096, 4 rows per GPU (16k tokens per
           GPU per step): 1 GPU and N GPUs (--gpus, default 2), each with ddp and with fsdp. tokens/s per GPU
           over steps 5..N-1 and weak-scaling efficiency (per-GPU rate on N GPUs / on 1 GPU). 1 GPU ddp is a
           plain process; every other run is `torchrun --nproc_per_node G -m longtrain.cli fit`.
  large    a ~1B llama (22 × 2048, 16 heads, 4 KV heads, SwiGLU 4×) with SparseK+SW k = w = 512 at chunk 8192
           under fsdp on N GPUs, one row per GPU reading a document of 270k+ tokens: tokens/s, peak memory
           of rank 0, and that peak when its row is at position 16k and at 256k (flat: the cache has a fixed
           size), the time of the final checkpoint (the whole model and AdamW state gathered on rank 0), and
           the time to load it (the run resumed for one more step: fit's "loaded in").
  regroup  another world size on resume: 12 × 768 ddp, 2 rows per GPU on N GPUs for 10 steps (deterministic), a fork
           of its checkpoint 4 on one GPU with 2N rows (steps 5..8), and a fork of that one's checkpoint 8 back on N
           GPUs (steps 9..10): the rows read and the losses against the straight run's.
  resume   12 × 768 ddp on N GPUs, 10 steps, checkpoints every 4, train.deterministic (the kernels' backward
           without atomics, torch.use_deterministic_algorithms): a straight run, a second straight run (is the
           run reproducible at all?), and a run whose rank 1 is SIGKILLed after checkpoint 4 (torchrun then
           stops the others) resumed with --resume auto. Compares steps 5..10's losses and the final weights.

NCCL's NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set here and in every run's environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)  # before torch loads NCCL

import torch  # noqa: E402 (after the environment above)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from fit_throughput import rate, recipe_yaml, train_tokenizer, write_corpus  # noqa: E402 (after sys.path)

SHAPES = {
    "12x768": dict(layers=12, d_model=768, heads=12),
    "24x1024": dict(layers=24, d_model=1024, heads=16),
    "22x2048": dict(layers=22, d_model=2048, heads=16, kv_heads=4),  # ~1B parameters with vocab 8192
}
SPARSEK = {"type": "sparsek+sw", "topk": 512, "window": 512}


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


class Bench:
    def __init__(self, args):
        self.args, self.out = args, args.out
        self.work = Path(os.environ.get("MULTI_GPU_WORK", "/tmp/multi_gpu"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs = self.work / "logs"  # one file per fit; DIR gets one file per part (the device tool returns few files)
        self.logs.mkdir(exist_ok=True)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.gpu = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        self.commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        small = args.small
        self.shapes = {k: dict(layers=2, d_model=64, heads=2) for k in SHAPES} if small else SHAPES
        self.attention = {"type": "sparsek+sw", "topk": 16, "window": 16} if small else SPARSEK
        self.chunk = 128 if small else 4096
        self.large_chunk = 256 if small else 8192
        self.rows = 4
        self.vocab = 512 if small else 8192
        self.corpus = self.work / "corpus"
        if not self.corpus.is_dir():  # 4 rows per GPU, several GPUs: at least 8 documents of 60k+ tokens
            write_corpus(self.corpus, n_docs=max(8, 4 * args.gpus), words_per_doc=3000 if small else 60_000, seed=0)
        self.tokenizer = self.work / "tokenizer.json"
        if not self.tokenizer.is_file():
            train_tokenizer(self.corpus, self.tokenizer, self.vocab)
        print(f"device {self.gpu} × {torch.cuda.device_count() if self.device == 'cuda' else 0}, commit {self.commit or '?'}", flush=True)

    def recipe(self, name: str, shape: dict, *, chunk: int, rows: int, steps: int, corpus: Path, extra: str = "") -> Path:
        text = recipe_yaml(shape, self.attention, chunk=chunk, rows=rows, steps=steps, corpus=corpus,
                           tokenizer=self.tokenizer, device=self.device)
        path = self.work / f"{name}.yaml"
        path.write_text(text + extra)
        return path

    def fit(self, name: str, recipe: Path, *, gpus: int, parallel: str, launch: bool = True, args=(), env=None,
            deterministic: bool = False, run: str | None = None) -> tuple[int | str, list[dict], str]:
        """One `longtrain fit` (under torchrun with `gpus` ranks when `launch`) into run dir `run` (default: `name`);
        returns (exit code, metrics records, log); the log is DIR/fit-<name>.log."""
        run_dir = self.work / f"run-{run or name}"
        fit_args = ["fit", str(recipe), "--run-dir", str(run_dir), "--set", f"train.parallel={parallel}", *args]
        if deterministic:
            fit_args += ["--set", "train.deterministic=true"]
        target = ["-m", "longtrain.cli"]
        if launch:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus), *target, *fit_args]
        else:
            cmd = [sys.executable, *target, *fit_args]
        full_env = dict(os.environ, **NO_MULTICAST, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                        LONGTRAIN_CACHE=str(self.work / "cache"), PYTHONUNBUFFERED="1", **(env or {}))
        if self.device == "cpu":
            full_env["OMP_NUM_THREADS"] = "1"
        t0 = time.monotonic()
        log_path = self.logs / f"fit-{name}.log"
        with open(log_path, "w") as log:
            rc = run_stopping_on_timeout(cmd, log, full_env, self.args.timeout, self.work)
        print(f"  {name}: exit {rc}, {time.monotonic() - t0:.0f} s", flush=True)
        metrics = run_dir / "metrics.jsonl"
        recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
        return rc, recs, log_path.read_text(errors="replace")

    def drop_checkpoints(self, name: str) -> None:
        """A measured run's checkpoints are not needed (a 1B model's take 16 GiB of disk)."""
        shutil.rmtree(self.work / f"run-{name}" / "checkpoints", ignore_errors=True)

    def save(self, part: str, results: dict) -> None:
        """DIR/multi_gpu-<part>.json, and the part's fit logs in one file, DIR/multi_gpu-<part>.log."""
        (self.out / f"multi_gpu-{part}.json").write_text(json.dumps({"device": self.gpu, "commit": self.commit, **results}, indent=1))
        logs = sorted(self.logs.glob(f"fit-{part.replace('scaling', 'scale')}*.log"))
        (self.out / f"multi_gpu-{part}.log").write_text("".join(f"===== {f.name}\n{f.read_text(errors='replace')}\n" for f in logs))

    # ------------------------------------------------------------------ parts

    def scaling(self) -> None:
        steps, n = self.args.steps, self.args.gpus
        rows = []
        for model in self.args.models.split(","):
            recipe = self.recipe(f"scale-{model}", self.shapes[model], chunk=self.chunk, rows=self.rows, steps=steps, corpus=self.corpus)
            row = {"model": model, "chunk": self.chunk, "rows_per_gpu": self.rows}
            for parallel in ("ddp", "fsdp"):
                for gpus in (1, n):
                    launch = not (gpus == 1 and parallel == "ddp")  # the 1-GPU ddp baseline is a plain process
                    name = f"scale-{model}-{parallel}-{gpus}"
                    rc, recs, _ = self.fit(name, recipe, gpus=gpus, parallel=parallel, launch=launch, args=["--resume", "never"])
                    self.drop_checkpoints(name)
                    tps = rate(recs, 5, steps - 1)
                    row[f"{parallel}_{gpus}"] = {
                        "exit": rc, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / gpus if tps else None,
                        "peak_mem_bytes": max((r.get("memory_bytes") or 0 for r in recs), default=None),
                    }
                one, many = row[f"{parallel}_1"]["tokens_per_s_per_gpu"], row[f"{parallel}_{n}"]["tokens_per_s_per_gpu"]
                row[f"{parallel}_efficiency"] = many / one if one and many else None
            rows.append(row)
            self.save("scaling", {"gpus": n, "steps": steps, "rows": rows})
        print(f"\nweak scaling on {self.gpu} at {self.commit}: tokens/s per GPU over steps 5..{steps - 1} (peak GiB, rank 0)")
        print(f"| model | chunk × rows/GPU | ddp 1 | ddp {n} | ddp eff. | fsdp 1 | fsdp {n} | fsdp eff. |")
        print("|---|---|---|---|---|---|---|---|")
        for row in rows:
            cell = lambda k: (f"{row[k]['tokens_per_s_per_gpu'] / 1e3:.1f}k ({(row[k]['peak_mem_bytes'] or 0) / 2**30:.1f})"  # noqa: E731
                              if row[k]["tokens_per_s_per_gpu"] else f"exit {row[k]['exit']}")
            eff = lambda k: f"{100 * row[k]:.0f}%" if row[k] else "—"  # noqa: E731
            print(f"| {row['model']} | {row['chunk']} × {row['rows_per_gpu']} | {cell('ddp_1')} | {cell(f'ddp_{n}')} | "
                  f"{eff('ddp_efficiency')} | {cell('fsdp_1')} | {cell(f'fsdp_{n}')} | {eff('fsdp_efficiency')} |")

    def large(self) -> None:
        n, chunk = self.args.gpus, self.large_chunk
        flat = self.work / "long"
        target = 4 * chunk if self.args.small else 262_144  # the position where memory is read a second time
        if not flat.is_dir():  # one document per GPU, longer than 256k tokens
            write_corpus(flat, n_docs=n, words_per_doc=int(1.15 * target) + 2 * chunk, seed=1)
        steps = target // chunk + 2
        recipe = self.recipe("large", self.shapes["22x2048"], chunk=chunk, rows=1, steps=steps, corpus=flat)
        rc, recs, log = self.fit("large-fsdp", recipe, gpus=n, parallel="fsdp", args=["--resume", "never"])
        # the load: the same run resumed from its final checkpoint for one more step
        more = self.recipe("large-more", self.shapes["22x2048"], chunk=chunk, rows=1, steps=steps + 1, corpus=flat)
        _, _, log_more = self.fit("large-fsdp-load", more, gpus=n, parallel="fsdp", run="large-fsdp")
        loaded = re.search(r"loaded in ([\d.]+) s", log_more)
        self.drop_checkpoints("large-fsdp")
        at = lambda p: max((r["memory_bytes"] for r in recs if 0 < r["doc_positions"][0] <= p), default=None)  # noqa: E731
        m = re.search(r"([\d.]+) s in (?:validation, )?checkpoints and logging", log)  # no validation: not named
        params = re.search(r"([\d.]+)M parameters", log)
        result = {
            "exit": rc, "gpus": n, "model": "22x2048 (16 heads, 4 KV heads)", "params_millions": float(params.group(1)) if params else None,
            "chunk": chunk, "steps": steps, "tokens_per_s": rate(recs, 3, steps - 1),
            "peak_mem_bytes": max((r.get("memory_bytes") or 0 for r in recs), default=None),
            "peak_at_16k": at(16384), "peak_at_256k": at(target), "last_position": max((r["doc_positions"][0] for r in recs), default=0),
            "seconds_outside_steps": float(m.group(1)) if m else None,  # the final checkpoint, mostly
            "load_seconds": float(loaded.group(1)) if loaded else None,  # read, checked, sharded onto the GPUs
        }
        self.save("large", result)
        gib = lambda b: f"{b / 2**30:.2f} GiB" if b else "?"  # noqa: E731
        tps = f"{result['tokens_per_s']:,.0f}" if result["tokens_per_s"] else "?"
        print(f"\n~1B llama ({result['params_millions']}M parameters) fsdp on {n} GPUs, chunk {chunk}: {tps} tokens/s; "
              f"peak memory (rank 0) {gib(result['peak_mem_bytes'])}, at position 16k {gib(result['peak_at_16k'])}, "
              f"at {target:,} {gib(result['peak_at_256k'])}; {result['seconds_outside_steps']} s outside steps (the final checkpoint); "
              f"loading it: {result['load_seconds']} s")

    def resume(self) -> None:
        n = self.args.gpus
        recipe = self.recipe("resume", self.shapes["12x768"], chunk=self.chunk, rows=2, steps=10, corpus=self.corpus)
        every = ["--set", "checkpoint.every=4", "--set", "checkpoint.keep=3"]
        runs = {}
        for name in ("straight", "straight2"):
            runs[name] = self.fit(f"resume-{name}", recipe, gpus=n, parallel="ddp", args=["--resume", "never", *every], deterministic=True)
        kill = {"LONGTRAIN_TEST_KILL_AFTER": "4", "LONGTRAIN_TEST_KILL_RANK": "1"}
        killed = self.fit("resume-killed", recipe, gpus=n, parallel="ddp", args=["--resume", "never", *every], env=kill, deterministic=True)
        resumed = self.fit("resume-resumed", recipe, gpus=n, parallel="ddp", args=["--resume", "auto", *every], deterministic=True,
                           run="resume-killed")
        loss = lambda recs: {r["step"]: r["loss"] for r in recs}  # noqa: E731
        a, a2, b = loss(runs["straight"][1]), loss(runs["straight2"][1]), loss(resumed[1])
        steps = [s for s in range(5, 11) if s in a and s in b]
        result = {
            "gpus": n, "killed_exit": killed[0], "resumed_exit": resumed[0], "resumed_from_step_4": "step-00000004" in resumed[2],
            "straight": [a.get(s) for s in range(1, 11)], "straight2": [a2.get(s) for s in range(1, 11)],
            "resumed": [b.get(s) for s in range(1, 11)],
            "resumed_equals_straight_steps_5_10": bool(steps) and all(a[s] == b[s] for s in steps) and len(steps) == 6,
            "straight_reproducible": all(a.get(s) == a2.get(s) for s in range(1, 11)),
            "max_rel_diff_steps_5_10": max((abs(a[s] - b[s]) / abs(a[s]) for s in steps), default=None),
        }
        result |= self.compare_weights("resume-straight", "resume-killed")
        self.save("resume", result)
        print(f"\nexact resume on {n} GPUs (ddp, deterministic mode): rank 1 killed after checkpoint 4 (exit {killed[0]}), "
              f"resumed (exit {resumed[0]}): steps 5..10 bitwise equal to a straight run: {result['resumed_equals_straight_steps_5_10']} "
              f"(max rel. diff {result['max_rel_diff_steps_5_10']}); final weights equal: {result.get('weights_equal')}; "
              f"two straight runs equal: {result['straight_reproducible']}")

    def regroup(self) -> None:
        """Save on N GPUs, resume on one (the same rows in total: 1 × 2N), and back on N from that run."""
        n = self.args.gpus
        recipe = self.recipe("regroup", self.shapes["12x768"], chunk=self.chunk, rows=2, steps=10, corpus=self.corpus)
        common = ["--set", "checkpoint.every=4", "--set", "checkpoint.keep=3"]
        one = ["--set", f"train.batch_docs={2 * n}"]
        fork = lambda run, step: ["--resume", str(self.work / f"run-{run}/checkpoints/step-{step:08d}"), "--fork"]  # noqa: E731
        runs = {
            "straight": self.fit("regroup-straight", recipe, gpus=n, parallel="ddp", args=["--resume", "never", *common],
                                 deterministic=True),
            "one": self.fit("regroup-one", recipe, gpus=1, parallel="ddp", launch=False,
                            args=[*fork("regroup-straight", 4), *common, *one], deterministic=True),
        }
        runs["back"] = self.fit("regroup-back", recipe, gpus=n, parallel="ddp", args=[*fork("regroup-one", 8), *common],
                                deterministic=True)
        by_step = {k: {r["step"]: r for r in v[1]} for k, v in runs.items()}
        straight = by_step["straight"]

        def against_straight(name: str, steps: range) -> dict:
            got = by_step[name]
            shared = [s for s in steps if s in got and s in straight]
            return {"exit": runs[name][0], "steps": shared, "loss": [got[s]["loss"] for s in shared],
                    "positions_equal": bool(shared) and all(got[s]["doc_positions"] == straight[s]["doc_positions"] for s in shared),
                    "max_rel_loss_diff": max((abs(got[s]["loss"] - straight[s]["loss"]) / abs(straight[s]["loss"]) for s in shared),
                                             default=None)}

        result = {"gpus": n, "straight_exit": runs["straight"][0], "straight_loss": [straight[s]["loss"] for s in sorted(straight)],
                  f"{n}_to_1": against_straight("one", range(5, 9)), f"1_to_{n}": against_straight("back", range(9, 11))}
        self.save("regroup", result)
        for key in (f"{n}_to_1", f"1_to_{n}"):
            r = result[key]
            print(f"\nresume {key.replace('_to_', ' → ')} GPUs (ddp, deterministic): steps {r['steps']}, the same rows as the "
                  f"straight {n}-GPU run: {r['positions_equal']}, max relative loss difference {r['max_rel_loss_diff']}")

    def compare_weights(self, a: str, b: str) -> dict:
        from safetensors.torch import load_file

        pa, pb = (self.work / f"run-{x}/checkpoints/step-00000010/model.safetensors" for x in (a, b))
        if not (pa.is_file() and pb.is_file()):
            return {"weights_equal": None}
        wa, wb = load_file(pa), load_file(pb)
        return {"weights_equal": all(torch.equal(wa[k], wb[k]) for k in wa),
                "weights_max_abs_diff": max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="scaling,large,resume")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count() if torch.cuda.is_available() else 2)
    ap.add_argument("--steps", type=int, default=12, help="steps of each scaling run (tokens/s over 5..steps-1)")
    ap.add_argument("--models", default="12x768,24x1024", help="the scaling part's models (one call per model if time is short)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per fit run")
    ap.add_argument("--small", action="store_true", help="a tiny CPU configuration (gloo) that checks the script")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gpus < 2:
        sys.exit(f"multi_gpu.py needs 2 or more GPUs (this machine shows {args.gpus}); --small runs it on the CPU")
    bench = Bench(args)
    for part in args.parts.split(","):
        getattr(bench, part)()


if __name__ == "__main__":
    main()
