"""`longtrain clean RUN`: list, then delete, what earlier runs moved aside in a run dir."""

from __future__ import annotations

from pathlib import Path

import typer

from longtrain.cli.app import app, fail
from longtrain.errors import UsageError

RUN_DIR = "a run directory written by `longtrain fit` (runs/NAME)"


@app.command("clean")
def clean(
    run_dir: Path = typer.Argument(..., help="a run directory"),
    delete: bool = typer.Option(False, "--delete", help="delete them (without it, only list them)"),
) -> None:
    """List what `fit` moved aside in RUN (old runs replaced by --resume never, checkpoints superseded by
    --resume PATH or unusable); with --delete, delete exactly those. The live run is never touched."""
    from longtrain.data.cache import disk_size
    from longtrain.path_args import input_folder
    from longtrain.train.metrics import gib
    from longtrain.train.run_dir import RunDirBusy, RunLock, set_aside

    input_folder(run_dir, RUN_DIR)  # no such path, or a file: exit 2
    if not _is_run_dir(run_dir):  # another folder's `name.replaced-…` files are none of clean's business
        raise UsageError(f"{run_dir} is not a longtrain run directory (it has no {', '.join(_run_files())}); give "
                         f"{RUN_DIR}. Nothing was deleted")
    aside = set_aside(run_dir, _checkpoint_dir(run_dir))
    if not aside:
        typer.echo(f"{run_dir}: nothing was moved aside, nothing to clean")
        return
    sizes = [disk_size(p) for p in aside]
    for path, size in zip(aside, sizes):
        typer.echo(f"{gib(size):>9}  {path}")
    total = f"{len(aside)} moved-aside item{'s' if len(aside) != 1 else ''} ({gib(sum(sizes))})"
    if not delete:
        typer.echo(f"{total}; nothing deleted: `longtrain clean {run_dir} --delete` deletes them")
        return
    import shutil

    try:
        with RunLock(run_dir):  # no fit is running in it (a running one would hold it)
            for path in aside:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
    except RunDirBusy as e:
        raise fail(f"run dir {e.run_dir} is in use by {e.holder}; wait for it to finish (or stop it: Ctrl-C saves a "
                   "checkpoint); nothing was deleted", 1)
    typer.echo(f"deleted {total}")


def _run_files() -> tuple[str, ...]:
    """What `fit` writes in every run dir it runs in: the resolved recipe (when a run starts; never moved aside),
    the checkpoints folder and the metrics."""
    from longtrain.train.checkpoint.storage import RECIPE_FILE
    from longtrain.train.metrics import METRICS_FILE

    return (RECIPE_FILE, "checkpoints", METRICS_FILE)


def _is_run_dir(folder: Path) -> bool:
    """`fit` has run in `folder`."""
    return any((folder / name).exists() for name in _run_files())


def _checkpoint_dir(run_dir: Path) -> Path | None:
    """The run's checkpoint.dir from its recipe.yaml when it sets one (None: RUN/checkpoints)."""
    import yaml

    from longtrain.train.checkpoint import RECIPE_FILE

    try:
        recipe = yaml.safe_load((run_dir / RECIPE_FILE).read_text()) or {}
        folder = (recipe.get("checkpoint") or {}).get("dir")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return Path(folder) if folder else None
