"""Each rank's part of a checkpoint (the format: the package doc), and how a resume with another
number of ranks regroups the rows.

A run may resume with W' ranks × b' rows when W'·b' = W·b: every row keeps its document, its
position and its cache (new rank R' takes global rows R'·b' .. R'·b' + b' - 1, from whichever
saved ranks held them), so the data continues exactly. Any other change of rows is refused with a
message that says what matches and what does not. Checkpoints from before data parallelism (one
`cache.safetensors`, one RNG state) read as W = 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longtrain.train.checkpoint.storage import CheckpointError

OLD_CACHE = "cache"  # the single-process checkpoints' cache group, before ranks


def cache_group(rank: int) -> str:
    """The tensor group (file `<group>.safetensors`) of rank `rank`'s per-row caches."""
    return f"cache.rank{rank:05d}"


@dataclass(frozen=True)
class Layout:
    """How a run's rows are spread over its ranks."""

    world_size: int
    batch_docs: int  # rows per rank
    parallel: str = "ddp"

    @property
    def rows(self) -> int:
        return self.world_size * self.batch_docs

    def describe(self) -> str:
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        return f"{ranks} × {self.batch_docs} row{'s' if self.batch_docs != 1 else ''} = {self.rows} rows in total ({self.parallel})"

    def to_meta(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "batch_docs": self.batch_docs, "rows": self.rows, "parallel": self.parallel}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Layout:
        if "layout" in meta:
            d = meta["layout"]
            return cls(int(d["world_size"]), int(d["batch_docs"]), str(d.get("parallel", "ddp")))
        # written by one process before ranks existed: its rows are the stream's rows
        return cls(1, len(meta["data_stream"]["rows"]), "ddp")


def check_layout(saved: Layout, current: Layout, *, path: str | Path = "") -> None:
    """Refuse a resume whose total rows differ; the message says what matches and what does not."""
    if saved.rows == current.rows:
        return
    pairs = (("ranks", saved.world_size, current.world_size), ("train.batch_docs", saved.batch_docs, current.batch_docs))
    same = [f"{name} ({a})" for name, a, b in pairs if a == b]
    differ = [f"{name} ({a} vs {b})" for name, a, b in pairs if a != b] + [f"rows in total ({saved.rows} vs {current.rows})"]
    options = ", ".join(f"{n} × {saved.rows // n}" for n in range(1, saved.rows + 1) if saved.rows % n == 0)
    launch = (
        f"`torchrun --nproc_per_node {saved.world_size} -m longtrain.cli fit ... --set train.batch_docs={saved.batch_docs}`"
        if saved.world_size > 1 else f"`longtrain fit ... --set train.batch_docs={saved.batch_docs}` without torchrun"
    )
    raise CheckpointError(
        f"checkpoint {path} was written by {saved.describe()}; this run has {current.describe()}. "
        + (f"Same: {', '.join(same)}. " if same else "")
        + f"Different: {', '.join(differ)}. Every row carries its document's position and cache, so the rows in total "
        f"must stay {saved.rows}: resume with ranks × train.batch_docs = {saved.rows} ({options}; e.g. {launch}), "
        "or start a new run with {resume} never or another {run_dir}.", names=("resume", "run_dir"),
    )


def saved_groups_for(saved: Layout, meta: Mapping[str, Any], rank: int, batch_docs: int) -> list[str]:
    """The saved cache groups that hold global rows rank·batch_docs .. (rank+1)·batch_docs - 1."""
    if "layout" not in meta:
        return [OLD_CACHE]
    first, last = rank * batch_docs, (rank + 1) * batch_docs - 1
    return [cache_group(s) for s in range(first // saved.batch_docs, last // saved.batch_docs + 1)]


def cache_for_rank(
    parts: Mapping[str, Mapping[str, torch.Tensor]], saved: Layout, meta: Mapping[str, Any], rank: int, batch_docs: int
) -> dict[str, torch.Tensor]:
    """This rank's cache state_dict (rows rank·batch_docs ...) from the saved ranks' parts.

    Every cache tensor has one leading row per batch row, or G per row when score groups are
    folded into the batch (row b·G + g): the factor is read off each tensor.
    """
    groups = saved_groups_for(saved, meta, rank, batch_docs)
    first_saved = (rank * batch_docs) // saved.batch_docs if "layout" in meta else 0
    start = rank * batch_docs - first_saved * saved.batch_docs  # in rows of the concatenation
    out: dict[str, torch.Tensor] = {}
    for name in parts[groups[0]]:
        pieces = [parts[g][name] for g in groups]
        per_row = pieces[0].shape[0] // saved.batch_docs
        joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
        out[name] = joined[start * per_row : (start + batch_docs) * per_row].clone()
    return out


def rng_for_rank(meta: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """The RNG state rank `rank` resumes with: its own, or rank 0's when the run had fewer ranks.

    (RNG draws only feed dropout; with dropout, masks differ anyway once the ranks change.)
    """
    if "ranks" not in meta:
        return meta["rng"]
    states = meta["ranks"]
    return states[rank if rank < len(states) else 0]["rng"]
