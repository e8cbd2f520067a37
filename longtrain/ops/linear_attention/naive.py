"""Causal linear attention in plain PyTorch, chunk-wise: the reference and the CPU path.

For queries i and keys j of one chunk, continuing from a state (the keys before the chunk):

    num_i = phi_q_i . (S0 + sum_{j <= i} phi_k_j v_j^T)      S0 [F, D]: sum of phi_k v^T before the chunk
    den_i = phi_q_i . (z0 + sum_{j <= i} phi_k_j)            z0 [F]:    sum of phi_k before the chunk

Unnormalised: the SparseK+Linear+SW op mixes them with the softmax part before dividing. Computed
in blocks of C keys (intra-block C x C products plus a prefix of per-block states), so time is
O(L (C + F) D) and no L x L matrix or per-position F x D state is formed. The GPU fast path
(fla.py) has the same signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def feature_map(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(head-wise linear(x)) + 1 (paper, Appendix B.1): x [B, T, H, D], weight [Hkv, D, F]
    (H a multiple of Hkv: query heads of a group share their key head's map) -> [B, T, H, F], all > 0."""
    B, T, H, D = x.shape
    Hkv = weight.shape[0]
    y = torch.einsum("btgrd,gdf->btgrf", x.view(B, T, Hkv, H // Hkv, D), weight.to(x.dtype))
    return (F.elu(y) + 1).reshape(B, T, H, weight.shape[-1])


def causal_linear_attention_naive(
    phq: torch.Tensor,  # [B, L, H, F] phi of the queries
    phk: torch.Tensor,  # [B, L, Hkv, F] phi of the keys (0 where a key is padding)
    v: torch.Tensor,  # [B, L, Hkv, D]
    state_kv: torch.Tensor,  # [B, Hkv, F, D] sum of phi_k v^T over the keys before the chunk
    state_k: torch.Tensor,  # [B, Hkv, F] sum of phi_k over them
    block: int = 64,
    wide: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num [B, L, H, D], den [B, L, H]) of causal linear attention continuing from the state (module doc), in
    float32 at least. wide: summed in float64 and rounded once at the end, so that a position's sums do not depend
    on where its chunk starts (the blocks and the carried state group the same terms otherwise)."""
    B, L, H, Fd = phq.shape
    Hkv, D = v.shape[2], v.shape[3]
    R = H // Hkv
    out_dtype = torch.promote_types(phq.dtype, torch.float32)  # sums over the whole chunk: float32 at least
    cdt = torch.float64 if wide else out_dtype
    phq, phk, v = phq.to(cdt), phk.to(cdt), v.to(cdt)
    n = -(-L // block)
    pad = n * block - L
    q = F.pad(phq, (0, 0, 0, 0, 0, pad)).view(B, n, block, Hkv, R, Fd)
    k = F.pad(phk, (0, 0, 0, 0, 0, pad)).view(B, n, block, Hkv, Fd)
    vv = F.pad(v, (0, 0, 0, 0, 0, pad)).view(B, n, block, Hkv, D)
    # Intra-block: keys j <= i of the same block.
    causal = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
    a = torch.einsum("bnigrf,bnjgf->bngrij", q, k).masked_fill(~causal, 0)  # [B, n, Hkv, R, C, C]
    num = torch.einsum("bngrij,bnjgd->bnigrd", a, vv)  # [B, n, C, Hkv, R, D]
    # Inter-block: the state at each block start (the carried state plus every earlier block).
    blk_kv = torch.einsum("bnjgf,bnjgd->bngfd", k, vv)  # [B, n, Hkv, F, D]
    # Exclusive prefix as a shifted cumsum, not cumsum - blk: a query's sums must not depend on the keys
    # after it in its block (a shorter or padded chunk would otherwise round them differently).
    start_kv = state_kv[:, None].to(cdt) + F.pad(blk_kv.cumsum(1), (0, 0, 0, 0, 0, 0, 1, 0))[:, :n]
    num = num + torch.einsum("bnigrf,bngfd->bnigrd", q, start_kv)
    z = state_k[:, None, None].to(cdt) + k.reshape(B, n * block, Hkv, Fd).cumsum(1).view(B, n, block, Hkv, Fd)
    den = torch.einsum("bnigrf,bnigf->bnigr", q, z)  # [B, n, C, Hkv, R]
    return num.reshape(B, n * block, H, D)[:, :L].to(out_dtype), den.reshape(B, n * block, H)[:, :L].to(out_dtype)
