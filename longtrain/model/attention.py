"""The model's attention layer: projections, RoPE, the SparseK op (or its linear variants, or full
causal attention) and the output projection, with the layers' chunk-invariant Linear (longtrain.model.model
builds the blocks from them)."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from longtrain.model.attention_types import linear
from longtrain.model.cache import FullKVCache, LayerCache
from longtrain.model.rope import apply_rope, inverse_frequencies
from longtrain.model.score_distill import score_distill_loss
from longtrain.model.scoring import Scorer, score_dtype
from longtrain.ops.sparsek_attention import (
    ChunkSelection,
    SparseKCache,
    sparsek_attention_chunk,
    sparsek_attention_decode,
)
from longtrain.ops.sparsek_attention.linear import (
    SparseKLinearCache,
    sparsek_linear_attention_chunk,
    sparsek_linear_attention_decode,
)

if TYPE_CHECKING:
    from longtrain.model.model import LMConfig


EXACT_ROWS = 1024  # rows_padded's default: rows as many as a long chunk's (MKL: any forward's bits; cuBLAS: not short ones)
_padded_rows = 0  # products with fewer rows than this run padded with zero rows (0: off); set by rows_padded


@contextlib.contextmanager
def rows_padded(rows: int = EXACT_ROWS):
    """Inside: every chunk_invariant_linear of fewer rows than `rows` (without gradients) computes them as the first
    rows of a `rows`-row product. A GEMM's kernel, and so a row's bits, can depend on the row count: cuBLAS's one-row
    bf16 product at 12 x 768's MLP down projection rounds apart from the same row in a chunk, MKL's float32 gemv too.
    The exact decoder's one-token steps run inside it; the fast decoder does not (it would cost a chunk's GEMMs)."""
    global _padded_rows
    before, _padded_rows = _padded_rows, rows
    try:
        yield
    finally:
        _padded_rows = before


def initial_linear_log_gain(heads: int, features: int) -> torch.Tensor:
    """[heads] log of the learned linear gain at init: -log F, one key's weight (Attention.__init__'s comment)."""
    return torch.full((heads,), -math.log(features))


def chunk_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear (the plain reference), but on the CPU in bf16/fp16 without gradients summed in float64, and inside
    rows_padded with few rows as rows of a larger product.

    The CPU's half-precision GEMMs (oneDNN, AMX) pick their blocking and accumulation order by the row
    count and threads, so a row's product depended on the chunk it came in (quickstart at chunks of 61:
    selection agreement 0.97). Half-precision products are exact in float64 and its sums are rounded
    2^45 times finer than bf16's, so rounding them to the compute dtype gives a row the same bits in any
    chunk (H100s' bf16 GEMMs already do). Training (gradients) keeps the fast kernels.
    """
    rows = x.numel() // x.shape[-1] if _padded_rows else 0  # off (0): no shape arithmetic for compile to trace
    if rows and rows < _padded_rows and not torch.is_grad_enabled():
        flat = x.reshape(rows, x.shape[-1])  # [rows, K]
        padded = torch.cat([flat, flat.new_zeros(_padded_rows - rows, flat.shape[1])])  # [_padded_rows, K]
        return _linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])
    return _linear(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    if x.device.type != "cpu" or torch.is_grad_enabled() or dtype not in (torch.bfloat16, torch.float16):
        return F.linear(x, weight, bias)
    wide = [t.to(dtype).double() if t is not None else None for t in (x, weight, bias)]  # rounded as autocast rounds
    with torch.autocast("cpu", enabled=False):
        return F.linear(*wide).to(dtype)


class Linear(nn.Linear):
    """nn.Linear through `chunk_invariant_linear` (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return chunk_invariant_linear(x, self.weight, self.bias)


# ----------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Multi-head (grouped-query) attention with SparseK+SW, SparseK, SW, their linear variants or full attention."""

    def __init__(self, cfg: LMConfig, bias: bool):
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, d = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
        qkv_bias = bias if cfg.qkv_bias is None else cfg.qkv_bias
        self.q_proj = Linear(d, H * D, bias=qkv_bias)
        self.k_proj = Linear(d, Hkv * D, bias=qkv_bias)
        self.v_proj = Linear(d, Hkv * D, bias=qkv_bias)
        self.o_proj = Linear(H * D, d, bias=bias)
        G = cfg.score_group_count
        self.scorer = Scorer(d, G, timestep_norm=cfg.timestep_norm, eps_slope=cfg.eps_slope) if G else None
        # Linear types: phi(x) = elu(x W_h) + 1, one D x D map per KV head (its query heads share it).
        self.phi_weight = nn.Parameter(torch.eye(D).repeat(Hkv, 1, 1)) if linear(cfg.attention) else None
        # attention.linear_gain learned: log of a factor per query head on phi(q), from 1/F: phi ~ 1 per feature at
        # init, so phi(q).phi(k) ~ F, and the linear part starts as one key of weight ~1, not F keys' worth
        self.linear_log_gain = nn.Parameter(initial_linear_log_gain(H, D)) if cfg.linear_gain == "learned" else None
        self._phi_inv_freq: torch.Tensor | None = None  # attention.linear_rope unrotated: made once per device
        # What the op is called with (sw is SparseK with k = 0); LMConfig holds 0 for an unused size.
        self.topk, self.window = cfg.topk, cfg.window
        self.distill_queries = 0  # > 0: compute score_distill_loss in training passes (LM.set_score_distill)
        self.distill_loss: torch.Tensor | None = None  # [] the last training pass's, read by LM.hidden

    def linear_gain(self) -> torch.Tensor | None:
        """The linear part's factor per query head [H] (attention.linear_gain learned), else None (1)."""
        return None if self.linear_log_gain is None else self.linear_log_gain.exp()

    def phi_inv_freq(self, device: torch.device) -> torch.Tensor | None:
        """RoPE's inverse frequencies [R/2] float64 with which phi reads q and k rotated back (attention.linear_rope
        unrotated; the op's phi_inv_freq), else None. Not a buffer: a model cast to bfloat16 would round them."""
        cfg = self.cfg
        if cfg.linear_rope != "unrotated":
            return None
        if self._phi_inv_freq is None or self._phi_inv_freq.device != device:
            self._phi_inv_freq = inverse_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, device)[0]
        return self._phi_inv_freq

    def empty_cache(self, batch: int, *, dtype, device) -> LayerCache:
        cfg = self.cfg
        G = cfg.score_group_count
        if cfg.attention == "full":
            attn = FullKVCache.empty(batch, cfg.kv_heads, cfg.head_dim, dtype=dtype, device=device)
        elif linear(cfg.attention):
            attn = SparseKLinearCache.empty(
                batch, self.topk, self.window, cfg.kv_heads, cfg.head_dim, dtype=dtype,
                score_dtype=score_dtype(dtype), device=device, cap=cfg.threshold_cap,
            )
        else:
            folded = G > 1  # per-KV-head groups: one op row per (row, group), one KV head each
            attn = SparseKCache.empty(
                batch * G if folded else batch, self.topk, self.window, 1 if folded else cfg.kv_heads,
                cfg.head_dim, dtype=dtype, score_dtype=score_dtype(dtype), device=device, cap=cfg.threshold_cap,
            )
        zeros = torch.zeros(batch, G, dtype=torch.float64, device=device)
        return LayerCache(attn, zeros, zeros.clone())

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, L, H, D], k and v [B, L, Hkv, D] of the attention input h [B, L, d]; q and k after RoPE."""
        cfg = self.cfg
        B, L, _ = h.shape
        H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        q = apply_rope(self.q_proj(h).view(B, L, H, D), cos, sin)  # [B, L, H, D]
        k = apply_rope(self.k_proj(h).view(B, L, Hkv, D), cos, sin)  # [B, L, Hkv, D], cached after RoPE
        v = self.v_proj(h).view(B, L, Hkv, D)  # [B, L, Hkv, D]
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [B, L, d]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, L, D/2]
        pos: torch.Tensor,  # [B, L] int64 absolute positions
        valid: torch.Tensor,  # [B, L] bool
        seen: torch.Tensor,  # [B] int64
        lengths: torch.Tensor,  # [B] int64
        cache: LayerCache,
        decode: bool = False,  # L = 1, every row valid: the op's decode step instead of a chunk
        with_selection: bool = True,  # decode: also report what was selected (a few ops per layer)
        full_bias: torch.Tensor | None = None,  # full attention: the chunk's mask (full_attention_bias)
        align: bool | None = None,  # no gradients: lay query tiles at absolute positions (the op's `align`)
    ) -> tuple[torch.Tensor, LayerCache, ChunkSelection | None]:
        B, L, _ = x.shape
        q, k, v = self.project(x, *rope)
        o, new, sel = self.attend(x, q, k, v, pos, valid, seen, lengths, cache, decode, with_selection, full_bias, align)
        return self.o_proj(o.reshape(B, L, -1)), new, sel  # [B, L, d]

    def attend(
        self,
        x: torch.Tensor,  # [B, L, d] the attention input (the scorer reads it)
        q: torch.Tensor,  # [B, L, H, D]
        k: torch.Tensor,  # [B, L, Hkv, D]
        v: torch.Tensor,  # [B, L, Hkv, D]
        pos: torch.Tensor,
        valid: torch.Tensor,
        seen: torch.Tensor,
        lengths: torch.Tensor,
        cache: LayerCache,
        decode: bool = False,
        with_selection: bool = True,
        full_bias: torch.Tensor | None = None,
        align: bool | None = None,
    ) -> tuple[torch.Tensor, LayerCache, ChunkSelection | None]:
        """The attention op between the projections and o_proj: o [B, L, H, D], the next cache, the selection.

        Not compiled (LM.compile_blocks compiles what is around it): the op runs its own kernels and scan.
        """
        cfg = self.cfg
        B, L, H, D = q.shape
        if cfg.attention == "full":
            o, attn_cache = self._full(q, k, v, pos, valid, cache.attn, full_bias)
            return o, LayerCache(attn_cache, cache.score_sum, cache.score_sumsq), None
        if self.scorer is not None:
            u, ssum, ssq = self.scorer(x, pos, valid, seen, cache.score_sum, cache.score_sumsq, decode=decode)  # u [B, L, G]
            if self.distill_queries and not decode and torch.is_grad_enabled():
                # the same scores from a detached input: this loss trains the scoring vectors alone
                u_student = self.scorer(x.detach(), pos, valid, seen, cache.score_sum, cache.score_sumsq)[0]
                self.distill_loss = score_distill_loss(q.detach(), k.detach(), u_student, valid,
                                                       window=self.window, queries=self.distill_queries)
        else:  # sliding window: nothing is selected, the op ignores the scores
            u = torch.zeros(B, L, 1, dtype=score_dtype(x.dtype), device=x.device)
            ssum, ssq = cache.score_sum, cache.score_sumsq
        G = u.shape[-1]
        if G > 1:  # fold the groups into the batch: row b·G + g holds group g's heads
            R = H // G
            qf = q.view(B, L, G, R, D).transpose(1, 2).reshape(B * G, L, R, D)
            kf = k.transpose(1, 2).reshape(B * G, L, 1, D)
            vf = v.transpose(1, 2).reshape(B * G, L, 1, D)
            uf, lf = u.transpose(1, 2).reshape(B * G, L), lengths.repeat_interleave(G)
        else:
            qf, kf, vf, uf, lf = q, k, v, u[..., 0], lengths
        if self.phi_weight is not None and decode:
            o, attn_cache, sel = sparsek_linear_attention_decode(
                qf[:, 0], kf[:, 0], vf[:, 0], uf[:, 0], self.phi_weight, cache.attn, variant=cfg.variant,
                with_selection=with_selection, linear_norm=cfg.linear_norm, linear_gain=self.linear_gain(),
                phi_inv_freq=self.phi_inv_freq(q.device),
            )
            o = o[:, None]
        elif self.phi_weight is not None:
            o, attn_cache, sel = sparsek_linear_attention_chunk(
                qf, kf, vf, uf, self.phi_weight, cache.attn, variant=cfg.variant, lengths=lf, backend=cfg.backend,
                scan=cfg.scan, align=align, linear_norm=cfg.linear_norm, linear_gain=self.linear_gain(),
                phi_inv_freq=self.phi_inv_freq(q.device),
            )
        elif decode:
            o, attn_cache, sel = sparsek_attention_decode(
                qf[:, 0], kf[:, 0], vf[:, 0], uf[:, 0], cache.attn, variant=cfg.variant,
                with_selection=with_selection,
            )
            o = o[:, None]  # [B·G, 1, H/G, D]
        else:
            o, attn_cache, sel = sparsek_attention_chunk(
                qf, kf, vf, uf, cache.attn, variant=cfg.variant, lengths=lf, backend=cfg.backend, scan=cfg.scan, align=align,
            )
        if G > 1:
            o = o.view(B, G, L, H // G, D).transpose(1, 2)
        return o, LayerCache(attn_cache, ssum, ssq), sel if self.topk > 0 else None

    def _full(self, q, k, v, pos, valid, cache: FullKVCache, bias: torch.Tensor | None):
        """Causal SDPA over the cached keys plus the chunk (the baseline; its cache grows, up to max_context).

        `bias` [B, 1, L, T0 + L] is the chunk's mask as an additive bias, built once per chunk for all
        layers (full_attention_bias); None means plain causal attention (no cache, every query valid).
        """
        B, L, H, D = q.shape
        R = H // k.shape[2]
        kpos = torch.where(valid, pos, -1)
        k_all = torch.cat([cache.full_k.to(k.dtype), k], 1)  # [B, T0 + L, Hkv, D]
        v_all = torch.cat([cache.full_v.to(v.dtype), v], 1)
        pos_all = torch.cat([cache.full_pos, kpos], 1)  # [B, T0 + L]
        qt = q.transpose(1, 2)  # [B, H, L, D]
        kt, vt = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [B, Hkv, T0 + L, D], views
        if R > 1:  # grouped-query attention: SDPA's masked kernels want every head's keys
            kt, vt = kt.repeat_interleave(R, 1), vt.repeat_interleave(R, 1)
        if bias is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # no L x L mask
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias.to(q.dtype))
        keep = None if self.cfg.max_context is None else self.cfg.max_context - 1  # what the next chunk's queries can see
        if keep is not None and k_all.shape[1] > keep:  # a copy: the dropped keys' memory is freed
            k_all, v_all, pos_all = (t[:, t.shape[1] - keep:].clone() for t in (k_all, v_all, pos_all))
        new = FullKVCache(k_all.detach(), v_all.detach(), pos_all)
        return o.transpose(1, 2), new  # [B, L, H, D]


def full_attention_bias(
    cache_pos: torch.Tensor,  # [B, T0] int64 positions of the cached keys (-1: none)
    pos: torch.Tensor,  # [B, L] int64 positions of the chunk
    valid: torch.Tensor,  # [B, L] bool
    max_context: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The chunk's full-attention mask as an additive bias [B, 1, L, T0 + L] (0 or -inf), for every layer.

    Built once per chunk: SDPA keeps its mask for the backward, so one shared tensor instead of a
    converted copy per layer saves layers × B × L × (T0 + L) elements at long positions.
    """
    kpos = torch.cat([cache_pos, torch.where(valid, pos, -1)], 1)[:, None, :]  # [B, 1, T0 + L]
    qpos = pos[:, :, None]  # [B, L, 1]
    mask = (kpos >= 0) & (kpos <= qpos)
    if max_context is not None:  # a sliding window of max_context keys
        mask &= kpos > qpos - max_context
    mask |= ~valid[:, :, None]  # padded queries: any finite row, discarded by the caller
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -float("inf"))[:, None]
