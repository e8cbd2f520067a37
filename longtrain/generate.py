"""Generation from a trained model: chunked prefill of one or many prompts, then decoding them together.

  read_prompts  the prompts go through the model in chunks (as training reads a document), rows of
            different lengths side by side: a row's padding is masked (`lengths`), so it never enters
            that row's pool, threshold state, score statistics or position.
  prefill   read_prompts keeping each row's cache and the logits at its last prompt token.
  Sampler   the next token of every row on the device, with the row's own settings (greedy, or
            temperature, top-k, top-p and a seed): Gumbel-max with noise hashed from (seed, step,
            token id), so a row draws the same tokens alone or in a batch, eagerly or in a graph.
  Decoder   one step for every row: `LM.decode` (each row's query against its own cache, at its
            own position) and the sampler. On CUDA the whole step (every layer, the sampler, the
            cache written back into fixed buffers, the next token fed back) is one CUDA graph,
            replayed once per token with no host work in between; compile=True runs the step
            through torch.compile first (fused elementwise work: fewer kernels in the graph).
            Full attention's cache grows every step, so it runs eagerly.
  generate_batch  prefill + decoding until every row has stopped (its max_new_tokens, the
            end-of-document token, a stop text); the tokens are read back every `sync_every` steps.
  generate  one prompt (the CLI streams its text).

`longtrain generate` (flags, prompt files, streaming, JSONL) is `longtrain.cli.generate`; scripts use
`longtrain.load` (longtrain/api.py).

With SparseK+SW or SW the cache holds at most k + w - 1 entries per layer whatever the prompt and
output length, so memory does not grow while generating; full attention keeps every key.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from longtrain.device import warm_up_aside
from longtrain.model import LM, LMOutput, ModelCache
from longtrain.model.attention import rows_padded
from longtrain.model.attention_types import has_ring_layout
from longtrain.model.chunks import PREFILL_CHUNK, ChunkReader, prefill_chunk_size, split_rows
from longtrain.ops.sparsek_attention.decode import position_hash
from longtrain.train.metrics import peak_memory_bytes

STOP_REASONS = ("max_new_tokens", "end_of_document", "stop_text")


# ----------------------------------------------------------------------------- prefill


def pad_prompts(prompts: torch.Tensor | Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T] int64 on the host, padded with 0 after each row's end; lengths [B]) of B prompts."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompt ids must be [B, T]; got {tuple(prompts.shape)}")
        ids = prompts.to("cpu", torch.int64)
        lengths = torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64)
    else:
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        ids = torch.zeros(len(prompts), max(lengths.tolist(), default=0), dtype=torch.int64)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.as_tensor(p, dtype=torch.int64)
    if ids.shape[0] < 1:
        raise ValueError("no prompts")
    if int(lengths.min()) < 1:
        raise ValueError(f"prompt {int(lengths.argmin())} has no tokens")
    return ids, lengths


def read_prompts(
    model: LM,
    ids: torch.Tensor,  # [B, T] int64 on the host (pad_prompts)
    lengths: torch.Tensor,  # [B] tokens per row (the rest of the row is padding)
    *,
    chunk_size: int = PREFILL_CHUNK,
    cache: ModelCache | None = None,
) -> Iterator[tuple[int, torch.Tensor, LMOutput]]:
    """Every chunk of the prompts through the model: (start, valid tokens per row [B] on the host, LMOutput).

    A row whose prompt has ended reads chunks of 0 tokens: its cache (pool, threshold state, tail,
    score statistics, position) is left exactly as its last token left it, so each row's state
    equals reading that prompt alone. Only `hidden` is formed (no [chunk, V] logits).
    """
    dev = model.embed.weight.device
    reader = ChunkReader(cache if cache is not None else model.empty_cache(ids.shape[0], device=dev), dev)
    chunks = split_rows(ids, chunk_size, seen=None if cache is None else cache.seen, lengths=lengths)
    for start, host in zip(range(0, ids.shape[1], chunk_size), chunks):
        L = host.tokens.shape[1]
        full = bool((host.lengths == L).all())  # every row reads the whole chunk: no mask needed

        def forward(c, cache, full=full):
            with torch.no_grad():  # here, not on the generator: torch's generator wrapper keeps the last output alive
                return model.hidden(c.tokens, cache=cache, lengths=None if full else c.lengths)

        _, out = reader.read(host, forward)
        yield start, host.lengths, out
        del out  # the chunk's hidden states [B, L, d] and selections, freed before the next chunk runs


def prefill_chunk_for(model: LM, rows: int, requested: int | None = None, trained: int = 0) -> int:
    """The chunk a prefill of `rows` prompts reads with `model` on its device (model.chunks.prefill_chunk_size):
    `requested`, else at least the training chunk `trained`, and longer on a GPU for a fixed-size cache."""
    return prefill_chunk_size(requested, trained, rows=rows, d_model=model.cfg.d_model, attention=model.cfg.attention,
                              device_type=model.embed.weight.device.type)


@torch.no_grad()
def prefill(
    model: LM,
    prompts: torch.Tensor | Sequence[Sequence[int]],  # ids [B, T], or B token lists of any lengths
    *,
    chunk_size: int | None = None,  # None: prefill_chunk_size's for these rows on this device
    cache: ModelCache | None = None,
    on_chunk: Callable[[int], None] | None = None,  # called with the tokens done so far (of the longest row)
) -> tuple[ModelCache, torch.Tensor]:
    """(cache after the prompts, logits [B, V] at each row's last prompt token): the prompts read in chunks."""
    ids, lengths = pad_prompts(prompts)
    chunk_size = prefill_chunk_for(model, ids.shape[0], chunk_size)
    last = None  # [B, d] the final hidden state at each row's last token
    for s, n, out in read_prompts(model, ids, lengths, chunk_size=chunk_size, cache=cache):
        cache = out.cache
        if last is None:
            last = out.hidden.new_empty(ids.shape[0], out.hidden.shape[-1])
        ends = ((lengths > s) & (lengths <= s + n.max())).nonzero()[:, 0]  # rows whose prompt ends in this chunk
        if len(ends):
            idx = ends.to(last.device)
            last[idx] = out.hidden[idx, (lengths[ends] - s - 1).to(last.device)]
        del out  # only its cache goes on: a long prompt's peak holds one chunk's activations, not two
        if on_chunk is not None:
            on_chunk(s + int(n.max()))
    return cache, model.head(last)


# ----------------------------------------------------------------------------- sampling


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def problems(self) -> list[tuple[str, str]]:
        """(setting, what is wrong with it) for each setting out of range."""
        out = []
        if not self.temperature >= 0:
            out.append(("temperature", f"must be >= 0 (0 = greedy); got {self.temperature}"))
        if self.top_k < 0:
            out.append(("top_k", f"must be >= 0 (0 = off); got {self.top_k}"))
        if not 0 < self.top_p <= 1:
            out.append(("top_p", f"must be in (0, 1] (1 = off); got {self.top_p}"))
        return out


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] float64 from a counter hash of (seed [B], step [B], token id): the same
    numbers on every device and in any batch, with no generator state (so a CUDA graph can hold it)."""
    key = position_hash(position_hash(seed) ^ step)  # [B] one stream per (seed, step)
    bits = position_hash(key[:, None] + torch.arange(vocab, device=seed.device)[None])  # [B, V] 63 random bits
    u = ((bits >> 10).to(torch.float64) + 0.5) * 2.0**-53  # uniform in (0, 1), exact in float64
    return -torch.log(-torch.log(u))


class Sampler:
    """The next token of each row from logits [B, V], with the row's own settings (device tensors).

    Greedy rows take the argmax. The others draw from softmax(logits / temperature) restricted to
    the top-k tokens and then to the smallest set of likeliest tokens holding mass top_p (the most
    likely token always stays), by Gumbel-max: argmax(z + G) with G = gumbel_noise(seed, step).
    Static shapes, no host synchronisation: a CUDA graph can hold it.
    """

    def __init__(self, settings: Sequence[Sampling], device: torch.device | str):
        problems = [f"row {i}: {name} {p}" for i, s in enumerate(settings) for name, p in s.problems()]
        if problems:
            raise ValueError("; ".join(problems))
        t = dict(device=device)
        self.temperature = torch.tensor([s.temperature for s in settings], dtype=torch.float64, **t)  # [B]
        self.top_k = torch.tensor([s.top_k for s in settings], dtype=torch.int64, **t)
        self.top_p = torch.tensor([s.top_p if s.top_p < 1 else torch.inf for s in settings], dtype=torch.float64, **t)
        self.seed = torch.tensor([s.seed for s in settings], dtype=torch.int64, **t)
        self.random = any(s.temperature > 0 for s in settings)  # decided once: the step's ops are fixed
        self.filters = any(s.temperature > 0 and (s.top_k > 0 or s.top_p < 1) for s in settings)

    def __call__(self, logits: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Tokens [B] int64 from logits [B, V] at each row's step [B] (tokens it has sampled so far)."""
        greedy = logits.argmax(-1)
        if not self.random:
            return greedy
        z = logits.to(torch.float64) / self.temperature.clamp(min=1e-6)[:, None]  # [B, V]
        if self.filters:
            z = self._filter(z)
        drawn = (z + gumbel_noise(self.seed, step, z.shape[-1])).argmax(-1)
        return torch.where(self.temperature > 0, drawn, greedy)

    def _filter(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, V] with -inf outside each row's top-k and top-p set (ties at the edge stay)."""
        V = z.shape[-1]
        sz = z.sort(-1, descending=True).values  # [B, V]
        rank = torch.arange(V, device=z.device)[None]
        k = torch.where(self.top_k > 0, self.top_k.clamp(max=V), V)[:, None]  # [B, 1]
        in_k = rank < k
        p = torch.where(in_k, sz, -torch.inf).softmax(-1)
        keep = in_k & (p.cumsum(-1) - p < self.top_p[:, None])  # the mass before a token is below top_p
        edge = torch.where(keep, sz, torch.inf).amin(-1, keepdim=True)  # the smallest kept logit
        return torch.where(z >= edge, z, -torch.inf)


def sample(logits: torch.Tensor, opts: Sampling, step: int = 0) -> torch.Tensor:
    """Next tokens [B] from logits [B, V], every row with the same settings (the Sampler, eagerly)."""
    B = logits.shape[0]
    return Sampler([opts] * B, logits.device)(logits, torch.full((B,), step, dtype=torch.int64, device=logits.device))


# ----------------------------------------------------------------------------- decoding


def in_place_by_default(attention: str, device_type: str) -> bool:
    """Decoder's in_place where it was measured faster: on CUDA, for every attention with a ring layout (an H100, one
    and 64 rows, graph and compiled: benchmarks/README.md, issue 33). On the CPU not measured at a real size (the
    rebuilt cache stays)."""
    return has_ring_layout(attention) and device_type == "cuda"


# Inductor settings of the compiled step on CUDA: freezing folds the weights into the graph as constants (q/k/v and
# gate/up become one product each) and combo kernels fuse the step's small independent kernels. On an H100,
# SparseK+SW 12 x 768 one row: 984 tokens/s with Inductor's defaults, 1,070 with freezing, 1,406 with both
# (benchmarks/README.md, issue 33). A frozen step reads the weights as they were when it compiled.
COMPILE_OPTIONS = {"freezing": True, "combo_kernels": True}


def exact_step(model: LM, tokens: torch.Tensor, cache: ModelCache, **kw) -> LMOutput:
    """tokens [B] read as a one-token chunk of the chunked forward (Decoder's exact step): its attention, selection
    and, through rows_padded, its matrix products' rows (a GEMM's bits can depend on its row count)."""
    with rows_padded():
        return model(tokens[:, None], cache=cache, **kw)


class Decoder:
    """Decodes one token per row per step from a prefilled cache, sampling on the device.

    `start(logits)` samples every row's first token from the prefill's logits; each `advance()` then
    feeds the last sampled tokens through the model and samples the next ones ([B] on the device).
    `step(tokens)` feeds given tokens instead and returns the logits [B, V].

    cuda_graph captures the whole step once and replays it: the cache lives in fixed buffers that
    each replay updates in place, and the sampled tokens are written into the buffer the next
    replay reads. None (the default): on CUDA unless the model uses full attention, and if the
    capture fails, eager decoding with the reason in `graph_error` (True: fail). compile: the step
    through torch.compile (before the capture; on CUDA with COMPILE_OPTIONS); a compile that fails falls back the
    same way.

    in_place (SparseK and SW caches): the decoder keeps the cache in the ring layout (SparseKRingCache): each
    step writes its token's K/V into the tail slot of the token leaving the window and an admitted key into the
    evicted key's pool slot, in place, instead of rebuilding the tail and pool (the whole cache) every step;
    `cache` gives it back in the chunk op's layout. The same tokens; logits to rounding (keys summed in
    another order). None (the default): `in_place_by_default`.

    exact: each step reads its token as a one-token chunk of the chunked forward (the selection scan and the chunk
    op's kernels; its products as rows of 1,024, rows_padded), so the attention and selection are the forward's own;
    the logits are its bits where the forward's products round as 1,024 rows do (the CPU, 4 x 128 on an H200; not
    768 wide there against a short forward: docs/VERBS.md). The
    fast step computes its query's attention in float32 (more precise, not the same bits: a near-tie can then select
    another key). Eager, no graph, no compile,
    no ring layout: far slower (benchmarks/README.md, issue 33), a way to check, not to serve.
    """

    def __init__(self, model: LM, cache: ModelCache, *, sampling: Sampling | Sequence[Sampling] | None = None,
                 cuda_graph: bool | None = None, compile: bool = False, in_place: bool | None = None,
                 exact: bool = False):
        if exact and (cuda_graph or compile or in_place):
            raise ValueError("exact decoding steps the chunked forward eagerly: drop cuda_graph, compile and in_place")
        self.model, self.exact = model, exact
        self._cache = cache
        B = cache.batch_size
        dev = model.embed.weight.device
        settings = list(sampling) if isinstance(sampling, Sequence) else [sampling or Sampling()] * B
        if len(settings) != B:
            raise ValueError(f"{len(settings)} sampling settings for {B} rows")
        self.sampler = Sampler(settings, dev)
        self.tokens = torch.zeros(B, dtype=torch.int64, device=dev)  # [B] what the next step reads
        self.steps = torch.zeros(B, dtype=torch.int64, device=dev)  # [B] tokens sampled so far (the noise's counter)
        self.logits: torch.Tensor | None = None  # [B, V] of the last step
        self.graph, self.graph_error, self.compiled = None, None, False
        self._fn = self._decode_and_sample
        on_cuda = dev.type == "cuda"
        fixed = model.cfg.attention != "full"
        if cuda_graph and not (on_cuda and fixed):
            raise ValueError("a CUDA graph needs a CUDA model whose cache has a fixed size (not full attention)")
        if exact:
            cuda_graph, in_place = False, False
        if in_place is None:
            in_place = in_place_by_default(model.cfg.attention, dev.type)
        if in_place and not has_ring_layout(model.cfg.attention):
            raise ValueError("in_place needs sparsek, sparsek+sw or sw attention (a plain SparseK cache)")
        if in_place:
            self._cache = cache.to_ring()  # its own tail and pool (what steps write in place): the caller's stays
        self.in_place = in_place
        try:
            if compile:
                self._fn = torch.compile(self._decode_and_sample, dynamic=False, options=COMPILE_OPTIONS if on_cuda else None)
                self.compiled = True
            if cuda_graph or (cuda_graph is None and on_cuda and fixed):
                self._capture()
        except Exception as e:  # e.g. an op that cannot be captured or compiled: decoding still works, eagerly
            if cuda_graph:
                raise
            self._fn, self.compiled = self._decode_and_sample, False
            self.graph, self.graph_error = None, f"{type(e).__name__}: {e}"
            warnings.warn(f"decoding eagerly, the step's capture failed: {self.graph_error}", stacklevel=2)

    @property
    def cache(self) -> ModelCache:
        """The cache after the last step, in the chunk op's layout."""
        return self._cache.from_ring() if self.in_place else self._cache

    @property
    def cache_grows(self) -> bool:
        return self._cache.grows

    def _decode_and_sample(self, tokens: torch.Tensor, cache: ModelCache, steps: torch.Tensor):
        """One step, functional: (next cache, logits [B, V], sampled tokens [B])."""
        out = exact_step(self.model, tokens, cache) if self.exact else self.model.decode(tokens, cache)
        logits = out.logits[:, 0]
        return out.cache, logits, self.sampler(logits, steps)

    @torch.no_grad()
    def start(self, logits: torch.Tensor) -> torch.Tensor:
        """Every row's first token [B] from the prefill's logits [B, V]; the next advance() feeds it."""
        first = self.sampler(logits, self.steps)
        self.tokens.copy_(first)
        self.steps.add_(1)
        return first

    @torch.no_grad()
    def advance(self) -> torch.Tensor:
        """Feed the last sampled tokens; the next ones [B] (a copy: the next step overwrites the buffer)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._cache, self.logits, nxt = self._fn(self.tokens, self._cache, self.steps)
            self.tokens.copy_(nxt)
            self.steps.add_(1)
        return self.tokens.clone()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token after `tokens` [B] (a copy)."""
        self.tokens.copy_(tokens)
        self.advance()
        return self.logits.clone()

    @torch.no_grad()
    def _capture(self) -> None:
        # The graph updates its cache in place: it gets its own copy, the caller's cache stays as it was.
        static = self._cache = self._cache.clone()
        with warm_up_aside(self.tokens.device):  # warm up off the capture (compiles; the step is functional: nothing changes,
            for _ in range(2):  # except, in_place, the K/V it writes: on a scratch copy then)
                self._fn(self.tokens, static.clone() if self.in_place else static, self.steps)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            nxt_cache, logits, nxt = self._fn(self.tokens, static, self.steps)
            static.copy_(nxt_cache)  # the next cache, in place
            self.tokens.copy_(nxt)  # fed to the next replay
            self.steps.add_(1)
        self.graph, self.logits = graph, logits


# ----------------------------------------------------------------------------- text streaming


class TextStream:
    """Turns tokens into text as they come, holding back a split multi-byte character.

    skip_special_tokens: leave out the text of special tokens (the end-of-document token), as
    `tokenizer.decode` does by default and so a Completion's `text`; the stop check keeps them."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.shown = 0  # characters of decode(ids) already handed out

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""  # a character's bytes span tokens: wait for the rest
        new = text[self.shown :]
        if len(self.ids) > 64 and new:  # start over now and then, so decoding stays short
            self.ids, self.shown = [], 0
        else:
            self.shown = len(text)
        return new


class ShownText:
    """One row's text for a terminal as its tokens come: in the end exactly the Completion's `text`.

    A stop text may span tokens, so text that could be the start of one is held back until later tokens
    show it is not; once a stop text appears nothing from it on is shown. `finish(text)` hands out the
    rest of the row's final text (what was held back at the end). Special tokens are left out, as in `text`.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.stream = TextStream(tokenizer, skip_special_tokens=True)
        self.stop = [s for s in stop if s]
        self.pending = ""  # decoded but not shown: it could be the start of a stop text (at most the longest one)
        self.pieces: list[str] = []  # what was handed out
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.pending += self.stream.push(token)
        # No stop text starts in what was shown (its end would have been held back), so only `pending` is searched.
        at = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if at:
            self.stopped = True
            return self._show(min(at))
        return self._show(len(self.pending) - held_back(self.pending, self.stop))

    def finish(self, text: str | None = None) -> str:
        """The rest of the row's final `text` (default: what the tokens decode to, cut before a stop text)."""
        shown = "".join(self.pieces)
        text = shown + ("" if self.stopped else self.pending) if text is None else text
        self.pending, self.stopped = "", True
        if not text.startswith(shown):  # cannot happen: what was shown is the start of the text
            return ""
        rest = text[len(shown):]
        self.pieces.append(rest)
        return rest

    def _show(self, n: int) -> str:
        new, self.pending = self.pending[:n], self.pending[n:]
        if new:
            self.pieces.append(new)
        return new


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop text (0: none)."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


# ----------------------------------------------------------------------------- generate


@dataclass
class Completion:
    """One prompt's continuation."""

    prompt_tokens: int
    tokens: list[int]  # the generated tokens (through the one that stopped the row)
    stopped: str  # one of STOP_REASONS
    text: str | None = None  # with a tokenizer: the tokens' text, cut before a stop text


@dataclass
class Generation:
    """What generate_batch returns: each row's completion and the batch's timings and memory."""

    rows: list[Completion]
    prefill_seconds: float
    decode_seconds: float  # the first token's sampling included (on CUDA: the graph's capture is not)
    capture_seconds: float
    decode_steps: int  # steps the batch ran (rows that stopped early ride along until the last one stops)
    peak_memory_bytes: int  # CUDA: peak allocated by tensors; CPU: the process's peak resident memory
    kv_entries_per_layer: int  # per row, at the end
    cache_bytes: int  # the whole cache, at the end
    cache_grows: bool
    extra: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.rows)

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens (all rows) per second of decoding."""
        return self.new_tokens / max(self.decode_seconds, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _RowStop:
    """One row's stop conditions, checked on the host as its tokens come back."""

    def __init__(self, max_new_tokens: int, eod_id: int | None, stop: Sequence[str], tokenizer):
        if stop and tokenizer is None:
            raise ValueError("stop texts need the tokenizer (to read the text)")
        self.max_new, self.eod_id, self.stop = max_new_tokens, eod_id, [s for s in stop if s]
        self.stream = TextStream(tokenizer) if self.stop else None
        self.text = ""  # the text so far (only kept to find stop texts)
        self.tokens: list[int] = []
        self.stopped: str | None = None

    def push(self, token: int) -> None:
        self.tokens.append(token)
        if self.stream is not None:
            new = self.stream.push(token)
            start = max(len(self.text) - max(len(s) for s in self.stop) + 1, 0)  # a stop text may span the pieces
            self.text += new
            if new and any(s in self.text[start:] for s in self.stop):
                self.stopped = "stop_text"
                return
        if self.eod_id is not None and token == self.eod_id:
            self.stopped = "end_of_document"
        elif len(self.tokens) >= self.max_new:
            self.stopped = "max_new_tokens"


def _per_row(value, B: int, name: str) -> list:
    rows = list(value) if isinstance(value, (list, tuple)) else [value] * B
    if len(rows) != B:
        raise ValueError(f"{name}: {len(rows)} values for {B} prompts")
    return rows


@torch.no_grad()
def generate_batch(
    model: LM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: Sampling | Sequence[Sampling] | None = None,
    stop: Sequence[str] | Sequence[Sequence[str]] = (),  # stop texts (one list for all rows, or one per row)
    eod_id: int | None = None,  # a row stops after this token (None: never)
    tokenizer=None,  # needed for stop texts; with it every row's `text` is filled in
    chunk_size: int | None = None,  # the prefill's (None: prefill_chunk_size's)
    cuda_graph: bool | None = None,
    compile: bool = False,
    in_place: bool | None = None,  # Decoder's: the cache's ring layout (None: where measured faster)
    exact: bool = False,  # Decoder's: every step through the chunked forward (its attention and selection; slower)
    sync_every: int | None = None,  # steps between reads of the tokens (default: 1 on the CPU, 8 on CUDA)
    on_token: Callable[[int, int], None] | None = None,  # (row, token) as the tokens are read back
    on_prefill: Callable[[int], None] | None = None,
) -> Generation:
    """Prefill the prompts side by side, then decode them together until every row has stopped.

    Each row gets the same tokens as generating it alone: its cache holds its prompt only, it decodes
    at its own position, and its sampling noise depends on its seed and step only (greedy rows: the
    argmax, identical up to the rounding of batched matmuls).
    """
    B = len(prompts)
    max_new = _per_row(max_new_tokens, B, "max_new_tokens")
    if min(max_new, default=1) < 1:
        raise ValueError(f"max_new_tokens must be at least 1; got {min(max_new)}")
    stops = [list(s) for s in stop] if stop and not isinstance(stop[0], str) else [list(stop)] * B
    if len(stops) != B:
        raise ValueError(f"stop: {len(stops)} lists for {B} prompts")
    rows = [_RowStop(m, eod_id, s, tokenizer) for m, s in zip(max_new, stops)]
    settings = _per_row(sampling or Sampling(), B, "sampling")
    dev = model.embed.weight.device
    sync_every = sync_every or (8 if dev.type == "cuda" else 1)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    t0 = time.perf_counter()
    cache, logits = prefill(model, prompts, chunk_size=chunk_size, on_chunk=on_prefill)
    _sync(dev)
    t1 = time.perf_counter()
    decoder = Decoder(model, cache, sampling=settings, cuda_graph=cuda_graph, compile=compile, in_place=in_place,
                      exact=exact)
    _sync(dev)
    t2 = time.perf_counter()

    pending = [decoder.start(logits)]  # [B] per step, on the device until read back
    steps, longest = 1, max(max_new)
    while True:
        if len(pending) >= sync_every or steps >= longest:
            block = torch.stack(pending, 1).tolist()  # [B, n]: one host read for n steps
            for r, row in enumerate(rows):
                for token in block[r]:
                    if row.stopped is not None:
                        break  # the tokens a stopped row rode along with are dropped
                    row.push(token)
                    if on_token is not None:
                        on_token(r, token)
            pending = []
            if all(row.stopped for row in rows):
                break
        pending.append(decoder.advance())
        steps += 1
    _sync(dev)
    t3 = time.perf_counter()
    cache = decoder.cache
    done = [
        Completion(prompt_tokens=len(p), tokens=row.tokens, stopped=row.stopped,
                   text=None if tokenizer is None else _cut(tokenizer.decode(row.tokens), row.stop))
        for p, row in zip(prompts, rows)
    ]
    return Generation(
        rows=done, prefill_seconds=t1 - t0, decode_seconds=t3 - t2, capture_seconds=t2 - t1, decode_steps=steps,
        peak_memory_bytes=peak_memory_bytes(dev), kv_entries_per_layer=cache.kv_entries_per_layer,
        cache_bytes=cache.nbytes(), cache_grows=decoder.cache_grows,
        extra={"overflowed": cache.overflowed(), "cuda_graph": decoder.graph is not None,
               "compiled": decoder.compiled, "in_place": decoder.in_place, "exact": decoder.exact,
               "cuda_graph_error": decoder.graph_error},
    )


def _cut(text: str, stop: Sequence[str]) -> str:
    """text up to the first stop text (all of it when none occurs)."""
    at = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(at)] if at else text


@torch.no_grad()
def generate(
    model: LM,
    prompt: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    on_token: Callable[[int], None] | None = None,
    **kwargs,
) -> Generation:
    """One prompt: generate_batch with one row (on_token gets the token alone)."""
    return generate_batch(model, [prompt], max_new_tokens=max_new_tokens, sampling=sampling,
                          on_token=None if on_token is None else lambda _row, t: on_token(t), **kwargs)
