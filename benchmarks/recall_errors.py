"""What a recall model gets wrong: each query's error classified, and the first value token's accuracy by distance.

    python benchmarks/recall_errors.py RUN [RUN ...] [--docs 96] [--far 128] [--bin 16] [--json F]

For each run (a run dir or checkpoint; recall-circuit, recall-sparsek, ...), fresh documents of its own recall
settings (the evaluation stream, as `longtrain eval --task recall`), teacher-forced. Each query at least --far
tokens from its fact is one of:
    correct            every value token is the argmax at the position before it
    another fact       the predicted value is another earlier fact's (a retrieval of the wrong fact), split by
                       whether the two keys share a letter at the same place (a partial key match) or not
    digits R           no fact's value; R marks which value tokens were right (x) and wrong (-), e.g. '-x':
                       the first wrong, the second right (teacher-forced after the true first)
Then the first value token's accuracy by distance (bins of --bin tokens) over all queries: the token that
needs the key matched (later ones can also follow the value's own earlier tokens).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np


def classify(cfg, docs, preds, far: int) -> collections.Counter:
    """Counts of the categories in the module doc over the queries at least `far` tokens from their fact."""
    from longtrain.data.recall import value_offset
    from longtrain.eval.recall import value_positions

    counts = collections.Counter()
    k0 = value_offset(cfg) - 1 - cfg.key_length  # the key sits right before the line's '=', which precedes the value
    for doc, pred in zip(docs, preds):
        keys = [tuple(doc.tokens[p + k0 : p + k0 + cfg.key_length].tolist()) for p in doc.fact_pos]
        values = [tuple(v.tolist()) for v in doc.values]
        for f, v in enumerate(value_positions(cfg, doc)):
            if doc.query_pos[f] - doc.fact_pos[f] < far:
                continue
            got = tuple(pred[v - 1].tolist())
            if got == values[f]:
                counts["correct"] += 1
                continue
            other = next((g for g in range(len(values)) if g != f and values[g] == got
                          and doc.fact_pos[g] < doc.query_pos[f]), None)
            if other is not None:
                shared = any(a == b for a, b in zip(keys[other], keys[f]))
                counts["another fact, keys share a letter" if shared else "another fact, keys share none"] += 1
            else:
                counts["digits " + "".join("x" if a == b else "-" for a, b in zip(got, values[f]))] += 1
    return counts


def first_token_by_distance(cfg, docs, preds, bin_tokens: int) -> dict[int, tuple[float, int]]:
    """{bin start: (accuracy of the first value token, queries)} over every query."""
    from longtrain.eval.recall import value_positions

    hits = collections.defaultdict(list)
    for doc, pred in zip(docs, preds):
        first = value_positions(cfg, doc)[:, 0]
        for f, p in enumerate(first):
            hits[int(doc.distances[f] // bin_tokens * bin_tokens)].append(pred[p - 1] == doc.tokens[p])
    return {b: (float(np.mean(h)), len(h)) for b, h in sorted(hits.items())}


def analyse(run: Path, docs: int, far: int, bin_tokens: int, device: str = "cpu") -> dict:
    from longtrain.device import pick_device
    from longtrain.eval.recall import recall_predictions
    from longtrain.train.checkpoint import load_checkpoint

    ckpt = load_checkpoint(run, device=pick_device(device))
    cfg, recall_docs, preds = recall_predictions(ckpt, docs=docs)
    counts = classify(cfg, recall_docs, preds, far)
    total = sum(counts.values())
    return {
        "run": str(run), "step": ckpt.step, "queries": total, "far": far,
        "share": {k: v / total for k, v in sorted(counts.items())} if total else {},
        "first_token_by_distance": first_token_by_distance(cfg, recall_docs, preds, bin_tokens),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run dirs or checkpoints")
    ap.add_argument("--docs", type=int, default=96, help="fresh documents per run")
    ap.add_argument("--far", type=int, default=128, help="classify the queries at least this far from their fact")
    ap.add_argument("--bin", type=int, default=16, help="distance bins of the first token's accuracy (tokens)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()
    results = []
    for run in a.runs:
        r = analyse(run, a.docs, a.far, a.bin, a.device)
        results.append(r)
        print(f"{run} (step {r['step']}, {r['queries']} queries ≥ {a.far} tokens): "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["share"].items()))
        print("  first value token by distance: "
              + " ".join(f"{b}:{acc:.2f}" for b, (acc, _) in r["first_token_by_distance"].items()))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
