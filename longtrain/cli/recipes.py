"""`longtrain recipes`: the built-in recipes and what each is for."""

from __future__ import annotations

import typer

from longtrain.cli.app import app


@app.command("recipes")
def recipes() -> None:
    """List the built-in recipes (use a name with `longtrain fit NAME`)."""
    from longtrain.train.recipe import RECIPES_DIR, builtin_recipes, recipe_description

    names = builtin_recipes()
    width = max(map(len, names), default=0)
    for name in names:
        typer.echo(f"{name:<{width}}  {recipe_description(RECIPES_DIR / f'{name}.yaml')}")
    typer.echo(f"(from {RECIPES_DIR}; `longtrain fit NAME --dry-run` shows one resolved)")
