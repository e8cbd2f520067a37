"""metrics.jsonl stays consistent across resumes; the display works with and without a terminal."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from rich.console import Console

from longtrain.train.metrics import (
    MetricsLogger,
    ProgressDisplay,
    RowProgress,
    StepStats,
    peak_memory_bytes,
    read_metrics,
)


def log_steps(run_dir, steps, start_step=0):
    with MetricsLogger(run_dir, start_step=start_step) as log:
        for s in steps:
            log.log({"step": s, "loss": 1.0 / s, "tokens": 10 * s, "lr": 1e-3})


def test_one_json_object_per_step(tmp_path):
    log_steps(tmp_path, range(1, 4))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert json.loads(lines[1]) == {"step": 2, "loss": 0.5, "tokens": 20, "lr": 1e-3}


def test_resume_drops_steps_after_the_checkpoint_and_torn_lines(tmp_path):
    log_steps(tmp_path, range(1, 8))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "lo')  # killed mid-line
    log_steps(tmp_path, range(6, 9), start_step=5)  # resumed from the step-5 checkpoint
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 8


def test_fresh_run_starts_an_empty_file(tmp_path):
    log_steps(tmp_path, range(1, 5))
    log_steps(tmp_path, [1])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


def stats(step):
    return StepStats(
        step=step, loss=2.0, lr=3e-4, grad_norm=0.75, tokens=1024 * step,
        rows=[RowProgress(doc=3, position=410, length=1000), RowProgress(doc=0, position=12)],
        cache_fill=0.5, memory_bytes=300 * 2**20,
    )


def test_plain_lines_every_n_steps_when_not_a_terminal():
    out = io.StringIO()
    with ProgressDisplay(25, every=10, console=Console(file=out, force_terminal=False)) as display:
        for step in range(1, 26):
            display.update(stats(step))
        display.message("valid ppl 7.39")
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines[:3]] == ["step 10/25", "step 20/25", "step 25/25"]
    assert "loss 2.0000 | ppl 7.39 | lr 3.00e-04 | gnorm 0.750" in lines[0]
    assert "cache 50%" in lines[0] and "mem 300 MiB" in lines[0] and "eta " in lines[0]
    assert lines[3] == "valid ppl 7.39"


def test_live_display_shows_rows_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    with ProgressDisplay(5, every=100, console=console) as display:
        assert display.live_enabled
        for step in range(1, 4):
            display.update(stats(step))
    text = out.getvalue()
    assert "step 3/5" in text and "row 0: doc 3 · 41%" in text and "row 1: doc 0 · 12 tok" in text


def test_progress_false_disables_live():
    console = Console(file=io.StringIO(), force_terminal=True)
    assert not ProgressDisplay(5, live=False, console=console).live_enabled


def test_cpu_peak_memory_is_a_peak_not_the_current_size():
    """A block held for a moment and freed still counts: the progress line's `mem` is the run's high-water mark."""
    import psutil
    import torch

    size = 1 << 30  # above anything this test process held before (it only imported torch and ran small tests)
    block = torch.ones(size // 4, dtype=torch.float32)  # written, so resident
    held = psutil.Process().memory_info().rss
    # a program this process starts (as pytest starts `longtrain fit`) counts its own peak, not this process's 1 GiB
    child = subprocess.run([sys.executable, "-c", "from longtrain.train.metrics import peak_memory_bytes as p; print(p())"],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) < size, (int(child.stdout), held)
    del block
    assert held >= size and peak_memory_bytes("cpu") >= held - (16 << 20)  # (the kernel's counters lag by a few pages)
    assert peak_memory_bytes("cpu") > psutil.Process().memory_info().rss + size // 2  # freed, the peak stays


def test_rate_and_eta_come_from_the_recent_window_of_training_time():
    display = ProgressDisplay(100, every=1000, console=Console(file=io.StringIO(), force_terminal=False))
    tokens = 0
    with display:
        for step in range(1, 51):
            step_tokens = 100 if step <= 40 else 1000  # a slow start, then ten times faster
            tokens += step_tokens
            display.update(StepStats(step=step, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=tokens, seconds=1.0))
    # Only the last 30 s of training count: 20 slow steps and 10 fast ones.
    assert display.tokens_per_s() == (20 * 100 + 10 * 1000) / 30
    line = display.line(StepStats(step=50, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=tokens, seconds=1.0))
    assert "400 tok/s" in line and "eta 0m50s" in line  # 50 steps left at 1 s per step


def test_the_live_panel_never_shows_markup():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None, markup=False)
    with ProgressDisplay(5, every=100, console=console) as display:
        display.update(stats(1))
    text = out.getvalue()
    assert "loss 2.0000" in text and "[bold" not in text and "[/]" not in text
