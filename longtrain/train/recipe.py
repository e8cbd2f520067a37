"""The recipe: one YAML file that says what to train and how.

`load_recipe` reads the YAML, applies `--set a.b=value` overrides and
validates everything at once against the pydantic schema below. Every problem
comes back in one `RecipeError` that names its YAML path, the bad value and a
hint, so a user fixes a recipe in one round trip instead of one per typo.

The parser reads no checkpoint: what a recipe takes from train.init_from, its caller reads (fit: train.init.load_fit_recipe).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from longtrain.data.config import UNUSED_CHECK, DataConfig, TokenizerConfig
from longtrain.errors import RecipeError  # noqa: F401  (raised here; defined with the others)
from longtrain.model.attention_types import (USES, AttentionType, default_linear_gain, default_linear_norm, default_linear_rope,
                                             linear_problems, size_problems)
from longtrain.model.rope import scaling_problems
from longtrain.train.recipe_errors import describe_error


def _builtin_recipes_dir() -> Path:
    """The top-level `recipes/` folder is the one source: an installed wheel carries it as
    `longtrain/recipes/` (setup.py maps it there); a checkout reads it where it is."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "recipes"
    return installed if installed.is_dir() else package.parent / "recipes"


RECIPES_DIR = _builtin_recipes_dir()
DEFAULT_RECIPE = "quickstart"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RopeScalingConfig(_Section):
    """RoPE rescaled for contexts longer than the model was trained on (longtrain.model.rope)."""

    type: Literal["linear", "dynamic", "yarn", "llama3"] = Field(
        description="linear (position interpolation), dynamic (NTK-aware: the paper's fine-tuning), yarn or llama3"
    )
    factor: float | None = Field(None, ge=1, description="context extension factor; null: target_length / original_context")
    original_context: int | None = Field(
        None, ge=1, description="the context the model was trained on (max_position_embeddings of its config.json)"
    )
    target_length: int | None = Field(
        None, ge=1, description="the context to reach; sets factor when it is null (dynamic: the length whose "
        "NTK frequencies are used; default factor × original_context)"
    )
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above original_context / this are interpolated")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below original_context / this are kept")
    beta_fast: float = Field(32.0, gt=0, description="yarn: dims turning more often than this over the context are kept")
    beta_slow: float = Field(1.0, gt=0, description="yarn: dims turning less often than this are interpolated")
    attention_factor: float | None = Field(None, gt=0, description="yarn: scale of cos and sin; null: 0.1 ln(factor) + 1")
    mscale: float | None = Field(None,
        description="yarn (DeepSeek): attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)")
    mscale_all_dim: float | None = Field(None, description="yarn (DeepSeek): see mscale")
    truncate: bool = Field(True, description="yarn: round the ramp's ends to whole dims")

    @model_validator(mode="after")
    def _complete(self) -> RopeScalingConfig:
        problems = scaling_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ModelConfig(_Section):
    style: Literal["gpt2", "llama", "gptneox"] = Field(
        "gpt2", description="block style: gpt2 (LayerNorm, GELU MLP), llama (RMSNorm, SwiGLU MLP) or "
        "gptneox (Pythia: LayerNorm, GELU MLP, parallel residual)"
    )
    layers: int = Field(ge=1, le=1024, description="number of transformer blocks")
    d_model: int = Field(ge=8, description="hidden size; a multiple of `heads`")
    heads: int = Field(ge=1, description="query heads; d_model / heads is the head size")
    kv_heads: int | None = Field(
        None, ge=1, description="key/value heads (grouped-query attention); null means `heads`"
    )
    mlp_ratio: float = Field(4.0, gt=0, le=64, description="MLP hidden size as a multiple of d_model")
    vocab_size: int | None = Field(
        None, ge=2, description="embedding rows; null takes the tokenizer's vocabulary size"
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability, in [0, 1)")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency")
    rope_scaling: RopeScalingConfig | None = Field(
        None, description="RoPE for longer contexts, e.g. {type: dynamic, target_length: 8192, original_context: 2048} "
        "(the paper's NTK-aware interpolation to 4x); null: plain RoPE"
    )
    qkv_bias: bool | None = Field(None, description="biases on the q, k and v projections (Qwen2); null: the style's default")
    init_std: float = Field(0.02, gt=0, le=1, description="standard deviation of the weight init")
    # What imported checkpoints vary; the defaults give the models longtrain always built.
    intermediate_size: int | None = Field(
        None, ge=1, description="MLP hidden size; null means mlp_ratio × d_model"
    )
    norm_eps: float = Field(1e-5, gt=0, lt=1, description="epsilon of the LayerNorm / RMSNorm layers")
    tied_embeddings: bool | None = Field(
        None, description="the output head reuses the embedding; null takes the style's default (gpt2 tied)"
    )
    rotary_pct: float = Field(
        1.0, gt=0, le=1, description="fraction of each head's dims that RoPE rotates (Pythia: 0.25)"
    )
    parallel_residual: bool | None = Field(
        None, description="attention and MLP read the same block input (GPT-NeoX); null takes the style's default"
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.d_model % self.heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be a multiple of heads ({self.heads}); "
                f"hint: try d_model {self.heads * max(1, round(self.d_model / self.heads))}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}); "
                "hint: drop kv_heads, or pick a divisor of heads"
            )
        return self


class AttentionConfig(_Section):
    type: AttentionType = Field(
        "sparsek+sw",
        description="sparsek+sw (SparseK pool plus sliding window), sparsek only, sw "
        "(sliding window only), sparsek+linear+sw or linear+sw (plus linear attention over the keys "
        "not fully attended to) or full causal attention",
    )
    topk: int | None = Field(
        None, ge=0, description="k, the SparseK pool size per layer (sparsek types only)"
    )
    window: int | None = Field(
        None, ge=0, description="w, the sliding-window width (sparsek+sw and sw only)"
    )
    variant: Literal["hard_k_soft_v", "soft_kv", "straight_through"] = Field(
        "hard_k_soft_v", description="how the SparseK mask enters attention"
    )
    score_groups: Literal["shared", "per_kv_head"] = Field(
        "shared", description="one scoring vector for all heads, or one per KV head"
    )
    timestep_norm: bool = Field(True, description="normalise scores with causal running mean/variance")
    eps_slope: float = Field(
        1e-3, ge=0, description="position slope ε added to scores (u_j += ε·j), favours recent tokens"
    )
    score_init: Literal["random", "mimic"] = Field(
        "random", description="init of the scoring vector: random, or mimic attention (W_Q W_Kᵀ 1)"
    )
    linear_norm: Literal["sum", "mean"] | None = Field(
        None, description="linear types: the linear part's sums over the keys beyond each query's window as "
        "the paper writes them (sum: their weight grows with the position and outweighs the softmax keys "
        "within a few thousand tokens) or divided by their count (mean: one averaged key's weight at every "
        "position; 14.8 perplexity better on small books). null: mean for the linear types, sum (no linear part) otherwise"
    )
    linear_gain: Literal["fixed", "learned"] | None = Field(
        None, description="linear types: the linear part as linear_norm gives it (fixed) or times a learned "
        "factor per head (learned), which starts at 1/F (F: phi's features), one key's weight where mean alone "
        "starts at about F keys' (16-33% of the denominator at init; learned: 0.6 perplexity better on small "
        "books). null: learned for the linear types, fixed (no linear part) otherwise"
    )
    linear_rope: Literal["rotated", "unrotated"] | None = Field(
        None, description="linear types: phi reads the queries and keys after RoPE (rotated, as the cache holds "
        "the keys) or rotated back to position 0 (unrotated: their content alone, so phi(q).phi(k) does not change "
        "with where the two tokens are; level with rotated on small books). null: rotated"
    )
    threshold_cap: int | None = Field(
        None, ge=1, description="cap on the SparseK threshold state per row; null picks the default"
    )
    backend: Literal["auto", "naive", "triton"] = Field(
        "auto", description="kernels: auto (Triton on CUDA, naive on the CPU), naive or triton"
    )
    scan: Literal["auto", "host", "device"] = Field(
        "auto", description="selection scan: auto (device on CUDA), host (CPU heaps) or device (GPU wavelet)"
    )
    max_context: int | None = Field(
        None, ge=1, description="full attention only: each query sees at most this many keys (itself "
        "included), so the cache keeps the last max_context - 1 keys: a sliding window computed by SDPA, "
        "with memory that stops growing. null: the whole document. May change on resume (e.g. after an "
        "out-of-memory stop); the attention then changes from that step on"
    )

    @model_validator(mode="after")
    def _type_matches_sizes(self) -> AttentionConfig:
        # The used sizes are required and positive; the unused ones must be absent or 0 and
        # become 0, so the model always reads two ints.
        problems = size_problems(self.type, self.topk, self.window)
        self.linear_norm = self.linear_norm or default_linear_norm(self.type)
        self.linear_gain = self.linear_gain or default_linear_gain(self.type)
        self.linear_rope = self.linear_rope or default_linear_rope(self.type)
        problems += linear_problems(self.type, self.score_groups, self.linear_norm, self.linear_gain, self.linear_rope)
        if self.max_context is not None and self.type != "full":
            problems.append(
                f"attention.max_context caps full attention's growing cache; type {self.type} has a fixed-size "
                "cache already (topk + window); hint: remove max_context, or use type full"
            )
        if problems:
            raise ValueError("; ".join(problems))
        for name in ("topk", "window"):
            if name not in USES[self.type]:
                setattr(self, name, 0)
        return self


class FreezeConfig(_Section):
    """For the first `steps` optimizer steps only the parameters matching `trainable` learn."""

    steps: int = Field(ge=0, description="optimizer steps during which everything else is frozen")
    trainable: list[str] = Field(
        ["*.scorer.weight"], min_length=1,
        description="fnmatch globs of parameter names that train during the frozen steps "
        "(default: the SparseK scoring vectors)",
    )


class EarlyStoppingConfig(_Section):
    """Stop the run when validation stops improving."""

    patience: int = Field(ge=1, description="validation passes in a row without improvement that stop the run")
    min_delta: float = Field(
        0.0, ge=0, description="an improvement: a validation loss below the best so far by more than this"
    )


class LoraConfig(_Section):
    """Low-rank adapters on the frozen projections (longtrain.train.lora); the scoring vectors train in full."""

    rank: int = Field(16, ge=1, description="rank r of each adapter (A [r, in], B [out, r])")
    alpha: float = Field(32.0, gt=0, description="the adapters' output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down"]] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down"], min_length=1,
        description="the projections of every block that get adapters (gate: SwiGLU models only)",
    )


class TrainConfig(_Section):
    steps: int = Field(ge=1, description="optimizer steps to train")
    chunk_size: int = Field(512, ge=1, description="tokens per chunk (one forward/backward)")
    batch_docs: int = Field(4, ge=1, description="documents streamed side by side (batch rows)")
    grad_accum: int = Field(1, ge=1, description="chunks whose gradients make one optimizer step")
    lr: float = Field(6e-4, gt=0, le=1, description="peak learning rate")
    schedule: Literal["cosine", "linear", "wsd", "constant"] = Field(
        "cosine", description="learning rate after the warmup: cosine or linear decay to lr·min_lr_ratio at the "
        "last step, wsd (warmup-stable-decay: lr until the last decay_fraction of the steps, then linear down "
        "to lr·min_lr_ratio), or constant lr"
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="schedule wsd: the share of train.steps (after the warmup) spent decaying"
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="final learning rate of the cosine, linear or wsd decay as a fraction of lr"
    )
    warmup_steps: int = Field(
        100, ge=0, description="steps of linear warmup to lr; a run shorter than this warms up "
        "over its first tenth instead (so `--set train.steps=20` works on any recipe)"
    )
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (≥2-D weights)")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.95), description="AdamW betas, two numbers in [0, 1)"
    )
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm; 0 turns clipping off")
    seed: int = Field(0, ge=0, description="seed of every random generator")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto uses CUDA when present")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="with several ranks (torchrun): ddp replicates the model, fsdp shards parameters, "
        "gradients and optimizer state (FSDP2) for models that do not fit one device"
    )
    compile: bool | None = Field(
        None, description="torch.compile what surrounds the attention op (norms, projections, RoPE, the "
        "scorer, MLPs, residuals, the loss); the op keeps its own kernels. Costs a compile at the start "
        "(and one for validation). Unset: on CUDA (about 1.3x the tokens/s of eager there), off on the CPU"
    )
    cuda_graphs: bool = Field(
        True, description="on CUDA, capture one chunk's forward and backward as a CUDA graph and replay it "
        "for every chunk (the same kernels; the host no longer holds the GPU up). Used where it can be: "
        "not fsdp, a fixed-size cache (not full attention), no dropout, not fp16, no train.freeze"
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="compute precision: bf16 or fp16 autocast (fp16 with a loss scaler), or fp32; "
        "auto is bf16 on CUDA and fp32 on the CPU. Weights, optimizer state, scores and thresholds stay "
        "fp32; the KV cache is kept in the compute dtype"
    )
    valid_every: int = Field(
        0, ge=0, description="steps between validation passes, plus one at the last step of a run at "
        "least this long (a shorter run is not validated); 0 turns it off"
    )
    valid_docs: int = Field(4, ge=1, description="held-out documents per validation pass (at most)")
    valid_tokens: int = Field(16384, ge=1, description="tokens read per validation document (at most)")
    # Fine-tuning (longtrain.train.init).
    init_from: str | None = Field(
        None, description="start from the weights of this checkpoint or run dir (e.g. one made by "
        "`longtrain import`), with a fresh optimizer, schedule and data stream; a recipe without a "
        "`model:` section takes the source's, and one without tokenizer.path its tokenizer"
    )
    warmup_start_ratio: float = Field(
        0.0, ge=0, le=1, description="warmup starts at this fraction of lr (the paper's fine-tuning: 0.1)"
    )
    score_lr_scale: float = Field(
        1.0, gt=0, description="learning rate of the SparseK scoring vectors as a multiple of lr"
    )
    freeze: FreezeConfig | None = Field(
        None, description="train only some parameters for the first steps (scorer-first warm-up)"
    )
    score_distill: float = Field(
        0.0, ge=0, description="weight of the score distillation loss: the SparseK scores learn where the "
        "model's dense attention goes for a few sampled queries per chunk (KL), so keys that are never "
        "selected still get a signal; 0 turns it off. Training only: outputs and selections are unchanged"
    )
    clip_scorer_apart: bool = Field(
        False, description="clip the SparseK scoring vectors' gradient norm apart from the rest of the model's "
        "(each to train.grad_clip), so a large scorer gradient, e.g. train.score_distill's, does not set the "
        "clip factor of the model's gradient from step to step"
    )
    scorer_unit_norm: bool = Field(
        False, description="put each SparseK scoring vector back to length 1 after every optimizer step: under "
        "attention.timestep_norm the scores do not depend on its length, but its gradient grows as it shrinks "
        "(train.score_distill shrank one to 0.009, benchmarks/README.md)"
    )
    score_distill_queries: int = Field(
        128, ge=1, description="queries sampled per chunk and row for train.score_distill"
    )
    deterministic: bool = Field(
        False, description="the same seed gives the same run bit for bit on the same kind of device and software "
        "(a checkpoint's meta.json records them as `machine`; fit notes a resume saved elsewhere): "
        "deterministic kernels (no atomic adds, fixed cuBLAS workspaces), Inductor "
        "without timing-based choices; costs some tokens/s on CUDA (benchmarks/README.md)"
    )
    activation_checkpointing: bool = Field(
        False, description="keep only each block's input for the backward and recompute the block there "
        "(torch.utils.checkpoint): less activation memory for a larger batch or chunk, at the cost of a second "
        "forward of every block (benchmarks/activation_checkpointing.py measures both); results are unchanged"
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None, description="stop (saving a checkpoint) after `patience` validation passes without a validation loss "
        "lower than the best by more than `min_delta`, e.g. {patience: 3, min_delta: 0.001}; needs train.valid_every"
    )
    lora: LoraConfig | None = Field(
        None, description="fine-tune LoRA adapters (plus the scoring vectors) instead of every weight, e.g. "
        "{rank: 16, alpha: 32}; checkpoints keep the adapters, export merges them"
    )

    @model_validator(mode="after")
    def _fp16_not_sharded(self) -> TrainConfig:
        if self.precision == "fp16" and self.parallel == "fsdp":
            raise ValueError(
                "train.precision fp16 is not supported with train.parallel fsdp (its loss scaler would need "
                "sharded inf checks); hint: use precision bf16 with fsdp, or fp16 with ddp"
            )
        return self

    def warmup(self) -> int:
        """The warmup actually used: warmup_steps, or a tenth of a run shorter than it."""
        return self.warmup_steps if self.warmup_steps <= self.steps else self.steps // 10

    def validates_at(self, step: int) -> bool:
        """Validation every `valid_every` steps and at the end of a run at least that long."""
        if not self.valid_every:
            return False
        return step % self.valid_every == 0 or (step == self.steps and self.steps >= self.valid_every)


class CheckpointConfig(_Section):
    every: int = Field(500, ge=1, description="steps between checkpoints (a final one is always saved)")
    keep: int = Field(3, ge=1, description="complete checkpoints kept; older ones are deleted")
    keep_best: bool = Field(
        False, description="also save a checkpoint at every new best validation loss and keep the best one, "
        "whatever `keep` deletes (needs train.valid_every)"
    )
    dir: str | None = Field(None, description="checkpoint folder; null means RUN_DIR/checkpoints")


class LoggingConfig(_Section):
    every: int = Field(10, ge=1, description="steps between printed log lines")
    progress: bool = Field(True, description="rich live display when the output is a terminal")
    tensorboard: bool = Field(
        False, description="also write TensorBoard event files to RUN_DIR/tensorboard "
        "(needs the extra: pip install 'longtrain[tensorboard]')"
    )
    wandb: bool = Field(
        False, description="also log the same scalars to Weights & Biases (needs the extra: pip install "
        "'longtrain[wandb]'; WANDB_MODE=offline keeps it on disk, `wandb sync` uploads later). The run's id is "
        "kept in RUN_DIR/wandb-id, so a resumed run continues the same W&B run"
    )
    wandb_project: str = Field("longtrain", min_length=1, description="the W&B project of logging.wandb")
    run_dir: str | None = Field(None, description="run directory; null means runs/<recipe name>")


class Recipe(_Section):
    name: str | None = Field(
        None, min_length=1, description="run name; null takes the recipe file's name"
    )
    model: ModelConfig = Field(
        description="the model's shape; a fine-tuning recipe may leave it out and set train.init_from "
        "(e.g. a run dir from `longtrain import`)"
    )
    attention: AttentionConfig
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    train: TrainConfig
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    # attention keys (topk, window) the recipe left unset and train.init_from's run gave (load_recipe)
    _from_init_source: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _validation_for_best(self) -> Recipe:
        wants = [name for name, on in (("checkpoint.keep_best", self.checkpoint.keep_best),
                                       ("train.early_stopping", self.train.early_stopping is not None)) if on]
        if wants and not self.train.valid_every:
            raise ValueError(
                f"{' and '.join(wants)} compare validation losses, but train.valid_every is 0 (no validation); "
                "hint: set train.valid_every (e.g. --set train.valid_every=100) and validation data (data.valid)"
            )
        return self

    @model_validator(mode="after")
    def _unit_norm_needs_timestep_norm(self) -> Recipe:
        if self.train.scorer_unit_norm and not self.attention.timestep_norm:
            raise ValueError(
                "train.scorer_unit_norm rescales the scoring vectors, which changes the scores unless "
                "attention.timestep_norm normalises them; hint: set attention.timestep_norm=true or "
                "train.scorer_unit_norm=false"
            )
        return self

    @model_validator(mode="after")
    def _vocab_fits_tokenizer(self) -> Recipe:
        vocab = self.model.vocab_size
        if vocab is not None and self.tokenizer.path is None and vocab < self.tokenizer.vocab_size:
            raise ValueError(
                f"model.vocab_size ({vocab}) is smaller than tokenizer.vocab_size "
                f"({self.tokenizer.vocab_size}); hint: set model.vocab_size to null to take the tokenizer's"
            )
        return self

    def run_dir(self) -> Path:
        return Path(self.logging.run_dir or Path("runs") / (self.name or DEFAULT_RECIPE))

    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir() / "checkpoints"


# --------------------------------------------------------------------- loading

_SECTIONS = {
    name for name, f in Recipe.model_fields.items() if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
}


def builtin_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_description(path: Path) -> str:
    """A recipe file's one-line description: its first comment line, `# name: description`."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            text = line.lstrip("# ").strip()
            name, sep, rest = text.partition(": ")
            return rest if sep and name == path.stem else text
        if line.strip():
            break
    return ""


def resolve_recipe_path(name_or_path: str | Path | None) -> Path:
    """An existing file, else a built-in recipe name (`quickstart`); None is the default."""
    if name_or_path is None:
        name_or_path = DEFAULT_RECIPE
    path = Path(name_or_path)
    if path.exists() or path.suffix or len(path.parts) > 1:
        return path
    return RECIPES_DIR / f"{path.name}.yaml"


# A reader of train.init_from's run: its `model:`, tokenizer.json, tokenizer.eod_token and `attention:` (train.init.read_init_source)
InitSource = Callable[[str], tuple[dict, Path, "str | None", dict]]


def load_recipe(path: str | Path | None, overrides: Sequence[str] = (), *, init_source: InitSource | None = None) -> Recipe:
    """Read, override and validate a recipe; every problem in one RecipeError. `init_source` reads
    train.init_from's run for the keys a fine-tuning recipe leaves out (None: such a recipe is refused)."""
    path = resolve_recipe_path(path)
    raw = _read_yaml(path)
    _fill_fields_added_later(raw, path)
    # what the file says of the data before the overrides (a saved run's resolved recipe: nothing to check)
    file_data = None if _resolved(path) else copy.deepcopy(raw.get("data") if isinstance(raw.get("data"), dict) else {})
    override_paths, made = _apply_overrides(raw, overrides)
    raw.setdefault("name", path.stem)
    inherited = _fill_from_init_source(raw, path, init_source)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    data_sets = {keys[1] for keys in override_paths if keys[0] == "data" and len(keys) > 1}
    data_sets |= set(data) if ("data",) in override_paths else set()  # --set data={...}: the whole section
    check = {UNUSED_CHECK: {"file": file_data, "overrides": data_sets}}  # DataConfig refuses settings its source ignores
    try:
        recipe = Recipe.model_validate(raw, context=check)
        recipe._from_init_source = inherited
        return recipe
    except ValidationError as e:
        origins = {**made, **override_paths}  # a key the file does not have, that a --set wrote (or made a section of)
        problems = [describe_error(err, origins, Recipe, example=RECIPES_DIR / f"{DEFAULT_RECIPE}.yaml") for err in e.errors()]
        noun = "problem" if len(problems) == 1 else "problems"
        raise RecipeError(f"recipe {path} has {len(problems)} {noun}:\n" + "\n".join(problems)) from None


RESOLVED_HEADER = "# resolved recipe: every default filled in; `longtrain fit` can read it back\n"


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe (defaults filled in), as saved to the run directory."""
    body = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    return RESOLVED_HEADER + body


# Fields added after runs were saved, by section, with the value that means what the code computed before them. The
# hash leaves a field out at that value, so runs saved before it still resume; a saved recipe without it gets that
# value (attention.linear_norm and linear_gain: the linear types summed with a fixed gain before them, where a new
# recipe's defaults are mean and learned; linear_rope: phi read the keys after RoPE).
_FIELDS_ADDED_LATER = {
    "model": {"intermediate_size": None, "norm_eps": 1e-5, "tied_embeddings": None, "rotary_pct": 1.0,
              "parallel_residual": None, "rope_scaling": None, "qkv_bias": None},
    "tokenizer": {"eod_token": None},
    "attention": {"linear_norm": "sum", "linear_gain": "fixed", "linear_rope": "rotated"},
}


def _fill_fields_added_later(raw: dict[str, Any], path: Path) -> None:
    """A run's saved (resolved) recipe holds every field of its day: one missing there was added later, and the run
    computed what the code did before it (_FIELDS_ADDED_LATER), so it loads and resumes as it trained."""
    if not _resolved(path):
        return
    for section, added in _FIELDS_ADDED_LATER.items():
        if isinstance(raw.get(section), dict):
            for key, before in added.items():
                raw[section].setdefault(key, before)


def _resolved(path: Path) -> bool:
    """A recipe as a run saved it (recipe_to_yaml), not one a user wrote."""
    return path.read_text().startswith(RESOLVED_HEADER)


def recipe_hash(recipe: Recipe, sections: Iterable[str] = ("model", "attention", "tokenizer")) -> str:
    """Stable hash of the sections that decide what a checkpoint can be loaded into.

    `attention.backend` and `attention.scan` are left out: they pick implementations, not
    results, so a run started on the CPU may resume on a GPU. `attention.max_context` is left out
    too: it is what a full-attention run that ran out of memory resumes with.
    """
    dump = recipe.model_dump(mode="json", include=set(sections))
    for section, added in _FIELDS_ADDED_LATER.items():  # so runs saved before them still resume
        for key, before in added.items():
            if key in dump.get(section, {}) and dump[section][key] == before:
                dump[section].pop(key)
    dump.get("attention", {}).pop("backend", None)
    dump.get("attention", {}).pop("scan", None)
    dump.get("attention", {}).pop("max_context", None)  # a memory cap the user may change on resume
    canonical = json.dumps(dump, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _fill_from_init_source(raw: dict[str, Any], path: Path, init_source: InitSource | None) -> list[str]:
    """A fine-tuning recipe (train.init_from set) may leave out `model:`, tokenizer.path and
    attention.topk / attention.window: they come from the source checkpoint, so nobody copies a model's
    shape by hand and an import's `--topk 32 --window 32` carry on. Keys the recipe does set win (e.g.
    `--set model.rope_theta=...`, `--set attention.topk=64`). A complete recipe (as saved in a run)
    never reads the source, so a fine-tuned checkpoint loads after its source is gone.
    `init_source` reads the source (fit's resolves the path). Returns the attention keys taken from the source."""
    train, model, tok, att = raw.get("train"), raw.get("model"), raw.get("tokenizer"), raw.get("attention")
    source = train.get("init_from") if isinstance(train, dict) else None
    model_complete = isinstance(model, dict) and all(k in model for k in ("layers", "d_model", "heads"))
    if not source and not model_complete and isinstance(train, dict) and "init_from" in train:
        raise RecipeError(
            f"recipe {path}: train.init_from is not set, and this fine-tuning recipe takes its model from it; "
            "add --set train.init_from=RUN_DIR (a run dir from `longtrain import`, or any longtrain checkpoint or run)"
        )
    att_type = att.get("type", "sparsek+sw") if isinstance(att, dict) else None
    unset_sizes = [k for k in ("topk", "window") if att_type in USES and k in USES[att_type] and att.get(k) is None]
    if not source or (model_complete and isinstance(tok, dict) and tok.get("path") and not unset_sizes):
        return []
    if not isinstance(source, str):
        raise RecipeError(f"recipe {path}: train.init_from must be a path (a run dir or checkpoint); got {source!r}")
    if init_source is None:
        raise RecipeError(f"recipe {path} takes its model, tokenizer or attention sizes from train.init_from ({source}), which "
                          "`longtrain fit` reads; give the recipe a `model:` section, tokenizer.path and the sizes to read it here")
    source_model, tokenizer_path, eod_token, source_attention = init_source(source)
    if not model_complete:
        raw["model"] = {**source_model, **(model if isinstance(model, dict) else {})}
    tok = raw.setdefault("tokenizer", {})
    if isinstance(tok, dict) and not tok.get("path"):
        tok["path"] = str(tokenizer_path)
        if eod_token is not None:
            tok.setdefault("eod_token", eod_token)
    for key in unset_sizes:
        if not source_attention.get(key):
            raise RecipeError(
                f"recipe {path}: attention.{key} comes from train.init_from, and {source} (attention "
                f"{source_attention.get('type', 'unknown')}) has none; set it, e.g. --set attention.{key}=512"
            )
        att[key] = source_attention[key]
    return unset_sizes


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        builtins = ", ".join(builtin_recipes()) or "none"
        raise RecipeError(f"recipe file not found: {path} (built-in recipes: {builtins})")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise RecipeError(f"{where}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: YAML syntax error: {e}") from None
    if raw is None:
        raise RecipeError(f"recipe {path} is empty; see recipes/{DEFAULT_RECIPE}.yaml for an example")
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path} must be a mapping of sections, got a {type(raw).__name__}")
    # A section whose keys are all commented out reads as null: treat it as empty.
    return {k: {} if v is None and k in _SECTIONS else v for k, v in raw.items()}


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key `{key}`", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[tuple[str, ...], str], dict[tuple[str, ...], str]]:
    """Apply `a.b=value` overrides in place; returns ({path: override text}, {path of a section the file does not
    have: the first override that made it}) for messages (`--set trian.steps=5` makes a section `trian`)."""
    applied: dict[tuple[str, ...], str] = {}
    made: dict[tuple[str, ...], str] = {}
    bad: list[str] = []
    for text in overrides:
        key, sep, value_text = text.partition("=")
        keys = tuple(key.strip().split("."))
        if not sep or not all(keys):
            bad.append(f"  - --set {text}: expected KEY=VALUE, e.g. --set train.lr=3e-4")
            continue
        try:
            value = yaml.safe_load(value_text)
        except yaml.YAMLError:
            value = value_text  # not a YAML scalar: take it as a plain string
        node = raw
        for i, part in enumerate(keys[:-1]):
            if node.get(part) is None:  # absent, or null (a resolved recipe writes an unset section so): made here
                if part not in node:
                    made.setdefault(keys[: i + 1], text)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                bad.append(f"  - --set {text}: `{'.'.join(keys[: i + 1])}` is a value, not a section")
                break
        else:
            node[keys[-1]] = value
            applied[keys] = text
    if bad:
        raise RecipeError("bad --set override:\n" + "\n".join(bad))
    return applied, made
