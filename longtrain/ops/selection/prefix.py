"""prefix_thresholds: the decoder's per-query theta and tau for a score sequence, resumable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longtrain.ops.selection.chunk import lay_out_scores, next_state, select
from longtrain.ops.selection.state import SelectionState


@dataclass
class PrefixThresholds:
    theta: torch.Tensor  # [B, T] float64, k-th largest candidate score (-inf: |C_i| <= k)
    theta_pos: torch.Tensor  # [B, T] int64, its position (ties: the larger position)
    tau: torch.Tensor  # [B, T] float64, SparseK threshold over C_i (-inf: |C_i| <= k)
    n_active: torch.Tensor  # [B, T] int64, |{j in C_i : 0 < p_j < 1}|
    state: SelectionState  # what the next chunk continues from (.overflowed: the cap was hit, never silent)


def prefix_thresholds(
    u: torch.Tensor, topk: int, window: int, state: SelectionState | None = None, cap: int | None = None
) -> PrefixThresholds:
    """theta_i, tau_i over C_i = {j <= i - window} for every query of u [B, T].

    Pass the returned `.state` to continue with the next chunk of the same rows: chunk by chunk
    equals one pass. O(T log k) per row on the CPU heaps. The scores the state keeps are only those above tau.
    """
    B, T = u.shape
    if state is None:
        state = SelectionState.empty(B, topk, window, score_dtype=u.dtype, device=u.device, cap=cap)
    elif (state.topk, state.tail_slots) != (topk, max(window - 1, 0)):
        built = state.tail_slots + 1 if state.tail_slots else "0 or 1"
        raise ValueError(f"state was built for topk={state.topk}, window={built}; "
                         f"the call uses topk={topk}, window={window}")
    keys = lay_out_scores(state, u.detach())
    scan = select(keys, state, window=window, block=max(T, 1), scan="host")
    return PrefixThresholds(theta=scan.theta_u, theta_pos=scan.theta_pos, tau=scan.tau, n_active=scan.n_active,
                            state=next_state(state, keys, scan))
