"""How much of a SparseK+Linear+SW query's attention goes to the linear part? (issue 38)

The paper's formula shares one denominator between the softmax part (the window and the selected keys,
e^{q.k / sqrt(D)}) and the linear part (every other causal key, phi(q).phi(k)). With phi = elu(x W) + 1 and
W = I at init, phi(q).phi(k) is about F per key against e^{small} ~ 1, and the linear keys grow with the
position: the share below is the linear part's fraction of each query's denominator, an upper bound of the
softmax mass taken (the window plus the best k older keys by q.k, every older key counted as linear).

    python benchmarks/linear_mass.py --out OUT                      # random init at books_study's small size
    python benchmarks/linear_mass.py --out OUT --linear-norm mean   # the same with attention.linear_norm mean
    python benchmarks/linear_mass.py --out OUT --linear-norm mean --linear-gain learned   # and a gain from 1/F
    python benchmarks/linear_mass.py --out OUT --checkpoint RUN     # a trained run (its last checkpoint), a book
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from longtrain.model import LM, LMConfig
from longtrain.ops.linear_attention import feature_map
from longtrain.ops.sparsek_attention.linear import query_scale, scaled_query_features

BUCKETS = [(0, 256), (256, 1024), (1024, 2048), (2048, 4096), (4096, 1 << 30)]


def shares(model: LM, ids: torch.Tensor, every: int = 32) -> list[dict]:
    """Per layer: the median linear share of the denominator by query position bucket (queries every `every`)."""
    cfg, rec = model.cfg, []
    for block in model.blocks:
        def spy(x, q, k, v, *args, _attend=block.attn.attend, _attn=block.attn, **kw):
            gain = _attn.linear_gain()
            rec.append((q.detach(), k.detach(), _attn.phi_weight.detach(), None if gain is None else gain.detach()))
            return _attend(x, q, k, v, *args, **kw)
        block.attn.attend = spy
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for block in model.blocks:
            del block.attn.attend  # the instance's spy: the class's method again
    k_sel, w = cfg.topk, cfg.window
    out = []
    for layer, (q, k, phi_w, gain) in enumerate(rec):
        q, k = q[0].double(), k[0].double()  # [T, H, D], [T, Hkv, D]
        T, H, D = q.shape
        R = H // k.shape[1]
        phq = feature_map(q[None], phi_w.double())[0]  # [T, H, F]
        scale = query_scale(torch.arange(T), w, cfg.linear_norm, phq.dtype)  # [T] (mean) or None
        phq = scaled_query_features(phq, scale, None if gain is None else gain.double())  # as the chunk op scales it
        phk = feature_map(k[None], phi_w.double())[0].repeat_interleave(R, 1)  # [T, H, F]
        k = k.repeat_interleave(R, 1)  # [T, H, D]
        prefix = torch.cat([torch.zeros(1, H, phk.shape[-1], dtype=phk.dtype), phk.cumsum(0)])  # [T + 1, H, F]
        per = {b: [] for b in BUCKETS}
        for i in range(w, T, every):
            old = i - w + 1  # keys 0 .. old - 1 are beyond the window
            lin = (phq[i] * prefix[old]).sum(-1)  # [H]
            s = torch.einsum("hd,jhd->hj", q[i], k[: i + 1]) * D**-0.5  # [H, i + 1]
            soft = s[:, old:].exp().sum(-1) + s[:, :old].topk(min(k_sel, old), -1).values.exp().sum(-1)
            share = (lin / (lin + soft)).median().item()
            per[next(b for b in BUCKETS if b[0] <= i < b[1])].append(share)
        out.append({"layer": layer, **{f"{a}-{b}": sorted(v)[len(v) // 2] for (a, b), v in per.items() if v}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, help="a run folder or checkpoint (default: random init)")
    ap.add_argument("--text", type=Path, help="with --checkpoint: a book to read (default: random tokens)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--linear-norm", choices=["sum", "mean"], default="sum", help="without --checkpoint: the model's")
    ap.add_argument("--linear-gain", choices=["fixed", "learned"], default="fixed",
                    help="without --checkpoint: the model's (learned starts at 1/F)")
    a = ap.parse_args()
    ids = None
    if a.checkpoint:
        from longtrain.train.checkpoint import load_checkpoint
        loaded = load_checkpoint(a.checkpoint, dtype=torch.float32)
        model = loaded.model.eval()
        if a.text:
            ids = torch.tensor([loaded.tokenizer.encode(a.text.read_text()).ids[: a.tokens]])
    else:  # books_study's small size with gutenberg-sparsek's split
        torch.manual_seed(0)
        model = LM(LMConfig(vocab_size=16384, layers=8, d_model=512, heads=8, style="llama",
                            attention="sparsek+linear+sw", topk=192, window=64,
                            linear_norm=a.linear_norm, linear_gain=a.linear_gain)).eval()
    if ids is None:
        ids = torch.randint(0, model.cfg.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    res = {"checkpoint": str(a.checkpoint) if a.checkpoint else None, "linear_norm": model.cfg.linear_norm,
           "linear_gain": model.cfg.linear_gain,
           "topk": model.cfg.topk,
           "window": model.cfg.window, "tokens": a.tokens, "layers": shares(model, ids)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "linear_mass.json").write_text(json.dumps(res, indent=1))
    for row in res["layers"]:
        print(" ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
