"""The several-GPU benchmarks' CPU versions (gloo, real `torchrun` processes): multi_gpu.py's regroup part
(save on 2 ranks, resume on 1 with twice the rows, and back), its large part (fsdp, the checkpoint's load
timed) and fit_profile.py under torchrun with FSDP
(every rank writes its profile; collectives have their own group)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=full_env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_regroup_resumes_on_one_rank_and_back_on_two_reading_the_same_rows(tmp_path):
    out = tmp_path / "out"
    run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu.py"), "--out", str(out), "--small", "--gpus", "2",
         "--parts", "regroup"], tmp_path, MULTI_GPU_WORK=str(tmp_path / "work"))
    r = json.loads((out / "multi_gpu-regroup.json").read_text())
    assert r["straight_exit"] == 0 and len(r["straight_loss"]) == 10
    for key, steps in (("2_to_1", [5, 6, 7, 8]), ("1_to_2", [9, 10])):
        assert r[key]["exit"] == 0 and r[key]["steps"] == steps, (key, r[key])
        assert r[key]["positions_equal"] and r[key]["max_rel_loss_diff"] < 1e-5, (key, r[key])
    log = (out / "multi_gpu-regroup.log").read_text()
    assert "forking (a new run) from" in log and "step-00000004" in log and "step-00000008" in log


def test_large_part_times_the_checkpoint_load_of_its_fsdp_run(tmp_path):
    out = tmp_path / "out"
    run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu.py"), "--out", str(out), "--small", "--gpus", "2",
         "--parts", "large"], tmp_path, MULTI_GPU_WORK=str(tmp_path / "work"))
    r = json.loads((out / "multi_gpu-large.json").read_text())
    assert r["exit"] == 0 and r["tokens_per_s"] > 0 and r["peak_at_16k"] and r["peak_at_256k"]
    assert r["load_seconds"] is not None and r["load_seconds"] >= 0  # the resumed run's "loaded in"


def test_fit_profile_under_torchrun_profiles_every_rank_with_a_communication_group(tmp_path):
    out = tmp_path / "out"
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "benchmarks" / "fit_profile.py"), "--small", "--out", str(out), "--steps", "2", "--warmup", "2",
               "--set", "train.parallel=fsdp", "--set", "train.compile=false"], tmp_path,
              FIT_THROUGHPUT_WORK=str(tmp_path / "work"))
    assert "(rank 0 of 2)" in res.stdout and "| communication |" in res.stdout
    for rank in (0, 1):
        p = json.loads((out / f"fit_profile-rank{rank}.json").read_text())
        assert p["rank"] == rank and p["world_size"] == 2 and p["steps"] == 2
        assert p["host_ms_per_step"]["communication"] > 0  # FSDP's all-gathers and reduce-scatters (gloo: host)
        assert (out / f"fit_profile-rank{rank}.txt").is_file()
