"""`longtrain verify-equivalence`: chunked against unchunked passes over one document."""

from __future__ import annotations

from pathlib import Path

import typer

from longtrain.cli.app import app
from longtrain.console import make_console


@app.command("verify-equivalence")
def verify_equivalence(
    recipe: Path = typer.Option(None, "--recipe", help="build the model from this recipe (random init)"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="a checkpoint folder, or a run dir (its newest complete checkpoint)"),
    text: Path = typer.Option(None, "--text", help="a text file as the document (default: random tokens)"),
    tokens: int = typer.Option(65536, "--tokens", help="document length in tokens (truncates --text)"),
    chunk_size: list[int] = typer.Option(None, "--chunk-size", help="chunk size (repeatable; default 1024, 4096, 3001)"),
    dtype: str = typer.Option(
        None, "--dtype",
        help="float64 | float32 | bfloat16 | bfloat16-weights (default: float64 on cpu, float32 on cuda). bfloat16 is "
             "bf16 autocast over float32 weights, the precision `longtrain fit` trains in; bfloat16-weights casts the "
             "whole model to bf16 (bf16 residual stream)",
    ),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    seed: int = typer.Option(0, "--seed", help="seed of the random model and tokens"),
    json_path: Path = typer.Option(None, "--json", help="write the results as JSON here"),
    max_logit_diff: float = typer.Option(None, "--max-logit-diff", help="pass threshold (default: 1e-9 float64, 1e-2 float32, 0.5 bfloat16)"),
    min_agreement: float = typer.Option(None, "--min-agreement", help="pass threshold on every layer's selection agreement (default: 1 float64, 0.9999 float32, 0.999 bfloat16)"),
) -> None:
    """Check that reading a document in chunks gives what one unchunked pass gives (exit 0 pass, 1 fail, 2 usage)."""
    from longtrain.eval.equivalence import run_command

    code = run_command(
        recipe=recipe, checkpoint=checkpoint, text=text, tokens=tokens, chunk_sizes=chunk_size, dtype=dtype,
        device=device, seed=seed, json_path=json_path, max_logit_diff=max_logit_diff,
        min_agreement=min_agreement, console=make_console(),
    )
    raise typer.Exit(code)
