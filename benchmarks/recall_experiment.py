"""Does the SparseK pool keep what matters? Train recall-sparsek and recall-sw (same KV budget),
then measure exact recall against distance, at the training length and 4x longer (issue 17).

Parts (each fits a 10-minute device call; a training part stops gracefully at --budget-s with a
checkpoint, and calling it again resumes where it stopped):

    python benchmarks/recall_experiment.py --out $OUT --part train --model sparsek
    python benchmarks/recall_experiment.py --out $OUT --part train --model sw
    python benchmarks/recall_experiment.py --out $OUT --part eval      # every trained model in $OUT/runs
    python benchmarks/recall_experiment.py --out $OUT --part plot      # recall.png, table.md from recall.json

--model also takes the ablations below (recall-sparsek with one setting changed). Runs live in
$OUT/runs/<model>; eval writes $OUT/recall.json, plot writes $OUT/recall.png and $OUT/table.md.

Evaluation settings (fresh documents of the evaluation stream, never seen in training):
    train   the training documents' length, distances and fact count
    4x      documents 4x longer with 4x the facts (same distances, same density): does the pool
            hold up over a longer document, at positions beyond training?
    4x-far  documents 4x longer with distances up to 4x farther (same fact count, so the same
            number of facts waits in the pool at a time): does recall reach beyond the trained range?
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"sparsek": ROOT / "recipes" / "recall-sparsek.yaml", "sw": ROOT / "recipes" / "recall-sw.yaml"}
# Ablations: recall-sparsek with one setting changed (the candidates).
ABLATIONS = {
    "sparsek-slope1e-3": ["attention.eps_slope=1.0e-3"],  # the default slope
    "sparsek-noslope": ["attention.eps_slope=0.0"],
    "sparsek-notsn": ["attention.timestep_norm=false"],
    "sparsek-mimic": ["attention.score_init=mimic"],
    "sparsek-softkv": ["attention.variant=soft_kv"],
    "sparsek-st": ["attention.variant=straight_through"],
    "sparsek-scorelr10": ["train.score_lr_scale=10.0"],
    "sparsek-only": ["attention.type=sparsek", "attention.topk=64", "attention.window=0"],
}
SETTINGS = ("train", "4x", "4x-far")


def log(msg: str) -> None:
    print(msg, flush=True)


def model_args(model: str) -> tuple[Path, list[str]]:
    if model in RECIPES:
        return RECIPES[model], []
    if model in ABLATIONS:
        return RECIPES["sparsek"], ABLATIONS[model]
    raise SystemExit(f"--model {model}: choose one of {', '.join([*RECIPES, *ABLATIONS])}")


# ----------------------------------------------------------------------------- train


def train(out: Path, model: str, budget_s: float, extra: list[str]) -> None:
    """`longtrain fit` into out/runs/<model>; SIGTERM at the budget (it saves and exits; rerun resumes)."""
    recipe, sets = model_args(model)
    run_dir = out / "runs" / model
    cmd = [sys.executable, "-m", "longtrain.cli", "fit", str(recipe), "--run-dir", str(run_dir)]
    for s in sets + extra:
        cmd += ["--set", s]
    log(f"$ {' '.join(cmd)}   (budget {budget_s:.0f} s)")
    t0 = time.monotonic()
    with open(out / f"fit-{model}.log", "a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the trainer finishes its step, saves a checkpoint, exits
            rc = proc.wait()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()] if (run_dir / "metrics.jsonl").exists() else []
    last = records[-1] if records else {}
    log(f"{model}: exit {rc} after {time.monotonic() - t0:.0f} s; step {last.get('step')}, loss {last.get('loss')}, "
        f"{last.get('tokens')} tokens; log in {out / f'fit-{model}.log'}")
    tail = (out / f"fit-{model}.log").read_text().splitlines()[-6:]
    log("\n".join("  | " + line for line in tail))


# ----------------------------------------------------------------------------- eval


def evaluate(out: Path, docs: int, device: str) -> None:
    import torch

    from longtrain.data.recall import chance_level
    from longtrain.eval.recall import measure_recall, recall_config
    from longtrain.train.checkpointer import load_checkpoint

    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    results = {"settings": {}, "models": {}}
    for run_dir in sorted((out / "runs").iterdir()):
        if not (run_dir / "checkpoints").is_dir():
            continue
        ckpt = load_checkpoint(run_dir, device=device)
        att, rc = ckpt.recipe.attention, ckpt.recipe.data.recall
        settings = {
            "train": {},
            "4x": {"doc_tokens": 4 * rc.doc_tokens, "facts": 4 * rc.facts},
            "4x-far": {"doc_tokens": 4 * rc.doc_tokens, "max_distance": 4 * rc.max_distance},
        }
        entry = {
            "checkpoint": str(ckpt.path), "step": ckpt.step, "attention": att.type, "topk": att.topk,
            "window": att.window, "kv_budget": att.topk + att.window, "eps_slope": att.eps_slope,
            "timestep_norm": att.timestep_norm, "variant": att.variant, "score_init": att.score_init,
            "train": training_summary(run_dir), "recall": {},
        }
        for name, over in settings.items():
            _, cfg = recall_config(ckpt.recipe, **over)
            results["settings"][name] = {**cfg.model_dump(), "chance": chance_level(cfg)}
            t0 = time.monotonic()
            buckets = measure_recall(ckpt, docs=docs, **over)
            entry["recall"][name] = buckets
            cells = "  ".join(f"{b['start']}+:{b['accuracy']:.2f}" for b in buckets if b["trials"])
            log(f"{run_dir.name} {name} ({time.monotonic() - t0:.0f} s): {cells}")
        results["models"][run_dir.name] = entry
        del ckpt
    (out / "recall.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {out / 'recall.json'}")


def training_summary(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = records[-1]
    valid = [r for r in records if "valid_loss" in r]
    train_s = sum(r.get("step_s", 0.0) for r in records)
    sel = next((r["selection"] for r in reversed(records) if "selection" in r), None)
    return {
        "steps": last["step"], "tokens": last["tokens"], "loss": last["loss"],
        "valid_loss": valid[-1]["valid_loss"] if valid else None,
        "train_s": round(train_s, 1), "tokens_per_s": round(last["tokens"] / train_s) if train_s else None,
        "selection": sel,
    }


# ----------------------------------------------------------------------------- plot and table


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads((out / "recall.json").read_text())
    fig, axes = plt.subplots(1, len(SETTINGS), figsize=(5.2 * len(SETTINGS), 4.2), sharey=True)
    for ax, setting in zip(axes, SETTINGS):
        s = res["settings"][setting]
        for name, m in res["models"].items():
            b = [x for x in m["recall"][setting] if x["trials"]]
            mid = [math.sqrt(x["start"] * (x["end"] - 1)) for x in b]
            ax.plot(mid, [x["accuracy"] for x in b], marker="o", label=f"{name} (k={m['topk']}, w={m['window']})")
        ax.axhline(s["chance"]["exact"], color="grey", ls=":", lw=1, label="chance")
        budgets = {m["kv_budget"] for m in res["models"].values()}
        for kv in budgets:
            ax.axvline(16 * kv, color="grey", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distance from fact to query (tokens)")
        ax.set_title(f"{setting}: documents of {s['doc_tokens']:,} tokens, {s['facts']} facts", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact recall of the value")
    axes[0].set_ylim(-0.02, 1.02)
    axes[-1].legend(fontsize=7, loc="best")
    fig.suptitle("Recall against distance (dashed: 16 x the KV budget k + w)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "recall.png", dpi=120)
    log(f"wrote {out / 'recall.png'}")
    table = markdown_table(res)
    (out / "table.md").write_text(table)
    log(table)


def markdown_table(res: dict) -> str:
    lines = []
    for setting in SETTINGS:
        s = res["settings"][setting]
        models = res["models"]
        edges = [(b["start"], b["end"]) for b in next(iter(models.values()))["recall"][setting]]
        lines.append(f"\n**{setting}**: documents of {s['doc_tokens']:,} tokens, {s['facts']} facts, distances "
                     f"{s['min_distance']}..{s['max_distance']}; chance {s['chance']['exact']:.3g} exact\n")
        lines.append("| model | k | w | " + " | ".join(f"{a}–{b - 1}" for a, b in edges) + " |")
        lines.append("|---|---|---|" + "---|" * len(edges))
        for name, m in models.items():
            cells = [f"{b['accuracy']:.3f}" if b["trials"] else "-" for b in m["recall"][setting]]
            lines.append(f"| {name} | {m['topk']} | {m['window']} | " + " | ".join(cells) + " |")
    lines.append("\n| model | steps | tokens | train s | tok/s | final loss | valid loss |")
    lines.append("|---|---|---|---|---|---|---|")
    for name, m in res["models"].items():
        t = m["train"]
        vl = f"{t['valid_loss']:.4f}" if t["valid_loss"] is not None else "-"
        lines.append(f"| {name} | {t['steps']} | {t['tokens']:,} | {t['train_s']} | {t['tokens_per_s']} | {t['loss']:.4f} | {vl} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output folder (runs, logs, JSON, PNG)")
    ap.add_argument("--part", choices=("train", "eval", "plot"), required=True)
    ap.add_argument("--model", default="sparsek", help=f"train: {', '.join([*RECIPES, *ABLATIONS])}")
    ap.add_argument("--budget-s", type=float, default=540.0, help="train: stop (with a checkpoint) after this many seconds")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="train: extra recipe override (repeatable)")
    ap.add_argument("--docs", type=int, default=64, help="eval: documents per setting")
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part == "train":
        train(a.out, a.model, a.budget_s, a.sets)
    elif a.part == "eval":
        evaluate(a.out, a.docs, a.device)
    else:
        plot(a.out)


if __name__ == "__main__":
    main()
