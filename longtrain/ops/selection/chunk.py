"""One chunk's selection in three stages: lay out the scores, scan, carry the state to the next chunk.

    keys = lay_out_scores(state, u, lengths)           # [pool K][tail W-1][chunk L], absolute positions
    scan = select(keys, state, window=w, block=G)       # theta, tau, |A|, pools; the next threshold state
    state = next_state(state, keys, scan)               # the top-k pool and the last w-1 scores, detached

The attention op (sparsek_attention/op.py) runs the same stages with K and V beside the scores;
prefix.py runs them on scores alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longtrain.ops.selection.state import (
    ExtendedScores,
    ScanResult,
    SelectionState,
    ThresholdState,
    move_together,
)

SCANS = ("auto", "host", "device")


def lay_out_scores(state: SelectionState, u: torch.Tensor, lengths: torch.Tensor | None = None) -> ExtendedScores:
    """The chunk's scores u [B, L] after the state's pool and tail, with absolute positions."""
    B, L = u.shape
    dev = u.device
    lengths = torch.full((B,), L, dtype=torch.int64, device=dev) if lengths is None else lengths.to(dev, torch.int64)
    seen = state.seen.to(dev)
    Wt = state.tail_slots
    ar = torch.arange(L, device=dev)
    q_pos = torch.where(ar[None] < lengths[:, None], seen[:, None] + ar[None], -1)  # [B, L]
    tail_pos = seen[:, None] - Wt + torch.arange(Wt, device=dev)[None]  # [B, W-1]
    tail_pos = torch.where(tail_pos >= 0, tail_pos, -1)
    return ExtendedScores(
        u=torch.cat([state.pool_u.to(u.dtype), state.tail_u.to(u.dtype), u], dim=1),  # [B, N]
        pos=torch.cat([state.pool_pos.to(dev), tail_pos, q_pos], dim=1),  # [B, N]
        q_pos=q_pos, seen=seen, lengths=lengths, topk=state.topk, tail_slots=Wt,
    )


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_scan(scan: str, u: torch.Tensor) -> None:
    """A clear error for a scan this call cannot run."""
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}; got {scan!r}")
    if scan == "device" and not triton_available():
        raise ValueError("scan='device' needs Triton (Linux); use scan='host'")
    if scan == "device" and u.dtype == torch.float64:
        raise ValueError("scan='device' packs float32 scores into its keys; float64 scores need scan='host'")


def pick_scan(scan: str, u: torch.Tensor) -> str:
    """auto: on the GPU where the scores are (float32 or narrower), else the CPU heaps."""
    if scan == "auto":
        return "device" if u.is_cuda and u.dtype != torch.float64 and triton_available() else "host"
    return scan


def select(keys: ExtendedScores, state: ThresholdState, *, window: int, block: int = 64,
           scan: str = "auto") -> ScanResult:
    """The selection scan over one chunk, continuing from `state`: on the keys' device ("device", no host
    synchronisation) or on the CPU heaps ("host", one copy each way); results on the keys' device."""
    check_scan(scan, keys.u)
    if pick_scan(scan, keys.u) == "device":
        from longtrain.ops.selection.device import scan_chunk_device  # needs Triton

        return scan_chunk_device(keys, state, window=window, block=block)
    from longtrain.ops.selection.host import scan_chunk_host

    return scan_chunk_host(keys, state, window=window, block=block)


@dataclass
class Carried:
    """The ext rows the next state keeps: the final pool and the tail (positions t-(W-1) .. t-1)."""

    rows: torch.Tensor  # [B, 1]
    pool: torch.Tensor  # [B, K] ext indices (0 where the slot is empty)
    pool_ok: torch.Tensor  # [B, K] bool
    tail: torch.Tensor  # [B, W-1] ext indices


def carried(keys: ExtendedScores, scan: ScanResult) -> Carried:
    """Which ext rows the next state keeps."""
    B, dev = keys.u.shape[0], keys.u.device
    tail = keys.topk + keys.lengths[:, None] + torch.arange(keys.tail_slots, device=dev)[None]
    return Carried(rows=torch.arange(B, device=dev)[:, None], pool=scan.final_pool.clamp(min=0),
                   pool_ok=scan.final_pool >= 0, tail=tail)


@torch.no_grad()
def next_state(state: SelectionState, keys: ExtendedScores, scan: ScanResult, rows: Carried | None = None
               ) -> SelectionState:
    """The state after the chunk (detached; scores in the state's dtype); `rows`: carried(keys, scan)."""
    c = carried(keys, scan) if rows is None else rows
    # Copied: the device scan returns its outputs as views of one buffer (ScanResult.clone), so a view kept here
    # would hold the chunk-sized rest of it (per-query fingerprints, block pools) for as long as the cache lives:
    # a long prefill's peak held two chunks' worth per layer (issue 33).
    threshold = scan.threshold.tensors()
    threshold = dict(zip(threshold, move_together(list(threshold.values()), scan.theta_u.device, copy=True)))
    return SelectionState(
        pool_u=torch.where(c.pool_ok, keys.u[c.rows, c.pool], -float("inf")).to(state.pool_u.dtype),
        pool_pos=torch.where(c.pool_ok, keys.pos[c.rows, c.pool], -1),
        tail_u=keys.u[c.rows, c.tail].to(state.tail_u.dtype),
        seen=keys.seen + keys.lengths,
        **threshold,
    )
