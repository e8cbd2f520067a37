"""Path arguments checked before any work: a folder to read (a checkpoint, a run dir), a file to read.

The split follows longtrain.errors: a path that does not exist, or is a file where a folder is wanted (or
a folder where a file is), cannot work whatever else is on disk, so it is a UsageError (exit 2; every verb
checks it here, with `input_folder` or `input_file`, so they all say it alike); an existing folder that holds
no usable checkpoint is a CheckpointError (exit 1, from `resolve_checkpoint`, which `load_checkpoint` calls:
it says what is missing and how to get it).

`eval`, `generate`, `inspect`, `export`, `verify-equivalence`, `import`, `plot`, `clean`, fit's `--resume` and
`longtrain.load` use these; other verbs can too.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from longtrain.errors import LongtrainError, UsageError

CHECKPOINT_FORMS = "a checkpoint folder (…/checkpoints/step-XXXXXXXX) or a run dir"


def _did_you_mean(path: Path, *, folders: bool) -> str:
    """"; did you mean X?" when the path's folder holds a near name (a typo), else ""."""
    try:
        names = [p.name for p in path.parent.iterdir() if p.is_dir() == folders] if path.parent.is_dir() else []
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.8)
    return f"; did you mean {path.parent / close[0]}?" if close else ""


def input_folder(path: str | Path, give: str, *, prefix: str = "", arg: str | None = None,
                 error: type[UsageError] = UsageError, file_fix: str | None = None, then: str = "") -> Path:
    """`path` (expanded) if it is a folder to read; else `error` (a UsageError: exit 2) saying it does not exist (and
    its folder neither, or a near name there) or is a file, then "give GIVE" (`file_fix` instead, for a file), then
    `then`. `prefix` goes before the path ("checkpoint "); `arg` is the argument the message is about (GIVE may say
    where its flag goes as `{arg}`). What the folder holds is the caller's to check (an existing folder that cannot
    be used is about what is on disk: exit 1)."""
    path = Path(path).expanduser()
    if not path.exists():
        where = "" if path.parent.is_dir() else f" (nor does its folder {path.parent})"
        raise error(f"{prefix}{path} does not exist{where}: give {give}{_did_you_mean(path, folders=True)}{then}", arg=arg)
    if not path.is_dir():
        raise error(f"{prefix}{path} is a file, not a folder: {file_fix or 'give ' + give}{then}", arg=arg)
    return path


def checkpoint_arg(path: str | Path, arg: str | None = None) -> Path:
    """`path` as a checkpoint argument, checked in a moment, before anything is read: UsageError (exit 2) when
    it does not exist or is a file (`arg`: the argument's name, where the message says which to fix). Whether the
    folder holds a checkpoint is `resolve_checkpoint`'s (and so `load_checkpoint`'s) to say: a CheckpointError
    (exit 1) naming what is missing. That check reads (hashes) the weights, so it is left to them, to run once.
    """
    from longtrain.train.checkpoint.storage import META

    path = Path(path).expanduser()
    inside = path.parent if path.is_file() and (path.parent / META).is_file() else None
    return input_folder(path, ("{arg} " if arg else "") + CHECKPOINT_FORMS, prefix="checkpoint ", arg=arg,
                        file_fix=f"give its checkpoint folder {inside}" if inside else None)


def input_file(path: Path, arg: str, what: str = "a text file") -> Path:
    """`path` (the argument `arg`) if it names something to read: UsageError for a folder or a missing path.
    Not only regular files: /dev/stdin and named pipes are read as well."""
    if path.is_dir():
        raise UsageError(f"{path} is a folder, not a file: give {what}", arg=arg)
    if not path.exists():
        raise UsageError(f"{path}: no such file; give {what}" + _did_you_mean(path, folders=False), arg=arg)
    return path


def read_bytes(path: Path, arg: str, limit: int | None = None) -> bytes:
    """The bytes of an existing input file (at most `limit`); one that cannot be read (no permission, a
    device error) is a LongtrainError (exit 1) naming the reason."""
    try:
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit)
    except OSError as e:
        raise LongtrainError(f"{path} cannot be read ({e.strerror or e}); check its permissions", arg=arg) from None
