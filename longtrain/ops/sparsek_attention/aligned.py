"""Query tiles at absolute positions: a chunk computes each query exactly as the unchunked pass does.

The attention cores take queries in tiles of G (each tile: the pool at its first query, then one band
of positions, DESIGN.md fact 2) and round a sum whose order is that layout. A chunk's tiles start at
its first token, so a chunk that starts at seen = a + r (a a multiple of G, 0 < r < G) lays out every
query differently from the unchunked pass, whose tiles start at multiples of G. In bf16 one rounding
step of difference is enough: a deep model carries it into the next layers' scores and selections
(issue 24). Here the chunk is laid out as if it started at a:

  queries   [r dummy rows at positions a .. seen-1][the chunk's L queries][padding]
  keys      [cache pool K][positions a-(w-1) .. a-1][positions a .. ][ghosts K]

so tile t holds the queries at positions a + tG .. as in the unchunked pass. The chunk is always
padded by G - 1 rows, so shapes do not depend on r and nothing waits for the device.

The dummy rows select every pool and band key (theta = -inf): the selecting rows of a key stay a
prefix of the tile, which the kernels' cuts assume; their outputs are dropped. The band's keys older
than the cache's tail (a - w < p <= seen - w) are candidates of every real query: the pooled ones come
from the pool, the others are never attended again (DESIGN.md fact 1) and stand in as zeros with a
score below every theta. Tile 0's pool is the pool at a: its keys still pooled at seen, plus "ghosts"
for the ones evicted between a and seen (positions carried in the cache; zeros, never attended), so
the keys sit at the same places in the tile as in the unchunked pass. Tiles t >= 1 take the pool at
their first query: the top-k of the scan's pool at the block start before it and the candidates that
joined since (pool_at). The cores order each tile's pool by position.

Only without gradients (evaluation, verify-equivalence, generation): the backward's pool walk needs
stable slots across tiles. Training chunks start at multiples of their size, aligned whenever the
chunk size is a multiple of G.
"""

from __future__ import annotations

import torch

INT64_MAX = torch.iinfo(torch.int64).max
# The score of a stand-in key: below every real query's theta (one exists only where the query has more
# than k candidates), and finite: the kernels multiply a masked p = 0 by its gate min(u - tau, 1).
DEAD_SCORE = -1e30


def query_tile(core: str, block: int) -> int:
    """The query tile G of a core ("naive" or "triton") for the op's block."""
    if core == "triton":
        from longtrain.ops.sparsek_attention.triton_core import QUERY_TILE

        return max(block, QUERY_TILE)
    return block


def _take(x: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, fill) -> torch.Tensor:
    """x[b, idx[b, j]] where ok, else fill; x [B, N, ...], idx and ok [B, J]."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    got = x[rows, idx.clamp(0, x.shape[1] - 1)]
    okx = ok.view(*ok.shape, *([1] * (got.dim() - 2)))
    return torch.where(okx, got, fill)  # (a Python scalar: no tensor from host data)


def pool_at(block_pool, u_ext, pos_ext, c, *, topk, window, block):
    """The pool of query c (op's index) [B, M, K] as ext indices (-1 empty), for offsets c [B, M] >= 0:
    the top-k by (u, position) of the scan's pool at the block start c0 <= c and the candidates that
    joined after it (positions seen + c0 - w < p <= seen + c - w, fewer than `block`)."""
    B, M = c.shape
    dev = c.device
    K, Wt = topk, max(window - 1, 0)
    rows = torch.arange(B, device=dev)[:, None, None]
    nb = block_pool.shape[1]
    c = c.clamp(min=0)
    b0 = torch.div(c, block, rounding_mode="floor").clamp(max=max(nb - 1, 0))
    base = block_pool[torch.arange(B, device=dev)[:, None], b0]  # [B, M, K]
    d = torch.arange(block, device=dev)[None, None]
    new = K + Wt + b0[..., None] * block - window + 1 + d  # ext index of the d-th candidate to join
    new = torch.where((d < (c - b0 * block)[..., None]) & (new < u_ext.shape[1]), new, -1)  # (c past the chunk: masked by the caller)
    cand = torch.cat([base, new], -1)  # [B, M, K + block]
    ok = cand >= 0
    safe = cand.clamp(min=0)
    cu = torch.where(ok, u_ext[rows, safe], float("-inf"))
    cp = torch.where(ok, pos_ext[rows, safe], -1)
    ok &= cp >= 0
    cu = torch.where(ok, cu, float("-inf"))
    # (u, position) descending: by position first, then a stable sort by u.
    order = cp.argsort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, cu.gather(-1, order).argsort(dim=-1, descending=True, stable=True))[..., :K]
    return torch.where(ok.gather(-1, order), cand.gather(-1, order), -1)


@torch.no_grad()
def aligned_inputs(q, keys, scan, tau, tile_pool, *, window, tile, block, query_terms=(), key_terms=()):
    """The core's inputs for tiles at absolute positions, a function that cuts its output back, and the
    extra per-query and per-key tensors laid out the same way.

    q [B, L, H, D]; keys: the chunk's ExtendedKeys [pool][tail][chunk]; scan: its ScanResult (pools at
    every `block` queries); tau [B, L]; tile_pool: the cache's (tile_pool_pos, tile_pool_at), or None.
    query_terms: tensors [B, L, ...] with a row per query (the linear types' phi(q), num, den): laid out as q,
    0 on dummy and padding rows; key_terms: tensors [B, N, ...] with a row per extended key (phi(k)): laid
    out as k, 0 on stand-in and ghost keys. Returns (inputs, cut_back, query_terms + key_terms laid out)."""
    k_ext, v_ext, u_ext, pos_ext, seen, lengths = keys.k, keys.v, keys.u, keys.pos, keys.seen, keys.lengths
    B, L = q.shape[:2]
    N, dev = u_ext.shape[1], q.device
    K, Wt = keys.topk, keys.tail_slots
    pool_pos = pos_ext[:, :K]  # the cache's pool
    r = seen % tile  # [B] dummy rows before the first query
    a = seen - r
    R = tile - 1  # rows of padding whatever r is: no host synchronisation
    Lp = L + R
    rows = torch.arange(B, device=dev)[:, None]

    # Keys [K + Wt + Lp]: slot K + j holds position a - Wt + j; slots j >= r are the op's tail and chunk.
    j = torch.arange(Wt + Lp, device=dev)[None]  # [1, Wt + Lp]
    p = a[:, None] - Wt + j
    src = torch.where((j >= r[:, None]) & (K + j - r[:, None] < N), K + j - r[:, None], -1)  # op's ext index
    if K > 0:  # older than the tail (j < r): the pooled ones come from the pool
        old = p[:, :R]
        hit = (pool_pos[:, None, :] == old[:, :, None]) & (old[:, :, None] >= 0)  # [B, R, K]
        slot = hit.int().argmax(-1)
        src[:, :R] = torch.where(hit.any(-1) & (j[:, :R] < r[:, None]), slot, src[:, :R])
    ok = src >= 0
    band_k, band_v = _take(k_ext, src, ok, 0.0), _take(v_ext, src, ok, 0.0)
    band_u = _take(u_ext, src, ok, DEAD_SCORE)
    band_pos = torch.where(ok, _take(pos_ext, src, ok, -1), torch.where((j < r[:, None]) & (p >= 0), p, -1))

    # Ghosts: the pool at `a` minus what is still pooled at seen (known when the cache holds that pool).
    if tile_pool is None:
        tile_pool = (torch.full((B, K), -1, dtype=torch.int64, device=dev), torch.full((B,), -1, dtype=torch.int64, device=dev))
    tile_pos, tile_at = tile_pool[0].to(dev), tile_pool[1].to(dev)
    known = (tile_at == a) & (r > 0)
    pooled = (tile_pos[:, :, None] == pool_pos[:, None, :]).any(-1)  # [B, K]
    ghost = known[:, None] & (tile_pos >= 0) & ~pooled
    ghost_pos = torch.where(ghost, tile_pos, -1)
    G0 = K + Wt + Lp  # ext index of ghost slot 0
    zeros_kv = k_ext.new_zeros(B, K, *k_ext.shape[2:])

    k_p = torch.cat([k_ext[:, :K], band_k, zeros_kv], 1)
    v_p = torch.cat([v_ext[:, :K], band_v, zeros_kv.to(v_ext.dtype)], 1)
    u_p = torch.cat([u_ext[:, :K], band_u, torch.full((B, K), DEAD_SCORE, dtype=u_ext.dtype, device=dev)], 1)
    pos_p = torch.cat([pos_ext[:, :K], band_pos, ghost_pos], 1)

    # Queries [Lp]: r dummy rows, the chunk, padding.
    qi = torch.arange(Lp, device=dev)[None]
    c = qi - r[:, None]  # the op's query index
    real = (c >= 0) & (c < lengths[:, None])
    dummy = c < 0
    q_p = _take(q, c, real, 0.0)
    qpos_p = torch.where(real | dummy, a[:, None] + qi, -1)
    thu_p = torch.where(dummy, float("-inf"), _take(scan.theta_u, c, real, float("inf")))
    thp_p = torch.where(dummy, INT64_MAX, _take(scan.theta_pos, c, real, INT64_MAX))
    tau_p = _take(tau.detach(), c, real, 0.0)

    # Pools per block of the padded queries (rows at multiples of `block`).
    nb = -(-Lp // block)
    first = torch.arange(nb, device=dev)[None] * block - r[:, None]  # the op's query index of each block start
    from_scan = (first >= 0) & (first < lengths[:, None])
    snap = pool_at(scan.block_pool.to(dev), u_ext, pos_ext, first, topk=K, window=window, block=block)
    snap = torch.where(snap >= K, snap + r[:, None, None], snap)  # tail and chunk moved r slots on
    snap = torch.where(from_scan[..., None], snap, -1)
    if K > 0:  # tile 0 of a chunk that starts inside it: the pool at `a`
        keep = (pool_pos >= 0) & (pool_pos <= a[:, None] - window)
        cand = torch.cat([torch.where(keep, torch.arange(K, device=dev)[None], -1),
                          torch.where(ghost, G0 + torch.arange(K, device=dev)[None], -1)], 1)  # [B, 2K]
        tile0 = cand.sort(dim=-1, descending=True).values[:, :K]  # at most K are kept (the pool at a)
        snap[:, 0] = torch.where((r > 0)[:, None], tile0, snap[:, 0])

    def cut_back(o_p: torch.Tensor) -> torch.Tensor:
        """The chunk's rows [B, L, ...] of the padded output."""
        return o_p[rows, r[:, None] + torch.arange(L, device=dev)[None]]

    def key_rows(x: torch.Tensor) -> torch.Tensor:  # [B, N, ...] -> [B, K + Wt + Lp + K, ...], as k_p
        return torch.cat([x[:, :K], _take(x, src, ok, 0.0), x.new_zeros(B, K, *x.shape[2:])], 1)

    inputs = (q_p, k_p, v_p, u_p, pos_p, qpos_p, thu_p, thp_p, tau_p, snap)
    terms = tuple(_take(x, c, real, 0.0) for x in query_terms) + tuple(key_rows(x) for x in key_terms)
    return inputs, cut_back, terms


@torch.no_grad()
def next_tile_pool(tile_pool, keys, scan, *, tile, window, block):
    """(tile_pool_pos, tile_pool_at) after the chunk: the pool at the last tile start <= seen + length,
    from the cache's (tile_pool_pos, tile_pool_at) before it, the chunk's ExtendedScores and ScanResult
    (unknown at the chunk's end when w = 0: a query is then its own candidate, so the pool after the
    chunk is not the pool at its end)."""
    u_ext, pos_ext, seen, lengths = keys.u, keys.pos, keys.seen, keys.lengths
    B, K = scan.final_pool.shape
    dev = pos_ext.device
    rows = torch.arange(B, device=dev)[:, None]
    end = seen + lengths
    at = end - end % tile
    c = at - seen  # the op's query index of that tile start (< 0: before the chunk)
    inside = (c >= 0) & (c < lengths)
    at_end = (c == lengths) & (window > 0)
    snap = pool_at(scan.block_pool.to(dev), u_ext, pos_ext, c[:, None], topk=K, window=window, block=block)[:, 0]
    snap = torch.where(at_end[:, None], scan.final_pool.to(dev), torch.where(inside[:, None], snap, -1))
    kpos = torch.where(snap >= 0, pos_ext[rows, snap.clamp(min=0)], -1).sort(dim=-1).values
    have = inside | at_end
    before = c < 0
    pos = torch.where(before[:, None], tile_pool[0].to(dev), torch.where(have[:, None], kpos, -1))
    at = torch.where(before, tile_pool[1].to(dev), torch.where(have, at, -1))
    return pos, at
