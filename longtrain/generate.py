"""Generation from a trained model: chunked prefill, then decoding one token at a time.

  prefill   the prompt goes through the model in chunks (as training reads a document), so a
            prompt can be a whole book; only the last position's logits are formed.
  Decoder   one token per row per step through `LM.decode` (the attention's decode step: one
            query against the cache). On CUDA the step is captured once as a CUDA graph and
            replayed: a step is ~100 small kernels per layer, so launching them costs more than
            running them. Full attention's cache grows every step, so it runs eagerly.
  generate  prefill + sampling (greedy, temperature, top-k, top-p) + decoding, with a callback
            per token (the CLI streams the text) and the timings.

`longtrain generate` (flags, prompt file, streaming, --json) is `longtrain.cli.generate`.

With SparseK+SW or SW the cache holds at most k + w - 1 entries per layer whatever the prompt and
output length, so memory does not grow while generating; full attention keeps every key.
"""

from __future__ import annotations

import resource
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from longtrain.model import LM, ModelCache
from longtrain.model.chunks import PREFILL_CHUNK, ChunkReader, split_rows

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
