"""Data parallelism's parts: torchrun's environment, each rank's part of a checkpoint, regrouping rows.

The multi-process tests launch real `torchrun` processes (gloo on the CPU); the end-to-end runs of
`longtrain fit` under torchrun are in test_fit_distributed.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longtrain.train import distributed
from longtrain.train.checkpoint import CheckpointError, CheckpointManager
from longtrain.train.checkpoint.ranks import Layout, cache_for_rank, cache_group, check_layout, rng_for_rank, saved_groups_for

HERE = Path(__file__).parent


def torchrun(nproc: int, script: Path, *args, env_extra=None, timeout=120) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run` (torchrun) with `nproc` ranks on this machine."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_launch_env_reads_torchrun_variables():
    assert distributed.launch_env({}) == distributed.Ranks()
    r = distributed.launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size, r.launched) == (3, 4, 1, 2, True)
    assert not r.is_main and r.parallel and r.describe() == "rank 3 of 4"


def test_every_rank_writes_its_part_rank_0_commits_and_a_rank_killed_mid_save_leaves_no_checkpoint(tmp_path):
    # two ranks save checkpoint 1; during checkpoint 2 rank 1 dies once its part is written (torchrun stops rank 0)
    r = torchrun(2, HERE / "dist_save_worker.py", tmp_path, env_extra={"LONGTRAIN_TEST_KILL_IN_SAVE": "2:1"})
    assert r.returncode != 0 and "rank 0 saved" in r.stdout and "rank 1 saved" in r.stdout, r.stderr[-3000:]
    manager = CheckpointManager(tmp_path, keep=3)
    assert [p.name for p in manager.steps()] == ["step-00000001"]
    assert manager.latest_complete() == manager.path_for(1)  # what a later run resumes from
    meta = json.loads((manager.path_for(1) / "meta.json").read_text())
    assert sorted(meta["files"]) == ["cache.rank00000.safetensors", "cache.rank00001.safetensors", "model.safetensors"]
    assert meta["ranks"] == [{"rank": 0}, {"rank": 1}]
    tensors, _ = manager.load(manager.path_for(1), groups=[cache_group(1)])  # a rank reads only its part
    assert list(tensors) == [cache_group(1)] and tensors[cache_group(1)]["seen"].tolist() == [11, 11]
    stale = [p for p in manager.dir.iterdir() if p.name.startswith(".tmp-step-00000002")]
    assert stale and (stale[0] / "cache.rank00001.safetensors").exists() and not (stale[0] / "meta.json").exists()


def fake_cache(rows: int, groups: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "seen": torch.randint(0, 100, (rows,), generator=g),
        "layers.0.pool_k": torch.randn(rows * groups, 5, 1, 4, generator=g),  # score groups folded: row b·G + g
        "layers.0.score_sum": torch.randn(rows, groups, generator=g, dtype=torch.float64),
    }


@pytest.mark.parametrize("saved_world,saved_b,world,b", [(2, 2, 1, 4), (1, 4, 2, 2), (2, 2, 4, 1), (3, 2, 2, 3), (2, 3, 3, 2)])
def test_a_resume_regroups_the_rows_of_any_world_size_with_the_same_total(saved_world, saved_b, world, b):
    G = 2
    whole = fake_cache(saved_world * saved_b, G, seed=7)  # the global rows, in order
    saved = Layout(saved_world, saved_b)
    parts = {
        cache_group(s): {
            k: v[s * saved_b * (v.shape[0] // whole["seen"].shape[0]) : (s + 1) * saved_b * (v.shape[0] // whole["seen"].shape[0])]
            for k, v in whole.items()
        }
        for s in range(saved_world)
    }
    meta = {"layout": saved.to_meta()}
    check_layout(saved, Layout(world, b))
    for rank in range(world):
        needed = saved_groups_for(saved, meta, rank, b)
        got = cache_for_rank({g: parts[g] for g in needed}, saved, meta, rank, b)
        for k, v in whole.items():
            per_row = v.shape[0] // whole["seen"].shape[0]
            assert torch.equal(got[k], v[rank * b * per_row : (rank + 1) * b * per_row]), (rank, k)


def test_a_checkpoint_from_before_ranks_reads_as_one_rank():
    meta = {"data_stream": {"rows": [[0, 5], [1, 7]]}, "rng": {"python": 1}}
    saved = Layout.from_meta(meta)
    assert saved == Layout(1, 2) and saved_groups_for(saved, meta, 0, 2) == ["cache"]
    cache = fake_cache(2, 1, seed=1)
    assert torch.equal(cache_for_rank({"cache": cache}, saved, meta, 0, 2)["seen"], cache["seen"])
    assert rng_for_rank(meta, 0) == {"python": 1}
    assert rng_for_rank({"ranks": [{"rng": "r0"}, {"rng": "r1"}]}, 1) == "r1"
    assert rng_for_rank({"ranks": [{"rng": "r0"}]}, 3) == "r0"


def test_other_total_rows_are_refused_saying_what_matches():
    with pytest.raises(CheckpointError) as e:
        check_layout(Layout(2, 2), Layout(3, 2, "fsdp"), path="run/checkpoints/step-00000004")
    msg = str(e.value)
    assert "2 ranks × 2 rows = 4 rows in total (ddp)" in msg and "3 ranks × 2 rows = 6 rows in total (fsdp)" in msg
    assert "Same: train.batch_docs (2). Different: ranks (2 vs 3), rows in total (4 vs 6)." in msg
    assert "ranks × train.batch_docs = 4 (1 × 4, 2 × 2, 4 × 1; e.g. `torchrun --nproc_per_node 2" in msg
    assert "resume never or another run_dir" in msg  # `longtrain fit` says --resume, --run-dir
    assert "--resume never or another --run-dir" in e.value.naming("", {"resume": "--resume", "run_dir": "--run-dir"})
    with pytest.raises(CheckpointError, match=r"Same: ranks \(1\)\. Different: train.batch_docs \(4 vs 3\).*without torchrun"):
        check_layout(Layout(1, 4), Layout(1, 3))


def test_optimizer_state_converts_between_names_and_positions():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2]}, {"params": [p for p in model.parameters() if p.dim() < 2],
            "weight_decay": 0.0}],
        foreach=True,
    )
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    positional = opt.state_dict()
    named = distributed._fqn_layout(model, opt, positional)
    assert named["param_groups"][0]["params"] == ["0.weight", "2.weight"]
    assert sorted(named["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]
    back = distributed._positional(named)
    assert back["param_groups"] == positional["param_groups"]
    assert back["state"].keys() == positional["state"].keys()
    for i, s in positional["state"].items():
        assert all(torch.equal(s[k], back["state"][i][k]) for k in s)
