"""Finding and loading a trained model: what every verb that takes a checkpoint uses.

A checkpoint (`RUN_DIR/checkpoints/step-XXXXXXXX/`) is self-contained: besides its safetensors and
`meta.json` it holds the resolved `recipe.yaml` and the `tokenizer.json` it was trained with (the
vocabulary size is read from the weights), so a checkpoint copied anywhere loads on its own. Checkpoints
written before that still load: their recipe and tokenizer come from the run dir two levels up.

Verbs accept either a checkpoint dir or a run dir; a run dir means its newest complete checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from longtrain.train import checkpoint as ckpt
from longtrain.train.checkpoint import META, CheckpointError, CheckpointManager

RECIPE_FILE = "recipe.yaml"
TOKENIZER_FILE = "tokenizer.json"


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


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory's newest complete checkpoint."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: give a checkpoint folder (…/checkpoints/step-XXXXXXXX) or a run dir")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file: give a checkpoint folder (…/checkpoints/step-XXXXXXXX) or a run dir")
    if (path / META).is_file():
        problem = ckpt.validate(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} cannot be used: {problem}")
        return path
    for folder in (path / "checkpoints", path):  # a run dir, or a checkpoints folder itself
        steps = CheckpointManager(path, keep=1, directory=folder).steps()
        if steps:
            latest = CheckpointManager(path, keep=1, directory=folder).latest_complete()
            if latest is None:
                raise CheckpointError(
                    f"{folder} has {len(steps)} checkpoint(s) but none is complete (each fails its checks); "
                    "resume the run to write a new one"
                )
            return latest
    raise CheckpointError(
        f"{path} is neither a checkpoint (no {META}) nor a run dir with checkpoints (no checkpoints/step-XXXXXXXX); "
        "train one with `longtrain fit`"
    )


def checkpoint_files(recipe, tokenizer: Tokenizer) -> dict[str, bytes]:
    """The files that make a checkpoint self-contained (for CheckpointManager.save(files=...))."""
    from longtrain.train.recipe import recipe_to_yaml

    return {RECIPE_FILE: recipe_to_yaml(recipe).encode(), TOKENIZER_FILE: tokenizer.to_str().encode()}


def _beside(path: Path, name: str) -> Path | None:
    """`name` in the checkpoint, else in the run dir of an older checkpoint; None if neither."""
    for candidate in (path / name, path.parent.parent / name):
        if candidate.is_file():
            return candidate
    return None


def load_recipe_and_tokenizer(path: Path):
    """(recipe, tokenizer) of a resolved checkpoint directory."""
    from longtrain.data import DataError
    from longtrain.data.tokenizer import load_tokenizer
    from longtrain.train.recipe import RecipeError, load_recipe

    recipe_path = _beside(path, RECIPE_FILE)
    if recipe_path is None:
        raise CheckpointError(f"checkpoint {path} has no {RECIPE_FILE}, nor has its run dir {path.parent.parent}")
    try:
        recipe = load_recipe(recipe_path)
    except RecipeError as e:
        raise CheckpointError(f"checkpoint {path}: its recipe does not load: {e}") from None
    tok_path = _beside(path, TOKENIZER_FILE) or (Path(recipe.tokenizer.path) if recipe.tokenizer.path else None)
    if tok_path is None:
        raise CheckpointError(
            f"checkpoint {path} has no {TOKENIZER_FILE}, nor has its run dir {path.parent.parent}, "
            "and its recipe names no tokenizer.path; copy the run's tokenizer.json into the checkpoint folder"
        )
    try:
        tokenizer = load_tokenizer(tok_path)
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
    tensors, meta = ckpt.load(path)
    if "model" not in tensors:
        raise CheckpointError(f"checkpoint {path} holds no model.safetensors")
    state = tensors["model"]
    vocab = state["embed.weight"].shape[0] if "embed.weight" in state else None
    try:
        model = LM(LMConfig.from_recipe(recipe.model, recipe.attention, vocab_size=vocab))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: its recipe does not describe a model: {e}") from None
    ckpt.check_shapes(state, model.state_dict())
    model.load_state_dict(state)
    model.to(device=device, dtype=dtype).eval()
    return LoadedCheckpoint(path=path, recipe=recipe, tokenizer=tokenizer, model=model, meta=meta)
