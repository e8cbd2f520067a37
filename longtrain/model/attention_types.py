"""The attention types and which of (topk, window) each uses: the one place this rule lives.

    sparsek+sw         the SparseK pool of k keys plus a sliding window of w (the default)
    sparsek            the pool only (w = 0)
    sw                 the window only (k = 0): the op with nothing selected
    sparsek+linear+sw  sparsek+sw plus linear attention over what each query does not fully attend
                       to (paper Appendix B.1; a fixed-size linear state per layer and row)
    linear+sw          the window plus linear attention over everything before it
    full               causal attention over the whole document (the baseline; its cache grows)

The recipe validates against it (`size_problems`), the model builds its layers from it
(`selects`) and the trainer reports the KV budget from it (`kv_entries`).
"""

from __future__ import annotations

from typing import Literal

AttentionType = Literal["sparsek+sw", "sparsek", "sw", "sparsek+linear+sw", "linear+sw", "full"]
USES: dict[str, tuple[str, ...]] = {
    "sparsek+sw": ("topk", "window"),
    "sparsek": ("topk",),
    "sw": ("window",),
    "sparsek+linear+sw": ("topk", "window"),
    "linear+sw": ("window",),
    "full": (),
}


def selects(type: str) -> bool:
    """Whether the type keeps a SparseK pool (and so has scoring vectors)."""
    return "topk" in USES[type]


def linear(type: str) -> bool:
    """Whether the type adds linear attention (a feature map per layer and a linear state in the cache)."""
    return "linear" in type


def has_ring_layout(type: str) -> bool:
    """Whether the type's cache is a plain SparseK cache (no linear state, not full attention's growing one),
    the one the decoder can keep as a ring and write in place (SparseKRingCache)."""
    return type != "full" and not linear(type)


def default_linear_norm(type: str) -> str:
    """attention.linear_norm when unset: mean for the linear types (small books, 3 seeds: perplexity 64.59 against
    sum's 79.38), sum, which changes nothing, for the others."""
    return "mean" if linear(type) else "sum"


def default_linear_gain(type: str) -> str:
    """attention.linear_gain when unset: learned for the linear types (small books, 3 seeds, H200: Linear+SW 64.70
    against fixed's 65.34, ahead in every seed and bucket; SparseK+Linear+SW ahead in mean at 32M tokens), fixed,
    which changes nothing, for the others."""
    return "learned" if linear(type) else "fixed"


def default_linear_rope(type: str) -> str:
    """attention.linear_rope when unset: rotated (phi reads q and k after RoPE, as the cache holds the keys), for
    every type. Unrotated measured level with it (small books, 3 seeds, H200: Linear+SW 64.68 against 64.70, paired
    +0.13 / -0.30 / +0.13; SparseK+Linear+SW level with SparseK+SW at 24M tokens), so the simpler reading stays."""
    return "rotated"


def linear_problems(type: str, score_groups: str, linear_norm: str = "sum", linear_gain: str = "fixed",
                    linear_rope: str = "rotated") -> list[str]:
    """What the linear types cannot do: per-KV-head score groups (any backend runs them: naive or Triton core);
    and linear_norm mean, linear_gain learned or linear_rope unrotated on a type with no linear part (sum, fixed
    and rotated change nothing there)."""
    problems = []
    if linear(type) and score_groups != "shared":
        problems.append(f"attention type {type} has one score group; hint: set attention.score_groups shared")
    if not linear(type):  # each setting against the value that changes nothing without a linear part
        for name, value, neutral, what in (("linear_norm", linear_norm, "sum", "weighs"),
                                           ("linear_gain", linear_gain, "fixed", "scales"),
                                           ("linear_rope", linear_rope, "rotated", "sets what phi reads of")):
            if value != neutral:
                problems.append(f"attention.{name} {value} {what} a linear part, which type {type} has not; "
                                f"hint: remove {name}, or use type sparsek+linear+sw or linear+sw")
    return problems


def size_problems(type: str, topk: int | None, window: int | None) -> list[str]:
    """What is wrong with (topk, window) for `type`: the used sizes must be > 0, the others 0 or unset."""
    if type not in USES:
        return [f"attention type must be one of {', '.join(USES)}; got {type!r}"]
    problems = []
    for name, value in (("topk", topk), ("window", window)):
        if name in USES[type] and not value:
            problems.append(f"attention type {type} needs `{name}` > 0 (got {value})")
        elif name not in USES[type] and value:
            other = {"sw": "sparsek+sw", "sparsek": "sparsek+sw", "linear+sw": "sparsek+linear+sw"}.get(type, "sparsek+sw or sw")
            problems.append(f"attention type {type} has no `{name}` (got {value}); hint: remove `{name}` or use type {other}")
    return problems


def describe(type: str, topk: int, window: int) -> str:
    """"full attention", or the type with its sizes, e.g. "sparsek+sw (k=64, w=64)"."""
    if type == "full":
        return "full attention"
    parts = ([f"k={topk}"] if topk else []) + ([f"w={window}"] if window else [])
    return f"{type} ({', '.join(parts)})"


def kv_entries(type: str, topk: int, window: int) -> int | None:
    """Cached keys per layer per row (k pooled + w − 1 in the window's tail); None for full (it grows)."""
    if type == "full":
        return None
    return topk + max(window - 1, 0)
