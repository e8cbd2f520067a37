"""Several `longtrain fit` runs side by side on one GPU, stopped gracefully at a time budget: the seed studies'
launcher (recall_experiment.py, books_study.py). A run stopped at the budget saves a checkpoint and exits; the same
command resumes it (`--resume auto` once the run dir has checkpoints). With several GPUs visible each new run goes to
the one with the fewest of these runs still going (CUDA_VISIBLE_DEVICES in its environment), so that a study uses
them all."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The studies read their runs with longtrain's own readers (training_summary, metrics) in this process, as the fits
# they start do with `python -m longtrain.cli` in ROOT: installed or not (a lent GPU machine runs the checkout)
sys.path.insert(0, str(ROOT))
_placed: list[tuple[str, subprocess.Popen]] = []  # (GPU id, process) of each run start_fit placed on a GPU


def fit_command(recipe: str | Path, run_dir: Path, sets: list[str]) -> list[str]:
    """`longtrain fit RECIPE --run-dir RUN_DIR --set ...` as an argv."""
    return [sys.executable, "-m", "longtrain.cli", "fit", str(recipe), "--run-dir", str(run_dir),
            *[x for s in sets for x in ("--set", s)]]


def start_fit(recipe: str | Path, run_dir: Path, sets: list[str], log_path: Path) -> subprocess.Popen:
    """fit_command in the background (resuming a run dir that has checkpoints), its output appended to log_path."""
    cmd = fit_command(recipe, run_dir, sets)
    if (run_dir / "checkpoints").is_dir():
        cmd += ["--resume", "auto"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    gpu = pick_gpu()
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    print(f"$ {'' if gpu is None else f'CUDA_VISIBLE_DEVICES={gpu} '}{' '.join(cmd)}", flush=True)
    with open(log_path, "a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if gpu is not None:
        _placed.append((gpu, proc))
    return proc


def gpu_count() -> int:
    """The GPUs this process sees (torch.cuda.device_count(): no CUDA context in this process; 0 without torch)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def pick_gpu() -> str | None:
    """The visible GPU (its id as CUDA_VISIBLE_DEVICES names it: one of the parent's own list, if it has one) with
    the fewest of start_fit's runs still going, the first on a tie; None with fewer than two GPUs (nothing to choose)."""
    n = gpu_count()
    if n < 2:
        return None
    listed = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    gpus = listed[:n] if listed else [str(i) for i in range(n)]
    _placed[:] = [(g, p) for g, p in _placed if p.poll() is None]  # a finished run frees its place
    load = {g: sum(g == h for h, _ in _placed) for g in gpus}
    return min(gpus, key=load.__getitem__)


def wait_all(procs: dict[str, subprocess.Popen], budget_s: float) -> list[str]:
    """Wait for every run; at the budget SIGTERM all those still running at once (they finish their step, save and
    exit together: one at a time, the last would train on through the others' saves). Returns the names stopped at
    the budget; a run that exits with an error on its own stops the others (with a checkpoint) and the caller."""
    t0, stopped = time.monotonic(), []
    for name, proc in procs.items():
        try:  # past the budget the timeout is 0: a run still going is left for below, a finished one is checked
            rc = proc.wait(timeout=max(0.0, budget_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            continue
        print(f"{name}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
        if rc:
            stop([p for p in procs.values() if p.poll() is None])  # none left running unwatched on the GPU
            raise SystemExit(f"{name} failed (exit {rc}): see its fit-{name}.log")
    running = {name: p for name, p in procs.items() if p.poll() is None}
    stop(list(running.values()))
    for name in running:
        stopped.append(name)
        print(f"{name}: stopped at the budget after {time.monotonic() - t0:.0f} s", flush=True)
    return stopped


def wait_first(procs: dict[str, subprocess.Popen], budget_s: float, poll_s: float = 2.0) -> str | None:
    """Wait until one run exits and return its name, so that the caller can act on it while the others train. A run
    that exits with an error stops the others and the caller, as in wait_all; at the budget every run still going
    is stopped as wait_all stops them, and None is returned."""
    t0 = time.monotonic()
    while True:
        done = next((name for name, p in procs.items() if p.poll() is not None), None)
        if done is not None or time.monotonic() - t0 >= budget_s:
            break
        time.sleep(poll_s)
    if done is None:
        wait_all(procs, 0)
        return None
    rc = procs[done].returncode
    print(f"{done}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
    if rc:
        stop([p for p in procs.values() if p.poll() is None])  # none left running unwatched on the GPU
        raise SystemExit(f"{done} failed (exit {rc}): see its fit-{done}.log")
    return done


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process first, then wait for each (they save their checkpoints in parallel)."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait()


def training_summary(run_dir: Path) -> dict:
    """A run's steps, tokens, last losses, training seconds (the steps' own time, summed over resumes) and tokens/s:
    tokens over those seconds (compiles and warm-ups of every session included), and `logged_tokens_per_s`, the median
    of the rate each step logged over the progress line's recent window (the steady rate: a session's first windows,
    slowed by compiling, are a few of thousands)."""
    from longtrain.train.metrics import METRICS_FILE, read_metrics

    records = read_metrics(run_dir / METRICS_FILE)
    last = records[-1]
    valid = [r for r in records if "valid_loss" in r]
    train_s = sum(r.get("step_s", 0.0) for r in records)
    sel = next((r["selection"] for r in reversed(records) if "selection" in r), None)
    logged = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    return {
        "steps": last["step"], "tokens": last["tokens"], "loss": last["loss"],
        "valid_loss": valid[-1]["valid_loss"] if valid else None,
        "train_s": round(train_s, 1), "tokens_per_s": round(last["tokens"] / train_s) if train_s else None,
        "logged_tokens_per_s": round(statistics.median(logged)) if logged else None,
        "selection": sel,
    }
