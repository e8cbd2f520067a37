"""benchmarks/side_by_side.py's wait_all with real processes: at the budget every run still going gets SIGTERM at
once, so their saves overlap instead of each run training on through the saves of those stopped before it. And
start_fit's placement on several GPUs (their count faked)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from side_by_side import wait_all, wait_first  # noqa: E402

# a run that "saves" for 1 s on SIGTERM, writing when the signal came
RUN = """import signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write(repr(time.time())); time.sleep(1.0); sys.exit(143)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".up", "w").close()
time.sleep(60)
"""


def wait_up(*marks: Path) -> None:
    """Until every RUN has installed its SIGTERM handler (before a budget can stop it)."""
    while not all(Path(f"{m}.up").exists() for m in marks):
        time.sleep(0.05)


def test_runs_at_the_budget_are_stopped_together(tmp_path):
    marks = [tmp_path / f"run{i}" for i in range(3)]
    procs = {m.name: subprocess.Popen([sys.executable, "-c", RUN, str(m)]) for m in marks}
    wait_up(*marks)
    stopped = wait_all(procs, budget_s=1.0)
    assert stopped == ["run0", "run1", "run2"] and all(p.returncode == 143 for p in procs.values())
    got = [float(m.read_text()) for m in marks]
    assert max(got) - min(got) < 0.5  # one at a time, the last would get its signal 2 s after the first


def test_a_run_that_fails_stops_the_others(tmp_path):
    marks = [tmp_path / f"run{i}" for i in range(2)]
    procs = {"bad": subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
             **{m.name: subprocess.Popen([sys.executable, "-c", RUN, str(m)]) for m in marks}}
    wait_up(*marks)
    with pytest.raises(SystemExit, match=r"bad failed \(exit 3\)"):  # never a normal return
        wait_all(procs, budget_s=60.0)
    assert all(m.exists() for m in marks) and all(p.poll() is not None for p in procs.values())


def test_a_run_that_failed_behind_one_still_going_is_reported_at_the_budget(tmp_path):
    """The budget runs out while the first run still trains; the second had already failed on its own. Its failure
    must reach the caller, not pass for a finished run."""
    mark = tmp_path / "run0"
    procs = {"run0": subprocess.Popen([sys.executable, "-c", RUN, str(mark)]),
             "bad": subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])}
    wait_up(mark)
    procs["bad"].wait()
    with pytest.raises(SystemExit, match=r"bad failed \(exit 3\)"):  # never a normal return
        wait_all(procs, budget_s=1.0)
    assert mark.exists() and procs["run0"].returncode == 143  # the one still going was stopped with its save


def test_wait_first_returns_the_run_that_finished_while_the_others_train_on(tmp_path):
    mark = tmp_path / "run0"
    procs = {"run0": subprocess.Popen([sys.executable, "-c", RUN, str(mark)]),
             "quick": subprocess.Popen([sys.executable, "-c", "pass"])}
    wait_up(mark)
    assert wait_first(procs, budget_s=60.0, poll_s=0.05) == "quick"
    assert procs["run0"].poll() is None  # still training
    assert wait_first({"run0": procs["run0"]}, budget_s=0.5, poll_s=0.05) is None  # the budget: stopped, saved
    assert mark.exists() and procs["run0"].returncode == 143


def test_wait_first_stops_the_others_when_a_run_fails(tmp_path):
    mark = tmp_path / "run0"
    procs = {"run0": subprocess.Popen([sys.executable, "-c", RUN, str(mark)]),
             "bad": subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])}
    wait_up(mark)
    with pytest.raises(SystemExit, match=r"bad failed \(exit 3\)"):
        wait_first(procs, budget_s=60.0, poll_s=0.05)
    assert mark.exists() and procs["run0"].returncode == 143


# a run that writes the GPU it was given (in one rename), then trains until told to finish (a file `go` in its run dir)
PLACED = """import os, sys, time
from pathlib import Path
run = Path(sys.argv[1])
run.mkdir(parents=True, exist_ok=True)
(run / "gpu.part").write_text(str(os.environ.get("CUDA_VISIBLE_DEVICES")))
os.replace(run / "gpu.part", run / "gpu")  # whole or absent: the test reads it as soon as it exists
while not (run / "go").exists():
    time.sleep(0.02)
"""


def _gpu_of(run: Path) -> str:
    while not (run / "gpu").exists():
        time.sleep(0.02)
    return (run / "gpu").read_text()


def test_start_fit_puts_each_run_on_the_gpu_with_the_fewest_runs_going(tmp_path, monkeypatch):
    import side_by_side as sbs

    monkeypatch.setattr(sbs, "gpu_count", lambda: 2)
    monkeypatch.setattr(sbs, "_placed", [])
    monkeypatch.setattr(sbs, "fit_command", lambda recipe, run_dir, sets: [sys.executable, "-c", PLACED, str(run_dir)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    procs = {}

    def start(name: str) -> str:
        procs[name] = sbs.start_fit("recipe", tmp_path / name, [], tmp_path / f"fit-{name}.log")
        return _gpu_of(tmp_path / name)

    def finish(name: str) -> None:
        (tmp_path / name / "go").touch()
        procs[name].wait()

    try:
        assert [start("a"), start("b"), start("c")] == ["0", "1", "0"]
        finish("a")
        finish("c")  # GPU 0 is free again: counted so, not as two runs
        assert start("d") == "0"
        assert start("e") == "0" and start("f") == "1"  # a tie goes to the first: 2 and 1 a GPU, then 2 and 2
        # the parent's own CUDA_VISIBLE_DEVICES: the runs go to its GPUs, by its ids
        for name in "bdef":
            finish(name)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
        assert [start("g"), start("h")] == ["5", "7"]
        for name in "gh":
            finish(name)
        # one GPU (or none): the environment is the parent's
        monkeypatch.setattr(sbs, "gpu_count", lambda: 1)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        assert start("i") == "None"
        finish("i")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def test_training_summary_gives_the_steady_rate_beside_the_one_with_compiles(tmp_path):
    """tokens over the steps' seconds counts a session's compile (the first steps, and again after a resume); the
    logged rate's median leaves those few steps out."""
    import json

    from side_by_side import training_summary

    # 20 steps of 1,000 tokens: steps 1 and 11 (a resume) take 10 s, the others 0.1 s at a logged 10k tokens/s
    records = [{"step": s, "tokens": 1000 * s, "loss": 1.0, "step_s": 10.0 if s in (1, 11) else 0.1,
                "tokens_per_s": 100.0 if s in (1, 11) else 10_000.0} for s in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    t = training_summary(tmp_path)
    assert t["tokens_per_s"] == round(20_000 / 21.8)  # 917: the compiles weigh in
    assert t["logged_tokens_per_s"] == 10_000
