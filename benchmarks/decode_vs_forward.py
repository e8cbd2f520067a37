"""Where does token-by-token decoding leave the chunked forward pass? (issue 33)

A random llama-style SparseK+SW model: a prompt prefilled in chunks, then the same tokens once through one forward
pass over them and once decoded one at a time. Forward hooks record every module's output; the rows of the two
passes are compared bit for bit. Prints (and writes OUT/decode_vs_forward.json) the positions whose selection
differs per layer, the largest |logit difference|, and each module's count of differing positions in the order the
modules finish (a block after its parts), so the first line is the first module that rounds apart.

    python benchmarks/decode_vs_forward.py --out OUT --dtype bfloat16                  # CPU: 1,024 + 200 tokens
    python benchmarks/decode_vs_forward.py --out OUT --dtype bfloat16 --device cuda --prompt 65536 --tokens 1000
    python benchmarks/decode_vs_forward.py ... --exact     # the exact decoder (one-token chunks): at 4 x 128 nothing differs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from longtrain.generate import exact_step, prefill
from longtrain.model import LM, LMConfig


def compare(model: LM, ids: torch.Tensor, n_prompt: int, chunk: int, exact: bool = False) -> dict:
    """ids [1, n_prompt + n]: per-layer selection differences, max |Δ logit| and per-module differing positions
    (exact: each token read as a one-token chunk of the forward, the Decoder's exact mode, instead of the decode step)."""
    n = ids.shape[1] - n_prompt
    names = {m: name for name, m in model.named_modules() if name}
    outputs: dict[str, list[torch.Tensor]] = {}

    def record(module, args, out):
        out = out[0] if isinstance(out, tuple) else out
        if torch.is_tensor(out) and out.dim() >= 2:
            outputs.setdefault(names[module], []).append(out.detach().clone())

    hooks = [m.register_forward_hook(record) for m in names]
    try:
        with torch.no_grad():
            cache, _ = prefill(model, ids[:, :n_prompt], chunk_size=chunk)
            outputs.clear()
            ref = model(ids[:, n_prompt:], cache=cache)
            forward = {k: v[0] for k, v in outputs.items()}
            outputs.clear()
            step_cache, differ, worst = cache, [0] * len(ref.selections), 0.0
            for t in range(n):
                token = ids[:, n_prompt + t]
                out = exact_step(model, token, step_cache) if exact else model.decode(token, step_cache, selections=True)
                step_cache = out.cache
                worst = max(worst, float((out.logits[0, 0].float() - ref.logits[0, t].float()).abs().max()))
                for layer, (sel, want) in enumerate(zip(out.selections, ref.selections)):
                    if sel is not None and not torch.equal(sel.fingerprint[0, 0], want.fingerprint[0, t]):
                        differ[layer] += 1
    finally:
        for h in hooks:
            h.remove()
    modules = {}
    for name in forward:  # in the order the modules finished in the forward pass: the first that differs rounded apart
        whole, steps = forward.get(name), outputs.get(name, [])
        if whole is None or len(steps) != n or whole.shape[1] != n or steps[0].shape[1] != 1:
            continue  # not a per-token output (e.g. the cache)
        modules[name] = sum(not torch.equal(whole[:, t], steps[t][:, 0]) for t in range(n))
    return {"tokens": n, "selections_differ_per_layer": differ, "max_abs_logit_diff": worst,
            "differing_positions_per_module": modules}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "float64"), default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens, prefilled in --chunk chunks")
    ap.add_argument("--tokens", type=int, default=200, help="tokens decoded and compared")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--exact", action="store_true", help="decode as one-token chunks of the forward (Decoder's exact)")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=2048, layers=a.layers, d_model=a.d_model, heads=a.heads, style="llama",
                   attention="sparsek+sw", topk=a.topk, window=a.window)
    model = LM(cfg).to(device=a.device, dtype=getattr(torch, a.dtype)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, a.prompt + a.tokens), generator=torch.Generator().manual_seed(7))
    res = {"dtype": a.dtype, "device": a.device, "prompt": a.prompt, "exact": a.exact,
           **compare(model, ids.to(a.device), a.prompt, a.chunk, a.exact)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "decode_vs_forward.json").write_text(json.dumps(res, indent=1))
    print(f"{a.dtype} on {a.device}, {a.tokens} tokens after {a.prompt}{' (exact)' if a.exact else ''}: "
          "selections differ per layer "
          f"{res['selections_differ_per_layer']}, max |Δ logit| {res['max_abs_logit_diff']:.3g}")
    for name, count in res["differing_positions_per_module"].items():
        if count:
            print(f"  {name}: {count} of {a.tokens} positions differ")


if __name__ == "__main__":
    main()
