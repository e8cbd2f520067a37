"""SparseK+Linear+SW (and Linear+SW, topk = 0): SparseK attention plus linear attention over every key a
query does not fully attend to (paper Appendix B.1; the formula is in naive.py), chunk by chunk.

The linear part of query i is phi(q_i) . sum_j (1 - g_ij) phi(k_j) v_j^T. Split the causal keys:
  - keys that can no longer be selected: they left the window and are not in the pool, so by
    irreversibility (DESIGN.md section 2, fact 1) no later query selects them: g = 0 for every later
    query. Their sums (sum phi(k) v^T, sum phi(k)) are the carried state, of fixed size;
  - the pool, the tail and the chunk (the extended keys): query i's linear sums over those outside
    its window are a causal linear attention (ops/linear_attention) started from state + pool over the
    tail and chunk keys lagged by the window (_phi_and_beyond_window_sums), and the core takes the g-weighted
    part of the selected keys back out, where g depends on the query (tau_i), so a pooled key cannot
    join the state before it is evicted. The window's keys (g = 1) never enter the linear sums.
After the chunk, the extended keys in neither the new pool nor the new tail join the state.
phi(x) = elu(head-wise linear(x)) + 1 reads the keys as the cache holds them (after RoPE), or, given RoPE's
inverse frequencies (attention.linear_rope unrotated), those keys and the queries rotated back to position 0
(rotated_back): either way the cache needs no second copy of the pool's and tail's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from longtrain.ops.linear_attention import causal_linear_attention, feature_map
from longtrain.ops.rope import apply_rope
from longtrain.ops.selection import ThresholdFn, select
from longtrain.ops.selection.chunk import carried
from longtrain.ops.sparsek_attention.cache import SparseKCache
from longtrain.ops.sparsek_attention.decode import sparsek_attention_decode
from longtrain.ops.sparsek_attention.naive import LinearTerms, sparsek_attention_core_naive
from longtrain.ops.sparsek_attention.aligned import aligned_inputs
from longtrain.ops.sparsek_attention.op import ChunkSelection, _check, _differentiable, lay_out_keys, next_cache


@dataclass
class SparseKLinearCache(SparseKCache):
    """A SparseKCache plus the linear state of the keys no query can select any more (module doc)."""

    lin_kv: torch.Tensor | None = None  # [B, Hkv, F, D] sum of phi(k) v^T (STATE_DTYPE)
    lin_k: torch.Tensor | None = None  # [B, Hkv, F] sum of phi(k)

    def __post_init__(self):
        super().__post_init__()
        if self.lin_kv is None or self.lin_k is None:
            raise ValueError("SparseKLinearCache needs lin_kv and lin_k (SparseKLinearCache.empty makes them)")

    @classmethod
    def empty(cls, batch: int, topk: int, window: int, kv_heads: int, head_dim: int, *,
              dtype: torch.dtype = torch.float32, score_dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", cap: int | None = None, features: int | None = None
              ) -> SparseKLinearCache:
        base = SparseKCache.empty(batch, topk, window, kv_heads, head_dim, dtype=dtype, score_dtype=score_dtype,
                                  device=device, cap=cap)
        F = features or head_dim
        return cls(**base.tensors(), window=window,
                   lin_kv=torch.zeros(batch, kv_heads, F, head_dim, dtype=STATE_DTYPE, device=device),
                   lin_k=torch.zeros(batch, kv_heads, F, dtype=STATE_DTYPE, device=device))

    def reset_rows(self, mask: torch.Tensor) -> SparseKLinearCache:
        base = SparseKCache(**{f.name: getattr(self, f.name) for f in fields(SparseKCache)}).reset_rows(mask)
        m = mask.to(self.lin_kv.device)
        return SparseKLinearCache(**base.tensors(), window=self.window, lin_kv=torch.where(m[:, None, None, None], 0, self.lin_kv),
                                  lin_k=torch.where(m[:, None, None], 0, self.lin_k))


# The linear state's dtype, whatever the keys': it sums the keys that left the pool chunk by chunk, where one pass sums
# them as one prefix; float64 sums (of products exact there for half-precision keys) agree to ~1e-16, far below
# float32's and bf16's rounding, so a document read in chunks gets the one pass's bits (causal_linear_attention_naive's
# `wide`). [B, Hkv, F, D] per layer and row: 32 KiB at F = D = 64.
STATE_DTYPE = torch.float64


def _linear_window(cache: SparseKLinearCache) -> int:
    """The cache's window, which the linear types need (w >= 1): the window is what g = 1 keeps exact."""
    if not isinstance(cache, SparseKLinearCache):
        raise TypeError("the linear attention types need a SparseKLinearCache")
    if cache.window < 1:
        raise ValueError("linear attention types need a window (w >= 1): the window is what g = 1 keeps exact")
    return cache.window


def _phi_keys(k: torch.Tensor, pos: torch.Tensor, phi_weight: torch.Tensor) -> torch.Tensor:
    """phi of keys k [B, N, Hkv, D] at positions pos [B, N] (-1: none): [B, N, Hkv, F], 0 where there is no key."""
    return torch.where((pos >= 0)[:, :, None, None], feature_map(k, phi_weight), 0)


def rotated_back(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """x [B, N, h, D] (queries or keys after RoPE) rotated back by RoPE's angles at positions pos [B, N] (-1: none,
    whose rows are masked or padding), with inv_freq [R/2] float64 the model's inverse frequencies (rotate-half
    layout on the first R dims, as model/rope.py's apply_rope): what phi reads under attention.linear_rope
    unrotated, the projection's content without its position. After RoPE the features phi(q_i).phi(k_j) would
    depend on i and j themselves (elu does not commute with a rotation), so a sum over thousands of keys mixed
    their content at every angle. Angles in float64 from the position alone: a token gets the same bits in any
    chunking and in decoding. A yarn scaling's attention factor a stays in (a x): phi's map takes the constant.
    inv_freq None: x as it is."""
    if inv_freq is None:
        return x
    ang = pos.to(torch.float64)[..., None] * inv_freq.to(device=pos.device, dtype=torch.float64)  # [B, N, R/2]
    return apply_rope(x, ang.cos(), -ang.sin())  # the rotation by -angle: its transpose


def _add_state(state_kv, state_k, phk, v, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """The state plus the keys where keep [B, N] (phk [B, N, Hkv, F], v [B, N, Hkv, D]).

    phi(k) and v are copied once each, into the state's dtype and the layout of a batched product over (row,
    KV head); the mask goes into v's copy as it is cast (one write, out=) and into sum phi(k) as a product with
    the mask's column (an einsum of the cast, masked inputs wrote them three times, a separate in-place mask once
    more: benchmarks/op_traffic.py)."""
    B, N, Hkv, D = v.shape
    sdt = state_kv.dtype
    keep_col = keep.to(sdt)[:, None, :, None]  # [B, 1, N, 1]
    phk_t = phk.permute(0, 2, 3, 1).to(dtype=sdt, memory_format=torch.contiguous_format, copy=True)  # [B, Hkv, F, N]
    v_t = torch.mul(v.permute(0, 2, 1, 3), keep_col, out=v.new_empty(B, Hkv, N, D, dtype=sdt))  # [B, Hkv, N, D] masked
    return state_kv + phk_t @ v_t, state_k + (phk_t @ keep_col)[..., 0]


class _QueryFeatures(torch.autograd.Function):
    """feature_map(q, weight) [B, L, H, F] (bitwise), its + 1 written straight into a contiguous tensor (the core
    reads phi(q) contiguous: as torch ops its layout was the einsum's and the core copied it)."""

    @staticmethod
    def forward(ctx, q, weight):  # q [B, L, H, D], weight [Hkv, D, F]
        B, L, H, D = q.shape
        Hkv, Fd = weight.shape[0], weight.shape[-1]
        w = weight.to(q.dtype)
        y = torch.einsum("btgrd,gdf->btgrf", q.view(B, L, Hkv, H // Hkv, D), w)  # [B, L, Hkv, R, F]
        phq = torch.add(torch.nn.functional.elu(y), 1, out=q.new_empty(B, L, Hkv, H // Hkv, Fd))
        ctx.save_for_backward(q, w, y)
        ctx.weight_dtype = weight.dtype
        return phq.view(B, L, H, Fd)

    @staticmethod
    def backward(ctx, g):  # g [B, L, H, F]
        q, w, y = ctx.saved_tensors
        B, L, H, D = q.shape
        dy = torch.ops.aten.elu_backward(g.view(y.shape), 1.0, 1, 1, False, y)  # [B, L, Hkv, R, F]
        dq = dw = None
        if ctx.needs_input_grad[0]:
            dq = torch.einsum("btgrf,gdf->btgrd", dy, w).reshape(B, L, H, D)
        if ctx.needs_input_grad[1]:
            dw = torch.einsum("btgrd,btgrf->gdf", q.view(*y.shape[:-1], D), dy).to(ctx.weight_dtype)
        return dq, dw


def _lagged_rows(x: torch.Tensor, K: int, lag: int, L: int) -> torch.Tensor:
    """[B, L, ...]: row i holds x's ext row K + i - lag (tail ++ chunk index i - lag), 0 for i < lag: one write."""
    rows = max(L - lag, 0)
    return torch.nn.functional.pad(x[:, K:K + rows], (0, 0, 0, 0, L - rows, 0))


class _KeyFeatures(torch.autograd.Function):
    """phi of the extended keys and what the linear sums read of it, with one backward for all of them: phk
    [B, N, Hkv, F] (0 where there is no key), its rows lagged for the causal sums (_phi_and_beyond_window_sums) and the
    start state (state + the pool). As separate torch ops each reader's gradient was a full-size slice backward
    and the readers' sum a full-size add (benchmarks/op_traffic.py); here they add into one buffer."""

    @staticmethod
    def forward(ctx, k, weight, k_ext, has_key, v_pool, state_kv, state_k, lag):
        # k [B, L, Hkv, D] the chunk's keys (k_ext's last L rows, the ones with a gradient); k_ext [B, N, Hkv, D]
        # detached; weight [Hkv, D, F]; has_key [B, N]; v_pool [B, K, Hkv, D] the cache's (no gradient)
        B, N, Hkv, D = k_ext.shape
        L, K, Fd = k.shape[1], v_pool.shape[1], weight.shape[-1]
        w = weight.to(k_ext.dtype)
        y = torch.bmm(k_ext.permute(2, 0, 1, 3).reshape(Hkv, B * N, D), w)  # [Hkv, B N, F]
        m = has_key.to(y.dtype)[:, :, None, None]  # [B, N, 1, 1]
        # phi = m (1 + elu(y)): the + 1 and the mask in one pass, written in the layout the core reads
        phk = torch.addcmul(m, m, torch.nn.functional.elu(y).view(Hkv, B, N, Fd).permute(1, 2, 0, 3),
                            out=y.new_empty(B, N, Hkv, Fd))  # [B, N, Hkv, F]
        start_kv, start_k = _add_state(state_kv, state_k, phk[:, :K], v_pool, has_key[:, :K])
        ctx.save_for_backward(k_ext, w, y, has_key, v_pool)
        ctx.lag, ctx.L, ctx.weight_dtype = lag, L, weight.dtype
        ctx.set_materialize_grads(False)
        return phk, _lagged_rows(phk, K, lag, L), start_kv, start_k

    @staticmethod
    def backward(ctx, g_phk, g_lag, g_skv, g_sk):
        k_ext, w, y, has_key, v_pool = ctx.saved_tensors
        B, N, Hkv, D = k_ext.shape
        L, K, lag, Fd = ctx.L, v_pool.shape[1], ctx.lag, w.shape[-1]
        m = has_key.to(y.dtype)[:, :, None, None]  # [B, N, 1, 1]
        # d phi summed over the readers, masked (phi's mask): the core's, then the lagged rows' and the pool's added
        tot = g_phk * m if g_phk is not None else y.new_zeros(B, N, Hkv, Fd)  # [B, N, Hkv, F]
        rows = max(L - lag, 0)
        if g_lag is not None and rows:
            tot[:, K:K + rows].addcmul_(g_lag[:, L - rows:], m[:, K:K + rows])
        if K and (g_skv is not None or g_sk is not None):
            # start_kv = state_kv + sum_j keep_j phk_j v_j^T, start_k = state_k + sum_j keep_j phk_j (j in the pool)
            if g_skv is not None:
                dpool = g_skv @ v_pool.permute(0, 2, 3, 1).to(g_skv.dtype)  # [B, Hkv, F, K]
                dpool = dpool + g_sk[..., None] if g_sk is not None else dpool
            else:
                dpool = g_sk[..., None].expand(B, Hkv, Fd, K)
            # added in place in dpool's dtype, rounded once into tot's
            tot[:, :K].addcmul_(dpool.permute(0, 3, 1, 2), has_key[:, :K, None, None].to(dpool.dtype))
        # through elu (its derivative from y, as torch's elu takes it) into the head-wise map's input
        dy = torch.ops.aten.elu_backward(tot.permute(2, 0, 1, 3), 1.0, 1, 1, False, y.view(Hkv, B, N, Fd))
        dy = dy.reshape(Hkv, B * N, Fd)  # [Hkv, B N, F]
        dk = dw = None
        if ctx.needs_input_grad[0]:  # only the chunk's rows: the cache's keys carry no gradient
            dk = torch.bmm(dy, w.transpose(1, 2)).view(Hkv, B, N, D).permute(1, 2, 0, 3)[:, N - L:]  # [B, L, Hkv, D]
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(k_ext.permute(2, 0, 1, 3).reshape(Hkv, B * N, D).transpose(1, 2), dy).to(ctx.weight_dtype)
        return dk, dw, None, None, None, None, None, None


class _LaggedValues(torch.autograd.Function):
    """The values' rows lagged for the causal sums (_lagged_rows), whose gradient goes to the chunk's values
    alone (the cache's carry none) in one write, not a pad's and two slices' backward into full-size zeros."""

    @staticmethod
    def forward(ctx, v, v_ext, K, lag):  # v [B, L, Hkv, D] the chunk's values (v_ext's last L rows), v_ext detached
        ctx.skip = min(v_ext.shape[1] - K - v.shape[1] + lag, v.shape[1])  # lagged index of the chunk's first row
        return _lagged_rows(v_ext, K, lag, v.shape[1])

    @staticmethod
    def backward(ctx, g):  # g [B, L, Hkv, D]: chunk row c is lagged row skip + c
        return torch.nn.functional.pad(g[:, ctx.skip:], (0, 0, 0, 0, 0, ctx.skip)), None, None, None


# How the linear part weighs the keys beyond a query's window (attention.linear_norm):
#   sum:  as the paper writes it, phi(q_i) . sum_j (1 - g_ij) phi(k_j) v_j^T. Every key beyond the window adds about
#         F (phi ~ 1 per feature at init) against e^{q.k} ~ 1 for a softmax key, so the linear part's share of the
#         denominator grows with the position: 97.5% at 0-256 and 99.8% at 2k-4k at init (benchmarks/linear_mass.py);
#   mean: the same sums divided by their key count, max(1, p_i - w + 1): the linear part weighs as one key of the
#         sums' average phi(k) (~F at init) at every position, so a 64k-token document starts as SparseK+SW plus a
#         summary of what left the window, not as linear attention over the whole prefix.
# Both scale phi(q_i) alone (everything linear is linear in it), by a factor of the query's position: chunked ==
# unchunked and decode == forward hold as for sum.
LINEAR_NORMS = ("sum", "mean")


def query_scale(q_pos: torch.Tensor, window: int, norm: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The factor [B, L] of phi(q) at query positions q_pos [B, L] (-1: padding) under `norm`; None for sum."""
    if norm not in LINEAR_NORMS:
        raise ValueError(f"linear_norm must be one of {LINEAR_NORMS}; got {norm!r}")
    if norm == "sum":
        return None
    count = (q_pos - window + 1).clamp(min=1)  # keys at positions <= p_i - w
    return count.to(torch.float64).reciprocal().to(dtype)  # rounded once from float64: the same bits in any chunking


def scaled_query_features(phq: torch.Tensor, s: torch.Tensor | None, gain: torch.Tensor | None) -> torch.Tensor:
    """phi(q) [..., H, F] times the position factor s [...] (query_scale) and the per-head gain [H]
    (attention.linear_gain learned; None: 1), in this order in the chunk op and the decode step alike (the same bits)."""
    if s is not None:
        phq = phq * s[..., None, None]
    if gain is not None:
        phq = phq * gain.to(phq.dtype)[:, None]
    return phq


def _phi_and_beyond_window_sums(q, k, v, phi_weight, keys, cache: SparseKLinearCache, window: int, backend: str,
                                linear_norm: str = "sum", linear_gain: torch.Tensor | None = None,
                                phi_inv_freq: torch.Tensor | None = None):
    """(phq [B, L, H, F], phk [B, N, Hkv, F], num [B, L, H, D], den [B, L, H]): phi of the queries and the extended
    keys, and phi(q_i) . the sums over the causal keys outside query i's window
    (positions <= p_i - w), so the window's keys (gate 1, no linear part) are never added and then taken
    back out: that difference of two large sums cancelled to noise in bfloat16 and float32 and made the
    denominator zero or negative (NaN in training on the GPU).

    They are the state, the pool (both beyond every chunk query's window) and the tail and chunk keys
    lagged: tail ++ chunk index e holds position seen - (W-1) + e, which leaves query i's window once
    e <= i - lag, lag = w - (W-1); causal linear attention over that sequence shifted right by lag."""
    K = keys.topk
    lag = window - keys.tail_slots
    L = k.shape[1]
    phq = _QueryFeatures.apply(rotated_back(q, keys.q_pos, phi_inv_freq), phi_weight)  # [B, L, H, F]
    phq = scaled_query_features(phq, query_scale(keys.q_pos, window, linear_norm, phq.dtype), linear_gain)
    # the pool's values are the cache's, which carry no gradient; the chunk's keys are k_ext's last L rows
    k_ext = rotated_back(keys.k.detach(), keys.pos, phi_inv_freq)
    phk, phk_lag, start_kv, start_k = _KeyFeatures.apply(rotated_back(k, keys.pos[:, -L:], phi_inv_freq), phi_weight,
                                                         k_ext, keys.pos >= 0, keys.v[:, :K].detach(), cache.lin_kv,
                                                         cache.lin_k, lag)
    v_lag = _LaggedValues.apply(v, keys.v.detach(), K, lag)  # [B, L, Hkv, D]
    num, den = causal_linear_attention(phq, phk_lag, v_lag, start_kv, start_k, backend=backend)
    return phq, phk, num, den


def runs_triton_core(backend: str, device_type: str) -> bool:
    """Whether attention.backend `backend` runs linear_triton.py's core on a `device_type` device: "triton" does
    (on the CPU under TRITON_INTERPRET), auto does on CUDA, naive never. Under torch's deterministic algorithms
    (train.deterministic) the core's backward sums the keys' gradients without atomic adds, in a fixed order, bit
    for bit the same every run (linear_triton.deterministic_backward; tests/gpu/test_linear_gpu.py -k
    without_atomics). The core follows the naive one on the GPU (tests/gpu/test_linear_gpu.py) and its op is ~8x
    faster there (linear_core_ab.py, H100, 4 x 4096 tokens, D = 64: 10.18 against 81.64 ms forward + backward).
    auto took the naive core until fit, eval and generate's prefill had run on it on a GPU (issue 38)."""
    return backend == "triton" or (backend == "auto" and device_type == "cuda")


def triton_kernels_run(backend: str, device_type: str, *, block: int, head_dim: int, phi_dim: int, dtype: torch.dtype,
                       score_dtype: torch.dtype = torch.float32) -> bool:
    """Whether a call runs linear_triton.py's kernels: `backend` takes them on this device (runs_triton_core) and they
    take the call's block, dims and dtypes (linear_triton.unsupported: not float64, power-of-two dims)."""
    if not runs_triton_core(backend, device_type):
        return False
    from longtrain.ops.sparsek_attention.linear_triton import unsupported

    return unsupported(block, head_dim, phi_dim, dtype, score_dtype) is None


def linear_core(backend: str, q: torch.Tensor, phi_dim: int, score_dtype: torch.dtype, block: int = 64):
    """The SparseK+Linear core for `backend` and the call's queries q [B, L, H, D]: linear_triton.py's kernels where
    they run (triton_kernels_run), else the naive core; "triton" always asks for the kernels, which warn and run the
    naive core where they cannot."""
    if backend == "triton" or triton_kernels_run(backend, q.device.type, block=block, head_dim=q.shape[-1],
                                                 phi_dim=phi_dim, dtype=q.dtype, score_dtype=score_dtype):
        from longtrain.ops.sparsek_attention.linear_triton import sparsek_linear_attention_core_triton

        return sparsek_linear_attention_core_triton
    return sparsek_attention_core_naive


def sparsek_linear_attention_chunk(
    q: torch.Tensor,  # [B, L, H, D]
    k: torch.Tensor,  # [B, L, Hkv, D] (after RoPE)
    v: torch.Tensor,  # [B, L, Hkv, D]
    u: torch.Tensor,  # [B, L] importance scores (unused when topk = 0)
    phi_weight: torch.Tensor,  # [Hkv, D, F] the head-wise linear map of phi
    cache: SparseKLinearCache,  # its topk and window are the call's
    *,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
    linear_backend: str = "auto",
    block: int = 64,
    scan: str = "auto",
    backend: str = "auto",
    align: bool | None = None,
    linear_norm: str = "sum",
    linear_gain: torch.Tensor | None = None,  # [H] > 0
    phi_inv_freq: torch.Tensor | None = None,  # [R/2] float64 RoPE's inverse frequencies (rotated_back)
) -> tuple[torch.Tensor, SparseKLinearCache, ChunkSelection]:
    """SparseK+Linear+SW of one chunk continuing from `cache`: (o [B, L, H, D], next cache, selection).

    backend: the core of the SparseK part ("triton": linear_triton.py's kernels, "naive" and auto: the
    reference; linear_core says why);
    linear_backend picks the causal linear attention (ops/linear_attention: fla on CUDA when installed);
    linear_norm: the linear part's sums as the paper writes them ("sum") or divided by their key count ("mean";
    LINEAR_NORMS says why);
    linear_gain: a factor [H] per query head on the linear part (phi(q)), the model's learned one; None: 1;
    phi_inv_freq: phi reads q and k rotated back to position 0 with these RoPE frequencies (rotated_back); None:
    as given;
    align: without gradients, the core's query tiles at absolute positions, as sparsek_attention_chunk's (aligned.py,
    with phi(q), num, den and phi(k) laid out as q and k): a chunk that starts inside a tile rounds as the
    unchunked pass does. None: always; False: never."""
    _check(q, k, v, u, variant, backend, scan)
    window = _linear_window(cache)
    keys = lay_out_keys(cache, k, v, u, lengths)
    sel = select(keys, cache, window=window, block=block, scan=scan)
    tau = ThresholdFn.apply(u, sel.tau, sel.n_active, keys.lengths, window)
    phq, phk, num, den = _phi_and_beyond_window_sums(q, k, v, phi_weight, keys, cache, window, linear_backend,
                                                     linear_norm, linear_gain, phi_inv_freq)
    core = linear_core(backend, q, phq.shape[-1], keys.u.dtype, block)
    args = (q, keys.k, keys.v, keys.u, keys.pos, keys.q_pos, sel.theta_u, sel.theta_pos, tau, sel.block_pool)
    linear = LinearTerms(phq, phk, num, den)
    training = _differentiable(q, k, v, u)
    aligned = align is not False and not training
    if aligned:  # the linear cores' query tile is the op's block
        args, cut_back, (a_phq, a_num, a_den, a_phk) = aligned_inputs(
            q, keys, sel, tau, (cache.tile_pool_pos, cache.tile_pool_at), window=window, tile=block, block=block,
            query_terms=(phq, num, den), key_terms=(phk,))
        linear = LinearTerms(a_phq, a_phk, a_num, a_den)
    o = core(*args, topk=keys.topk, window=window, tail_slots=keys.tail_slots, variant=variant, scale=scale, block=block,
             linear=linear)
    o = (cut_back(o) if aligned else o).to(q.dtype)
    # without gradients the pool at the last tile start too (what the next chunk's aligned layout reads)
    base = next_cache(cache, keys, sel, window=window, tile=None if training else block, block=block)
    with torch.no_grad():  # keys in neither the new pool nor the new tail can never be selected again
        rows = carried(keys, sel)
        B, N = keys.pos.shape
        # scatter_ of a scalar, not `kept[rows, idx] = True`: that copies True from the host, two syncs on CUDA per
        # call (24 a step at 12 layers; the H100 profile counted 25) and a copy a CUDA graph cannot capture
        kept = torch.zeros(B, N + 1, dtype=torch.bool, device=keys.pos.device)  # slot N: empty pool slots
        kept.scatter_(1, rows.tail, True).scatter_(1, torch.where(rows.pool_ok, rows.pool, N), True)
        kept = kept[:, :N]
        lin_kv, lin_k = _add_state(cache.lin_kv, cache.lin_k, phk.detach(), keys.v.detach(), (keys.pos >= 0) & ~kept)
    return o, SparseKLinearCache(**base.tensors(), lin_kv=lin_kv, lin_k=lin_k, window=window), ChunkSelection.of(sel, u)


def sparsek_linear_attention(q, k, v, u, phi_weight, *, topk: int, window: int, variant: str = "hard_k_soft_v",
                             scale: float | None = None, linear_backend: str = "auto", scan: str = "auto",
                             block: int = 64, backend: str = "auto", linear_norm: str = "sum",
                             linear_gain: torch.Tensor | None = None,
                             phi_inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """SparseK+Linear+SW over whole sequences (positions 0..T-1): o [B, T, H, D] (topk = 0: Linear+SW)."""
    cache = SparseKLinearCache.empty(q.shape[0], topk, window, k.shape[2], k.shape[3], dtype=k.dtype,
                                     score_dtype=u.dtype, device=q.device, features=phi_weight.shape[-1])
    o, _, _ = sparsek_linear_attention_chunk(q, k, v, u, phi_weight, cache, variant=variant, scale=scale,
                                             linear_backend=linear_backend, scan=scan, block=block, backend=backend,
                                             align=False, linear_norm=linear_norm, linear_gain=linear_gain,
                                             phi_inv_freq=phi_inv_freq)  # position 0 is a tile edge
    return o


def sparsek_linear_attention_decode(
    q: torch.Tensor,  # [B, H, D] the new token's query
    k: torch.Tensor,  # [B, Hkv, D] its key (after RoPE)
    v: torch.Tensor,  # [B, Hkv, D]
    u: torch.Tensor,  # [B]
    phi_weight: torch.Tensor,  # [Hkv, D, F]
    cache: SparseKLinearCache,  # after positions [0, t); its topk and window are the call's
    *,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    with_selection: bool = False,
    backend: str = "auto",
    linear_norm: str = "sum",
    linear_gain: torch.Tensor | None = None,  # [H] > 0
    phi_inv_freq: torch.Tensor | None = None,  # [R/2] float64 (rotated_back)
) -> tuple[torch.Tensor, SparseKLinearCache, ChunkSelection | None]:
    """One token per row at position cache.seen: (o [B, H, D], next cache, selection); equals the chunk op on
    one token, the options as sparsek_attention_decode's. The query sees [pool][tail][itself] (every key there
    is causal): exp part g e^{s - M}, linear part (1 - g) phi(q).phi(k) there plus phi(q) . state. The SparseK
    decode step then updates pool, tail and threshold; the keys it drops (the rejected candidate or the evicted
    pool key) join the state."""
    window = _linear_window(cache)
    B, H, D = q.shape
    Hkv = k.shape[1]
    t = cache.seen
    dev = q.device
    cdt = torch.promote_types(q.dtype, torch.float32)
    K, Wt = cache.topk, cache.tail_slots
    tail_pos = t[:, None] - Wt + torch.arange(Wt, device=dev)[None]  # [B, W-1]
    pos = torch.cat([cache.pool_pos, torch.where(tail_pos >= 0, tail_pos, -1), t[:, None]], 1)  # [B, N]
    keys = torch.cat([cache.pool_k, cache.tail_k.to(cache.pool_k.dtype), k[:, None].to(cache.pool_k.dtype)], 1)
    vals = torch.cat([cache.pool_v, cache.tail_v.to(cache.pool_v.dtype), v[:, None].to(cache.pool_v.dtype)], 1)
    ok = pos >= 0
    if K > 0:
        m = (cache.pool_u.to(torch.float64) - cache.tau.to(torch.float64)[:, None]).clamp(0, 1)  # tau = -inf: 1
        m = torch.where(cache.pool_pos >= 0, m, 0.0)
        if variant == "straight_through":
            m = torch.where(cache.pool_pos >= 0, 1.0, 0.0).to(m.dtype)
        gate = torch.cat([m.to(cdt), torch.ones(B, Wt + 1, dtype=cdt, device=dev)], 1)  # [B, N]
    else:
        gate = torch.ones(B, Wt + 1, dtype=cdt, device=dev)
    gate = torch.where(ok, gate, 0)
    scale = D**-0.5 if scale is None else scale
    qh = q.to(cdt).view(B, Hkv, H // Hkv, D)
    logits = torch.einsum("bgrd,bngd->bgrn", qh, keys.to(cdt)) * scale  # [B, Hkv, R, N]
    if variant == "soft_kv":
        logits = logits * gate[:, None, None]
    logits = logits.masked_fill(~ok[:, None, None], -torch.inf)
    M = logits.amax(-1, keepdim=True).clamp(min=0)
    phq = feature_map(rotated_back(q[:, None], t[:, None], phi_inv_freq), phi_weight)[:, 0]  # [B, H, F]
    s = query_scale(t, window, linear_norm, phq.dtype)  # [B]: as the chunk op scales it, bit for bit
    phq = scaled_query_features(phq, s, linear_gain).to(cdt).view(B, Hkv, H // Hkv, -1)  # [B, Hkv, R, F]
    phk = _phi_keys(rotated_back(keys, pos, phi_inv_freq), pos, phi_weight).to(cdt)  # [B, N, Hkv, F]
    lin_w = torch.einsum("bgrf,bngf->bgrn", phq, phk)
    g = gate[:, None, None]
    w = torch.where(ok[:, None, None], g * torch.exp(logits - M) + torch.exp(-M) * (1 - g) * lin_w, 0)
    num = torch.einsum("bgrn,bngd->bgrd", w, vals.to(cdt)) + torch.exp(-M) * torch.einsum(
        "bgrf,bgfd->bgrd", phq, cache.lin_kv.to(cdt))
    den = w.sum(-1, keepdim=True) + torch.exp(-M) * torch.einsum("bgrf,bgf->bgr", phq, cache.lin_k.to(cdt))[..., None]
    o = (num / den).reshape(B, H, D).to(q.dtype)

    _, base, sel = sparsek_attention_decode(q, k, v, u, cache, variant=variant, scale=scale,
                                            with_selection=with_selection, backend=backend)
    # Dropped: the keys of [pool][tail][itself] in neither the new pool nor the new tail (positions t-w+2 .. t).
    in_pool = (pos[:, :, None] == base.pool_pos[:, None, :]).any(-1)  # [B, N]
    dropped = ok & ~in_pool & (pos <= t[:, None] - window + 1)
    lin_kv, lin_k = _add_state(cache.lin_kv, cache.lin_k, phk.detach(), vals.detach(), dropped)
    nxt = replace(base, lin_kv=lin_kv, lin_k=lin_k)  # base: the linear cache the SparseK step updated
    return o, nxt, sel


__all__ = [
    "LINEAR_NORMS",
    "SparseKLinearCache",
    "query_scale",
    "rotated_back",
    "scaled_query_features",
    "sparsek_linear_attention",
    "sparsek_linear_attention_chunk",
    "sparsek_linear_attention_decode",
    "STATE_DTYPE",
]
