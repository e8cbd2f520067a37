"""The `longtrain` command line: one thin function per verb."""

from __future__ import annotations

from pathlib import Path

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


@app.command("fit")
def fit(
    recipe: str = typer.Argument(
        None, help="recipe YAML file or built-in name (default: quickstart)", show_default=False
    ),
    run_dir: Path = typer.Option(None, "--run-dir", help="run directory (default: runs/<recipe name>)"),
    overrides: list[str] = typer.Option([], "--set", help="override a recipe key: --set train.lr=3e-4 (repeatable)"),
    resume: str = typer.Option("auto", "--resume", help="auto (newest complete checkpoint, if any) | never (start over; deletes this run's checkpoints) | PATH to a checkpoint directory"),
) -> None:
    """Train or fine-tune on long documents, chunk by chunk, resumable from checkpoints."""
    from longtrain.data import DataError
    from longtrain.train.checkpoint import CheckpointError
    from longtrain.train.recipe import RecipeError, load_recipe
    from longtrain.train.trainer import TrainingError, fit as run_fit

    err = Console(stderr=True)
    try:
        r = load_recipe(recipe, overrides)
        result = run_fit(r, run_dir=run_dir, resume=resume)
    except (RecipeError, DataError, CheckpointError, TrainingError) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2 if isinstance(e, RecipeError) else 1)
    out = Console(soft_wrap=True)
    done = "stopped early (signal)" if result.interrupted else "done"
    best = f", best validation loss {result.best_valid_loss:.4f}" if result.best_valid_loss is not None else ""
    final = f", final validation loss {result.final_valid_loss:.4f}" if result.final_valid_loss is not None else ""
    out.print(
        f"{done}: {result.steps} steps, {result.tokens:,} tokens in {result.seconds:.1f} s "
        f"({result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s); last loss {result.last_loss:.4f}{final}{best}"
    )
    if result.checkpoint:
        out.print(f"checkpoint: {result.checkpoint}")


@app.command("verify-equivalence")
def verify_equivalence(
    recipe: Path = typer.Option(None, "--recipe", help="build the model from this recipe (random init)"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="a RUN_DIR/checkpoints/step-XXXXXXXX folder"),
    text: Path = typer.Option(None, "--text", help="a text file as the document (default: random tokens)"),
    tokens: int = typer.Option(65536, "--tokens", help="document length in tokens (truncates --text)"),
    chunk_size: list[int] = typer.Option(None, "--chunk-size", help="chunk size (repeatable; default 1024, 4096, 3001)"),
    dtype: str = typer.Option(None, "--dtype", help="float64 | float32 | bfloat16 (default: float64 on cpu, float32 on cuda)"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    seed: int = typer.Option(0, "--seed", help="seed of the random model and tokens"),
    json_path: Path = typer.Option(None, "--json", help="write the results as JSON here"),
    max_logit_diff: float = typer.Option(None, "--max-logit-diff", help="pass threshold (default: 1e-9 float64, 1e-2 float32, 0.5 bfloat16)"),
    min_agreement: float = typer.Option(None, "--min-agreement", help="pass threshold on selection agreement (default: 1 float64, 0.99 float32, 0.8 bfloat16)"),
) -> None:
    """Check that reading a document in chunks gives what one unchunked pass gives (exit 0 pass, 1 fail, 2 usage)."""
    from longtrain.eval.equivalence import UsageError, run_command

    try:
        code = run_command(
            recipe=recipe, checkpoint=checkpoint, text=text, tokens=tokens, chunk_sizes=chunk_size, dtype=dtype,
            device=device, seed=seed, json_path=json_path, max_logit_diff=max_logit_diff,
            min_agreement=min_agreement, console=Console(),
        )
    except UsageError as e:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    raise typer.Exit(code)


@app.command("version")
def version() -> None:
    """Print the longtrain version."""
    from longtrain import __version__

    typer.echo(__version__)


if __name__ == "__main__":
    app()
