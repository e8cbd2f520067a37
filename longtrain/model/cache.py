"""ModelCache: what the model carries from one chunk of a document to the next (Algorithm 3).

Per layer and per batch row:
  - the attention cache: a SparseKCache (tail of the last w-1 tokens, top-k pool, threshold
    state; fixed size) for sparsek+sw / sparsek / sw layers, a SparseKLinearCache (the same plus
    the linear state: fixed size) for the linear types, or a FullKVCache for `full` layers
    (every past key: the baseline, whose memory grows with the document);
  - the TimestepNorm running totals of the raw scores (sum and sum of squares, float64); the count
    is `seen`, the tokens of the current document processed so far, shared by all layers.
Everything is detached: gradients never flow into a previous chunk. Rows are reset one by one at a
document boundary (`reset_rows`). With per-KV-head score groups a layer's attention cache holds
B·G rows (the groups are folded into the batch of the op), row b·G + g for group g of row b.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

import torch

from longtrain.ops.sparsek_attention import SparseKCache
from longtrain.ops.sparsek_attention.cache import SparseKRingCache, from_ring, to_ring
from longtrain.ops.sparsek_attention.linear import SparseKLinearCache


@dataclass
class FullKVCache:
    """Full causal attention's cache: every key and value seen so far (grows with the document)."""

    full_k: torch.Tensor  # [B, T, Hkv, D] (after RoPE)
    full_v: torch.Tensor  # [B, T, Hkv, D]
    full_pos: torch.Tensor  # [B, T] int64 absolute positions (-1: padding or a finished document)

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, *, dtype, device) -> "FullKVCache":
        kv = torch.zeros(batch, 0, kv_heads, head_dim, dtype=dtype, device=device)
        return cls(kv, kv.clone(), torch.zeros(batch, 0, dtype=torch.int64, device=device))

    def reset_rows(self, mask: torch.Tensor) -> "FullKVCache":
        # Invalidate the row's keys; the tensor keeps its length (the batch shares one T).
        pos = torch.where(mask.to(self.full_pos.device)[:, None], -1, self.full_pos)
        return FullKVCache(self.full_k, self.full_v, pos)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().contiguous() for name, t in self.tensors().items()}

    @classmethod
    def from_state_dict(cls, d: dict[str, torch.Tensor]) -> "FullKVCache":
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def to(self, device) -> "FullKVCache":
        return FullKVCache(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


AttentionCache = SparseKCache | SparseKLinearCache | FullKVCache
# The key and value tensors of each cache kind: what `with_kv_dtype` casts (scores, positions and the
# threshold state keep their own dtypes: float32 / float64 / int64, DESIGN.md section 2).
# The linear state keeps its own dtype too (float32 at least: a sum over the whole document).
KV_FIELDS = {SparseKCache: ("pool_k", "pool_v", "tail_k", "tail_v"), FullKVCache: ("full_k", "full_v")}
KV_FIELDS[SparseKLinearCache] = KV_FIELDS[SparseKCache]


@dataclass
class LayerCache:
    attn: AttentionCache
    score_sum: torch.Tensor  # [B, G] float64: sum of raw scores r_0..r_{t-1} (TimestepNorm)
    score_sumsq: torch.Tensor  # [B, G] float64: sum of r_j^2


def _expand_rows(mask: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-document mask [B] for a tensor of B·G rows (groups folded into the batch)."""
    return mask.repeat_interleave(rows // mask.shape[0]) if rows != mask.shape[0] else mask


@dataclass
class ModelCache:
    seen: torch.Tensor  # [B] int64: tokens of the current document processed (the next position)
    layers: list[LayerCache]

    @property
    def batch_size(self) -> int:
        return self.seen.shape[0]

    @property
    def grows(self) -> bool:
        """Full attention's cache: it keeps every key, so it grows chunk by chunk (SparseK's has a fixed size)."""
        return any(isinstance(layer.attn, FullKVCache) for layer in self.layers)

    @property
    def kv_entries_per_layer(self) -> int:
        """KV capacity of one layer per row: k + w - 1 (a full-attention cache: its current length)."""
        attn = self.layers[0].attn
        if isinstance(attn, SparseKCache):
            return attn.topk + attn.tail_slots
        return attn.full_k.shape[1]

    def fill(self) -> float:
        """Fraction of the KV slots that hold a real token, over all layers and rows."""
        used, total = [], 0  # counted on the device, read with one host sync
        for layer in self.layers:
            a = layer.attn
            if isinstance(a, SparseKCache):
                used.append((a.pool_pos >= 0).sum() + a.seen.clamp(max=a.tail_slots).sum())
                total += a.pool_pos.shape[0] * (a.topk + a.tail_slots)
            else:
                used.append((a.full_pos >= 0).sum())
                total += a.full_pos.numel()
        return float(torch.stack(used).sum()) / total if total else 0.0

    def with_kv_dtype(self, dtype: torch.dtype) -> "ModelCache":
        """The same cache with its keys and values in `dtype` (the compute dtype: bf16 under bf16 autocast).

        A run keeps its cache in the dtype the attention computes in, so no chunk casts it back and
        forth; a checkpoint written with another dtype (older runs kept float32) is cast on load.
        """
        layers = []
        for layer in self.layers:
            a = layer.attn
            cast = {n: getattr(a, n).to(dtype) for n in KV_FIELDS[type(a)] if getattr(a, n).dtype != dtype}
            layers.append(LayerCache(replace(a, **cast) if cast else a, layer.score_sum, layer.score_sumsq))
        return ModelCache(seen=self.seen, layers=layers)

    def clone(self) -> "ModelCache":
        """A copy that shares no tensor with this cache (a CUDA graph's buffers are updated in place)."""
        layers = [LayerCache(replace(la.attn, **{n: t.clone() for n, t in la.attn.tensors().items()}),
                             la.score_sum.clone(), la.score_sumsq.clone()) for la in self.layers]
        return ModelCache(seen=self.seen.clone(), layers=layers)

    def to_ring(self) -> "ModelCache":
        """Every layer in the decoder's layout (SparseKRingCache: decode steps write K/V in place; plain
        SparseK caches only: attention_types.has_ring_layout)."""
        return ModelCache(seen=self.seen, layers=[LayerCache(to_ring(la.attn), la.score_sum, la.score_sumsq)
                                                  for la in self.layers])

    def from_ring(self) -> "ModelCache":
        """Every layer back in the chunk op's layout (a cache with no ring layer comes back as it is)."""
        if not any(isinstance(la.attn, SparseKRingCache) for la in self.layers):
            return self
        return ModelCache(seen=self.seen, layers=[LayerCache(from_ring(la.attn), la.score_sum, la.score_sumsq)
                                                  for la in self.layers])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache itself (no copies), in a fixed order: two caches of one model pair up
        (copying one into another's buffers, as a CUDA graph's replay needs)."""
        out = [self.seen]
        for layer in self.layers:
            out += [*layer.attn.tensors().values(), layer.score_sum, layer.score_sumsq]
        return out

    def copy_(self, other: "ModelCache") -> "ModelCache":
        """Copy `other` into this cache's tensors, in place (those it shares with this one are left); returns self.

        One foreach copy per (dtype, device): a list of mixed dtypes takes the foreach's per-tensor path, one
        memcpy per tensor (195 per decode step of a 12-layer SparseK cache, ~0.3 ms of an H100's graph replay)."""
        groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for a, b in zip(self.tensors(), other.tensors()):
            if not _same(a, b):  # (a step that wrote a tensor in place returns it, or a view of it under compile)
                groups.setdefault((a.dtype, a.device, b.dtype), []).append((a, b))
        for pairs in groups.values():
            torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])
        return self

    def keep_last(self, n: int) -> "ModelCache":
        """Full-attention caches cut to their last `n` keys (SparseK caches have a fixed size: unchanged).

        A row's current document is its last `seen` keys (a reset row's older keys are all -1), so
        `n` = the longest current document loses nothing: the cache grows with the longest document,
        not with everything the run has read.
        """
        layers = []
        for layer in self.layers:
            a = layer.attn
            if isinstance(a, FullKVCache) and a.full_k.shape[1] > n:
                a = FullKVCache(*(t[:, t.shape[1] - n :].clone() for t in (a.full_k, a.full_v, a.full_pos)))
            layers.append(LayerCache(a, layer.score_sum, layer.score_sumsq))
        return ModelCache(seen=self.seen, layers=layers)

    def overflowed(self) -> bool:
        """Some layer's SparseK threshold state hit its cap (selection no longer exact); a host sync."""
        flags = [layer.attn.overflow for layer in self.layers if isinstance(layer.attn, SparseKCache)]
        return bool(torch.stack(flags).gt(0).any()) if flags else False

    def reset_rows(self, mask: torch.Tensor) -> "ModelCache":
        """A cache where the rows in `mask` [B] bool start a new document."""
        mask = mask.to(torch.bool)
        layers = []
        for layer in self.layers:
            rows = layer.attn.full_pos.shape[0] if isinstance(layer.attn, FullKVCache) else layer.attn.seen.shape[0]
            m_attn = _expand_rows(mask, rows)
            m = mask.to(layer.score_sum.device)[:, None]
            layers.append(
                LayerCache(
                    attn=layer.attn.reset_rows(m_attn),
                    score_sum=torch.where(m, 0.0, layer.score_sum),
                    score_sumsq=torch.where(m, 0.0, layer.score_sumsq),
                )
            )
        return ModelCache(seen=torch.where(mask.to(self.seen.device), 0, self.seen), layers=layers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat names ("seen", "layers.3.pool_k", "layers.3.score_sum", ...) for safetensors."""
        out = {"seen": self.seen.detach().contiguous()}
        for i, layer in enumerate(self.layers):
            items = {**layer.attn.state_dict(), "score_sum": layer.score_sum, "score_sumsq": layer.score_sumsq}
            out.update({f"layers.{i}.{name}": t.detach().contiguous() for name, t in items.items()})
        return out

    @classmethod
    def from_state_dict(cls, d: dict[str, torch.Tensor]) -> "ModelCache":
        per_layer: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in d.items():
            m = re.fullmatch(r"layers\.(\d+)\.(\w+)", key)
            if m:
                per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = t
        if "seen" not in d or sorted(per_layer) != list(range(len(per_layer))):
            raise KeyError("cache state needs `seen` and layers.0 .. layers.N-1")
        layers = []
        for i in range(len(per_layer)):
            sub = per_layer[i]
            kind = FullKVCache if "full_k" in sub else SparseKLinearCache if "lin_kv" in sub else SparseKCache
            layers.append(LayerCache(kind.from_state_dict(sub), sub["score_sum"], sub["score_sumsq"]))
        return cls(seen=d["seen"], layers=layers)

    def to(self, device) -> "ModelCache":
        return ModelCache(
            seen=self.seen.to(device),
            layers=[LayerCache(la.attn.to(device), la.score_sum.to(device), la.score_sumsq.to(device)) for la in self.layers],
        )

    def nbytes(self) -> int:
        """Bytes the cache holds (its tensors as they are, no copies)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same memory seen the same way (copying one into the other would change nothing)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device and a.numel() > 0)
