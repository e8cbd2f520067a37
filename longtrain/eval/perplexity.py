"""Perplexity by absolute position: does the model use context beyond its window?

Each document is streamed through the model in chunks exactly as training reads it (the chunk
cache carried, absolute positions; `longtrain.data.iter_valid_chunks`, as `fit`'s validation). The
next-token loss at input position p (the prediction of token p + 1 from tokens 0..p) counts in
the bucket holding p: [0, 1024), [1024, 2048), [2048, 4096), ... doubling up to the longest
document. Every number is token-weighted: a bucket's loss is the mean over its tokens, and the
buckets' token counts add up to the total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from longtrain.console import plural
from longtrain.data import IGNORE, TokenDocs, iter_valid_chunks
from longtrain.eval.tasks import EvalContext, EvalOptions, EvalUsageError, Progress, Task, TaskResult, register
from longtrain.model.chunks import ChunkReader, resolve_chunk_size

FIRST_BUCKET = 1024


def bucket_edges(longest: int) -> list[int]:
    """[0, 1024, 2048, 4096, ...]: the last edge is the first at or beyond `longest` positions."""
    edges = [0, FIRST_BUCKET]
    while edges[-1] < longest:
        edges.append(edges[-1] * 2)
    return edges


def ppl(loss: float) -> float:
    return math.exp(min(loss, 700.0))


@dataclass
class PositionLoss:
    """Summed loss and token count per position bucket (float64 sums on the CPU)."""

    edges: list[int]

    def __post_init__(self):
        self.nll = np.zeros(len(self.edges) - 1)
        self.count = np.zeros(len(self.edges) - 1, dtype=np.int64)

    def add(self, positions: np.ndarray, nll: np.ndarray) -> None:
        """Losses `nll` [N] of predictions made at absolute positions `positions` [N]."""
        b = np.searchsorted(self.edges, positions, side="right") - 1  # bucket of each position
        if len(b) and (b.min() < 0 or b.max() >= len(self.count)):
            raise ValueError(f"position outside the buckets {self.edges[0]}..{self.edges[-1]}")
        np.add.at(self.nll, b, nll.astype(np.float64))
        np.add.at(self.count, b, 1)

    def result(self) -> dict:
        tokens = int(self.count.sum())
        loss = float(self.nll.sum() / max(tokens, 1))
        buckets = [
            {"start": int(s), "end": int(e), "tokens": int(n), "loss": float(nll / n), "ppl": ppl(float(nll / n))}
            for s, e, n, nll in zip(self.edges[:-1], self.edges[1:], self.count, self.nll)
            if n > 0
        ]
        return {"loss": loss, "ppl": ppl(loss), "tokens": tokens, "buckets": buckets}


@torch.no_grad()
def perplexity_by_position(
    model,
    docs: TokenDocs,
    *,
    chunk_size: int,
    max_docs: int | None = None,
    max_tokens: int | None = None,  # positions per document at most
    rows: int = 4,  # documents read side by side
    progress: Progress | None = None,
) -> dict:
    """Token-weighted loss and perplexity overall and per position bucket (see the module doc)."""
    n_docs = len(docs) if max_docs is None else min(max_docs, len(docs))
    if n_docs == 0:
        raise ValueError("no documents to evaluate")
    lengths = docs.lengths[:n_docs]
    read = lengths if max_tokens is None else np.minimum(lengths, max_tokens)
    acc = PositionLoss(bucket_edges(int(read.max())))
    if progress is not None:
        progress.start("perplexity", int(read.sum()))
    dev = model.embed.weight.device
    rows = max(1, min(rows, n_docs))
    reader = ChunkReader(model.empty_cache(rows, device=dev), dev)
    chunks = iter_valid_chunks(docs, chunk_size, batch_rows=rows, max_docs=n_docs, max_tokens=max_tokens)
    for chunk, _, out in reader(chunks, lambda c, cache: model.hidden(c.tokens, cache=cache, lengths=c.lengths)):
        pos = (chunk.doc_offset[:, None] + torch.arange(chunk_size)[None]).numpy()  # [B, C] absolute positions
        targets = chunk.targets.numpy()
        keep = targets != IGNORE
        if max_tokens is not None:
            keep &= pos < max_tokens  # iter_valid_chunks reads whole chunks
        for b in np.flatnonzero(keep.any(1)):  # one row at a time: no [B, C, V] logits
            logits = model.head(out.hidden[b, torch.from_numpy(keep[b]).to(dev)])
            logits = logits if logits.dtype == torch.float64 else logits.float()
            nll = F.cross_entropy(logits, torch.from_numpy(targets[b][keep[b]]).to(dev), reduction="none")
            acc.add(pos[b][keep[b]], nll.double().cpu().numpy())
            del logits, nll  # a row's [C, V] logits: gone before the next row's, and before the next chunk
        del out  # the chunk's hidden states, freed before the next chunk runs
        if progress is not None:
            progress.advance(int(keep.sum()))
    result = acc.result()
    result.update(documents=n_docs, chunk_size=chunk_size)
    return result


# ----------------------------------------------------------------------------- the eval task


def _span(start: int, end: int) -> str:
    def k(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"

    return f"[{k(start)}, {k(end)})"


def run(ctx: EvalContext) -> TaskResult:

    recipe, opts = ctx.ckpt.recipe, ctx.opts
    res = perplexity_by_position(
        ctx.ckpt.model, ctx.documents(), chunk_size=resolve_chunk_size(opts.chunk_size, recipe.train.chunk_size), max_docs=opts.docs,
        max_tokens=opts.tokens, rows=recipe.train.batch_docs, progress=ctx.progress,
    )
    rows = [(f"all positions ({plural(res['documents'], 'doc')})", f"{res['loss']:.4f} · ppl {res['ppl']:.2f} · {res['tokens']:,} tok")]
    for b in res["buckets"]:
        rows.append((f"positions {_span(b['start'], b['end'])}", f"{b['loss']:.4f} · ppl {b['ppl']:.2f} · {b['tokens']:,} tok"))
    return TaskResult(json=res, rows=rows)


def check(recipe, opts: EvalOptions) -> None:
    if opts.docs < 1:
        raise EvalUsageError(f"must be at least 1; got {opts.docs}", arg="docs")
    if opts.tokens is not None and opts.tokens < 2:
        raise EvalUsageError(f"must be at least 2 (a token and its successor); got {opts.tokens}", arg="tokens")
    if opts.chunk_size is not None and opts.chunk_size < 1:
        raise EvalUsageError(f"must be at least 1; got {opts.chunk_size}", arg="chunk_size")


def plot(fig, spec, entries: list[tuple[str, dict]]) -> None:
    """Loss against position bucket (log x), one line per checkpoint."""
    ax = fig.add_subplot(spec)
    for label, res in entries:
        b = res["buckets"]
        x = [max((r["start"] + r["end"]) / 2, 1) for r in b]
        ax.plot(x, [r["loss"] for r in b], marker="o", label=label)
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1024:g}k" if x >= 1024 else f"{x:g}"))
    ax.set_xlabel("position in the document (middle of each bucket)")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title("loss by position")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


register(Task("ppl", "perplexity by position", run, plot=plot, check=check, order=0, reads=("data", "docs", "tokens")))
