"""The typer app that every verb module registers itself on."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    name="longtrain",
    help="Train language models on long documents with SparseK attention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` on stderr; `raise fail(...)` exits with `code` (2: bad usage)."""
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)
