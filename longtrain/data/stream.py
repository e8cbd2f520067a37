"""Document streams: B rows, each reading one document chunk by chunk.

Within a row, a chunk holds document tokens [o, o+L) as inputs and
[o+1, o+L+1) as targets; the next chunk starts at o+L. So every document
position is an input exactly once, and the last token of a document (EOD)
has no target (-100). A row never mixes two documents in one chunk: when its
document ends it pads, and in its next chunk it starts the next document with
`reset` set, telling the model to clear that row's cache first.

Order: each rank takes documents rank, rank+W, rank+2W, ... (disjoint, no
coordination) and reads them in a permutation drawn from (seed, epoch); the
rows share that queue. The state is a few integers, so a resumed run
continues at exactly the next token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np
import torch

from .cache import TokenDocs
from .errors import DataError

IGNORE = -100  # target of padding and of a document's last token (torch's cross_entropy default)


@dataclass
class Chunk:
    tokens: torch.Tensor  # [B, L] int64 inputs, padded with pad_id
    targets: torch.Tensor  # [B, L] int64 next tokens, IGNORE where there is none
    lengths: torch.Tensor  # [B] int64 valid input tokens per row (0: the row is idle)
    reset: torch.Tensor  # [B] bool: the row starts a new document in this chunk
    doc_index: torch.Tensor  # [B] int64 index into the documents (-1: idle row)
    doc_offset: torch.Tensor  # [B] int64 position in the document of the chunk's first token
    doc_len: torch.Tensor  # [B] int64 length of the row's document

    def to(self, device, non_blocking: bool = False) -> Chunk:
        return Chunk(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    @property
    def n_targets(self) -> int:
        return int((self.targets != IGNORE).sum())


def make_chunk(docs: TokenDocs, rows: list[tuple[int, int, bool] | None], chunk_size: int, pad_id: int) -> Chunk:
    """A chunk from per-row (document index, offset, reset), or None for an idle row."""
    B = len(rows)
    tokens = np.full((B, chunk_size), pad_id, dtype=np.int64)
    targets = np.full((B, chunk_size), IGNORE, dtype=np.int64)
    meta = np.zeros((5, B), dtype=np.int64)  # lengths, reset, doc_index, doc_offset, doc_len
    meta[2] = -1
    for b, row in enumerate(rows):
        if row is None:
            continue
        d, o, reset = row
        doc = docs.doc(d)
        n = min(chunk_size, len(doc) - o)
        window = doc[o : o + n + 1]  # inputs plus the one token after them
        tokens[b, :n] = window[:n]
        targets[b, : len(window) - 1] = window[1:]
        meta[:, b] = (n, reset, d, o, len(doc))
    t = torch.from_numpy
    return Chunk(t(tokens), t(targets), t(meta[0]), t(meta[1]).bool(), t(meta[2]), t(meta[3]), t(meta[4]))


class DocumentStream:
    """An endless stream of chunks over `docs` for `batch_rows` rows."""

    def __init__(
        self,
        docs: TokenDocs,
        *,
        batch_rows: int,
        chunk_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        pad_id: int = 0,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.docs, self.batch_rows, self.chunk_size, self.pad_id = docs, batch_rows, chunk_size, pad_id
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.lengths = docs.lengths
        self.shard = np.arange(rank, len(docs), world_size)
        if len(self.shard) == 0:
            raise DataError(
                f"Rank {rank} of {world_size} gets no documents: the corpus has only {len(docs)}. "
                "Use fewer ranks or more documents."
            )
        self.epoch, self.order_pos = 0, 0
        self._order = self._epoch_order(0)
        self.rows = [[-1, 0] for _ in range(batch_rows)]  # per row: document index, next offset

    def too_few_documents(self) -> str | None:
        """A warning when this rank has fewer documents than batch rows, else None.

        Rows then read the same documents side by side (one document: every row the same
        tokens), so a step holds fewer distinct tokens than it counts.
        """
        n, rows = len(self.shard), self.batch_rows
        if n >= rows:
            return None
        where = f" on rank {self.rank} of {self.world_size}" if self.world_size > 1 else ""
        return (
            f"the corpus has {n} training document{'s' if n != 1 else ''}{where} for {rows} batch rows, so rows "
            f"read the same documents side by side; lower train.batch_docs to {n} or add documents"
        )

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return self.shard[np.random.default_rng([self.seed, epoch]).permutation(len(self.shard))]

    def _next_doc(self) -> int:
        if self.order_pos == len(self._order):
            self.epoch, self.order_pos = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        self.order_pos += 1
        return int(self._order[self.order_pos - 1])

    def next_chunk(self) -> Chunk:
        spec = []
        for row in self.rows:
            d, o = row
            reset = d < 0 or o >= self.lengths[d]
            if reset:
                d, o = self._next_doc(), 0
            spec.append((d, o, reset))
            row[0], row[1] = d, o + min(self.chunk_size, int(self.lengths[d]) - o)
        return make_chunk(self.docs, spec, self.chunk_size, self.pad_id)

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            yield self.next_chunk()

    def progress(self) -> dict:
        """For the trainer's display: epoch, documents started of this rank's shard, per-row position."""
        rows = [
            {"doc": d, "offset": o, "len": int(self.lengths[d]) if d >= 0 else 0} for d, o in self.rows
        ]
        return {"epoch": self.epoch, "docs_started": self.order_pos, "docs": len(self.shard), "rows": rows}

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "order_pos": self.order_pos,
            "rows": [list(r) for r in self.rows],
            "n_docs": len(self.docs),
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for k in ("seed", "n_docs", "rank", "world_size"):
            if state[k] != mine[k]:
                raise DataError(
                    f"The saved data stream has {k} = {state[k]}, this one {mine[k]}: "
                    "resume with the same corpus, seed and number of ranks."
                )
        if len(state["rows"]) != self.batch_rows:
            raise DataError(
                f"The saved data stream has {len(state['rows'])} rows, this one {self.batch_rows}: "
                "resume with the same batch size."
            )
        self.epoch, self.order_pos = int(state["epoch"]), int(state["order_pos"])
        self._order = self._epoch_order(self.epoch)
        self.rows = [[int(d), int(o)] for d, o in state["rows"]]


def iter_valid_chunks(
    docs: TokenDocs,
    chunk_size: int,
    *,
    batch_rows: int = 1,
    max_docs: int | None = None,
    max_tokens: int | None = None,
    pad_id: int = 0,
) -> Iterator[Chunk]:
    """Every document (the first `max_docs`) once, in order, one document per row.

    Documents go in groups of `batch_rows`; a group's rows run to the end of
    their documents (or their first `max_tokens`, rounded up to whole chunks),
    rows that finish early stay idle (length 0) until the longest one ends.
    """
    n = len(docs) if max_docs is None else min(max_docs, len(docs))
    for start in range(0, n, batch_rows):
        group = list(range(start, min(start + batch_rows, n)))
        read = [int(docs.lengths[d]) if max_tokens is None else min(int(docs.lengths[d]), max_tokens) for d in group]
        for o in range(0, max(read), chunk_size):
            spec = [(d, o, o == 0) if o < r else None for d, r in zip(group, read)]
            spec += [None] * (batch_rows - len(group))
            yield make_chunk(docs, spec, chunk_size, pad_id)
