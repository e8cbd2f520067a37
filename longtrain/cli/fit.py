"""`longtrain fit`: train or fine-tune from a recipe."""

from __future__ import annotations

from pathlib import Path

import typer

from longtrain.cli.app import app, fail, message


@app.command("fit")
def fit(
    ctx: typer.Context,
    recipe: str = typer.Argument(
        None, show_default=False,
        help="recipe YAML file or built-in name (default: the --run-dir's own recipe when it holds a run, else quickstart; "
             "see `longtrain recipes`)",
    ),
    run_dir: Path = typer.Option(None, "--run-dir", help="run directory (default: runs/<recipe name>)"),
    overrides: list[str] = typer.Option([], "--set", help="override a recipe key: --set train.lr=3e-4 (repeatable)"),
    resume: str = typer.Option(
        "auto", "--resume",
        help="auto (newest complete checkpoint, if any) | never (start over; the old checkpoints and metrics are "
        "moved aside, not deleted) | PATH to a checkpoint directory of this run",
    ),
    fork: bool = typer.Option(
        False, "--fork", help="with --resume PATH: start this run afresh from that checkpoint's state (another "
        "run's, too); this run's old checkpoints and metrics are moved aside",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="print the resolved recipe, model size, KV budget, tokens per step, data and what "
        "fit would do, then exit without writing to the run dir",
    ),
) -> None:
    """Train or fine-tune on long documents, chunk by chunk, resumable from checkpoints.

    Exit codes: 0 finished, 1 failed, 2 bad recipe or flags, 130/143 stopped by SIGINT/SIGTERM after saving (the same command resumes).
    """
    from longtrain.console import make_console
    from longtrain.errors import LongtrainError
    from longtrain.train.init import load_fit_recipe
    from longtrain.train.trainer import Trainer

    out = make_console()
    if fork and resume in ("auto", "never"):
        raise fail(f"--fork starts a new run from a checkpoint's state: give the checkpoint as --resume PATH "
                   f"(not --resume {resume})", 2)
    try:
        recipe = run_recipe(recipe, run_dir, out)
        trainer = Trainer(load_fit_recipe(recipe, overrides), run_dir=run_dir, resume=resume, fork=fork, console=out)
        if dry_run:
            for line in trainer.dry_run():
                out.print(line, markup=False)
            return
        result = trainer.train()
    except LongtrainError as e:  # as cli.app maps it, with the rank in front under torchrun
        raise fail(rank_message(message(e, ctx.command)), e.exit_code)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, no save
        raise fail(rank_message("interrupted again: stopped without saving; the last checkpoint is unchanged"), 130)

    if trainer.ranks.is_main:  # under torchrun, rank 0 speaks for the run
        for line in summary_lines(result, trainer.recipe.train.steps):
            out.print(line, markup=False)
    raise typer.Exit(result.exit_code)


def rank_message(text: str) -> str:
    """Under torchrun every rank reports its own error, its rank first."""
    from longtrain.train.distributed import launch_env, rank_message

    return rank_message(launch_env(), text)


def run_recipe(recipe: str | None, run_dir: Path | None, out) -> str | Path | None:
    """No RECIPE, and a --run-dir that holds a run: that run's own recipe (its recipe.yaml), so that resuming goes on
    as the run was set (its steps, schedule, data), not as quickstart (the default for a new run) would."""
    from longtrain.train.checkpoint import RECIPE_FILE

    if recipe is None and run_dir is not None and (run_dir / RECIPE_FILE).is_file():
        out.print(f"recipe: {run_dir / RECIPE_FILE} (the run's own; give RECIPE to train another)", markup=False)
        return run_dir / RECIPE_FILE
    return recipe


def summary_lines(result, train_steps: int | None = None) -> list[str]:
    """The closing lines: what this session did (not the whole run's tokens over this session's time); train_steps:
    the recipe's train.steps (a run already past it says so)."""
    import signal

    if result.session_steps == 0 and result.out_of_patience:
        return [
            f"already stopped early at step {result.steps}: {result.out_of_patience}. Raise "
            "train.early_stopping.patience to train further, or start over with --resume never.",
            f"checkpoint: {result.checkpoint}",
        ] + ([f"best checkpoint: {result.best_checkpoint}"] if result.best_checkpoint else [])
    if result.session_steps == 0 and result.stopped_by is None:
        steps = result.steps if train_steps is None else train_steps
        return [
            f"already {'finished' if steps == result.steps else 'past train.steps'} at step {result.steps} (train.steps "
            f"is {steps}): nothing to do. Raise it to train further (--set train.steps=N), or start over with --resume never.",
            f"checkpoint: {result.checkpoint}",
        ]
    rate = result.session_tokens / result.train_seconds if result.train_seconds > 0 else 0.0
    other = result.seconds - result.train_seconds
    how = f"stopped by {signal.Signals(result.stopped_by).name} after saving" if result.stopped_by else "done"
    if result.out_of_patience and not result.stopped_by:
        how = "stopped early (train.early_stopping)"
    span = f"steps {result.start_step + 1}–{result.steps}" if result.session_steps > 1 else f"step {result.steps}"
    resumed = f" (resumed at step {result.start_step})" if result.start_step else ""
    if result.forked_from is not None:
        resumed = f" (a new run forked from {result.forked_from} at step {result.start_step})"
    loss = f"; last loss {result.last_loss:.4f}" if result.last_loss is not None else ""
    final = f", final validation loss {result.final_valid_loss:.4f}" if result.final_valid_loss is not None else ""
    best = f", best {result.best_valid_loss:.4f}" if result.best_valid_loss is not None else ""
    # validation only where this session validated (a final validation loss): not with train.valid_every 0, no
    # validation documents, or a session shorter than train.valid_every
    rest = "validation, checkpoints and logging" if result.final_valid_loss is not None else "checkpoints and logging"
    lines = [
        f"{how}: {span}{resumed}, {result.session_tokens:,} tokens in {result.seconds:.1f} s "
        f"({rate:,.0f} tokens/s over {result.train_seconds:.1f} s of training; {other:.1f} s in {rest}){loss}{final}{best}"
    ]
    if result.checkpoint:
        lines.append(f"checkpoint: {result.checkpoint}")
    if result.best_checkpoint:
        lines.append(f"best checkpoint: {result.best_checkpoint} (validation loss {result.best_valid_loss:.4f}; checkpoint.keep_best)")
    if result.out_of_patience and not result.stopped_by:
        lines.append(f"early stopping: {result.out_of_patience}")
    if result.stopped_by:
        lines.append(f"exit {result.exit_code}: the run is not finished; the same command resumes it")
    return lines
