"""benchmarks/recall_experiment.py's stage-1 check (issue 30): a circuit that has not formed trains again (longer,
or from a new init), only the unformed seeds; stage 2 then trains the seeds whose circuit formed and never one that did not, and the
experiment ends with a message naming those. A curriculum stage (--circuit-stage) trains first and the
circuit starts from it. A real run of the script's parts (real `longtrain fit` processes) at a toy size on the
CPU, with the circuit's recall measurement replaced so that one seed forms and the other does not."""

import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
TOY = ["train.steps=2", "model.layers=1", "model.d_model=32", "model.heads=2", "train.batch_docs=2",
       "data.recall.docs=200", "train.device=cpu", "checkpoint.every=2", "train.valid_every=0", "train.compile=false"]
TOY_STAGE2 = ["train.steps=2", "train.freeze.steps=1", "model.layers=1", "model.d_model=32", "model.heads=2",
              "train.batch_docs=2", "train.chunk_size=256", "data.recall.docs=200", "data.recall.doc_tokens=512",
              "data.recall.max_distance=256", "train.device=cpu", "checkpoint.every=2", "train.valid_every=0",
              "train.compile=false"]


def test_stage_2_trains_the_formed_seeds_and_names_the_one_that_did_not_form(tmp_path, monkeypatch, capsys):
    import recall_experiment as rx

    formed = {"circuit-s0": 0.95, "circuit-s1": 0.1}
    monkeypatch.setattr(rx, "circuit_recall", lambda run_dir, device: formed[run_dir.name])

    def argv(part: str, seeds: str) -> list[str]:
        return ["recall_experiment.py", "--out", str(tmp_path), "--part", part, "--model", "sparsek", "--seeds", seeds,
                "--device", "cpu", "--docs", "2", "--circuit-extensions", "2", "--circuit-retries", "0",
                "--circuit-stage", "data.recall.max_distance=32 train.steps=2",
                *[x for s in [*TOY, "model.rotary_pct=0.5"] for x in ("--circuit-set", s)],
                *[x for s in TOY_STAGE2 for x in ("--set", s)]]

    monkeypatch.setattr(sys, "argv", argv("all", "0,1"))
    with pytest.raises(SystemExit) as stop:
        rx.main()
    assert "did not form for seeds [1] (seed 1: 0.10 after 6 steps" in str(stop.value), capsys.readouterr().out[-3000:]
    state = json.loads((tmp_path / "circuit.json").read_text())
    assert state["0"] == {"steps": 2, "recall": 0.95, "attempt": 0}  # formed at once: never extended
    assert state["1"] == {"steps": 6, "recall": 0.1, "attempt": 0}  # 2 steps, then twice 2 more
    assert capsys.readouterr().out.count("circuit not formed for seeds [1] (< 0.9): training them 2 more steps") == 2
    metrics = [json.loads(x) for x in (tmp_path / "circuit-s1" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert max(r["step"] for r in metrics) == 6  # the extensions resumed the same run
    # stage 2: the formed seed trained from its circuit and was evaluated; the unformed one never started
    assert (tmp_path / "runs" / "sparsek-s0" / "checkpoints").is_dir()
    assert not (tmp_path / "runs" / "sparsek-s1").exists()
    stage2 = yaml.safe_load((tmp_path / "runs" / "sparsek-s0" / "recipe.yaml").read_text())
    assert Path(stage2["train"]["init_from"]).name == "circuit-s0"
    assert stage2["model"]["rotary_pct"] == 0.5  # the circuit's model settings reach stage 2
    assert "computes differently" not in (tmp_path / "fit-sparsek-s0.log").read_text()
    assert (tmp_path / "eval" / "sparsek-s0.json").is_file() and (tmp_path / "table.md").is_file()
    assert "- trained on cpu (" in (tmp_path / "table.md").read_text()  # the machine: formation depends on the card
    # the curriculum stage ran first, at its own distances, and the circuit started from its weights
    stage = yaml.safe_load((tmp_path / "warmup0-s1" / "recipe.yaml").read_text())
    assert stage["data"]["recall"]["max_distance"] == 32
    circuit = yaml.safe_load((tmp_path / "circuit-s1" / "recipe.yaml").read_text())
    assert circuit["data"]["recall"]["max_distance"] == 256
    assert Path(circuit["train"]["init_from"]).name == "warmup0-s1"
    # stage 2 alone refuses the recorded unformed seed, before anything trains
    monkeypatch.setattr(sys, "argv", argv("train", "1"))
    with pytest.raises(SystemExit, match=r"did not form for seeds \[1\]"):
        rx.main()
    assert not (tmp_path / "runs" / "sparsek-s1").exists()


def test_an_unformed_circuit_starts_over_from_a_new_init_and_stage_2_starts_from_the_attempt_that_formed(
        tmp_path, monkeypatch, capsys):
    import recall_experiment as rx

    recall = {"circuit-s0": 0.95, "circuit-s1": 0.1, "circuit-s1-a1": 0.898, "circuit-s1-a2": 0.97}
    monkeypatch.setattr(rx, "circuit_recall", lambda run_dir, device: recall[run_dir.name])
    monkeypatch.setattr(sys, "argv", [
        "recall_experiment.py", "--out", str(tmp_path), "--part", "all", "--model", "sparsek", "--seeds", "0,1",
        "--device", "cpu", "--docs", "2", "--circuit-stage", "data.recall.max_distance=32 train.steps=2",
        *[x for s in TOY for x in ("--circuit-set", s)], *[x for s in TOY_STAGE2 for x in ("--set", s)]])
    rx.main()  # every seed formed in the end: no exit
    out = capsys.readouterr().out
    state = json.loads((tmp_path / "circuit.json").read_text())
    assert state["0"] == {"steps": 2, "recall": 0.95, "attempt": 0}
    assert state["1"] == {"steps": 2, "recall": 0.97, "attempt": 2}  # the defaults: no extension, retries
    assert "seed 1: 0.89 after 2 steps (attempt 2)" in out  # 0.898 is under 0.9 and reads so
    assert "attempt 3 of 8 starts over from a new init (train.seed=2001 data.recall.seed=2002, in circuit-s1-a2)" in out
    for attempt, name in ((1, "circuit-s1-a1"), (2, "circuit-s1-a2")):
        circuit = yaml.safe_load((tmp_path / name / "recipe.yaml").read_text())
        assert circuit["train"]["seed"] == 1 + 1000 * attempt  # a new init
        assert circuit["data"]["recall"]["seed"] == 2 + 1000 * attempt  # and new documents
        assert Path(circuit["train"]["init_from"]).name == f"warmup0-s1-a{attempt}"  # each attempt has its curriculum
        warm = yaml.safe_load((tmp_path / f"warmup0-s1-a{attempt}" / "recipe.yaml").read_text())
        assert warm["train"]["seed"] == 1 + 1000 * attempt and warm["train"].get("init_from") is None
        assert warm["data"]["recall"]["seed"] == 2 + 1000 * attempt
    # seed 0's stage 2 started once its circuit formed, beside seed 1's retries
    assert out.index(f"--run-dir {tmp_path / 'runs' / 'sparsek-s0'} ") < out.index(f"--run-dir {tmp_path / 'circuit-s1-a1'} ")
    assert out.index(f"--run-dir {tmp_path / 'runs' / 'sparsek-s1'} ") > out.index(f"--run-dir {tmp_path / 'circuit-s1-a2'} ")
    stage2 = yaml.safe_load((tmp_path / "runs" / "sparsek-s1" / "recipe.yaml").read_text())
    assert Path(stage2["train"]["init_from"]).name == "circuit-s1-a2" and stage2["train"]["seed"] == 1
    assert stage2["data"]["recall"]["seed"] == 1  # the seed's own documents, whichever attempt formed
    assert stage2["train"]["deterministic"] and circuit["train"]["deterministic"]  # every run, by default
    assert Path(yaml.safe_load((tmp_path / "runs" / "sparsek-s0" / "recipe.yaml").read_text())["train"]["init_from"]).name == "circuit-s0"


def test_a_circuit_stopped_by_the_budget_logs_its_recall_so_far_and_resumes_unmeasured(tmp_path, monkeypatch, capsys):
    import recall_experiment as rx

    monkeypatch.setattr(rx, "circuit_recall", lambda run_dir, device: 0.42)

    def budget_ran_out(procs, budget_s):  # the runs finish (checkpoints written), then the budget counts as spent
        for p in procs.values():
            p.wait()
        return list(procs)

    monkeypatch.setattr(rx, "wait_all", budget_ran_out)
    monkeypatch.setattr(sys, "argv", ["recall_experiment.py", "--out", str(tmp_path), "--part", "circuit", "--seeds", "3",
                                      "--device", "cpu", "--circuit-stage", "none",
                                      *[x for s in TOY for x in ("--circuit-set", s)]])
    with pytest.raises(SystemExit, match="time budget ran out"):
        rx.main()
    assert "circuit-s3 so far: recall 0.42 at step 2 (not final)" in capsys.readouterr().out
    assert json.loads((tmp_path / "circuit.json").read_text())["3"] == {"steps": 2, "recall": None, "attempt": 0}  # measured on resume


def test_the_circuit_trains_after_the_default_curriculum_and_none_turns_it_off():
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


def test_every_run_is_evaluated_on_recall_sparsek_documents_also_an_ablation_that_trains_on_others():
    import recall_experiment as rx
    from longtrain.train.recipe import load_recipe

    standard = rx._standard_recall([])
    assert (standard.doc_tokens, standard.facts) == (4096, 8)
    assert rx._standard_recall(["data.recall.doc_tokens=512", "data.recall.max_distance=256"]).doc_tokens == 512
    recipe, sets = rx.model_args("sparsek-train4x")  # trains on the 4x setting itself
    trained = load_recipe(recipe, sets).data.recall
    assert (trained.doc_tokens, trained.facts) == (4 * standard.doc_tokens, 4 * standard.facts)


def test_the_verdict_names_the_runs_that_miss_the_target_and_counts_the_rest():
    import recall_experiment as rx

    def run(topk, window, *accuracies):  # buckets 512-1023, 1024-2048 (16x to 32x a budget of 64), 2049-4096
        edges = [512, 1024, 2049, 4097]
        return {"topk": topk, "window": window, "kv_budget": topk + window, "recall": {"train": [
            {"start": a, "end": b, "trials": 10, "accuracy": acc} for a, b, acc in zip(edges, edges[1:], accuracies)]}}

    res = {"settings": {"train": {"chance": {"exact": 0.01}}},
           "models": {"sparsek-s0": run(32, 32, 1.0, 0.97, 0.2), "sparsek-s3": run(32, 32, 0.94, 0.87, 0.1),
                      "sw-s0": run(0, 64, 0.0, 0.02, 0.0)}}
    lines = rx.verdict(res)
    assert lines[0] == "sparsek-s0: meets >= 0.95 at 1024-2048 (worst 0.970 at 1024-2048)"  # the 2049+ bucket is beyond 32x
    assert lines[1] == "sparsek-s3: MISSES >= 0.95 at 1024-2048 (worst 0.870 at 1024-2048)"
    assert lines[2] == "sw-s0: a window, recall at 1024-2048 (worst 0.020 at 1024-2048); chance 0.01"
    assert lines[-1].startswith("1 of 2 SparseK runs recall >= 0.95")
    assert rx.missed(res) == {"sparsek-s3": 0.87}  # the window is not a miss: it is meant to be at chance there
    assert "stage 2 missed the target in sparsek-s3 (0.870)" in rx.missed_message(res, Path("OUT"))


def test_circuit_recall_and_stage2_check_read_their_own_buckets_of_the_measurement(tmp_path, monkeypatch):
    """The real circuit_recall and stage2_check, with the checkpoint and measure_recall replaced by known buckets:
    circuit_recall is the trial-weighted mean of the buckets from max_distance // 2 on (formed at exactly
    CIRCUIT_FORMED, not just under it); stage2_check the worst bucket from 16x to 32x the KV budget, whatever its
    trials (kept at exactly TARGET_RECALL, retried just under it). Empty buckets never count."""
    from types import SimpleNamespace

    import longtrain.eval.recall as recall_mod
    import longtrain.train.checkpoint as checkpoint_mod
    import recall_experiment as rx

    assert (rx.CIRCUIT_FORMED, rx.TARGET_RECALL) == (0.9, 0.95)  # the edges the buckets below sit on
    ckpt = SimpleNamespace(recipe=SimpleNamespace(data=SimpleNamespace(recall=SimpleNamespace(max_distance=256, seed=7))),
                           model=SimpleNamespace(cfg=SimpleNamespace(attention="sparsek+sw", topk=32, window=32)))  # KV 64
    loads, calls, buckets = [], [], []
    monkeypatch.setattr(checkpoint_mod, "load_checkpoint", lambda run_dir, device: loads.append((run_dir, device)) or ckpt)
    monkeypatch.setattr(recall_mod, "measure_recall", lambda loaded, **settings: calls.append((loaded, settings)) or buckets)

    def measured(*rows):  # (start, end, trials, accuracy)
        buckets[:] = [{"start": a, "end": b, "trials": n, "accuracy": acc, "symbol_accuracy": acc and 0.5} for a, b, n, acc in rows]

    def circuit(far_acc):  # far = 256 // 2 = 128
        measured((32, 64, 50, 0.0), (64, 128, 50, 0.2),  # nearer than 128: left out (with them: 0.329)
                 (128, 192, 30, 1.0), (192, 224, 0, None), (224, 257, 10, far_acc))  # from 128 on; the empty one skipped
        return rx.circuit_recall(tmp_path / "circuit-s0", "cpu")

    assert circuit(0.6) == 0.9  # (30 * 1.0 + 10 * 0.6) / 40; unweighted (1.0 + 0.6) / 2 = 0.8 would not form
    assert rx.formed({"0": {"recall": circuit(0.6)}}, [0]) == [0]
    assert circuit(0.59) == pytest.approx(0.8975) and rx.formed({"0": {"recall": circuit(0.59)}}, [0]) == []
    assert loads[0] == (tmp_path / "circuit-s0", "cpu") and calls[0] == (ckpt, {"docs": 32})
    measured((32, 64, 50, 1.0))
    assert rx.circuit_recall(tmp_path / "circuit-s0", "cpu") == 0.0  # no far bucket: nothing recalled there

    def stage2(edge_acc):  # 16x to 32x a KV budget of 64: 1024..2048
        measured((512, 1024, 40, 0.1),  # before 16x: left out (the worst, if it counted)
                 (1024, 1536, 40, 0.97), (1536, 1800, 0, None),  # from 16x on; the empty one skipped
                 (1800, 2049, 8, edge_acc),  # to 32x inclusive: its few trials count as much as the 40 (min, not a mean)
                 (2049, 4097, 40, 0.2))  # beyond 32x: left out
        return rx.stage2_check(tmp_path / "runs" / "sparsek-s0", "cpu", [], docs=3)

    assert stage2(0.95) == 0.95  # the trial-weighted mean (0.9667) or the 0.97 bucket alone would hide it
    assert rx.settled({"checked": True, "recall": stage2(0.95), "attempt": 0}, retries=2)
    assert stage2(0.9499) == 0.9499 and not rx.settled({"checked": True, "recall": stage2(0.9499), "attempt": 0}, retries=2)
    rc = rx._standard_recall([])
    assert calls[-1] == (ckpt, {"docs": 3, "doc_tokens": rc.doc_tokens, "facts": rc.facts, "min_distance": rc.min_distance,
                                "max_distance": rc.max_distance, "seed": rx.CHECK_SEED + 7})  # documents the evaluation never reads
    measured((512, 1024, 40, 0.1), (2049, 4097, 40, 0.2))
    assert rx.stage2_check(tmp_path / "runs" / "sparsek-s0", "cpu", []) is None  # nothing from 16x to 32x to check
    assert calls[-1][1]["docs"] == rx.CHECK_DOCS


def test_the_whole_experiment_exits_non_zero_naming_a_stage_2_run_that_misses_the_target(tmp_path, monkeypatch):
    import recall_experiment as rx

    def run(topk, window, far):  # one bucket 1024-2048: 16x to 32x a KV budget of 64
        return {"topk": topk, "window": window, "kv_budget": 64,
                "recall": {"train": [{"start": 1024, "end": 2049, "trials": 80, "accuracy": far}]}}

    res = {"settings": {"train": {"chance": {"exact": 0.01}}},
           "models": {"sparsek-s0": run(32, 32, 0.889), "sparsek-s1": run(32, 32, 0.988), "sw-s0": run(0, 64, 0.01)}}
    monkeypatch.setattr(rx, "circuit", lambda *a, **k: {})  # every stage ran: only the ending is under test
    monkeypatch.setattr(rx, "evaluate", lambda *a, **k: None)
    monkeypatch.setattr(rx, "plot", lambda out: res)  # table.md and the plot from these results
    monkeypatch.setattr(sys, "argv", ["recall_experiment.py", "--out", str(tmp_path), "--part", "all", "--seeds", "0,1"])
    with pytest.raises(SystemExit, match=r"stage 2 missed the target in sparsek-s0 \(0\.889\): exact recall under 0\.95"):
        rx.main()
    res["models"]["sparsek-s0"] = run(32, 32, 0.95)
    rx.main()  # every SparseK run met it: no exit


def test_a_stage_2_run_under_the_target_starts_over_from_its_circuit_with_a_new_train_seed(tmp_path, monkeypatch, capsys):
    import recall_experiment as rx

    monkeypatch.setattr(rx, "circuit_recall", lambda run_dir, device: 0.95)  # every circuit formed
    checks = {"sparsek-s0": [0.5, 0.97], "sparsek-s1": [0.5, 0.6]}  # the check of each attempt, in turn
    checked = []

    def check(run_dir, device, sets, docs):
        checked.append(run_dir.name)
        assert docs == 1  # half of --docs
        return checks[run_dir.name].pop(0)

    monkeypatch.setattr(rx, "stage2_check", check)
    monkeypatch.setattr(sys, "argv", [
        "recall_experiment.py", "--out", str(tmp_path), "--part", "all", "--model", "sparsek", "--seeds", "0,1",
        "--device", "cpu", "--docs", "2", "--stage2-retries", "1", "--circuit-stage", "none",
        *[x for s in TOY for x in ("--circuit-set", s)], *[x for s in TOY_STAGE2 for x in ("--set", s)]])
    rx.main()  # the toy's documents hold no distance 16x its KV budget: no miss to exit on
    out = capsys.readouterr().out
    assert sorted(checked) == ["sparsek-s0", "sparsek-s0", "sparsek-s1", "sparsek-s1"]
    assert not rx.is_sparsek("sw", []) and rx.is_sparsek("sparsek-only", [])  # a window is never checked
    state = json.loads((tmp_path / "stage2.json").read_text())
    assert state["sparsek-s0"] == {"attempt": 1, "checked": True, "recall": 0.97, "failed": [0.5]}
    assert state["sparsek-s1"] == {"attempt": 1, "checked": True, "recall": 0.6, "failed": [0.5]}  # no attempt left
    for seed in (0, 1):
        failed = tmp_path / "runs-failed" / f"sparsek-s{seed}-a0"
        assert (failed / "checkpoints").is_dir()  # kept
        again = yaml.safe_load((tmp_path / "runs" / f"sparsek-s{seed}" / "recipe.yaml").read_text())
        assert again["train"]["seed"] == seed + 1000 and again["data"]["recall"]["seed"] == seed  # new init, same documents
        assert Path(again["train"]["init_from"]).name == f"circuit-s{seed}"  # from its circuit again
        assert yaml.safe_load((failed / "recipe.yaml").read_text())["train"]["seed"] == seed
    assert "stage 2 of sparsek-s0 under 0.95 (0.500): attempt 2 of 2 starts over from its circuit" in out
    table = (tmp_path / "table.md").read_text()
    assert "sparsek-s0: stage 2 attempt 2; the earlier attempts' checks 0.500" in table
    assert sorted(p.stem for p in (tmp_path / "eval").glob("*.json")) == ["sparsek-s0", "sparsek-s1"]  # the last attempts


# --attempts-at-once: the orchestration with a stand-in for `longtrain fit` (a process that makes the run's checkpoints
# folder, records its overrides and "trains" for a while; SIGTERM: it saves and exits), the circuit's recall and the
# stage 2 check read from what each run was started with.
FAKE_FIT = """import json, signal, sys, time
from pathlib import Path
run, seconds = Path(sys.argv[1]), float(sys.argv[2])
run.mkdir(parents=True, exist_ok=True)
signal.signal(signal.SIGTERM, lambda *_: ((run / "stopped").touch(), sys.exit(0)))
(run / "sets.json").write_text(sys.argv[3])
(run / "checkpoints").mkdir(exist_ok=True)
time.sleep(seconds)
(run / "finished").touch()
"""


def _fake_runs(monkeypatch, rx, seconds=lambda run_dir, sets: 0.0):
    """start_fit, wait_all, evaluate and plot replaced: returns the started runs [(run dir name, sets)] and the rounds
    (each wait_all's runs, in order)."""
    import functools
    import subprocess

    from side_by_side import wait_all, wait_first

    started, rounds = [], []

    def start_fit(recipe, run_dir, sets, log_path):
        started.append((run_dir.name, list(sets)))
        return subprocess.Popen([sys.executable, "-c", FAKE_FIT, str(run_dir), str(seconds(run_dir, sets)), json.dumps(sets)])

    def waited(procs, budget_s):
        rounds.append(sorted(procs))
        return wait_all(procs, budget_s)

    monkeypatch.setattr(rx, "start_fit", start_fit)
    monkeypatch.setattr(rx, "wait_all", waited)
    monkeypatch.setattr(rx, "wait_first", functools.partial(wait_first, poll_s=0.05))
    monkeypatch.setattr(rx, "evaluate", lambda *a, **k: None)
    monkeypatch.setattr(rx, "plot", lambda out: {"models": {}})
    return started, rounds


def _last(sets: list[str], key: str) -> str:
    return [s.split("=", 1)[1] for s in sets if s.startswith(key + "=")][-1]


def _circuits(tmp_path, monkeypatch, at_once: int, recall: dict, *args: str):
    """--part all on seed 0 with `recall[(circuit dir name, its step target)]`; returns (circuit.json's seed 0, the
    rounds of circuits and warm-ups, stage 2's init_from, the runs started)."""
    import recall_experiment as rx

    started, rounds = _fake_runs(monkeypatch, rx)
    steps = lambda run_dir: int(_last([s for n, sets in started if n == run_dir.name for s in sets], "train.steps"))  # noqa: E731
    monkeypatch.setattr(rx, "circuit_recall", lambda run_dir, device: recall[(run_dir.name, steps(run_dir))])
    monkeypatch.setattr(rx, "stage2_check", lambda *a, **k: 0.97)
    monkeypatch.setattr(sys, "argv", [
        "recall_experiment.py", "--out", str(tmp_path), "--part", "all", "--model", "sparsek", "--seeds", "0",
        "--device", "cpu", "--attempts-at-once", str(at_once), "--circuit-stage", "train.steps=1",
        "--circuit-set", "train.steps=2", *args])
    rx.main()
    state = json.loads((tmp_path / "circuit.json").read_text())["0"]
    init_from = Path(_last(next(sets for n, sets in started if n == "sparsek-s0"), "train.init_from")).name
    return state, rounds, init_from, started


def test_attempts_at_once_trains_a_circuits_next_attempts_beside_it_and_keeps_the_sequential_result(tmp_path, monkeypatch):
    recall = {("circuit-s0", 2): 0.67, ("circuit-s0-a1", 2): 0.5, ("circuit-s0-a2", 2): 1.0, ("circuit-s0-a3", 2): 0.2}
    one, rounds1, init1, _ = _circuits(tmp_path / "one", monkeypatch, 1, recall)
    assert one == {"steps": 2, "recall": 1.0, "attempt": 2}  # the sequential run: three attempts, one after another
    assert rounds1 == [["warmup0-s0"], ["circuit-s0"], ["warmup0-s0-a1"], ["circuit-s0-a1"], ["warmup0-s0-a2"],
                       ["circuit-s0-a2"]] and init1 == "circuit-s0-a2"

    three, rounds3, init3, started = _circuits(tmp_path / "three", monkeypatch, 3, recall)
    assert rounds3 == [["warmup0-s0", "warmup0-s0-a1", "warmup0-s0-a2"], ["circuit-s0", "circuit-s0-a1", "circuit-s0-a2"]]
    assert three.pop("tried") == {"0": 0.67, "1": 0.5, "2": 1.0} and three == one  # the same, and sooner
    assert init3 == "circuit-s0-a2"
    seeds = {n: (_last(sets, "train.seed"), _last(sets, "data.recall.seed")) for n, sets in started}
    assert seeds["circuit-s0-a2"] == ("2000", "2001") and seeds["warmup0-s0-a2"] == ("2000", "2001")  # its own init
    assert Path(_last(dict(started)["circuit-s0-a2"], "train.init_from")).name == "warmup0-s0-a2"  # and curriculum

    two, rounds2, init2, _ = _circuits(tmp_path / "two", monkeypatch, 2, recall)
    assert [r for r in rounds2 if r[0].startswith("circuit")] == [["circuit-s0", "circuit-s0-a1"],
                                                                 ["circuit-s0-a2", "circuit-s0-a3"]]
    assert two.pop("tried") == {"0": 0.67, "1": 0.5, "2": 1.0, "3": 0.2} and two == one and init2 == "circuit-s0-a2"


def test_attempts_trained_ahead_of_a_circuit_that_formed_are_not_used(tmp_path, monkeypatch):
    recall = {("circuit-s0", 2): 0.95, ("circuit-s0-a1", 2): 1.0, ("circuit-s0-a2", 2): 0.3}
    state, rounds, init_from, _ = _circuits(tmp_path, monkeypatch, 3, recall)
    assert [r for r in rounds if r[0].startswith("circuit")] == [["circuit-s0", "circuit-s0-a1", "circuit-s0-a2"]]
    assert state == {"steps": 2, "recall": 0.95, "attempt": 0, "tried": {"0": 0.95, "1": 1.0, "2": 0.3}}
    assert init_from == "circuit-s0"  # stage 2 starts from attempt 0, as one at a time


def test_attempts_at_once_with_extensions_extends_an_attempt_trained_ahead_as_the_sequential_run_does(tmp_path, monkeypatch):
    recall = {("circuit-s0", 2): 0.5, ("circuit-s0", 4): 0.6, ("circuit-s0-a1", 2): 0.7, ("circuit-s0-a1", 4): 0.92}
    args = ("--circuit-extensions", "1", "--circuit-retries", "1")
    one, rounds1, _, _ = _circuits(tmp_path / "one", monkeypatch, 1, recall, *args)
    assert one == {"steps": 4, "recall": 0.92, "attempt": 1}
    two, rounds2, init2, started = _circuits(tmp_path / "two", monkeypatch, 2, recall, *args)
    assert [r for r in rounds2 if r[0].startswith("circuit")] == [["circuit-s0", "circuit-s0-a1"], ["circuit-s0"],
                                                                 ["circuit-s0-a1"]]
    assert two.pop("tried") == {"0": 0.5, "1": 0.7} and two == one and init2 == "circuit-s0-a1"
    assert [_last(sets, "train.steps") for n, sets in started if n == "circuit-s0-a1"] == ["2", "4"]  # resumed, extended


def test_attempts_at_once_resume_after_the_budget_without_a_second_curriculum(tmp_path, monkeypatch):
    import recall_experiment as rx

    recall = {("circuit-s0", 2): 0.5, ("circuit-s0-a1", 2): 0.95}
    started, rounds = _fake_runs(monkeypatch, rx)
    real_wait = rx.wait_all

    def budget_ran_out(procs, budget_s):  # the circuits finish, then the budget counts as spent
        if any(name.startswith("circuit") for name in procs):
            real_wait(procs, budget_s)
            return list(procs)
        return real_wait(procs, budget_s)

    monkeypatch.setattr(rx, "wait_all", budget_ran_out)
    progress = []
    monkeypatch.setattr(rx, "log_progress", lambda out, runs, device: progress.append(runs))
    steps = lambda run_dir: int(_last([s for n, sets in started if n == run_dir.name for s in sets], "train.steps"))  # noqa: E731
    monkeypatch.setattr(rx, "circuit_recall", lambda run_dir, device: recall[(run_dir.name, steps(run_dir))])
    monkeypatch.setattr(sys, "argv", ["recall_experiment.py", "--out", str(tmp_path), "--part", "circuit", "--seeds", "0",
                                      "--device", "cpu", "--attempts-at-once", "2", "--circuit-stage", "train.steps=1",
                                      "--circuit-set", "train.steps=2"])
    with pytest.raises(SystemExit, match="time budget ran out"):
        rx.main()
    assert json.loads((tmp_path / "circuit.json").read_text())["0"] == {"steps": 2, "recall": None, "attempt": 0}
    assert progress == [[(0, 0), (0, 1)]]  # both circuits' recall so far is logged
    monkeypatch.setattr(rx, "wait_all", real_wait)
    del started[:]
    rx.main()
    assert [n for n, _ in started] == ["circuit-s0", "circuit-s0-a1"]  # resumed, past their curriculum
    assert json.loads((tmp_path / "circuit.json").read_text())["0"] == {
        "steps": 2, "recall": 0.95, "attempt": 1, "tried": {"0": 0.5, "1": 0.95}}


def _stage2(tmp_path, monkeypatch, at_once: int):
    """--part all, seed 0, sparsek and sw: every circuit forms; sparsek's attempt 0 fails its check (and trains longest
    but one), attempt 1 passes (and finishes first), attempt 2 would train on for a minute. Returns the checks
    (attempts, in order) and stage2.json."""
    import recall_experiment as rx

    attempt = lambda sets: int(_last(sets, "train.seed")) // 1000  # noqa: E731
    secs = {0: 1.0, 1: 0.2, 2: 60.0}
    _fake_runs(monkeypatch, rx, lambda run_dir, sets: secs[attempt(sets)] if run_dir.parent.name != tmp_path.name else 0.0)
    monkeypatch.setattr(rx, "circuit_recall", lambda run_dir, device: 0.95)
    checks = []

    def check(run_dir, device, sets, docs):
        assert run_dir == tmp_path / "runs" / "sparsek-s0"  # checked where the sequential run is
        checks.append(attempt(json.loads((run_dir / "sets.json").read_text())))
        return {0: 0.5, 1: 0.97}[checks[-1]]

    monkeypatch.setattr(rx, "stage2_check", check)
    monkeypatch.setattr(sys, "argv", [
        "recall_experiment.py", "--out", str(tmp_path), "--part", "all", "--model", "sparsek,sw", "--seeds", "0",
        "--device", "cpu", "--circuit-stage", "none", "--circuit-retries", "0", "--attempts-at-once", str(at_once)])
    rx.main()
    return checks, json.loads((tmp_path / "stage2.json").read_text())


def test_stage_2_attempts_at_once_keep_the_first_that_passes_in_runs_and_set_the_later_ones_aside(tmp_path, monkeypatch):
    checks1, state1 = _stage2(tmp_path / "one", monkeypatch, 1)
    assert checks1 == [0, 1] and state1 == {"sparsek-s0": {"attempt": 1, "checked": True, "recall": 0.97, "failed": [0.5]}}

    out = tmp_path / "three"
    checks, state = _stage2(out, monkeypatch, 3)
    assert checks == [0, 1]  # in order, though attempt 1 finished first; attempt 2 never checked
    finished = lambda run: (run / "finished").stat().st_mtime  # noqa: E731
    assert finished(out / "runs" / "sparsek-s0") < finished(out / "runs-failed" / "sparsek-s0-a0")
    assert state["sparsek-s0"].pop("unused") == [2] and state == state1
    seed_of = lambda run: _last(json.loads((run / "sets.json").read_text()), "train.seed")  # noqa: E731
    assert seed_of(out / "runs" / "sparsek-s0") == "1000" and (out / "runs" / "sparsek-s0" / "finished").exists()
    assert seed_of(out / "runs-failed" / "sparsek-s0-a0") == "0"
    unused = out / "runs-unused" / "sparsek-s0-a2"
    assert seed_of(unused) == "2000" and (unused / "stopped").exists() and not (unused / "finished").exists()
    assert not any((out / "runs-retry").iterdir())
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["sparsek-s0", "sw-s0"]  # a window: one attempt only
    assert not list(out.glob("runs-*/sw-*"))


def test_stage_2_attempts_at_once_resume_after_the_budget_where_the_attempt_ahead_trains(tmp_path, monkeypatch):
    import recall_experiment as rx

    attempt = lambda sets: int(_last(sets, "train.seed")) // 1000  # noqa: E731
    secs = {0: 0.2, 1: 60.0}
    started, _ = _fake_runs(monkeypatch, rx, lambda run_dir, sets: secs[attempt(sets)] if run_dir.parent.name.startswith("runs") else 0.0)
    monkeypatch.setattr(rx, "circuit_recall", lambda run_dir, device: 0.95)
    monkeypatch.setattr(rx, "stage2_check", lambda run_dir, *a: {0: 0.5, 1: 0.97}[
        attempt(json.loads((run_dir / "sets.json").read_text()))])
    argv = ["recall_experiment.py", "--out", str(tmp_path), "--part", "all", "--model", "sparsek", "--seeds", "0",
            "--device", "cpu", "--circuit-stage", "none", "--circuit-retries", "0", "--stage2-retries", "1",
            "--attempts-at-once", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--budget-s", "3"])
    with pytest.raises(SystemExit, match="time budget ran out"):
        rx.main()  # attempt 0 failed its check; attempt 1, ahead, was stopped at the budget
    ahead = tmp_path / "runs-retry" / "sparsek-s0-a1"
    assert (ahead / "stopped").exists() and not (tmp_path / "runs" / "sparsek-s0").exists()
    assert json.loads((tmp_path / "stage2.json").read_text())["sparsek-s0"]["attempt"] == 1
    secs[1] = 0.1
    del started[:]
    monkeypatch.setattr(sys, "argv", argv)
    rx.main()
    assert [n for n, _ in started] == ["sparsek-s0-a1"]  # resumed where it trained; nothing else
    assert json.loads((tmp_path / "stage2.json").read_text())["sparsek-s0"] == {
        "attempt": 1, "checked": True, "recall": 0.97, "failed": [0.5]}
    assert (tmp_path / "runs" / "sparsek-s0" / "finished").exists() and not ahead.exists()
