"""Which numerics a card's libraries pick for a recipe's products and attention (issue 30).

    python benchmarks/card_numerics.py --out DIR [--recipe recall-circuit]   # on a GPU (seconds)
    python benchmarks/card_numerics.py --out /tmp/cn --small                  # checks the script on the CPU

Why: the recall circuit formed in 8 of 12 distinct attempts on H100s and 6 of 29 on H200s (benchmarks/README.md,
2026-11-27), each attempt repeatable on its own kind of card under train.deterministic. Both are sm_90 with 132 SMs
and run the same Triton and Inductor code (no timing-based choices under train.deterministic), so the suspects, not
yet confirmed, are the libraries that may choose by device: cuBLAS (split-K, and whether split-K partial sums are
reduced in bfloat16, which torch allows by default) and SDPA's backend. This script says what each card does, so
two cards' JSONs can be compared.

For the recipe's model (every distinct nn.Linear shape) at one step's tokens (train.batch_docs x train.chunk_size):
the forward product, the input gradient and the weight gradient (the one that sums over every token, where split-K
happens), each from bfloat16 inputs as autocast runs them, once with cuBLAS allowed to reduce in bfloat16
(torch's default) and once not. For each: the relative error against a float64 product of the same inputs (largest
|diff| / largest |ref|), whether the two settings give the same bits, and the kernels that ran (torch.profiler).
Then SDPA at the recipe's attention shape (causal, forward + backward): the kernels that ran name the backend.
cuBLAS runs with train.deterministic's workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8, set before the first product)
unless --workspace-default. Writes DIR/card_numerics.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longtrain.device import machine, machine_words  # noqa: E402
from longtrain.model.model import LM, LMConfig  # noqa: E402
from longtrain.train.recipe import load_recipe  # noqa: E402


def linear_shapes(recipe) -> list[tuple[int, int]]:
    """Every distinct (in_features, out_features) of the recipe's model (built on the meta device: no memory)."""
    vocab = recipe.model.vocab_size or recipe.tokenizer.vocab_size
    cfg = LMConfig.from_recipe(recipe.model, recipe.attention, vocab_size=vocab)
    with torch.device("meta"):
        model = LM(cfg)
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sorted(shapes)


def kernels_of(fn, device: str) -> list[str]:
    """The device kernels (or CPU ops) one call of fn ran, in order, repeats dropped."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    if device == "cuda":  # the kernels themselves
        names = [e.name for e in prof.events() if str(e.device_type).lower().endswith("cuda")]
    else:  # the CPU ops that compute (no views, no allocations)
        names = [e.name for e in prof.events() if any(w in e.name for w in ("mm", "attention"))]
    return list(dict.fromkeys(names))[:12]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def products(tokens: int, fan_in: int, fan_out: int, device: str, seed: int) -> dict[str, tuple]:
    """The three products of one nn.Linear at `tokens` rows: (bf16 operands, float64 reference)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, fan_in, generator=g)  # [T, in]  the layer's input
    w = torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5  # [out, in]
    dy = torch.randn(tokens, fan_out, generator=g) / tokens ** 0.5  # [T, out]  the output's gradient
    xb, wb, dyb = (t.to(device=device, dtype=torch.bfloat16) for t in (x, w, dy))
    xd, wd, dyd = (t.to(device=device, dtype=torch.float64) for t in (xb, wb, dyb))  # the same (rounded) values
    return {
        "forward": (lambda: xb @ wb.t(), xd @ wd.t()),  # [T, out]
        "input_grad": (lambda: dyb @ wb, dyd @ wd),  # [T, in]
        "weight_grad": (lambda: dyb.t() @ xb, dyd.t() @ xd),  # [out, in]: sums over all T tokens
    }


def sdpa_case(batch: int, heads: int, length: int, head_dim: int, device: str) -> dict:
    q, k, v = (torch.randn(batch, heads, length, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def step():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.float().square().sum().backward()

    return {"shape": [batch, heads, length, head_dim], "kernels": kernels_of(step, device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default="recall-circuit", help="a builtin recipe's name or a recipe file")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="recipe override (repeatable)")
    ap.add_argument("--workspace-default", action="store_true", help="leave CUBLAS_WORKSPACE_CONFIG as it is")
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU: checks the script")
    a = ap.parse_args()
    if not a.workspace_default:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS makes its handle
    device = "cuda" if torch.cuda.is_available() and not a.small else "cpu"
    recipe = load_recipe(a.recipe, a.sets)
    t = recipe.train
    tokens = 64 if a.small else t.batch_docs * t.chunk_size
    shapes = linear_shapes(recipe)[:2] if a.small else linear_shapes(recipe)
    matmul = torch.backends.cuda.matmul
    rows = []
    for i, (fan_in, fan_out) in enumerate(shapes):
        for kind, (fn, ref) in products(tokens, fan_in, fan_out, device, seed=i).items():
            row = {"in": fan_in, "out": fan_out, "tokens": tokens, "product": kind}
            outs = {}
            for allow in (True, False):
                matmul.allow_bf16_reduced_precision_reduction = allow
                outs[allow] = fn()
                row[f"rel_err_bf16_reduce_{'on' if allow else 'off'}"] = rel_err(outs[allow], ref)
                row[f"kernels_bf16_reduce_{'on' if allow else 'off'}"] = kernels_of(fn, device)
            row["same_bits"] = torch.equal(outs[True], outs[False])
            row["same_kernels"] = row["kernels_bf16_reduce_on"] == row["kernels_bf16_reduce_off"]
            rows.append(row)
    matmul.allow_bf16_reduced_precision_reduction = True  # torch's default
    m = recipe.model
    attn = sdpa_case(2 if a.small else t.batch_docs, m.heads, 16 if a.small else t.chunk_size, m.d_model // m.heads,
                     device)
    rec = machine(torch.device(device))  # what a checkpoint records: device model, torch, CUDA, Triton
    result = {
        "device": rec["device"] if device == "cuda" else "cpu",
        "machine": rec,
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "recipe": a.recipe, "sets": a.sets, "products": rows, "sdpa": attn,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "card_numerics.json").write_text(json.dumps(result, indent=1))
    print(f"{machine_words(rec)}, {tokens} tokens a step")
    print("| in → out | product | rel err, bf16 reduction on | off | same bits | same kernels | kernel (on) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kernel = (r["kernels_bf16_reduce_on"] or ["?"])[0][:60]
        print(f"| {r['in']} → {r['out']} | {r['product']} | {r['rel_err_bf16_reduce_on']:.2e} | "
              f"{r['rel_err_bf16_reduce_off']:.2e} | {r['same_bits']} | {r['same_kernels']} | {kernel} |")
    print(f"SDPA {attn['shape']}: {', '.join(k[:60] for k in attn['kernels'][:6])}")


if __name__ == "__main__":
    main()
