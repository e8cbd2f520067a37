"""`longtrain inspect`: a text shaded by each token's selection score, the pool at its end marked."""

from __future__ import annotations

from pathlib import Path

import typer

from longtrain.cli.app import app, fail

FORMATS = (".html", ".png")


@app.command("inspect")
def inspect(
    checkpoint: str = typer.Argument(..., help="a checkpoint folder (…/checkpoints/step-XXXXXXXX) or a run dir"),
    text: Path = typer.Option(..., "--text", help="a UTF-8 text file to read through the model"),
    out: Path = typer.Option(..., "--out", help="FILE.html (any length) or FILE.png (a page or two)"),
    layer: int = typer.Option(None, "--layer", help="one layer, counted from 0 (default: every selecting layer)"),
    without_slope: bool = typer.Option(
        False, "--without-slope", help="shade by u − ε·j, the scorer's part, instead of u itself"
    ),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto"),
) -> None:
    """Show which tokens the SparseK pool keeps: every token shaded by its score u, the pool at the end of the text boxed, one panel per layer."""
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise fail(f"--out {out}: the file must end in .html or .png (got {out.suffix or 'no suffix'!r})", 2)
    if not out.parent.is_dir():
        raise fail(f"--out {out}: the folder {out.parent} does not exist; create it first", 2)
    if not text.is_file():
        raise fail(f"--text {text}: no such file; give a UTF-8 text file", 2)
    raw = text.read_bytes()
    content = raw.decode("utf-8", errors="replace")
    if not content.strip():
        raise fail(f"--text {text} is empty: give a text with some words in it", 2)

    from longtrain.eval.inspect import InspectError, render_html, render_png, selection_map
    from longtrain.eval.runner import pick_device
    from longtrain.eval.tasks import EvalUsageError
    from longtrain.train.checkpoint import CheckpointError
    from longtrain.train.checkpointer import load_checkpoint

    try:
        device = pick_device(device)
    except EvalUsageError as e:
        raise fail(str(e), 2)
    try:
        loaded = load_checkpoint(checkpoint, device=device)
        sm = selection_map(loaded, content, layer=layer)
        title = f"{text.name} through {loaded.path} (step {loaded.step})"
        if suffix == ".html":
            render_html(sm, out, title=title, without_slope=without_slope)
        else:
            render_png(sm, out, title=title, without_slope=without_slope)
    except CheckpointError as e:
        raise fail(str(e), 1)
    except InspectError as e:
        raise fail(str(e), 2)
    print(f"wrote {out}: {sm.n_tokens:,} tokens, layer(s) {', '.join(map(str, sm.layers))}")
