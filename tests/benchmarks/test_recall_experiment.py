"""benchmarks/recall_experiment.py's stage-1 check (issue 30): a circuit that has not formed trains again, only
the unformed seeds, and then the experiment stops with a message naming them; stage 2 never starts from it.
A curriculum stage (--circuit-stage) trains first and the circuit starts from it.
A real run of the script (real `longtrain fit` processes) at a toy size on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TOY = ["train.steps=2", "model.layers=1", "model.d_model=32", "model.heads=2", "train.batch_docs=2",
       "data.recall.docs=200", "train.device=cpu", "checkpoint.every=2", "train.valid_every=0", "train.compile=false"]


def test_an_unformed_circuit_trains_again_then_stops_with_a_message(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "recall_experiment.py"), "--out", str(tmp_path), "--part", "all",
           "--model", "sparsek", "--seeds", "3", "--device", "cpu", "--circuit-budget-s", "600",
           "--circuit-stage", "data.recall.max_distance=32 train.steps=2"]
    for s in TOY:
        cmd += ["--circuit-set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode != 0
    assert "did not form for seeds [3] after 6 steps" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    state = json.loads((tmp_path / "circuit.json").read_text())
    assert state["3"]["steps"] == 6 and state["3"]["recall"] < 0.9  # 2 steps, then twice 2 more
    assert out.stdout.count("training them 2 more steps") == 2
    assert not (tmp_path / "runs").exists()  # stage 2 did not start from a circuit that cannot recall
    metrics = [json.loads(x) for x in (tmp_path / "circuit-s3" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert max(r["step"] for r in metrics) == 6  # the extensions resumed the same run
    # the curriculum stage ran first, at its own distances, and the circuit started from its weights
    stage = yaml.safe_load((tmp_path / "warmup0-s3" / "recipe.yaml").read_text())
    assert stage["data"]["recall"]["max_distance"] == 32
    circuit = yaml.safe_load((tmp_path / "circuit-s3" / "recipe.yaml").read_text())
    assert circuit["data"]["recall"]["max_distance"] == 256
    assert Path(circuit["train"]["init_from"]).name == "warmup0-s3"


def test_the_circuit_trains_after_the_default_curriculum_and_none_turns_it_off():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import recall_experiment as rx
    from longtrain.train.recipe import load_recipe

    stages = rx.curriculum([])
    assert stages == [s.split() for s in rx.CIRCUIT_CURRICULUM] and stages
    assert rx.curriculum(["none"]) == []
    assert rx.curriculum(["train.steps=5", "train.steps=7"]) == [["train.steps=5"], ["train.steps=7"]]
    # the curriculum's distances are shorter than the circuit's, and both recipes load
    near = load_recipe(rx.CIRCUIT, stages[0]).data.recall
    far = load_recipe(rx.CIRCUIT, []).data.recall
    assert near.max_distance <= far.min_distance < far.max_distance
