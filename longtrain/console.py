"""The rich console every command prints through.

On a terminal it is rich's usual console. When the output is a file or a pipe it neither wraps
nor colours: a path or a table row stays on one line however long it is, and no style codes end
up in a log file. Messages print with `markup=False` (or `rich.markup.escape`), so text that
contains brackets (a path, a loss line) is shown as it is.
"""

from __future__ import annotations

import sys

from rich.console import Console

PIPE_WIDTH = 10_000  # "no wrapping": wider than any line we print; tables still take only what they need


def make_console(*, stderr: bool = False) -> Console:
    console = Console(file=sys.stderr if stderr else sys.stdout, highlight=False)
    if not console.is_terminal:
        console = Console(
            file=sys.stderr if stderr else sys.stdout, highlight=False, width=PIPE_WIDTH, soft_wrap=True,
            color_system=None,
        )
    return console


def plural(count: int, noun: str) -> str:
    """`1 document`, `2 documents`, `1,024 steps`."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def format_warning(message, category, filename, lineno, line=None) -> str:
    """Python warnings as longtrain prints its own messages: `warning: text` (no file, line or class)."""
    return f"warning: {message}\n"


def print_warnings_plainly() -> None:
    """Every Python warning of this process prints as `warning: text` (the CLI installs it at startup;
    under torchrun, distributed.install_rank_prefix puts `[rank N]` in front)."""
    import warnings

    warnings.formatwarning = format_warning
