"""`longtrain version`."""

from __future__ import annotations

import typer

from longtrain.cli.app import app


@app.command("version")
def version() -> None:
    """Print the longtrain version."""
    from longtrain import __version__

    typer.echo(__version__)
