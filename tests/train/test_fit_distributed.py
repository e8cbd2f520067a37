"""`longtrain fit` under real `torchrun` processes (gloo on the CPU): equivalence, exact resume, bad input.

One tiny recipe, run as 1 process × 4 rows and as 2 ranks × 2 rows (ddp and fsdp): the same documents
in the same rows, so the per-step losses and the final weights agree up to the order of the sums.
The runs are shared by the tests of this module (each costs seconds of CPU).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longtrain.train.metrics import read_metrics

from .tiny import RECIPE, cli_command, write_corpus

STEPS = 10


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """A folder with the tiny corpus and recipe (2 rows per rank), and a token cache shared by every run."""
    tmp = tmp_path_factory.mktemp("dist")
    write_corpus(tmp / "corpus")
    (tmp / "tiny.yaml").write_text(RECIPE.format(corpus=tmp / "corpus", steps=STEPS, every=4))
    return tmp


def env(space: Path, **extra) -> dict[str, str]:
    return dict(os.environ, LONGTRAIN_CACHE=str(space / "cache"), OMP_NUM_THREADS="1", **extra)


def run(cmd: list[str], env: dict, timeout: int = 300, preexec_fn=None) -> subprocess.CompletedProcess:
    """Run to the end; past `timeout`, SIGTERM (torchrun passes it on to its ranks) before SIGKILL, and fail."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:8])}... ran past {timeout} s:\n{(out + err)[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def fit(space: Path, run_dir: str, *args, extra_env=None) -> subprocess.CompletedProcess:
    """`longtrain fit tiny.yaml` as one process (no torchrun)."""
    cmd = cli_command("fit", space / "tiny.yaml", "--run-dir", space / run_dir, *args)
    return run(cmd, env(space, **(extra_env or {})))


def torchrun_fit(space: Path, run_dir: str, *args, nproc=2, script=False, extra_env=None, cores=None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m longtrain.cli fit tiny.yaml ...` (or the `longtrain` script under torchrun)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    if script:  # the console script, as a user types it: torchrun --no-python longtrain fit ...
        target = ["--no-python", str(Path(sys.executable).parent / "longtrain")]
    else:
        target = ["-m", "longtrain.cli"]
    cmd = [*launcher, *target, "fit", str(space / "tiny.yaml"), "--run-dir", str(space / run_dir), *map(str, args)]
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None  # fewer cores than ranks
    return run(cmd, env(space, **(extra_env or {})), preexec_fn=pin)


def records(space: Path, run_dir: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(space / run_dir / "metrics.jsonl")}


def weights(space: Path, run_dir: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(space / run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors")


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


@pytest.fixture(scope="module")
def one(space):
    """The reference: one process with all 4 rows."""
    return ok(fit(space, "one", "--set", "train.batch_docs=4"))


@pytest.fixture(scope="module")
def ddp(space):
    return ok(torchrun_fit(space, "ddp"))


def assert_equivalent(space: Path, run_dir: str, reference: str = "one") -> None:
    a, b = records(space, reference), records(space, run_dir)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in a:
        assert a[s]["doc_positions"] == b[s]["doc_positions"], s  # the same rows at the same positions
        assert a[s]["tokens"] == b[s]["tokens"]
        assert abs(a[s]["loss"] - b[s]["loss"]) <= 1e-5 * abs(a[s]["loss"]), (s, a[s]["loss"], b[s]["loss"])
        if "valid_loss" in a[s]:  # validation, sharded over the ranks and reduced
            assert abs(a[s]["valid_loss"] - b[s]["valid_loss"]) <= 1e-5 * a[s]["valid_loss"]
    wa, wb = weights(space, reference), weights(space, run_dir)
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5
    assert a[STEPS]["loss"] < a[1]["loss"]  # it learns


def test_two_ranks_of_two_rows_train_as_one_process_of_four_rows_ddp(space, one, ddp):
    assert_equivalent(space, "ddp")
    out = ddp.stdout
    assert out.count(f"step {STEPS}/{STEPS}") == 1 and out.count("longtrain fit tiny") == 1  # rank 0 alone prints
    assert "ranks: 2 ranks (ddp, gloo on cpu)" in out and "rank r reads global rows r·2 .. r·2+1 of 4" in out
    assert "need not divide among the ranks" in out
    meta = json.loads((space / "ddp/checkpoints/step-00000010/meta.json").read_text())
    assert meta["layout"] == {"world_size": 2, "batch_docs": 2, "rows": 4, "parallel": "ddp"}
    assert len(meta["ranks"]) == 2 and len(meta["data_stream"]["rows"]) == 4
    assert {"model.safetensors", "optimizer.safetensors", "cache.rank00000.safetensors",
        "cache.rank00001.safetensors"} <= meta["files"].keys()


def test_two_fsdp_ranks_train_as_one_process_through_a_kill_and_the_longtrain_script_runs_under_torchrun(space, one):
    fsdp = ("--set", "train.parallel=fsdp")
    # rank 0 is SIGKILLed right after checkpoint 4; torchrun stops rank 1; --resume auto goes on from step 4
    killed = torchrun_fit(space, "fsdp", *fsdp, script=True, extra_env={"LONGTRAIN_TEST_KILL_AFTER": "4", "LONGTRAIN_TEST_KILL_RANK": "0"})
    assert killed.returncode != 0 and "ranks: 2 ranks (fsdp, gloo on cpu)" in killed.stdout
    assert sorted(records(space, "fsdp")) == [1, 2, 3, 4]
    resumed = ok(torchrun_fit(space, "fsdp", *fsdp, script=True))
    assert "resuming from" in resumed.stdout and "step-00000004" in resumed.stdout
    assert_equivalent(space, "fsdp")  # FSDP's gathered save and its sharded restore lose nothing
    # FSDP's checkpoint holds the whole model, as one process writes it: it loads anywhere
    from longtrain.train.checkpoint import load_checkpoint

    loaded = load_checkpoint(space / "fsdp")
    assert loaded.step == STEPS and torch.equal(loaded.model.state_dict()["embed.weight"], weights(space, "fsdp")["embed.weight"])


@pytest.fixture(scope="module")
def killed_in_save(space):
    """A 2 × 2 ddp run whose rank 1 died while writing checkpoint 8 (its part is written, rank 0 has not
    committed; torchrun stops rank 0): the folder `killed-in-save` as it was left. No test writes to it:
    each copies it to a folder of its own, so the tests that need it run alone and in any order."""
    return torchrun_fit(space, "killed-in-save", extra_env={"LONGTRAIN_TEST_KILL_IN_SAVE": "8:1"})


def test_a_rank_killed_mid_save_leaves_no_checkpoint_and_the_run_resumes_bitwise(space, ddp, killed_in_save):
    assert killed_in_save.returncode != 0
    shutil.copytree(space / "killed-in-save", space / "killed")
    ckpts = space / "killed/checkpoints"
    assert (ckpts / "step-00000004").is_dir() and not (ckpts / "step-00000008").exists()
    half = [p for p in ckpts.iterdir() if p.name.startswith(".tmp-step-00000008")]
    assert half and not (half[0] / "meta.json").exists()  # what was written never carries the final name

    resumed = ok(torchrun_fit(space, "killed"))  # --resume auto
    assert "resuming from" in resumed.stdout and "step-00000004" in resumed.stdout
    a, b = records(space, "ddp"), records(space, "killed")
    assert sorted(b) == list(range(1, STEPS + 1))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]  # bitwise, steps 5..10 included
    wa, wb = weights(space, "ddp"), weights(space, "killed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not any(p.name.startswith(".tmp-") for p in ckpts.iterdir())  # the next save cleared the stale part


def test_two_by_two_resumes_as_one_by_four_and_other_totals_are_refused(space, ddp, killed_in_save):
    assert killed_in_save.returncode != 0
    regrouped = space / "regrouped"
    shutil.copytree(space / "killed-in-save", regrouped)  # its step 4 (and the half-written step 8), as it was
    assert (regrouped / "checkpoints/step-00000004").is_dir() and not (regrouped / "checkpoints/step-00000008").exists()
    refused = fit(space, "regrouped", "--set", "train.batch_docs=3")  # one process × 3 rows: 3 != 2 × 2
    assert refused.returncode == 1
    msg = refused.stderr
    assert "2 ranks × 2 rows = 4 rows in total (ddp)" in msg and "1 rank × 3 rows = 3 rows in total (ddp)" in msg
    assert "Different: ranks (2 vs 1), train.batch_docs (2 vs 3), rows in total (4 vs 3)" in msg
    assert "ranks × train.batch_docs = 4" in msg
    assert not (regrouped / "checkpoints/step-00000008").exists()  # a refused resume writes nothing

    regrouped = ok(fit(space, "regrouped", "--set", "train.batch_docs=4"))  # 1 × 4 from 2 × 2's step 4
    assert "resuming from" in regrouped.stdout
    a, b = records(space, "ddp"), records(space, "regrouped")
    assert [a[s]["doc_positions"] for s in a] == [b[s]["doc_positions"] for s in a]  # every row went on
    assert_equivalent(space, "regrouped", reference="ddp")


def test_fsdp_without_torchrun_runs_as_one_rank_with_a_note(space, ddp):
    # one process, fsdp (a world of one), resuming the 2 × 2 ddp run's checkpoint 8 with 1 × 4 rows
    step8 = space / "ddp/checkpoints/step-00000008"
    r = ok(fit(space, "fsdp1", "--resume", step8, "--fork", "--set", "train.parallel=fsdp", "--set", "train.batch_docs=4"))
    assert "note: train.parallel is fsdp but the run was not launched by torchrun: running as world size 1" in r.stdout
    assert "ranks: 1 rank (fsdp, gloo on cpu)" in r.stdout and "forking (a new run) from" in r.stdout
    a, b = records(space, "ddp"), records(space, "fsdp1")
    assert sorted(b) == [9, 10]
    assert all(abs(a[s]["loss"] - b[s]["loss"]) <= 1e-5 * a[s]["loss"] for s in (9, 10))
    wa, wb = weights(space, "ddp"), weights(space, "fsdp1")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5


def test_ddp_with_frozen_parameters_on_too_few_cores_trains_as_one_process_and_every_rank_warns(space):
    # train.freeze leaves most parameters without gradients for the first steps: DDP must not wait for them.
    # The two ranks share one core (a warning), and a threshold cap small enough to overflow makes every rank warn.
    common = ["--set", "train.freeze.steps=2", "--set", "train.steps=3", "--set", "attention.threshold_cap=1"]
    ok(fit(space, "frozen1", "--set", "train.batch_docs=4", *common))
    r = ok(torchrun_fit(space, "frozen2", *common, cores={0}))
    a, b = records(space, "frozen1"), records(space, "frozen2")
    assert sorted(b) == [1, 2, 3]
    assert all(abs(a[s]["loss"] - b[s]["loss"]) <= 1e-5 * a[s]["loss"] for s in a)
    assert all(abs(a[s]["grad_norm"] - b[s]["grad_norm"]) <= 1e-4 * a[s]["grad_norm"] for s in a)
    assert a[3]["grad_norm"] > 10 * a[2]["grad_norm"]  # step 3 thaws everything: the freeze did hold before

    assert "warning: 2 ranks on this machine share 1 CPU core(s)" in r.stdout and "--nproc_per_node 1" in r.stdout
    assert "[rank 0] warning: a layer's SparseK threshold state hit its cap" in r.stdout
    assert "[rank 1] warning: a layer's SparseK threshold state hit its cap" in r.stderr
    # python warnings carry the rank too, printed plainly (no file:line or class)
    assert re.search(r"^\[rank 1\] warning: SparseK threshold state overflowed its cap", r.stderr, re.M)


def test_fsdp_with_compiled_blocks_trains_as_one_process(space, one):
    # train.compile (the CUDA default) under FSDP2: the compiled scorer must read the gathered weight, not
    # its DTensor shard (it crashed with "mixed torch.Tensor and DTensor"). aot_eager: dynamo's tracing and
    # autograd graphs, without Inductor's slow CPU code generation.
    compiled = ("--set", "train.parallel=fsdp", "--set", "train.compile=true", "--set", "train.steps=3")
    r = ok(torchrun_fit(space, "fsdp-compiled", *compiled, extra_env={"LONGTRAIN_COMPILE_BACKEND": "aot_eager"}))
    assert "compiled around the attention op" in r.stdout
    a, b = records(space, "one"), records(space, "fsdp-compiled")
    assert sorted(b) == [1, 2, 3]
    assert all(abs(a[s]["loss"] - b[s]["loss"]) <= 1e-5 * a[s]["loss"] for s in b)


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(space, ddp):
    # rank 1 alone gets SIGINT after step 5; its vote goes out with step 6 and reaches the hosts a step
    # late (no host sync per step), so both ranks finish step 7, save it together and exit 130
    r = torchrun_fit(space, "stopped", extra_env={"LONGTRAIN_TEST_SIGINT_AT": "5:1"})
    assert r.returncode != 0
    assert sorted(records(space, "stopped")) == [1, 2, 3, 4, 5, 6, 7]
    meta = json.loads((space / "stopped/checkpoints/step-00000007/meta.json").read_text())
    assert len(meta["ranks"]) == 2  # both ranks' parts: they stopped at the same step
    resumed = ok(torchrun_fit(space, "stopped"))
    assert "step-00000007" in resumed.stdout
    assert_equivalent(space, "stopped", reference="ddp")
