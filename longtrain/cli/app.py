"""The typer app that every verb module registers itself on, and the one place errors become exit codes."""

from __future__ import annotations

import typer
from rich.markup import escape
from typer.core import TyperGroup

from longtrain.console import make_console
from longtrain.errors import LongtrainError


class Verbs(TyperGroup):
    """Runs a verb; a LongtrainError it raises is printed (its argument named by the verb's flag) and
    becomes the class's exit code, so no verb maps errors of its own."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LongtrainError as e:
            raise fail(message(e, self.get_command(ctx, ctx.invoked_subcommand or "")), e.exit_code) from None


def message(e: LongtrainError, command) -> str:
    """The error's text, with the flags (or ARGUMENTs) of the click `command` that stand for `e.arg` and `e.names`."""
    flags = {p.name: p.opts[0] if p.param_type_name == "option" else p.name.upper() for p in command.params} if command else {}
    return e.naming(flags.get(e.arg, e.arg) if e.arg else "", flags)


app = typer.Typer(
    cls=Verbs,
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
