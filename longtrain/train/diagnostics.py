"""Selection diagnostics: what each layer's SparseK pool holds and how it moves (issue 17).

Per selecting layer, accumulated over every chunk since the last read:
  pool_age_mean, pool_age_max  positions between a pool entry and the row's last processed token,
                               at the end of each chunk
  pool_churn                   fraction of the pool's entries that are new in the chunk (entered from
                               the tail or the chunk itself; rows that start a document are left out)
  tau, active                  mean SparseK threshold τ and active-set size |A| over the chunk's
                               queries that have more than k candidates
  u_mean, u_std                mean and spread of the chunk's scores u without the position slope
                               ε·j (the slope only shifts u by position; what remains is the scorer's)
Everything is summed on the device; `read` makes the one host transfer, once per log line.

A pool entry is new iff its position is past the previous chunk's candidates (> seen - max(w, 1)):
by irreversibility an older candidate that is in the pool now was in it before.
"""

from __future__ import annotations

import math

import torch

# Accumulator columns: sums and counts (max for the age).
_AGE_SUM, _AGE_N, _AGE_MAX, _NEW, _SLOTS, _TAU, _ACTIVE, _TAU_N, _U, _U2, _U_N = range(11)


class SelectionDiagnostics:
    """Accumulates per-layer selection statistics of a model's chunks; `read()` once per log line."""

    def __init__(self, model):
        self.layers = [i for i, blk in enumerate(model.blocks) if blk.attn.topk > 0]
        self.window = model.cfg.window if model.cfg.attention in ("sparsek+sw", "sparsek+linear+sw") else 0
        self.eps_slope = model.cfg.eps_slope
        self._acc: torch.Tensor | None = None  # [layers, 11] float64 on the model's device

    def update(self, before, out) -> None:
        """After one chunk: chunk_stats and add in one call."""
        self.add(self.chunk_stats(before, out))

    def chunk_stats(self, before, out) -> torch.Tensor | None:
        """One chunk's statistics [layers, 11] (device ops only: a CUDA graph replays them), from `before`,
        the ModelCache the chunk started from (rows already reset), and `out`, the model's LMOutput; None
        when no layer selects. `add` accumulates them. Every layer at once (their shapes agree): some forty
        small kernels a chunk, not forty a layer."""
        if not self.layers:
            return None
        a0 = [before.layers[i].attn for i in self.layers]
        a1 = [out.cache.layers[i].attn for i in self.layers]
        sel = [out.selections[i] for i in self.layers]
        dev = a1[0].seen.device
        return self._chunk_stats(
            torch.stack([a.seen.to(dev) for a in a0]), torch.stack([a.seen for a in a1]),
            torch.stack([a.pool_pos for a in a1]), torch.stack([s.tau for s in sel]),
            torch.stack([s.n_active for s in sel]), torch.stack([s.u for s in sel]))

    def add(self, acc: torch.Tensor | None) -> None:
        """Accumulate one chunk's statistics (a copy is kept: `acc` may be a graph's buffer)."""
        if acc is None:
            return
        if self._acc is None:
            self._acc = acc.clone()
        else:
            self._acc = torch.cat([self._acc[:, :_AGE_MAX] + acc[:, :_AGE_MAX],
                                   torch.maximum(self._acc[:, _AGE_MAX:_NEW], acc[:, _AGE_MAX:_NEW]),
                                   self._acc[:, _NEW:] + acc[:, _NEW:]], dim=1)

    @torch.no_grad()
    def _chunk_stats(
        self,
        seen0: torch.Tensor,  # [Y, R] tokens before the chunk, per selecting layer and op row (groups folded in)
        seen1: torch.Tensor,  # [Y, R] after it
        pos: torch.Tensor,  # [Y, R, K] positions in the pool after the chunk (-1: empty)
        tau: torch.Tensor,  # [Y, R, L]
        n_active: torch.Tensor,  # [Y, R, L]
        u: torch.Tensor,  # [Y, R, L] the chunk's scores
    ) -> torch.Tensor:
        """[Y, 11] the accumulator's columns for one chunk."""
        f64, rk = torch.float64, (1, 2)
        n = seen1 - seen0  # [Y, R] tokens of the chunk
        active_row = n > 0
        in_pool = (pos >= 0) & active_row[..., None]
        age = (seen1[..., None] - 1 - pos).to(f64)
        age_sum = torch.where(in_pool, age, 0.0).sum(rk)
        age_max = torch.where(in_pool, age, -math.inf).amax(rk)
        # Churn over rows that continue a document; new = past the previous chunk's candidates.
        cont = in_pool & (seen0 > 0)[..., None]
        new = cont & (pos > (seen0 - max(self.window, 1))[..., None])

        L = tau.shape[-1]
        ar = torch.arange(L, device=pos.device)
        qpos = seen0[..., None] + ar  # [Y, R, L]
        valid = ar < n[..., None]
        tau = tau.to(f64)
        has_tau = valid & torch.isfinite(tau)
        u = torch.where(valid, u.to(f64) - self.eps_slope * qpos.to(f64), 0.0)  # the scorer's part of u
        return torch.stack([
            age_sum, in_pool.sum(rk).to(f64), age_max,
            new.sum(rk).to(f64), cont.sum(rk).to(f64),
            torch.where(has_tau, tau, 0.0).sum(rk), torch.where(has_tau, n_active.to(f64), 0.0).sum(rk),
            has_tau.sum(rk).to(f64),
            u.sum(rk), (u * u).sum(rk), valid.sum(rk).to(f64),
        ], dim=1)

    def read(self) -> list[dict] | None:
        """Per-layer statistics since the last read ({"layer": i, ...}; None where nothing was
        counted), and start over. One host transfer. None when no layer selects or nothing ran."""
        if self._acc is None:
            return None
        acc, self._acc = self._acc.cpu().tolist(), None
        out = []
        for i, a in zip(self.layers, acc):
            def ratio(num, den):
                return num / den if den > 0 else None

            u_mean = ratio(a[_U], a[_U_N])
            u_var = ratio(a[_U2], a[_U_N])
            out.append({
                "layer": i,
                "pool_age_mean": ratio(a[_AGE_SUM], a[_AGE_N]),
                "pool_age_max": a[_AGE_MAX] if a[_AGE_N] > 0 else None,
                "pool_churn": ratio(a[_NEW], a[_SLOTS]),
                "tau": ratio(a[_TAU], a[_TAU_N]),
                "active": ratio(a[_ACTIVE], a[_TAU_N]),
                "u_mean": u_mean,
                "u_std": math.sqrt(max(u_var - u_mean * u_mean, 0.0)) if u_mean is not None else None,
            })
        return out


def summary_line(stats: list[dict]) -> str:
    """One plain line over all layers: mean of each statistic (the largest age), per layer in metrics.jsonl."""
    def mean(key):
        vals = [s[key] for s in stats if s[key] is not None]
        return sum(vals) / len(vals) if vals else None

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    ages = [s["pool_age_max"] for s in stats if s["pool_age_max"] is not None]
    return (
        f"selection ({len(stats)} layers): pool age {fmt(mean('pool_age_mean'), '.0f')} mean / "
        f"{fmt(max(ages) if ages else None, '.0f')} max | "
        f"churn {fmt(None if mean('pool_churn') is None else 100 * mean('pool_churn'), '.1f')}%"
        f" | τ {fmt(mean('tau'), '.3f')} | |A| {fmt(mean('active'), '.1f')} | u {fmt(mean('u_mean'), '.2f')} ± {fmt(mean('u_std'), '.2f')}"
    )


def selection_table(stats: list[dict]):
    """A rich table with one row per selecting layer (the live display)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, padding=(0, 1), header_style="dim", title_style="dim", title_justify="left")
    for name in ("layer", "pool age", "max age", "churn", "τ", "|A|", "u"):
        table.add_column(name, justify="right")

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for s in stats:
        churn = None if s["pool_churn"] is None else 100 * s["pool_churn"]
        cells = (
            str(s["layer"]), fmt(s["pool_age_mean"], ",.0f"), fmt(s["pool_age_max"], ",.0f"), fmt(churn, ".1f") + "%",
            fmt(s["tau"], ".3f"), fmt(s["active"], ".1f"), f"{fmt(s['u_mean'], '.2f')} ± {fmt(s['u_std'], '.2f')}",
        )
        table.add_row(*(Text(c) for c in cells))  # Text cells: a value is never read as markup
    return table
