"""The typer app that every verb module registers itself on."""

from __future__ import annotations

import typer
from rich.markup import escape

from longtrain.console import make_console

app = typer.Typer(
    name="longtrain",
    help="Train language models on long documents with SparseK attention.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from longtrain import __version__

        typer.echo(f"longtrain {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Train language models on long documents with SparseK attention."""
    from longtrain.console import print_warnings_plainly

    print_warnings_plainly()


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` on stderr; `raise fail(...)` exits with `code` (2: bad usage)."""
    make_console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)
