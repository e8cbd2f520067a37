"""Fine-tuning: start a run from existing weights (`train.init_from`) and warm the scorer up first
(`train.freeze`).

`init_from` copies only the model weights of a checkpoint or run dir (one `longtrain import` wrote, or
any longtrain run): the new run has a fresh optimizer, schedule and data stream. `--resume` keeps its
meaning (continue this run from its own checkpoints), and a resumed run never reads the source again.

Scoring vectors the source does not have (it used full or sliding-window attention, or was imported
from Hugging Face) keep the new model's initialisation, per `attention.score_init`: `random`, or
`mimic`, recomputed from the loaded W_Q and W_K (longtrain.model.scoring.mimic_score_weight).

`train.freeze: {steps: N, trainable: [globs]}` holds every parameter whose name matches none of the
globs still for optimizer steps 1..N (default globs: the scoring vectors, so the new scorer learns to
imitate the pretrained attention before the rest of the model adapts to it). A frozen parameter has
`requires_grad = False`: no gradient, so AdamW gives it no update, no weight decay and no moments;
when it thaws it warms up again (longtrain.train.optim.set_lr).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path

import torch
import yaml
from torch import nn

from longtrain.errors import CheckpointError, RecipeError
from longtrain.model.scoring import mimic_score_weight
from longtrain.path_args import CHECKPOINT_FORMS, input_folder
from longtrain.train.checkpoint import storage as ckpt
from longtrain.train.checkpoint.storage import RECIPE_FILE, TOKENIZER_FILE, beside, resolve_checkpoint
from longtrain.train.lora import ADAPTER_KEYS, has_adapters, merge_lora, trains
from longtrain.train.recipe import ModelConfig, Recipe, load_recipe


def load_fit_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe `fit` runs: load_recipe, with train.init_from resolved here, where the run starts (read_init_source)."""
    return load_recipe(path, overrides, init_source=read_init_source)


def read_init_source(source: str | Path) -> tuple[dict, Path, str | None, dict]:
    """The `model:` section, tokenizer.json, tokenizer.eod_token and `attention:` section of a checkpoint or run dir (for a
    recipe that leaves them out); a source that cannot be read: check_init_source's CheckpointError."""

    path = check_init_source(source)
    recipe_path, tok_path = beside(path, RECIPE_FILE), beside(path, TOKENIZER_FILE)
    if recipe_path is None or tok_path is None:
        missing = RECIPE_FILE if recipe_path is None else TOKENIZER_FILE
        raise RecipeError(f"train.init_from: checkpoint {path} has no {missing}; give the recipe a `model:` section and tokenizer.path")
    raw = saved_recipe(path)
    model, attention = raw.get("model"), raw.get("attention")
    if not isinstance(model, dict):
        raise RecipeError(f"train.init_from: {recipe_path} has no `model:` section")
    return model, tok_path, (raw.get("tokenizer") or {}).get("eod_token"), attention if isinstance(attention, dict) else {}


def saved_recipe(checkpoint: Path) -> dict:
    """The recipe saved beside a checkpoint, as YAML gives it ({} where there is none)."""
    recipe_path = beside(checkpoint, RECIPE_FILE)
    return (yaml.safe_load(recipe_path.read_text()) or {}) if recipe_path is not None else {}


def check_init_source(source: str | Path) -> Path:
    """The checkpoint of a `train.init_from`; refuses one that cannot be read, before the data is prepared (a recipe may
    take its tokenizer from that run: without this, its missing tokenizer.json would be the first error)."""

    fix = (". Train or import that model first (`longtrain fit RECIPE --run-dir DIR`, `longtrain import HF_DIR --out DIR`), "
           "or point train.init_from at it (--set train.init_from=DIR)")
    # no such path, or a file: the recipe cannot work as it is (exit 2); a folder without a usable checkpoint: exit 1
    input_folder(source, CHECKPOINT_FORMS, prefix="train.init_from: ", error=RecipeError, then=fix)
    try:
        return resolve_checkpoint(source)
    except CheckpointError as e:
        raise CheckpointError(f"train.init_from: {e}{fix}") from None


def imported_origin(source: str | Path) -> dict | None:
    """`longtrain import`'s record (path, model_type, config.json) of the Hugging Face model the source
    descends from, carried on by every run that starts from it; None for a model trained from scratch."""

    return json.loads((Path(resolve_checkpoint(source)) / ckpt.META).read_text()).get("imported_from")


@torch.no_grad()
def init_from_checkpoint(model: nn.Module, source: str | Path, recipe) -> list[str]:
    """Load the source's weights into `model` (a longtrain LM); returns lines that say what happened.

    Refuses (CheckpointError naming the tensors) a source whose tensors disagree with the model.
    """

    path = resolve_checkpoint(source)
    if not (Path(path) / "model.safetensors").is_file():
        raise CheckpointError(f"train.init_from: checkpoint {path} holds no model.safetensors")
    tensors, _ = ckpt.load(path, ["model"])  # weights only: not the optimizer state
    state = dict(tensors["model"])
    own = model.state_dict()
    merged = has_adapters(state) and not has_adapters(own)
    if merged:  # a LoRA run's weights into a model without adapters: fold them in
        state = merge_lora(state)
    is_score = lambda k: k.endswith("scorer.weight")  # noqa: E731
    new_scores = [k for k in own if is_score(k) and k not in state]
    new_adapters = [k for k in own if k.endswith(ADAPTER_KEYS) and k not in state]  # keep their init (B = 0)
    dropped = [k for k in state if is_score(k) and k not in own]  # a SparseK source fine-tuned as sw/full
    for k in dropped:
        del state[k]
    try:
        ckpt.check_shapes(state, {k: v for k, v in own.items() if k not in new_scores and k not in new_adapters})
    except CheckpointError as e:
        raise CheckpointError(
            f"train.init_from {source}: {e}. Hint: leave out the recipe's `model:` section to take the source's shape"
        ) from None
    model.load_state_dict(state, strict=False)

    notes = [f"initialised from {path} (weights only: fresh optimizer, schedule and data stream)"]
    changed = model_differences(saved_recipe(path).get("model"), recipe.model)
    if changed:  # the shapes fit, so nothing else would say it: e.g. a circuit trained with partial RoPE, fine-tuned without
        notes.append(f"the model computes differently from the source's: {'; '.join(changed)} (the weights fit; intended for "
                     "a RoPE change, otherwise leave out the recipe's `model:` section to take the source's)")
    if new_scores:
        how = recipe.attention.score_init
        if how == "mimic":
            _mimic_scores(model, new_scores)
        notes.append(f"{len(new_scores)} scoring vectors are new (not in the source): initialised {how}")
    if dropped:
        notes.append(f"{len(dropped)} scoring vectors of the source are unused by attention {recipe.attention.type}")
    if merged:
        notes.append("the source's LoRA adapters are merged into its weights (this recipe has no train.lora)")
    elif has_adapters(state):
        notes.append("the source's LoRA adapters are loaded and train on")
    return notes


# Keys that may differ from the source without changing what its weights compute.
_TRAINING_ONLY = ("dropout", "init_std")


def model_differences(raw: dict | None, model: ModelConfig) -> list[str]:
    """The `model:` settings in which `model` differs from a source run's saved `model:` section `raw` ("key
    source → here"), beyond the training-only ones; none when the source has none (an import's weights without a
    recipe) or a key is unset (null: a default) on either side."""
    if not isinstance(raw, dict):
        return []
    try:
        theirs = ModelConfig.model_validate(raw).model_dump()
    except ValueError:
        return []  # a recipe this version cannot read: the shape check above already spoke for the tensors
    ours = model.model_dump()
    return [f"{k} {theirs[k]} → {ours[k]}" for k in ours
            if k not in _TRAINING_ONLY and theirs.get(k) is not None and ours[k] is not None and theirs[k] != ours[k]]


def _mimic_scores(model: nn.Module, keys: list[str]) -> None:
    cfg = model.cfg
    for i, blk in enumerate(model.blocks):
        a = blk.attn
        if f"blocks.{i}.attn.scorer.weight" in keys:
            a.scorer.weight.copy_(mimic_score_weight(a.q_proj.weight, a.k_proj.weight, cfg.heads, cfg.kv_heads, a.scorer.weight.shape[0]))


def apply_freeze(model: nn.Module, freeze, step: int) -> int:
    """Set requires_grad for optimizer step `step` under `train.freeze`; returns how many tensors are frozen.

    Call before every step's forward (cheap): the state follows from the step alone, so a run resumed
    in the middle of the warm-up freezes exactly what an uninterrupted one would.
    """
    if freeze is None or freeze.steps == 0:
        return 0

    names = [n for n, _ in model.named_parameters()]
    trainable = {n for n in names if any(fnmatchcase(n, g) for g in freeze.trainable)}
    if not trainable:
        why = f" (attention {model.cfg.attention} has no scoring vectors)" if model.cfg.score_group_count == 0 else ""
        raise RecipeError(
            f"train.freeze.trainable {freeze.trainable} matches no parameter of this model{why}; "
            "names look like blocks.0.attn.scorer.weight, blocks.0.attn.q_proj.weight, embed.weight"
        )
    frozen = 0
    lora = has_adapters(dict(model.named_parameters()))
    for name, p in model.named_parameters():
        p.requires_grad_((step > freeze.steps or name in trainable) and (not lora or trains(name)))  # LoRA: base stays frozen
        frozen += not p.requires_grad
    return frozen
