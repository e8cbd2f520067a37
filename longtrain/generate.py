"""Generation from a trained model: chunked prefill, then decoding one token at a time.

  prefill   the prompt goes through the model in chunks (as training reads a document), so a
            prompt can be a whole book; only the last position's logits are formed.
  Decoder   one token per row per step through `LM.decode` (the attention's decode step: one
            query against the cache). On CUDA the step is captured once as a CUDA graph and
            replayed: a step is ~100 small kernels per layer, so launching them costs more than
            running them. Full attention's cache grows every step, so it runs eagerly.
  generate  prefill + sampling (greedy, temperature, top-k, top-p) + decoding, with a callback
            per token (the CLI streams the text) and the timings.

With SparseK+SW or SW the cache holds at most k + w - 1 entries per layer whatever the prompt and
output length, so memory does not grow while generating; full attention keeps every key.
"""

from __future__ import annotations

import json
import resource
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from longtrain.model import LM, ModelCache
from longtrain.model.chunks import PREFILL_CHUNK, ChunkReader, resolve_chunk_size, split_rows



# ----------------------------------------------------------------------------- prefill


@torch.no_grad()
def prefill(
    model: LM,
    ids: torch.Tensor,  # [B, T] int64 prompt tokens (on any device)
    *,
    chunk_size: int = PREFILL_CHUNK,
    cache: ModelCache | None = None,
    on_chunk: Callable[[int], None] | None = None,  # called with the tokens done so far
) -> tuple[ModelCache, torch.Tensor]:
    """(cache after the prompt, logits [B, V] at its last position): the prompt read in chunks."""
    dev = model.embed.weight.device
    B, T = ids.shape
    if T < 1:
        raise ValueError("the prompt has no tokens")
    reader = ChunkReader(cache if cache is not None else model.empty_cache(B, device=dev), dev)
    chunks = split_rows(ids, chunk_size, seen=None if cache is None else cache.seen)
    for done, (_, _, out) in enumerate(reader(chunks, lambda c, cache: model.hidden(c.tokens, cache=cache)), 1):
        if on_chunk is not None:  # no [chunk, V] logits above: only the last position's below
            on_chunk(min(done * chunk_size, T))
    return reader.cache, model.head(out.hidden[:, -1])


# ----------------------------------------------------------------------------- decoding


class Decoder:
    """Decodes one token per row per step from a prefilled cache.

    cuda_graph captures `LM.decode` once and replays it; the cache then lives in fixed buffers that
    each replay updates in place. None (the default): on CUDA unless the model uses full attention,
    and if the capture fails, eager decoding with the reason in `graph_error` (True: fail).
    """

    def __init__(self, model: LM, cache: ModelCache, *, cuda_graph: bool | None = None):
        self.model = model
        self._cache = cache
        self.graph, self.graph_error = None, None
        on_cuda = model.embed.weight.is_cuda
        fixed = model.cfg.attention != "full"
        if cuda_graph and not (on_cuda and fixed):
            raise ValueError("a CUDA graph needs a CUDA model whose cache has a fixed size (not full attention)")
        if cuda_graph or (cuda_graph is None and on_cuda and fixed):
            try:
                self._capture()
            except RuntimeError as e:  # e.g. an op that cannot be captured: decoding still works, eagerly
                if cuda_graph:
                    raise
                self.graph, self.graph_error = None, f"{type(e).__name__}: {e}"
                warnings.warn(f"decoding without a CUDA graph, its capture failed: {self.graph_error}", stacklevel=2)

    @property
    def cache(self) -> ModelCache:
        return self._cache

    @property
    def cache_grows(self) -> bool:
        return self._cache.grows

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token after `tokens` [B] (the last sampled ones)."""
        if self.graph is None:
            out = self.model.decode(tokens, self._cache)
            self._cache = out.cache
            return out.logits[:, 0]
        self._tokens.copy_(tokens)
        self.graph.replay()
        return self._logits.clone()  # the next replay overwrites the buffer

    @torch.no_grad()
    def _capture(self) -> None:
        B = self._cache.batch_size
        dev = self.model.embed.weight.device
        self._tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        # The graph updates its cache in place: it gets its own copy, the caller's cache stays as it was.
        static = self._cache = self._cache.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture (the decode step is functional: the cache is untouched)
            for _ in range(2):
                self.model.decode(self._tokens, static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.model.decode(self._tokens, static)
            static.copy_(out.cache)  # the next cache, in place
        self.graph, self._logits = graph, out.logits[:, 0]


# ----------------------------------------------------------------------------- sampling


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0


def sample(logits: torch.Tensor, opts: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens [B] from logits [B, V] (on the CPU, so a seed gives the same text on any device)."""
    logits = logits.detach().float().cpu()
    if opts.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / opts.temperature
    if opts.top_k > 0:
        kth = logits.topk(min(opts.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if opts.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= opts.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -torch.inf))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


# ----------------------------------------------------------------------------- text streaming


class TextStream:
    """Turns tokens into text as they come, holding back a split multi-byte character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0  # characters of decode(ids) already handed out

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return ""  # a character's bytes span tokens: wait for the rest
        new = text[self.shown :]
        if len(self.ids) > 64 and new:  # start over now and then, so decoding stays short
            self.ids, self.shown = [], 0
        else:
            self.shown = len(text)
        return new


# ----------------------------------------------------------------------------- generate


@dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int]  # the generated tokens
    stopped: str  # "max_new_tokens" | "end_of_document"
    prefill_seconds: float
    decode_seconds: float  # the first step included (on CUDA: the graph's capture is not)
    capture_seconds: float
    peak_memory_bytes: int  # CUDA: peak allocated by tensors; CPU: the process's peak resident memory
    kv_entries_per_layer: int  # per row, at the end
    cache_bytes: int  # the whole cache, at the end
    cache_grows: bool
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.decode_seconds, 1e-9)


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model: LM,
    prompt: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    chunk_size: int = PREFILL_CHUNK,
    eod_id: int | None = None,  # stop after this token (None: never)
    cuda_graph: bool | None = None,
    on_token: Callable[[int], None] | None = None,
    on_prefill: Callable[[int], None] | None = None,
) -> Generation:
    """Prefill `prompt` in chunks, then sample up to `max_new_tokens` tokens one at a time."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
    sampling = sampling or Sampling()
    dev = model.embed.weight.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    gen = torch.Generator().manual_seed(sampling.seed)
    ids = torch.tensor([prompt], dtype=torch.int64)

    t0 = time.perf_counter()
    cache, logits = prefill(model, ids, chunk_size=chunk_size, on_chunk=on_prefill)
    _sync(dev)
    t1 = time.perf_counter()
    decoder = Decoder(model, cache, cuda_graph=cuda_graph)
    _sync(dev)
    t2 = time.perf_counter()

    out, stopped = [], "max_new_tokens"
    while True:
        token = sample(logits, sampling, gen)  # [1]
        out.append(int(token[0]))
        if on_token is not None:
            on_token(out[-1])
        if eod_id is not None and out[-1] == eod_id:
            stopped = "end_of_document"
            break
        if len(out) == max_new_tokens:
            break
        logits = decoder.step(token.to(dev))
    _sync(dev)
    t3 = time.perf_counter()
    cache = decoder.cache
    return Generation(
        prompt_tokens=len(prompt), tokens=out, stopped=stopped, prefill_seconds=t1 - t0, decode_seconds=t3 - t2,
        capture_seconds=t2 - t1, peak_memory_bytes=peak_memory(dev), kv_entries_per_layer=cache.kv_entries_per_layer,
        cache_bytes=cache.nbytes(), cache_grows=decoder.cache_grows,
        extra={"overflowed": cache.overflowed(), "cuda_graph": decoder.graph is not None, "cuda_graph_error": decoder.graph_error},
    )


# ----------------------------------------------------------------------------- the command


class GenerateUsageError(Exception):
    """Bad flags or inputs; the message names the problem and the fix (exit 2)."""


def read_prompt(prompt: str | None, prompt_file: Path | None, err) -> str:
    """The prompt text; a file that is not UTF-8 is read with U+FFFD replacements and a warning (as `fit`)."""
    from longtrain.data.sources import invalid_utf8_bytes

    if (prompt is None) == (prompt_file is None):
        raise GenerateUsageError("give the prompt as --prompt TEXT or --prompt-file FILE (one of them)")
    if prompt_file is None:
        return prompt
    if not prompt_file.is_file():
        raise GenerateUsageError(f"--prompt-file {prompt_file}: no such file")
    raw = prompt_file.read_bytes()
    bad = invalid_utf8_bytes(raw)
    if bad:
        err.print(f"[yellow]warning: {bad} bytes of invalid UTF-8 in {prompt_file} were replaced by U+FFFD[/]")
    return raw.decode("utf-8", errors="replace")


def run_command(
    *, checkpoint: str, prompt: str | None, prompt_file: Path | None, max_new_tokens: int, temperature: float,
    top_k: int, top_p: float, seed: int, chunk_size: int | None, json_path: Path | None, device: str,
    dtype: str | None, console, err,
) -> Generation:
    """Everything behind `longtrain generate`: text on `console` (stdout), the rest on `err` (stderr)."""
    from longtrain.eval.runner import DTYPES, describe_attention, pick_device, pick_dtype
    from longtrain.eval.tasks import EvalUsageError
    from longtrain.train.checkpointer import load_checkpoint

    if max_new_tokens < 1:
        raise GenerateUsageError(f"--max-new-tokens must be at least 1; got {max_new_tokens}")
    if temperature < 0:
        raise GenerateUsageError(f"--temperature must be >= 0 (0 = greedy); got {temperature}")
    if top_k < 0:
        raise GenerateUsageError(f"--top-k must be >= 0 (0 = off); got {top_k}")
    if not 0 < top_p <= 1:
        raise GenerateUsageError(f"--top-p must be in (0, 1] (1 = off); got {top_p}")
    if chunk_size is not None and chunk_size < 1:
        raise GenerateUsageError(f"--chunk-size must be at least 1; got {chunk_size}")
    if json_path is not None and not json_path.parent.is_dir():
        raise GenerateUsageError(f"--json {json_path}: folder {json_path.parent} does not exist")
    try:
        device = pick_device(device)
        dtype = pick_dtype(dtype, device)
    except EvalUsageError as e:
        raise GenerateUsageError(str(e)) from None
    text = read_prompt(prompt, prompt_file, err)

    ckpt = load_checkpoint(checkpoint, device=device, dtype=DTYPES[dtype])
    model, tok = ckpt.model, ckpt.tokenizer
    ids = tok.encode(text, add_special_tokens=False).ids
    if not ids:
        raise GenerateUsageError("the prompt is empty: give some text to continue")
    chunk = resolve_chunk_size(chunk_size, ckpt.recipe.train.chunk_size, prefill=True)
    cfg = model.cfg
    err.print(f"{ckpt.path} (step {ckpt.step}): {describe_attention(cfg)}, {dtype} on {device}; prompt {len(ids):,} tokens")
    if cfg.attention == "full":
        err.print("full attention: the KV cache keeps every token, so memory grows with the prompt and the output")
    else:
        err.print(f"KV cache: {cfg.topk + max(cfg.window - 1, 0)} entries per layer (k + w − 1), whatever the prompt and output length")

    from longtrain.data.tokenizer import eod_id

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


def to_json(result: Generation, tok, ckpt, sampling: Sampling, device: str, dtype: str, chunk: int) -> dict:
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
