"""SparseKCache: one layer's fixed-size, score-tagged KV cache carried between chunks.

After a row has processed document positions [0, t) it holds (DESIGN.md section 3):
  - the pool: K, V, u, position of the top-k candidates (positions <= t - max(w, 1));
  - the tail: K, V, u of positions t-(w-1) .. t-1 (slot s <-> position t-(w-1)+s);
  - the threshold state: the scores still above tau (no K/V), split into saturated and fractional;
  - t itself (`seen`);
  - the sizes k (the pool's slots) and w (`window`, a host int: w = 0 and w = 1 both keep no tail), the one
    source of both for the op and the decode step;
  - the positions of the pool at the last query tile start a = t - t mod G (no K/V): a chunk that
    starts inside a tile lays that tile out as the unchunked pass does (aligned.py).
Everything but K, V and the tile's pool is the selection's state (selection.SelectionState), which the cache extends:
the scans read the cache's own tensors. KV memory is k + w - 1 entries whatever the document length;
every tensor is detached.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

import torch

from longtrain.ops.selection import SelectionState
from longtrain.ops.selection.state import size_field


def check_sizes(topk: int, window: int, tail_slots: int | None = None) -> None:
    """The one check of (topk, window), run wherever a SparseKCache is made (the op and decode read the sizes from
    the cache): both >= 0, not both 0, and (given) the tail the tensors hold is w - 1 slots."""
    if topk < 0 or window < 0:
        raise ValueError(f"topk and window must be >= 0; got topk={topk}, window={window}")
    if topk == 0 and window == 0:
        raise ValueError("topk = 0 and window = 0 leave every query with no keys; set one of them > 0")
    if tail_slots is not None and tail_slots != max(window - 1, 0):
        raise ValueError(f"a cache for window={window} holds {max(window - 1, 0)} tail slots; its tensors hold {tail_slots}")


def legacy_window(topk: int, tail_slots: int) -> int:
    """The window of a cache state saved before the cache carried it: w - 1 tail slots, so w = tail + 1, except
    for no tail, where w = 1 without a pool (sw) and w = 0 with one (sparsek; sparsek+sw with w = 1 was not told apart)."""
    return tail_slots + 1 if tail_slots or topk == 0 else 0


@dataclass
class SparseKCache(SelectionState):
    pool_k: torch.Tensor  # [B, K, Hkv, D] (after RoPE)
    pool_v: torch.Tensor  # [B, K, Hkv, D]
    tail_k: torch.Tensor  # [B, W-1, Hkv, D]
    tail_v: torch.Tensor  # [B, W-1, Hkv, D]
    # The pool at query tile start `tile_pool_at` (positions ascending, -1 empty; at = -1: unknown).
    # Optional so that caches saved before they existed still load (unknown: exact, maybe not bitwise).
    tile_pool_pos: torch.Tensor | None = None  # [B, K] int64
    tile_pool_at: torch.Tensor | None = None  # [B] int64
    window: int = size_field()  # w (the tail holds w - 1 slots; the pool's k is topk, read off its shape)

    def __post_init__(self):
        check_sizes(self.topk, self.window, self.tail_slots)
        if self.tile_pool_pos is None or self.tile_pool_at is None:
            B, dev = self.seen.shape[0], self.seen.device
            self.tile_pool_pos = torch.full((B, self.pool_pos.shape[1]), -1, dtype=torch.int64, device=dev)
            self.tile_pool_at = torch.full((B,), -1, dtype=torch.int64, device=dev)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors, and the window as one int64 per row (so that rows split and join as the tensors do)."""
        return {**super().state_dict(), "window": torch.full_like(self.seen, self.window)}

    @classmethod
    def from_state_dict(cls, d: dict[str, torch.Tensor]) -> "SparseKCache":
        """As the selection state's, the tile's pool optional (caches saved before it existed: unknown), and the
        window (saved before the cache carried it: legacy_window)."""
        names = [f.name for f in fields(cls) if not f.metadata.get("size")]
        missing = [f.name for f in fields(cls) if f.name in names and f.name not in d and f.default is MISSING]
        if missing:
            raise KeyError(f"{cls.__name__} state is missing {missing}")
        if "window" in d and d["window"].numel():
            window = int(d["window"].reshape(-1)[0])
        else:
            window = legacy_window(d["pool_u"].shape[1], d["tail_u"].shape[1])
        return cls(**{name: d[name] for name in names if name in d}, window=window)

    @classmethod
    def empty(
        cls,
        batch: int,
        topk: int,
        window: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        score_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        cap: int | None = None,
    ) -> "SparseKCache":
        check_sizes(topk, window)
        tail = max(window - 1, 0)
        kv = dict(dtype=dtype, device=device)
        state = SelectionState.empty(batch, topk, window, score_dtype=score_dtype, device=device, cap=cap)
        return cls(
            **state.tensors(),
            pool_k=torch.zeros(batch, topk, kv_heads, head_dim, **kv),
            pool_v=torch.zeros(batch, topk, kv_heads, head_dim, **kv),
            tail_k=torch.zeros(batch, tail, kv_heads, head_dim, **kv),
            tail_v=torch.zeros(batch, tail, kv_heads, head_dim, **kv),
            tile_pool_pos=torch.full((batch, topk), -1, dtype=torch.int64, device=device),  # the empty pool at 0
            tile_pool_at=torch.zeros(batch, dtype=torch.int64, device=device),
            window=window,
        )

    def reset_rows(self, mask: torch.Tensor) -> "SparseKCache":
        """A new cache where rows in `mask` [B] bool start a new document."""
        fresh = SparseKCache.empty(
            self.seen.shape[0], self.topk, self.window,
            self.pool_k.shape[2], self.pool_k.shape[3], dtype=self.pool_k.dtype,
            score_dtype=self.pool_u.dtype, device=self.seen.device, cap=self.cap,
        )
        out = {}
        for name, old in self.tensors().items():
            m = mask.to(old.device).view(-1, *([1] * (old.dim() - 1)))
            out[name] = torch.where(m, getattr(fresh, name), old)
        return SparseKCache(**out, window=self.window)


@dataclass
class SparseKRingCache(SparseKCache):
    """A SparseKCache in the decoder's layout, which a decode step updates in place (sparsek_attention_decode):
      - the tail is a ring: position p sits in slot p mod (w - 1), so a step writes its token into the slot of
        the one leaving the window instead of shifting the whole tail;
      - the pool's slots are in no order (valid ones first): an admitted key takes the evicted key's slot.
    Only decode steps read it; `from_ring` gives the chunk op's layout back (to_ring: into this one)."""

    def reset_rows(self, mask: torch.Tensor) -> "SparseKRingCache":
        return to_ring(from_ring(self).reset_rows(mask))


def ring_slots(seen: torch.Tensor, tail_slots: int) -> torch.Tensor:
    """[B, W-1] the ring slot of each canonical tail slot s (position seen - (w-1) + s): (seen + s) mod (w-1)."""
    s = torch.arange(tail_slots, device=seen.device)
    return (seen[:, None] + s[None]) % max(tail_slots, 1)


def _rows_take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...] with its dim 1 reordered per row: out[b, j] = x[b, idx[b, j]]."""
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))


def to_ring(cache: SparseKCache) -> SparseKRingCache:
    """The same state in the decoder's layout, with its own copy of what decode steps write in place (the tail,
    rotated, and the pool, whose chunk layout is one of the ring's orders); the other tensors are shared."""
    if isinstance(cache, SparseKRingCache):
        return cache
    if type(cache) is not SparseKCache:
        raise TypeError(f"only a plain SparseKCache has a ring layout; got {type(cache).__name__}")
    Wt = cache.tail_slots
    inverse = torch.argsort(ring_slots(cache.seen, Wt), dim=1)  # ring slot j holds canonical slot inverse[b, j]
    tail = {n: _rows_take(getattr(cache, n), inverse) for n in ("tail_k", "tail_v", "tail_u")}
    pool = {n: getattr(cache, n).clone() for n in ("pool_k", "pool_v", "pool_u", "pool_pos")}
    return SparseKRingCache(**{**cache.tensors(), **tail, **pool}, window=cache.window)


def from_ring(cache: SparseKCache) -> SparseKCache:
    """The chunk op's layout of a ring cache (new tensors): the tail in position order, the pool valid first in
    ascending positions. A plain SparseKCache comes back as it is."""
    if not isinstance(cache, SparseKRingCache):
        return cache
    tail = {n: _rows_take(getattr(cache, n), ring_slots(cache.seen, cache.tail_slots)) for n in ("tail_k", "tail_v", "tail_u")}
    key = torch.where(cache.pool_pos >= 0, cache.pool_pos, torch.iinfo(torch.int64).max)
    order = torch.argsort(key, dim=1, stable=True)
    pool = {n: _rows_take(getattr(cache, n), order) for n in ("pool_k", "pool_v", "pool_u", "pool_pos")}
    return SparseKCache(**{**cache.tensors(), **tail, **pool}, window=cache.window)
