"""Rotary position embeddings (RoPE) and the ways pretrained models rescale them for longer contexts.

`rope_angles` gives cos and sin at absolute positions (float64, so any chunking of a document gets
the same angles); `apply_rope` rotates q or k with them. `model.rope_scaling` (a dict, None for plain
RoPE) changes the inverse frequencies, and for yarn the magnitude of cos and sin:

  linear   positions divided by `factor` (position interpolation): every frequency / factor
  dynamic  NTK-aware: the base becomes theta · s^(R/(R-2)) (R rotary dims), so low frequencies are
           interpolated and high ones barely move. s follows transformers' dynamic formula at the
           sequence length `target_length`: s = factor · target_length / original_context - (factor - 1).
           Without a factor (or 1) this is the paper's NTK-aware interpolation to target_length (s =
           target / original). transformers recomputes s from each forward's length; longtrain fixes it at
           target_length (default factor × original_context) so chunked and unchunked runs agree
  yarn     NTK-by-parts: frequencies with fewer than beta_slow rotations over original_context are
           divided by factor, those with more than beta_fast kept, a linear ramp between; cos and
           sin are scaled by attention_factor (default 0.1 ln(factor) + 1)
  llama3   Llama 3.1's by-parts rule: wavelengths above original_context / low_freq_factor are
           divided by factor, below original_context / high_freq_factor kept, smoothed between

The formulas are those of transformers' modeling_rope_utils (tests compare logits with it per type).
`factor` may be left out for `target_length / original_context` (dynamic: see above).
"""

from __future__ import annotations

import math

import torch

from longtrain.ops.rope import apply_rope  # noqa: F401  (the rotation is an op: the linear types' phi undoes it)

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
# Keys of model.rope_scaling and their defaults (transformers' defaults); None: required or derived.
ROPE_SCALING_DEFAULTS: dict[str, object] = {
    "type": None, "factor": None, "original_context": None, "target_length": None,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0,  # llama3
    "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None, "mscale_all_dim": None,  # yarn
    "truncate": True,  # yarn: round the ramp's ends to whole dims
}


def scaling_problems(scaling: dict | None) -> list[str]:
    """What is wrong with a rope_scaling dict (empty: nothing)."""
    if scaling is None:
        return []
    unknown = sorted(set(scaling) - set(ROPE_SCALING_DEFAULTS))
    if unknown:
        return [f"rope_scaling has unknown key(s) {', '.join(unknown)} (known: {', '.join(ROPE_SCALING_DEFAULTS)})"]
    kind, factor, orig, target = (scaling.get(k) for k in ("type", "factor", "original_context", "target_length"))
    if kind not in ROPE_TYPES:
        return [f"rope_scaling.type must be one of {', '.join(ROPE_TYPES)}; got {kind!r}"]
    problems = []
    if factor is None and not (orig and target):
        problems.append(f"rope_scaling ({kind}) needs `factor`, or `target_length` and `original_context` (factor = their ratio)")
    if kind != "linear" and not orig:
        problems.append(
            f"rope_scaling type {kind} needs `original_context`: the context the model was trained on "
            "(max_position_embeddings in its config.json)"
        )
    if factor is not None and factor < 1:
        problems.append(f"rope_scaling.factor must be >= 1 (got {factor})")
    return problems


def scaling_factor(scaling: dict) -> float:
    factor = scaling.get("factor")
    return float(factor) if factor is not None else scaling["target_length"] / scaling["original_context"]


def ntk_theta(rotary_dim: int, theta: float, scaling: dict) -> float:
    """The base a dynamic (NTK-aware) scaling uses: theta · s^(R/(R-2)), s from transformers' formula at
    target_length; without a factor, s = target_length / original_context (the paper's)."""
    factor, orig = scaling.get("factor") or 1.0, scaling["original_context"]
    length = max(scaling.get("target_length") or factor * orig, orig)  # transformers: never below the original context
    s = factor * length / orig - (factor - 1)
    return theta * s ** (rotary_dim / (rotary_dim - 2))


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict | None, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R/2] float64, attention factor that multiplies cos and sin)."""
    R = rotary_dim
    exponents = torch.arange(0, R, 2, dtype=torch.float64, device=device) / R  # [R/2]
    if scaling is None:
        return theta ** -exponents, 1.0
    s = {k: scaling.get(k, v) if scaling.get(k) is not None else v for k, v in ROPE_SCALING_DEFAULTS.items()}
    kind, factor = s["type"], scaling_factor(scaling)
    inv = theta ** -exponents
    if kind == "linear":
        return inv / factor, 1.0
    orig = s["original_context"]
    if kind == "dynamic":
        return ntk_theta(R, theta, scaling) ** -exponents, 1.0
    if kind == "llama3":
        low_wavelen, high_wavelen = orig / s["low_freq_factor"], orig / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, (1 - smooth) * out / factor + smooth * out, out), 1.0
    # yarn
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s["attention_factor"]
    if attention is None:
        both = s["mscale"] and s["mscale_all_dim"]
        attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]) if both else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim index that turns `rotations` times over orig
        return R * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(R // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)  # 0: keep
    return inv / factor * ramp + inv * (1 - ramp), float(attention)


def rope_angles(
    pos: torch.Tensor, rotary_dim: int, theta: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, L, R/2] (float64) at absolute positions pos [B, L]: exact for any chunking."""
    inv_freq, attention = inverse_frequencies(rotary_dim, theta, scaling, pos.device)
    ang = pos.to(torch.float64)[..., None] * inv_freq  # [B, L, R/2]
    return ang.cos() * attention, ang.sin() * attention


