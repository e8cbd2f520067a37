"""The trainer's memory estimate beside the peak a short fit reaches (issue 31).

The measured peak is what the run adds from just before it builds the model (the data is loaded, the
compiled selection scan warmed): on the CPU the resident memory (its high-water mark), on CUDA the memory
tensors take (torch.cuda.max_memory_allocated). The estimate is the trainer's for the same span
(`longtrain.train.memory.estimate_training_bytes`, at the furthest document position the run reaches;
the summary line adds what the process already held). One JSON line per run:

    python benchmarks/memory_estimate.py [RECIPE] [--set key=value ...] [--size "key=value ..." ...] [--steps N] [--out FILE.json]

On an H100 (a few minutes; exit 1 if a ratio is outside [1/1.5, 1.5]):
    PYTHONPATH=. python benchmarks/memory_estimate.py quickstart --gpu-sizes --steps 4 --out $OUT/memory_estimate-h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tempfile
from pathlib import Path

import torch

from longtrain.eval.equivalence import PeakMemory
from longtrain.model import LM, LMConfig
from longtrain.train import memory, summary
from longtrain.train.recipe import load_recipe
from longtrain.train.trainer import Trainer

# GPU sizes: quickstart's data (on every machine) at three model, batch and pool sizes, eager (no compile)
GPU = ["train.device=cuda", "train.compile=false"]
GPU_SIZES = [
    [*GPU, "train.batch_docs=16", "train.chunk_size=1024"],
    [*GPU, "model.d_model=512", "model.heads=8", "model.layers=8", "attention.topk=1024", "attention.window=1024",
     "train.batch_docs=16", "train.chunk_size=2048"],
    [*GPU, "model.d_model=1024", "model.heads=16", "model.layers=12", "attention.topk=2048", "attention.window=512",
     "train.batch_docs=8", "train.chunk_size=4096"],
]


class Measured(Trainer):
    """A Trainer that starts measuring once its data is read, before the model exists."""

    def read_inputs(self):
        meta = super().read_inputs()
        warm_scan()
        gc.collect()
        self.peak = PeakMemory(self.device)
        self.peak.__enter__()
        self.high_water = max_rss()
        return meta

    def peak_bytes(self) -> int:
        """The run's peak over the level at the start: on the CPU the kernel's high-water mark when the run
        set a new one (a sampler can miss a short peak), else the sampled peak."""
        self.peak.__exit__(None, None, None)
        if self.device.type == "cpu" and max_rss() > self.high_water:
            return max(self.peak.bytes, max_rss() - self.peak.base)
        return self.peak.bytes


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def warm_scan() -> None:
    """A tiny training step first: numba's scan compiled (or loaded from its cache) and the libraries' code
    a step runs paged in, so the measurement holds neither (the summary's total counts them as held)."""
    model = LM(LMConfig(vocab_size=8, layers=1, d_model=8, heads=1, attention="sparsek+sw", topk=2, window=2))
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.zeros(2, 16, dtype=torch.long)
    model(tokens, targets=tokens).loss_sum.backward()
    opt.step()


def measure(recipe_name: str | None, overrides: list[str], steps: int) -> dict:
    sets = [*overrides, f"train.steps={steps}", "train.valid_every=0", "logging.progress=false",
            f"checkpoint.every={steps + 1}"]
    recipe = load_recipe(recipe_name, sets)
    with tempfile.TemporaryDirectory() as tmp:
        t = Measured(recipe, run_dir=Path(tmp) / "run", resume="never")
        t.train()
        peak = t.peak_bytes()
        reached = min(steps * recipe.train.chunk_size, memory.longest_position(t.corpus, t.cfg))
        estimate = summary.estimate_memory(t, reached)
    return {"recipe": recipe.name, "sets": overrides, "steps": steps, "device": str(t.device),
            "estimate_bytes": estimate, "peak_bytes": peak, "ratio": estimate / max(peak, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", nargs="?", default=None)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", dest="sizes", action="append", default=[],
                    help="one run's overrides on top of --set, space-separated (repeatable: one run each)")
    ap.add_argument("--gpu-sizes", action="store_true", help="the three GPU_SIZES on top of --set")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sizes = GPU_SIZES if args.gpu_sizes else [size.split() for size in args.sizes] or [[]]
    runs = [[*args.sets, *size] for size in sizes]
    results = []
    for sets in runs:
        results.append(measure(args.recipe, sets, args.steps))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0 if all(1 / 1.5 <= r["ratio"] <= 1.5 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
