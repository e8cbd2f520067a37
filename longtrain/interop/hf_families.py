"""The Hugging Face families longtrain reads and writes: one small table each.

Llama (Llama 1-3, TinyLlama), Mistral (a Llama with a sliding window in its config) and Qwen2 (a
Llama with biases on q, k and v) share the llama block style; GPT-NeoX (Pythia) has its own.

A family says which `config.json` keys make longtrain's `model:` recipe section (and which settings it
cannot represent), and how tensor names map between the layouts. `{i}` stands for the layer index.
GPT-NeoX fuses q, k and v into one `query_key_value` projection whose output rows are ordered
[head, (q|k|v), head_dim]; longtrain keeps three projections, so the converter splits and fuses it
(`split_qkv`, `fuse_qkv`).

Both the config formats of transformers 4 (`rope_theta`, `rotary_pct`, `rotary_emb_base`,
`rope_scaling`) and 5 (`rope_parameters`) are read; export writes both. Scaled RoPE (linear, dynamic,
yarn, llama3) becomes the recipe's `model.rope_scaling` (longtrain.model.rope); export writes it back,
a dynamic (NTK-aware) one as plain RoPE with the larger base longtrain uses (transformers would
otherwise recompute it from each forward's length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from longtrain.errors import HFFormatError  # noqa: F401  (raised here; defined with the others)
from longtrain.model.rope import ROPE_TYPES, ntk_theta, scaling_factor


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    style: str  # longtrain block style
    names: dict[str, str]  # longtrain name -> HF name, for tensors that map one to one
    fused_qkv: str | None = None  # HF name of the fused q/k/v projection (without .weight/.bias)
    score: str = ""  # HF name of the extra SparseK scoring tensor that export writes
    aliases: dict[str, str] = field(default_factory=dict)  # other HF names of a tensor (newer transformers)
    ignored: tuple[str, ...] = ()  # HF tensors that are buffers, not weights (old checkpoints carry them)


LLAMA = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    style="llama",
    names={
        "embed.weight": "model.embed_tokens.weight",
        "blocks.{i}.norm1.weight": "model.layers.{i}.input_layernorm.weight",
        "blocks.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
        "blocks.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
        "blocks.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
        "blocks.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
        "blocks.{i}.norm2.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blocks.{i}.mlp.gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
        "blocks.{i}.mlp.up.weight": "model.layers.{i}.mlp.up_proj.weight",
        "blocks.{i}.mlp.down.weight": "model.layers.{i}.mlp.down_proj.weight",
        "norm_f.weight": "model.norm.weight",
        "unembed.weight": "lm_head.weight",
    },
    score="model.layers.{i}.self_attn.sparsek_score.weight",
    ignored=("rotary_emb.inv_freq",),
)

GPT_NEOX = Family(
    model_type="gpt_neox",
    architecture="GPTNeoXForCausalLM",
    style="gptneox",
    names={
        "embed.weight": "gpt_neox.embed_in.weight",
        "blocks.{i}.norm1.weight": "gpt_neox.layers.{i}.input_layernorm.weight",
        "blocks.{i}.norm1.bias": "gpt_neox.layers.{i}.input_layernorm.bias",
        "blocks.{i}.attn.o_proj.weight": "gpt_neox.layers.{i}.attention.dense.weight",
        "blocks.{i}.attn.o_proj.bias": "gpt_neox.layers.{i}.attention.dense.bias",
        "blocks.{i}.norm2.weight": "gpt_neox.layers.{i}.post_attention_layernorm.weight",
        "blocks.{i}.norm2.bias": "gpt_neox.layers.{i}.post_attention_layernorm.bias",
        "blocks.{i}.mlp.up.weight": "gpt_neox.layers.{i}.mlp.dense_h_to_4h.weight",
        "blocks.{i}.mlp.up.bias": "gpt_neox.layers.{i}.mlp.dense_h_to_4h.bias",
        "blocks.{i}.mlp.down.weight": "gpt_neox.layers.{i}.mlp.dense_4h_to_h.weight",
        "blocks.{i}.mlp.down.bias": "gpt_neox.layers.{i}.mlp.dense_4h_to_h.bias",
        "norm_f.weight": "gpt_neox.final_layer_norm.weight",
        "norm_f.bias": "gpt_neox.final_layer_norm.bias",
        "unembed.weight": "embed_out.weight",
    },
    fused_qkv="gpt_neox.layers.{i}.attention.query_key_value",
    score="gpt_neox.layers.{i}.attention.sparsek_score.weight",
    aliases={"embed_out.weight": "lm_head.weight"},
    ignored=("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq"),
)

MISTRAL = Family(model_type="mistral", architecture="MistralForCausalLM", style="llama", names=LLAMA.names,
                 score=LLAMA.score, ignored=LLAMA.ignored)
QWEN2 = Family(
    model_type="qwen2", architecture="Qwen2ForCausalLM", style="llama", score=LLAMA.score, ignored=LLAMA.ignored,
    names=LLAMA.names | {f"blocks.{{i}}.attn.{p}_proj.bias": f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"},
)
LLAMA_LIKE = (LLAMA, MISTRAL, QWEN2)

FAMILIES = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, GPT_NEOX)}
STYLE_FAMILY = {"llama": LLAMA, "gptneox": GPT_NEOX, "gpt2": GPT_NEOX}  # gpt2 style = non-parallel, tied NeoX


def export_family(cfg, source_type: str | None) -> Family:
    """The family a longtrain model is written as: its style's, Qwen2 for q/k/v biases, Mistral for a
    Mistral import or a llama-style model whose attention is a plain sliding window."""
    family = STYLE_FAMILY[cfg.style]
    if family is LLAMA and cfg.qkv_bias:
        return QWEN2
    if family is LLAMA and (source_type == "mistral" or sliding_window_of(cfg) is not None):
        return MISTRAL
    return family


def export_problems(cfg, family: Family, remote: bool) -> list[str]:
    """What `family`'s config.json cannot say about an LMConfig, so that transformers would compute another model.

    The attention type is the one exception, by design: SparseK and SW exports carry modeling_longtrain.py
    (`remote`), and plain transformers runs them as the family's full (or Mistral's sliding) attention, as
    config.json's note says. A partial rotary fraction in the Llama layout is allowed there too (the remote
    code rotates what longtrain rotates; the note says that plain transformers rotates every dim)."""
    problems = []
    name = family.architecture
    if family in LLAMA_LIKE:
        if cfg.rotary_pct != 1.0 and not remote:  # LlamaForCausalLM rotates every dim of a head, whatever its config says
            problems.append(f"model.rotary_pct {cfg.rotary_pct}: {name} rotates all of each head's dims (transformers' Llama "
                            "family has no partial rotary; GPT-NeoX has, so a gpt2 or gptneox style model exports it)")
        if cfg.parallel_residual:
            problems.append(f"model.parallel_residual true: {name} has no parallel residual")
        if family is QWEN2 and cfg.max_context is not None:
            problems.append(f"attention.max_context {cfg.max_context}: a model with q/k/v biases is written as {name}, "
                            "which this export gives no sliding window")
    else:
        if cfg.kv_heads != cfg.heads:
            problems.append(f"kv_heads {cfg.kv_heads} ≠ heads {cfg.heads}: GPT-NeoX has no grouped-query attention")
        if cfg.qkv_bias is False:
            problems.append("model.qkv_bias false: GPT-NeoX has biases on q, k and v whenever its output projection has one")
        if cfg.max_context is not None:
            problems.append(f"attention.max_context {cfg.max_context}: GPT-NeoX has no sliding window")
    return problems


def sliding_window_of(cfg) -> int | None:
    """What transformers' `sliding_window` must be to compute what an LMConfig's attention does, if it can."""
    if cfg.attention == "full":
        return cfg.max_context
    return cfg.window if cfg.attention == "sw" else None


def family_of(config: dict[str, Any]) -> Family:
    kind = config.get("model_type")
    if kind is None:  # a config.json of another tool, or not a model's
        raise HFFormatError(f"config.json names no model_type: a Hugging Face model folder's config says which family "
                            f"it is (supported: {', '.join(FAMILIES)})")
    if kind not in FAMILIES:
        raise HFFormatError(f"model_type {kind!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[kind]


# ----------------------------------------------------------------------------- config.json -> model:


def _rope(config: dict[str, Any], default_partial: float) -> tuple[float, float, dict | None]:
    """(rope_theta, partial rotary fraction, longtrain's rope_scaling or None) from either config format."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base", 10000.0)))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", config.get("rotary_pct", default_partial)))
    if kind in ("default", None):
        return float(theta), float(partial), None
    if kind not in ROPE_TYPES:
        raise HFFormatError(
            f"RoPE scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}, or plain RoPE); the model's config has {params}"
        )
    max_pos = config.get("max_position_embeddings")
    orig = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings", max_pos))
    scaling: dict[str, Any] = {"type": kind, "factor": params.get("factor")}
    if kind == "dynamic":  # transformers' dynamic formula divides by max_position_embeddings
        scaling["original_context"] = max_pos
    elif kind != "linear":
        scaling["original_context"] = orig
    if kind == "yarn":
        if scaling["factor"] is None and max_pos and orig:
            scaling["factor"] = max_pos / orig
        truncate = params.get("truncate")
        scaling |= {k: params.get(k) for k in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")}
        scaling["truncate"] = True if truncate is None else bool(truncate)
    if kind == "llama3":
        scaling |= {k: params.get(k) for k in ("low_freq_factor", "high_freq_factor")}
    scaling = {k: v for k, v in scaling.items() if v is not None}
    if scaling.get("factor") is None or (kind != "linear" and not scaling.get("original_context")):
        raise HFFormatError(
            f"RoPE scaling {kind!r} lacks its factor or original context (max_position_embeddings); the model's config has {params}"
        )
    return float(theta), float(partial), scaling


def hf_rope_parameters(model) -> dict[str, Any]:
    """transformers' rope_parameters (v5; v4 reads the same dict as rope_scaling) for an LMConfig."""
    theta, s = model.rope_theta, model.rope_scaling
    if s is None or s["type"] == "dynamic":  # dynamic: the fixed NTK base longtrain uses, as plain RoPE
        theta = theta if s is None else ntk_theta(model.rotary_dim, theta, s)
        return {"rope_type": "default", "rope_theta": theta}

    out = {"rope_type": s["type"], "rope_theta": theta, "factor": scaling_factor(s)}
    if s["type"] != "linear":
        out["original_max_position_embeddings"] = s["original_context"]
    keys = {"llama3": ("low_freq_factor", "high_freq_factor"),
            "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")}.get(s["type"], ())
    return out | {k: s[k] for k in keys if s.get(k) is not None}


def _need(config: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise HFFormatError(f"config.json lacks {', '.join(missing)}")


def model_section(family: Family, config: dict[str, Any]) -> dict[str, Any]:
    """longtrain's recipe `model:` section for this config; HFFormatError for what it cannot represent."""
    _need(config, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    d, heads = config["hidden_size"], config["num_attention_heads"]
    if d % heads:
        raise HFFormatError(f"hidden_size {d} is not a multiple of num_attention_heads {heads}")
    llama_like = family in LLAMA_LIKE
    act = config.get("hidden_act", "silu" if llama_like else "gelu")
    want_act = "silu" if llama_like else "gelu"
    if act != want_act:
        raise HFFormatError(f"hidden_act {act!r} is not supported for {family.model_type} (only {want_act!r})")
    section = {
        "style": family.style,
        "layers": config["num_hidden_layers"],
        "d_model": d,
        "heads": heads,
        "vocab_size": config["vocab_size"],
        "intermediate_size": config["intermediate_size"],
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
        "init_std": config.get("initializer_range", 0.02),
    }
    if llama_like:
        theta, partial, scaling = _rope(config, 1.0)
        kv = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or d // heads
        checks = (("attention_bias", False), ("mlp_bias", False)) if family is LLAMA else ()
        if family is QWEN2:
            checks = (("use_sliding_window", False),)  # per-layer windows (max_window_layers) are not represented
        unsupported = [f"{k} = {config[k]}" for k, ok in checks if config.get(k, ok) != ok]
        if head_dim != d // heads:
            unsupported.append(f"head_dim = {head_dim} (≠ hidden_size / num_attention_heads = {d // heads})")
        if partial != 1.0:
            unsupported.append(f"partial_rotary_factor = {partial}")
        if unsupported:
            raise HFFormatError(f"this {family.model_type} config is not supported: {'; '.join(unsupported)}")
        section |= {"kv_heads": kv, "rope_theta": theta, "norm_eps": config.get("rms_norm_eps", 1e-6)}
        # A longtrain export records the rotary fraction that the Llama family's keys cannot say (its remote code uses it).
        saved = config.get("longtrain_sparsek")
        if isinstance(saved, dict) and saved.get("rotary_pct") is not None:
            section["rotary_pct"] = float(saved["rotary_pct"])
        if family is QWEN2:
            section["qkv_bias"] = True
    else:
        theta, partial, scaling = _rope(config, 0.25)
        if not config.get("attention_bias", True):
            raise HFFormatError("this GPT-NeoX config is not supported: attention_bias = false")
        section |= {
            "rope_theta": theta, "rotary_pct": partial, "norm_eps": config.get("layer_norm_eps", 1e-5),
            "parallel_residual": bool(config.get("use_parallel_residual", True)),
        }
    if scaling is not None:
        section["rope_scaling"] = scaling
    return section


# ----------------------------------------------------------------------------- model: -> config.json


def hf_config(family: Family, model, *, bos: int | None, eos: int | None, dtype: str, max_positions: int) -> dict[str, Any]:
    """config.json for an LMConfig `model`, in the keys of transformers 4 and 5 alike."""
    c = model
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": max_positions,
        "initializer_range": c.init_std,
        "tie_word_embeddings": c.tied_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    rope = hf_rope_parameters(c)
    config |= {"rope_theta": rope["rope_theta"], "rope_scaling": rope if rope["rope_type"] != "default" else None}
    if family in LLAMA_LIKE:
        config |= {
            "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.norm_eps, "rope_parameters": rope,
        }
        if family is LLAMA:
            config |= {"attention_bias": False, "mlp_bias": False}
        if family is MISTRAL:
            config["sliding_window"] = sliding_window_of(c)
        if family is QWEN2:
            config |= {"use_sliding_window": False, "sliding_window": None}
    else:
        config |= {
            "hidden_act": "gelu", "layer_norm_eps": c.norm_eps, "use_parallel_residual": c.parallel_residual,
            "rotary_pct": c.rotary_pct, "rotary_emb_base": rope["rope_theta"], "attention_bias": True,
            "rope_parameters": rope | {"partial_rotary_factor": c.rotary_pct},
        }
    return config


# ----------------------------------------------------------------------------- fused q/k/v


def split_qkv(fused: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPT-NeoX query_key_value weight [3·H·D, d] (or bias [3·H·D]) -> q, k, v [H·D, ...] each."""
    rest = fused.shape[1:]
    per_head = fused.reshape(heads, 3, -1, *rest)  # [H, (q|k|v), D, ...]
    return tuple(per_head[:, j].reshape(-1, *rest).contiguous() for j in range(3))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of split_qkv."""
    rest = q.shape[1:]
    parts = [t.reshape(heads, 1, -1, *rest) for t in (q, k, v)]  # [H, 1, D, ...]
    return torch.cat(parts, 1).reshape(-1, *rest).contiguous()
