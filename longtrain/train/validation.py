"""Validation during `fit`: the held-out documents read chunk by chunk, as training reads them."""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from longtrain.data import IGNORE, PreparedCorpus, iter_valid_chunks
from longtrain.model import LM
from longtrain.model.chunks import ChunkReader
from longtrain.train import distributed
from longtrain.train.distributed import Ranks


@torch.no_grad()
def evaluate(
    model: LM, corpus: PreparedCorpus, cfg, device: torch.device, ranks: Ranks = Ranks(), *,
    autocast=nullcontext, cache_dtype: torch.dtype = torch.float32,
) -> float:
    """Validation loss over held-out documents, read chunk-recurrently like training.

    `autocast` and `cache_dtype`: the training's precision (the trainer passes its own). The summed
    loss stays on the device until the end (one host sync per pass).
    With several ranks each reads its rows of every group of documents, in lockstep (a sharded
    model needs every rank in every forward), and the token-weighted sums are added over the ranks.
    """
    model.eval()
    docs = len(corpus.valid) if cfg.valid_docs is None else min(cfg.valid_docs, len(corpus.valid))
    rows = max(1, min(cfg.batch_docs, math.ceil(docs / ranks.world_size)))
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    chunks = iter_valid_chunks(
        corpus.valid, cfg.chunk_size, batch_rows=rows, max_docs=cfg.valid_docs, max_tokens=cfg.valid_tokens,
        rank=ranks.rank, world_size=ranks.world_size,
    )
    sharded = distributed.is_sharded(model)
    busy = (c for c in chunks if sharded or c.lengths.numpy().any())  # idle rows skip a chunk (FSDP still joins in)

    def loss_pass(chunk, cache):
        with autocast():
            return model(chunk.tokens, cache=cache, lengths=chunk.lengths, targets=chunk.targets)

    reader = ChunkReader(model.empty_cache(rows, device=device, dtype=cache_dtype), device)
    for host, _, out in reader(busy, loss_pass):
        total += out.loss_sum.double()
        count += int((host.targets != IGNORE).sum())
    model.train()
    if ranks.parallel:
        sums = distributed.all_reduce_sum(torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=device)]))
        total, count = sums.tolist()
    else:
        total = float(total)
    return total / max(count, 1)
