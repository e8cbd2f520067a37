"""prefix_thresholds: the decoder's per-query theta and tau for a score sequence, resumable."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from longtrain.ops.selection.scan import RowState, default_threshold_cap
from longtrain.ops.selection.scan_numba import scan_chunk_numba as scan_chunk


@dataclass
class PrefixThresholds:
    theta: torch.Tensor  # [B, T] float64, k-th largest candidate score (-inf: |C_i| <= k)
    theta_pos: torch.Tensor  # [B, T] int64, its position (ties: the larger position)
    tau: torch.Tensor  # [B, T] float64, SparseK threshold over C_i (-inf: |C_i| <= k)
    n_active: torch.Tensor  # [B, T] int64, |{j in C_i : 0 < p_j < 1}|
    state: "ThresholdState"


@dataclass
class ThresholdState:
    """What a chunk boundary carries: the scan's per-row state and how far each row has read."""

    rows: list[RowState]
    seen: np.ndarray  # [B] positions consumed
    window: int
    topk: int
    cap: int
    tail_u: np.ndarray  # [B, <= w-1] the latest scores, not yet candidates

    @property
    def overflowed(self) -> bool:
        """The state hit its cap at some point: tau is no longer exact (never silent)."""
        return any(r.overflow > 0 for r in self.rows)


def prefix_thresholds(
    u: torch.Tensor, topk: int, window: int, state: ThresholdState | None = None, cap: int | None = None
) -> PrefixThresholds:
    """theta_i, tau_i over C_i = {j <= i - window} for every query of u [B, T].

    Pass the returned `.state` to continue with the next chunk of the same rows: chunk by chunk
    equals one pass. O(T log k) per row. The scores the state keeps are only those above tau.
    """
    B, T = u.shape
    if state is None:
        cap = max(cap if cap is not None else default_threshold_cap(topk), topk + 2)
        rows = [RowState([], [], [], 0.0, -float("inf"), 0, 0, 0) for _ in range(B)]
        state = ThresholdState(rows, np.zeros(B, dtype=np.int64), window, topk, cap, np.zeros((B, 0)))
    elif (state.window, state.topk) != (window, topk):
        raise ValueError(f"state was built for topk={state.topk}, window={state.window}")
    # Extended layout [tail][new]: candidates lag the queries by the window.
    tail = state.tail_u
    lag_slots = tail.shape[1]
    u_ext = np.concatenate([tail, u.detach().to("cpu", torch.float64).numpy()], axis=1)
    pos_ext = np.concatenate(
        [state.seen[:, None] - lag_slots + np.arange(lag_slots)[None], state.seen[:, None] + np.arange(T)[None]], axis=1
    )
    res = scan_chunk(
        u_ext, pos_ext, state.rows, seen=state.seen, lengths=np.full(B, T), n_queries=T, topk=topk,
        window=window, cap=state.cap, block=max(T, 1), ext_of_first_chunk_token=lag_slots,
    )
    new_seen = state.seen + T
    keep = min(max(window - 1, 0), u_ext.shape[1])
    new_state = ThresholdState(res.states, new_seen, window, topk, state.cap, u_ext[:, u_ext.shape[1] - keep :])
    return PrefixThresholds(
        theta=res.theta_u, theta_pos=res.theta_pos, tau=torch.from_numpy(res.tau),
        n_active=torch.from_numpy(res.n_active), state=new_state,
    )
