"""Storage of checkpoints: atomic writes, checks on read, finding and pruning (the format: the package doc)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from longtrain.errors import CheckpointError  # noqa: F401  (raised here; defined with the others)
from longtrain.train.distributed import Ranks, broadcast_object, gather_objects

META = "meta.json"
RECIPE_FILE = "recipe.yaml"  # the resolved recipe, in a checkpoint and in its run dir
TOKENIZER_FILE = "tokenizer.json"
WEIGHT_FILES = ("model.safetensors", RECIPE_FILE, TOKENIZER_FILE)  # what reading a model needs of a checkpoint
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt or incomplete); an older one is used."""


class CheckpointManager:
    """Saves, finds, validates, loads and prunes the checkpoints of one run."""

    def __init__(self, run_dir: str | Path, keep: int, *, directory: str | Path | None = None):
        self.dir = Path(directory) if directory is not None else Path(run_dir) / "checkpoints"
        self.keep = keep
        self.protected: set[str] = set()  # checkpoint folder names prune never deletes

    def path_for(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}"

    def save(
        self,
        step: int,
        *,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        meta: Mapping[str, Any],
        files: Mapping[str, bytes] | None = None,
        rank_meta: Mapping[str, Any] | None = None,
        ranks: Ranks | None = None,
    ) -> Path:
        """Write checkpoint `step` atomically, then prune to the newest `keep`.

        With keep ≥ 2 the oldest are deleted first, down to keep − 1, so a save needs room for `keep`
        checkpoints (keep = 1: two, the old one goes once the new one is complete).

        `files` are extra files by name (the recipe, the tokenizer), checked like the tensors.
        With `ranks` (several processes) every rank calls save with its own tensor groups, under
        names no other rank uses, and its `rank_meta`; rank 0's `meta` is the checkpoint's, with
        every rank's `rank_meta` in rank order under "ranks". Every rank returns the final path.
        """
        main = ranks is None or ranks.is_main
        final = self.path_for(step)
        tmp, error = None, None
        if main:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self.clean_stale()
                if self.keep > 1:  # room first: the oldest goes before the new one is written (keep − 1 stay)
                    self.prune(self.keep - 1, besides=final)
                tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
                tmp.mkdir()
            except OSError as e:
                error = _why(e)
        tmp, error = broadcast_object((tmp, error))
        if error is not None:
            raise CheckpointError(f"could not save checkpoint {final}: {error}; the previous checkpoints are intact")

        written, error = {}, None
        try:
            for group, state in tensors.items():
                written[f"{group}.safetensors"] = _write_file(tmp / f"{group}.safetensors", st_save(_storable(state)))
            for name, data in (files or {}).items():
                written[name] = _write_file(tmp / name, data)
        except OSError as e:
            error = _why(e)
        except BaseException:  # e.g. Ctrl-C during the save (several ranks: the launcher stops them all)
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        _test_only_kill_in_save(step, 0 if ranks is None else ranks.rank)
        parts = gather_objects({"files": written, "meta": rank_meta, "error": error})

        failure: str | None = None  # why the save failed, as every rank learns it
        if main:
            try:
                failure = self._commit(step, tmp, final, meta, parts, with_ranks=rank_meta is not None)
            except BaseException:  # e.g. meta that is not JSON
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        failure = broadcast_object(failure)
        if failure is not None:
            raise CheckpointError(f"could not save checkpoint {final}: {failure}; the previous checkpoints are intact")
        if main:
            self.prune()
        return final

    def _commit(self, step: int, tmp: Path, final: Path, meta, parts: list[dict], *, with_ranks: bool) -> str | None:
        """Rank 0, once every rank has written: meta.json, then the rename that makes it a checkpoint.

        Returns None, or why it failed (the temporary directory is then gone).
        """
        failed = [f"rank {r}: {p['error']}" if len(parts) > 1 else p["error"] for r, p in enumerate(parts) if p["error"]]
        if failed:
            shutil.rmtree(tmp, ignore_errors=True)
            return "; ".join(failed)
        written: dict[str, Any] = {}
        for part in parts:
            clash = written.keys() & part["files"].keys()
            if clash:  # two ranks wrote the same file: a caller's bug, never a silent overwrite
                raise CheckpointError(f"ranks wrote the same checkpoint files: {sorted(clash)}")
            written.update(part["files"])
        record = {**meta, "step": step, "format": FORMAT, "files": written}
        if with_ranks:
            record["ranks"] = [p["meta"] for p in parts]
        try:
            _write_file(tmp / META, json.dumps(record, indent=1).encode())
            _fsync_dir(tmp)
            if final.exists():  # saving the same step twice (e.g. final == periodic)
                old = self.dir / f".tmp-old-{final.name}-{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.dir)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            return _why(e)
        return None

    def steps(self) -> list[Path]:
        """Checkpoint directories carrying a final name, oldest first (not yet validated)."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
        return sorted(found, key=lambda p: p.name)

    def latest_complete(self, check=None) -> Path | None:
        """The newest checkpoint that validates (`check(path)` -> problem or None; default `validate`);
        corrupt ones are skipped with a warning."""
        for path in reversed(self.steps()):
            problem = (check or validate)(path)
            if problem is None:
                return path
            warnings.warn(f"skipping checkpoint {path}: {problem}", CheckpointWarning, stacklevel=2)
        return None

    def load(
        self, path: str | Path, groups: Iterable[str] | None = None
    ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        return load(path, groups)

    def prune(self, keep: int | None = None, *, besides: Path | None = None) -> None:
        """Delete the oldest checkpoints beyond `keep` (default self.keep), not counting `besides` (the one
        about to be written, a step saved twice); the `protected` ones (checkpoint.keep_best) stay and do not count."""
        keep = self.keep if keep is None else keep
        for path in [p for p in self.steps() if p.name not in self.protected and p != besides][: -keep]:
            shutil.rmtree(path, ignore_errors=True)

    def clean_stale(self) -> None:
        """Remove temporary directories left by a save that was killed."""
        if self.dir.is_dir():
            for path in self.dir.glob(".tmp-*"):
                shutil.rmtree(path, ignore_errors=True)


def validate(path: str | Path, only: Iterable[str] | None = None) -> str | None:
    """None if the checkpoint at `path` is complete and intact, else what is wrong.

    `only` checks just those of its files (a rank reading its own part of a checkpoint that
    rank 0 validated whole).
    """
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        return f"{META} is missing"
    except (OSError, ValueError) as e:
        return f"{META} is unreadable ({e})"
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict):
        return f"{META} lists no files"
    if only is not None:
        only = set(only)
        if missing := sorted(only - files.keys()):
            return f"{META} does not list {', '.join(missing)}"
    for name, want in files.items():
        if only is not None and name not in only:
            continue
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want["bytes"]:
            return f"{name} is truncated or altered ({file.stat().st_size} bytes, expected {want['bytes']})"
        if _sha256(file.read_bytes()) != want["sha256"]:
            return f"{name} is corrupt (sha256 mismatch)"
    return None


def load(
    path: str | Path, groups: Iterable[str] | None = None
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """The tensor groups (all, or those named) and meta of a checkpoint, after validating what is read."""
    path = Path(path)
    names = None if groups is None else [f"{g}.safetensors" for g in groups]
    problem = validate(path, only=names)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} cannot be used: {problem}")
    meta = json.loads((path / META).read_text())
    tensors = {
        name.removesuffix(".safetensors"): st_load((path / name).read_bytes())
        for name in (names if names is not None else meta["files"])
        if name.endswith(".safetensors")
    }
    return tensors, meta


# ------------------------------------------------------------ compatibility

_WHAT = {"model": "model shape", "attention": "attention settings", "tokenizer": "tokenizer"}


def check_compatible(meta: Mapping[str, Any], hashes: Mapping[str, str], *, path: str | Path = "") -> None:
    """Refuse to resume from a checkpoint whose recorded hashes differ from ours.

    `hashes` maps a part (model, attention, tokenizer, ...) to the hash of the
    current run's version of it; meta["hashes"] holds the checkpoint's.
    """
    if "hashes" not in meta and "imported_from" in meta:
        run = Path(path).parent.parent
        raise CheckpointError(
            f"checkpoint {path} holds imported weights only (`longtrain import`): there is no run to resume. "
            f"Fine-tune it in another run dir: --set train.init_from={run} with {{run_dir}} SOMEWHERE_ELSE", names=("run_dir",)
        )
    saved = meta.get("hashes", {})
    differ = [key for key, value in hashes.items() if saved.get(key) != value]
    if differ:
        what = " and ".join(_WHAT.get(key, key) for key in differ)
        raise CheckpointError(
            f"checkpoint {path} does not match this recipe's {what}; refusing to resume. Start a fresh "
            "run with `{resume} never` (it moves this run's checkpoints and metrics aside, as "
            "`longtrain fit -h` says) or choose another `{run_dir}`.", names=("resume", "run_dir"),
        )


def check_shapes(saved: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, what: str = "model") -> None:
    """Refuse tensors whose names or shapes differ from the live state dict."""
    problems = [f"{k} is missing" for k in expected if k not in saved]
    problems += [f"{k} is unexpected" for k in saved if k not in expected]
    problems += [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs {what} {tuple(v.shape)}"
        for k, v in expected.items()
        if k in saved and saved[k].shape != v.shape
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {what} state does not fit this {what}: {shown}")


# ------------------------------------------------------------ optimizer state


def optimizer_to_checkpoint(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state_dict into tensors (`state.<param>.<name>`) and JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, state in state_dict["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = value
            else:
                scalars.setdefault(str(pid), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_from_checkpoint(tensors: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of optimizer_to_checkpoint: a state_dict for Optimizer.load_state_dict."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for pid, values in info["scalars"].items():
        state.setdefault(int(pid), {}).update(values)
    return {"state": state, "param_groups": [dict(g) for g in info["param_groups"]]}


# ------------------------------------------------------------ writing


def _write_file(path: Path, data: bytes) -> dict[str, Any]:
    """Write and fsync one file; returns the record that validate() checks."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": _sha256(data)}


def _why(e: OSError) -> str:
    return "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))


def _test_only_kill_in_save(step: int, rank: int) -> None:
    """Tests kill a rank mid-save: SIGKILL once its files are written, before rank 0 commits.

    `LONGTRAIN_TEST_KILL_IN_SAVE=STEP:RANK` (set by tests only).
    """
    if os.environ.get("LONGTRAIN_TEST_KILL_IN_SAVE") == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _storable(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors; safetensors refuses shared storage (tied weights), so copy those."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out


# ------------------------------------------------------------ finding one


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


def read_meta(path: str | Path) -> dict[str, Any]:
    """A validated checkpoint's meta.json (step, tokens, hashes, ...) without loading tensors."""
    return json.loads((Path(path) / META).read_text())


def weights_problem(path: Path) -> str | None:
    """None if what reading the model needs is intact: its weights, recipe and tokenizer.

    eval, generate, export, inspect and train.init_from read no optimizer state, caches or RNG, so a
    checkpoint whose optimizer.safetensors is damaged still serves them (resuming it does not).
    """
    try:
        listed = read_meta(path).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if not isinstance(listed, dict):
        return validate(path)  # its own words for a missing or broken meta.json
    return validate(path, only=[name for name in WEIGHT_FILES if name in listed] or [WEIGHT_FILES[0]])


def beside(path: Path, name: str) -> Path | None:
    """`name` in the checkpoint, else in the run dir of an older checkpoint; None if neither."""
    for candidate in (path / name, path.parent.parent / name):
        if candidate.is_file():
            return candidate
    return None


def step_of(checkpoint: Path) -> int:
    """The step of a checkpoint folder `step-XXXXXXXX`."""
    return int(checkpoint.name.removeprefix("step-"))


def steps_text(checkpoints: list[Path]) -> str:
    """'step 4' or 'steps 2–8': the steps of a list of checkpoints, oldest first."""
    first, last = step_of(checkpoints[0]), step_of(checkpoints[-1])
    return f"steps {first}–{last}" if len(checkpoints) > 1 else f"step {first}"
