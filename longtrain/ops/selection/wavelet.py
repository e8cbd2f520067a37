"""A wavelet tree over each row's ranks: prefix counts, score sums and quantiles in O(log n).

The device selection scan (device.py) asks, for every query, two questions about the first P
items of a row in ext order (each item tagged with its rank in the row's score order):
  - which item is the r-th best (theta: r = k - 1), and the hash sum of the better ones;
  - how many items rank better than rho, and the sum of their scores (tau's piecewise-linear f).

The ranks are a permutation of 0..N-1, so the tree needs no bookkeeping of node bounds: level l
(0 <= l <= LV) has nodes of 2**(LV - l) consecutive ranks, node t holding ranks
[t * 2**(LV-l), (t+1) * 2**(LV-l)) at the same positions, its items sorted by ext index. Level LV
is the rank order itself; level 0 the ext order. Level l is the merge sort of level l + 1's
children: a bottom-up merge sort of the items by ext index, started from the rank order.
Per level we keep, in-node and inclusive:
  - left[l, p] = (z, their score sum): z items of the node's left child (rank bit LV-1-l = 0) among
    its first p - start + 1, side by side with the sum of those z items' scores;
  - score_sum[l, p], hash_sum[l, p]: the sums of their scores and hashes over the same prefix.
A descent reads one record per level: the first m items of a node (ext < P) put left[.., m-1]'s z
of them in the left child, which are its first ones (children are sorted by ext index too).

Building a level is one merge per child pair: each item's place in its parent is its own index plus
the number of the sibling's items with a smaller ext index (a binary search), and the parent's
prefix sums are the two children's prefix sums at the split: no scan, no sort. The low levels
(nodes up to a tile) run in one launch, a tile per program; each higher level is a launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MERGE_TILE = 256  # positions per program of the low levels (a power of two)
UPPER_TILE = 128  # positions per program of a high level


@dataclass
class WaveletTree:
    order: torch.Tensor  # [B, LV+1, N] int32: each level's items (ext indices); level LV is the rank order
    left: torch.Tensor  # [B, LV, N, 2] int64: (left-child items among the node's first p - start + 1,
    #                     float64 bits of those items' score sum), side by side: one sector per descent step
    score_sum: torch.Tensor  # [B, LV+1, N] float64: their scores' in-node inclusive prefix sum, per level
    hash_sum: torch.Tensor  # [B, LV+1, N] int64: the same for hashes (wrapping)

    @property
    def levels(self) -> int:
        return self.left.shape[1]


def wavelet_levels(n: int) -> int:
    """Bits for ranks and thresholds rho in [0, n]: the root's 2**LV ranks exceed n."""
    return max(1, int(n).bit_length())


@triton.jit
def tree_count_below(LEFT, zrow, P, rho, LV, N):
    """Count and score sum of the items among the first P (ext order) whose rank is below rho."""
    s = tl.zeros_like(P)  # the node's start (its first rank and position)
    m = P  # its items with ext index < P: its first m
    cnt = tl.zeros_like(P)
    ssum = tl.zeros(P.shape, tl.float64)
    for level in range(LV):
        right = ((rho >> (LV - 1 - level)) & 1) == 1  # the left child's items all rank below rho
        rec = LEFT + 2 * (zrow + level * N + s + m - 1)
        z = tl.load(rec, mask=m > 0, other=0).to(tl.int32)  # of them in the left child
        ssum += tl.load(rec + 1, mask=right & (m > 0), other=0).to(tl.float64, bitcast=True)
        cnt += tl.where(right, z, 0)
        s = tl.where(right, s + (1 << (LV - 1 - level)), s)
        m = tl.where(right, m - z, z)
    return cnt, ssum


@triton.jit
def tree_quantile(LEFT, HS, zrow, hrow, P, r, LV, N):
    """The rank of the r-th best (0-based) item among the first P, and the hash sum of the better ones."""
    s = tl.zeros_like(P)
    m = P
    hsum = tl.zeros(P.shape, tl.int64)
    for level in range(LV):
        z = tl.load(LEFT + 2 * (zrow + level * N + s + m - 1), mask=m > 0, other=0).to(tl.int32)
        right = r >= z  # not among the left child's: skip them
        r = tl.where(right, r - z, r)
        hsum += tl.load(HS + hrow + (level + 1) * N + s + z - 1, mask=right & (z > 0), other=0)
        s = tl.where(right, s + (1 << (LV - 1 - level)), s)
        m = tl.where(right, m - z, z)
    return s, hsum


@triton.jit
def _merge_level(ORD, LEFT, SS, HS, orow, zrow, srow, p, pm, level, LV, N):
    """Build level `level` from level + 1 at positions p: each item's place in the merged parent."""
    lg = LV - 1 - level  # children hold 2**lg ranks
    half = 1 << lg
    src = (level + 1) * N + p
    x = tl.load(ORD + orow + src, mask=pm, other=0)  # ext index (the merge key)
    sp = tl.load(SS + srow + src, mask=pm, other=0.0)
    hp = tl.load(HS + srow + src, mask=pm, other=0)
    child = p >> lg
    i = p - (child << lg)  # index in its child
    sib = (child ^ 1) << lg  # the sibling's start
    lo = tl.zeros_like(p)
    hi = tl.minimum(tl.maximum(N - sib, 0), half)  # the sibling's length
    for _ in range(lg + 1):  # lower bound of x among the sibling's ext indices
        act = pm & (lo < hi)
        mid = (lo + hi) >> 1
        less = tl.load(ORD + orow + (level + 1) * N + sib + mid, mask=act, other=0) < x
        lo = tl.where(act & less, mid + 1, lo)
        hi = tl.where(act & ~less, mid, hi)
    out = ((child >> 1) << (lg + 1)) + i + lo  # the parent's start + place
    is_left = (child & 1) == 0
    z = tl.where(is_left, i + 1, lo)  # left-child items up to and including it
    sib_m = pm & (lo > 0)
    sib_sp = tl.load(SS + srow + (level + 1) * N + sib + lo - 1, mask=sib_m, other=0.0)
    own = sp
    sp += sib_sp
    hp += tl.load(HS + srow + (level + 1) * N + sib + lo - 1, mask=sib_m, other=0)
    rec = LEFT + 2 * (zrow + level * N + out)  # (z, their score sum): one sector per descent step
    tl.store(rec, z.to(tl.int64), mask=pm)
    tl.store(rec + 1, tl.where(is_left, own, sib_sp).to(tl.int64, bitcast=True), mask=pm)
    tl.store(ORD + orow + level * N + out, x, mask=pm)
    tl.store(SS + srow + level * N + out, sp, mask=pm)
    tl.store(HS + srow + level * N + out, hp, mask=pm)


@triton.jit
def _merge_levels_kernel(ORD, LEFT, SS, HS, N, LV, TOP, NLEV, BLK: tl.constexpr):
    """Levels TOP-1 down to TOP-NLEV for one tile of positions (grid: tiles, rows).

    With NLEV > 1 every node built must fit in the tile: the program reads only what it wrote."""
    b = tl.program_id(1).to(tl.int64)
    p = tl.program_id(0) * BLK + tl.arange(0, BLK)
    pm = p < N
    orow = b * (LV + 1) * N
    zrow = b * LV * N
    for k in range(NLEV):
        _merge_level(ORD, LEFT, SS, HS, orow, zrow, orow, p, pm, TOP - 1 - k, LV, N)
        tl.debug_barrier()  # the next level reads this one's stores, made by other threads


def empty_wavelet_tree(B: int, N: int, device) -> WaveletTree:
    """Storage for a tree over N ranks per row; the caller fills the leaves (level LV) before merge_levels."""
    LV = wavelet_levels(N)
    return WaveletTree(
        order=torch.empty(B, LV + 1, N, dtype=torch.int32, device=device),
        left=torch.empty(B, LV, N, 2, dtype=torch.int64, device=device),
        score_sum=torch.empty(B, LV + 1, N, dtype=torch.float64, device=device),
        hash_sum=torch.empty(B, LV + 1, N, dtype=torch.int64, device=device),
    )


def merge_levels(tree: WaveletTree) -> WaveletTree:
    """Levels LV-1 .. 0 from the leaves: one launch for the low levels, one per higher level."""
    B, LV, N = tree.left.shape[:3]
    low = min(LV, MERGE_TILE.bit_length() - 1)  # levels whose nodes fit in a tile
    _merge_levels_kernel[(triton.cdiv(N, MERGE_TILE), B)](
        ORD=tree.order, LEFT=tree.left, SS=tree.score_sum, HS=tree.hash_sum, N=N, LV=LV, TOP=LV, NLEV=low, BLK=MERGE_TILE,
    )
    for level in range(LV - low - 1, -1, -1):
        _merge_levels_kernel[(triton.cdiv(N, UPPER_TILE), B)](
            ORD=tree.order, LEFT=tree.left, SS=tree.score_sum, HS=tree.hash_sum, N=N, LV=LV, TOP=level + 1, NLEV=1,
            BLK=UPPER_TILE,
        )
    return tree


def build_wavelet_tree(
    by_rank: torch.Tensor,  # [B, N] int32: the item (ext index) at each rank, a permutation of 0..N-1
    score: torch.Tensor,  # [B, N] float64: its score (by rank)
    hashes: torch.Tensor,  # [B, N] int64: its hash (by rank)
) -> WaveletTree:
    """The tree by bottom-up merges from the rank order (the leaves: one rank each, its own prefix)."""
    B, N = by_rank.shape
    tree = empty_wavelet_tree(B, N, by_rank.device)
    tree.order[:, -1] = by_rank
    tree.score_sum[:, -1] = score
    tree.hash_sum[:, -1] = hashes
    return merge_levels(tree)
