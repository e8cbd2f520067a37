"""Checkpoints of a run, as every verb uses them: the one `Checkpointer`.

`Checkpointer` is what `fit` saves and restores: which checkpoint a run resumes from, the
training state that goes into one (model, optimizer, per-row caches, data-stream position, RNG,
counters) and the hashes that refuse a resume into a different model, attention or tokenizer.
`load_checkpoint` (also `Checkpointer.load_model`) is what `eval`, `generate` and
`verify-equivalence` use: a model ready for inference, with its recipe and tokenizer.
Storage itself (atomic writes, checksums, pruning) is `longtrain.train.checkpoint`.

A checkpoint (`RUN_DIR/checkpoints/step-XXXXXXXX/`) is self-contained: besides its safetensors and
`meta.json` it holds the resolved `recipe.yaml` and the `tokenizer.json` it was trained with (the
vocabulary size is read from the weights), so a checkpoint copied anywhere loads on its own. Checkpoints
written before that still load: their recipe and tokenizer come from the run dir two levels up.

Verbs accept either a checkpoint dir or a run dir; a run dir means its newest complete checkpoint.

With several ranks (torchrun) a checkpoint holds the whole model and optimizer (gathered on rank 0),
each rank's per-row caches and RNG, and the layout (ranks × rows); `longtrain.train.rank_state`
says why and how a resume with another number of ranks regroups the rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from longtrain.train import checkpoint as ckpt
from longtrain.train import distributed
from longtrain.train.checkpoint import META, CheckpointError, CheckpointManager
from longtrain.train.distributed import Ranks
from longtrain.train.lora import merge_lora
from longtrain.train.rank_state import Layout, cache_for_rank, cache_group, check_layout, rng_for_rank, saved_groups_for
from longtrain.train.rng import capture_rng, restore_rng

RECIPE_FILE = "recipe.yaml"
TOKENIZER_FILE = "tokenizer.json"
WEIGHT_FILES = ("model.safetensors", RECIPE_FILE, TOKENIZER_FILE)  # what reading a model needs of a checkpoint


@dataclass
class TrainState:
    """What changes every step besides the model, optimizer, caches and data stream."""

    step: int = 0  # last completed optimizer step
    tokens: int = 0  # trained on since step 0
    best_valid_loss: float | None = None
    best_step: int | None = None  # the step of best_valid_loss (checkpoint.keep_best keeps its checkpoint)
    stale_validations: int = 0  # validation passes since the last improvement (train.early_stopping)
    grad_scaler: dict[str, Any] | None = None  # train.precision fp16: the loss scaler's state_dict
    # the Hugging Face model a fine-tuned run descends from (`longtrain import`'s record, carried through
    # train.init_from), so `longtrain export` writes its family and max_position_embeddings back
    imported_from: dict[str, Any] | None = None

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> TrainState:
        """The state a checkpoint's meta.json records."""
        return cls(
            step=meta["step"], tokens=meta["tokens"], best_valid_loss=meta.get("best_valid_loss"),
            best_step=meta.get("best_step"), stale_validations=meta.get("stale_validations", 0),
            grad_scaler=meta.get("grad_scaler"), imported_from=meta.get("imported_from"),
        )


class Checkpointer:
    """The checkpoints of one run: choose the one to resume, save, restore, set old ones aside."""

    def __init__(self, run_dir: str | Path, cfg) -> None:  # cfg: the recipe's CheckpointConfig
        self.manager = CheckpointManager(run_dir, cfg.keep, directory=cfg.dir)
        self.every = cfg.every

    @property
    def dir(self) -> Path:
        return self.manager.dir

    def to_resume(self, resume: str) -> Path | None:
        """The checkpoint `--resume` means: auto (newest complete one, if any), never (none) or a PATH."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.manager.latest_complete()
        path = Path(resume)
        problem = ckpt.validate(path) if path.is_dir() else f"no checkpoint directory at {path}"
        if problem:
            raise CheckpointError(f"--resume {resume}: {problem}")
        return path

    def existing(self) -> list[Path]:
        """Checkpoint folders already in the run's checkpoint dir (complete or not)."""
        return self.manager.steps()

    @staticmethod
    def read_meta(path: Path) -> dict[str, Any]:
        """A validated checkpoint's meta.json (step, tokens, hashes, ...) without loading tensors."""
        return json.loads((Path(path) / META).read_text())

    @staticmethod
    def hashes(recipe, tokenizer: Tokenizer) -> dict[str, str]:
        """What a checkpoint must match to be resumed: model shape, attention, tokenizer."""
        from longtrain.train.recipe import recipe_hash

        return {
            "model": recipe_hash(recipe, ("model",)),
            "attention": recipe_hash(recipe, ("attention",)),
            # the bytes of RUN_DIR/tokenizer.json, as runs before the Checkpointer hashed them
            "tokenizer": hashlib.sha256(tokenizer.to_str(pretty=True).encode()).hexdigest(),
        }

    def check(self, path: Path, hashes: dict[str, str], layout: Layout | None = None) -> dict[str, Any]:
        """The checkpoint's meta, after refusing one written for another model, attention or tokenizer,
        or (given this run's `layout`) for another total of rows."""
        meta = self.read_meta(path)
        ckpt.check_compatible(meta, hashes, path=path)
        if layout is not None:
            check_layout(Layout.from_meta(meta), layout, path=path)
        return meta

    def save(
        self, state: TrainState, *, model, optimizer, cache, stream, hashes, recipe, corpus,
        ranks: Ranks = Ranks(), layout: Layout | None = None,
    ) -> Path:
        """Checkpoint `state.step` atomically (and prune to `keep`); with several ranks every rank calls it.

        `model` is the model as trained (FSDP sharded, or the LM itself).
        """
        layout = layout or Layout(1, cache.batch_size)
        model_sd, optim_sd = distributed.full_state(model, optimizer, ranks)  # FSDP: a collective
        tensors = {cache_group(ranks.rank): cache.state_dict()}
        meta, files = {}, None
        if ranks.is_main:
            opt_tensors, opt_info = ckpt.optimizer_to_checkpoint(optim_sd)
            tensors |= {"model": model_sd, "optimizer": opt_tensors}
            meta = {
                "step": state.step,
                "tokens": state.tokens,
                "best_valid_loss": state.best_valid_loss,
                **({"best_step": state.best_step} if state.best_step is not None else {}),
                **({"stale_validations": state.stale_validations} if state.stale_validations else {}),
                **({"grad_scaler": state.grad_scaler} if state.grad_scaler else {}),
                **({"imported_from": state.imported_from} if state.imported_from else {}),
                "data_stream": stream.state_dict(),  # every row's, the same on every rank
                "layout": layout.to_meta(),
                "corpus": corpus.fingerprint,
                "optimizer": opt_info,
                "hashes": hashes,
            }
            files = checkpoint_files(recipe, corpus.tokenizer)  # self-contained
        return self.manager.save(
            state.step, tensors=tensors, meta=meta, files=files, rank_meta={"rng": capture_rng()}, ranks=ranks
        )

    def restore(
        self, path: Path, *, model, optimizer, stream, hashes, device, ranks: Ranks = Ranks(), layout: Layout | None = None,
    ) -> tuple[TrainState, Any]:
        """Load a checkpoint into the live objects; returns its TrainState and this rank's per-row caches.

        Everything is checked (hashes, the layout of rows, shapes, the data stream) before the model
        or optimizer changes, and nothing is written: a refused resume leaves the run as it was.
        With several ranks, rank 0 reads the model and optimizer and hands them to the others
        (FSDP: each keeps its shard); each rank reads the caches of its own rows.
        """
        from longtrain.model import ModelCache

        layout = layout or Layout(1, stream.batch_rows)
        meta = self.read_meta(path)
        ckpt.check_compatible(meta, hashes, path=path)
        saved = Layout.from_meta(meta)
        check_layout(saved, layout, path=path)
        groups = saved_groups_for(saved, meta, ranks.rank, layout.batch_docs)
        reads_model = ranks.is_main or not ranks.active  # with a process group, rank 0 reads for all
        tensors, meta = ckpt.load(path, groups + (["model", "optimizer"] if reads_model else []))

        def check_model() -> None:
            ckpt.check_shapes(tensors["model"], model.state_dict())

        distributed.on_main(check_model, ranks)  # a refusal stops every rank alike
        stream.load_state_dict(meta["data_stream"])
        optim_sd = ckpt.optimizer_from_checkpoint(tensors["optimizer"], meta["optimizer"]) if reads_model else None
        distributed.load_full_state(model, optimizer, tensors.get("model"), optim_sd, ranks)
        restore_rng(rng_for_rank(meta, ranks.rank))
        rows = cache_for_rank(tensors, saved, meta, ranks.rank, layout.batch_docs)
        return TrainState.from_meta(meta), ModelCache.from_state_dict({k: v.to(device) for k, v in rows.items()})

    @staticmethod
    def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        """A trained model for inference (eval, generate, verify-equivalence): see `load_checkpoint`."""
        return load_checkpoint(path, device=device, dtype=dtype)


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
        problem = weights_problem(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} cannot be used: {problem}")
        return path
    for folder in (path / "checkpoints", path):  # a run dir, or a checkpoints folder itself
        manager = CheckpointManager(path, keep=1, directory=folder)
        if steps := manager.steps():
            latest = manager.latest_complete(check=weights_problem)
            if latest is None:
                raise CheckpointError(
                    f"{folder} has {len(steps)} checkpoint(s) but none has intact weights (the newest, "
                    f"{steps[-1].name}: {weights_problem(steps[-1])}); give an intact checkpoint folder"
                )
            return latest
    raise CheckpointError(
        f"{path} is neither a checkpoint (no {META}) nor a run dir with checkpoints (no checkpoints/step-XXXXXXXX); "
        "train one with `longtrain fit`"
    )


def weights_problem(path: Path) -> str | None:
    """None if what reading the model needs is intact: its weights, recipe and tokenizer.

    eval, generate, export, inspect and train.init_from read no optimizer state, caches or RNG, so a
    checkpoint whose optimizer.safetensors is damaged still serves them (resuming it does not).
    """
    try:
        listed = Checkpointer.read_meta(path).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if not isinstance(listed, dict):
        return ckpt.validate(path)  # its own words for a missing or broken meta.json
    return ckpt.validate(path, only=[name for name in WEIGHT_FILES if name in listed] or [WEIGHT_FILES[0]])


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
