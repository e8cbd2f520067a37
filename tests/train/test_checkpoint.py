"""Checkpoints: atomic writes, pruning, corruption detection, exact state round trips."""

from __future__ import annotations

import errno
import json
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import longtrain.train.checkpoint.storage as ckpt
from longtrain.train.checkpoint.storage import (
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    check_compatible,
    check_shapes,
    optimizer_from_checkpoint,
    optimizer_to_checkpoint,
)
from longtrain.train.checkpoint.rng import capture_rng, restore_rng


def state(value: float) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": torch.full((3, 4), value)}, "cache": {"pool_u": torch.full((2, 5), -value)}}


def save_steps(manager: CheckpointManager, *steps: int) -> None:
    for s in steps:
        manager.save(s, tensors=state(float(s)), meta={"tokens": 100 * s})


def test_layout_and_round_trip(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    path = manager.save(7, tensors=state(1.5), meta={"tokens": 700, "data": {"row": [1, 2]}})
    assert path == tmp_path / "checkpoints" / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == ["cache.safetensors", "meta.json", "model.safetensors"]
    tensors, meta = manager.load(manager.latest_complete())
    assert torch.equal(tensors["model"]["w"], state(1.5)["model"]["w"])
    assert torch.equal(tensors["cache"]["pool_u"], state(1.5)["cache"]["pool_u"])
    assert meta["step"] == 7 and meta["tokens"] == 700 and meta["data"] == {"row": [1, 2]}
    assert set(meta["files"]["model.safetensors"]) == {"bytes", "sha256"}


def test_keeps_the_newest_n(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    save_steps(manager, 1, 2, 3, 4)
    assert [p.name for p in manager.steps()] == ["step-00000003", "step-00000004"]


@pytest.mark.parametrize("keep, on_disk_while_saving", [(1, ["step-00000002"]), (2, ["step-00000002"]),
                                                        (3, ["step-00000001", "step-00000002"])])
def test_a_save_frees_the_oldest_first_when_keep_allows(tmp_path, monkeypatch, keep, on_disk_while_saving):
    """Issue 31: a save needs room for keep checkpoints, not keep + 1: with keep ≥ 2 the oldest goes
    before the new one is written (keep − 1 complete ones stay meanwhile); keep = 1 keeps its only one
    until the new one is complete."""
    manager = CheckpointManager(tmp_path, keep=keep)
    save_steps(manager, 1, 2)
    seen = []
    write_file = ckpt._write_file

    def spy(path, data):
        seen.append([p.name for p in manager.steps()])
        return write_file(path, data)

    monkeypatch.setattr(ckpt, "_write_file", spy)
    save_steps(manager, 3)
    assert seen[0] == on_disk_while_saving
    assert [p.name for p in manager.steps()] == ["step-00000001", "step-00000002", "step-00000003"][-keep:]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    save_steps(manager, 5)
    manager.save(5, tensors=state(9.0), meta={})
    tensors, _ = manager.load(manager.latest_complete())
    assert tensors["model"]["w"][0, 0].item() == 9.0
    assert [p.name for p in manager.dir.iterdir()] == ["step-00000005"]


def test_tied_weights_are_saved(tmp_path):
    shared = torch.randn(4, 4)
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, tensors={"model": {"wte": shared, "lm_head": shared}}, meta={})
    tensors, _ = manager.load(manager.latest_complete())
    assert torch.equal(tensors["model"]["wte"], shared) and torch.equal(tensors["model"]["lm_head"], shared)


KILL_MID_SAVE = """
import os, signal, sys, torch
import longtrain.train.checkpoint.storage as ckpt
real_write = ckpt._write_file
def write_then_die(path, data):
    real_write(path, data)
    os.kill(os.getpid(), signal.SIGKILL)  # dies with one file of the checkpoint written
ckpt._write_file = write_then_die
ckpt.CheckpointManager(sys.argv[1], keep=3).save(2, tensors={"model": {"w": torch.ones(3)}}, meta={})
"""


def test_sigkill_mid_save_leaves_previous_intact(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    save_steps(manager, 1)
    proc = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, str(tmp_path)])
    assert proc.returncode == -signal.SIGKILL
    assert not manager.path_for(2).exists()
    assert any(p.name.startswith(".tmp-step-00000002") for p in manager.dir.iterdir())
    assert manager.latest_complete() == manager.path_for(1)
    save_steps(manager, 3)  # the next save clears the stale temporary directory
    assert sorted(p.name for p in manager.dir.iterdir()) == ["step-00000001", "step-00000003"]


def test_failed_save_removes_its_temporary_directory(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    with pytest.raises(TypeError):
        manager.save(1, tensors=state(1.0), meta={"not json": object()})
    assert list(manager.dir.iterdir()) == []


def test_no_space_left_keeps_previous(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=3)
    save_steps(manager, 1)

    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "_write_file", disk_full)
    with pytest.raises(CheckpointError, match="no space left.*previous checkpoints are intact"):
        save_steps(manager, 2)
    assert [p.name for p in manager.dir.iterdir()] == ["step-00000001"]
    tensors, _ = manager.load(manager.latest_complete())
    assert tensors["model"]["w"][0, 0].item() == 1.0


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.joinpath("model.safetensors").write_bytes(p.joinpath("model.safetensors").read_bytes()[:-10]), "truncated"),
        (lambda p: p.joinpath("cache.safetensors").write_bytes(p.joinpath("cache.safetensors").read_bytes()[:-1] + b"X"),
            "sha256 mismatch"),
        (lambda p: p.joinpath("meta.json").unlink(), "meta.json is missing"),
        (lambda p: p.joinpath("meta.json").write_text('{"step": 2, "fil'), "meta.json is unreadable"),
        (lambda p: p.joinpath("model.safetensors").unlink(), "model.safetensors is missing"),
    ],
)
def test_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path, damage, reason):
    manager = CheckpointManager(tmp_path, keep=3)
    save_steps(manager, 1, 2)
    damage(manager.path_for(2))
    with pytest.warns(CheckpointWarning, match=f"step-00000002.*{reason}"):
        assert manager.latest_complete() == manager.path_for(1)
    with pytest.raises(CheckpointError, match=reason):
        manager.load(manager.path_for(2))


def test_no_checkpoint(tmp_path):
    assert CheckpointManager(tmp_path, keep=1).latest_complete() is None


def test_adamw_state_round_trips_bitwise(tmp_path):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
        opt = torch.optim.AdamW(
            [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
            lr=1e-2, betas=(0.9, 0.95), foreach=True,
        )
        return model, opt

    def step(model, opt, seed):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    model, opt = make()
    for s in range(3):
        step(model, opt, s)
    tensors, info = optimizer_to_checkpoint(opt.state_dict())
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(3, tensors={"model": model.state_dict(), "optimizer": tensors}, meta={"optimizer": info})

    saved, meta = manager.load(manager.latest_complete())
    model2, opt2 = make()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(optimizer_from_checkpoint(saved["optimizer"], meta["optimizer"]))
    for s in range(3, 6):
        step(model, opt, s)
        step(model2, opt2, s)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
        a, b = opt.state[p], opt2.state[p2]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_rng_round_trips_through_json():
    state = json.loads(json.dumps(capture_rng()))
    first = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    restore_rng(state)
    second = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_incompatible_checkpoint_is_refused_naming_what_differs():
    meta = {"hashes": {"model": "a", "attention": "b", "tokenizer": "c"}}
    check_compatible(meta, {"model": "a", "attention": "b", "tokenizer": "c"})
    with pytest.raises(CheckpointError) as e:
        check_compatible(meta, {"model": "x", "attention": "b", "tokenizer": "y"}, path="runs/q/step-00000001")
    msg = str(e.value)
    assert "does not match this recipe's model shape and tokenizer; refusing to resume" in msg
    assert "moves this run's checkpoints and metrics aside" in msg
    assert "`resume never`" in msg and "`run_dir`" in msg and "--" not in msg  # the CLI names the flags
    cli = e.value.naming("", {"resume": "--resume", "run_dir": "--run-dir"})
    assert "`--resume never`" in cli and "`--run-dir`" in cli


def test_state_of_another_shape_is_refused():
    live = {"w": torch.zeros(4, 8), "b": torch.zeros(8)}
    check_shapes({"w": torch.ones(4, 8), "b": torch.ones(8)}, live)
    with pytest.raises(CheckpointError, match=r"b is missing; w: checkpoint \(4, 16\) vs model \(4, 8\)"):
        check_shapes({"w": torch.ones(4, 16)}, live)
