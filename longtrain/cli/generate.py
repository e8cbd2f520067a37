"""`longtrain generate`: continue a prompt, streaming the text as it is sampled."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import typer

from longtrain.cli.app import app
from longtrain.errors import UsageError


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

    run_generate(
        checkpoint=checkpoint, prompt=prompt, prompt_file=prompt_file, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chunk_size=chunk_size, json_path=json_path,
        device=device, dtype=dtype, console=make_console(), err=make_console(stderr=True),
    )


def read_prompt(prompt: str | None, prompt_file: Path | None, err) -> str:
    """The prompt text; a file that is not UTF-8 is read with U+FFFD replacements and a warning (as `fit`)."""
    from longtrain.data.sources import invalid_utf8_bytes

    if (prompt is None) == (prompt_file is None):
        raise UsageError("give the prompt as --prompt TEXT or --prompt-file FILE (one of them)")
    if prompt_file is None:
        return prompt
    if not prompt_file.is_file():
        raise UsageError(f"--prompt-file {prompt_file}: no such file")
    raw = prompt_file.read_bytes()
    bad = invalid_utf8_bytes(raw)
    if bad:
        err.print(f"[yellow]warning: {bad} bytes of invalid UTF-8 in {prompt_file} were replaced by U+FFFD[/]")
    return raw.decode("utf-8", errors="replace")


def run_generate(
    *, checkpoint: str, prompt: str | None, prompt_file: Path | None, max_new_tokens: int, temperature: float,
    top_k: int, top_p: float, seed: int, chunk_size: int | None, json_path: Path | None, device: str,
    dtype: str | None, console, err,
):
    """Everything behind `longtrain generate`: text on `console` (stdout), the rest on `err` (stderr)."""
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1; got {max_new_tokens}")
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy); got {temperature}")
    if top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off); got {top_k}")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (1 = off); got {top_p}")
    if chunk_size is not None and chunk_size < 1:
        raise UsageError(f"--chunk-size must be at least 1; got {chunk_size}")
    if json_path is not None and not json_path.parent.is_dir():
        raise UsageError(f"--json {json_path}: folder {json_path.parent} does not exist")

    from longtrain.data.tokenizer import eod_id
    from longtrain.device import DTYPES, pick_device, pick_dtype
    from longtrain.generate import Sampling, TextStream, generate
    from longtrain.model.attention_types import describe
    from longtrain.model.chunks import resolve_chunk_size
    from longtrain.train.checkpoint import load_checkpoint

    device = pick_device(device)
    dtype = pick_dtype(dtype, device)
    text = read_prompt(prompt, prompt_file, err)

    ckpt = load_checkpoint(checkpoint, device=device, dtype=DTYPES[dtype])
    model, tok = ckpt.model, ckpt.tokenizer
    ids = tok.encode(text, add_special_tokens=False).ids
    if not ids:
        raise UsageError("the prompt is empty: give some text to continue")
    chunk = resolve_chunk_size(chunk_size, ckpt.recipe.train.chunk_size, prefill=True)
    cfg = model.cfg
    err.print(f"{ckpt.path} (step {ckpt.step}): {describe(cfg.attention, cfg.topk, cfg.window)}, {dtype} on {device}; "
              f"prompt {len(ids):,} tokens")
    if cfg.attention == "full":
        err.print("full attention: the KV cache keeps every token, so memory grows with the prompt and the output")
    else:
        err.print(f"KV cache: {cfg.topk + max(cfg.window - 1, 0)} entries per layer (k + w − 1), whatever the prompt and output length")

    stream = TextStream(tok)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    with _prefill_bar(err, len(ids), chunk) as on_prefill:
        result = generate(
            model, ids, max_new_tokens=max_new_tokens, sampling=sampling, chunk_size=chunk, eod_id=eod_id(tok),
            on_token=lambda t: _write(console.file, stream.push(t)), on_prefill=on_prefill,
        )
    _write(console.file, "\n")
    mib = 2**20
    stop = "end of document" if result.stopped == "end_of_document" else f"{len(result.tokens)} tokens"
    err.print(
        f"stopped at {stop}; prefill {result.prompt_tokens:,} tokens at {result.prefill_tokens_per_s:,.0f} tokens/s, "
        f"decode {len(result.tokens)} tokens at {result.decode_tokens_per_s:,.1f} tokens/s; "
        f"peak memory {result.peak_memory_bytes / mib:,.0f} MiB ({'GPU tensors' if device == 'cuda' else 'resident'}); "
        f"KV cache {result.kv_entries_per_layer:,} entries per layer, {result.cache_bytes / mib:,.1f} MiB"
    )
    if result.extra.get("overflowed"):
        err.print("[yellow]warning: a SparseK threshold state hit its cap: selection was approximate (raise attention.threshold_cap)[/]")
    if json_path is not None:
        json_path.write_text(json.dumps(to_json(result, tok, ckpt, sampling, device, dtype, chunk), indent=1))
    return result


def to_json(result, tok, ckpt, sampling, device: str, dtype: str, chunk: int) -> dict:
    """What --json writes: the text, the tokens, the timings and the cache's size."""
    return {
        "checkpoint": str(ckpt.path),
        "text": tok.decode(result.tokens),
        "tokens": result.tokens,
        "stopped": result.stopped,
        "prompt_tokens": result.prompt_tokens,
        "prefill": {"tokens": result.prompt_tokens, "seconds": result.prefill_seconds,
                    "tokens_per_s": result.prefill_tokens_per_s, "chunk_size": chunk},
        "decode": {"tokens": len(result.tokens), "seconds": result.decode_seconds,
                   "tokens_per_s": result.decode_tokens_per_s, "cuda_graph": result.extra.get("cuda_graph", False),
                   "cuda_graph_capture_seconds": result.capture_seconds},
        "peak_memory_bytes": result.peak_memory_bytes,
        "kv_cache": {"entries_per_layer": result.kv_entries_per_layer, "bytes": result.cache_bytes, "grows": result.cache_grows},
        "overflowed": result.extra.get("overflowed", False),
        "sampling": asdict(sampling),
        "device": device,
        "dtype": dtype,
    }


def _write(out, text: str) -> None:
    """Streamed text goes to the terminal as it is: no markup, no wrapping of its own."""
    if text:
        out.write(text)
        out.flush()


@contextmanager
def _prefill_bar(err, total: int, chunk: int):
    """A rich bar while a long prompt is read (only on a terminal, and only when it takes several chunks)."""
    if not err.is_terminal or total <= chunk:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("prefill", total=total)

        def on_chunk(done: int) -> None:
            bar.update(task, completed=done)
            if done >= total:
                bar.stop()  # before the text streams out

        yield on_chunk
