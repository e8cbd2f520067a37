"""A decoder-only Transformer with SparseK attention that reads a document chunk by chunk.

One file in the nanoGPT manner: config, MLPs, blocks, the LM (attention: model/attention.py; RoPE: model/rope.py). Block styles:
  gpt2     LayerNorm, GELU MLP, biases, tied embeddings, RoPE (the paper's from-scratch model)
  llama    RMSNorm, SwiGLU MLP, no biases, untied head, RoPE, grouped-query attention (TinyLlama)
  gptneox  LayerNorm, GELU MLP, biases, untied head, parallel residual, partial RoPE (Pythia)
A style is one entry of STYLES; LMConfig can override what real checkpoints vary (MLP width, norm
eps, tied head, rotary fraction, parallel residual). Hugging Face layouts (GPT-NeoX's fused QKV) are
converted in longtrain.interop: this file keeps separate q/k/v projections for every style.

`model(tokens, cache=cache)` processes one chunk at absolute positions cache.seen .. and returns
the logits and the next cache (Algorithm 3 of the paper). `cache=None` is one unchunked pass from
position 0; chunked and unchunked give the same results (docs/DESIGN.md section 3). `model.decode(tokens,
cache)` is one token per row through the attention's decode step (one query against the cache, no
chunk scan): the same results as a chunk of one token, for generation.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from longtrain.model.attention import Attention, Linear, chunk_invariant_linear, full_attention_bias, initial_linear_log_gain
from longtrain.model.attention_types import (AttentionType, default_linear_gain, default_linear_norm, default_linear_rope,
                                             linear_problems, selects, size_problems)
from longtrain.model.cache import LayerCache, ModelCache
from longtrain.model.loss import linear_cross_entropy, loss_slice
from longtrain.model.rope import rope_angles, scaling_problems
from longtrain.model.scoring import mimic_score_weight
from longtrain.ops.sparsek_attention import (
    ChunkSelection,
    starts_inside_tile,
)


class ThresholdOverflowWarning(UserWarning):
    """A SparseK threshold state hit its cap: selection is no longer exact (raise threshold_cap)."""


def warn_threshold_overflow(stacklevel: int = 2) -> None:
    """The Python warning for an overflowed threshold state (a forward that reads the flag, or the trainer)."""
    warnings.warn(
        "SparseK threshold state overflowed its cap: selection is no longer exact; raise attention.threshold_cap",
        ThresholdOverflowWarning, stacklevel=stacklevel + 1,  # + 1: this function's frame
    )


@dataclass
class LMConfig:
    vocab_size: int
    layers: int
    d_model: int
    heads: int
    kv_heads: int | None = None  # None: heads
    style: Literal["gpt2", "llama", "gptneox"] = "gpt2"
    mlp_ratio: float = 4.0  # MLP hidden = mlp_ratio * d_model (SwiGLU: each of its three matrices)
    intermediate_size: int | None = None  # MLP hidden size; None: int(mlp_ratio * d_model)
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    tied_embeddings: bool | None = None  # head reuses the embedding; None: the style's default
    rotary_pct: float = 1.0  # fraction of each head's dims that RoPE rotates (Pythia: 0.25)
    parallel_residual: bool | None = None  # x + attn(n1(x)) + mlp(n2(x)); None: the style's default
    dropout: float = 0.0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # longtrain.model.rope: linear, dynamic (NTK-aware), yarn or llama3; None: plain
    qkv_bias: bool | None = None  # biases on q, k and v (Qwen2); None: the style's default
    init_std: float = 0.02
    attention: AttentionType = "sparsek+sw"
    topk: int = 0
    window: int = 0
    variant: str = "hard_k_soft_v"
    score_groups: Literal["shared", "per_kv_head"] = "shared"
    timestep_norm: bool = True
    eps_slope: float = 1e-3
    score_init: Literal["random", "mimic"] = "random"
    linear_norm: Literal["sum", "mean"] | None = None  # the linear sums as the paper's or over their count; None: the type's
    linear_gain: Literal["fixed", "learned"] | None = None  # the linear part times 1, or a learned factor per head; None: the type's
    linear_rope: Literal["rotated", "unrotated"] | None = None  # phi reads q, k after RoPE or rotated back; None: the type's
    threshold_cap: int | None = None
    backend: str = "auto"
    scan: str = "auto"
    max_context: int | None = None  # full attention: keys a query may see (a sliding window); None: all

    def __post_init__(self):
        self.kv_heads = self.kv_heads or self.heads
        if self.d_model % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must divide d_model ({self.d_model}) and be a multiple of kv_heads ({self.kv_heads})")
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {sorted(STYLES)}; got {self.style!r}")
        if self.rotary_dim % 2 or not 0 < self.rotary_pct <= 1:
            raise ValueError(
                f"RoPE needs an even number of rotary dims; got {self.rotary_dim} (head size {self.head_dim}, "
                f"rotary_pct {self.rotary_pct})"
            )
        st = STYLES[self.style]
        self.intermediate_size = self.intermediate_size or int(self.mlp_ratio * self.d_model)
        self.tied_embeddings = st.tied if self.tied_embeddings is None else self.tied_embeddings
        self.parallel_residual = st.parallel_residual if self.parallel_residual is None else self.parallel_residual
        problems = size_problems(self.attention, self.topk, self.window) + scaling_problems(self.rope_scaling)
        if self.max_context is not None and (self.attention != "full" or self.max_context < 1):
            problems.append(f"max_context ({self.max_context}) caps full attention's cache: it needs attention full and a value >= 1")
        self.linear_norm = self.linear_norm or default_linear_norm(self.attention)
        self.linear_gain = self.linear_gain or default_linear_gain(self.attention)
        self.linear_rope = self.linear_rope or default_linear_rope(self.attention)
        problems += linear_problems(self.attention, self.score_groups, self.linear_norm, self.linear_gain, self.linear_rope)
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_recipe(cls, model, attention, vocab_size: int | None = None) -> "LMConfig":
        """From the recipe's ModelConfig and AttentionConfig; model.vocab_size wins over vocab_size."""
        vocab = model.vocab_size or vocab_size
        if vocab is None:
            raise ValueError("no vocabulary size: set model.vocab_size or pass the tokenizer's")
        return cls(
            vocab_size=vocab, layers=model.layers, d_model=model.d_model, heads=model.heads,
            kv_heads=model.kv_heads, style=model.style, mlp_ratio=model.mlp_ratio, dropout=model.dropout,
            intermediate_size=model.intermediate_size, norm_eps=model.norm_eps, tied_embeddings=model.tied_embeddings,
            rotary_pct=model.rotary_pct, parallel_residual=model.parallel_residual,
            rope_theta=model.rope_theta, init_std=model.init_std, attention=attention.type,
            rope_scaling=model.rope_scaling.model_dump() if getattr(model, "rope_scaling", None) else None,
            qkv_bias=getattr(model, "qkv_bias", None),
            topk=attention.topk or 0, window=attention.window or 0, variant=attention.variant,
            score_groups=attention.score_groups, timestep_norm=attention.timestep_norm,
            eps_slope=attention.eps_slope, score_init=attention.score_init,
            linear_norm=getattr(attention, "linear_norm", None), linear_gain=getattr(attention, "linear_gain", None),
            linear_rope=getattr(attention, "linear_rope", None),
            threshold_cap=attention.threshold_cap, backend=attention.backend, scan=attention.scan,
            max_context=getattr(attention, "max_context", None),
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (GPT-NeoX: int(head_dim * rotary_pct))."""
        return int(self.head_dim * self.rotary_pct)

    @property
    def score_group_count(self) -> int:
        """Scoring vectors per layer: 0 when nothing is selected (sw, full)."""
        if not selects(self.attention):
            return 0
        return self.kv_heads if self.score_groups == "per_kv_head" else 1

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- MLPs and blocks


class GeluMLP(nn.Module):
    def __init__(self, d: int, hidden: int, bias: bool):
        super().__init__()
        self.up = Linear(d, hidden, bias=bias)
        self.down = Linear(hidden, d, bias=bias)

    def forward(self, x):  # [B, L, d]
        return self.down(F.gelu(self.up(x)))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int, bias: bool):
        super().__init__()
        self.gate = Linear(d, hidden, bias=bias)
        self.up = Linear(d, hidden, bias=bias)
        self.down = Linear(hidden, d, bias=bias)

    def forward(self, x):  # [B, L, d]
        return self.down(F.silu(self.gate(x)) * self.up(x))


@dataclass(frozen=True)
class Style:
    norm: type
    mlp: type
    bias: bool
    tied: bool  # default of LMConfig.tied_embeddings
    parallel_residual: bool = False  # default of LMConfig.parallel_residual


STYLES = {
    "gpt2": Style(norm=nn.LayerNorm, mlp=GeluMLP, bias=True, tied=True),
    "llama": Style(norm=nn.RMSNorm, mlp=SwiGLU, bias=False, tied=False),
    "gptneox": Style(norm=nn.LayerNorm, mlp=GeluMLP, bias=True, tied=False, parallel_residual=True),
}


class Block(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        st = STYLES[cfg.style]
        self.norm1 = st.norm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, st.bias)
        self.norm2 = st.norm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = st.mlp(cfg.d_model, cfg.intermediate_size, st.bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.parallel = cfg.parallel_residual
        self.compiled: tuple | None = None  # (enter, leave) compiled by LM.compile_blocks

    def enter(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """What comes before the attention op: (h = norm1(x) [B, L, d], q, k, v)."""
        h = self.norm1(x)
        return (h, *self.attn.project(h, cos, sin))

    def leave(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """What comes after the attention op (o [B, L, H, D]): o_proj, the residuals and the MLP."""
        a = self.attn.o_proj(o.flatten(2))  # [B, L, d]
        if self.parallel:  # GPT-NeoX: attention and MLP both read the block's input
            return x + self.drop(a) + self.drop(self.mlp(self.norm2(x)))
        x = x + self.drop(a)  # [B, L, d]
        return x + self.drop(self.mlp(self.norm2(x)))

    def forward(self, x, rope, pos, valid, seen, lengths, cache: LayerCache, decode: bool = False,
                with_selection: bool = True, full_bias: torch.Tensor | None = None, align: bool | None = None):
        enter, leave = self.compiled or (self.enter, self.leave)
        h, q, k, v = enter(x, *rope)
        o, cache, sel = self.attn.attend(h, q, k, v, pos, valid, seen, lengths, cache, decode, with_selection, full_bias,
                                         align)
        return leave(x, o), cache, sel


# ----------------------------------------------------------------------------- the LM


@dataclass
class LMOutput:
    logits: torch.Tensor | None  # [B, L, V] (None from LM.hidden)
    cache: ModelCache  # the next cache, detached
    selections: list[ChunkSelection | None]  # per layer; None for sw and full layers
    overflowed: bool | None  # a threshold state hit its cap: selection is no longer exact (None: not read)
    hidden: torch.Tensor | None = None  # [B, L, d] final (normed) hidden states
    overflow: torch.Tensor | None = None  # [] bool on the device: the same flag, unread (None: nothing selects)
    loss_sum: torch.Tensor | None = None  # [] summed cross-entropy over the targets (forward with targets)
    score_distill: torch.Tensor | None = None  # [] the score distillation loss, mean over layers (when on)


class LM(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        st = STYLES[cfg.style]
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm_f = st.norm(cfg.d_model, eps=cfg.norm_eps)
        # Tied: the head reuses embed.weight (no second parameter, so safetensors needs no copy).
        self.unembed = None if cfg.tied_embeddings else Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.loss_slice = loss_slice  # the head's loss per slice of rows (compiled by compile_blocks)
        self.activation_checkpointing = False  # train.activation_checkpointing: recompute each block in the backward
        self.reset_parameters()

    def compile_blocks(self, **compile_kwargs) -> None:
        """torch.compile what surrounds the attention op: each block's norm, projections and RoPE before
        it, the scorer, o_proj, residuals and MLP after it, and the head's loss per slice. The op itself
        (kernels, selection scan, cache update) stays outside the compiled graphs. The blocks share one
        compiled graph per region (same code and shapes); gradients and results equal eager to rounding."""
        for blk in self.blocks:
            blk.compiled = (torch.compile(blk.enter, **compile_kwargs), torch.compile(blk.leave, **compile_kwargs))
            if blk.attn.scorer is not None:  # its arithmetic; the module (names, FSDP hooks) stays as it is
                blk.attn.scorer.compile_scores(**compile_kwargs)
        self.loss_slice = torch.compile(loss_slice, **compile_kwargs)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith(("scorer.weight", "phi_weight")):
                continue
            if p.dim() >= 2:
                # Residual projections scaled down by depth (GPT-2).
                scale = (2 * self.cfg.layers) ** -0.5 if name.endswith(("o_proj.weight", "down.weight")) else 1.0
                nn.init.normal_(p, std=std * scale)
            elif name.endswith("bias") and "norm" not in name:
                nn.init.zeros_(p)
        for blk in self.blocks:
            if blk.attn.scorer is not None:
                blk.attn.scorer.reset_parameters()
            if blk.attn.phi_weight is not None:  # phi starts as elu(x) + 1 (Katharopoulos et al.)
                blk.attn.phi_weight.copy_(torch.eye(self.cfg.head_dim).expand_as(blk.attn.phi_weight))
            if blk.attn.linear_log_gain is not None:  # from 1/F (Attention says why)
                blk.attn.linear_log_gain.copy_(initial_linear_log_gain(self.cfg.heads, self.cfg.head_dim))
        if self.cfg.score_init == "mimic":
            self.init_scores_mimic_()

    @torch.no_grad()
    def init_scores_mimic_(self) -> None:
        """Set every w_score to W_Q W_Kᵀ 1 / ||·|| (paper 3.5); call again after importing weights."""
        cfg = self.cfg
        for blk in self.blocks:
            a = blk.attn
            if a.scorer is not None:
                a.scorer.weight.copy_(mimic_score_weight(a.q_proj.weight, a.k_proj.weight, cfg.heads, cfg.kv_heads,
                    a.scorer.weight.shape[0]))

    def set_score_distill(self, queries: int) -> None:
        """Training passes also compute the score distillation loss over `queries` sampled queries per
        chunk (0: off); LMOutput.score_distill carries it (longtrain.model.score_distill)."""
        for blk in self.blocks:
            blk.attn.distill_queries = queries if blk.attn.scorer is not None else 0

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def empty_cache(self, batch: int, *, device=None, dtype: torch.dtype | None = None) -> ModelCache:
        """A fresh cache for `batch` documents; dtype is the KV dtype (default: the weights')."""
        device = device if device is not None else self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        return ModelCache(
            seen=torch.zeros(batch, dtype=torch.int64, device=device),
            layers=[blk.attn.empty_cache(batch, dtype=dtype, device=device) for blk in self.blocks],
        )

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] from final hidden states [..., d]."""
        return chunk_invariant_linear(h, self.embed.weight if self.unembed is None else self.unembed.weight)

    def hidden(
        self,
        tokens: torch.Tensor,
        cache: ModelCache | None = None,
        lengths: torch.Tensor | None = None,
        decode: bool = False,
        with_selection: bool = True,
        check_overflow: bool = True,
    ) -> LMOutput:
        """Final hidden states of one chunk (tokens [B, L]) continuing from `cache`; logits=None.

        decode (L = 1, no lengths): the attention's decode step, with no host synchronisation (so a
        CUDA graph can hold it); overflow is then not checked here but left in the cache's layers.
        with_selection=False (decode only) skips reporting the selections (None per layer).
        check_overflow=False leaves the threshold-overflow flag on the device (`LMOutput.overflow`)
        instead of reading it (a host sync per chunk) and warning: the trainer reads it at its log lines.
        """
        B, L = tokens.shape
        dev = tokens.device
        if cache is None:
            cache = self.empty_cache(B, device=dev)
        # full attention without a mask needs every query valid, known here without reading the device
        all_valid = lengths is None or (
            self.cfg.attention == "full" and lengths.device.type == "cpu" and bool((lengths >= L).all())
        )
        lengths = torch.full((B,), L, dtype=torch.int64, device=dev) if lengths is None else lengths.to(dev, torch.int64)
        seen = cache.seen.to(dev)
        ar = torch.arange(L, device=dev)
        pos = seen[:, None] + ar[None]  # [B, L] absolute document positions
        valid = ar[None] < lengths[:, None]  # [B, L]
        rope = rope_angles(pos, self.cfg.rotary_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

        x = self.drop(self.embed(tokens))  # [B, L, d]
        full_bias = None
        if self.cfg.attention == "full":
            cache_pos = cache.layers[0].attn.full_pos.to(dev)  # every layer caches the same positions
            cut = self.cfg.max_context is not None and self.cfg.max_context < L
            if cache_pos.shape[1] or not all_valid or cut:
                full_bias = full_attention_bias(cache_pos, pos, valid, self.cfg.max_context, self.compute_dtype(dev))
        align = None
        if not decode and self.cfg.attention != "full" and not torch.is_grad_enabled():
            # One host read per chunk: the aligned layout (exact to the bit, slower) only where a row's
            # chunk starts inside a query tile; a chunk starting on a tile edge is laid out as the unchunked pass.
            align = starts_inside_tile(seen, dtype=self.compute_dtype(dev), backend=self.cfg.backend)
        layers, selections = [], []
        recompute = self.activation_checkpointing and torch.is_grad_enabled() and not decode
        for blk, lc in zip(self.blocks, cache.layers):
            blk.attn.distill_loss = None
            args = (x, rope, pos, valid, seen, lengths, lc, decode, with_selection, full_bias, align)
            if recompute:  # keeps only the block's input; the backward runs its forward again (the same kernels,
                # the same selection from the same cache: the recomputed tensors equal the first ones bit for bit)
                x, lc, sel = torch.utils.checkpoint.checkpoint(blk, *args, use_reentrant=False)
            else:
                x, lc, sel = blk(*args)
            layers.append(lc)
            selections.append(sel)
        distill = [blk.attn.distill_loss for blk in self.blocks if blk.attn.distill_loss is not None]
        h = self.norm_f(x)  # [B, L, d]
        flags = [s.overflow for s in selections if s is not None]
        overflow = torch.stack(flags).gt(0).any() if flags and not decode else None  # [] bool, on the device
        overflowed = None
        if check_overflow:
            overflowed = bool(overflow) if overflow is not None else False  # one host sync for all layers
            if overflowed:
                warn_threshold_overflow(stacklevel=3)
        new_cache = ModelCache(seen=seen + lengths, layers=layers)
        return LMOutput(logits=None, cache=new_cache, selections=selections, overflowed=overflowed, hidden=h,
                        overflow=overflow, score_distill=torch.stack(distill).mean() if distill else None)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype activations take here: autocast's when it is on, else the weights'."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.embed.weight.dtype

    def forward(
        self,
        tokens: torch.Tensor,
        cache: ModelCache | None = None,
        lengths: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        check_overflow: bool = True,
    ) -> LMOutput:
        """Logits [B, L, V] of one chunk and the next cache; cache=None is an unchunked pass from 0.

        With targets [B, L] (IGNORE where there is none): `loss_sum`, the summed cross-entropy, computed
        slice by slice without the logits (longtrain.model.loss), and logits=None. It is computed here,
        inside the module, so that DDP and FSDP see the head's weight used in their forward.
        """
        out = self.hidden(tokens, cache=cache, lengths=lengths, check_overflow=check_overflow)
        if targets is None:
            out.logits = self.head(out.hidden)
        else:
            weight = self.embed.weight if self.unembed is None else self.unembed.weight
            out.loss_sum = linear_cross_entropy(out.hidden, weight, targets.to(out.hidden.device), slice_fn=self.loss_slice)
        return out

    def decode(self, tokens: torch.Tensor, cache: ModelCache, selections: bool = False) -> LMOutput:
        """Logits [B, 1, V] of one token per row (tokens [B]) at position cache.seen, and the next cache.

        Equals forward(tokens[:, None], cache) (tests: float64, same selections, logits within 1e-9),
        through the attention's decode step: no selection scan, no host synchronisation. Threshold
        overflow is not checked per token: read it from the cache (`ModelCache.overflowed()`).
        selections=True also reports each layer's selection (for comparisons; a few ops per layer).
        """
        out = self.hidden(tokens[:, None], cache=cache, decode=True, with_selection=selections)
        out.logits = self.head(out.hidden)
        return out

