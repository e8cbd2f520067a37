"""The run directory's safety: one `fit` at a time, and nothing deleted without a word.

`RunLock` takes an exclusive `flock` on the run directory itself (not on a file in it, which a
holder could delete under a waiting process) and writes `RUN_DIR/.lock` naming its process, for
the message a second `fit` prints. The kernel drops a flock when its process dies, SIGKILL
included, so a killed run never leaves the directory locked; a stale `.lock` file left behind
is only information and is overwritten by the next holder (and removed when a holder exits).

`move_aside` renames files a run would otherwise overwrite or delete (old checkpoints, old
metrics) to `<name>.<tag>-<time>`, beside themselves; `set_aside` finds them again (the run's summary
lists them and `longtrain clean` deletes them).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import sys
import time
from pathlib import Path

from longtrain.errors import RunDirBusy, RunDirWriteError, UsageError  # noqa: F401  (raised here; defined with the others)

LOCK_FILE = ".lock"
ASIDE_TAGS = ("replaced", "superseded", "unusable")  # --resume never; --resume PATH; checkpoints failing their checks
_ASIDE = re.compile(r"\.(?:" + "|".join(ASIDE_TAGS) + r")-(\d{8}-\d{6})$")


def os_error_words(e: OSError) -> str:
    return "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))


def write_atomically(path: Path, text: str, *, why: str) -> None:
    """Replace `path` with `text` through a temporary file beside it: on failure (a full disk) `path`
    is as it was, no temporary file stays, and RunDirWriteError says what to do."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunDirWriteError(
            f"could not write {path} ({why}): {os_error_words(e)}. It is unchanged; free some space "
            "(or choose another {run_dir}) and rerun the same command", names=("run_dir",)
        ) from None


def not_a_folder(path: Path) -> Path | None:
    """The part of `path` (itself or the nearest existing folder above it) that exists but is not a
    folder, so `path` cannot be (or be made) a folder; None when it can."""
    for part in (path, *path.parents):
        if part.exists():
            return None if part.is_dir() else part
        if part.is_symlink():  # a dangling link: mkdir would fail on it
            return part
    return None


def check_run_folders(run_dir: Path, checkpoint_dir: Path, custom_checkpoint_dir: bool) -> None:
    """Refuse a run dir (or checkpoint folder) that a file stands in the way of, before anything is written."""

    def problem(folder: Path, bad: Path) -> str:
        kind = "a broken link" if bad.is_symlink() and not bad.exists() else "a file"
        return f"is {kind}, not a folder" if bad == folder else f"cannot be made: {bad} is {kind}, not a folder"

    if (bad := not_a_folder(run_dir)) is not None:
        raise UsageError(f"run dir {run_dir} {problem(run_dir, bad)}; choose another {{run_dir}} (a new folder, or "
                         "this run's)", names=("run_dir",))
    if (bad := not_a_folder(checkpoint_dir)) is not None:
        fix = ("set checkpoint.dir to a folder (--set checkpoint.dir=DIR)" if custom_checkpoint_dir
               else "move it away, or choose another {run_dir}")
        raise UsageError(f"checkpoint folder {checkpoint_dir} {problem(checkpoint_dir, bad)}; {fix}", names=("run_dir",))


class RunLock:
    """`with RunLock(run_dir):` holds the run directory (creating it) or raises RunDirBusy."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None
        self._created: Path | None = None

    def __enter__(self) -> RunLock:
        # the outermost folder this lock makes (run_dir or a parent of it), removed again if the run leaves it empty
        self._created = next((p for p in reversed((self.run_dir, *self.run_dir.parents)) if not p.exists()), None)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # e.g. no permission, a read-only or virtual file system
            raise UsageError(f"run dir {self.run_dir} cannot be made: {os_error_words(e)}; choose another {{run_dir}}",
                             names=("run_dir",)) from None
        fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirBusy(self.run_dir, self._holder()) from None
        self._fd = fd
        info = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}\n"
        (self.run_dir / LOCK_FILE).write_text(info)
        return self

    def __exit__(self, *exc: object) -> None:
        (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None
        if self._created is not None:  # a run that never started leaves no trace (nor the runs/ folder it made)
            for folder in (self.run_dir, *self.run_dir.parents):
                if any(folder.iterdir()):
                    break
                folder.rmdir()
                if folder == self._created:
                    break

    def _holder(self) -> str:
        try:
            text = (self.run_dir / LOCK_FILE).read_text().strip()
        except OSError:
            text = ""
        return f"process {text}" if text else "another process (it has not written its pid yet)"


def run_dir_holder(run_dir: str | Path) -> str | None:
    """Who holds the run dir's lock now (as RunDirBusy names it), or None: free, or no run dir yet. Takes the
    lock for a moment only when it is free, so it changes nothing (`fit --dry-run` says what `fit` would meet)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return RunLock(run_dir)._holder()
    finally:
        os.close(fd)  # releases the flock if it was taken
    return None


def move_aside(paths: list[Path], tag: str) -> list[tuple[Path, Path]]:
    """Rename each existing path to `<name>.<tag>-<time>` beside it; returns (old, new) pairs."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for path in paths:
        if path.exists():
            new = path.with_name(f"{path.name}.{tag}-{stamp}")
            path.rename(new)
            moved.append((path, new))
    return moved


def set_aside(run_dir: str | Path, checkpoint_dir: str | Path | None = None) -> list[Path]:
    """What `move_aside` left in a run: `<name>.<tag>-<time>` in the run dir, its checkpoint folder and
    (a custom checkpoint.dir) beside that folder; oldest first. Nothing else ever matches."""
    places = {Path(run_dir), Path(run_dir) / "checkpoints"}
    if checkpoint_dir is not None:
        places |= {Path(checkpoint_dir), Path(checkpoint_dir).parent}
    found = {p for d in places if d.is_dir() for p in d.iterdir() if _ASIDE.search(p.name)}
    return sorted(found, key=lambda p: (_ASIDE.search(p.name).group(1), str(p)))
