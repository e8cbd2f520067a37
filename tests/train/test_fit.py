"""End-to-end `longtrain fit` on a tiny generated corpus: resume exactness, signals, bad input."""

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longtrain.train.metrics import read_metrics

from .tiny import cli, logged_steps, losses, run_cli


def final_model(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors")


def test_resume_after_sigkill_is_bitwise_identical(workspace):
    tmp, recipe = workspace
    path = recipe(steps=10, every=4)
    straight = run_cli("fit", path, "--run-dir", tmp / "straight")
    assert straight.returncode == 0, straight.stderr + straight.stdout

    killed = run_cli("fit", path, "--run-dir", tmp / "resumed", env_extra={"LONGTRAIN_TEST_KILL_AFTER": "4"})
    assert killed.returncode == -signal.SIGKILL
    meta = json.loads((tmp / "resumed/checkpoints/step-00000004/meta.json").read_text())
    rows = meta["data_stream"]["rows"]
    assert any(0 < off for _, off in rows), "the kill should fall in the middle of a document"
    assert not (tmp / "resumed/checkpoints/step-00000008").exists()

    resumed = run_cli("fit", path, "--run-dir", tmp / "resumed")
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert "resuming from" in resumed.stdout and re.search(r"loaded in \d+\.\d s\)", resumed.stdout)
    a, b = losses(tmp / "straight"), losses(tmp / "resumed")
    assert logged_steps(tmp / "resumed") == list(range(1, 11))  # the killed run's steps after 4 dropped, each step once
    assert [a[s] for s in range(5, 11)] == [b[s] for s in range(5, 11)]
    ma, mb = final_model(tmp / "straight", 10), final_model(tmp / "resumed", 10)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    # the loss falls on this tiny corpus
    assert a[10] < a[1]
    # every record carries the loop's wall-clock time, for throughput between any two steps
    times = [r["elapsed_s"] for r in read_metrics(tmp / "straight" / "metrics.jsonl")]
    assert len(times) == 10 and times == sorted(times) and times[0] > 0


def test_resume_takes_a_run_dir_for_its_newest_checkpoint(workspace):
    """--resume RUN_DIR (or RUN_DIR/checkpoints), as every other verb takes a run dir: its newest complete checkpoint."""
    tmp, recipe = workspace
    first = run_cli("fit", recipe(steps=4, every=2), "--run-dir", tmp / "run")
    assert first.returncode == 0, first.stderr + first.stdout
    for given in (tmp / "run", tmp / "run" / "checkpoints"):
        more = run_cli("fit", recipe(steps=6 if given.name == "run" else 8, every=2), "--run-dir", tmp / "run",
                       "--resume", given)
        assert more.returncode == 0, more.stderr + more.stdout
        assert "resuming from" in more.stdout and ("step-00000004" in more.stdout or "step-00000006" in more.stdout)
    assert logged_steps(tmp / "run") == list(range(1, 9))
    empty = run_cli("fit", recipe(steps=8, every=2), "--run-dir", tmp / "other", "--resume", tmp / "corpus")
    assert empty.returncode != 0 and "Traceback" not in empty.stderr
    assert "neither a checkpoint" in " ".join((empty.stderr + empty.stdout).split())


def test_missing_recipe_and_bad_keys_are_named(workspace):
    tmp, recipe = workspace
    r = cli("fit", tmp / "nope.yaml")
    assert r.exit_code == 2 and "nope.yaml" in r.output
    r = cli("fit", recipe(), "--set", "model.layerz=3", "--run-dir", tmp / "x")
    assert r.exit_code == 2 and "model.layerz" in r.output and "layers" in r.output


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(workspace, monkeypatch):
    tmp, recipe = workspace
    import longtrain.model.model as model
    from longtrain.train.memory import runtime_bytes

    runtime_bytes()  # measured once per process with a tiny step (its loss would be counted below when this test runs first)
    calls = {"n": 0}
    real = model.linear_cross_entropy

    def poisoned(h, weight, targets, **kw):
        calls["n"] += 1
        loss = real(h, weight, targets, **kw)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(model, "linear_cross_entropy", poisoned)
    r = cli("fit", recipe(steps=6, every=2), "--run-dir", tmp / "nan")
    assert r.exit_code == 1, r.output
    assert "loss is nan at step 3" in r.output and "step-00000002" in r.output
    assert (tmp / "nan/checkpoints/step-00000002/model.safetensors").exists()
    assert not (tmp / "nan/checkpoints/step-00000003").exists()


def test_a_checkpoint_names_its_machine_and_a_resume_elsewhere_says_so(workspace):
    """meta.json records the machine (device model and count, torch, Triton); fit prints it, and resuming a checkpoint
    saved on another machine says so (under train.deterministic: that bit-for-bit repeats end there)."""
    from longtrain.device import machine, machine_words

    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.deterministic=true")
    assert r.exit_code == 0, r.output
    here = machine(torch.device("cpu"))
    assert f"machine: {machine_words(here)}" in r.output
    meta_path = tmp / "r/checkpoints/step-00000004/meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["machine"] == here and here["device"].startswith("cpu (") and here["torch"] == torch.__version__

    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.deterministic=true", "--set", "train.steps=6")
    assert r.exit_code == 0 and "resuming from" in r.output and "saved on" not in r.output, r.output  # the same machine

    meta = json.loads((tmp / "r/checkpoints/step-00000006/meta.json").read_text())
    meta["machine"] = {"device": "NVIDIA H100 80GB HBM3", "devices": 2, "torch": "2.11.0", "cuda": "12.8"}
    (tmp / "r/checkpoints/step-00000006/meta.json").write_text(json.dumps(meta))
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.deterministic=true", "--set", "train.steps=8")
    out = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "saved on NVIDIA H100 80GB HBM3 × 2, torch 2.11.0, CUDA 12.8" in out and "bit for bit" in out, out
    assert logged_steps(tmp / "r") == list(range(1, 9))  # the run goes on


def test_resume_refuses_another_model_and_skips_a_corrupt_checkpoint(workspace):
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    assert cli("fit", path, "--run-dir", tmp / "r").exit_code == 0
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "model.d_model=48", "--set", "train.steps=6")
    assert r.exit_code == 1 and "does not match this recipe's model shape" in " ".join(r.output.split())

    # Truncate the newest checkpoint: the previous complete one is used, with a warning.
    newest = tmp / "r/checkpoints/step-00000004/model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.warns(UserWarning, match="step-00000004"):
        r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=6")
    assert r.exit_code == 0, r.output
    assert "resuming from" in r.output and "step-00000002" in r.output
    assert logged_steps(tmp / "r") == list(range(1, 7))  # steps 3-4 of the first run dropped, each step once

    # An explicit checkpoint: metrics after it are dropped and rewritten.
    r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=6", "--resume", tmp / "r/checkpoints/step-00000002")
    assert r.exit_code == 0 and "(step 2," in r.output, r.output
    assert logged_steps(tmp / "r") == list(range(1, 7))
    r = cli("fit", path, "--run-dir", tmp / "r", "--resume", tmp / "r/checkpoints/step-00000099")
    assert r.exit_code == 2 and "step-00000099 does not exist" in r.output  # a missing --resume path: exit 2

    # No complete checkpoint at all: start over, but keep the broken ones aside.
    for step in (4, 6):
        f = tmp / f"r/checkpoints/step-{step:08d}/model.safetensors"
        f.write_bytes(b"broken")
    import shutil

    shutil.rmtree(tmp / "r/checkpoints/step-00000002", ignore_errors=True)
    with pytest.warns(UserWarning):
        r = cli("fit", path, "--run-dir", tmp / "r", "--set", "train.steps=2")
    assert r.exit_code == 0 and "moved the unusable ones" in r.output, r.output
    assert list(tmp.glob("r/checkpoints.unusable-*/step-00000006"))


def signal_at_step_3(monkeypatch, *signals):
    """Deliver real signals to this process in the middle of step 3 (after its backward)."""
    import longtrain.train.trainer as trainer

    real, calls = trainer.clip_grad_norms, {"n": 0}

    def clip_then_signal(model, max_norm, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            for sig in signals:
                signal.raise_signal(sig)
        return real(model, max_norm, **kwargs)

    monkeypatch.setattr(trainer, "clip_grad_norms", clip_then_signal)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_a_checkpoint_then_exits_128_plus_signal(workspace, monkeypatch, sig, code):
    tmp, recipe = workspace
    signal_at_step_3(monkeypatch, sig)
    r = cli("fit", recipe(steps=10, every=100), "--run-dir", tmp / "t")
    assert r.exit_code == code, r.output
    assert f"stopped by {signal.Signals(sig).name} after saving: steps 1–3" in r.output
    assert (tmp / "t/checkpoints/step-00000003").is_dir()
    assert logged_steps(tmp / "t") == [1, 2, 3]


def test_a_second_ctrl_c_stops_at_once_without_saving(workspace, monkeypatch):
    tmp, recipe = workspace
    signal_at_step_3(monkeypatch, signal.SIGINT, signal.SIGINT)
    r = cli("fit", recipe(steps=10, every=100), "--run-dir", tmp / "t")
    assert r.exit_code == 130 and "stopped without saving" in r.output, r.output
    assert not (tmp / "t/checkpoints").exists()


def test_keep_best_and_early_stopping_follow_the_validation_loss(workspace, monkeypatch):
    """Scripted validation losses (the trainer's `evaluate` replaced) decide what is kept and when the run stops."""
    import longtrain.train.trainer as trainer_module

    tmp, recipe = workspace
    path = recipe(steps=20, every=100)
    scripted = iter([3.0, 2.0, 2.5, 1.9995, 2.6, 2.8])  # steps 2, 4, 6, 8, 10 (and 12)
    monkeypatch.setattr(trainer_module, "evaluate", lambda *args, **kwargs: next(scripted))
    sets = ["train.valid_every=2", "checkpoint.keep=1", "checkpoint.keep_best=true",
            "train.early_stopping={patience: 3, min_delta: 0.001}"]
    args = ["fit", path, "--run-dir", tmp / "r", *[a for s in sets for a in ("--set", s)]]
    r = cli(*args)
    assert r.exit_code == 0, r.output
    # 8 is the best (below 2.0, though by less than min_delta: a new best, not an improvement for patience);
    # 6, 8 and 10 did not improve by 0.001: three passes, so the run stops at 10 and saves there.
    assert sorted(p.name for p in (tmp / "r/checkpoints").iterdir()) == ["step-00000008", "step-00000010"]
    assert max(losses(tmp / "r")) == 10
    assert "stopped early (train.early_stopping): steps 1–10" in r.output
    assert f"best checkpoint: {tmp / 'r/checkpoints/step-00000008'} (validation loss 1.9995" in r.output
    assert "has not improved by more than 0.001 for 3 validation passes; the best was 1.9995 (at step 8)" in r.output
    again = cli(*args)  # the same command: nothing to do, nothing written
    assert again.exit_code == 0 and "already stopped early at step 10" in again.output
    assert "already stopped early at step 10" in cli(*args, "--dry-run").output
    assert sorted(p.name for p in (tmp / "r/checkpoints").iterdir()) == ["step-00000008", "step-00000010"]
    more = cli(*args, "--set", "train.early_stopping={patience: 4, min_delta: 0.001}", "--set", "train.steps=12")
    assert more.exit_code == 0, more.output
    assert "resuming from" in more.output and max(losses(tmp / "r")) == 12 and "stopped early" in more.output
    assert sorted(p.name for p in (tmp / "r/checkpoints").iterdir()) == ["step-00000008", "step-00000012"]


def test_keep_best_and_early_stopping_need_validation(workspace):
    tmp, recipe = workspace
    r = cli("fit", recipe(), "--set", "train.valid_every=0", "--set", "checkpoint.keep_best=true", "--dry-run")
    assert r.exit_code == 2 and "checkpoint.keep_best compare validation losses, but train.valid_every is 0" in " ".join(r.output.split())
    r = cli("fit", recipe(), "--run-dir", tmp / "r", "--set", "data.valid=null", "--set", "train.early_stopping={patience: 2}")
    assert r.exit_code == 1 and "the data has no validation documents; set data.valid" in " ".join(r.output.split())
    assert not (tmp / "r").exists()


def test_activation_checkpointing_trains_bitwise_the_same_and_resumes(workspace):
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    on = ("--set", "train.activation_checkpointing=true")
    assert cli("fit", path, "--run-dir", tmp / "plain").exit_code == 0
    r = cli("fit", path, "--run-dir", tmp / "ac", *on)
    assert r.exit_code == 0, r.output
    assert "activation checkpointing (each block recomputed in the backward)" in r.output
    half = cli("fit", path, "--run-dir", tmp / "resumed", *on, "--set", "train.steps=2")
    assert half.exit_code == 0, half.output
    assert cli("fit", path, "--run-dir", tmp / "resumed", *on).exit_code == 0
    want = load_file(tmp / "plain/checkpoints/step-00000004/model.safetensors")
    for run in ("ac", "resumed"):
        got = load_file(tmp / run / "checkpoints/step-00000004/model.safetensors")
        assert all(torch.equal(got[k], want[k]) for k in want), run
    assert losses(tmp / "ac") == losses(tmp / "plain")


def test_wandb_logs_offline_and_a_resume_continues_the_same_run(workspace, monkeypatch):
    pytest.importorskip("wandb")  # the extra: pip install 'longtrain[wandb]'
    monkeypatch.setenv("WANDB_MODE", "offline")
    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    on = ("--set", "logging.wandb=true", "--set", "train.valid_every=2")
    r = cli("fit", path, "--run-dir", tmp / "r", *on, "--set", "train.steps=2")
    assert r.exit_code == 0, r.output
    run_id = (tmp / "r/wandb-id").read_text().strip()
    [first] = (tmp / "r/wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    keys = (b"loss", b"grad_norm", b"valid_loss", b"selection/tau/layer0")
    for _ in range(100):  # wandb's service process may still be writing its file when finish() returns
        if all(key in first.read_bytes() for key in keys):
            break
        time.sleep(0.1)
    assert all(key in first.read_bytes() for key in keys)
    assert cli("fit", path, "--run-dir", tmp / "r", *on).exit_code == 0  # resumed: the same W&B run, continued
    assert (tmp / "r/wandb-id").read_text().strip() == run_id
    assert len(list((tmp / "r/wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))) >= 1
    again = cli("fit", path, "--run-dir", tmp / "r", *on, "--resume", "never")  # a new run: a new W&B run
    assert again.exit_code == 0 and (tmp / "r/wandb-id").read_text().strip() != run_id


def test_wandb_without_the_package_names_the_extra(workspace, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if it were not installed
    tmp, recipe = workspace
    r = cli("fit", recipe(steps=2), "--run-dir", tmp / "r", "--set", "logging.wandb=true")
    assert r.exit_code == 1 and "pip install 'longtrain[wandb]'" in r.output
    assert not (tmp / "r").exists()


def test_the_summary_counts_validation_time_only_where_a_validation_ran(workspace):
    """A session without a validation pass (train.valid_every 0, or fewer steps than it) said "0.1 s in validation"."""
    tmp, recipe = workspace
    path = recipe(steps=4, every=100)  # valid_every 4
    for name, sets in (("off", ["--set", "train.valid_every=0"]), ("short", ["--set", "train.steps=2"])):
        r = cli("fit", path, "--run-dir", tmp / name, *sets)
        done = next(line for line in r.output.splitlines() if line.startswith("done:"))
        assert r.exit_code == 0 and "s in checkpoints and logging)" in done and "validation" not in done, r.output
    r = cli("fit", path, "--run-dir", tmp / "on")  # validates at step 4
    done = next(line for line in r.output.splitlines() if line.startswith("done:"))
    assert r.exit_code == 0 and "s in validation, checkpoints and logging)" in done and "final validation loss" in done, r.output
