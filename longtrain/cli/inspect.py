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
    max_tokens: int = typer.Option(
        None, "--max-tokens", min=1, help="read at most the text's first N tokens (default 20,000: about 0.4 KB of HTML "
        "per token and layer)", show_default=False,
    ),
) -> None:
    """Show which tokens the SparseK pool keeps: every token shaded by its score u, the pool at the end of the text
    boxed, one panel per layer."""
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise fail(f"--out {out}: the file must end in .html or .png (got {out.suffix or 'no suffix'!r})", 2)
    if not out.parent.is_dir():
        raise fail(f"--out {out}: the folder {out.parent} does not exist; create it first", 2)
    from longtrain.path_args import checkpoint_arg, input_file, read_bytes

    input_file(text, "text", "a UTF-8 text file")  # exit 2: a folder, no such file
    from longtrain.device import pick_device
    from longtrain.eval.inspect import (
        MAX_TOKENS, check_png_size, first_tokens, read_text, render_html, render_png, selecting_layers,
        selection_map,
    )
    from longtrain.train.checkpoint import load_checkpoint

    limit = max_tokens or MAX_TOKENS
    raw = read_bytes(text, "text", 128 * limit + 1)  # what first_tokens can use (32 characters a token, up to 4 bytes each)
    # a binary or empty file is refused before the checkpoint is read
    content = read_text(raw[: 128 * limit], str(text), cut=len(raw) > 128 * limit)
    device = pick_device(device)
    loaded = load_checkpoint(checkpoint_arg(checkpoint), device=device)  # exit 2: no such path, a file; 1: no checkpoint
    content, n_tokens = first_tokens(loaded.tokenizer, content, limit)
    if n_tokens > limit:
        print(f"note: read the first {limit:,} tokens of {text} (it has more); --max-tokens N reads more")
    if suffix == ".png":  # before the model pass: a text too long for a PNG is refused in a second
        n_layers = 1 if layer is not None else len(selecting_layers(loaded.model))
        check_png_size(content, n_layers, layer_given=layer is not None)
    sm = selection_map(loaded, content, layer=layer)
    title = f"{text.name} through {loaded.path} (step {loaded.step})"
    if suffix == ".html":
        render_html(sm, out, title=title, without_slope=without_slope)
    else:
        render_png(sm, out, title=title, without_slope=without_slope)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): {sm.n_tokens:,} tokens, layer(s) {', '.join(map(str, sm.layers))}")
