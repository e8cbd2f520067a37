"""`longtrain verify-equivalence`: chunked against unchunked passes over one document."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from longtrain.cli.app import app
from longtrain.console import make_console
from longtrain.errors import UsageError
from longtrain.path_args import checkpoint_arg


@app.command("verify-equivalence")
def verify_equivalence(
    recipe: Path = typer.Option(None, "--recipe", help="build the model from this recipe (random init)"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="a checkpoint folder, or a run dir (its newest complete checkpoint)"),
    text: Path = typer.Option(None, "--text", help="a text file as the document (default: random tokens)"),
    tokens: int = typer.Option(65536, "--tokens", help="document length in tokens (truncates --text)"),
    chunk_size: list[int] = typer.Option(
        None, "--chunk-size", help="chunk size, below the document's length (repeatable; default 1024, 4096, 3001, those below it)"
    ),
    dtype: str = typer.Option(
        None, "--dtype",
        help="float64 | float32 | bfloat16 | bfloat16-weights (default: float64 on cpu, float32 on cuda). bfloat16 is "
             "bf16 autocast over float32 weights, the precision `longtrain fit` trains in; bfloat16-weights casts the "
             "whole model to bf16 (bf16 residual stream)",
    ),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    seed: int = typer.Option(0, "--seed", help="seed of the random model and tokens"),
    json_path: Path = typer.Option(None, "--json", help="write the results as JSON here"),
    max_logit_diff: float = typer.Option(None, "--max-logit-diff",
        help="pass threshold (default: 1e-9 float64, 1e-2 float32, 0.5 bfloat16)"),
    min_agreement: float = typer.Option(None, "--min-agreement",
        help="pass threshold on every layer's selection agreement (default: 1 float64, 0.9999 float32, 0.999 bfloat16)"),
) -> None:
    """Check that reading a document in chunks gives what one unchunked pass gives (exit 0 pass, 1 fail, 2 usage)."""
    code = run_verify(
        recipe=recipe, checkpoint=checkpoint, text=text, tokens=tokens, chunk_sizes=chunk_size, dtype=dtype,
        device=device, seed=seed, json_path=json_path, max_logit_diff=max_logit_diff,
        min_agreement=min_agreement, console=make_console(),
    )
    raise typer.Exit(code)


def run_verify(
    *,
    recipe: Path | None,
    checkpoint: Path | None,
    text: Path | None,
    tokens: int,
    chunk_sizes: list[int] | None,
    dtype: str | None,
    device: str,
    seed: int,
    json_path: Path | None,
    max_logit_diff: float | None,
    min_agreement: float | None,
    console,
) -> int:
    """Everything behind `longtrain verify-equivalence`: the flags checked, then the passes; returns the exit code."""
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda; got {device!r}")
    if recipe is not None and checkpoint is not None:
        raise UsageError("give --recipe or --checkpoint, not both")
    if checkpoint is not None:
        checkpoint_arg(checkpoint, arg="checkpoint")  # no such path, or a file: exit 2 (no checkpoint in it: 1, at load)
    import torch

    from longtrain.eval.equivalence import (
        DEFAULT_CHUNK_SIZES,
        DEFAULT_THRESHOLDS,
        DTYPES,
        FAULTS,
        PRECISIONS,
        load_model,
        load_tokens,
        render,
        verify,
    )

    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    dtype = dtype or ("float64" if device == "cpu" else "float32")
    if dtype not in PRECISIONS:
        raise UsageError(f"--dtype must be one of {', '.join(PRECISIONS)}; got {dtype!r}")
    if tokens < 2:
        raise UsageError(f"--tokens must be at least 2; got {tokens}")
    if chunk_sizes and any(c < 1 for c in chunk_sizes):
        raise UsageError(f"--chunk-size must be >= 1; got {chunk_sizes}")
    explicit = bool(chunk_sizes)
    chunk_sizes, dropped = chunks_to_verify(
        list(chunk_sizes or DEFAULT_CHUNK_SIZES), tokens, explicit=explicit, what=f"--tokens {tokens:,}", more="--tokens above {n:,}"
    )
    fault = os.environ.get("LONGTRAIN_FAULT") or None
    if fault is not None and fault not in FAULTS:
        raise UsageError(f"LONGTRAIN_FAULT must be one of {FAULTS}; got {fault!r}")
    if json_path is not None and not json_path.parent.is_dir():
        raise UsageError(f"--json {json_path}: folder {json_path.parent} does not exist")
    if min_agreement is not None and not 0.0 <= min_agreement <= 1.0:
        raise UsageError(f"--min-agreement is a fraction of queries: give a value from 0 to 1; got {min_agreement:g}")
    if max_logit_diff is not None and not max_logit_diff >= 0.0:
        raise UsageError(f"--max-logit-diff is an absolute difference: give a value of at least 0; got {max_logit_diff:g}")
    d_max, a_min = DEFAULT_THRESHOLDS[dtype]
    d_max = d_max if max_logit_diff is None else max_logit_diff
    a_min = a_min if min_agreement is None else min_agreement

    model, tokenizer = load_model(recipe, checkpoint, seed)
    dev = torch.device(device)
    model = model.to(dev, DTYPES[dtype])
    if dtype == "float64" and model.cfg.backend == "auto":
        model.cfg.backend = "naive"  # the Triton core has no float64; the attention layers share this cfg
    doc = load_tokens(text, tokens, model.cfg.vocab_size, tokenizer, seed).to(dev)
    if doc.numel() < tokens:  # --text is shorter than --tokens: the chunks must split what it has
        chunk_sizes, dropped_here = chunks_to_verify(
            chunk_sizes, doc.numel(), explicit=explicit, what=f"the {doc.numel():,} tokens of --text {text}",
            more="a --text longer than {n:,} tokens",
        )
        dropped += dropped_here
    cfg = model.cfg
    console.print(
        f"model: {cfg.style}, {cfg.layers} layers × {cfg.d_model}, {cfg.heads} heads, {cfg.attention} "
        f"(k={cfg.topk}, w={cfg.window}), {model.num_params() / 1e6:.2f}M parameters; "
        f"{doc.numel():,} tokens, {dtype} on {device}"
    )
    if dropped:
        console.print(f"  default chunk size{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} left out: "
                      f"not smaller than the document's {doc.numel():,} tokens", highlight=False)
    report = verify(
        model, doc, chunk_sizes, dtype=dtype, max_logit_diff=d_max, min_agreement=a_min, fault=fault,
        on_run=lambda r: console.print(f"  chunk {r.chunk_size}: {r.seconds:.1f} s", highlight=False),
    )
    render(report, console)
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=1))
    return 0 if report.passed else 1


def chunks_to_verify(chunk_sizes: list[int], length: int, *, explicit: bool, what: str, more: str) -> tuple[list[int], list[int]]:
    """(the chunk sizes to run, the default sizes left out) for a document of `length` tokens.

    A chunk of at least the document's length reads it in one chunk, the unchunked pass itself, so
    it verifies nothing: an `explicit` --chunk-size of that size is refused; a default one is left
    out (the caller says so), unless none is left. `what` names the length, `more` the other fix (a
    format of `n`, the length that would do).
    """
    whole = [c for c in chunk_sizes if c >= length]
    kept = [c for c in chunk_sizes if c < length]
    if explicit and whole:
        raise UsageError(
            f"--chunk-size {', '.join(f'{c:,}' for c in whole)} is not smaller than {what}: the document would be read "
            "in one chunk, which is the unchunked pass itself, so there is nothing to verify; give a --chunk-size "
            f"below {length:,}, or {more.format(n=max(whole))}"
        )
    if not kept:
        raise UsageError(
            f"every default chunk size ({', '.join(f'{c:,}' for c in chunk_sizes)}) is at least {what}: each would "
            "read the document in one chunk, the unchunked pass itself, so there is nothing to verify; give a --chunk-size below "
            f"{length:,}, or {more.format(n=min(chunk_sizes))}"
        )
    return kept, whole
