"""The `longtrain` command line: one thin function per verb."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="longtrain",
    help="Train language models on long documents with SparseK attention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command("version")
def version() -> None:
    """Print the longtrain version."""
    from longtrain import __version__

    typer.echo(__version__)


if __name__ == "__main__":
    app()
