"""`longtrain generate`: continue a prompt, streaming the text as it is sampled."""

from __future__ import annotations

from pathlib import Path

import typer

from longtrain.cli.app import app, fail


@app.command("generate")
def generate(
    checkpoint: str = typer.Argument(..., help="a checkpoint folder or a run dir (its newest complete checkpoint)", show_default=False),
    prompt: str = typer.Option(None, "--prompt", help="the text to continue"),
    prompt_file: Path = typer.Option(None, "--prompt-file", help="read the prompt from this file (it may be a whole book)"),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", help="tokens to generate, at most (stops early at the end of a document)"),
    temperature: float = typer.Option(0.8, "--temperature", help="0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", help="sample among the K likeliest tokens (0 = off)"),
    top_p: float = typer.Option(1.0, "--top-p", help="sample among the likeliest tokens holding mass P (1 = off)"),
    seed: int = typer.Option(0, "--seed", help="seed of the sampling"),
    chunk_size: int = typer.Option(None, "--chunk-size", help="prefill chunk (default: 4096, or the recipe's train.chunk_size if larger)"),
    json_path: Path = typer.Option(None, "--json", help="write the text and the timings as JSON here"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    dtype: str = typer.Option(None, "--dtype", help="float32 | bfloat16 | float64 (default: float32 on cpu, bfloat16 on cuda)"),
) -> None:
    """Prefill the prompt in chunks, then decode token by token; memory stays fixed with SparseK+SW or SW."""
    from longtrain.console import make_console
    from longtrain.generate import GenerateUsageError, run_command
    from longtrain.train.checkpoint import CheckpointError

    try:
        run_command(
            checkpoint=checkpoint, prompt=prompt, prompt_file=prompt_file, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chunk_size=chunk_size, json_path=json_path,
            device=device, dtype=dtype, console=make_console(), err=make_console(stderr=True),
        )
    except (GenerateUsageError, CheckpointError) as e:
        raise fail(str(e), 2)
