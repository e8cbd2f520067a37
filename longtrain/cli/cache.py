"""`longtrain cache list|clear`: the token cache (tokenized corpora and trained tokenizers) on disk."""

from __future__ import annotations

import sys

import typer

from longtrain.cli.app import app, fail

cache_app = typer.Typer(
    help="See or clear the token cache: tokenized corpora and trained tokenizers, rebuilt when needed "
    "(~/.cache/longtrain/tokens; LONGTRAIN_CACHE moves it).",
    no_args_is_help=True,
)
app.add_typer(cache_app, name="cache")


@cache_app.command("list")
def list_cache() -> None:
    """Every entry of the token cache: what corpus it holds, its size and when it was written."""
    from longtrain.data.cache import age, cache_items, default_cache_dir
    from longtrain.train.metrics import gib

    folder = default_cache_dir()
    items = cache_items(folder)
    if not items:
        typer.echo(f"the token cache {folder} is empty")
        return
    for item in items:
        counts = f"{item.docs:,} docs, {item.tokens:,} tokens; " if item.docs is not None and item.tokens is not None else ""
        typer.echo(f"{gib(item.size):>9}  {age(item.written):>11}  {item.kind:<10} {item.key}  {counts}{item.what}")
    total = sum(item.size for item in items)
    typer.echo(f"{gib(total)} in {len(items)} items in {folder}; `longtrain cache clear` deletes them (runs rebuild what they need)")


def can_ask() -> bool:
    """Whether a person can answer a question: stdin is a terminal (not a pipe, a file or /dev/null)."""
    return sys.stdin.isatty()


@cache_app.command("clear")
def clear_cache(
    yes: bool = typer.Option(False, "--yes", "-y",
        help="delete without asking (needed where no terminal can answer: scripts, pipes, CI)"),
) -> None:
    """Delete the token cache's entries (a run rebuilds what it needs; one being built is left alone).

    On a terminal it asks first; elsewhere it deletes nothing unless --yes is given."""
    from longtrain.data.cache import cache_items, clear_cache, default_cache_dir
    from longtrain.train.metrics import gib

    folder = default_cache_dir()
    items = cache_items(folder)
    if not items:
        typer.echo(f"the token cache {folder} is empty: nothing to delete")
        return
    what = f"{_items(len(items))} ({gib(sum(item.size for item in items))}) in {folder}"
    if not yes:
        if not can_ask():
            raise fail(f"deleted nothing: this would delete {what}, but stdin is not a terminal, so it cannot ask "
                       "you first; to go ahead, run `longtrain cache clear --yes`", 2)
        if not typer.confirm(f"delete {what}?", err=True):
            typer.echo("deleted nothing", err=True)
            raise typer.Exit(1)
    deleted, busy = clear_cache(items)
    typer.echo(f"deleted {_items(len(deleted))} ({gib(sum(item.size for item in deleted))}) from {folder}")
    for item in busy:
        typer.echo(f"kept {item.path.name}: another process is building it")


def _items(n: int) -> str:
    return f"{n:,} item" + ("" if n == 1 else "s")
