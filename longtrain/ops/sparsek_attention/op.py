"""The public SparseK attention op: one chunk against a SparseKCache, or a whole sequence.

A chunk call (1) lays out keys as [cache pool][cache tail][chunk], (2) runs the selection scan from
the cache's threshold state, (3) runs the attention core (naive reference or Triton kernels) and
(4) builds the next cache: the top-k pool after the chunk and the last w-1 positions as the tail.
Everything stored in the cache is detached: gradients stop at the chunk boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longtrain.ops.sparsek_attention.cache import SparseKCache
from longtrain.ops.sparsek_attention.naive import VARIANTS, sparsek_attention_core_naive
from longtrain.ops.selection.scan import DeviceScan, ThresholdFn
from longtrain.ops.selection.scan_numba import scan_chunk_numba as scan_chunk

BACKENDS = ("auto", "naive", "triton")
SCANS = ("auto", "host", "device")


@dataclass
class ChunkSelection:
    """What was selected in a chunk: enough to compare two runs query by query."""

    fingerprint: torch.Tensor  # [B, L] int64 hash of S_i (0 when nothing is selected)
    theta_pos: torch.Tensor  # [B, L] int64
    tau: torch.Tensor  # [B, L] float64
    n_active: torch.Tensor  # [B, L] int64
    # (all on the device of the call: reading them is the caller's host sync)
    overflow: torch.Tensor  # [B] int64 scores dropped at the threshold state's cap (kept on device)

    @property
    def overflowed(self) -> bool:
        """The threshold state hit its cap: tau is no longer exact (a host sync)."""
        return bool((self.overflow > 0).any())


def _check(q, k, v, u, topk, window, variant, backend, scan="auto"):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if u.shape != q.shape[:2]:
        raise ValueError(f"u must be [B, T] = {tuple(q.shape[:2])}; got {tuple(u.shape)}")
    if topk < 0 or window < 0:
        raise ValueError(f"topk and window must be >= 0; got topk={topk}, window={window}")
    if topk == 0 and window == 0:
        raise ValueError("topk = 0 and window = 0 leave every query with no keys; set one of them > 0")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}; got {scan!r}")
    if scan == "device" and not _triton_available():
        raise ValueError("scan='device' needs Triton (Linux); use scan='host'")
    if scan == "device" and u.dtype == torch.float64:
        raise ValueError("scan='device' packs float32 scores into its keys; float64 scores need scan='host'")


def _pick_backend(backend: str, q: torch.Tensor) -> str:
    if backend == "auto":  # the kernels take half precision and float32, not float64
        return "triton" if q.is_cuda and q.dtype != torch.float64 and _triton_available() else "naive"
    return backend


def _pick_scan(scan: str, u: torch.Tensor) -> str:
    """auto: on the GPU where the scores are (float32 or narrower), else the CPU heaps."""
    if scan == "auto":
        return "device" if u.is_cuda and u.dtype != torch.float64 and _triton_available() else "host"
    return scan


def _host_scan(u_ext, pos_ext, cache, seen, lengths, L, topk, window, block) -> DeviceScan:
    """The CPU heap scan (compiled), its results moved to the call's device as a DeviceScan."""
    dev = u_ext.device
    scan = scan_chunk(
        u_ext.detach().to("cpu", torch.float64).numpy(),
        pos_ext.cpu().numpy(),
        cache.row_states(),
        seen=seen.cpu().numpy(),
        lengths=lengths.cpu().numpy(),
        n_queries=L,
        topk=topk,
        window=window,
        cap=cache.cap,
        block=block,
        ext_of_first_chunk_token=cache.topk + cache.tail_slots,
    )
    final_pool = torch.full((len(scan.final_pool), topk), -1, dtype=torch.int64)
    for b, ids in enumerate(scan.final_pool):
        final_pool[b, : len(ids)] = torch.tensor(sorted(ids), dtype=torch.int64)
    return DeviceScan(
        theta_u=scan.theta_u.to(dev),
        theta_pos=scan.theta_pos.to(dev),
        tau=torch.from_numpy(scan.tau).to(dev),
        n_active=torch.from_numpy(scan.n_active).to(dev),
        fingerprint=scan.fingerprint.to(dev),
        block_pool=scan.block_pool.to(dev),
        final_pool=final_pool.to(dev),
        threshold=cache.threshold_tensors(scan.states),
    )


def _triton_available() -> bool:
    try:
        from longtrain.ops.sparsek_attention import triton_core  # noqa: F401
    except ImportError:
        return False
    return True


def sparsek_attention_chunk(
    q: torch.Tensor,  # [B, L, H, D]
    k: torch.Tensor,  # [B, L, Hkv, D] (after RoPE)
    v: torch.Tensor,  # [B, L, Hkv, D]
    u: torch.Tensor,  # [B, L] importance scores
    cache: SparseKCache,
    *,
    topk: int,
    window: int,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    lengths: torch.Tensor | None = None,  # [B] valid tokens per row (default L)
    backend: str = "auto",
    block: int = 64,
    scan: str = "auto",
) -> tuple[torch.Tensor, SparseKCache, ChunkSelection]:
    """SparseK attention of one chunk continuing from `cache`; returns (o, next cache, selection).

    backend: the attention core ("triton" kernels or the "naive" reference; auto: kernels on CUDA).
    scan: the selection scan ("device": wavelet scan on the tensors' device, exact selection, tau
    to rounding; "host": the CPU heaps; auto: device on CUDA unless the scores are float64).
    """
    _check(q, k, v, u, topk, window, variant, backend, scan)
    if cache.topk != topk or cache.tail_slots != max(window - 1, 0):
        raise ValueError(
            f"cache was built for topk={cache.topk}, window={cache.tail_slots + 1}; the call uses topk={topk}, window={window}"
        )
    B, L, H, D = q.shape
    dev = q.device
    K, Wt = topk, cache.tail_slots
    if lengths is None:
        lengths = torch.full((B,), L, dtype=torch.int64, device=dev)
    lengths = lengths.to(device=dev, dtype=torch.int64)
    seen = cache.seen.to(dev)

    # 1. The extended key layout [pool K][tail W-1][chunk L] with absolute positions.
    ar = torch.arange(L, device=dev)
    chunk_pos = torch.where(ar[None] < lengths[:, None], seen[:, None] + ar[None], -1)  # [B, L]
    tail_pos = seen[:, None] - Wt + torch.arange(Wt, device=dev)[None]  # [B, W-1]
    tail_pos = torch.where(tail_pos >= 0, tail_pos, -1)
    pos_ext = torch.cat([cache.pool_pos.to(dev), tail_pos, chunk_pos], dim=1)  # [B, N]
    k_ext = torch.cat([cache.pool_k.to(k.dtype), cache.tail_k.to(k.dtype), k], dim=1)
    v_ext = torch.cat([cache.pool_v.to(v.dtype), cache.tail_v.to(v.dtype), v], dim=1)
    u_ext = torch.cat([cache.pool_u.to(u.dtype), cache.tail_u.to(u.dtype), u], dim=1)

    # 2. The selection scan, continuing from the cache's state: on the tensors' device, or CPU heaps.
    if _pick_scan(scan, u_ext) == "device":
        from longtrain.ops.selection.scan_device import scan_chunk_device  # needs Triton

        sel = scan_chunk_device(
            u_ext, pos_ext, thr_u=cache.thr_u.to(dev), thr_count=cache.thr_count.to(dev),
            overflow=cache.overflow.to(dev), seen=seen, lengths=lengths, n_queries=L, topk=topk,
            window=window, block=block, tau_prev=cache.tau.to(dev),
        )
    else:
        sel = _host_scan(u_ext, pos_ext, cache, seen, lengths, L, topk, window, block)
    tau = ThresholdFn.apply(u, sel.tau, sel.n_active, lengths, window)

    # 3. The attention core.
    core_args = (q, k_ext, v_ext, u_ext, pos_ext, chunk_pos, sel.theta_u, sel.theta_pos, tau, sel.block_pool)
    core_kw = dict(topk=topk, window=window, tail_slots=Wt, variant=variant, scale=scale, block=block)
    if _pick_backend(backend, q) == "triton":
        from longtrain.ops.sparsek_attention.triton_core import sparsek_attention_core_triton

        o = sparsek_attention_core_triton(*core_args, **core_kw)
    else:
        o = sparsek_attention_core_naive(*core_args, **core_kw)

    # 4. The next cache: the top-k pool and the last w-1 positions, detached.
    pool_idx = sel.final_pool  # [B, K] ext indices, -1 empty
    tail_idx = K + lengths[:, None] + torch.arange(Wt, device=dev)[None]  # positions t-(W-1)..t-1
    rows = torch.arange(B, device=dev)[:, None]
    pool_ok = pool_idx >= 0
    pi = pool_idx.clamp(min=0)
    with torch.no_grad():
        okv = pool_ok[:, :, None, None]
        new = dict(
            pool_k=torch.where(okv, k_ext[rows, pi], 0).to(cache.pool_k.dtype),
            pool_v=torch.where(okv, v_ext[rows, pi], 0).to(cache.pool_v.dtype),
            pool_u=torch.where(pool_ok, u_ext[rows, pi], -float("inf")).to(cache.pool_u.dtype),
            pool_pos=torch.where(pool_ok, pos_ext[rows, pi], -1),
            tail_k=k_ext[rows, tail_idx].to(cache.tail_k.dtype),
            tail_v=v_ext[rows, tail_idx].to(cache.tail_v.dtype),
            tail_u=u_ext[rows, tail_idx].to(cache.tail_u.dtype),
            seen=seen + lengths,
            **{name: t.to(dev) for name, t in sel.threshold.items()},
        )
    next_cache = SparseKCache(**{name: t.detach() for name, t in new.items()})
    selection = ChunkSelection(
        fingerprint=sel.fingerprint,
        theta_pos=sel.theta_pos,
        tau=sel.tau,
        n_active=sel.n_active,
        overflow=next_cache.overflow,
    )
    return o, next_cache, selection


def sparsek_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    *,
    topk: int,
    window: int,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    backend: str = "auto",
    scan: str = "auto",
) -> torch.Tensor:
    """SparseK attention over whole sequences (positions 0..T-1): o [B, T, H, D].

    q [B, T, H, D], k and v [B, T, Hkv, D], u [B, T] importance scores. topk = 0 is a sliding
    window, window = 0 is SparseK only, topk + window >= T is full causal attention.
    """
    _check(q, k, v, u, topk, window, variant, backend, scan)
    cache = SparseKCache.empty(
        q.shape[0], topk, window, k.shape[2], k.shape[3], dtype=k.dtype, score_dtype=u.dtype, device=q.device
    )
    o, _, _ = sparsek_attention_chunk(
        q, k, v, u, cache, topk=topk, window=window, variant=variant, scale=scale, backend=backend, scan=scan
    )
    return o
