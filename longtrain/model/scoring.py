"""SparseK importance scores (docs/DESIGN.md section 2): u_j = TimestepNorm(x_j · w_score) + eps_slope · j.

Scores are float32 (float64 in a float64 model) even under bf16 autocast: selection compares them,
and a rounding flip changes which keys a query sees. TimestepNorm uses causal running statistics
over the document; the totals before the chunk come from the cache and the chunk's prefix sums are
one cumsum that starts from them, so chunked and unchunked runs compute the same sums in the same
order on the CPU (bit-identical there; on CUDA to the last bit of the float64 sums).
"""

from __future__ import annotations

import torch
import torch.nn as nn

TSN_EPS = 1e-5


def score_dtype(activation_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if activation_dtype == torch.float64 else torch.float32


class Scorer(nn.Module):
    """The scoring network of one layer: G groups (1 = shared by all heads, or one per KV head)."""

    def __init__(self, d_model: int, groups: int, *, timestep_norm: bool, eps_slope: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, d_model))  # [G, d]
        self.timestep_norm = timestep_norm
        self.eps_slope = eps_slope
        self.compiled = None  # importance_scores compiled by `compile_scores` (LM.compile_blocks)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # ||w|| ~ 1, so a unit-variance input gives unit-variance scores (as the mimic init does).
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)

    def forward(
        self,
        x: torch.Tensor,  # [B, L, d] the attention input (after the block's norm)
        pos: torch.Tensor,  # [B, L] int64 absolute positions
        valid: torch.Tensor,  # [B, L] bool (False: padding after the row's length)
        seen: torch.Tensor,  # [B] int64 tokens before the chunk (the TimestepNorm count)
        score_sum: torch.Tensor,  # [B, G] float64 carried sum of raw scores
        score_sumsq: torch.Tensor,  # [B, G] float64 carried sum of squares
        decode: bool = False,  # one token per row (L = 1)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u [B, L, G], next score_sum, next score_sumsq)."""
        # Through the module's call, so FSDP's hooks have gathered the weight before the (possibly
        # compiled) arithmetic reads it: a compiled bound forward would skip them and see a DTensor.
        fn = self.compiled or importance_scores
        return fn(x, self.weight, pos, valid, seen, score_sum, score_sumsq,
                  timestep_norm=self.timestep_norm, eps_slope=self.eps_slope, one_token=decode)

    def compile_scores(self, **compile_kwargs) -> None:
        """Compile the score arithmetic (its float64 elementwise work fused); the module stays as it is,
        so the state dict keeps its names and FSDP its hooks."""
        self.compiled = torch.compile(importance_scores, **compile_kwargs)


def importance_scores(
    x: torch.Tensor,  # [B, L, d]
    weight: torch.Tensor,  # [G, d]
    pos: torch.Tensor,  # [B, L] int64
    valid: torch.Tensor,  # [B, L] bool
    seen: torch.Tensor,  # [B] int64
    score_sum: torch.Tensor,  # [B, G] float64
    score_sumsq: torch.Tensor,  # [B, G] float64
    *,
    timestep_norm: bool,
    eps_slope: float,
    one_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scorer.forward's arithmetic: (u [B, L, G], next score_sum, next score_sumsq). The product x · w as a
    sum of elementwise products when compiled or decoding (one_token, L = 1), a float64 matmul otherwise:
    compiled, the cast, products and sum fuse into one reduction that reads x in its own dtype, and the
    backward saves x, not a float64 copy of it (a [B, L, d] float64 tensor per layer, written, read and kept
    for the backward by the matmul); decoding, cuBLAS's float64 GEMV of one row is a split-K GEMM plus its
    reduction (~25 us per layer on an H200: 10% of a decode step). Eager, the elementwise form would
    materialise [B, L, G, d] float64, so it stays a matmul; both give the same sums to float64 rounding."""
    sd = score_dtype(x.dtype)
    with torch.autocast(device_type=x.device.type, enabled=False):
        # float64 from the first operation: a float32 product's last bit depends on the kernel the
        # matmul picks for the chunk's shape, and one ulp of u can swap two keys at the k-th score.
        if one_token or torch.compiler.is_compiling():
            r = (x.to(torch.float64)[..., None, :] * weight.to(torch.float64)).sum(-1)  # [B, L, G]
        else:
            r = x.to(torch.float64) @ weight.to(torch.float64).t()  # [B, L, G]
    r64 = torch.where(valid[..., None], r, 0.0)
    scores = one_token_scores if one_token else prefix_scores
    u, csum, csq = scores(r64, pos, valid, seen, score_sum, score_sumsq, timestep_norm=timestep_norm, eps_slope=eps_slope)
    return u.to(sd), csum.detach(), csq.detach()


def prefix_scores(
    r64: torch.Tensor,  # [B, L, G] float64 raw scores x · w (0 where invalid)
    pos: torch.Tensor,  # [B, L] int64
    valid: torch.Tensor,  # [B, L] bool
    seen: torch.Tensor,  # [B] int64
    score_sum: torch.Tensor,  # [B, G] float64
    score_sumsq: torch.Tensor,  # [B, G] float64
    *,
    timestep_norm: bool,
    eps_slope: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u [B, L, G] float64 from the raw scores and the carried totals, and the totals after the chunk [B, G]."""
    # Prefix sums that start from the carried totals: [carry, r_0, r_1, ...] -> drop the carry. One
    # cumsum for both, along the last (contiguous) dim: there CUDA scans in parallel (~0.01 ms at
    # 16k tokens), while a cumsum along dim 1 of [B, L, 2G] runs one thread per column through all
    # L positions (~0.4 ms per call, 10 ms per training step at 12 layers). On the CPU both are
    # sequential, so chunked and unchunked sums are the same bits there; CUDA's parallel scan
    # associates by its tile layout, which can move the float64 sums' last bit between chunkings.
    carry = torch.cat([score_sum, score_sumsq], -1)[..., None].to(r64)  # [B, 2G, 1]
    terms = torch.cat([r64, r64 * r64], -1).transpose(1, 2)  # [B, 2G, L]
    both = torch.cat([carry, terms], -1).cumsum(-1)[..., 1:].transpose(1, 2)  # [B, L, 2G]
    csum, csq = both.split(r64.shape[-1], -1)  # [B, L, G] each
    count = (seen[:, None] + valid.cumsum(1)).clamp(min=1).to(torch.float64)[..., None]  # [B, L, 1]
    u = _normalized(r64, csum, csq, count, pos, valid, timestep_norm=timestep_norm, eps_slope=eps_slope)
    return u, csum[:, -1], csq[:, -1]


def one_token_scores(r64, pos, valid, seen, score_sum, score_sumsq, *, timestep_norm: bool, eps_slope: float):
    """prefix_scores for L = 1 (decoding), the same bits: the prefix sums are the carried totals plus this token's
    term, the one float64 addition the chunk's cumsum makes, written without the cat, transpose and scan, so that
    a compiled decode step computes the scorer in one kernel (a scan is a kernel of its own)."""
    csum = (score_sum.to(r64) + r64[:, 0])[:, None]  # [B, 1, G]
    csq = (score_sumsq.to(r64) + r64[:, 0] * r64[:, 0])[:, None]
    count = (seen + valid[:, 0]).clamp(min=1).to(torch.float64)[:, None, None]  # [B, 1, 1]
    u = _normalized(r64, csum, csq, count, pos, valid, timestep_norm=timestep_norm, eps_slope=eps_slope)
    return u, csum[:, 0], csq[:, 0]


def _normalized(r64, csum, csq, count, pos, valid, *, timestep_norm: bool, eps_slope: float) -> torch.Tensor:
    """u [B, L, G]: TimestepNorm of the raw scores r64 by the prefix sums csum, csq [B, L, G] over count [B, L, 1]
    tokens, plus the position slope."""
    if timestep_norm:
        mean = csum / count
        var = (csq / count - mean * mean).clamp(min=0.0)
        n = torch.where(valid[..., None], (r64 - mean) / torch.sqrt(var + TSN_EPS), 0.0)
    else:
        n = r64
    return n + eps_slope * pos.to(torch.float64)[..., None]


@torch.no_grad()
def mimic_score_weight(
    wq: torch.Tensor,  # [H·D, d] query projection (nn.Linear weight)
    wk: torch.Tensor,  # [Hkv·D, d] key projection
    heads: int,
    kv_heads: int,
    groups: int,
) -> torch.Tensor:
    """w = W_Q W_Kᵀ 1 / ||·|| (paper section 3.5) per score group: [G, d].

    In the paper's row convention (q = x W_Q) this is Σ_h W_Qh W_K(h)ᵀ 1 over the heads of a group,
    so u_j ranks keys roughly as their accumulated attention would.
    """
    d = wq.shape[1]
    D = wq.shape[0] // heads
    q = wq.reshape(heads, D, d).to(torch.float64)  # W_Q of head h is q[h]ᵀ, [d, D]
    k = wk.reshape(kv_heads, D, d).to(torch.float64).repeat_interleave(heads // kv_heads, 0)  # [H, D, d]
    per_head = torch.einsum("hei,he->hi", q, k.sum(-1))  # W_Qh (W_Khᵀ 1): [H, d]
    w = per_head.reshape(groups, heads // groups, d).sum(1)  # [G, d]
    return (w / w.norm(dim=-1, keepdim=True).clamp(min=1e-12)).to(wq.dtype)
