"""Does SparseK+SW beat a same-budget window on books, beyond the seed spread? (issue 30) Does a linear part
help it, and at what training time? (issue 38)

Trains several attentions and seeds side by side on one GPU (one `longtrain fit` each), evaluates
perplexity by position on held-out books (`longtrain eval --task ppl`), and writes a table with the
seed spread and a picture of the gap against tokens trained (validation loss logged during training).

    python benchmarks/books_study.py --train T --valid V --out OUT --runs RUNS --size small \\
        --run sparsek:0,1,2 --run sw:0,1,2 --run full:0 --run sparsek-64-192:0 --run sparsek-192-64:0 \\
        --part all --budget-s 520

Every run is `train.deterministic` (a seed gives one run, whatever else shares the GPU; `--set
train.deterministic=false` for the faster, unrepeatable kernels).

Sizes (the paper's from-scratch comparison: the same KV budget k + w per query):
    small    8 x 512 llama (~42M parameters, vocab 16,384), chunks of 4096 x 4 rows, 2,500 steps (41M
             tokens); sparsek: k = w = 128; sw: w = 256; full: full attention over the last 4096 keys
             (the chunk's length, 16x the budget: a ceiling, not a same-budget baseline)
    medium   12 x 768 llama (~110M parameters), chunks of 4096 x 4 rows, 6,100 steps (100M tokens);
             sparsek: k = w = 512; sw: w = 1024; full: the last 4096 keys
`--kv-budget N` sets another budget at either size (the paper's 256 at medium: `--size medium --kv-budget 256
--run sparsek-192-64@attention.eps_slope=3e-3:0,1 --run sw:0,1`).
Models `sparsek-K-W` set the split of the same budget (k = K, w = W); `sparsek+linear[-K-W]` is SparseK+Linear+SW
(k = w = budget / 2 unless split, every other key through linear attention; `attention.linear_norm` mean, the default
since 2026-12-02: add `@attention.linear_norm=sum` for the paper's formula, which the stored
books_study-small-linear-h200.json's rows ran; `attention.linear_gain` learned, the default since 2026-12-04: stored
rows that trained without it are named `@attention.linear_gain=fixed`, apart from that file's, which are sum and
fixed) and `linear` Linear+SW (w = budget), the paper's appendix comparison (`pip install 'longtrain[linear]'` for fla's kernels on a GPU):

    python benchmarks/books_study.py ... --size small --run sparsek+linear:0,1,2 --run sparsek:0,1,2 \
        --run linear:0,1,2 --run sw:0,1,2 --part all

A model name may carry recipe settings after `@`: a variant with its own runs and row, e.g. the position slope
(issue 30, books at 256 keys: 3e-3 best in mean, 1e-4 behind SW):

    python benchmarks/books_study.py ... --size small --run sw:0,1,2 --run sparsek:0,1,2 \
        --run sparsek@attention.eps_slope=3e-3:0,1,2 --run sparsek@attention.eps_slope=1e-4:0,1,2 --part all

Parts: `train` (stops at --budget-s with checkpoints; the same command resumes), `eval`, `summary`
(OUT/books.md with each model's steps and training tokens/s, OUT/books-gap.png, OUT/books_study.json with what they
came from), `all` (the three in a row). A study may take models from a stored one instead of training them again
(the same books, size, budget and card kind: seed 0 of SW 1024 read 47.93 on an H100, 48.72 on an H200), and may add
seeds to a stored model, which is how a study too long for one session's device time is split over sessions:

    python benchmarks/books_study.py ... --size small --run sparsek+linear:0,1,2 --part all \
        --baseline benchmarks/books_study-small-h200.json:sw     # H200, tree 5235619: SW 256, seeds 0-2
    python benchmarks/books_study.py ... --size medium --kv-budget 256 --run sw:2 --part all \
        --baseline benchmarks/books_study-medium-256-h200.json:sw  # SW's seeds 0, 1 stored, seed 2 trained here

A stored run is a seed of its own, not the run again: deterministic runs repeated to the digit between two H200 trees
and across machines of one session, but not between two H200 sessions (2026-12-03, benchmarks/README.md).
RUNS may live outside OUT (the runs' checkpoints need not come back from a device call; the summary needs only OUT).
On a lent GPU machine without datasets or pydantic, `. benchmarks/device_setup.sh` first (it says what to carry).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from side_by_side import ROOT, fit_command, start_fit, training_summary, wait_all  # (puts ROOT on sys.path)

SIZES = {
    "small": {"layers": 8, "d_model": 512, "heads": 8, "steps": 2500, "budget": 256},
    "medium": {"layers": 12, "d_model": 768, "heads": 12, "steps": 6100, "budget": 1024},
}


def attention_sets(model: str, budget: int) -> list[str]:
    """The attention of a model name at a KV budget (k + w keys per query)."""
    if model == "sw":
        return ["attention.type=sw", "attention.topk=0", f"attention.window={budget}"]
    if model == "full":
        return ["attention.type=full", "attention.topk=0", "attention.window=0", "attention.max_context=4096"]
    if model == "linear":
        return ["attention.type=linear+sw", "attention.topk=0", f"attention.window={budget}"]
    base, _, split = model.partition("-")
    if base not in ("sparsek", "sparsek+linear"):
        raise SystemExit(f"unknown model {model}: sparsek, sw, full, sparsek-K-W, sparsek+linear[-K-W] or linear")
    k, w = budget // 2, budget // 2
    if split:
        k, w = (int(x) for x in split.split("-"))
        if k + w != budget:
            raise SystemExit(f"{model}: k + w = {k + w}, not the KV budget {budget} (--kv-budget, else the size's)")
    kind = "sparsek+linear+sw" if base == "sparsek+linear" else "sparsek+sw"
    return [f"attention.type={kind}", f"attention.topk={k}", f"attention.window={w}"]


def common_sets(a: argparse.Namespace) -> list[str]:
    s = SIZES[a.size]
    return [
        f"data.path={a.train}", f"data.valid={a.valid}", f"model.layers={s['layers']}",
        f"model.d_model={s['d_model']}", f"model.heads={s['heads']}", "model.mlp_ratio=4.0",
        "tokenizer.vocab_size=16384", "train.chunk_size=4096", "train.batch_docs=4",
        f"train.steps={a.steps or s['steps']}", "train.lr=1.0e-3", "train.warmup_steps=100",
        "train.weight_decay=0.1", "train.valid_every=250", "train.valid_docs=4", "train.valid_tokens=32768",
        "checkpoint.every=250", "checkpoint.keep=1", "logging.every=50", "logging.progress=false",
        # fit's default slope, which every study before 2026-12-01 ran: a model name means the same runs whatever
        # the base recipe ships (gutenberg-sparsek has 3e-3 since); a variant's @attention.eps_slope=... overrides it
        "attention.eps_slope=1.0e-3",
        # A seed is one run, not one of many: on 2026-11-26 two H100 sessions ran the same SW seed 2 apart from
        # step 50 (perplexity 65.22 and 65.08) while seeds 0 and 1 repeated exactly (benchmarks/README.md)
        "train.deterministic=true",
        *a.sets,  # after it: --set train.deterministic=false turns it off
    ]


def kv_budget(a: argparse.Namespace) -> int:
    """Keys per query (k + w) of every same-budget model: --kv-budget, else the size's."""
    return a.kv_budget or SIZES[a.size]["budget"]


def runs_of(a: argparse.Namespace) -> dict[str, tuple[str, int]]:
    """run name -> (model, seed), from --run MODEL:SEED,SEED,... (MODEL may carry @KEY=VALUE settings)"""
    out = {}
    for spec in a.run:
        model, _, seeds = spec.rpartition(":") if ":" in spec else (spec, "", "0")
        base, settings = split_model(model)
        attention_sets(base, kv_budget(a))  # an unknown name fails before anything runs
        if bad := [x for x in settings if "=" not in x]:
            raise SystemExit(f"{spec}: settings after @ are KEY=VALUE, got {bad}")
        for seed in (int(x) for x in (seeds or "0").split(",")):
            out[f"{model}-s{seed}"] = (model, seed)
    return out


def split_model(model: str) -> tuple[str, list[str]]:
    """'sparsek@attention.eps_slope=3e-3@train.score_distill=0.1' -> ('sparsek', ['attention.eps_slope=3e-3', ...]):
    a variant of a model, its own run and row (the settings are recipe overrides, as --set)."""
    base, *settings = model.split("@")
    return base, settings


def model_sets(model: str, budget: int) -> list[str]:
    """The recipe overrides of a model name, variant settings included."""
    base, settings = split_model(model)
    return [*attention_sets(base, budget), *settings]


def train(a: argparse.Namespace) -> None:
    common = common_sets(a)
    prep = subprocess.run([*fit_command("gutenberg-sparsek", a.runs / "prepare", common), "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT)
    if prep.returncode:  # the token cache, once (the runs would otherwise wait on its lock)
        raise SystemExit(prep.stdout + prep.stderr)
    procs = {}
    for name, (model, seed) in runs_of(a).items():
        sets = [*common, *model_sets(model, kv_budget(a)), f"train.seed={seed}"]
        procs[name] = start_fit("gutenberg-sparsek", a.runs / name, sets, out_file(a.out, "fit", name, "log"))
    if stopped := wait_all(procs, a.budget_s):
        raise SystemExit(f"stopped at the budget: {stopped}; run the same command again to resume them")


def evaluate(a: argparse.Namespace) -> None:
    from longtrain.train.metrics import METRICS_FILE, read_metrics

    runs = [str(a.runs / name) for name in runs_of(a) if (a.runs / name / "checkpoints").is_dir()]
    cmd = [sys.executable, "-m", "longtrain.cli", "eval", *runs, "--task", "ppl", "--data", str(a.valid),
           "--docs", str(a.docs), "--tokens", str(a.tokens), "--json", str(a.out / "books-eval.json")]
    subprocess.run(cmd, check=True, cwd=ROOT)
    for name in runs_of(a):  # the validation losses logged in training (the gap against tokens), steps and tokens/s
        metrics = a.runs / name / METRICS_FILE
        if metrics.is_file():
            curve = [(r["tokens"], r["valid_loss"]) for r in read_metrics(metrics) if "valid_loss" in r]
            out_file(a.out, "curve", name).write_text(json.dumps(curve))
            t = training_summary(a.runs / name)
            gains = linear_gains(a.runs / name)
            out_file(a.out, "train", name).write_text(json.dumps({**{k: t[k] for k in ("steps", "tokens", "tokens_per_s",
                                                                                       "logged_tokens_per_s")},
                                                                  **provenance(a.runs / name),
                                                                  **({"linear_gains": gains} if gains else {})}))


def linear_gains(run_dir: Path) -> list[list[float]] | None:
    """The learned linear gains of the newest checkpoint, [layer][query head], times F (phi's features): 1 is where
    they start (one key's weight), near 0 a linear part training turned off. None: no learned gain."""
    from safetensors import safe_open

    from longtrain.train.checkpoint.storage import resolve_checkpoint

    with safe_open(str(resolve_checkpoint(run_dir) / "model.safetensors"), "pt") as f:
        names = {k.removesuffix("linear_log_gain"): k for k in f.keys() if k.endswith(".attn.linear_log_gain")}
        layer = lambda prefix: int(prefix.split(".")[-3])  # noqa: E731  blocks.<i>.attn.
        return [(f.get_tensor(names[p]).double().exp() * f.get_slice(p + "phi_weight").get_shape()[-1]).tolist()
                for p in sorted(names, key=layer)] or None


def provenance(run_dir: Path) -> dict:
    """What a run's numbers came from, by its newest checkpoint: the token stream (the corpus fingerprint: books and
    tokenizer), the recipe's hashes and the machine (card, torch, CUDA, Triton). Two same-seed runs that differ tell by
    these which of the three changed."""
    from longtrain.train.checkpoint.storage import read_meta, resolve_checkpoint

    meta = read_meta(resolve_checkpoint(run_dir))
    return {k: meta[k] for k in ("corpus", "hashes", "machine") if k in meta}


def file_stem(name: str) -> str:
    """A run or model name as a plain file name: variants carry '@', '=' and '+', which shells, globs and some
    copy tools (the device tool returns no such name) take badly; the run folders keep the names."""
    return name.replace("@", "__").replace("=", "-").replace("+", "_")


def out_file(out: Path, kind: str, name: str, ext: str = "json") -> Path:
    """OUT/<kind>-<run>.<ext>: a run's log, validation curve or training summary."""
    return out / f"{kind}-{file_stem(name)}.{ext}"


def run_name(checkpoint: str) -> str:
    """RUNS/<model>-s<seed>/checkpoints/step-... -> <model>-s<seed>"""
    return Path(checkpoint).parent.parent.name


def run_model(checkpoint: str) -> str:
    """RUNS/<model>-s<seed>/checkpoints/step-... -> model"""
    return run_name(checkpoint).rsplit("-s", 1)[0]


def add_baselines(a: argparse.Namespace, res: list[dict]) -> list[str]:
    """--baseline FILE:MODEL,...: a stored study's (OUT/books_study.json of another run) evaluations, steps, tokens/s
    and validation curves of those models, as if they had run here, beside this study's own seeds of them. A same-seed
    SW run repeated to the digit on another tree of the same card kind (benchmarks/README.md, 2026-12-01), but not on
    an H100 against an H200 (2026-12-02) nor between two H200 sessions (2026-12-03): take a baseline from the same
    card kind, and count a stored run as a seed of its own, not as the same run again. Returns the table's notes on
    where they came from."""
    notes, here = [], {run_name(r["checkpoint"]) for r in res}
    ours = {json.loads(f.read_text()).get("corpus") for f in (out_file(a.out, "train", n) for n in here)
            if f.is_file()} - {None}  # this study's token streams (provenance), before the stored runs' files join
    for spec in a.baseline:
        path, _, models = spec.rpartition(":")
        if not path:
            raise SystemExit(f"--baseline {spec}: FILE:MODEL[,MODEL], e.g. benchmarks/books_study-small-h200.json:sw")
        stored = json.loads(Path(path).read_text())
        # a study stored before --kv-budget ran at its size's budget
        theirs = (stored["size"], stored.get("kv_budget", SIZES[stored["size"]]["budget"]), stored["docs"],
                  stored["tokens"])
        if theirs != (a.size, kv_budget(a), a.docs, a.tokens):
            raise SystemExit(f"--baseline {path}: size {theirs[0]} at {theirs[1]} keys, {theirs[2]} books x {theirs[3]} "
                             f"tokens, not this study's {a.size} at {kv_budget(a)} keys, {a.docs} x {a.tokens}")
        for model in models.split(","):
            rows = [r for r in stored["eval"] if run_model(r["checkpoint"]) == model]
            if not rows:
                raise SystemExit(f"--baseline {spec}: {path} has no {model} (it has "
                                 f"{sorted({run_model(r['checkpoint']) for r in stored['eval']})})")
            names = [run_name(r["checkpoint"]) for r in rows]
            # other seeds of a model that also runs here join its row (a study split over sessions); the same seed twice
            # would count one run as two
            if twice := sorted(set(names) & here):
                raise SystemExit(f"--baseline {spec}: {', '.join(twice)} also ran in this study; drop that seed from "
                                 "--run or from the baseline")
            res.extend(rows)
            for name in names:
                out_file(a.out, "train", name).write_text(json.dumps(stored["train"][name]))
                out_file(a.out, "curve", name).write_text(json.dumps(stored["valid_loss_curves"][name]))
            seeds = ", ".join(name.rsplit("-s", 1)[1] for name in names)
            notes.append(f"{model} (seed{'s' * (len(names) > 1)} {seeds}): from {path} ({stored.get('device', '?')}, "
                         f"tree {stored.get('tree', '?')}), not trained in this study (its tokens/s, and so a time "
                         "ratio against it, are from that run)")
            # runs of this study on another token stream than the stored ones (books or tokenizer changed): say so
            theirs_c = {(stored["train"].get(n) or {}).get("corpus") for n in names} - {None}
            if theirs_c and ours and theirs_c != ours:
                notes.append(f"{model}: the stored runs read another token stream (corpus {', '.join(sorted(theirs_c))}) "
                             f"than this study's ({', '.join(sorted(ours))}): other books or another tokenizer")
    return notes


def summary(a: argparse.Namespace) -> None:
    res = json.loads((a.out / "books-eval.json").read_text())["results"]
    own = {run_name(r["checkpoint"]) for r in res}  # trained in this study, side by side, before stored runs join
    notes = add_baselines(a, res)
    by_model: dict[str, list[dict]] = {}
    for r in res:
        by_model.setdefault(run_model(r["checkpoint"]), []).append(r)
    buckets = [(b["start"], b["end"]) for b in res[0]["ppl"]["buckets"]]
    k = lambda n: f"{n // 1024}k" if n >= 1024 else str(n)  # noqa: E731
    stats: dict[str, dict] = {}
    for model, runs in by_model.items():
        per = {(b["start"], b["end"]): [] for b in runs[0]["ppl"]["buckets"]}
        for r in runs:
            for b in r["ppl"]["buckets"]:
                per[(b["start"], b["end"])].append(b["ppl"])
        per["all"] = [r["ppl"]["ppl"] for r in runs]
        stats[model] = {key: (statistics.mean(v), min(v), max(v)) for key, v in per.items() if v}
    cols = ["all", *buckets]
    key = rate_key(a.out, res)
    speed = {m: train_speed(a.out, runs, key) for m, runs in by_model.items()}  # (steps per seed, mean tokens/s)
    own_speed = {m: train_speed(a.out, mine, key) for m, runs in by_model.items()
                 if (mine := [r for r in runs if run_name(r["checkpoint"]) in own])}
    measure = ("the median of each run's logged rate, compiles and resumes left out" if key == "logged_tokens_per_s"
               else "tokens over training seconds, compiles and resumes included")
    head = ("| model | seeds | steps | tokens/s | "
            + " | ".join("all" if c == "all" else f"{k(c[0])}–{k(c[1])}" for c in cols) + " |")
    lines = [head, "|---|---|---|---|" + "---|" * len(cols)]
    for model, st in stats.items():
        cells = [f"{st[c][0]:.2f} ({st[c][1]:.2f}–{st[c][2]:.2f})" if len(by_model[model]) > 1 else f"{st[c][0]:.2f}"
                 for c in cols]
        steps, tps = speed[model]
        lines.append(f"| {model} | {len(by_model[model])} | {steps} | {f'{tps:,.0f}' if tps else '?'} | "
                     + " | ".join(cells) + " |")
    notes += gain_notes(a.out, by_model)
    for base, new in gap_pairs(list(stats)):  # the issues' questions (30, 38)
        if base in stats:  # ✓: beyond the spread, the new model's worst seed beats base's best
            marks = [f"{stats[base][c][0] - stats[new][c][0]:+.2f}{' ✓' if stats[new][c][2] < stats[base][c][1] else ''}"
                     for c in cols]
            time = time_ratio(base, new, speed, own_speed)
            lines.append(f"| {base} − {new} | | | {time} | " + " | ".join(marks) + " |")
    text = (f"Perplexity by position on {a.docs} validation books × their first {a.tokens:,} tokens ({a.size}, "
            f"KV budget {kv_budget(a):,} keys), "
            "mean over seeds (lowest–highest); steps reached per seed and training tokens/s (mean over seeds, all "
            f"runs side by side; {measure}). Rows `A − B`: A's perplexity minus B's (> 0: B is ahead), ✓ where every B seed beats "
            "every A seed, and B's training time per token relative to A's (from this study's own runs where both "
            "have some; * where it takes stored runs, which ran beside other loads: not a same-run ratio).\n\n"
            + "\n".join(lines) + "\n"
            + "".join(f"\n{n}\n" for n in notes))
    (a.out / "books.md").write_text(text)
    store(a, res)
    print(text)
    plot_gap(a, sorted(by_model))


def store(a: argparse.Namespace, res: list[dict]) -> None:
    """OUT/books_study.json: everything the table and the picture came from, for --baseline of a later study
    (add "device" and "tree" by hand when keeping it in benchmarks/)."""
    names = sorted({run_name(r["checkpoint"]) for r in res})
    read = lambda f: json.loads(f.read_text()) if f.is_file() else None  # noqa: E731
    (a.out / "books_study.json").write_text(json.dumps({
        "size": a.size, "kv_budget": kv_budget(a), "docs": a.docs, "tokens": a.tokens, "runs": a.run, "sets": a.sets,
        "baseline": a.baseline,
        "eval": res, "train": {n: read(out_file(a.out, "train", n)) for n in names},
        "valid_loss_curves": {n: read(out_file(a.out, "curve", n)) for n in names}}, indent=1))


def gain_notes(out: Path, by_model: dict[str, list[dict]]) -> list[str]:
    """A line per model with learned linear gains (linear_gains, in its runs' train files): by layer, the mean over
    its seeds and heads, and the lowest and highest head."""
    notes = []
    for model, runs in by_model.items():
        gains = [g for f in train_files(out, runs) if f and (g := f.get("linear_gains"))]
        if gains:
            layers = [[x for g in gains for x in g[i]] for i in range(len(gains[0]))]  # every seed's heads, per layer
            text = ", ".join(f"{statistics.mean(v):.2f} ({min(v):.2f}–{max(v):.2f})" for v in layers)
            notes.append(f"{model}: learned linear gain × F by layer at the end (1: its start), mean over {len(gains)} "
                         f"seed(s) and the heads (lowest–highest head): {text}")
    return notes


def gap_pairs(models: list[str]) -> list[tuple[str, str]]:
    """(base, model) rows of the table: every SparseK+SW model (variants and k : w splits too) and Linear+SW against
    SW, every SparseK+Linear+SW one against its SparseK+SW twin (the same split and settings but the linear part's,
    else the same split) and SW."""
    pairs = []
    for m in models:
        base = split_model(m)[0]
        if base == "sparsek" or base.startswith("sparsek-") or base == "linear":
            pairs.append(("sw", m))
        elif base.startswith("sparsek+linear"):
            # the twin keeps the split and the settings a SparseK+SW model has (attention.linear_* are the linear part's)
            settings = [x for x in split_model(m)[1] if not x.startswith("attention.linear_")]
            twin = "@".join([base.replace("sparsek+linear", "sparsek", 1), *settings])
            pairs += [(twin if twin in models else base.replace("sparsek+linear", "sparsek", 1), m), ("sw", m)]
    return pairs


def time_ratio(base: str, new: str, speed: dict, own_speed: dict) -> str:
    """The new model's training time per token relative to base's, as a table cell: from this study's own runs where
    both models have some (side by side on one card, the same load), else from all their runs, marked *."""
    same_run = base in own_speed and new in own_speed
    use = own_speed if same_run else speed
    (_, tb), (_, tn) = use[base], use[new]
    return f"{tb / tn:.2f}× time{'' if same_run else '*'}" if tb and tn else ""


def train_files(out: Path, runs: list[dict]) -> list[dict]:
    """OUT/train-<run>.json of each run that has one."""
    files = [out_file(out, "train", run_name(r["checkpoint"])) for r in runs]
    return [json.loads(f.read_text()) for f in files if f.is_file()]


def rate_key(out: Path, runs: list[dict]) -> str:
    """Which training tokens/s the table compares: the steady rate (side_by_side.training_summary) where every run has
    one, else every run's tokens over its training seconds (stored runs before 2026-12-04 have only that; one measure
    for all, so a time ratio never sets one against the other)."""
    return "logged_tokens_per_s" if all(t.get("logged_tokens_per_s") for t in train_files(out, runs)) else "tokens_per_s"


def train_speed(out: Path, runs: list[dict], key: str = "tokens_per_s") -> tuple[str, float | None]:
    """Steps reached per seed ("2500/2500/2412") and the mean training tokens/s (`key`), from OUT/train-<run>.json."""
    train = train_files(out, runs)
    rates = [t[key] for t in train if t.get(key)]
    return "/".join(str(t["steps"]) for t in train) or "?", statistics.mean(rates) if rates else None


def plot_gap(a: argparse.Namespace, models: list[str]) -> None:
    """Left: each model's validation loss against tokens (mean over seeds, band: lowest to highest seed).
    Right: the gap to SW (SW's mean minus the model's; above 0 the model is ahead): does it grow?"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[list[tuple[int, float]]]] = {}
    for model in models:
        for f in sorted(a.out.glob(f"curve-{file_stem(model)}-s*.json")):
            if curve := json.loads(f.read_text()):
                curves.setdefault(model, []).append(curve)

    def band(runs: list[list[tuple[int, float]]]) -> tuple[list[float], list[float], list[float], list[float]]:
        n = min(len(r) for r in runs)  # the validations every seed reached
        x = [runs[0][i][0] / 1e6 for i in range(n)]
        vals = [[r[i][1] for r in runs] for i in range(n)]
        return x, [statistics.mean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for model, runs in curves.items():
        x, mean, lo, hi = band(runs)
        line, = left.plot(x, mean, lw=1.2, label=f"{model} ({len(runs)} seed{'s' * (len(runs) > 1)})")
        left.fill_between(x, lo, hi, alpha=0.2, color=line.get_color())
        if "sw" in curves and model != "sw":
            xs, sw_mean, sw_lo, sw_hi = band(curves["sw"])
            # Pair each validation with SW's at the same tokens (within 1%): runs may validate at other intervals.
            pairs = [(i, j) for i in range(len(x)) for j in range(len(xs)) if abs(xs[j] - x[i]) <= 0.01 * x[i]]
            px = [x[i] for i, _ in pairs]
            right.plot(px, [sw_mean[j] - mean[i] for i, j in pairs], marker="o", ms=3, color=line.get_color())
            if len(runs) > 1 and len(curves["sw"]) > 1:  # beyond the spread: the model's worst seed against SW's best
                right.fill_between(px, [sw_lo[j] - hi[i] for i, j in pairs], [sw_hi[j] - lo[i] for i, j in pairs],
                                   alpha=0.12, color=line.get_color())
    left.set_xlabel("tokens trained (M)")
    left.set_ylabel("validation loss (4 books x 32k tokens)")
    left.set_ylim(top=min(left.get_ylim()[1], 5.2))
    left.set_title("mean over seeds; band: lowest to highest seed", fontsize=8)
    right.axhline(0, color="grey", lw=0.8)
    right.set_xlabel("tokens trained (M)")
    right.set_ylabel("SW's loss minus the model's (> 0: ahead of SW)")
    right.set_title("band: the model's worst seed against SW's best, and its best against SW's worst", fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{a.size}, {kv_budget(a):,} keys: validation loss against tokens trained, and the gap to the "
                 "same-budget window", fontsize=10)
    fig.tight_layout()
    # one legend for both panels, under them: model names with their settings are long, and inside a panel they
    # covered the curves (savefig's tight box takes the legend in)
    fig.legend(*left.get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=7,
               frameon=False)
    fig.savefig(a.out / "books-gap.png", dpi=120, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, required=True, help="folder of training books (.txt)")
    ap.add_argument("--valid", type=Path, required=True, help="folder of held-out books (.txt)")
    ap.add_argument("--out", type=Path, required=True, help="logs, eval JSON, table and picture")
    ap.add_argument("--runs", type=Path, help="the runs' folders (default OUT/runs)")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--run", action="append", default=[],
                    help="MODEL:SEED,SEED (repeatable): sparsek, sw, full, sparsek-K-W, sparsek+linear, linear; "
                         "MODEL@KEY=VALUE[@KEY=VALUE] a variant with its own row (sparsek@attention.eps_slope=3e-3)")
    ap.add_argument("--steps", type=int, help="steps per run (default: the size's)")
    ap.add_argument("--kv-budget", type=int, help="keys per query k + w of sparsek, sw and linear "
                    "(default: the size's, small 256, medium 1024; the paper's from-scratch setting is 256)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra recipe override for every run")
    ap.add_argument("--part", choices=("train", "eval", "summary", "all"), required=True)
    ap.add_argument("--budget-s", type=float, default=540.0, help="train: stop (with checkpoints) after this many seconds")
    ap.add_argument("--docs", type=int, default=12, help="eval: validation books")
    ap.add_argument("--tokens", type=int, default=65536, help="eval: tokens per book")
    ap.add_argument("--baseline", action="append", default=[], metavar="FILE:MODEL[,MODEL]",
                    help="summary: take these models' results from a stored study (OUT/books_study.json of another "
                         "run, e.g. benchmarks/books_study-small-h200.json:sw) instead of training them again")
    a = ap.parse_args()
    a.runs = a.runs or a.out / "runs"
    a.out.mkdir(parents=True, exist_ok=True)
    a.runs.mkdir(parents=True, exist_ok=True)
    a.run = a.run or ["sparsek:0,1,2", "sw:0,1,2"]
    if a.part in ("train", "all"):
        train(a)
    if a.part in ("eval", "all"):
        evaluate(a)
    if a.part in ("summary", "all"):
        summary(a)


if __name__ == "__main__":
    main()
