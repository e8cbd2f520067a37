"""`longtrain plot`: loss and validation curves of one or several runs, as a picture."""

from __future__ import annotations

from pathlib import Path

import typer

from longtrain.cli.app import app


@app.command("plot")
def plot(
    run_dirs: list[Path] = typer.Argument(..., help="run directories (each with its metrics.jsonl)", show_default=False),
    out: Path = typer.Option(Path("loss.png"), "--out", "-o", help="the picture to write (.png, .pdf or .svg)"),
    x: str = typer.Option("tokens", "--x", help="x axis: tokens (runs of different batch sizes line up) | step"),
) -> None:
    """Draw training and validation loss curves of runs, side by side, into one picture."""
    from longtrain.train.plot import plot_runs

    written = plot_runs(run_dirs, out, x=x)
    typer.echo(f"wrote {written}")
