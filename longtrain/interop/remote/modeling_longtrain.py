"""SparseK attention in plain PyTorch: the model longtrain exports, for transformers (trust_remote_code=True).

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

A readable reference of what longtrain computes (SparseK, Lou et al. 2024), written for clarity, not
speed: one query at a time, every key kept in the cache. The weights are the standard Llama / Qwen2 /
Mistral / GPT-NeoX tensors plus one scoring matrix per layer (`...sparsek_score.weight`, [G, d]); without
trust_remote_code transformers loads the same folder as plain full attention and ignores the scores.

For the query at position i and a key at position j <= i (scores u_j, one per score group):

  window     i - w < j <= i                         the last w keys, gate 1
  selected   j <= i - w, among the k highest (u_j, j)  gate m_j = clamp(u_j - tau_i, 0, 1)
  tau_i      the SparseK threshold of the candidates' scores: sum_j clamp(u_j - tau_i, 0, 1) = k
             (no threshold, gate 1, while there are at most k candidates)
  variants   hard_k_soft_v  softmax(q.k / sqrt(D)) over window + selected, values scaled by the gate
             soft_kv        logits scaled by the gate too
             straight_through  gate 1 in the forward pass

Scores: u_j = TimestepNorm(h_j . w_g) + eps_slope * j, where h_j is the layer's normed input and
TimestepNorm subtracts the running mean of the raw scores over positions 0..j and divides by their
running standard deviation (so a score only depends on the past: the model stays causal).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_longtrain import LongtrainConfig

TSN_EPS = 1e-5
# The output field generate() reads the cache from: `cache` in transformers 5, `past_key_values` in 4.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# ----------------------------------------------------------------------------- SparseK pieces


def timestep_norm_scores(raw: torch.Tensor, positions: torch.Tensor, eps_slope: float, normalise: bool) -> torch.Tensor:
    """Scores u [B, T, G] (float64) from raw scores [B, T, G] of positions 0..T-1 of the document."""
    if normalise:
        count = (positions + 1).to(torch.float64)[None, :, None]  # [1, T, 1]
        mean = raw.cumsum(1) / count
        var = ((raw * raw).cumsum(1) / count - mean * mean).clamp(min=0.0)
        raw = (raw - mean) / torch.sqrt(var + TSN_EPS)
    return raw + eps_slope * positions.to(torch.float64)[None, :, None]


def sparsek_threshold(z: torch.Tensor, k: int) -> torch.Tensor:
    """tau [R] with sum_j clamp(z_j - tau, 0, 1) = k for rows z [R, n] (n > k), float64.

    f(t) = sum clamp(z - t, 0, 1) is continuous, piecewise linear and non-increasing, with breakpoints
    at every z_j and z_j - 1: find the two neighbouring breakpoints around f = k and interpolate. Where
    f is flat at k, tau is not unique (the gates are): this takes the smallest, as longtrain does.
    """
    z = z.to(torch.float64)
    n = z.shape[-1]
    breaks = torch.cat([z, z - 1], dim=-1).sort(dim=-1, descending=True).values  # [R, 2n]
    f = (z[:, None, :] - breaks[:, :, None]).clamp(0, 1).sum(-1)  # [R, 2n], non-decreasing
    tol = 1e-12 * n * (1 + z.abs().amax(-1, keepdim=True))  # rounding of the sums
    j = ((f <= k + tol).sum(-1, keepdim=True) - 1).clamp(0, 2 * n - 2)  # last breakpoint with f <= k
    t_hi, f_hi = breaks.gather(-1, j), f.gather(-1, j)  # f(t_hi) <= k
    t_lo, f_lo = breaks.gather(-1, j + 1), f.gather(-1, j + 1)  # f(t_lo) > k: tau is between
    return (t_hi - (k - f_hi) * (t_hi - t_lo) / (f_lo - f_hi).clamp(min=1e-300))[:, 0]


def sparsek_gates(u: torch.Tensor, query_pos: int, key_pos: torch.Tensor, topk: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys one query attends to and their gates: (attend [B, G, T] bool, gate [B, G, T]).

    u [B, G, T] scores of the keys at positions key_pos [T] (0..T-1, all <= query_pos).
    """
    B, G, T = u.shape
    attend = (key_pos > query_pos - window) & (key_pos <= query_pos)  # the window
    attend = attend[None, None].expand(B, G, T).clone()
    gate = torch.ones(B, G, T, dtype=torch.float64, device=u.device)
    n_cand = int((key_pos <= query_pos - window).sum())  # keys 0 .. n_cand - 1 may be selected
    if topk == 0 or n_cand == 0:
        return attend, gate
    cand = u[..., :n_cand].reshape(B * G, n_cand)
    # The k highest (u, position): sort by position descending, then stably by score descending.
    newest_first = cand.flip(-1).sort(dim=-1, descending=True, stable=True).indices
    chosen = n_cand - 1 - newest_first[:, :topk]  # [B·G, k'] key indices
    rows = torch.arange(B * G, device=u.device)[:, None]
    attend.view(B * G, T)[rows, chosen] = True
    if n_cand > topk:
        tau = sparsek_threshold(cand, topk)  # [B·G]
        m = (cand.to(torch.float64).gather(-1, chosen) - tau[:, None]).clamp(0, 1)
        gate.view(B * G, T)[rows, chosen] = m
    return attend, gate


# ----------------------------------------------------------------------------- the model


class LongtrainCache:
    """Every past key and value (after RoPE) and every raw score per layer: a reference, not a bounded
    cache (longtrain keeps only k selected + w window keys)."""

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor | None] = [None] * layers  # [B, T, Hkv, D]
        self.values: list[torch.Tensor | None] = [None] * layers
        self.raw_scores: list[torch.Tensor | None] = [None] * layers  # [B, T, G] float64
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def append(self, i: int, name: str, x: torch.Tensor) -> torch.Tensor:
        store = getattr(self, name)
        store[i] = x if store[i] is None else torch.cat([store[i], x], 1)
        return store[i]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R = 2 * cos.shape[-1] dims of x [B, L, H, D] (cos, sin [L, R/2])."""
    c, s = cos[None, :, None].to(x.dtype), sin[None, :, None].to(x.dtype)
    R = 2 * c.shape[-1]
    x1, x2, rest = x[..., : R // 2], x[..., R // 2 : R], x[..., R:]  # GPT-NeoX: only a part of each head rotates
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


class ScoreVectors(nn.Module):
    def __init__(self, groups: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, d))  # [G, d]


class SparseKAttention(nn.Module):
    """SparseK attention of one layer; the two layouts below differ only in their projections."""

    def __init__(self, config: LongtrainConfig, layer: int):
        super().__init__()
        sk = config.longtrain_sparsek
        d, H, Hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.layer, self.H, self.Hkv, self.D = layer, H, Hkv, d // H
        self.topk, self.window, self.variant = sk.get("topk", 0), sk.get("window", 0), sk.get("variant", "hard_k_soft_v")
        self.eps_slope, self.timestep_norm = sk.get("eps_slope", 1e-3), sk.get("timestep_norm", True)
        groups = (Hkv if sk.get("score_groups") == "per_kv_head" else 1) if self.topk > 0 else 0
        self.sparsek_score = ScoreVectors(groups, d) if groups else None

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, L, H, D], k and v [B, L, Hkv, D] (before RoPE)."""
        raise NotImplementedError

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """[B, L, H·D] -> [B, L, d]."""
        raise NotImplementedError

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LongtrainCache) -> torch.Tensor:
        B, L, _ = h.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        q, k, v = self.project(h)
        q = apply_rope(q, cos, sin)  # [B, L, H, D]
        k = cache.append(self.layer, "keys", apply_rope(k, cos, sin))  # [B, T, Hkv, D]: every key so far
        v = cache.append(self.layer, "values", v)
        T = k.shape[1]
        key_pos = torch.arange(T, device=h.device)
        if self.sparsek_score is not None:
            raw = h.to(torch.float64) @ self.sparsek_score.weight.to(torch.float64).t()  # [B, L, G]
            raw = cache.append(self.layer, "raw_scores", raw)  # [B, T, G]
            u = timestep_norm_scores(raw, key_pos, self.eps_slope, self.timestep_norm)
            u = u.to(torch.float64 if h.dtype == torch.float64 else torch.float32).transpose(1, 2)  # [B, G, T]
        else:  # sliding window only
            u = torch.zeros(B, 1, T, device=h.device)
        G = u.shape[1]
        keys = k.repeat_interleave(H // Hkv, dim=2)  # [B, T, H, D]
        values = v.repeat_interleave(H // Hkv, dim=2)
        out = []
        for i in range(L):  # one query at a time
            query_pos = T - L + i
            attend, gate = sparsek_gates(u, query_pos, key_pos, self.topk, self.window)  # [B, G, T]
            attend = attend.repeat_interleave(H // G, dim=1)  # [B, H, T]: heads of a group share its keys
            gate = gate.repeat_interleave(H // G, dim=1).to(q.dtype)
            if self.variant == "straight_through":
                gate = torch.ones_like(gate)
            logits = torch.einsum("bhd,bthd->bht", q[:, i], keys) * D**-0.5  # [B, H, T]
            if self.variant == "soft_kv":
                logits = logits * gate
            p = torch.softmax(logits.masked_fill(~attend, -float("inf")), dim=-1) * gate
            out.append(torch.einsum("bht,bthd->bhd", p, values))
        return self.output(torch.stack(out, 1).reshape(B, L, H * D))


# ----------------------------------------------------------------------------- Llama layout (Llama, Qwen2, Mistral)


class LlamaAttention(SparseKAttention):
    def __init__(self, config: LongtrainConfig, layer: int):
        super().__init__(config, layer)
        d, H, Hkv, D = config.hidden_size, self.H, self.Hkv, self.D
        bias = bool(config.longtrain_sparsek.get("qkv_bias", False))  # Qwen2
        self.q_proj = nn.Linear(d, H * D, bias=bias)
        self.k_proj = nn.Linear(d, Hkv * D, bias=bias)
        self.v_proj = nn.Linear(d, Hkv * D, bias=bias)
        self.o_proj = nn.Linear(H * D, d, bias=False)

    def project(self, h):
        B, L, _ = h.shape
        return (self.q_proj(h).view(B, L, self.H, self.D), self.k_proj(h).view(B, L, self.Hkv, self.D),
                self.v_proj(h).view(B, L, self.Hkv, self.D))

    def output(self, o):
        return self.o_proj(o)


class SwiGLU(nn.Module):
    def __init__(self, config: LongtrainConfig):
        super().__init__()
        d, hidden = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One layer of either layout: attention, then the MLP, each after its norm (GPT-NeoX's parallel residual:
    both read the layer's input). The attention sits under the name the layout's checkpoints give it."""

    def __init__(self, config: LongtrainConfig, norm: type[nn.Module], attention_name: str, attention: nn.Module,
                 mlp: nn.Module, parallel: bool = False):
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, eps=config.norm_eps)
        self.attention_name = attention_name
        self.add_module(attention_name, attention)
        self.post_attention_layernorm = norm(config.hidden_size, eps=config.norm_eps)
        self.mlp = mlp
        self.parallel = parallel

    def forward(self, x, cos, sin, cache):
        a = getattr(self, self.attention_name)(self.input_layernorm(x), cos, sin, cache)
        if self.parallel:  # attention and MLP both read the layer's input
            return x + a + self.mlp(self.post_attention_layernorm(x))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


def llama_layer(config: LongtrainConfig, layer: int) -> Layer:
    return Layer(config, nn.RMSNorm, "self_attn", LlamaAttention(config, layer), SwiGLU(config))


def stack(config: LongtrainConfig, layer, norm: type[nn.Module]) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """Either layout's embedding, layers and final norm (each layout keeps its own weight names)."""
    layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
    return nn.Embedding(config.vocab_size, config.hidden_size), layers, norm(config.hidden_size, eps=config.norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config: LongtrainConfig):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = stack(config, llama_layer, nn.RMSNorm)


# ----------------------------------------------------------------------------- GPT-NeoX layout (Pythia, longtrain's gpt2 style)


class NeoXAttention(SparseKAttention):
    def __init__(self, config: LongtrainConfig, layer: int):
        super().__init__(config, layer)
        d = config.hidden_size
        self.query_key_value = nn.Linear(d, 3 * d)  # output rows [head, (q|k|v), head_dim]
        self.dense = nn.Linear(d, d)

    def project(self, h):
        B, L, _ = h.shape
        q, k, v = self.query_key_value(h).view(B, L, self.H, 3, self.D).unbind(3)
        return q, k, v

    def output(self, o):
        return self.dense(o)


class GeluMLP(nn.Module):
    def __init__(self, config: LongtrainConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


def neox_layer(config: LongtrainConfig, layer: int) -> Layer:
    parallel = config.longtrain_sparsek.get("parallel_residual", True)
    return Layer(config, nn.LayerNorm, "attention", NeoXAttention(config, layer), GeluMLP(config), parallel=parallel)


class NeoXModel(nn.Module):
    def __init__(self, config: LongtrainConfig):
        super().__init__()
        self.embed_in, self.layers, self.final_layer_norm = stack(config, neox_layer, nn.LayerNorm)


# ----------------------------------------------------------------------------- the causal LM


class LongtrainForCausalLM(PreTrainedModel, GenerationMixin):
    """A decoder-only Transformer with SparseK attention, in the tensor names of the exported family:
    Llama (RMSNorm, SwiGLU, grouped-query attention) or GPT-NeoX (LayerNorm, GELU, fused q/k/v)."""

    config_class = LongtrainConfig
    base_model_prefix = "model"

    def __init__(self, config: LongtrainConfig):
        super().__init__(config)
        self.neox = config.longtrain_sparsek.get("layout") == "gpt_neox"
        # A tied head reuses the embedding (the folder holds no head tensor then).
        head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.neox:
            self.base_model_prefix = "gpt_neox"
            self.gpt_neox, self.embed_out = NeoXModel(config), head
        else:
            self.model, self.lm_head = LlamaModel(config), head
        self.post_init()

    def parts(self) -> tuple[nn.Embedding, nn.ModuleList, nn.Module, nn.Linear | None]:
        """(embedding, layers, final norm, head or None when tied) under either layout's names."""
        if self.neox:
            m = self.gpt_neox
            return m.embed_in, m.layers, m.final_layer_norm, self.embed_out
        return self.model.embed_tokens, self.model.layers, self.model.norm, self.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() gets its cache from forward: a LongtrainCache

    def _init_weights(self, module):  # every weight comes from the folder
        pass

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [L, D/2] at positions [L], from the inverse frequencies longtrain exported (scaling included)."""
        rope = self.config.longtrain_rope
        inv_freq = torch.tensor(rope["inv_freq"], dtype=torch.float64, device=positions.device)
        angles = positions.to(torch.float64)[:, None] * inv_freq  # [L, D/2]
        return angles.cos() * rope["attention_factor"], angles.sin() * rope["attention_factor"]

    def forward(self, input_ids, attention_mask=None, cache=None, past_key_values=None, labels=None, use_cache=None, **kwargs):
        """Logits [B, L, V] of input_ids [B, L] that continue `cache` (None: a new document)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this reference implementation takes no padding: pass rows of equal length (or one row)")
        cache = cache if cache is not None else past_key_values
        embed, layers, norm, head = self.parts()
        cache = cache if cache is not None else LongtrainCache(len(layers))
        B, L = input_ids.shape
        cos, sin = self.rope(torch.arange(cache.seen, cache.seen + L, device=input_ids.device))
        x = embed(input_ids)  # [B, L, d]
        for layer in layers:
            x = layer(x, cos, sin, cache)
        cache.seen += L
        logits = F.linear(norm(x), embed.weight if head is None else head.weight)  # [B, L, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(logits=logits, loss=loss, **{CACHE_FIELD: cache})

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            input_ids = input_ids[:, cache.seen:]  # only the tokens the cache has not seen
        return {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask}
