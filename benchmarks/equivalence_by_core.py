"""Chunked == unchunked by attention core: SparseK+SW (the control) and SparseK+Linear+SW on its naive and its
Triton core (attention.backend naive / auto), in bf16 autocast and float32, at chunk sizes on and off the 64-query tile.

    python benchmarks/equivalence_by_core.py --out OUT                    # on a GPU (about a minute on an H200)
    python benchmarks/equivalence_by_core.py --out /tmp/ec --small        # the CPU, tiny (checks the script)

A random quickstart-sized model (gpt2 style, 4 x 128, vocab 2048, k = w = 64) on random tokens, as
`longtrain verify-equivalence --recipe` builds one, through longtrain.eval.equivalence.verify. Prints a line per
(attention, core, dtype, chunk): the selection agreement over all layers, the worst layer's, the largest |logit
difference| and the loss difference; writes OUT/equivalence_by_core.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from longtrain.eval.equivalence import verify
from longtrain.model import LM, LMConfig

CASES = [("sparsek+sw", "auto"), ("sparsek+linear+sw", "naive"), ("sparsek+linear+sw", "auto")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--small", action="store_true", help="the CPU, 1/32 of the tokens and chunk sizes")
    args = ap.parse_args()
    dev = "cpu" if args.small or not torch.cuda.is_available() else "cuda"
    shrink = 32 if args.small else 1
    rows = []
    for attention, backend in CASES:
        for dtype, tokens in (("bfloat16", 65536), ("float32", 32768)):
            torch.manual_seed(0)
            cfg = LMConfig(vocab_size=2048, layers=4, d_model=128, heads=4, style="gpt2", attention=attention, topk=64,
                           window=64, backend=backend)
            model = LM(cfg).to(dev)
            doc = torch.randint(0, 2048, (tokens // shrink,), device=dev)
            chunks = [c // shrink for c in (1024, 4096, 3001)]
            report = verify(model, doc, chunks, dtype=dtype, max_logit_diff=0.5, min_agreement=0.999)
            for r in report.runs:
                row = dict(attention=attention, backend=backend, dtype=dtype, tokens=doc.numel(), chunk=r.chunk_size,
                           agreement=r.selection_agreement, worst_layer=r.worst_agreement,
                           max_abs_logit_diff=r.max_abs_logit_diff, loss_diff=r.loss_diff)
                rows.append(row)
                print(f"{attention:18s} {backend:6s} {dtype:9s} chunk {r.chunk_size:5d}: agreement {row['agreement']:.6f} "
                      f"worst {row['worst_layer']:.6f} max|dlogit| {row['max_abs_logit_diff']:.3g} dloss {row['loss_diff']:.3g}",
                      flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    (args.out / "equivalence_by_core.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
