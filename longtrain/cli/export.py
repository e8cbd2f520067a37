"""`longtrain export`: a checkpoint as a Hugging Face model folder (Llama or GPT-NeoX layout)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from longtrain.cli.app import app


@app.command("export")
def export(
    checkpoint: Path = typer.Argument(..., help="a checkpoint folder, or a run dir (its newest complete checkpoint)"),
    out: Path = typer.Option(..., "--out", help="folder to write (must not exist, or be empty)"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16 (the weights' dtype in the folder)"),
    max_positions: int = typer.Option(None, "--max-positions",
        help="config.json max_position_embeddings (default: the imported model's, else 2048)"),
) -> None:
    """Write config.json, model.safetensors and tokenizer.json that transformers loads (SparseK extras noted in the config);
    a model the family's config cannot express (a full-attention Llama with rotary_pct < 1, ...) is refused, nothing written."""
    from longtrain.interop.hf_export import export_hf

    path = export_hf(checkpoint, out, dtype=dtype, max_positions=max_positions)
    Console(soft_wrap=True).print(f"exported {checkpoint} → {path}")
