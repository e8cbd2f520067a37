"""What `train.activation_checkpointing` costs and saves: peak memory and tokens/s of `longtrain fit`.

    python benchmarks/activation_checkpointing.py --out DIR            # GPU: 12 x 768 llama, 24 rows x 1024 tokens
    python benchmarks/activation_checkpointing.py --out DIR --small    # a tiny CPU version, to check the script

Runs the real CLI (`python -m longtrain.cli fit`, as benchmarks/fit_throughput.py does, with its synthetic
corpus and tokenizer) on SparseK+SW (k = w = 512) at 24 rows x 1024 tokens per step, in four variants:

  no-graph       train.cuda_graphs=false: the fair baseline, since activation checkpointing turns the graph off
  ac             train.activation_checkpointing=true (compiled blocks, no graph)
  default        fit's defaults (on CUDA: compiled blocks and one CUDA graph per chunk)
  ac-eager       the same as ac with train.compile=false

and reads from each run's metrics.jsonl the peak memory (`memory_bytes`, torch's max allocated) and the
tokens/s between step 5 and the last step (exact there: the trainer reads the device back at its log lines).
It also compares each variant's losses with no-graph's: activation checkpointing must not change them
(the CPU tests check bitwise equality; on the GPU eager and compiled blocks, or a graph replay, may differ in rounding).
Writes DIR/activation_checkpointing.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_throughput as ft  # noqa: E402  (its corpus, tokenizer, recipe and fit-runner helpers)

VARIANTS = {  # in the order they run: the pair to compare first (the first run also tokenizes and fills Triton's cache)
    "no-graph": ["train.cuda_graphs=false"],
    "ac": ["train.activation_checkpointing=true"],
    "default": [],
    "ac-eager": ["train.activation_checkpointing=true", "train.compile=false"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=15, help="a multiple of 5, at least 10")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=int, default=150, help="seconds per fit run")
    ap.add_argument("--small", action="store_true", help="a tiny CPU configuration that checks the script")
    args = ap.parse_args()
    if args.steps % 5 or args.steps < 10:
        ap.error("--steps must be a multiple of 5 (the log lines, where elapsed_s is exact), at least 10")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("FIT_THROUGHPUT_WORK", "/tmp/fit_throughput"))
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape, attention, vocab = dict(layers=12, d_model=768, heads=12), {"type": "sparsek+sw", "topk": 512, "window": 512}, 8192
    words = 120_000
    if args.small:
        shape, attention, vocab, words = dict(layers=2, d_model=64, heads=2), {"type": "sparsek+sw", "topk": 16, "window": 16}, 512, 3000
        args.rows, args.chunk, args.steps = 2, 128, 10
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {gpu}: {shape['layers']} x {shape['d_model']}, {args.rows} rows x {args.chunk} tokens", flush=True)

    corpus = work / ("corpus-small" if args.small else "corpus")
    if not corpus.is_dir():
        ft.write_corpus(corpus, n_docs=8, words_per_doc=words, seed=0)
    tokenizer = work / ("tokenizer-small.json" if args.small else "tokenizer.json")
    if not tokenizer.is_file():
        ft.train_tokenizer(corpus, tokenizer, vocab)
    recipe = ft.recipe_yaml(shape, attention, chunk=args.chunk, rows=args.rows, steps=args.steps, corpus=corpus,
                            tokenizer=tokenizer, device=device)

    results = {"device": gpu, "model": f"{shape['layers']}x{shape['d_model']}", "rows": args.rows, "chunk": args.chunk,
               "steps": args.steps, "variants": {}}
    for name in args.variants.split(","):
        records = ft.run_fit(f"ac-{name}{'-small' if args.small else ''}", recipe, work, args.out, args.timeout, VARIANTS[name])
        peak = max((r.get("memory_bytes") or 0 for r in records), default=0) or None
        results["variants"][name] = {
            "overrides": VARIANTS[name], "tokens_per_s": ft.rate(records, 5, args.steps), "peak_memory_bytes": peak,
            "losses": [r["loss"] for r in records],
        }
        (args.out / "activation_checkpointing.json").write_text(json.dumps(results, indent=1))

    base = results["variants"].get("no-graph", {}).get("losses")
    print(f"{'variant':<10} {'tokens/s':>10} {'peak GiB':>9}  loss vs no-graph")
    for name, v in results["variants"].items():
        tps, peak = v["tokens_per_s"], v["peak_memory_bytes"]
        same = "-" if not base or not v["losses"] else (
            "identical" if v["losses"] == base else f"max |diff| {max(abs(a - b) for a, b in zip(v['losses'], base)):.2e}")
        print(f"{name:<10} {tps or float('nan'):>10,.0f} {(peak or 0) / 2**30:>9.2f}  {same}")


if __name__ == "__main__":
    main()
