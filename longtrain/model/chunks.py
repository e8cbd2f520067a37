"""Reading documents chunk by chunk through the model's cache: the loop every reader shares.

Training, validation, the eval tasks, verify-equivalence and generation's prefill all read a
document the same way (Algorithm 3 of the paper): per chunk, the rows that start a new document
have their cache reset, the model runs on the chunk from the cache, and the cache it returns is
carried on to the next chunk. `ChunkReader` is that loop; each caller supplies only its pass over
one chunk (`forward(chunk, cache)`: a forward, a forward with the loss, or the trainer's training
pass, which a CUDA graph may replay), because that is what differs between them.

Carrying: full attention's cache grows with every chunk; rows that finished a document leave only
dead keys behind, so it is cut to the longest current document (read from the host copy of the
chunk, no device sync). A SparseK cache has a fixed size and is carried as it is.

Chunk size: a reader reads in the chunks it is asked for, else the run's training chunk
(`resolve_chunk_size`); generation's prefill reads at least PREFILL_CHUNK tokens at a time, and on a GPU a
fixed-size cache's prefill reads much longer chunks (`prefill_chunk_size`). Speed only: chunked and unchunked
reads give the same results (docs/DESIGN.md section 3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from longtrain.data.stream import IGNORE, Chunk
from longtrain.model.cache import ModelCache

PREFILL_CHUNK = 4096  # a prompt's chunks at least this long: fewer, larger launches
# A fixed-size cache's prefill on a GPU: a chunk holds about this many activation elements (tokens x d_model)
# over all its rows. In chunks of 8192 a prefill is launch-bound: at 12 x 768 on an H100 its kernels ran at most
# 35% of a 64k prefill's time (a one-off torch.profiler run), and benchmarks/generate.py read 81.6k tokens/s at 64k
# for SparseK+SW; in chunks of 65536, 0.79-0.89M at 64k-1M, ~2 GiB (benchmarks/README.md, issue 33).
PREFILL_GPU_ELEMENTS = 65536 * 1024


def resolve_chunk_size(requested: int | None, trained: int, *, prefill: bool = False) -> int:
    """The chunk a reader reads: `requested` (a --chunk-size flag), else the training chunk; a prefill
    reads at least PREFILL_CHUNK tokens at a time."""
    if requested:  # None: not asked for
        return requested
    return max(PREFILL_CHUNK, trained) if prefill else trained


def prefill_chunk_size(requested: int | None, trained: int, *, rows: int, d_model: int, attention: str,
                       device_type: str) -> int:
    """The chunk a prefill of `rows` prompts reads: `requested`, else at least resolve_chunk_size's, and on a GPU
    for a fixed-size cache (every type but full attention) a power of two with about PREFILL_GPU_ELEMENTS
    activations over the rows (65,536 tokens for one row at d_model 768 or 1024, 16,384 at 4096)."""
    base = resolve_chunk_size(requested, trained, prefill=True)
    if requested or device_type != "cuda" or attention == "full":  # asked for, or not launch-bound / an L x T mask
        return base
    tokens = PREFILL_GPU_ELEMENTS // max(d_model * max(rows, 1), 1)
    return max(base, 1 << max(tokens.bit_length() - 1, 0))


# One chunk (on the device) from a cache -> what the pass returns: anything with the next `.cache`
# (LMOutput, the trainer's ChunkResult).
Forward = Callable[[Chunk, ModelCache], Any]


def send(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device`. From the host to a GPU it goes from pinned memory without waiting: a copy
    from pageable memory would wait for the device to finish its queue (a host sync per chunk)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device(chunk: Chunk, device: torch.device) -> Chunk:
    """The chunk on `device` (each tensor through `send`)."""
    return Chunk(**{f.name: send(v, device) if isinstance(v := getattr(chunk, f.name), torch.Tensor) else v
                    for f in fields(chunk)})


def longest_document(host: Chunk) -> int:
    """Keys of the longest current document once the chunk is read (what a full-attention cache keeps)."""
    return int(np.max(host.doc_offset.numpy() + host.lengths.numpy(), initial=0))


def split_rows(ids: torch.Tensor, size: int, *, seen: torch.Tensor | None = None,
               lengths: torch.Tensor | None = None) -> Iterator[Chunk]:
    """ids [B, T] as chunks of `size` tokens: B rows, each continuing the document in its cache (an
    empty cache: from position 0). `seen` [B] (host): the tokens each row's cache holds already (None:
    none). `lengths` [B] (host): each row's tokens, the rest of it padding (None: every row T); a row
    that has ended reads chunks of 0 tokens, so padding never reaches its cache. Tokens and targets
    (the next tokens of the row, IGNORE past its end) stay on ids' device; the rows' lengths and
    positions are on the host, as the reader reads them."""
    B, T = ids.shape
    before = torch.zeros(B, dtype=torch.int64) if seen is None else seen.cpu().to(torch.int64)
    total = torch.full((B,), T, dtype=torch.int64) if lengths is None else lengths.cpu().to(torch.int64)
    for s in range(0, T, size):
        tokens = ids[:, s : s + size]  # [B, L]
        L = tokens.shape[1]
        n = (total - s).clamp(0, L)  # [B] this chunk's tokens per row
        targets = torch.full((B, L), IGNORE, dtype=torch.int64, device=ids.device)
        nxt = ids[:, s + 1 : s + 1 + L]
        targets[:, : nxt.shape[1]] = nxt
        has_next = torch.arange(L)[None] < (total - s - 1)[:, None]  # [B, L]: a row's last token predicts nothing
        targets = torch.where(has_next.to(ids.device), targets, IGNORE)
        yield Chunk(
            tokens=tokens, targets=targets, lengths=n,
            reset=torch.zeros(B, dtype=torch.bool), doc_index=torch.arange(B), doc_offset=before + s, doc_len=before + total,
        )


class ChunkReader:
    """Reads chunks through one model cache, carried from each chunk to the next (see the module doc).

    `reader.cache` is the cache the next chunk continues from: set it to start elsewhere (a resumed
    run's checkpoint), read it after the last chunk (prefill).
    """

    def __init__(self, cache: ModelCache, device: torch.device):
        self.cache = cache
        self.device = device

    def read(self, host: Chunk, forward: Forward) -> tuple[Chunk, Any]:
        """One chunk (host: as the data gave it, on the CPU): (the chunk on the device, what forward returned)."""
        chunk = to_device(host, self.device)
        if host.reset.numpy().any():  # a new document starts with an empty cache (read on the host copy)
            self.cache = self.cache.reset_rows(chunk.reset)
            if self.cache.grows:  # full attention: keep the longest current document's keys, not the reset rows'
                self.cache = self.cache.keep_last(int(np.max(host.doc_offset.numpy(), initial=0)))
        out = forward(chunk, self.cache)
        self.cache = self.carry(out.cache, host)
        return chunk, out

    def __call__(self, chunks: Iterable[Chunk], forward: Forward) -> Iterator[tuple[Chunk, Chunk, Any]]:
        """Every chunk in turn: (host chunk, device chunk, what forward returned)."""
        for host in chunks:
            chunk, out = self.read(host, forward)
            yield host, chunk, out
            del chunk, out  # freed before the next chunk runs (the caller drops its own references)

    @staticmethod
    def carry(cache: ModelCache, host: Chunk) -> ModelCache:
        """The cache the next chunk continues from: a full-attention cache cut to the longest current
        document (rows that finished one leave only dead keys behind); a fixed-size cache as it is."""
        return cache.keep_last(longest_document(host)) if cache.grows else cache
