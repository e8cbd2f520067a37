"""Where do a chunked and an unchunked pass first part ways? (issue 24)

Runs the unchunked reference and one chunked pass of `verify-equivalence`'s model and document, keeping
per layer the attention output y (o_proj's output), the scores u, and per query the selection
fingerprint, theta position and tau. Then, per layer:
  - y: the first position whose output differs and how (elements differing, size in units of the
    activation dtype's rounding step);
  - u: the first position whose score differs, how many differ, |Δu| in float32 ulps of u;
  - selection: the first query whose selected set differs; there the two passes' theta (position,
    value) and tau, the keys that swapped in or out of the top-k with their u in both passes, and
    the reference's gap between the k-th and (k+1)-th candidate score.

    python benchmarks/equivalence_divergence.py --device cuda --tokens 1048576 --chunk-size 3001 \
        --dtype bfloat16 --json out.json
Precision modes as verify-equivalence's --dtype (bfloat16: autocast over float32 weights;
bfloat16-weights: the whole model in bf16). Prints a short report and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from longtrain.eval.equivalence import PRECISIONS, load_model, load_tokens, precision_context


class Recorder:
    """Forward hooks on every attention layer: y [L, d] and u [L, G] per call, appended per pass."""

    def __init__(self, model):
        self.y, self.u = {}, {}
        self.handles = []
        for i, blk in enumerate(model.blocks):
            self.handles.append(blk.attn.register_forward_hook(self._hook_y(i)))
            if blk.attn.scorer is not None:
                self.handles.append(blk.attn.scorer.register_forward_hook(self._hook_u(i)))

    def _hook_y(self, i):
        def hook(mod, args, out):
            self.y.setdefault(i, []).append(out[0][0].detach())  # [L, d]
        return hook

    def _hook_u(self, i):
        def hook(mod, args, out):
            self.u.setdefault(i, []).append(out[0][0].detach())  # [L, G]
        return hook

    def take(self):
        y = {i: torch.cat(v) for i, v in self.y.items()}
        u = {i: torch.cat(v) for i, v in self.u.items()}
        self.y, self.u = {}, {}
        return y, u


@torch.no_grad()
def run_pass(model, tokens, chunk, rec):
    """One pass (chunk None: unchunked): per selecting layer (fingerprint, theta_pos, tau) [rows, T], y, u."""
    T = tokens.numel()
    sels = {}
    cache = None
    for s in range(0, T, chunk or T):
        if cache is None:
            cache = model.empty_cache(1, device=tokens.device)
        out = model.hidden(tokens[None, s : s + (chunk or T)], cache=cache)
        cache = out.cache
        for i, sel in enumerate(out.selections):
            if sel is not None:
                sels.setdefault(i, []).append((sel.fingerprint, sel.theta_pos, sel.tau))
    sels = {i: tuple(torch.cat([p[j] for p in parts], 1) for j in range(3)) for i, parts in sels.items()}
    y, u = rec.take()
    return sels, y, u


def ulp32(x: torch.Tensor) -> torch.Tensor:
    """float32 spacing at |x|."""
    x = x.float().abs()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def first_true(mask: torch.Tensor) -> int | None:
    return int(mask.int().argmax()) if bool(mask.any()) else None


def topk_set(u: torch.Tensor, i: int, k: int, w: int) -> set[int]:
    """S_i from scores u [T] (candidates j <= i - w; ties by the larger position)."""
    n = i - w + 1
    if n <= 0:
        return set()
    if n <= k:
        return set(range(n))
    # Ascending and stable: equal scores keep ascending position, so the last k are the top-k.
    order = torch.argsort(u[:n].double(), stable=True)
    return set(order[-k:].tolist())


def analyse(model, ref, chk, k: int, w: int, act_dtype: torch.dtype) -> list[dict]:
    (rsel, ry, ru), (csel, cy, cu) = ref, chk
    step = torch.finfo(act_dtype).eps  # the activation dtype's relative rounding step
    layers = []
    for i in sorted(ry):
        d = {"layer": i}
        # Attention output y.
        a, b = ry[i].float(), cy[i].float()
        neq = a != b  # [T, d]
        rows = neq.any(1)
        rel = ((a - b).abs() / a.abs().clamp(min=1e-30))[neq]
        d["y"] = dict(first_position=first_true(rows), rows_differing=float(rows.float().mean()),
                      elements_differing=float(neq.float().mean()),
                      median_rel_diff_in_steps=float(rel.median() / step) if rel.numel() else 0.0,
                      max_rel_diff_in_steps=float(rel.max() / step) if rel.numel() else 0.0, dtype=str(ry[i].dtype))
        if i in ru:
            ua, ub = ru[i][:, 0].float(), cu[i][:, 0].float()
            du = (ua - ub).abs()
            ne = du > 0
            d["u"] = dict(first_position=first_true(ne), fraction_differing=float(ne.float().mean()),
                          max_abs_diff=float(du.max()), max_diff_in_f32_ulps=float((du / ulp32(ua))[ne].max()) if bool(ne.any()) else 0.0,
                          median_abs_diff=float(du[ne].median()) if bool(ne.any()) else 0.0)
        if i in rsel:
            (rfp, rth, rtau), (cfp, cth, ctau) = rsel[i], csel[i]
            bad = (rfp != cfp).any(0)
            d["agreement"] = float((rfp == cfp).float().mean())
            q = first_true(bad)
            d["first_divergence"] = q
            if q is not None:
                ua, ub = ru[i][:, 0].float(), cu[i][:, 0].float()
                tp = (int(rth[0, q]), int(cth[0, q]))
                sa, sb = topk_set(ua, q, k, w), topk_set(ub, q, k, w)
                swapped = sorted(sa ^ sb)
                cand = ua[: q - w + 1].double().sort(descending=True).values
                gap = float(cand[k - 1] - cand[k]) if cand.numel() > k else None
                d["at_first_divergence"] = dict(
                    query=q, theta_pos=tp,
                    theta_u=(float(ua[tp[0]]) if tp[0] >= 0 else None, float(ub[tp[1]]) if tp[1] >= 0 else None),
                    tau=(float(rtau[0, q]), float(ctau[0, q])),
                    kth_gap_reference=gap, theta_ulp32=float(ulp32(cand[k - 1:k]).item()) if gap is not None else None,
                    swapped=[dict(pos=j, u_ref=float(ua[j]), u_chunked=float(ub[j]), du=float(ub[j] - ua[j]),
                                  in_ref=j in sa) for j in swapped[:8]],
                    queries_since_first_u_diff=(q - d["u"]["first_position"]) if d["u"]["first_position"] is not None else None,
                )
        layers.append(d)
    return layers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--text", type=Path)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--chunk-size", type=int, action="append", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=list(PRECISIONS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    model, tokenizer = load_model(None, a.checkpoint, a.seed)
    wdt, ac = PRECISIONS[a.dtype]
    dev = torch.device(a.device)
    model = model.to(dev, wdt).eval()
    if wdt == torch.float64:
        model.cfg.backend = "naive"
    tokens = load_tokens(a.text, a.tokens, model.cfg.vocab_size, tokenizer, a.seed).to(dev)
    k, w = model.cfg.topk, model.cfg.window
    act = ac or wdt
    ctx = precision_context(a.dtype, dev)
    rec = Recorder(model)
    result = dict(dtype=a.dtype, tokens=tokens.numel(), device=str(dev), model=model.cfg.to_dict(), runs=[])
    with ctx:
        t0 = time.perf_counter()
        ref = run_pass(model, tokens, None, rec)
        print(f"reference: {time.perf_counter() - t0:.1f} s", flush=True)
        for c in a.chunk_size:
            t0 = time.perf_counter()
            chk = run_pass(model, tokens, c, rec)
            layers = analyse(model, ref, chk, k, w, act)
            result["runs"].append(dict(chunk_size=c, layers=layers))
            print(f"chunk {c} ({a.dtype}, {time.perf_counter() - t0:.1f} s):", flush=True)
            for d in layers:
                y = d["y"]
                line = (f"  layer {d['layer']}: y first differs at {y['first_position']}, rows {y['rows_differing']:.4f}, "
                        f"elements {y['elements_differing']:.4f}, median |Δ|/|y| {y['median_rel_diff_in_steps']:.2f} steps of {y['dtype']}")
                if "u" in d:
                    u = d["u"]
                    line += (f"; u first differs at {u['first_position']}, fraction {u['fraction_differing']:.4f}, "
                             f"max |Δu| {u['max_abs_diff']:.3g} ({u['max_diff_in_f32_ulps']:.0f} f32 ulps), "
                             f"median {u['median_abs_diff']:.3g}")
                if "agreement" in d:
                    line += f"; agreement {d['agreement']:.6f}, first divergence {d['first_divergence']}"
                print(line, flush=True)
                if d.get("at_first_divergence"):
                    print(f"    at it: {json.dumps(d['at_first_divergence'])}", flush=True)
            del chk
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
