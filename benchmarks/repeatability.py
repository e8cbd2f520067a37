"""Do two GPU runs of one seed give the same run? (`train.deterministic`, issue 30)

    python benchmarks/repeatability.py --out DIR --recipe recall-circuit --steps 1500 \
        --set data.recall.docs=12000 --variant det:train.deterministic=true --variant default

Each variant's recipe runs `--copies` times side by side (one `longtrain fit` process each, all at
once: the other runs on the GPU are the disturbance a seed study meets), with the same seed. The
table says, per variant, whether every logged loss and gradient norm of the copies is identical, the
first step where they part, the largest loss difference, and the median tokens/s of each copy.
Writes DIR/repeatability.json. `--small` checks the script on the CPU (the quickstart, a few steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def fit_command(recipe: str, run_dir: Path, sets: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "longtrain.cli", "fit", recipe, "--run-dir", str(run_dir), "--resume", "never"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compare(runs: list[list[dict]]) -> dict:
    """Identical logged numbers across the copies? The first step where they part, the largest loss gap."""
    first, gap = None, 0.0
    for records in zip(*runs):
        losses = [r["loss"] for r in records]
        norms = [r.get("grad_norm") for r in records]
        gap = max(gap, max(losses) - min(losses))
        if first is None and (len(set(losses)) > 1 or len(set(norms)) > 1):
            first = records[0]["step"]
    rates = [statistics.median([r["tokens_per_s"] for r in rs[len(rs) // 4:] if r.get("tokens_per_s")] or [0.0]) for rs in runs]
    return {"identical": first is None, "first_differing_step": first, "max_loss_gap": gap,
            "steps": min(len(r) for r in runs), "final_losses": [rs[-1]["loss"] for rs in runs], "tokens_per_s": rates}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default="recall-circuit")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="override for every run")
    ap.add_argument("--variant", action="append", default=[], help="NAME[:KEY=VALUE[,KEY=VALUE]] (repeatable)")
    ap.add_argument("--small", action="store_true", help="the quickstart for a few steps on the CPU")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.small:
        args.recipe, args.steps, args.sets = "quickstart", 6, [*args.sets, "train.device=cpu"]
    variants = args.variant or ["det:train.deterministic=true", "default"]
    common = [*args.sets, f"train.steps={args.steps}", "logging.every=10", "logging.progress=false",
              f"checkpoint.every={args.steps}"]
    # the data and tokenizer first, once (the copies would otherwise wait on the token cache's lock)
    prep = subprocess.run(fit_command(args.recipe, args.out / "prepare", common) + ["--dry-run"], capture_output=True, text=True)
    if prep.returncode:
        raise SystemExit(prep.stdout + prep.stderr)
    procs = {}
    for spec in variants:
        name, _, sets = spec.partition(":")
        for c in range(args.copies):
            run_dir = args.out / "runs" / f"{name}-{c}"
            log = (args.out / f"{name}-{c}.log").open("w")
            procs[(name, c)] = (subprocess.Popen(fit_command(args.recipe, run_dir, common + [s for s in sets.split(",") if s]),
                                                 stdout=log, stderr=subprocess.STDOUT), run_dir)
    failed = [k for k, (p, _) in procs.items() if p.wait()]
    if failed:
        raise SystemExit(f"runs failed: {failed}; see {args.out}/*.log")
    result = {}
    for spec in variants:
        name = spec.partition(":")[0]
        result[name] = compare([read(procs[(name, c)][1]) for c in range(args.copies)]) | {"settings": spec}
    (args.out / "repeatability.json").write_text(json.dumps(result, indent=2))
    print(f"{'variant':<10} {'identical':>9} {'first diff':>10} {'max |dloss|':>12} {'tokens/s per copy':>28}")
    for name, r in result.items():
        rates = ", ".join(f"{x / 1e3:.1f}k" for x in r["tokens_per_s"])
        print(f"{name:<10} {str(r['identical']):>9} {str(r['first_differing_step']):>10} {r['max_loss_gap']:>12.3g} {rates:>28}")


if __name__ == "__main__":
    main()
