"""Triton kernels against the naive reference, on the CPU through Triton's interpreter.

Small, awkward shapes (T not a multiple of the block, k above the candidate count, w = 0, k = 0,
GQA/MQA, ragged rows, a cache prefix), forward and backward, in float32.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

triton = pytest.importorskip("triton")

from longtrain.ops.sparsek_attention import SparseKCache, sparsek_attention, sparsek_attention_chunk  # noqa: E402
from longtrain.ops.sparsek_attention import triton_core  # noqa: E402
from longtrain.ops.selection import SelectionState, lay_out_scores  # noqa: E402
from longtrain.ops.selection.naive import scan_chunk_naive  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(B, T, H, Hkv, D, slope=1e-2):
    q = torch.randn(B, T, H, D, device=DEV)
    k = torch.randn(B, T, Hkv, D, device=DEV)
    v = torch.randn(B, T, Hkv, D, device=DEV)
    u = torch.randn(B, T, device=DEV) * 0.7 + torch.arange(T, device=DEV) * slope
    return q, k, v, u


def run_chunks(backend, args, chunks, *, topk, window, variant, block, lengths=None):
    """Forward through consecutive chunks (cache carried), then backward of a random projection."""
    a = [x.clone().requires_grad_() for x in args]
    q, k, v, u = a
    B, T, Hkv, D = k.shape
    cache = SparseKCache.empty(B, topk, window, Hkv, D, dtype=torch.float32, score_dtype=torch.float32, device=DEV)
    outs, s = [], 0
    for c in chunks:
        sl = slice(s, s + c)
        o, cache, _ = sparsek_attention_chunk(
            q[:, sl], k[:, sl], v[:, sl], u[:, sl], cache, variant=variant,
            backend=backend, block=block, lengths=lengths,
        )
        outs.append(o)
        s += c
    o = torch.cat(outs, 1)
    g = torch.sin(torch.arange(o.numel(), device=DEV, dtype=torch.float32)).reshape(o.shape)
    (o * g).sum().backward()
    return [o.detach()] + [x.grad for x in a]


def assert_close(got, want, names="o dq dk dv du".split()):
    for x, y, name in zip(got, want, names):
        assert torch.isfinite(x).all(), name
        err = (x - y).abs().max().item()
        assert err <= 2e-5 * max(1.0, y.abs().max().item()), f"{name}: max error {err:.2e}"


CASES = [
    # T, topk, window, H, Hkv, D, variant, block (, slope of u)
    (37, 5, 4, 4, 2, 16, "hard_k_soft_v", 16),  # GQA, T not a multiple of the block
    (40, 8, 0, 2, 2, 16, "soft_kv", 16),  # SparseK only (w = 0)
    (35, 0, 7, 2, 1, 16, "hard_k_soft_v", 16),  # sliding window only (k = 0), MQA
    (33, 3, 9, 2, 2, 32, "straight_through", 16),
    (20, 40, 3, 2, 2, 16, "hard_k_soft_v", 16),  # k larger than any candidate set
    (50, 6, 20, 3, 1, 16, "soft_kv", 16),  # window longer than a query block
    (70, 7, 5, 2, 2, 16, "hard_k_soft_v", 32),  # several blocks, pool keys leave and enter
    # Tiles on the kernels' fast paths: band tiles inside every window, pool tiles all selected (u falls)
    (90, 16, 40, 2, 1, 16, "soft_kv", 16, -0.1),
    (90, 32, 40, 2, 2, 16, "hard_k_soft_v", 16, -0.1),
]


@pytest.fixture(params=["segments", "deterministic", "segments-tile64"])
def pool_walk(request, monkeypatch):
    """The backward's pool walk: segments of 2 (or 1) query tiles with atomic adds, or one program per slot
    tile; the kernels' query tile is the op's block, twice it, or 64 (4 blocks of 16 share one pool snapshot);
    dk/dv tiles key-major or query-major."""
    if request.param == "segments":
        monkeypatch.setattr(triton_core, "POOL_SEGMENT", 2)
        monkeypatch.setattr(triton_core, "QUERY_TILE", 16)
        for D, cfg in triton_core.LAUNCH.items():
            monkeypatch.setitem(triton_core.LAUNCH, D, dict(cfg, walk=dict(cfg["walk"], KEY_MAJOR=False),
                                                            band=dict(cfg["band"], KEY_MAJOR=False)))
    elif request.param == "deterministic":
        monkeypatch.setattr(triton_core, "DETERMINISTIC", True)
        monkeypatch.setattr(triton_core, "QUERY_TILE", 32)
    else:
        monkeypatch.setattr(triton_core, "POOL_SEGMENT", 1)
        monkeypatch.setattr(triton_core, "QUERY_TILE", 64)


@pytest.mark.parametrize("T,k,w,H,Hkv,D,variant,block,slope", [c + (1e-2,) * (len(c) == 8) for c in CASES])
def test_kernels_equal_naive(T, k, w, H, Hkv, D, variant, block, slope, pool_walk):
    args = inputs(2, T, H, Hkv, D, slope)
    kw = dict(topk=k, window=w, variant=variant, block=block)
    assert_close(run_chunks("triton", args, [T], **kw), run_chunks("naive", args, [T], **kw))


@pytest.mark.parametrize("k,w,chunks", [(6, 5, [23, 30]), (4, 0, [17, 16, 9]), (0, 6, [20, 13])])
def test_chunks_with_cache_prefix_equal_naive(k, w, chunks):
    args = inputs(2, sum(chunks), 2, 1, 16)
    kw = dict(topk=k, window=w, variant="hard_k_soft_v", block=16)
    assert_close(run_chunks("triton", args, chunks, **kw), run_chunks("naive", args, chunks, **kw))


@pytest.mark.parametrize("variant", ["hard_k_soft_v", "soft_kv"])
def test_fast_band_tiles_across_chunks(variant, monkeypatch):
    """A window of several key tiles: band tiles inside every window (no masks) and past them (the
    causal mask alone), with the window's tail from the previous chunk; then ragged rows, whose padded
    queries take the general masks."""
    monkeypatch.setattr(triton_core, "QUERY_TILE", 16)
    monkeypatch.setattr(triton_core, "POISON", True)
    args = inputs(2, 140, 2, 1, 16, -0.02)
    kw = dict(topk=8, window=48, variant=variant, block=16)
    assert_close(run_chunks("triton", args, [75, 65], **kw), run_chunks("naive", args, [75, 65], **kw))
    kw["lengths"] = torch.tensor([140, 101], device=DEV)
    assert_close(run_chunks("triton", args, [140], **kw), run_chunks("naive", args, [140], **kw))


def test_ragged_rows_and_poisoned_buffers(monkeypatch):
    monkeypatch.setattr(triton_core, "POISON", True)  # a value never written would stay NaN
    args = inputs(2, 30, 2, 2, 16)
    kw = dict(topk=4, window=3, variant="soft_kv", block=16, lengths=torch.tensor([30, 19], device=DEV))
    got = run_chunks("triton", args, [30], **kw)
    assert_close(got, run_chunks("naive", args, [30], **kw))


class PoolWalkLaunches:
    """Wraps _dkv_pool_kernel (monkeypatched into triton_core) and records each launch's ATOMIC switch."""

    def __init__(self, kernel):
        self.kernel, self.atomic = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*a, **kw):
            self.atomic.append(kw["ATOMIC"])
            return launch(*a, **kw)

        return run


@pytest.mark.parametrize("how", ["flag", "torch"])
def test_backward_is_deterministic(monkeypatch, how):
    """Under DETERMINISTIC or torch's deterministic algorithms the pool walk runs as one segment with plain stores (no
    atomic adds: the interpreter runs atomics in order, so a repeat alone would not tell), repeats bit for bit and
    gives the fast backward's gradients; with segments shorter than the walk the fast backward adds atomically."""
    monkeypatch.setattr(triton_core, "POOL_SEGMENT", 1)  # several segments in the fast mode, even at this size
    rec = PoolWalkLaunches(triton_core._dkv_pool_kernel)
    monkeypatch.setattr(triton_core, "_dkv_pool_kernel", rec)
    args = inputs(1, 45, 2, 1, 16)
    kw = dict(topk=5, window=4, variant="hard_k_soft_v", block=16)
    fast = run_chunks("triton", args, [45], **kw)
    assert rec.atomic and all(rec.atomic)
    rec.atomic.clear()
    before = torch.are_deterministic_algorithms_enabled()
    try:
        if how == "flag":
            monkeypatch.setattr(triton_core, "DETERMINISTIC", True)
        else:
            torch.use_deterministic_algorithms(True)
        a, b = run_chunks("triton", args, [45], **kw), run_chunks("triton", args, [45], **kw)
    finally:
        torch.use_deterministic_algorithms(before)
    assert rec.atomic and not any(rec.atomic)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert_close(a, fast)


def test_public_op_default_block():
    args = [x.requires_grad_() for x in inputs(1, 70, 2, 2, 16)]
    o = sparsek_attention(*args, topk=9, window=8, backend="triton")
    ref = sparsek_attention(*[x.detach() for x in args], topk=9, window=8, backend="naive")
    assert (o - ref).abs().max() < 1e-5


@pytest.mark.parametrize("G", [16, 64])
def test_cut_counts_a_prefix_of_each_tile(G):
    """_cut_kernel: per query tile and pool slot, the queries selecting the key are the tile's first cut;
    it also hands the kernels the snapshot's indices and scores compacted."""
    B, T, K, w = 2, 300, 12, 5
    u = (torch.randn(B, T) + torch.arange(T) * 3e-3).double()  # float32 values, as the op's scores
    u[:, 100:110] = u[:, 90:100]  # ties in u: the position breaks them
    n0 = K + w - 1  # empty cache prefix
    lengths = torch.tensor([T, 170])
    state = SelectionState.empty(B, K, w, score_dtype=torch.float64)
    keys = lay_out_scores(state, u, lengths)
    u_ext, pos_ext, q_pos = keys.u, keys.pos, keys.q_pos
    scan = scan_chunk_naive(keys, state, window=w, block=16)
    bp = scan.block_pool[:, :: G // 16].contiguous()
    nt = bp.shape[1]
    args = [x.to(DEV) for x in (bp, u_ext.float(), pos_ext, q_pos, scan.theta_u, scan.theta_pos)]
    bw = 4  # the pool walk's slot groups (K = 12: three)
    out = triton_core._cut(*args, T, G, K, bw, w - 1, w)
    cut, pi, pu, flush, reach = (x.cpu() for x in out)  # [B, nt, K] each; flush [B, nt, 3]; reach [B, nt, G]
    cut = cut.long()
    # A group's flag: one of its slots holds a key after tile t that is not there after t + 1.
    nxt = torch.cat([bp[:, 1:], torch.full_like(bp[:, :1], -1)], 1)
    leave = ((bp >= 0) & (nxt != bp)).view(B, nt, K // bw, bw).any(-1)
    assert torch.equal(flush, leave.int())
    assert leave[:, :-1].any() and not leave[:, :-1].all()  # both kinds of steps occur
    # The compacted snapshot: int32 ext indices, float32 scores (+inf on empty slots).
    assert pi.dtype == torch.int32 and torch.equal(pi.long(), bp)
    assert torch.equal(pu, torch.where(bp >= 0, u_ext.float().gather(1, bp.clamp(min=0).flatten(1)).view_as(pu),
                                       float("inf")))
    # Reference selection [B, nt, G, K], as naive.py tests it, for the tile's queries.
    qi = torch.arange(nt * G).clamp(max=T - 1).reshape(nt, G)
    ok = (torch.arange(nt * G) < T).reshape(nt, G)
    rows = torch.arange(B)[:, None, None, None]
    idx = bp.clamp(min=0)[:, :, None, :]
    uu, kp = u_ext[rows, idx], pos_ext[rows, idx]
    tu, tp = scan.theta_u[:, qi][..., None], scan.theta_pos[:, qi][..., None]
    sel = (bp[:, :, None, :] >= 0) & (q_pos[:, qi][..., None] >= 0) & ok[None, :, :, None]
    sel &= (uu > tu) | ((uu == tu) & (kp >= tp))
    assert torch.equal(cut, sel.sum(2))
    assert torch.equal(sel, torch.arange(G)[None, None, :, None] < cut[:, :, None, :])  # a prefix
    assert (cut > 0).any() and ((cut > 0) & (cut < G)).any()  # keys leave mid-tile: the prefix is exercised
    # The tile's band keys j < G (ext rows K + t G + j here): queries r < max(j + 1, count) attend them.
    e = (K + torch.arange(nt * G)).clamp(max=n0 + T - 1).reshape(nt, G)
    ek = (K + torch.arange(nt * G) < n0 + T).reshape(nt, G)
    ue, pe = u_ext[:, e][:, :, None, :], pos_ext[:, e][:, :, None, :]  # [B, nt, 1, G]: keys
    above = (ue > tu) | ((ue == tu) & (pe >= tp))
    above &= ek[None, :, None, :] & (pe >= 0) & (q_pos[:, qi][..., None] >= 0) & ok[None, :, :, None]
    count = above.sum(2)  # [B, nt, G]
    assert torch.equal(above, torch.arange(G)[None, None, :, None] < count[:, :, None, :])  # a prefix
    j = torch.arange(G)
    assert torch.equal(reach.long(), torch.maximum(count, j + 1))
    assert (count > j + 1).any()  # candidates selected past the window: reach beyond it


@pytest.mark.parametrize("K", [1, 12, 64])
def test_the_position_order_kernel_equals_the_stable_argsort(K):
    """_by_position_triton (one sort per query tile) against _by_position (torch's stable argsort and gathers) on
    pools with empty slots, a slot count that is not a power of two and positions far apart."""
    B, nt, N = 3, 5, 400
    gen = torch.Generator().manual_seed(K)
    pos = torch.randperm(N * 1000, generator=gen)[:N].sort().values.repeat(B, 1) + 10**9  # [B, N] ascending, unique
    pos[1, :7] = -1  # empty ext rows: a cache with room in its pool
    pi = torch.stack([torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(nt)]) for _ in range(B)])
    pi = torch.where(torch.rand(B, nt, K, generator=gen) < 0.3, -1, pi).int()  # [B, nt, K] ext rows, -1 empty
    cut = torch.randint(0, 64, (B, nt, K), generator=gen, dtype=torch.int32)
    pu = torch.randn(B, nt, K, generator=gen)
    args = [x.to(DEV).contiguous() for x in (cut, pi, pu, pos)]
    fast = triton_core._by_position_triton(*args)
    ref = triton_core._by_position(*args)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    assert (ref[1] < 0).any() and (K == 1 or not torch.equal(ref[1].cpu(), pi))  # empties occur; the order moved slots


def test_unsupported_head_dim_falls_back_to_naive():
    args = inputs(1, 20, 2, 1, 8)  # D = 8: no kernel
    with pytest.warns(UserWarning, match="naive core"):
        o = sparsek_attention(*args, topk=3, window=2, backend="triton")
    assert torch.equal(o, sparsek_attention(*args, topk=3, window=2, backend="naive"))
