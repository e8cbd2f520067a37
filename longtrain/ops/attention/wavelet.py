"""A wavelet matrix over per-row rank sequences: prefix counts, score sums and quantiles in O(log n).

The device selection scan (scan_device.py) asks, for every query, two questions about the first n
items of a row (items in position order, each tagged with its rank in the row's score order):
  - which item is the r-th best (theta: r = k - 1), and the hash sum of the better ones;
  - how many items rank better than rho, and the sum of their scores (tau's piecewise-linear f).
A wavelet matrix answers each with one descent through its log2(n) bit levels. Level l holds the
sequence stably partitioned by the rank's higher bits; per level we keep prefix counts of 0-bits and
the prefix sums (score, hash) over the 0-bit items, so a descent reads two entries per level.
Building it is one stable partition (a cumsum and a scatter) per level: O(n log n), all on device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WaveletMatrix:
    zeros: torch.Tensor  # [B, LV, N+1] int32: 0-bit items among the first i of level l's order
    score_sum: torch.Tensor  # [B, LV, N+1] float64: their score sum
    hash_sum: torch.Tensor  # [B, LV, N+1] int64: their hash sum (wrapping)
    n_zeros: torch.Tensor  # [B, LV] int32: 0-bit items at level l (where the 1-bit items start)

    @property
    def levels(self) -> int:
        return self.zeros.shape[1]


def wavelet_levels(n: int) -> int:
    """Bits for ranks and thresholds rho in [0, n]."""
    return max(1, int(n).bit_length())


def _prefix(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [..., N+1] cumsum with a leading 0 (sums of the first i)."""
    return torch.nn.functional.pad(x.cumsum(-1), (1, 0))


def build_wavelet(
    ranks: torch.Tensor,  # [B, N] int64, each row a permutation of 0..N-1
    scores: torch.Tensor,  # [B, N] float64
    hashes: torch.Tensor,  # [B, N] int64
) -> WaveletMatrix:
    """All levels at once (a few batched ops, not a Python loop of launches per level).

    Level l's order is the sequence stably partitioned by rank bit LV-1 (the top), then by bit
    LV-2, ..., l times: a stable sort by the key whose bit m is rank bit LV-1-m (the first bit
    partitioned is the least significant). One batched stable sort gives every level.
    """
    B, N = ranks.shape
    LV = wavelet_levels(N)
    dev = ranks.device
    shift = (LV - 1 - torch.arange(LV, device=dev))[None, :, None]  # [1, LV, 1]
    bits = (ranks[:, None, :] >> shift) & 1  # [B, LV, N]: bit m = rank bit LV-1-m
    weights = bits << torch.arange(LV, device=dev)[None, :, None]
    key = (weights.cumsum(1) - weights).to(torch.int32)  # [B, LV, N]: level l partitions by bits 0..l-1
    order = key.sort(dim=2, stable=True).indices  # [B, LV, N]: level l's order (int32 keys: half the radix passes)
    rank_l = ranks[:, None, :].expand(B, LV, N).gather(2, order)
    is0 = ((rank_l >> shift) & 1) == 0  # [B, LV, N]
    s = scores[:, None, :].expand(B, LV, N).gather(2, order)
    h = hashes[:, None, :].expand(B, LV, N).gather(2, order)
    zeros = _prefix(is0.to(torch.int32)).to(torch.int32)
    return WaveletMatrix(
        zeros=zeros,
        score_sum=_prefix(torch.where(is0, s, 0.0)),
        hash_sum=_prefix(torch.where(is0, h, 0)),
        n_zeros=zeros[:, :, -1].contiguous(),
    )


def build_wavelet_by_levels(ranks: torch.Tensor, scores: torch.Tensor, hashes: torch.Tensor) -> WaveletMatrix:
    """The textbook construction, one stable partition per level: the reference for build_wavelet."""
    B, N = ranks.shape
    LV = wavelet_levels(N)
    dev = ranks.device
    zeros = torch.empty(B, LV, N + 1, dtype=torch.int32, device=dev)
    score_sum = torch.empty(B, LV, N + 1, dtype=torch.float64, device=dev)
    hash_sum = torch.empty(B, LV, N + 1, dtype=torch.int64, device=dev)
    ar = torch.arange(N, device=dev)[None]  # [1, N]
    order, s, h = ranks, scores, hashes
    for level in range(LV):
        is0 = ((order >> (LV - 1 - level)) & 1) == 0  # [B, N]
        z = _prefix(is0.to(torch.int64))  # [B, N+1]
        zeros[:, level] = z
        score_sum[:, level] = _prefix(torch.where(is0, s, 0.0))
        hash_sum[:, level] = _prefix(torch.where(is0, h, 0))
        nz = z[:, -1:]  # [B, 1]
        # Stable partition: 0-bit items first, then 1-bit items, each in their current order.
        dest = torch.where(is0, z[:, :-1], nz + ar - z[:, :-1])
        order = torch.empty_like(order).scatter_(1, dest, order)
        s = torch.empty_like(s).scatter_(1, dest, s)
        h = torch.empty_like(h).scatter_(1, dest, h)
    return WaveletMatrix(zeros, score_sum, hash_sum, zeros[:, :, -1].contiguous())
