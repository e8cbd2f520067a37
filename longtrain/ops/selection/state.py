"""The selection's data, in one array form: what a row carries between chunks, one chunk's keys, what a scan returns.

Every scan (naive.py, host.py, device.py) reads a ThresholdState and an ExtendedScores and returns a
ScanResult; SparseKCache (the attention's per-layer cache) is a SelectionState plus K and V, so the
cache's own tensors are the state the scans read, on whatever device they live on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

INF = math.inf


def default_threshold_cap(topk: int) -> int:
    """Room for the scores above tau: at most k are saturated, the fractional set is a few k."""
    return max(8 * topk, 1024)


def size_field(**kw):
    """A dataclass field that is a size (a Python int known on the host), not a tensor: no host sync reads it."""
    return field(kw_only=True, metadata={"size": True}, **kw)


class _Tensors:
    """Dataclasses of tensors: their fields as a dict, moved or saved together (size fields travel beside them)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("size")}

    def sizes(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("size")}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().contiguous() for name, t in self.tensors().items()}

    @classmethod
    def from_state_dict(cls, d: dict[str, torch.Tensor]):
        missing = [f.name for f in fields(cls) if f.name not in d]
        if missing:
            raise KeyError(f"{cls.__name__} state is missing {missing}")
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def to(self, device):
        return type(self)(**{name: t.to(device) for name, t in self.tensors().items()}, **self.sizes())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass
class ThresholdState(_Tensors):
    """Per row, the scores still above tau (no K/V): the SparseK threshold's state after positions [0, t)."""

    thr_u: torch.Tensor  # [B, cap] float64: the scores, first thr_count valid
    thr_saturated: torch.Tensor  # [B, cap] bool: the score is saturated (p = 1)
    thr_count: torch.Tensor  # [B] int64
    tau: torch.Tensor  # [B] float64: the current tau (-inf while |C| <= k)
    thr_sum: torch.Tensor  # [B] float64: running sum of the fractional (non-saturated) scores
    overflow: torch.Tensor  # [B] int64: scores dropped at the cap (tau is no longer exact when > 0)

    @property
    def cap(self) -> int:
        return self.thr_u.shape[1]

    @property
    def overflowed(self) -> bool:
        """The state hit its cap at some point: tau is no longer exact (never silent; a host sync)."""
        return bool((self.overflow > 0).any())

    def threshold(self) -> "ThresholdState":
        """The threshold fields alone (views)."""
        return ThresholdState(**{f.name: getattr(self, f.name) for f in fields(ThresholdState)})


@dataclass
class SelectionState(ThresholdState):
    """What a row's selection carries from one chunk to the next, after positions [0, t) (DESIGN.md section 3):
    the threshold state, the pool's and tail's scores and positions, and t. SparseKCache adds their K and V."""

    pool_u: torch.Tensor  # [B, K] scores of the top-k candidates (positions <= t - max(w, 1)); -inf in empty slots
    pool_pos: torch.Tensor  # [B, K] int64 their positions (-1 in empty slots)
    tail_u: torch.Tensor  # [B, W-1] scores of positions t-(W-1) .. t-1 (slot s <-> position t-(W-1)+s)
    seen: torch.Tensor  # [B] int64: t

    @classmethod
    def empty(cls, batch: int, topk: int, window: int, *, score_dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", cap: int | None = None, **extra) -> "SelectionState":
        """A fresh state (every row at position 0); `extra`: a subclass's other fields."""
        cap = max(cap if cap is not None else default_threshold_cap(topk), topk + 2)
        f64 = dict(dtype=torch.float64, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            thr_u=torch.zeros(batch, cap, **f64),
            thr_saturated=torch.zeros(batch, cap, dtype=torch.bool, device=device),
            thr_count=torch.zeros(batch, **i64),
            tau=torch.full((batch,), -INF, **f64),
            thr_sum=torch.zeros(batch, **f64),
            overflow=torch.zeros(batch, **i64),
            pool_u=torch.full((batch, topk), -INF, dtype=score_dtype, device=device),
            pool_pos=torch.full((batch, topk), -1, **i64),
            tail_u=torch.zeros(batch, max(window - 1, 0), dtype=score_dtype, device=device),
            seen=torch.zeros(batch, **i64),
            **extra,
        )

    @property
    def topk(self) -> int:
        return self.pool_u.shape[1]

    @property
    def tail_slots(self) -> int:
        return self.tail_u.shape[1]


@dataclass
class ExtendedScores:
    """One chunk's keys in the extended layout [pool K][tail W-1][chunk L]: scores and absolute positions.

    The ext index of position p is K + (W-1) + p - seen for the tail and the chunk (the pool's positions
    ascend with their slots: ties in u go to the larger ext index, which is the larger position)."""

    u: torch.Tensor  # [B, N] scores (the chunk's part may carry gradient)
    pos: torch.Tensor  # [B, N] int64 positions (-1: empty slot, or a position before the document)
    q_pos: torch.Tensor  # [B, L] int64 the chunk's positions = pos[:, K + W-1:] (-1: padding)
    seen: torch.Tensor  # [B] int64 positions processed before the chunk
    lengths: torch.Tensor  # [B] int64 valid queries of the chunk
    topk: int  # K
    tail_slots: int  # W - 1

    @property
    def first_query(self) -> int:
        """The ext index of the chunk's first token."""
        return self.topk + self.tail_slots

    @property
    def n_queries(self) -> int:
        return self.q_pos.shape[1]


@dataclass
class ScanResult:
    """What a scan returns for one chunk, on the call's device (padded queries: nothing selected)."""

    theta_u: torch.Tensor  # [B, L] float64: the k-th largest candidate score (-inf: all selected)
    theta_pos: torch.Tensor  # [B, L] int64: its position (ties: the larger position wins)
    tau: torch.Tensor  # [B, L] float64: the SparseK threshold over C_i (-inf while |C_i| <= k)
    n_active: torch.Tensor  # [B, L] int64: |A_i|
    fingerprint: torch.Tensor  # [B, L] int64: hash of S_i (a sum of position hashes mod 2**63)
    block_pool: torch.Tensor  # [B, n_blocks, K] int64: the pool at each block start as ext indices (-1 empty),
    #                           in stable slots: a key never moves while it is pooled
    final_pool: torch.Tensor  # [B, K] int64: ext indices of the top-k after the chunk, ascending (-1 empty)
    threshold: ThresholdState  # the threshold state after the chunk

    @classmethod
    def allocate(cls, B: int, L: int, n_blocks: int, K: int, cap: int, device) -> "ScanResult":
        """Uninitialised tensors of the right shapes and dtypes."""
        f64, i64 = dict(dtype=torch.float64, device=device), dict(dtype=torch.int64, device=device)
        return cls(
            theta_u=torch.empty(B, L, **f64), theta_pos=torch.empty(B, L, **i64), tau=torch.empty(B, L, **f64),
            n_active=torch.empty(B, L, **i64), fingerprint=torch.empty(B, L, **i64),
            block_pool=torch.empty(B, n_blocks, K, **i64), final_pool=torch.empty(B, K, **i64),
            threshold=ThresholdState(
                thr_u=torch.empty(B, cap, **f64), thr_saturated=torch.empty(B, cap, dtype=torch.bool, device=device),
                thr_count=torch.empty(B, **i64), tau=torch.empty(B, **f64), thr_sum=torch.empty(B, **f64),
                overflow=torch.empty(B, **i64),
            ),
        )

    def _flat(self) -> list[torch.Tensor]:
        t = self.threshold
        return [self.theta_u, self.theta_pos, self.tau, self.n_active, self.fingerprint, self.block_pool,
                self.final_pool, t.thr_u, t.thr_saturated, t.thr_count, t.tau, t.thr_sum, t.overflow]

    @classmethod
    def _unflat(cls, x: list[torch.Tensor]) -> "ScanResult":
        return cls(*x[:7], threshold=ThresholdState(*x[7:]))

    def to(self, device) -> "ScanResult":
        """On `device` by one copy (no copy where it already is)."""
        return self._unflat(move_together(self._flat(), device))

    def clone(self) -> "ScanResult":
        return self._unflat(move_together(self._flat(), self.theta_u.device, copy=True))


def move_together(tensors: list[torch.Tensor], device, *, copy: bool = False) -> list[torch.Tensor]:
    """`tensors` on `device` through one buffer: one transfer (one host sync), not one per tensor.

    Without `copy`, tensors already on `device` come back as they are."""
    device = torch.device(device)
    if not copy and all(t.device == device for t in tensors):
        return list(tensors)
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())  # aligned views
    flat = torch.cat([tensors[i].contiguous().view(-1).view(torch.uint8) for i in order]).to(device)
    out, off = [None] * len(tensors), 0
    for i in order:
        t = tensors[i]
        n = t.numel() * t.element_size()
        out[i] = flat[off: off + n].view(t.dtype).view(t.shape)
        off += n
    return out
