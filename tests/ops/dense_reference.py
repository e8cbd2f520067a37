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
        attend, gate = dense_gates(u[b], topk=topk, window=window, variant=variant)
        gate = gate.to(q.dtype)  # [T, T]
        lg = logits[b] * gate if variant == "soft_kv" else logits[b]
        lg = lg.masked_fill(~attend, -float("inf"))
        p = torch.softmax(lg, dim=-1) * gate
        out.append(torch.einsum("hij,jhd->ihd", p, vv[b]))
    return torch.stack(out)


def dense_gates(u, *, topk, window, variant="hard_k_soft_v"):
    """attend [T, T] bool (S_i u W_i) and gate [T, T] (m on S_i, 1 on W_i and elsewhere) for one row's u [T]."""
    T = u.shape[0]
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
            order = order[torch.sort(u[order].detach(), descending=True, stable=True).indices]
            sel = order[:topk]
            attend[i, sel] = True
            if n_cand > topk:
                tau = sparsek_threshold(u[:n_cand], topk)
                m = (u[sel] - tau).clamp(0, 1)
            else:
                m = torch.ones(len(sel), dtype=u.dtype)
            if variant == "straight_through":
                m = m - m.detach() + 1
            row_gate = row_gate.index_put((sel,), m)
        gate_rows.append(row_gate)
    return attend, torch.stack(gate_rows)


def dense_sparsek_linear_attention(q, k, v, u, phi_weight, *, topk, window, variant="hard_k_soft_v", scale=None,
                                   linear_norm="sum", linear_gain=None, phi_q=None, phi_k=None):
    """The paper's SparseK+Linear+SW formula (Appendix B.1) over the whole T x T causal matrix:

    o_i = sum_{j<=i} (g_ij e^{s_ij} + a_h c_i (1 - g_ij) phi(q_i).phi(k_j)) v_j / sum_{j<=i} (same without v_j)

    with g = m on S_i, 1 on W_i, 0 elsewhere, phi(x) = elu(x W_h) + 1 (no stabiliser: small inputs only);
    c_i = 1 (linear_norm sum, the paper's) or 1 / max(1, i - w + 1), one over the keys beyond the window (mean);
    a_h = linear_gain[h] (head h's learned gain, attention.linear_gain learned) or 1; phi reads phi_q and phi_k
    where given (q and k as they were before RoPE: attention.linear_rope unrotated), else q and k."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    R = H // Hkv
    scale = D**-0.5 if scale is None else scale
    w = phi_weight.repeat_interleave(R, 0)  # [H, D, F]
    phi_q, phi_k = q if phi_q is None else phi_q, k if phi_k is None else phi_k
    phq = torch.nn.functional.elu(torch.einsum("bthd,hdf->bthf", phi_q, w)) + 1
    phk = torch.nn.functional.elu(torch.einsum("bthd,hdf->bthf", phi_k.repeat_interleave(R, 2), w)) + 1
    vv = v.repeat_interleave(R, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(R, 2)) * scale  # [B, H, T, T]
    lin = torch.einsum("bihf,bjhf->bhij", phq, phk)  # [B, H, T, T]
    if linear_norm == "mean":
        lin = lin / (torch.arange(T) - window + 1).clamp(min=1).to(lin.dtype)[:, None]  # row i over its count
    if linear_gain is not None:
        lin = lin * linear_gain[:, None, None]  # head h's
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = []
    for b in range(B):
        attend, gate = dense_gates(u[b], topk=topk, window=window, variant=variant)
        g = torch.where(attend, gate, 0).to(q.dtype)  # [T, T]: 0 off S u W
        lg = logits[b] * g if variant == "soft_kv" else logits[b]
        weight = torch.where(causal, g * lg.exp() + (1 - g) * lin[b], 0)  # [H, T, T]
        out.append(torch.einsum("hij,jhd->ihd", weight, vv[b]) / weight.sum(-1).T[..., None])
    return torch.stack(out)
