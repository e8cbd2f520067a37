"""Run directories that cannot be damaged, and honest numbers (issue 22), on real tiny fits."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from longtrain.data.cache import disk_size
from longtrain.train.metrics import read_metrics
from longtrain.train.run_dir import LOCK_FILE, RunLock

from .tiny import cli, cli_command, logged_steps, losses, snapshot


def test_a_refused_resume_leaves_the_run_dir_byte_identical(workspace):
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    before = snapshot(tmp / "r")
    assert {"recipe.yaml", "tokenizer.json", "metrics.jsonl", "checkpoints/step-00000004/meta.json"} <= set(before)

    # Another tokenizer (the case: its tokenizer.json was overwritten) and another model.
    for change in ("tokenizer.vocab_size=300", "model.d_model=48"):
        r = cli("fit", path, "--run-dir", tmp / "r", "--set", change, "--set", "train.steps=8")
        assert r.exit_code == 1, r.output
        assert "refusing to resume" in r.output
        assert snapshot(tmp / "r") == before, change
    # The untouched run still loads as a model.
    assert cli("verify-equivalence", "--checkpoint", tmp / "r", "--tokens", "64", "--chunk-size", "16").exit_code == 0
    # A run that fails before it starts leaves no run dir behind.
    r = cli("fit", path, "--run-dir", tmp / "new", "--set", f"data.path={tmp / 'no-such-corpus'}")
    assert r.exit_code == 2 and "no-such-corpus" in r.output and not (tmp / "new").exists()


def test_resuming_an_earlier_checkpoint_moves_the_later_ones_aside(workspace):
    tmp, recipe = workspace
    path = recipe(steps=6, every=2)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    later = snapshot(tmp / "r/checkpoints/step-00000006")
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=3", "--resume", tmp / "r/checkpoints/step-00000002")
    assert r.exit_code == 0, r.output
    assert "moved the checkpoints after step 2 (steps 4–6) aside" in r.output
    ckpts = tmp / "r/checkpoints"
    [aside] = ckpts.glob("step-00000006.superseded-*")
    assert snapshot(aside) == later and len(list(ckpts.glob("step-00000004.superseded-*"))) == 1
    assert sorted(p.name for p in ckpts.iterdir() if "." not in p.name) == ["step-00000002", "step-00000003"]
    assert logged_steps(tmp / "r") == [1, 2, 3]  # the first run's steps 3-6 dropped, step 3 logged once, anew
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=3")  # auto now finds step 3, not the old 6
    assert "already finished at step 3" in r.output


def test_another_runs_checkpoint_is_refused_unless_forked_into_a_new_run(workspace):
    """Issue 31: `--resume PATH` of another run merged it into this one (metrics 1-120 then 801-900, and
    checkpoint.keep pruned this run's own checkpoints). Refused; --fork starts this run afresh from it."""
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    assert cli("fit", path, "--run-dir", tmp / "a").exit_code == 0
    assert cli("fit", path, "--run-dir", tmp / "b", "--set", "train.steps=2").exit_code == 0
    a, b = snapshot(tmp / "a"), snapshot(tmp / "b")
    other = tmp / "a/checkpoints/step-00000004"
    for dry in ((), ("--dry-run",)):
        r = cli("fit", path, "--run-dir", tmp / "b", "--set", "train.steps=6", "--resume", other, *dry)
        assert r.exit_code == 1 and "belongs to another run" in r.output and "--fork" in r.output, r.output
        assert f"train.init_from={other}" in r.output and snapshot(tmp / "b") == b
    r = cli("fit", path, "--run-dir", tmp / "b", "--resume", "auto", "--fork")
    assert r.exit_code == 2 and "--resume PATH" in r.output

    r = cli("fit", path, "--run-dir", tmp / "b", "--set", "train.steps=6", "--resume", other, "--fork", "--dry-run")
    assert r.exit_code == 0 and "would start a new run from the state of" in r.output and snapshot(tmp / "b") == b
    r = cli("fit", path, "--run-dir", tmp / "b", "--set", "train.steps=6", "--resume", other, "--fork")
    assert r.exit_code == 0, r.output
    assert f"--fork: a new run from {other} (step 4): its metrics and checkpoints start at step 5" in r.output
    assert f"done: steps 5–6 (a new run forked from {other} at step 4)" in r.output
    assert logged_steps(tmp / "b") == [5, 6]  # this run's metrics from the fork on, none of its old steps 1-2
    assert sorted(p.name for p in (tmp / "b/checkpoints").iterdir()) == ["step-00000006"]
    [old_ckpts] = (tmp / "b").glob("checkpoints.replaced-*")
    [old_metrics] = (tmp / "b").glob("metrics.jsonl.replaced-*")
    assert {p.name for p in old_ckpts.iterdir()} == {"step-00000002"} and old_metrics.read_bytes() == b["metrics.jsonl"]
    assert snapshot(tmp / "a") == a  # the other run is only read
    shutil.copytree(tmp / "a", tmp / "a2")  # a itself resumed to step 6: the fork went on from the same state
    assert cli("fit", path, "--run-dir", tmp / "a2", "--set", "train.steps=6").exit_code == 0
    assert {s: v for s, v in losses(tmp / "a2").items() if s > 4} == losses(tmp / "b")


def test_a_full_disk_when_resuming_says_so_and_leaves_the_run_dir_as_it_was(workspace, monkeypatch):
    """Issue 31: rewriting metrics.jsonl for a resume on a full disk was a raw OSError (Errno 28) that left
    metrics.jsonl.tmp behind; now a message, and the run dir byte-identical."""
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    before = snapshot(tmp / "r")
    write_text = Path.write_text
    for full in ("metrics.jsonl", "recipe.yaml"):  # the case; the first file a resume writes

        def full_disk(self, data, *args, full=full, **kwargs):
            if self.name.startswith(full):
                write_text(self, data[: len(data) // 2], *args, **kwargs)  # what fits, then the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write_text(self, data, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", full_disk)
        r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=6")
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        assert f"could not write {tmp / 'r' / full}" in r.output and "no space left on the device" in r.output
        assert "rerun the same command" in r.output
        assert snapshot(tmp / "r") == before  # no .tmp file left, recipe.yaml and metrics.jsonl untouched


def test_the_summary_says_how_much_disk_the_checkpoints_need(workspace, monkeypatch):
    """Issue 31: the checkpoints' room (keep of them; keep = 1: two while saving) is in the summary and the
    dry run, about the size a checkpoint turns out to be, and a warning when the disk has less free."""
    import longtrain.train.summary as summary

    tmp, recipe = workspace
    path = recipe(steps=2, every=2)
    r = cli("fit", path, "--run-dir", tmp / "r", "--dry-run")
    [line] = [x for x in r.output.splitlines() if x.startswith("disk: ")]
    assert "checkpoint.keep = 3 needs room for 3" in line and "the oldest is deleted before a save" in line, line
    estimate = float(line.split("a checkpoint is about ")[1].split(" MiB")[0])
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    real = disk_size(tmp / "r/checkpoints/step-00000002") / 2**20
    assert 0.8 * real <= estimate <= 1.25 * real, (estimate, real)
    r = cli("fit", path, "--run-dir", tmp / "r2", "--set", "checkpoint.keep=1", "--dry-run")
    assert "checkpoint.keep = 1 needs room for 2" in r.output and "warning: the checkpoints need" not in r.output

    monkeypatch.setattr(summary.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    r = cli("fit", path, "--run-dir", tmp / "r2", "--dry-run")
    assert "warning: the checkpoints need about" in r.output and "lower checkpoint.keep (now 3)" in r.output, r.output


def test_an_already_finished_run_says_so_and_writes_nothing(workspace):
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    before = snapshot(tmp / "r")
    r = cli("fit", path, "--run-dir", tmp / "r")
    assert r.exit_code == 0, r.output
    assert "already finished at step 4" in r.output and "tokens/s" not in r.output and "nan" not in r.output
    assert snapshot(tmp / "r") == before


def test_the_summary_after_a_resume_counts_this_session(workspace):
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=6")
    assert r.exit_code == 0, r.output
    # 2 steps of 2 rows x 48 tokens (every row is mid-document here, no padding): 192 tokens, not the run's 576.
    records = read_metrics(tmp / "r/metrics.jsonl")
    session = records[-1]["tokens"] - records[3]["tokens"]
    assert f"done: steps 5–6 (resumed at step 4), {session:,} tokens in" in r.output
    seconds = sum(rec["step_s"] for rec in records[4:])
    rate = float(r.output.split(" tokens in ")[1].split("(")[1].split(" tokens/s")[0].replace(",", ""))
    assert rate == pytest.approx(session / seconds, rel=0.05)


def test_resume_never_moves_the_previous_run_aside_and_says_where(workspace):
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    old = snapshot(tmp / "r/checkpoints")
    r = cli("fit", path, "--run-dir", tmp / "r", "--resume", "never", "--set", "train.steps=2")
    assert r.exit_code == 0, r.output
    [aside] = (tmp / "r").glob("checkpoints.replaced-*")
    [old_metrics] = (tmp / "r").glob("metrics.jsonl.replaced-*")
    assert "--resume never: moved the previous run (2 checkpoints, steps 2–4) aside" in r.output
    assert str(aside) in r.output and str(old_metrics) in r.output
    assert snapshot(aside) == old
    assert [rec["step"] for rec in read_metrics(old_metrics)] == [1, 2, 3, 4]
    assert logged_steps(tmp / "r") == [1, 2]
    assert sorted(p.name for p in (tmp / "r/checkpoints").iterdir()) == ["step-00000002"]
    # The summary lists what was moved aside, and `longtrain clean` deletes exactly that.
    note = next(line for line in r.output.splitlines() if "moved aside (" in line)
    assert "note: 2 items moved aside (" in note and aside.name in note and old_metrics.name in note
    assert f"longtrain clean {tmp / 'r'}" in note
    listed = cli("clean", tmp / "r")
    assert listed.exit_code == 0 and "nothing deleted" in listed.output and aside.exists() and old_metrics.exists()
    assert str(aside) in listed.output and str(old_metrics) in listed.output
    live = snapshot(tmp / "r")
    live = {k: v for k, v in live.items() if not k.startswith((aside.name, old_metrics.name))}
    with RunLock(tmp / "r"):  # a fit holding the run: nothing is deleted
        busy = cli("clean", tmp / "r", "--delete")
    assert busy.exit_code == 1 and "in use" in busy.output and aside.exists()
    done = cli("clean", tmp / "r", "--delete")
    assert done.exit_code == 0 and "deleted 2 moved-aside items" in done.output
    assert not aside.exists() and not old_metrics.exists() and snapshot(tmp / "r") == live
    assert "nothing was moved aside" in cli("clean", tmp / "r").output


def test_a_dry_run_says_when_the_run_dir_is_in_use(workspace):
    """A fresh-clone trial: `fit --dry-run` approved a run dir another fit held (the real fit was refused)."""
    tmp, recipe = workspace
    path = recipe(steps=2, every=100)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    with RunLock(tmp / "r") as lock:  # another fit holding the run
        r = cli("fit", path, "--run-dir", tmp / "r", "--dry-run")
        assert r.exit_code == 0 and "note: the run dir is in use by process pid" in r.output, r.output
        assert lock._fd is not None and (tmp / "r" / LOCK_FILE).exists()  # still held: the dry run only looked
    r = cli("fit", path, "--run-dir", tmp / "r", "--dry-run")
    assert r.exit_code == 0 and "in use" not in r.output, r.output


def _wait_for(predicate, timeout=120.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_busy_run_dir_is_refused_naming_its_holder_and_a_sigkilled_holder_leaves_no_lock(workspace):
    tmp, recipe = workspace
    path = recipe(steps=100_000, every=100_000)
    run = tmp / "r"
    holder = subprocess.Popen(cli_command("fit", path, "--run-dir", run), env=dict(os.environ),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size > 0,
                  what="the first fit to train a step")
        started = time.monotonic()
        r = cli("fit", path, "--run-dir", run, "--set", "train.steps=3")
        assert r.exit_code == 1, r.output
        assert f"is in use by process pid {holder.pid}" in r.output and "another --run-dir" in r.output
        assert time.monotonic() - started < 10, "a busy run dir must be refused at once, not after preparing data"
        assert holder.poll() is None, "the refused fit must not disturb the running one"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    assert (run / ".lock").is_file()  # left behind by the killed holder: information only
    r = cli("fit", path, "--run-dir", run, "--set", "train.steps=2")
    assert r.exit_code == 0, r.output
    assert logged_steps(run) == [1, 2]
    assert not (run / ".lock").exists()


def test_rates_and_eta_leave_validation_out(workspace, monkeypatch):
    tmp, recipe = workspace
    import longtrain.train.trainer as trainer

    real = trainer.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(0.5)  # a validation pass far slower than the steps around it
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate", slow_evaluate)
    r = cli("fit", recipe(steps=8, every=100), "--run-dir", tmp / "r", "--set", "train.valid_every=2")
    assert r.exit_code == 0, r.output
    records = read_metrics(tmp / "r/metrics.jsonl")
    assert [rec["step"] for rec in records if "valid_loss" in rec] == [2, 4, 6, 8]
    assert all(rec["valid_s"] >= 0.5 for rec in records if "valid_loss" in rec)
    for i, rec in enumerate(records):  # every step lies in the 30 s window: tokens over training time only
        train_time = sum(x["step_s"] for x in records[: i + 1])
        assert rec["tokens_per_s"] == pytest.approx(rec["tokens"] / train_time, rel=0.02)
    # The validation time is in the wall clock, not in the steps' own times.
    valid_time = sum(rec["valid_s"] for rec in records if "valid_s" in rec)
    assert records[-1]["elapsed_s"] >= sum(rec["step_s"] for rec in records) + valid_time - 0.01


def test_a_short_run_skips_the_final_validation_unless_asked(workspace):
    tmp, recipe = workspace
    r = cli("fit", recipe(steps=3, every=100), "--run-dir", tmp / "short")  # valid_every is 4
    assert r.exit_code == 0, r.output
    assert not any("valid_loss" in rec for rec in read_metrics(tmp / "short/metrics.jsonl"))
    assert "note: no validation: the run is shorter than train.valid_every (4)" in r.output
    r = cli("fit", recipe(steps=3, every=100), "--run-dir", tmp / "asked", "--set", "train.valid_every=3")
    assert [rec["step"] for rec in read_metrics(tmp / "asked/metrics.jsonl") if "valid_loss" in rec] == [3]
    r = cli("fit", recipe(steps=6, every=100), "--run-dir", tmp / "long")  # at least valid_every: 4 and the end
    assert [rec["step"] for rec in read_metrics(tmp / "long/metrics.jsonl") if "valid_loss" in rec] == [4, 6]


def test_output_has_no_markup_and_long_paths_stay_on_one_line(workspace):
    tmp, recipe = workspace
    run = tmp / ("a-run-dir-with-a-name-long-enough-to-pass-eighty-columns-" + "x" * 40)
    r = cli("fit", recipe(steps=2, every=100), "--run-dir", run)
    assert r.exit_code == 0, r.output
    assert f"saved checkpoint {run}/checkpoints/step-00000002\n" in r.output
    assert f"checkpoint: {run}/checkpoints/step-00000002\n" in r.output
    assert "[bold" not in r.output and "[/]" not in r.output and "\x1b[" not in r.output


def test_dry_run_describes_the_run_and_writes_nothing(workspace):
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    r = cli("fit", path, "--run-dir", tmp / "r", "--dry-run")
    assert r.exit_code == 0, r.output
    assert not (tmp / "r").exists()
    out = r.output
    assert "model:\n  style: gpt2" in out and "warmup_steps: 2" in out  # the resolved recipe
    assert "0.03M parameters" in out and "KV cache 15 entries per layer per row" in out
    assert "96 tokens per step, 4 steps" in out and "4 training documents" in out
    assert "dry run: would start a fresh run of 4 steps; nothing was written" in out

    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    before = snapshot(tmp / "r")
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=6", "--dry-run")
    assert "dry run: would resume from" in r.output and "train steps 5–6" in r.output
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "model.d_model=48", "--dry-run")
    assert r.exit_code == 1 and "refusing to resume" in r.output
    assert snapshot(tmp / "r") == before


def test_dry_run_refuses_what_the_run_refuses_with_the_same_message(workspace):
    """Issue 31: the dry run said "would resume" where fit refused (another seed, another corpus), and
    train.device=cuda on a CPU machine was torch's AssertionError instead of fit's message."""
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    before = snapshot(tmp / "r")
    for change in ("train.seed=4", "data.valid=0.4"):  # another seed; another corpus (3 training documents, not 4)
        args = ("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=6", "--set", change)
        real, dry = cli(*args), cli(*args, "--dry-run")
        assert real.exit_code == dry.exit_code == 1, (change, real.output, dry.output)
        assert "error:" in real.output and real.output.splitlines()[-1] in dry.output, (real.output, dry.output)
        assert snapshot(tmp / "r") == before
    if not torch.cuda.is_available():
        for dry_run in ((), ("--dry-run",)):
            r = cli("fit", path, "--run-dir", tmp / "cuda", "--set", "train.device=cuda", *dry_run)
            assert r.exit_code == 2 and "no CUDA device is visible; use `--set train.device=cpu`" in r.output, r.output
            assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        assert not (tmp / "cuda").exists()


def test_fewer_documents_than_batch_rows_is_a_warning(workspace):
    tmp, recipe = workspace
    r = cli("fit", recipe(steps=1, every=100), "--run-dir", tmp / "r", "--set", "train.batch_docs=6", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "warning: the corpus has 4 training documents for 6 batch rows" in r.output
    assert "lower train.batch_docs to 4" in r.output


def test_tensorboard_event_files_hold_the_metrics(workspace):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, recipe = workspace
    r = cli("fit", recipe(steps=4, every=100), "--run-dir", tmp / "r", "--set", "logging.tensorboard=true")
    assert r.exit_code == 0, r.output
    events = EventAccumulator(str(tmp / "r/tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("loss")}
    assert logged == pytest.approx(losses(tmp / "r"), rel=1e-6)
    assert [e.step for e in events.Scalars("valid_loss")] == [4]
    assert {"lr", "grad_norm", "tokens_per_s"} <= set(events.Tags()["scalars"])
