"""Plain-torch references for the device scan's building blocks (selection/device.py, wavelet.py):
the sort keys, the merged breakpoints and the wavelet tree, each as sorts and searches."""

import torch

from longtrain.ops.selection.wavelet import WaveletTree, wavelet_levels

INF = float("inf")


def sort_keys_reference(u_ext, pos_ext, thr_u, thr_count):
    """device.sort_keys in plain torch (the same keys, the same order)."""
    B, N = u_ext.shape
    cap = thr_u.shape[1]
    dev = u_ext.device
    u = torch.cat([u_ext.float(), thr_u.float()], 1)
    u = torch.where(u == 0, 0.0, u)
    bits = u.view(torch.int32).long() & 0xFFFFFFFF
    mono = torch.where(bits < 1 << 31, bits + (1 << 31), 0xFFFFFFFF - bits)
    valid = torch.cat([pos_ext >= 0, torch.arange(cap, device=dev)[None] < thr_count[:, None]], 1)
    desc = torch.where(valid, 0xFFFFFFFF - mono, 0xFFFFFFFF)
    return (desc - (1 << 31)).int().flip(1).sort(dim=1, stable=True)


def breakpoints_reference(score: torch.Tensor, nvalid: torch.Tensor):
    """breakpoints_kernel's (t, #{u > t}, #{u - 1 > t}) by a sort and searchsorted, from the scores by rank."""
    B, NM = score.shape
    valid = torch.arange(NM, device=score.device)[None] < nvalid[:, None]
    bp = torch.where(valid, score, INF)
    bpt = torch.cat([bp, bp - 1], 1).sort(1).values.nan_to_num(posinf=torch.finfo(torch.float64).max)
    neg = -score  # ascending
    rv = torch.searchsorted(neg.contiguous(), -bpt.contiguous())
    rw = torch.searchsorted((neg + 1).contiguous(), -bpt.contiguous())
    pad = bpt == torch.finfo(torch.float64).max
    return bpt, torch.where(pad, 0, rv).int(), torch.where(pad, 0, rw).int()


def build_wavelet_tree_reference(by_rank: torch.Tensor, score: torch.Tensor, hashes: torch.Tensor) -> WaveletTree:
    """wavelet.build_wavelet_tree level by level with sorts and segmented cumsums."""
    B, N = by_rank.shape
    LV = wavelet_levels(N)
    dev = by_rank.device
    rank = torch.arange(N, device=dev).expand(B, N)
    order_all = torch.empty(B, LV + 1, N, dtype=torch.int32, device=dev)
    left = torch.empty(B, LV, N, 2, dtype=torch.int64, device=dev)
    score_sum = torch.empty(B, LV + 1, N, dtype=torch.float64, device=dev)
    hash_sum = torch.empty(B, LV + 1, N, dtype=torch.int64, device=dev)
    for level in range(LV + 1):
        node = rank >> (LV - level)
        order = (node * N + by_rank.long()).argsort(1)  # ranks in level order: by node, then ext index
        s, h, r = score.gather(1, order), hashes.gather(1, order), rank.gather(1, order)
        order_all[:, level] = by_rank.gather(1, order)
        start = (rank >> (LV - level)) << (LV - level)  # each position's node start

        def in_node(x):  # inclusive prefix sums restarting at each node
            c = x.cumsum(1)
            return c - torch.nn.functional.pad(c, (1, 0))[:, :-1].gather(1, start)

        score_sum[:, level] = in_node(s)
        hash_sum[:, level] = in_node(h)
        if level < LV:
            is_left = (r >> (LV - 1 - level)) & 1 == 0
            left[:, level, :, 0] = in_node(is_left.long())
            left[:, level, :, 1] = in_node(torch.where(is_left, s, 0.0)).view(torch.int64)
    return WaveletTree(order_all, left, score_sum, hash_sum)
