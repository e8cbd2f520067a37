"""A dense T x T SparseK attention written straight from DESIGN.md section 2, for small T only.

Independent of the block-wise reference: selection by sorting each query's candidates, tau from
the standalone operator (whose gradient is the closed form, not the scan's prefix sums).
"""

import torch

from longtrain.ops import sparsek_threshold


def dense_sparsek_attention(q, k, v, u, *, topk, window, variant="hard_k_soft_v", scale=None):
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    R = H // Hkv
    scale = D**-0.5 if scale is None else scale
    kk = k.repeat_interleave(R, dim=2)
    vv = v.repeat_interleave(R, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q, kk) * scale  # [B, H, T, T]
    out = []
    for b in range(B):
        attend = torch.zeros(T, T, dtype=torch.bool)
        gate_rows = []
        for i in range(T):
            row_gate = torch.ones(T, dtype=u.dtype)
            lo = max(0, i - window + 1)
            attend[i, lo : i + 1] = window > 0
            n_cand = i - window + 1
            if topk > 0 and n_cand > 0:
                cand = torch.arange(n_cand)
                # Top-k by (u, position): sort by position, then stably by u, both descending.
                order = cand.flip(0)
                order = order[torch.sort(u[b, order].detach(), descending=True, stable=True).indices]
                sel = order[:topk]
                attend[i, sel] = True
                if n_cand > topk:
                    tau = sparsek_threshold(u[b, :n_cand], topk)
                    m = (u[b, sel] - tau).clamp(0, 1)
                else:
                    m = torch.ones(len(sel), dtype=u.dtype)
                if variant == "straight_through":
                    m = m - m.detach() + 1
                row_gate = row_gate.index_put((sel,), m)
            gate_rows.append(row_gate)
        gate = torch.stack(gate_rows).to(q.dtype)  # [T, T]
        lg = logits[b] * gate if variant == "soft_kv" else logits[b]
        lg = lg.masked_fill(~attend, -float("inf"))
        p = torch.softmax(lg, dim=-1) * gate
        out.append(torch.einsum("hij,jhd->ihd", p, vv[b]))
    return torch.stack(out)
