"""Document streams: B rows, each reading one document chunk by chunk.

Within a row, a chunk holds document tokens [o, o+L) as inputs and
[o+1, o+L+1) as targets; the next chunk starts at o+L. So every document
position is an input exactly once, and the last token of a document (EOD)
has no target (-100). A row never mixes two documents in one chunk: when its
document ends it pads, and in its next chunk it starts the next document with
`reset` set, telling the model to clear that row's cache first.

Order: the rows share one queue, a permutation of all documents drawn from
(seed, epoch); a row that finishes its document takes the next one. With W
data-parallel ranks of b rows each the stream has W·b global rows, global row
g = rank·b + r: every rank advances all of them (a few integers each) and
materialises only its own b rows. So W ranks × b rows read exactly the
documents one process with W·b rows reads, in the same rows, whatever the
number of documents; and the state is the same on every rank, which lets a run
resume with another W as long as W·b stays the same. A resumed run continues at
exactly the next token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np
import torch

from longtrain.errors import DataError

from .cache import TokenDocs

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
    # Over every rank's rows (the stream knows them all): targets, the loss's denominator, and input tokens.
    global_targets: int = -1  # -1: not known
    global_tokens: int = -1

    def to(self, device, non_blocking: bool = False) -> Chunk:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=non_blocking)
        return Chunk(**moved)

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


def count_tokens(lengths: np.ndarray, rows: list[tuple[int, int, bool] | None], chunk_size: int) -> tuple[int, int]:
    """(targets, input tokens) a chunk of these rows holds, from the document lengths alone."""
    targets = tokens = 0
    for row in rows:
        if row is not None:
            d, o, _ = row
            n = min(chunk_size, int(lengths[d]) - o)
            tokens += n
            targets += min(n, int(lengths[d]) - o - 1)  # a document's last token has no target
    return targets, tokens


class DocumentStream:
    """An endless stream of chunks over `docs`: this rank's `batch_rows` rows of `world_size · batch_rows`."""

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
        if len(docs) == 0:
            raise DataError("The stream has no documents to read; add documents to the corpus.")
        self.docs, self.batch_rows, self.chunk_size, self.pad_id = docs, batch_rows, chunk_size, pad_id
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.global_rows = batch_rows * world_size
        self.mine = range(rank * batch_rows, (rank + 1) * batch_rows)  # global row g = rank·b + r
        self.lengths = docs.lengths
        self.epoch, self.order_pos = 0, 0
        self._order = self._epoch_order(0)
        self.rows = [[-1, 0] for _ in range(self.global_rows)]  # per global row: document index, next offset

    def too_few_documents(self) -> str | None:
        """A warning when the corpus has fewer documents than rows (over all ranks), else None.

        Rows then read the same documents side by side (one document: every row the same
        tokens), so a step holds fewer distinct tokens than it counts.
        """
        n, rows = len(self.docs), self.global_rows
        if n >= rows:
            return None
        if self.world_size > 1:
            what = f"{rows} rows in total ({self.world_size} ranks × {self.batch_rows})"
            fix = f"lower ranks × train.batch_docs to {n} or less"
        else:
            what, fix = f"{rows} batch rows", f"lower train.batch_docs to {n}"
        return (
            f"the corpus has {n} training document{'s' if n != 1 else ''} for {what}, so rows "
            f"read the same documents side by side; {fix} or add documents"
        )

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))

    def _next_doc(self) -> int:
        if self.order_pos == len(self._order):
            self.epoch, self.order_pos = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        self.order_pos += 1
        return int(self._order[self.order_pos - 1])

    def next_chunk(self) -> Chunk:
        """This rank's rows of the next chunk; every global row advances, in order."""
        spec = []
        for row in self.rows:
            d, o = row
            reset = d < 0 or o >= self.lengths[d]
            if reset:
                d, o = self._next_doc(), 0
            spec.append((d, o, reset))
            row[0], row[1] = d, o + min(self.chunk_size, int(self.lengths[d]) - o)
        chunk = make_chunk(self.docs, [spec[g] for g in self.mine], self.chunk_size, self.pad_id)
        chunk.global_targets, chunk.global_tokens = count_tokens(self.lengths, spec, self.chunk_size)
        return chunk

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            yield self.next_chunk()

    def progress(self) -> dict:
        """For the trainer's display: epoch, documents started, and this rank's rows' positions."""
        rows = [
            {"doc": d, "offset": o, "len": int(self.lengths[d]) if d >= 0 else 0}
            for d, o in (self.rows[g] for g in self.mine)
        ]
        return {"epoch": self.epoch, "docs_started": self.order_pos, "docs": len(self.docs), "rows": rows}

    def state_dict(self) -> dict:
        """The whole stream (every global row): the same on every rank."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "order_pos": self.order_pos,
            "rows": [list(r) for r in self.rows],
            "n_docs": len(self.docs),
            "world_size": self.world_size,  # for the record; resuming needs only the same total rows
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for k in ("seed", "n_docs"):
            if state[k] != mine[k]:
                raise DataError(
                    f"The saved data stream has {k} = {state[k]}, this one {mine[k]}: "
                    "resume with the same corpus and seed."
                )
        if len(state["rows"]) != self.global_rows:
            saved_world = state.get("world_size", 1)
            raise DataError(
                f"The saved data stream has {len(state['rows'])} rows in total "
                f"({saved_world} rank{'s' if saved_world != 1 else ''} × {len(state['rows']) // saved_world}), "
                f"this one {self.global_rows} ({self.world_size} × {self.batch_rows}): resume with ranks × "
                f"train.batch_docs = {len(state['rows'])}."
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
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[Chunk]:
    """Every document (the first `max_docs`) once, in order, one document per row.

    Documents go in groups of `world_size · batch_rows` (global row g = rank · batch_rows + r;
    this rank gets its `batch_rows` of them); a group's rows run to the end of their documents
    (or their first `max_tokens`, rounded up to whole chunks), rows that finish early stay idle
    (length 0) until the longest one of the group ends. So every rank yields the same number of
    chunks (sharded models need every rank in every forward), some of them possibly all idle.
    """
    n = len(docs) if max_docs is None else min(max_docs, len(docs))
    width = batch_rows * world_size
    mine = slice(rank * batch_rows, (rank + 1) * batch_rows)
    for start in range(0, n, width):
        group = list(range(start, min(start + width, n)))
        read = [int(docs.lengths[d]) if max_tokens is None else min(int(docs.lengths[d]), max_tokens) for d in group]
        for o in range(0, max(read), chunk_size):
            spec = [(d, o, o == 0) if o < r else None for d, r in zip(group, read)]
            spec += [None] * (width - len(group))
            chunk = make_chunk(docs, spec[mine], chunk_size, pad_id)
            chunk.global_targets, chunk.global_tokens = count_tokens(docs.lengths, spec, chunk_size)
            yield chunk
