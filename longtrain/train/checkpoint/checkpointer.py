"""A run's checkpoints as `fit` uses them: which one to resume (`RunCheckpoints`), and the
`Checkpointer` built with the run's stateful parts, which saves them at a step and restores them
from a checkpoint (the format: the package doc)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from longtrain.console import plural
from longtrain.device import machine
from longtrain.path_args import input_folder
from longtrain.train import distributed
from longtrain.train.checkpoint import storage as ckpt
from longtrain.train.checkpoint.loading import checkpoint_files
from longtrain.train.checkpoint.ranks import Layout, cache_for_rank, cache_group, check_layout, rng_for_rank, saved_groups_for
from longtrain.train.checkpoint.rng import capture_rng, restore_rng
from longtrain.train.checkpoint.storage import CheckpointError, CheckpointManager, read_meta, step_of, steps_text
from longtrain.train.distributed import Ranks
from longtrain.train.run_dir import move_aside


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

    def record_validation(self, loss: float, early_stopping=None) -> bool:
        """Count a validation pass's loss: the best so far (and its step) and, with train.early_stopping,
        the passes since the last improvement by more than its min_delta. Returns whether it is a new best."""
        best = self.best_valid_loss
        if early_stopping is not None:
            improved = best is None or loss < best - early_stopping.min_delta
            self.stale_validations = 0 if improved else self.stale_validations + 1
        if best is None or loss < best:
            self.best_valid_loss, self.best_step = loss, self.step
            return True
        return False


def run_hashes(recipe, tokenizer: Tokenizer) -> dict[str, str]:
    """What a checkpoint must match to be resumed: model shape, attention, tokenizer."""
    from longtrain.train.recipe import recipe_hash

    return {
        "model": recipe_hash(recipe, ("model",)),
        "attention": recipe_hash(recipe, ("attention",)),
        # the bytes of RUN_DIR/tokenizer.json, as runs before the Checkpointer hashed them
        "tokenizer": hashlib.sha256(tokenizer.to_str(pretty=True).encode()).hexdigest(),
    }


class RunCheckpoints:
    """The checkpoint folder of one run (the recipe's `checkpoint:` section): which one to resume, what is there."""

    def __init__(self, run_dir: str | Path, cfg) -> None:  # cfg: the recipe's CheckpointConfig
        self.manager = CheckpointManager(run_dir, cfg.keep, directory=cfg.dir)
        self.every = cfg.every

    @property
    def dir(self) -> Path:
        return self.manager.dir

    def to_resume(self, resume: str, *, fork: bool = False) -> Path | None:
        """The checkpoint `--resume` means: auto (newest complete one, if any), never (none) or a PATH.

        A PATH outside this run's checkpoint folder belongs to another run: continuing it here would
        mix the two runs' metrics and let `keep` prune this run's checkpoints, so it needs `fork`
        (this run then starts over from that state, as a new run).
        """
        if resume == "never":
            return None
        if resume == "auto":
            return self.manager.latest_complete()
        # no such path, or a file: the flag cannot work whatever is on disk (exit 2)
        path = input_folder(resume, "{arg} a checkpoint folder (RUN_DIR/checkpoints/step-XXXXXXXX), a run dir, or auto "
                            "or never", arg="resume")
        if not (path / ckpt.META).is_file():  # a run dir (or its checkpoints folder): its newest complete checkpoint
            try:
                path = ckpt.resolve_checkpoint(path)
            except CheckpointError as e:
                raise CheckpointError(f"{resume}: {e}", arg="resume") from None
        problem = ckpt.validate(path)
        if problem:
            raise CheckpointError(f"{resume}: {problem}", arg="resume")
        if not fork and path.resolve().parent != self.dir.resolve():
            raise CheckpointError(
                f"{resume}: this checkpoint belongs to another run (not to {self.dir}); continuing it "
                f"here would mix the two runs' metrics and checkpoints. To start this run from its state as a new "
                f"run (this run's checkpoints and metrics moved aside), add {{fork}}; to continue that run, give "
                f"its own {{run_dir}}; to start from its weights only, --set train.init_from={resume}", arg="resume",
                names=("fork", "run_dir"),
            )
        return path

    def best(self, state: TrainState) -> Path | None:
        """checkpoint.keep_best: the checkpoint of the state's best validation loss, if it is on disk."""
        path = self.manager.path_for(state.best_step) if state.best_step is not None else None
        return path if path is not None and path.is_dir() else None

    def existing(self) -> list[Path]:
        """Checkpoint folders already in the run's checkpoint dir (complete or not)."""
        return self.manager.steps()

    def set_aside_previous(self, resume: str, *, resumed_step: int | None, forked_from: Path | None = None,
                           run_files: list[Path]) -> list[str]:
        """Move aside what the run would otherwise overwrite or mix with; returns what it says about it.

        A fresh start over existing checkpoints moves them (with `--resume never`, the run's `run_files`
        too: metrics and the like); a resume (from `resumed_step`) moves the checkpoints after its
        step, which belong to the future it rewrites; a fork (`forked_from`, at `resumed_step`) moves
        this run's checkpoints and `run_files`.
        """
        old = self.existing()
        if forked_from is not None:  # a new run from another checkpoint's state: nothing of this run's past in its way
            moved = move_aside([self.dir, *run_files], "replaced")
            aside = f"; moved this run's previous files aside to {', '.join(str(new) for _, new in moved)}" if moved else ""
            return [f"--fork: a new run from {forked_from} (step {resumed_step}): its metrics and checkpoints "
                    f"start at step {resumed_step + 1}{aside}"]
        if resumed_step is not None:
            later = [p for p in old if step_of(p) > resumed_step]
            if not later:
                return []
            tag = "unusable" if resume == "auto" else "superseded"  # auto: the newer ones failed their checks
            moved = move_aside(later, tag)
            return [f"moved the checkpoints after step {resumed_step} ({steps_text(later)}) aside, as "
                    f"{', '.join(new.name for _, new in moved)} in {self.dir}"]
        if not old:
            return []
        if resume == "never":
            moved = move_aside([self.dir, *run_files], "replaced")
            where = ", ".join(str(new) for _, new in moved)
            return [f"--resume never: moved the previous run ({plural(len(old), 'checkpoint')}, {steps_text(old)}) aside "
                    f"to {where}; delete them when you no longer need them"]
        moved = move_aside([self.dir], "unusable")  # auto, and none of them is complete
        return [f"warning: no complete checkpoint to resume from; moved the unusable ones ({steps_text(old)}) to {moved[0][1]}"]

    @staticmethod
    def check(path: Path, hashes: dict[str, str], layout: Layout | None = None) -> dict[str, Any]:
        """The checkpoint's meta, after refusing one written for another model, attention or tokenizer,
        or (given this run's `layout`) for another total of rows."""
        meta = read_meta(path)
        ckpt.check_compatible(meta, hashes, path=path)
        if layout is not None:
            check_layout(Layout.from_meta(meta), layout, path=path)
        return meta


class Checkpointer:
    """Saves and restores everything that decides a run's next step, from the run's live parts.

    `state` (TrainState), the model as trained (FSDP sharded, or the LM itself), its optimizer and
    loss scaler, the data stream and the chunk reader holding the per-row caches: `save(step)` writes
    them, `restore(path)` loads a checkpoint into them (the TrainState in place).
    """

    def __init__(
        self, checkpoints: RunCheckpoints, *, state: TrainState, model, optimizer, scaler, stream, reader,
        recipe, corpus, hashes: dict[str, str], ranks: Ranks, layout: Layout, device: torch.device,
        cache_dtype: torch.dtype,
    ) -> None:
        self.checkpoints, self.manager = checkpoints, checkpoints.manager
        self.state, self.model, self.optimizer, self.scaler = state, model, optimizer, scaler
        self.stream, self.reader, self.recipe, self.corpus = stream, reader, recipe, corpus
        self.hashes, self.ranks, self.layout, self.device, self.cache_dtype = hashes, ranks, layout, device, cache_dtype

    def save(self, step: int) -> Path:
        """Checkpoint `step` (the state's) atomically and prune to `keep` (never the best one with
        checkpoint.keep_best); with several ranks every rank calls it. Returns its path."""
        state, ranks = self.state, self.ranks
        state.grad_scaler = self.scaler.state_dict() if self.scaler.is_enabled() else None
        if self.recipe.checkpoint.keep_best and state.best_step is not None:  # pruning never deletes it
            self.manager.protected = {self.manager.path_for(state.best_step).name}
        model_sd, optim_sd = distributed.full_state(self.model, self.optimizer, ranks)  # FSDP: a collective
        tensors = {cache_group(ranks.rank): self.reader.cache.state_dict()}
        meta, files = {}, None
        if ranks.is_main:
            opt_tensors, opt_info = ckpt.optimizer_to_checkpoint(optim_sd)
            tensors |= {"model": model_sd, "optimizer": opt_tensors}
            meta = {
                "step": step,
                "tokens": state.tokens,
                "best_valid_loss": state.best_valid_loss,
                **({"best_step": state.best_step} if state.best_step is not None else {}),
                **({"stale_validations": state.stale_validations} if state.stale_validations else {}),
                **({"grad_scaler": state.grad_scaler} if state.grad_scaler else {}),
                **({"imported_from": state.imported_from} if state.imported_from else {}),
                "data_stream": self.stream.state_dict(),  # every row's, the same on every rank
                "layout": self.layout.to_meta(),
                "corpus": self.corpus.fingerprint,
                "optimizer": opt_info,
                "hashes": self.hashes,
                "machine": machine(self.device, ranks.world_size),  # what decides the rounding: longtrain.device
            }
            files = checkpoint_files(self.recipe, self.corpus.tokenizer)  # self-contained
        return self.manager.save(step, tensors=tensors, meta=meta, files=files, rank_meta={"rng": capture_rng()},
                                 ranks=ranks)

    def restore(self, path: Path) -> TrainState:
        """Load a checkpoint into the live parts; returns the TrainState (updated in place).

        Everything is checked (hashes, the layout of rows, shapes, the data stream) before the model
        or optimizer changes, and nothing is written: a refused resume leaves the run as it was.
        With several ranks, rank 0 reads the model and optimizer and hands them to the others
        (FSDP: each keeps its shard); each rank reads the caches of its own rows.
        """
        from longtrain.model import ModelCache

        ranks, layout = self.ranks, self.layout
        meta = read_meta(path)
        ckpt.check_compatible(meta, self.hashes, path=path)
        saved = Layout.from_meta(meta)
        check_layout(saved, layout, path=path)
        groups = saved_groups_for(saved, meta, ranks.rank, layout.batch_docs)
        reads_model = ranks.is_main or not ranks.active  # with a process group, rank 0 reads for all
        tensors, meta = ckpt.load(path, groups + (["model", "optimizer"] if reads_model else []))

        def check_model() -> None:
            ckpt.check_shapes(tensors["model"], self.model.state_dict())

        distributed.on_main(check_model, ranks)  # a refusal stops every rank alike
        self.stream.load_state_dict(meta["data_stream"])
        optim_sd = ckpt.optimizer_from_checkpoint(tensors["optimizer"], meta["optimizer"]) if reads_model else None
        distributed.load_full_state(self.model, self.optimizer, tensors.get("model"), optim_sd, ranks)
        restore_rng(rng_for_rank(meta, ranks.rank))
        rows = cache_for_rank(tensors, saved, meta, ranks.rank, layout.batch_docs)
        cache = ModelCache.from_state_dict({k: v.to(self.device) for k, v in rows.items()})
        self.reader.cache = cache.with_kv_dtype(self.cache_dtype)  # older checkpoints kept a float32 cache
        loaded = TrainState.from_meta(meta)
        for f in fields(TrainState):
            setattr(self.state, f.name, getattr(loaded, f.name))
        if self.state.grad_scaler and self.scaler.is_enabled():
            self.scaler.load_state_dict(self.state.grad_scaler)
        return self.state
