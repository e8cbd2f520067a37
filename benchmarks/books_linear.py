"""SparseK+Linear+SW against SparseK+SW, Linear+SW and SW on books (issue 38), side by side on one GPU.

A ~40M-parameter llama (8 x 512, vocab 16,384), chunks of 4096 tokens, k = w = 128 (Linear+SW and SW:
w = 256, the same budget of exactly attended keys), every (model, seed) run a `longtrain fit` process
of its own, all at once on one GPU within --budget seconds (SIGTERM at the budget: the trainer saves a
checkpoint and stops, so a slower model reaches fewer steps: the summary says how many). Then
`longtrain eval --task ppl` by position bucket on the validation books and a summary: mean perplexity
per bucket ± half the range between seeds, each model's training tokens/s and steps.

    python benchmarks/books_linear.py --train TRAIN_DIR --valid VALID_DIR --out OUT [--steps N] [--seeds 0,1]
    python benchmarks/books_linear.py ... --smoke      # a toy size on the CPU: checks the script end to end

OUT gets runs/<model>-<seed>/, train-<run>.log, books-linear-eval.json, books-linear.md and .json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# model name -> (recipe, --set overrides); SW and Linear+SW get the KV budget k + w of the SparseK types.
MODELS = {
    "sparsek+linear+sw": ("gutenberg-sparsek", ["attention.type=sparsek+linear+sw", "attention.topk=128", "attention.window=128"]),
    "sparsek+sw": ("gutenberg-sparsek", ["attention.type=sparsek+sw", "attention.topk=128", "attention.window=128"]),
    "linear+sw": ("gutenberg-sw", ["attention.type=linear+sw", "attention.window=256"]),
    "sw": ("gutenberg-sw", ["attention.type=sw", "attention.window=256"]),
}
H100 = [
    "model.layers=8", "model.d_model=512", "model.heads=8", "tokenizer.vocab_size=16384",
    "train.chunk_size=4096", "train.batch_docs=2", "train.grad_accum=2",
    "train.lr=6.0e-4", "train.warmup_steps=50", "train.weight_decay=0.1", "train.valid_every=0",
    "train.device=cuda", "checkpoint.every=100", "checkpoint.keep=1", "logging.every=10", "logging.progress=false",
]
EVAL_H100 = ["--docs", "12", "--tokens", "32768", "--device", "cuda"]
SMOKE = [  # the same runs at a toy size on the CPU
    "model.layers=1", "model.d_model=32", "model.heads=2", "tokenizer.vocab_size=512",
    "train.chunk_size=128", "train.batch_docs=2", "train.grad_accum=1", "train.warmup_steps=1",
    "train.valid_every=0", "train.device=cpu", "checkpoint.every=1000", "checkpoint.keep=1",
    "logging.every=2", "logging.progress=false",
]
SMOKE_SIZES = {"attention.topk=128": "attention.topk=16", "attention.window=128": "attention.window=16",
               "attention.window=256": "attention.window=32"}
EVAL_SMOKE = ["--docs", "2", "--tokens", "1024", "--device", "cpu"]


def sets(model: str, common: list[str], smoke: bool, data: list[str]) -> tuple[str, list[str]]:
    recipe, own = MODELS[model]
    if smoke:
        own = [SMOKE_SIZES.get(s, s) for s in own]
    args = []
    for s in [*data, *common, *own]:
        args += ["--set", s]
    return recipe, args


def prepare(common: list[str], data: list[str]) -> None:
    """Train the tokenizer and tokenize the books once: every run then reads the token cache."""
    from longtrain.data import prepare_corpus
    from longtrain.train.recipe import load_recipe

    r = load_recipe("gutenberg-sparsek", [*data, *common])
    c = prepare_corpus(r.data, r.tokenizer, progress=False)
    print(f"prepared: {len(c.train)} training and {len(c.valid)} validation books", flush=True)


def train_all(runs: list[tuple[str, int]], common, data, out: Path, steps: int, budget: float, smoke: bool) -> None:
    procs = []
    for model, seed in runs:
        recipe, args = sets(model, common, smoke, data)
        name = run_name(model, seed)
        cmd = [sys.executable, "-m", "longtrain.cli", "fit", recipe, *args, "--set", f"train.seed={seed}",
               "--set", f"train.steps={steps}", "--run-dir", str(out / "runs" / name)]
        log = open(out / f"train-{name}.log", "a")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        # SIGTERM at the budget: the trainer finishes its step, saves a checkpoint and exits.
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # many processes, one GPU
        procs.append((name, log, subprocess.Popen(["timeout", "-s", "TERM", str(int(budget)), *cmd], stdout=log,
                                                   stderr=subprocess.STDOUT, cwd=ROOT, env=env)))
    for name, log, p in procs:
        rc = p.wait()
        log.close()
        print(f"{name}: fit exited {rc}", flush=True)


def run_name(model: str, seed: int) -> str:
    return f"{model.replace('+', '-')}-{seed}"


def evaluate(out: Path, valid: str, smoke: bool) -> None:
    runs = [str(r) for r in sorted((out / "runs").iterdir()) if (r / "checkpoints").is_dir()]
    cmd = [sys.executable, "-m", "longtrain.cli", "eval", *runs, "--task", "ppl", "--data", valid,
           *(EVAL_SMOKE if smoke else EVAL_H100), "--json", str(out / "books-linear-eval.json")]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def tokens_per_s(run: Path) -> tuple[float | None, int]:
    """Training tokens/s after warm-up (steps after the first fifth) and the last step, from metrics.jsonl."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None, 0
    rec = [r for r in map(json.loads, filter(str.strip, path.read_text().splitlines())) if "step_s" in r]
    if len(rec) < 2:
        return None, rec[-1]["step"] if rec else 0
    late = [r for r in rec if r["step"] > rec[-1]["step"] // 5] or rec
    pairs = list(itertools.pairwise(late))
    secs = sum(b["step_s"] for _, b in pairs)
    return (sum(b["tokens"] - a["tokens"] for a, b in pairs) / secs if secs else None), rec[-1]["step"]


def summary(out: Path) -> str:
    res = json.loads((out / "books-linear-eval.json").read_text())["results"]
    by_model = defaultdict(list)  # model -> [(buckets, overall ppl, tokens/s, steps)]
    for r in res:
        run = Path(r["checkpoint"]).parent.parent  # runs/<model>-<seed>/checkpoints/step-...
        model = {run_name(m, 0)[:-2]: m for m in MODELS}.get(run.name.rsplit("-", 1)[0], run.name)
        tps, steps = tokens_per_s(run)
        by_model[model].append(({(b["start"], b["end"]): b["ppl"] for b in r["ppl"]["buckets"]}, r["ppl"]["ppl"], tps, steps))
    buckets = sorted({b for runs in by_model.values() for bs, *_ in runs for b in bs})
    k = lambda n: f"{n // 1024}k" if n >= 1024 else str(n)  # noqa: E731
    lines = ["| model | seeds | steps | tokens/s | all | " + " | ".join(f"{k(a)}–{k(b)}" for a, b in buckets) + " |",
             "|---|---|---|---|---|" + "---|" * len(buckets)]
    table = {}
    for model, runs in sorted(by_model.items()):
        cells, table[model] = [], {}
        for b in buckets:
            vals = [bs[b] for bs, *_ in runs if b in bs]
            m, half = sum(vals) / len(vals), (max(vals) - min(vals)) / 2
            table[model][f"{b[0]}-{b[1]}"] = [m, half]
            cells.append(f"{m:.2f} ± {half:.2f}")
        alls = [a for _, a, _, _ in runs]
        rates = [t for _, _, t, _ in runs if t]
        rate = f"{sum(rates) / len(rates):,.0f}" if rates else "?"
        steps = "/".join(str(s) for *_, s in runs)
        lines.append(f"| {model} | {len(runs)} | {steps} | {rate} | {sum(alls) / len(alls):.2f} | " + " | ".join(cells) + " |")
        table[model]["tokens_per_s"] = sum(rates) / len(rates) if rates else None
    base, new = "sparsek+sw", "sparsek+linear+sw"
    if base in table and new in table:  # the question: is the linear part worth its time?
        cells = []
        for b in buckets:
            (mb, hb), (mn, hn) = table[base][f"{b[0]}-{b[1]}"], table[new][f"{b[0]}-{b[1]}"]
            cells.append(f"{mb - mn:+.2f}{' *' if mb - mn > 2 * max(hb, hn) else ''}")  # * beyond both spreads
        rb, rn = table[base]["tokens_per_s"], table[new]["tokens_per_s"]
        ratio = f"{rb / rn:.2f}x time" if rb and rn else ""
        lines.append(f"| {base} − {new} | | | {ratio} | | " + " | ".join(cells) + " |")
    text = ("Perplexity by position bucket on the validation books (mean over seeds ± half the range between "
            "seeds); steps per seed; training tokens/s per run (all runs at once on one GPU). Last row: "
            f"{base} minus {new} (> 0: the linear part helps; * where the gap exceeds both models' range between "
            f"seeds) and {new}'s training time per token relative to {base}.\n\n" + "\n".join(lines) + "\n")
    (out / "books-linear.md").write_text(text)
    (out / "books-linear.json").write_text(json.dumps(table, indent=1))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="folder of training books (.txt)")
    ap.add_argument("--valid", required=True, help="folder of validation books")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=250, help="steps per run (the cosine schedule's length)")
    ap.add_argument("--budget", type=float, default=300, help="seconds of training per run (all run at once)")
    ap.add_argument("--part", default="all", choices=["all", "prepare", "train", "eval", "summary"])
    ap.add_argument("--smoke", action="store_true", help="a toy size on the CPU")
    a = ap.parse_args(argv)
    models = a.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    for folder in (a.train, a.valid):
        if not Path(folder).is_dir():
            ap.error(f"no such folder: {folder}")
    a.out.mkdir(parents=True, exist_ok=True)
    common = SMOKE if a.smoke else H100
    data = [f"data.path={Path(a.train).resolve()}", f"data.valid={Path(a.valid).resolve()}"]
    runs = [(m, int(s)) for m in models for s in a.seeds.split(",")]
    t0 = time.time()
    if a.part in ("all", "prepare"):
        prepare(common, data)
    if a.part in ("all", "train"):
        train_all(runs, common, data, a.out, a.steps, a.budget, a.smoke)
    if a.part in ("all", "eval"):
        evaluate(a.out, str(Path(a.valid).resolve()), a.smoke)
    if a.part in ("all", "summary"):
        print(summary(a.out))
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
