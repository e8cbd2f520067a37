"""`longtrain fit`: train or fine-tune from a recipe."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from longtrain.cli.app import app, fail


@app.command("fit")
def fit(
    recipe: str = typer.Argument(
        None, help="recipe YAML file or built-in name (default: quickstart)", show_default=False
    ),
    run_dir: Path = typer.Option(None, "--run-dir", help="run directory (default: runs/<recipe name>)"),
    overrides: list[str] = typer.Option([], "--set", help="override a recipe key: --set train.lr=3e-4 (repeatable)"),
    resume: str = typer.Option("auto", "--resume", help="auto (newest complete checkpoint, if any) | never (start over; deletes this run's checkpoints) | PATH to a checkpoint directory"),
) -> None:
    """Train or fine-tune on long documents, chunk by chunk, resumable from checkpoints."""
    from longtrain.data import DataError
    from longtrain.train.checkpoint import CheckpointError
    from longtrain.train.recipe import RecipeError, load_recipe
    from longtrain.train.trainer import TrainingError, fit as run_fit

    try:
        r = load_recipe(recipe, overrides)
        result = run_fit(r, run_dir=run_dir, resume=resume)
    except (RecipeError, DataError, CheckpointError, TrainingError) as e:
        raise fail(str(e), 2 if isinstance(e, RecipeError) else 1)
    out = Console(soft_wrap=True)
    done = "stopped early (signal)" if result.interrupted else "done"
    best = f", best validation loss {result.best_valid_loss:.4f}" if result.best_valid_loss is not None else ""
    final = f", final validation loss {result.final_valid_loss:.4f}" if result.final_valid_loss is not None else ""
    out.print(
        f"{done}: {result.steps} steps, {result.tokens:,} tokens in {result.seconds:.1f} s "
        f"({result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s); last loss {result.last_loss:.4f}{final}{best}"
    )
    if result.checkpoint:
        out.print(f"checkpoint: {result.checkpoint}")
