"""The public SparseK attention op: one chunk against a SparseKCache, or a whole sequence.

A chunk call runs four stages, each a public function that benchmarks and tests call too:
  1. lay_out_keys: keys as [cache pool][cache tail][chunk] with absolute positions (ExtendedKeys);
  2. select (longtrain.ops.selection): the selection scan, continuing from the cache's threshold state;
  3. attend: the attention core (the naive reference or the Triton kernels, one signature);
  4. next_cache: the top-k pool after the chunk and the last w-1 positions as the tail, detached.
Everything stored in the cache is detached: gradients stop at the chunk boundary. Without gradients
the core's query tiles sit at absolute positions (aligned.py), so each query is computed bitwise as in
the unchunked pass wherever the chunk starts (issue 24).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longtrain.ops.selection import ExtendedScores, ScanResult, ThresholdFn, lay_out_scores, select
from longtrain.ops.selection.chunk import carried, check_scan, next_state, triton_available
from longtrain.ops.sparsek_attention.aligned import aligned_inputs, next_tile_pool, query_tile
from longtrain.ops.sparsek_attention.cache import SparseKCache, SparseKRingCache
from longtrain.ops.sparsek_attention.naive import VARIANTS, sparsek_attention_core_naive

BACKENDS = ("auto", "naive", "triton")


@dataclass
class ExtendedKeys(ExtendedScores):
    """ExtendedScores with the keys and values in the same layout [pool K][tail W-1][chunk L]."""

    k: torch.Tensor  # [B, N, Hkv, D] (after RoPE)
    v: torch.Tensor  # [B, N, Hkv, D]


@dataclass
class ChunkSelection:
    """What was selected in a chunk: enough to compare two runs query by query."""

    fingerprint: torch.Tensor  # [B, L] int64 hash of S_i (0 when nothing is selected)
    theta_pos: torch.Tensor  # [B, L] int64
    tau: torch.Tensor  # [B, L] float64
    n_active: torch.Tensor  # [B, L] int64
    # (all on the device of the call: reading them is the caller's host sync)
    overflow: torch.Tensor  # [B] int64 scores dropped at the threshold state's cap (kept on device)
    u: torch.Tensor | None = None  # [B, L] the chunk's scores, detached (diagnostics, `longtrain inspect`)

    @classmethod
    def of(cls, scan: ScanResult, u: torch.Tensor | None = None) -> "ChunkSelection":
        return cls(fingerprint=scan.fingerprint, theta_pos=scan.theta_pos, tau=scan.tau, n_active=scan.n_active,
                   overflow=scan.threshold.overflow, u=None if u is None else u.detach())

    @property
    def overflowed(self) -> bool:
        """The threshold state hit its cap: tau is no longer exact (a host sync)."""
        return bool((self.overflow > 0).any())


def check_inputs(q, k, v, u, variant: str, *, one_token: bool = False) -> None:
    """The one check of an op call's tensors and variant, chunk and decode alike: q [B, T, H, D], k and v
    [B, T, Hkv, D], u [B, T]; one_token (the decode step): the same without T. The sizes are the cache's."""
    lead, names = (1, "[B") if one_token else (2, "[B, T")
    if q.dim() != lead + 2 or k.dim() != lead + 2 or v.dim() != lead + 2:
        raise ValueError(f"q must be {names}, H, D], k and v {names}, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:lead] != k.shape[:lead] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"query heads ({q.shape[-2]}) must be a multiple of kv heads ({k.shape[-2]})")
    if u.shape != q.shape[:lead]:
        raise ValueError(f"u must be {names}] = {list(q.shape[:lead])}; got {tuple(u.shape)}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")


def _check(q, k, v, u, variant, backend, scan="auto"):
    check_inputs(q, k, v, u, variant)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    check_scan(scan, u)


def _pick_backend(backend: str, q: torch.Tensor) -> str:
    if backend == "auto":  # the kernels take half precision and float32, not float64
        return "triton" if q.is_cuda and q.dtype != torch.float64 and triton_available() else "naive"
    return backend


def _differentiable(*tensors: torch.Tensor) -> bool:
    """Whether autograd records this chunk (training): its tiles then start at the chunk start (the
    backward's pool walk needs stable slots), and no later aligned chunk reads its tile's pool."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def starts_inside_tile(seen: torch.Tensor, *, dtype: torch.dtype, backend: str = "auto", block: int = 64) -> bool:
    """Whether some row's next chunk (at positions seen [B] ..) starts inside a query tile of the core
    that `backend` picks for queries of `dtype` on seen's device: where `align` matters. One host read."""
    name = _pick_backend(backend, torch.empty(0, dtype=dtype, device=seen.device))
    return bool((seen % query_tile(name, block)).ne(0).any())


def lay_out_keys(cache: SparseKCache, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor,
                 lengths: torch.Tensor | None = None) -> ExtendedKeys:
    """Stage 1: the chunk's keys k, v [B, L, Hkv, D] and scores u [B, L] after the cache's pool and tail."""
    scores = lay_out_scores(cache, u, lengths)
    return ExtendedKeys(
        **{name: getattr(scores, name) for name in ExtendedScores.__dataclass_fields__},
        k=torch.cat([cache.pool_k.to(k.dtype), cache.tail_k.to(k.dtype), k], dim=1),  # [B, N, Hkv, D]
        v=torch.cat([cache.pool_v.to(v.dtype), cache.tail_v.to(v.dtype), v], dim=1),
    )


def attend(q: torch.Tensor, keys: ExtendedKeys, scan: ScanResult, tau: torch.Tensor, *, window: int,
           variant: str = "hard_k_soft_v", scale: float | None = None, block: int = 64,
           backend: str = "auto", tile_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
           align: bool | None = None) -> torch.Tensor:
    """Stage 3: o [B, L, H, D] of the chunk's queries q over their window and selected keys, gated by tau
    [B, L] (differentiable: ThresholdFn of the chunk's scores in the op).

    Without gradients the query tiles sit at absolute positions (aligned.py); tile_pool, the cache's
    (tile_pool_pos, tile_pool_at), lets a chunk that starts inside a tile lay it out to the bit as the
    unchunked pass does (None: the same results, maybe not to the bit). align=False skips that layout
    (for chunks known to start on a tile edge, where the plain layout is already the unchunked pass's)."""
    name = _pick_backend(backend, q)
    core = sparsek_attention_core_naive
    if name == "triton":
        from longtrain.ops.sparsek_attention.triton_core import sparsek_attention_core_triton as core

    args = (q, keys.k, keys.v, keys.u, keys.pos, keys.q_pos, scan.theta_u, scan.theta_pos, tau, scan.block_pool)
    aligned = align is not False and not _differentiable(q, keys.k, keys.v, keys.u)
    if aligned:
        args, cut_back, _ = aligned_inputs(q, keys, scan, tau, tile_pool, window=window, tile=query_tile(name, block),
                                        block=block)
    o = core(*args, topk=keys.topk, window=window, tail_slots=keys.tail_slots, variant=variant, scale=scale,
             block=block)
    return cut_back(o) if aligned else o


@torch.no_grad()
def next_cache(cache: SparseKCache, keys: ExtendedKeys, scan: ScanResult, *, window: int | None = None,
               tile: int | None = None, block: int = 64) -> SparseKCache:
    """Stage 4: the cache after the chunk: the selection's next state and the K, V of its pool and tail;
    with window and tile (the core's query tile, aligned.query_tile) also the pool at the last tile start."""
    rows = carried(keys, scan)
    okv = rows.pool_ok[:, :, None, None]
    tile_pool = (cache.tile_pool_pos, cache.tile_pool_at)
    if window is not None and tile is not None:
        tile_pool = next_tile_pool(tile_pool, keys, scan, tile=tile, window=window, block=block)
    return SparseKCache(
        **next_state(cache, keys, scan, rows).tensors(),
        pool_k=torch.where(okv, keys.k[rows.rows, rows.pool], 0).to(cache.pool_k.dtype),
        pool_v=torch.where(okv, keys.v[rows.rows, rows.pool], 0).to(cache.pool_v.dtype),
        tail_k=keys.k[rows.rows, rows.tail].to(cache.tail_k.dtype),
        tail_v=keys.v[rows.rows, rows.tail].to(cache.tail_v.dtype),
        tile_pool_pos=tile_pool[0], tile_pool_at=tile_pool[1], window=cache.window,
    )


def sparsek_attention_chunk(
    q: torch.Tensor,  # [B, L, H, D]
    k: torch.Tensor,  # [B, L, Hkv, D] (after RoPE)
    v: torch.Tensor,  # [B, L, Hkv, D]
    u: torch.Tensor,  # [B, L] importance scores
    cache: SparseKCache,  # its topk and window are the call's
    *,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    lengths: torch.Tensor | None = None,  # [B] valid tokens per row (default L)
    backend: str = "auto",
    block: int = 64,
    scan: str = "auto",
    align: bool | None = None,
) -> tuple[torch.Tensor, SparseKCache, ChunkSelection]:
    """SparseK attention of one chunk continuing from `cache`; returns (o, next cache, selection).

    backend: the attention core ("triton" kernels or the "naive" reference; auto: kernels on CUDA).
    scan: the selection scan ("device": wavelet scan on the tensors' device, exact selection, tau
    to rounding; "host": the CPU heaps; auto: device on CUDA unless the scores are float64).
    align: without gradients, lay the query tiles at absolute positions (aligned.py: bitwise the
    unchunked pass when the chunk starts inside a tile; slower). None: always; False: never (the caller
    knows every row starts on a tile edge: starts_inside_tile).
    """
    _check(q, k, v, u, variant, backend, scan)
    if isinstance(cache, SparseKRingCache):
        raise TypeError("a SparseKRingCache is the decoder's layout, which decode steps update in place; the chunk op "
                        "takes the chunk layout: from_ring(cache) (ModelCache.from_ring for a model's cache)")
    window = cache.window
    keys = lay_out_keys(cache, k, v, u, lengths)
    sel = select(keys, cache, window=window, block=block, scan=scan)
    tau = ThresholdFn.apply(u, sel.tau, sel.n_active, keys.lengths, window)
    o = attend(q, keys, sel, tau, window=window, variant=variant, scale=scale, block=block, backend=backend,
               tile_pool=(cache.tile_pool_pos, cache.tile_pool_at), align=align)
    # Training skips the pool at the last tile start, keeping the cache's older (tile_pool_pos,
    # tile_pool_at): still true of that older tile start.
    tile = None if _differentiable(q, k, v, u) else query_tile(_pick_backend(backend, q), block)
    return o, next_cache(cache, keys, sel, window=window, tile=tile, block=block), ChunkSelection.of(sel, u)


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
    _check(q, k, v, u, variant, backend, scan)
    cache = SparseKCache.empty(
        q.shape[0], topk, window, k.shape[2], k.shape[3], dtype=k.dtype, score_dtype=u.dtype, device=q.device
    )
    o, _, _ = sparsek_attention_chunk(
        q, k, v, u, cache, variant=variant, scale=scale, backend=backend, scan=scan,
        align=False,  # position 0 is a tile edge
    )
    return o
