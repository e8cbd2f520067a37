"""SparseKCache: one layer's fixed-size, score-tagged KV cache carried between chunks.

After a row has processed document positions [0, t) it holds (DESIGN.md section 3):
  - the pool: K, V, u, position of the top-k candidates (positions <= t - max(w, 1));
  - the tail: K, V, u of positions t-(w-1) .. t-1 (slot s <-> position t-(w-1)+s);
  - the threshold state: the scores still above tau (no K/V), split into saturated and fractional;
  - t itself (`seen`).
KV memory is k + w - 1 entries whatever the document length; every tensor is detached.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from longtrain.ops.selection.scan import RowState, default_threshold_cap, position_hash


@dataclass
class SparseKCache:
    pool_k: torch.Tensor  # [B, K, Hkv, D]
    pool_v: torch.Tensor  # [B, K, Hkv, D]
    pool_u: torch.Tensor  # [B, K] (-inf in empty slots)
    pool_pos: torch.Tensor  # [B, K] int64 (-1 in empty slots)
    tail_k: torch.Tensor  # [B, W-1, Hkv, D]
    tail_v: torch.Tensor  # [B, W-1, Hkv, D]
    tail_u: torch.Tensor  # [B, W-1]
    seen: torch.Tensor  # [B] int64
    thr_u: torch.Tensor  # [B, cap] float64
    thr_saturated: torch.Tensor  # [B, cap] bool
    thr_count: torch.Tensor  # [B] int64
    tau: torch.Tensor  # [B] float64
    thr_sum: torch.Tensor  # [B] float64
    overflow: torch.Tensor  # [B] int64

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
        cap = max(cap if cap is not None else default_threshold_cap(topk), topk + 2)
        tail = max(window - 1, 0)
        kv = dict(dtype=dtype, device=device)
        f64 = dict(dtype=torch.float64, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            pool_k=torch.zeros(batch, topk, kv_heads, head_dim, **kv),
            pool_v=torch.zeros(batch, topk, kv_heads, head_dim, **kv),
            pool_u=torch.full((batch, topk), -float("inf"), dtype=score_dtype, device=device),
            pool_pos=torch.full((batch, topk), -1, **i64),
            tail_k=torch.zeros(batch, tail, kv_heads, head_dim, **kv),
            tail_v=torch.zeros(batch, tail, kv_heads, head_dim, **kv),
            tail_u=torch.zeros(batch, tail, dtype=score_dtype, device=device),
            seen=torch.zeros(batch, **i64),
            thr_u=torch.zeros(batch, cap, **f64),
            thr_saturated=torch.zeros(batch, cap, dtype=torch.bool, device=device),
            thr_count=torch.zeros(batch, **i64),
            tau=torch.full((batch,), -float("inf"), **f64),
            thr_sum=torch.zeros(batch, **f64),
            overflow=torch.zeros(batch, **i64),
        )

    @property
    def topk(self) -> int:
        return self.pool_k.shape[1]

    @property
    def tail_slots(self) -> int:
        return self.tail_k.shape[1]

    @property
    def cap(self) -> int:
        return self.thr_u.shape[1]

    def reset_rows(self, mask: torch.Tensor) -> "SparseKCache":
        """A new cache where rows in `mask` [B] bool start a new document."""
        fresh = SparseKCache.empty(
            self.seen.shape[0], self.topk, self.tail_slots + 1 if self.tail_slots else 0,
            self.pool_k.shape[2], self.pool_k.shape[3], dtype=self.pool_k.dtype,
            score_dtype=self.pool_u.dtype, device=self.seen.device, cap=self.cap,
        )
        out = {}
        for f in fields(self):
            old, new = getattr(self, f.name), getattr(fresh, f.name)
            m = mask.to(old.device).view(-1, *([1] * (old.dim() - 1)))
            out[f.name] = torch.where(m, new, old)
        return SparseKCache(**out)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name).detach().contiguous() for f in fields(self)}

    @classmethod
    def from_state_dict(cls, d: dict[str, torch.Tensor]) -> "SparseKCache":
        missing = [f.name for f in fields(cls) if f.name not in d]
        if missing:
            raise KeyError(f"cache state is missing {missing}")
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def to(self, device) -> "SparseKCache":
        return SparseKCache(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).numel() * getattr(self, f.name).element_size() for f in fields(self))

    # --- the threshold state as Python heaps for the CPU scan ---

    def row_states(self) -> list[RowState]:
        thr_u = self.thr_u.cpu().tolist()
        sat = self.thr_saturated.cpu().tolist()
        count = self.thr_count.cpu().tolist()
        pool_u = self.pool_u.detach().cpu().to(torch.float64).tolist()
        pool_pos = self.pool_pos.cpu().tolist()
        tau = self.tau.cpu().tolist()
        fsum = self.thr_sum.cpu().tolist()
        over = self.overflow.cpu().tolist()
        seen = self.seen.cpu().tolist()
        lag = 1 if self.tail_slots == 0 else self.tail_slots + 1  # max(w, 1)
        k = self.topk
        states = []
        for b in range(len(seen)):
            vals, flags = thr_u[b][: count[b]], sat[b][: count[b]]
            # The pool sits in ext slots 0..K-1, in the order the cache stores it; its keys take pool
            # slots 0..n-1 (the scan hands out n, n+1, ... while the pool grows).
            valid = [s for s in range(k) if pool_pos[b][s] >= 0]
            heap = sorted((pool_u[b][s], pool_pos[b][s], s, slot) for slot, s in enumerate(valid))
            fp = 0
            for _, p, _, _ in heap:
                fp = (fp + position_hash(p)) & (2**63 - 1)
            states.append(
                RowState(
                    topk_heap=heap,
                    sat=sorted(v for v, f in zip(vals, flags) if f),
                    frac=sorted(v for v, f in zip(vals, flags) if not f),
                    frac_sum=fsum[b],
                    tau=tau[b],
                    n_cand=max(0, seen[b] - lag + 1),
                    overflow=over[b],
                    fingerprint=fp,
                )
            )
        return states

    def threshold_tensors(self, states: list[RowState]) -> dict[str, torch.Tensor]:
        """The threshold-state fields of a cache holding `states`."""
        B, cap = len(states), self.cap
        thr_u = torch.zeros(B, cap, dtype=torch.float64)
        thr_sat = torch.zeros(B, cap, dtype=torch.bool)
        count = torch.zeros(B, dtype=torch.int64)
        for b, s in enumerate(states):
            vals = s.sat + s.frac
            n = len(vals)
            thr_u[b, :n] = torch.tensor(vals, dtype=torch.float64)
            thr_sat[b, : len(s.sat)] = True
            count[b] = n
        dev = self.seen.device
        return dict(
            thr_u=thr_u.to(dev),
            thr_saturated=thr_sat.to(dev),
            thr_count=count.to(dev),
            tau=torch.tensor([s.tau for s in states], dtype=torch.float64, device=dev),
            thr_sum=torch.tensor([s.frac_sum for s in states], dtype=torch.float64, device=dev),
            overflow=torch.tensor([s.overflow for s in states], dtype=torch.int64, device=dev),
        )
