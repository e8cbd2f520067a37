"""The device (wavelet) selection scan against the CPU heap scan: exact selection, tau to rounding.

Runs on the CPU here (its Triton kernel under TRITON_INTERPRET=1) and on CUDA where present.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from longtrain.ops.selection import SelectionState, lay_out_scores, next_state
from longtrain.ops.selection import device as scan_device
from longtrain.ops.selection import device_kernels as kern
from longtrain.ops.selection.device import scan_chunk_device, sort_keys
from longtrain.ops.selection.host import scan_chunk_host
from longtrain.ops.selection.naive import position_hash
from longtrain.ops.selection.wavelet import build_wavelet_tree, tree_count_below, tree_quantile
from longtrain.ops.sparsek_attention import SparseKCache, sparsek_attention_chunk
from tests.ops.selection_reference import breakpoints_reference, build_wavelet_tree_reference, sort_keys_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def scores(rng, B, L, ties):
    u = torch.from_numpy(rng.normal(size=(B, L))).float() * float(rng.choice([0.3, 1.0, 3.0]))
    if ties:
        u = (u * 2).round() / 2  # many exact ties: (u, position) order and p = 0 at tau
    return u


@pytest.mark.parametrize("B,L,k,w,block,chunks,ties,cap", [
    (2, 37, 5, 3, 8, 4, False, None),  # L not a multiple of the block, chunks continue the state
    (1, 50, 8, 0, 16, 3, False, None),  # w = 0: a query sees itself as a candidate
    (3, 20, 30, 4, 4, 3, False, None),  # k larger than the candidates for a while
    (2, 33, 0, 5, 8, 2, False, None),  # k = 0: sliding window only
    (2, 64, 7, 1, 16, 4, False, None),
    (2, 40, 6, 3, 8, 4, True, None),
    (1, 300, 40, 17, 64, 2, True, None),
    (2, 150, 6, 2, 4, 3, True, None),  # 38 blocks: chains of slots longer than one jump launch
])
def test_device_scan_equals_heap_scan(B, L, k, w, block, chunks, ties, cap):
    check_device_scan(B, L, k, w, block, chunks, ties, cap)


def both_scans(state, u, lengths, w, block):
    """One chunk through the compiled CPU heap scan (the reference) and the device scan, from `state`."""
    keys = lay_out_scores(state, u, lengths)
    ref = scan_chunk_host(keys, state, window=w, block=block)
    got = scan_chunk_device(lay_out_scores(state.to(DEV), u.to(DEV), lengths.to(DEV)), state.to(DEV), window=w,
                            block=block)
    return keys, ref, got.to("cpu")


def check_device_scan(B, L, k, w, block, chunks, ties, cap):
    rng = np.random.default_rng(B * 1000 + L * 10 + k)
    state = SelectionState.empty(B, k, w, cap=cap)
    for ci in range(chunks):
        u = scores(rng, B, L, ties)
        lengths = torch.from_numpy(rng.integers(0, L + 1, size=B)) if ci % 2 else torch.full((B,), L)  # ragged, even empty rows
        keys, ref, got = both_scans(state, u, lengths, w, block)
        # Selection is exact.
        assert torch.equal(got.theta_u, ref.theta_u)
        assert torch.equal(got.theta_pos, ref.theta_pos)
        assert torch.equal(got.fingerprint, ref.fingerprint)
        assert torch.equal(got.block_pool.sort(-1).values, ref.block_pool.sort(-1).values)
        for b in range(B):  # stable slots: a key keeps one slot while it is pooled
            bp = got.block_pool[b]
            for key in bp[bp >= 0].unique().tolist():
                assert len(set((bp == key).nonzero()[:, 1].tolist())) == 1
        assert torch.equal(got.final_pool, ref.final_pool)
        # tau to rounding; |A| exactly.
        fin = torch.isfinite(ref.tau)
        assert torch.equal(torch.isfinite(got.tau), fin)
        assert torch.equal(got.tau[~fin], ref.tau[~fin])
        assert torch.allclose(got.tau[fin], ref.tau[fin], rtol=0, atol=1e-10)
        assert torch.equal(got.n_active, ref.n_active)
        # The carried state: the same scores above tau (k = 0 carries none on the device).
        want, thr = ref.threshold, got.threshold
        if k > 0:
            assert torch.equal(thr.thr_count, want.thr_count)
            assert torch.equal(thr.overflow, want.overflow)
            assert torch.equal(thr.thr_saturated.sum(1), want.thr_saturated.sum(1))
            torch.testing.assert_close(thr.tau, want.tau, rtol=0, atol=1e-10)
            torch.testing.assert_close(thr.thr_sum, want.thr_sum, rtol=0, atol=1e-9)
            for b in range(B):
                n = int(want.thr_count[b])
                assert torch.equal(thr.thr_u[b, :n].sort().values, want.thr_u[b, :n].sort().values)
        # Continue from the reference's state, so every chunk is checked from the same start.
        state = next_state(state, keys, ref)


def test_device_scan_keeps_the_carried_tau_where_it_is_not_unique():
    """k tied saturated scores carried, then only low candidates: sum clamp(u - t, 0, 1) = k on a whole
    interval of t. The CPU scan keeps the carried tau there (tau never decreases); so must the device."""
    B, L, k, w, block = 1, 8, 2, 1, 4
    state = SelectionState.empty(B, k, w)
    for u in (torch.tensor([[10.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]),  # tau = 0: two saturated, none fractional
              torch.tensor([[-5.0, -6.0, -5.5, -7.0, -5.0, -6.5, -8.0, -5.2]])):  # all below the carried tau
        keys, ref, got = both_scans(state, u, torch.full((B,), L), w, block)
        assert torch.equal(got.tau, ref.tau)
        assert torch.equal(got.n_active, ref.n_active)
        assert torch.equal(got.threshold.tau, ref.threshold.tau)
        state = next_state(state, keys, ref)
    assert float(state.tau[0]) == 0.0  # the second chunk kept the carried tau


def test_device_scan_reports_overflow_at_the_cap():
    B, L, k, w = 1, 200, 4, 2
    state = SelectionState.empty(B, k, w, cap=6, device=DEV)
    u = torch.linspace(0, 0.5, L, device=DEV)[None]  # all within one unit: every score stays fractional
    got = scan_chunk_device(lay_out_scores(state, u), state, window=w, block=16)
    assert int(got.threshold.overflow[0]) > 0 and int(got.threshold.thr_count[0]) == 6


@triton.jit
def _position_hash_probe_kernel(POS, OUT, BLK: tl.constexpr):
    i = tl.arange(0, BLK)
    tl.store(OUT + i, kern._position_hash(tl.load(POS + i)))


def test_position_hashes_match_the_reference():
    """The device kernels' and the compiled scan's splitmix64 against naive.position_hash."""
    from longtrain.ops.selection.host import _hash

    pos = torch.tensor([0, 1, 2, 511, 2**31 - 1, 123456789, 2**40 + 3, 7], dtype=torch.int64)
    out = torch.empty_like(pos, device=DEV)
    _position_hash_probe_kernel[(1,)](pos.to(DEV), out, BLK=pos.numel())
    want = [position_hash(p) for p in pos.tolist()]
    assert out.tolist() == want
    assert [int(_hash(p)) for p in pos.tolist()] == want


@pytest.mark.parametrize("w,k", [(4, 6), (0, 5), (6, 0)])
def test_op_device_scan_equals_host_scan(w, k):
    """The whole chunked op, forward and gradients, is the same with either scan."""
    torch.manual_seed(0)
    B, T, H, D = 2, 45, 2, 8
    q, kk, v = (torch.randn(B, T, H, D, device=DEV, requires_grad=True) for _ in range(3))
    u = torch.randn(B, T, device=DEV, requires_grad=True)
    outs = {}
    # "mixed" alternates the two scans chunk by chunk: each continues from the other's carried state.
    for scan in ("host", "device", "mixed"):
        cache = SparseKCache.empty(B, k, w, H, D, device=DEV)
        os, sels = [], []
        for i, s in enumerate(range(0, T, 16)):
            sl = slice(s, s + 16)
            use = scan if scan != "mixed" else ("device", "host")[i % 2]
            o, cache, sel = sparsek_attention_chunk(q[:, sl], kk[:, sl], v[:, sl], u[:, sl], cache, backend="naive", scan=use, block=8)
            os.append(o)
            sels.append(sel)
        o = torch.cat(os, 1)
        grads = torch.autograd.grad(o.square().sum(), (q, kk, v, u))
        outs[scan] = (o, grads, torch.cat([s.fingerprint for s in sels], 1), cache)
    o1, g1, f1, c1 = outs["host"]
    for other in ("device", "mixed"):
        o2, g2, f2, c2 = outs[other]
        assert torch.equal(f1, f2)
        torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6)
        for a, b in zip(g2, g1):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert torch.equal(c1.pool_pos, c2.pool_pos) and torch.equal(c1.thr_count, c2.thr_count)


def test_device_scan_refuses_float64_scores():
    q = torch.randn(1, 8, 1, 4, dtype=torch.float64)
    cache = SparseKCache.empty(1, 2, 2, 1, 4, dtype=torch.float64, score_dtype=torch.float64)
    with pytest.raises(ValueError, match="scan='host'"):
        sparsek_attention_chunk(q, q, q, torch.randn(1, 8, dtype=torch.float64), cache, scan="device")


@pytest.mark.parametrize("B,N", [(1, 1), (2, 7), (3, 64), (2, 301), (1, 2500)])
def test_wavelet_tree_merges_equal_level_by_level_sorts(B, N):
    """The merge build (Triton) against sorts per level; 2500 ranks take the one-launch-per-level path too."""
    by_rank = torch.stack([torch.randperm(N) for _ in range(B)]).int().to(DEV)
    score = torch.randn(B, N, dtype=torch.float64, device=DEV)
    hashes = torch.randint(0, 2**62, (B, N), device=DEV)
    a, b = build_wavelet_tree(by_rank, score, hashes), build_wavelet_tree_reference(by_rank, score, hashes)
    assert torch.equal(a.order, b.order) and torch.equal(a.hash_sum, b.hash_sum)
    torch.testing.assert_close(a.score_sum, b.score_sum, rtol=0, atol=1e-12)  # summation orders differ
    assert torch.equal(a.left[..., 0], b.left[..., 0])
    torch.testing.assert_close(a.left[..., 1].view(torch.float64), b.left[..., 1].view(torch.float64), rtol=0, atol=1e-12)


@triton.jit
def _tree_probe_kernel(LEFT, HS, P, RHO, R, CNT, SUM, RANK, HSUM, N, LV, BLK: tl.constexpr):
    i = tl.arange(0, BLK)
    p, rho, r = tl.load(P + i), tl.load(RHO + i), tl.load(R + i)
    cnt, s = tree_count_below(LEFT, 0, p, rho, LV, N)
    rank, h = tree_quantile(LEFT, HS, 0, 0, p, r, LV, N)
    tl.store(CNT + i, cnt)
    tl.store(SUM + i, s)
    tl.store(RANK + i, rank)
    tl.store(HSUM + i, h)


@pytest.mark.parametrize("N", [1, 5, 64, 77])
def test_tree_descents_count_and_select_in_prefixes(N):
    """tree_count_below / tree_quantile against brute force over every prefix P and threshold."""
    g = torch.Generator().manual_seed(N)
    by_rank = torch.randperm(N, generator=g).int()[None]
    score = torch.randn(1, N, dtype=torch.float64, generator=g)
    hashes = torch.randint(0, 2**62, (1, N), generator=g)
    tree = build_wavelet_tree(by_rank.to(DEV), score.to(DEV), hashes.to(DEV))
    rank_of = torch.empty(N, dtype=torch.int64).scatter_(0, by_rank[0].long(), torch.arange(N))
    BLK = 128
    P = torch.randint(0, N + 1, (BLK,), generator=g, dtype=torch.int32)
    rho = torch.randint(0, N + 1, (BLK,), generator=g, dtype=torch.int32)
    r = (torch.rand(BLK, generator=g) * P).int()  # r < P where P > 0
    outs = [torch.empty(BLK, dtype=d, device=DEV) for d in (torch.int32, torch.float64, torch.int32, torch.int64)]
    _tree_probe_kernel[(1,)](tree.left, tree.hash_sum, P.to(DEV), rho.to(DEV), r.to(DEV), *outs, N,
                             tree.levels, BLK=BLK)
    cnt, ssum, rank, hsum = (o.cpu() for o in outs)
    for q in range(BLK):
        ranks = rank_of[: P[q]]  # the ranks of the first P items (ext order)
        below = ranks < rho[q]
        assert cnt[q] == below.sum()
        torch.testing.assert_close(ssum[q], score[0][ranks[below]].sum(), rtol=0, atol=1e-12)
        if P[q] > 0:
            want = ranks.sort().values[r[q]]
            assert rank[q] == want
            assert hsum[q] == hashes[0][ranks[ranks < want]].sum()


@pytest.mark.parametrize("B,N,cap", [(1, 5, 3), (3, 37, 20), (2, 300, 64)])
def test_sort_keys_rank_by_value_then_position(B, N, cap):
    """The key kernel against torch, and the order it gives: (u, position) descending, invalid last."""
    g = torch.Generator().manual_seed(N)
    u = (torch.randn(B, N, generator=g) * 2).round() / 2  # ties
    u[:, ::7] = -0.0
    pos = torch.arange(N).expand(B, N).clone()  # ascending with the ext index, as the op lays them out
    pos[torch.rand(B, N, generator=g) < 0.2] = -1
    thr = ((torch.randn(B, cap, generator=g) * 2).round() / 2).double()
    thr_count = torch.randint(0, cap + 1, (B,), generator=g)
    args = (u.to(DEV), pos.to(DEV), thr.to(DEV), thr_count.to(DEV))
    got, got_i = sort_keys(*args)
    want, want_i = sort_keys_reference(*args)
    assert torch.equal(got, want) and torch.equal(got_i, want_i)
    m = (N + cap - 1 - got_i).cpu()
    for b in range(B):
        entries = [(float(u[b, i]), i) for i in range(N) if pos[b, i] >= 0]
        entries += [(float(thr[b, c]), N + c) for c in range(int(thr_count[b]))]
        best_first = [i for _, i in sorted(entries, key=lambda e: (e[0], e[1]), reverse=True)]
        assert m[b, : len(best_first)].tolist() == best_first


@pytest.mark.parametrize("B,NM,N,K", [(1, 3, 2, 1), (2, 50, 30, 4), (2, 1500, 1200, 40)])
def test_breakpoints_kernel_equals_sort_and_search(B, NM, N, K):
    """The merged breakpoints (and f's offsets) against a float64 sort and searchsorted."""
    g = torch.Generator().manual_seed(NM)
    nvalid = torch.randint(0, NM + 1, (B,), generator=g, dtype=torch.int32)
    score = ((torch.randn(B, NM, generator=g) * 2).round() / 4).double().sort(1, descending=True).values
    score = torch.where(torch.arange(NM)[None] < nvalid[:, None].long(), score, -float("inf"))
    by_rank = torch.stack([torch.randperm(NM, generator=g) for _ in range(B)]).int()
    valid = torch.arange(NM)[None] < nvalid[:, None].long()
    w = (valid & (by_rank >= N)).int() - (valid & (by_rank < K)).int()
    wu = w.double() * torch.where(valid, score, 0.0)
    NT = triton.cdiv(NM, scan_device.TILE)
    pad = NT * scan_device.TILE - NM
    tot = torch.zeros(B, kern.N_TOT.value, NT, dtype=torch.int32)
    tot[:, kern.T_OFFSET.value] = torch.nn.functional.pad(w, (0, pad)).view(B, NT, -1).sum(2)
    tots = torch.nn.functional.pad(wu, (0, pad)).view(B, NT, -1).sum(2)
    outs = [torch.empty(B, NM + 1, dtype=torch.int32), torch.empty(B, NM + 1, dtype=torch.float64),
            torch.empty(B, 2 * NM, dtype=torch.float64), torch.empty(B, 2 * NM, dtype=torch.int32),
            torch.empty(B, 2 * NM, dtype=torch.int32)]
    outs = [o.to(DEV) for o in outs]
    cc, cs, bpt, rv, rw = outs
    kern.breakpoints_kernel[(NT, B)](SCORE=score.to(DEV), BY_RANK=by_rank.to(DEV), NVALID=nvalid.to(DEV), TOT=tot.to(DEV),
                                     TOTS=tots.to(DEV), CC=cc, CS=cs, BPT=bpt, BPRV=rv, BPRW=rw, N=N, NM=NM, K=K, NT=NT,
                                     ITERS=NM.bit_length(), NTP=triton.next_power_of_2(NT), BLK=scan_device.TILE)
    cc, cs, bpt, rv, rw = (o.cpu() for o in outs)
    want_t, want_rv, want_rw = breakpoints_reference(score, nvalid)
    assert torch.equal(bpt, want_t) and torch.equal(rv, want_rv) and torch.equal(rw, want_rw)
    assert torch.equal(cc, torch.nn.functional.pad(w.cumsum(1), (1, 0)).int())
    torch.testing.assert_close(cs, torch.nn.functional.pad(wu.cumsum(1), (1, 0)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("w,k,L,block", [(5, 6, 37, 16), (0, 4, 30, 16), (3, 20, 45, 16)])
def test_kernels_on_the_device_scans_stable_pools(w, k, L, block):
    """The Triton core trusts the device scan's stable slots (no relabelling): same o and gradients."""
    from longtrain.ops.sparsek_attention import triton_core  # noqa: F401  (the kernels exist: interpreter or CUDA)

    torch.manual_seed(1)
    B, H, D = 2, 2, 16
    q, kk, v = (torch.randn(B, 2 * L, H, D, device=DEV, requires_grad=True) for _ in range(3))
    u = torch.randn(B, 2 * L, device=DEV, requires_grad=True)
    outs = {}
    for backend, scan in (("naive", "host"), ("triton", "device")):
        cache = SparseKCache.empty(B, k, w, H, D, device=DEV)
        os = []
        for s in (slice(0, L), slice(L, 2 * L)):  # the second chunk starts from a full cache
            o, cache, _ = sparsek_attention_chunk(q[:, s], kk[:, s], v[:, s], u[:, s], cache, backend=backend, scan=scan, block=block)
            os.append(o)
        o = torch.cat(os, 1)
        outs[backend] = (o, torch.autograd.grad((o * torch.linspace(-1, 1, D, device=DEV)).sum(), (q, kk, v, u)))
    (o1, g1), (o2, g2) = outs["naive"], outs["triton"]
    torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
