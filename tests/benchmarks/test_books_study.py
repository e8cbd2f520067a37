"""benchmarks/books_study.py end to end at a toy size on the CPU (real `longtrain fit` and `longtrain eval`
processes): three models side by side, a seed each plus a second SparseK+SW seed, the table with the seed
range, steps and tokens/s, the SW gap and the linear part's gap with its time ratio, the gap picture."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOY = ["model.layers=1", "model.d_model=32", "model.heads=2", "tokenizer.vocab_size=300", "train.chunk_size=128",
       "train.batch_docs=2", "train.device=cpu", "train.valid_every=2", "train.valid_tokens=256", "train.compile=false"]


def books(folder: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    words = "the river house letter morning captain garden window silence evening mountain quiet ship".split()
    folder.mkdir()
    for i in range(n):
        (folder / f"book{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(3000)))
    return folder


LIN = "sparsek+linear@attention.eps_slope=3e-3"  # a variant (its own recipe setting) end to end


def test_two_models_train_evaluate_and_summarise(tmp_path):
    train, valid = books(tmp_path / "train", 4, 0), books(tmp_path / "valid", 2, 1)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "books_study.py"), "--train", str(train), "--valid", str(valid),
           "--out", str(out), "--run", "sparsek:0,1", "--run", "sw:0", "--run", f"{LIN}:0", "--steps", "4", "--part", "all",
           "--docs", "2", "--tokens", "1024"]
    for s in TOY:
        cmd += ["--set", s]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = (out / "books.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["sparsek"].split("|")[2].strip() == "2" and rows["sw"].split("|")[2].strip() == "1"  # seeds
    assert "(" in rows["sparsek"] and "(" not in rows["sw"]  # the range only where there are several seeds
    assert "sw − sparsek" in rows
    assert rows["sparsek"].split("|")[3].strip() == "4/4" and rows["sw"].split("|")[3].strip() == "4"  # steps per seed
    assert all(float(rows[m].split("|")[4].replace(",", "")) > 0 for m in ("sparsek", "sw", LIN))  # tokens/s
    assert "× time" in rows[f"sparsek − {LIN}"].split("|")[4]
    assert (out / "books-gap.png").stat().st_size > 10_000
    recipe = (out / "runs" / f"{LIN}-s0" / "recipe.yaml").read_text()
    assert "eps_slope: 0.003" in recipe  # the variant's setting
    # a plain model name keeps fit's default slope, whatever the base recipe (gutenberg-sparsek) ships
    assert "eps_slope: 0.001" in (out / "runs" / "sparsek-s0" / "recipe.yaml").read_text()
    assert "deterministic: true" in recipe  # every run of a seed study repeats
    lin_file = "sparsek_linear__attention.eps_slope-3e-3"  # OUT's file names: plain characters only
    assert sorted(p.name for p in out.glob("curve-*.json")) == ["curve-sparsek-s0.json", "curve-sparsek-s1.json",
                                                            f"curve-{lin_file}-s0.json", "curve-sw-s0.json"]
    assert (out / f"fit-{lin_file}-s0.log").is_file() and (out / f"train-{lin_file}-s0.json").is_file()
    import json

    gains = json.loads((out / f"train-{lin_file}-s0.json").read_text())["linear_gains"]  # [layer][head], x F
    assert len(gains) == 1 and len(gains[0]) == 2 and all(g > 0 for g in gains[0]) and gains[0] != [1.0, 1.0]  # trained
    assert f"{LIN}: learned linear gain × F by layer at the end" in table
    assert "linear_gains" not in json.loads((out / "train-sw-s0.json").read_text())  # no linear part, no gains
    made = json.loads((out / "train-sw-s0.json").read_text())  # what the numbers came from, by the checkpoint
    assert len(made["corpus"]) == 32 and made["machine"]["device"].startswith("cpu") and "attention" in made["hashes"]
    assert not [p.name for p in out.iterdir() if set(p.name) - set("abcdefghijklmnopqrstuvwxyz0123456789-_.")]

    # A later study takes SW from this one's books_study.json instead of training it again
    out2 = tmp_path / "out2"
    cmd2 = [sys.executable, str(ROOT / "benchmarks" / "books_study.py"), "--train", str(train), "--valid", str(valid),
            "--out", str(out2), "--run", "sparsek-192-64:0", "--steps", "4", "--docs", "2", "--tokens", "1024"]
    for s in TOY:
        cmd2 += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([*cmd2, "--part", "all", "--baseline", f"{out / 'books_study.json'}:sw"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table2 = (out2 / "books.md").read_text()
    rows2 = {line.split("|")[1].strip(): line for line in table2.splitlines() if line.startswith("| ")}
    assert rows2["sw"].split("|")[5:] == rows["sw"].split("|")[5:]  # the stored perplexities, unchanged
    assert "sw − sparsek-192-64" in rows2 and "not trained in this study" in table2
    assert not (out2 / "runs" / "sw-s0").exists() and (out2 / "curve-sw-s0.json").is_file()
    stored = f"{out / 'books_study.json'}"
    for bad, extra, why in ((f"{stored}:full", [], "has no full"), (f"{stored}:sparsek-192-64", [], "has no sparsek-192-64"),
                            (f"{stored}:sw", ["--kv-budget", "128"], "at 256 keys")):  # another budget's baseline
        res = subprocess.run([*cmd2, "--part", "summary", *extra, "--baseline", bad], capture_output=True, text=True,
                             cwd=ROOT, env=env, timeout=600)
        assert res.returncode != 0 and why in res.stderr, res.stderr[-2000:]


def test_model_variants_get_their_own_runs_settings_and_rows():
    """`--run MODEL@KEY=VALUE:SEEDS`: a run per seed named after the variant, its settings after the model's, and a
    gap row against SW like any SparseK+SW model; a setting without `=` is refused before anything runs."""
    import argparse

    import pytest

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import books_study

    a = argparse.Namespace(size="small", kv_budget=None, run=["sw:0", "sparsek@attention.eps_slope=3e-3@train.score_distill=0.1:1,2"])
    runs = books_study.runs_of(a)
    assert runs == {"sw-s0": ("sw", 0), "sparsek@attention.eps_slope=3e-3@train.score_distill=0.1-s1": (
        "sparsek@attention.eps_slope=3e-3@train.score_distill=0.1", 1),
        "sparsek@attention.eps_slope=3e-3@train.score_distill=0.1-s2": (
        "sparsek@attention.eps_slope=3e-3@train.score_distill=0.1", 2)}
    model = runs["sparsek@attention.eps_slope=3e-3@train.score_distill=0.1-s1"][0]
    assert books_study.model_sets(model, 256) == ["attention.type=sparsek+sw", "attention.topk=128",
                                                  "attention.window=128", "attention.eps_slope=3e-3",
                                                  "train.score_distill=0.1"]
    assert books_study.gap_pairs(["sw", "sparsek", model, "sparsek-64-192", "sparsek+linear@x=1", "linear", "full",
                                  "sparsek+linear-192-64@x=1"]) == [
        ("sw", "sparsek"), ("sw", model), ("sw", "sparsek-64-192"), ("sparsek", "sparsek+linear@x=1"),
        ("sw", "sparsek+linear@x=1"), ("sw", "linear"), ("sparsek-192-64", "sparsek+linear-192-64@x=1"),
        ("sw", "sparsek+linear-192-64@x=1")]
    gained = "sparsek+linear-192-64@attention.eps_slope=3e-3@attention.linear_gain=learned"  # a linear-only setting
    assert books_study.gap_pairs(["sw", "sparsek-192-64@attention.eps_slope=3e-3", gained])[1:] == [
        ("sparsek-192-64@attention.eps_slope=3e-3", gained), ("sw", gained)]
    assert books_study.model_sets("sparsek+linear-192-64", 256) == [
        "attention.type=sparsek+linear+sw", "attention.topk=192", "attention.window=64"]
    medium256 = argparse.Namespace(size="medium", kv_budget=256, run=["sw:0"])  # --kv-budget over the size's 1,024
    assert books_study.model_sets("sw", books_study.kv_budget(medium256))[-1] == "attention.window=256"
    assert books_study.kv_budget(argparse.Namespace(size="medium", kv_budget=None)) == 1024
    with pytest.raises(SystemExit, match="not the KV budget 256"):
        books_study.runs_of(argparse.Namespace(size="medium", kv_budget=256, run=["sparsek-768-256:0"]))
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        books_study.runs_of(argparse.Namespace(size="small", kv_budget=None, run=["sparsek@eps:0"]))
    with pytest.raises(SystemExit, match="unknown model"):
        books_study.runs_of(argparse.Namespace(size="small", kv_budget=None, run=["sparse@attention.eps_slope=1:0"]))


def test_a_baseline_adds_other_seeds_of_a_model_and_refuses_the_same_seed_twice(tmp_path):
    """A study split over sessions: the stored seeds of a model join this study's other seeds of it in one row (one
    run each); a stored seed that also ran here is refused, not counted twice."""
    import argparse
    import json

    import pytest

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import books_study

    def result(name: str, ppl: float) -> dict:
        return {"checkpoint": f"/runs/{name}/checkpoints/step-00000004",
                "ppl": {"ppl": ppl, "buckets": [{"start": 0, "end": 1024, "ppl": ppl}]}}

    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps({
        "size": "medium", "kv_budget": 256, "docs": 12, "tokens": 65536, "device": "H200", "tree": "abc1234",
        "eval": [result("sw-s0", 47.0), result("sw-s1", 46.0)],
        "train": {n: {"steps": 4, "tokens": 100, "tokens_per_s": 1.0, "corpus": "b" * 32} for n in ("sw-s0", "sw-s1")},
        "valid_loss_curves": {n: [[100, 4.0]] for n in ("sw-s0", "sw-s1")}}))
    a = argparse.Namespace(baseline=[f"{stored}:sw"], size="medium", kv_budget=256, docs=12, tokens=65536, out=tmp_path)
    res = [result("sw-s2", 45.0)]
    (tmp_path / "train-sw-s2.json").write_text(json.dumps({"steps": 4, "corpus": "b" * 32}))  # the same token stream
    notes = books_study.add_baselines(a, res)
    assert sorted(books_study.run_name(r["checkpoint"]) for r in res) == ["sw-s0", "sw-s1", "sw-s2"]
    assert len(notes) == 1 and "seeds 0, 1" in notes[0] and "abc1234" in notes[0]
    (tmp_path / "train-sw-s2.json").write_text(json.dumps({"steps": 4, "corpus": "a" * 32}))  # other books or tokenizer
    notes = books_study.add_baselines(a, [result("sw-s2", 45.0)])
    assert "another token stream" in notes[1] and "a" * 32 in notes[1]
    assert (tmp_path / "curve-sw-s1.json").is_file() and (tmp_path / "train-sw-s0.json").is_file()
    with pytest.raises(SystemExit, match="sw-s1 also ran in this study"):
        books_study.add_baselines(a, [result("sw-s1", 45.0)])


def test_the_time_ratio_takes_this_studys_own_runs_where_both_models_have_some():
    """A stored seed trained beside other loads (or alone) says little about speed: the ratio is the same-run one
    where both models trained here, and marked * where it has to take stored runs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import books_study

    speed = {"sw": ("6200/6200/6200", 250_000.0), "sparsek": ("6200/6200/6200", 125_000.0)}
    own = {"sw": ("6200", 210_000.0), "sparsek": ("6200", 175_000.0)}
    assert books_study.time_ratio("sw", "sparsek", speed, own) == "1.20× time"
    assert books_study.time_ratio("sw", "sparsek", speed, {"sparsek": own["sparsek"]}) == "2.00× time*"
    assert books_study.time_ratio("sw", "sparsek", {"sw": ("4", None), "sparsek": ("4", 1.0)}, {}) == ""


def test_the_table_compares_one_measure_of_tokens_per_s(tmp_path):
    """The steady rate where every run has one; else, as soon as one run (a stored one) lacks it, tokens over training
    seconds for all, so that a time ratio never sets one measure against the other."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import books_study

    def run(name, **train):
        (tmp_path / f"train-{books_study.file_stem(name)}.json").write_text(json.dumps({"steps": 10, "tokens": 100, **train}))
        return {"checkpoint": f"/r/{name}/checkpoints/step-00000010"}

    new = [run("sw-s0", tokens_per_s=80.0, logged_tokens_per_s=100.0), run("sw-s1", tokens_per_s=90.0, logged_tokens_per_s=120.0)]
    assert books_study.rate_key(tmp_path, new) == "logged_tokens_per_s"
    assert books_study.train_speed(tmp_path, new, "logged_tokens_per_s") == ("10/10", 110.0)
    stored = run("sparsek-s0", tokens_per_s=50.0)
    assert books_study.rate_key(tmp_path, [*new, stored]) == "tokens_per_s"
    assert books_study.train_speed(tmp_path, new) == ("10/10", 85.0)
