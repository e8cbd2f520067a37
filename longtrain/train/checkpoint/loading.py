"""A checkpoint as the inference verbs use it (`eval`, `generate`, `verify-equivalence`, `export`,
`inspect`): resolved from a checkpoint or run dir, with its recipe and tokenizer, the model ready."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from longtrain.train.checkpoint import storage as ckpt
from longtrain.train.lora import merge_lora
from longtrain.train.checkpoint.storage import META, RECIPE_FILE, TOKENIZER_FILE, CheckpointError, beside, resolve_checkpoint


@dataclass
class LoadedCheckpoint:
    path: Path  # the checkpoint directory
    recipe: Any  # longtrain.train.recipe.Recipe
    tokenizer: Tokenizer
    model: Any  # longtrain.model.LM, in eval mode, on the requested device and dtype
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta.get("step", 0))


def checkpoint_files(recipe, tokenizer: Tokenizer) -> dict[str, bytes]:
    """The files that make a checkpoint self-contained (for CheckpointManager.save(files=...))."""
    from longtrain.train.recipe import recipe_to_yaml

    return {RECIPE_FILE: recipe_to_yaml(recipe).encode(), TOKENIZER_FILE: tokenizer.to_str().encode()}


def load_recipe_and_tokenizer(path: Path):
    """(recipe, tokenizer) of a resolved checkpoint directory."""
    from longtrain.data import DataError
    from longtrain.data.tokenizer import load_tokenizer
    from longtrain.train.recipe import RecipeError, load_recipe

    recipe_path = beside(path, RECIPE_FILE)
    if recipe_path is None:
        raise CheckpointError(f"checkpoint {path} has no {RECIPE_FILE}, nor has its run dir {path.parent.parent}")
    try:
        recipe = load_recipe(recipe_path)
    except RecipeError as e:
        raise CheckpointError(f"checkpoint {path}: its recipe does not load: {e}") from None
    tok_path = beside(path, TOKENIZER_FILE) or (Path(recipe.tokenizer.path) if recipe.tokenizer.path else None)
    if tok_path is None:
        raise CheckpointError(
            f"checkpoint {path} has no {TOKENIZER_FILE}, nor has its run dir {path.parent.parent}, "
            "and its recipe names no tokenizer.path; copy the run's tokenizer.json into the checkpoint folder"
        )
    try:
        tokenizer = load_tokenizer(tok_path, recipe.tokenizer.eod_token)
    except DataError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    return recipe, tokenizer


def load_checkpoint(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> LoadedCheckpoint:
    """The model of a checkpoint or run dir, with its recipe and tokenizer, ready for inference."""
    from longtrain.model import LM, LMConfig

    path = resolve_checkpoint(path)
    recipe, tokenizer = load_recipe_and_tokenizer(path)
    meta = json.loads((path / META).read_text())
    if "model.safetensors" not in meta.get("files", {}):
        raise CheckpointError(f"checkpoint {path} holds no model.safetensors")
    tensors, meta = ckpt.load(path, ["model"])  # not the optimizer state (twice the model's size)
    state = merge_lora(tensors["model"])  # a LoRA run's adapters folded into the weights (longtrain.train.lora)
    vocab = state["embed.weight"].shape[0] if "embed.weight" in state else None
    try:
        model = LM(LMConfig.from_recipe(recipe.model, recipe.attention, vocab_size=vocab))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: its recipe does not describe a model: {e}") from None
    ckpt.check_shapes(state, model.state_dict())
    model.load_state_dict(state)
    model.to(device=device, dtype=dtype).eval()
    return LoadedCheckpoint(path=path, recipe=recipe, tokenizer=tokenizer, model=model, meta=meta)
