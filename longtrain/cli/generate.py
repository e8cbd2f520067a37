"""`longtrain generate`: continue one prompt, streaming its text, or several decoded together, as JSONL."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import typer

from longtrain.cli.app import app
from longtrain.console import plural as _n
from longtrain.errors import UsageError
from longtrain.path_args import checkpoint_arg, input_file, read_bytes

ROW_KEYS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")  # a --prompts line's keys
ROW_TYPES = {"max_new_tokens": (int, "an integer"), "top_k": (int, "an integer"), "seed": (int, "an integer"),
             "temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"), "stop": (list, "a string or a list")}


@app.command("generate")
def generate(
    checkpoint: str = typer.Argument(..., help="a checkpoint folder or a run dir (its newest complete checkpoint)", show_default=False),
    prompt: str = typer.Option(None, "--prompt", help="the text to continue"),
    prompt_file: list[Path] = typer.Option(None, "--prompt-file",
        help="read a prompt from this file (it may be a whole book); repeat it for several prompts, decoded together"),
    prompts: Path = typer.Option(None, "--prompts",
        help='a JSONL file, one prompt per line: a string, or {"prompt": ...} with its own "max_new_tokens", '
             '"temperature", "top_k", "top_p", "seed", "stop"'),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", help="tokens to generate, at most (stops early at the end of a document)"),
    temperature: float = typer.Option(0.8, "--temperature", help="0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", help="sample among the K likeliest tokens (0 = off)"),
    top_p: float = typer.Option(1.0, "--top-p", help="sample among the likeliest tokens holding mass P (1 = off)"),
    seed: int = typer.Option(0, "--seed", help="seed of the sampling (each prompt draws as it would alone)"),
    stop: list[str] = typer.Option(None, "--stop",
        help="stop once the text holds this text (repeat for several); the text is cut before it"),
    chunk_size: int = typer.Option(None, "--chunk-size",
        help="prefill chunk (default: the larger of 4096 and the recipe's train.chunk_size; on a GPU, longer chunks "
             "where the KV cache has a fixed size: about 64M activations over the prompts)"),
    json_path: Path = typer.Option(None, "--json", help="write the texts and the timings as JSON here"),
    output: Path = typer.Option(None, "--output", help="several prompts: write the JSONL here (default: stdout)"),
    compile: bool = typer.Option(False, "--compile", help="torch.compile the decode step (CUDA: a slower start, faster steps)"),
    exact: bool = typer.Option(False, "--exact",
        help="read each new token as a one-token chunk of the forward: its attention and selection, bit for bit "
             "where the forward's matrix products round as the padded step's do (slower; docs/VERBS.md)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    dtype: str = typer.Option(None, "--dtype", help="float32 | bfloat16 | float64 (default: float32 on cpu, bfloat16 on cuda)"),
) -> None:
    """Prefill the prompts in chunks, then decode them token by token, together; memory stays fixed with SparseK+SW or SW.

    One prompt: its text streams to stdout. Several (--prompt-file repeated, or --prompts FILE.jsonl):
    one JSON line per prompt, in order, with the text, the tokens and why it stopped."""
    from longtrain.console import make_console

    run_generate(
        checkpoint=checkpoint, prompt=prompt, prompt_files=prompt_file or [], prompts=prompts,
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop or [],
        chunk_size=chunk_size, json_path=json_path, output=output, compile=compile, exact=exact, device=device,
        dtype=dtype, console=make_console(), err=make_console(stderr=True),
    )


def read_prompt_file(path: Path, err) -> str:
    """A prompt file's text; one that is not UTF-8 is read with U+FFFD replacements and a warning (as `fit`)."""
    from longtrain.data.sources import invalid_utf8_bytes

    raw = read_bytes(input_file(path, "prompt_file", "a text file (repeat --prompt-file for several)"), "prompt_file")
    bad = invalid_utf8_bytes(raw)
    if bad:
        err.print(f"[yellow]warning: {bad} bytes of invalid UTF-8 in {path} were replaced by U+FFFD[/]")
    return raw.decode("utf-8", errors="replace")


def read_prompts_jsonl(path: Path) -> list[dict]:
    """The rows of a --prompts file: {"prompt": text, and the row's own settings}; blank lines skipped."""
    raw = read_bytes(input_file(path, "prompts", 'a JSONL file, one prompt (a string or {"prompt": ...}) per line'), "prompts")
    rows = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--prompts {path} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not JSON ({e.msg}); each line is a string or an object with \"prompt\"") from None
        row = {"prompt": row} if isinstance(row, str) else row
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UsageError(f'{where}: give a string or an object with a "prompt" string')
        unknown = sorted(set(row) - set(ROW_KEYS))
        if unknown:
            raise UsageError(f"{where}: unknown key {unknown[0]!r}; a line may set {', '.join(ROW_KEYS)}")
        if isinstance(row.get("stop"), str):
            row["stop"] = [row["stop"]]
        for key, (types, what) in ROW_TYPES.items():
            value = row.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
                raise UsageError(f"{where}: {key} must be {what}; got {value!r}")
        if "stop" in row and not all(isinstance(t, str) and t for t in row["stop"]):
            raise UsageError(f"{where}: stop must be a non-empty string or a list of them; got {row['stop']!r}")
        rows.append(row | {"source": f"line {n}"})
    if not rows:
        raise UsageError(f"--prompts {path}: no prompts in it (one per line)")
    return rows


def gather_prompts(prompt: str | None, prompt_files: list[Path], prompts: Path | None, err) -> list[dict]:
    """Every prompt as {"prompt": text, "source": where it came from, and any settings of its own}."""
    if (prompt is not None) + bool(prompt_files) + (prompts is not None) != 1:
        raise UsageError("give the prompt as --prompt TEXT or --prompt-file FILE (repeat it for several), "
                         "or several as --prompts FILE.jsonl (one of them)")
    if prompt is not None:
        return [{"prompt": prompt, "source": "--prompt"}]
    if prompt_files:
        return [{"prompt": read_prompt_file(p, err), "source": str(p)} for p in prompt_files]
    return read_prompts_jsonl(prompts)


def run_generate(
    *, checkpoint: str, prompt: str | None, prompt_files: list[Path], prompts: Path | None, max_new_tokens: int,
    temperature: float, top_k: int, top_p: float, seed: int, stop: list[str], chunk_size: int | None,
    json_path: Path | None, output: Path | None, compile: bool, exact: bool, device: str, dtype: str | None, console,
    err,
):
    """Everything behind `longtrain generate`: the text or JSONL on `console` (stdout), the rest on `err` (stderr)."""
    from longtrain.generate import Sampling

    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1; got {max_new_tokens}")
    if any(not t for t in stop):
        raise UsageError("--stop '' would stop nowhere: give a text to stop at")
    for name, problem in Sampling(temperature=temperature, top_k=top_k, top_p=top_p).problems():
        raise UsageError(problem, arg=name)
    if exact and compile:
        raise UsageError("--exact steps the chunked forward eagerly; drop --compile (or --exact)")
    if chunk_size is not None and chunk_size < 1:
        raise UsageError(f"--chunk-size must be at least 1; got {chunk_size}")
    for flag, path in (("--json", json_path), ("--output", output)):
        if path is not None and not path.parent.is_dir():
            raise UsageError(f"{flag} {path}: folder {path.parent} does not exist")
    checkpoint_arg(checkpoint)  # no such path, or a file: exit 2 now (a folder without a checkpoint: exit 1, at load)
    rows = gather_prompts(prompt, prompt_files, prompts, err)
    several = len(rows) > 1 or prompts is not None
    if output is not None and not several:
        raise UsageError("--output is for several prompts (JSONL); one prompt streams to stdout (--json writes it)")
    settings = [Sampling(temperature=r.get("temperature", temperature), top_k=r.get("top_k", top_k),
                         top_p=r.get("top_p", top_p), seed=r.get("seed", seed)) for r in rows]
    for r, s in zip(rows, settings):
        for name, problem in s.problems():
            raise UsageError(f"{r['source']}: {name} {problem}")
        if r.get("max_new_tokens", max_new_tokens) < 1:
            raise UsageError(f"{r['source']}: max_new_tokens must be at least 1")

    from longtrain import load
    from longtrain.model.attention_types import describe

    lm = load(checkpoint, device=device, dtype=dtype)
    for r in rows:
        if not lm.encode(r["prompt"]):
            which = "the prompt" if len(rows) == 1 else f"the prompt of {r['source']}"
            raise UsageError(f"{which} is empty: give some text to continue")
    cfg, ckpt = lm.model.cfg, lm.checkpoint
    chunk = lm.prefill_chunk(len(rows), chunk_size)
    n_tokens = [len(lm.encode(r["prompt"])) for r in rows]
    err.print(f"{ckpt.path} (step {ckpt.step}): {describe(cfg.attention, cfg.topk, cfg.window)}, {lm.dtype} on {lm.device}; "
              + (f"prompt {_n(n_tokens[0], 'token')}" if not several else f"{_n(len(rows), 'prompt')}, {_n(sum(n_tokens), 'token')}"))
    if cfg.attention == "full":
        err.print("full attention: the KV cache keeps every token, so memory grows with the prompt and the output")
    else:
        err.print(f"KV cache: {cfg.topk + max(cfg.window - 1, 0)} entries per layer (k + w − 1), whatever the prompt and output length")

    on_token = stream = None
    if not several:  # the text as it comes, exactly the text returned: cut before a stop text, special tokens left out
        from longtrain.generate import ShownText

        stream = ShownText(lm.tokenizer, rows[0].get("stop", stop))
        on_token = lambda _row, t: _write(console.file, stream.push(t))  # noqa: E731
    with _prefill_bar(err, max(n_tokens), chunk) as on_prefill:
        completions = lm.generate(
            [r["prompt"] for r in rows], max_new_tokens=[r.get("max_new_tokens", max_new_tokens) for r in rows],
            sampling=settings, stop=[r.get("stop", stop) for r in rows], chunk_size=chunk, compile=compile,
            exact=exact, on_token=on_token, on_prefill=on_prefill,
        )
    result = lm.last
    if several:
        lines = "".join(json.dumps(row_json(i, r, c)) + "\n" for i, (r, c) in enumerate(zip(rows, completions)))
        if output is not None:
            output.write_text(lines)
        else:
            _write(console.file, lines)
    else:
        _write(console.file, stream.finish(completions[0].text) + "\n")  # what was held back, if it is not a stop text
    mib = 2**20
    stops = {}
    for c in completions:
        stops[c.stopped] = stops.get(c.stopped, 0) + 1
    stopped = ", ".join(f"{n} at {reason.replace('_', ' ')}" for reason, n in stops.items()) if several else \
        ("end of document" if completions[0].stopped == "end_of_document" else
         "a stop text" if completions[0].stopped == "stop_text" else f"{len(completions[0].tokens)} tokens")
    err.print(
        f"stopped: {stopped}; prefill {_n(result.prompt_tokens, 'token')} at {_rate(result.prefill_tokens_per_s)} tokens/s, "
        f"decode {_n(result.new_tokens, 'token')} at {result.decode_tokens_per_s:,.1f} tokens/s"
        + (f" ({_n(len(rows), 'row')} together)" if several else "") + "; "
        f"peak memory {result.peak_memory_bytes / mib:,.0f} MiB ({'GPU tensors' if lm.device == 'cuda' else 'resident'}); "
        f"KV cache {result.kv_entries_per_layer:,} entries per layer, {result.cache_bytes / mib:,.1f} MiB"
    )
    if result.extra.get("overflowed"):
        err.print("[yellow]warning: a SparseK threshold state hit its cap: selection was approximate (raise attention.threshold_cap)[/]")
    if json_path is not None:
        json_path.write_text(json.dumps(to_json(result, rows, lm, settings, chunk, several), indent=1))
    return result


def _rate(per_s: float) -> str:
    """tokens/s as a person reads it: 862,226 or 7.3 (a short prompt's first prefill pays one-time set-up)."""
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:.1f}"


def row_json(index: int, row: dict, c) -> dict:
    """One JSONL line: the prompt's place and source, the text, the tokens and why it stopped."""
    return {"index": index, "source": row["source"], "prompt_tokens": c.prompt_tokens, "text": c.text,
            "tokens": c.tokens, "stopped": c.stopped}


def to_json(result, rows: list[dict], lm, settings: list, chunk: int, several: bool) -> dict:
    """What --json writes: the texts, the tokens, the timings and the cache's size (one prompt: its fields at the top)."""
    out = {
        "checkpoint": str(lm.checkpoint.path),
        "prefill": {"tokens": result.prompt_tokens, "seconds": result.prefill_seconds,
                    "tokens_per_s": result.prefill_tokens_per_s, "chunk_size": chunk},
        "decode": {"tokens": result.new_tokens, "steps": result.decode_steps, "seconds": result.decode_seconds,
                   "tokens_per_s": result.decode_tokens_per_s, "cuda_graph": result.extra.get("cuda_graph", False),
                   "compiled": result.extra.get("compiled", False), "in_place": result.extra.get("in_place", False),
                   "exact": result.extra.get("exact", False), "cuda_graph_capture_seconds": result.capture_seconds},
        "peak_memory_bytes": result.peak_memory_bytes,
        "kv_cache": {"entries_per_layer": result.kv_entries_per_layer, "bytes": result.cache_bytes, "grows": result.cache_grows},
        "overflowed": result.extra.get("overflowed", False),
        "device": lm.device,
        "dtype": lm.dtype,
    }
    if several:
        return out | {"rows": [row_json(i, r, c) | {"sampling": asdict(s)} for i, (r, c, s) in
                               enumerate(zip(rows, result.rows, settings))]}
    c = result.rows[0]
    return {"text": c.text, "tokens": c.tokens, "stopped": c.stopped, "prompt_tokens": c.prompt_tokens,
            "sampling": asdict(settings[0])} | out


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
