"""SparseK attention core on Triton kernels: same signature and results as naive.py's core.

The kernels are launched by `sparsek_fwd` and `sparsek_bwd` (fla's style: every kernel argument by its
name, strides and launch settings spelled out), which the autograd function calls.

Forward: triton_fwd (O and a base-2 log-sum-exp per query and head). Backward: triton_bwd (dq and
dtau query-major; dk, dv, du key-major; the pool keys' sums use a few atomic adds per key unless
DETERMINISTIC or torch.use_deterministic_algorithms is on). Gradients go to q, k_ext, v_ext, u_ext
(direct mask term) and tau (its chain to u is ThresholdFn's, in selection/threshold.py).
The selection scan's outputs (theta, positions, block pools: int64 / float64, on the GPU or the CPU)
go to the kernels as they are; the kernels cast. A small kernel (_cut_kernel) turns each query tile's
theta tests on its pool keys into one count per key, shared by all heads and kernels.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton

from longtrain.ops.sparsek_attention.naive import position_order, sparsek_attention_core_naive
from longtrain.ops.sparsek_attention.triton_bwd import _dkv_band_kernel, _dkv_pool_kernel, _dq_kernel
from longtrain.ops.sparsek_attention.triton_fwd import _by_position_kernel, _cut_kernel, _fwd_kernel
from longtrain.ops.sparsek_attention.triton_tiles import LOG2E, VARIANT_CODE

# Fill every kernel-written buffer with NaN first, so a value never written shows (tests set it).
POISON = False
# Backward without atomics (bitwise reproducible); also on under torch.use_deterministic_algorithms.
DETERMINISTIC = False
# Launch settings per head dim (benchmarks/attention.py --sweep D measures alternatives on the H100): the
# kernels' query tile, a multiple of the op's block (max(block, QUERY_TILE)); per kernel the key tile BN,
# warps, pipeline stages and a register cap (maxnreg 168 fits 3 programs per SM where shared memory
# allows: the kernels are latency-bound at 2; measured faster for the D = 64 forward, dq and band pass
# and the D = 128 forward and dq (32-key tiles), slower where it spills in the loops); queries per step
# (MQ) of the key-major dk/dv kernels (walk: the pool walk over slots; band: the band pass).
# A head dim takes the entry of the largest key <= D (the smallest key when none is). The interpreter
# (CPU tests) uses small tiles with the same switches.
_INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
QUERY_TILE = 32 if _INTERP else 64  # 128 measured slower on the H100 (benchmarks/gpu_notes.md)
LAUNCH = {
    64: dict(fwd=dict(BN=64, num_warps=4, num_stages=2, maxnreg=168),
             dq=dict(BN=64, num_warps=4, num_stages=1, maxnreg=168),
             walk=dict(BN=64, MQ=64, num_warps=4, num_stages=2, KEY_MAJOR=True),
             band=dict(BN=64, MQ=32, num_warps=4, num_stages=1, maxnreg=168, KEY_MAJOR=True)),
    128: dict(fwd=dict(BN=64, num_warps=4, num_stages=1, maxnreg=168),
              dq=dict(BN=32, num_warps=4, num_stages=2, maxnreg=168),
              walk=dict(BN=64, MQ=32, num_warps=4, num_stages=1, KEY_MAJOR=True),
              band=dict(BN=64, MQ=32, num_warps=4, num_stages=1, KEY_MAJOR=True)),
}
POOL_SEGMENT = 32


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unsupported(block: int, D: int, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot take this call (None: they can)."""
    if block < 16 or block & (block - 1):
        return f"the query block must be a power of two >= 16; got {block}"
    if D < 16 or D & (D - 1) or D > 256:
        return f"the head dim must be a power of two in [16, 256]; got {D}"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"q/k/v must be float16, bfloat16 or float32; got {dtype}"
    return None


def launch_settings(D: int) -> dict:
    """LAUNCH's entry for head dim D: {kernel: settings} (copies, safe to change)."""
    keys = sorted(LAUNCH)
    key = max([x for x in keys if x <= D], default=keys[0])
    return {name: dict(cfg) for name, cfg in LAUNCH[key].items()}


def _config(D: int, dtype: torch.dtype):
    """Dot precision and per-kernel launch settings (fwd, dq, walk, band: see LAUNCH)."""
    prec = "ieee" if dtype == torch.float32 else "tf32"  # float32 checks want exact fp32 dots
    cfg = launch_settings(D)
    if _interpreting():  # small tiles, the same switches
        for c in (cfg["fwd"], cfg["dq"]):
            c.update(BN=16, num_warps=4, num_stages=1)
        for c in (cfg["walk"], cfg["band"]):
            c.update(BN=16, MQ=16, num_warps=4)
    return prec, cfg


def _empty(shape, dtype, device):
    x = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        x.fill_(float("nan") if dtype.is_floating_point else -(2**31))
    return x


def _qkv_strides(q: torch.Tensor, k_ext: torch.Tensor, v_ext: torch.Tensor) -> dict[str, int]:
    """The strides every launch passes: q [B, L, H, D] and the extended keys and values [B, N, Hkv, D]
    (batch, row, head; D is contiguous)."""
    return dict(stride_qb=q.stride(0), stride_ql=q.stride(1), stride_qh=q.stride(2),
                stride_kb=k_ext.stride(0), stride_kn=k_ext.stride(1), stride_kh=k_ext.stride(2),
                stride_vb=v_ext.stride(0), stride_vn=v_ext.stride(1), stride_vh=v_ext.stride(2))


def _cut(sp, u, pos, qpos, thu, thp, L, G, topk, bw, tail, window):
    """Per query tile and pool slot [B, nt, K]: how many of the tile's queries select the key (int32),
    and the snapshot compacted for the kernels: ext index (int32, -1 empty), score (float32, +inf empty).
    Also per query tile and group of bw slots [B, nt, ceil(K / bw)]: 1 where a key leaves its slot
    after the tile (int32; the pool walk writes its sums then); and per query tile and band key j < G
    [B, nt, G]: the reach of the keys at the window's edge (int32, triton_tiles.edge_logits)."""
    B, nt = sp.shape[0], sp.shape[1]
    cut = _empty((B, nt, topk), torch.int32, u.device)
    pi = _empty((B, nt, topk), torch.int32, u.device)
    pu = _empty((B, nt, topk), torch.float32, u.device)
    flush = _empty((B, nt, triton.cdiv(topk, bw)), torch.int32, u.device)
    reach = _empty((B, nt, G), torch.int32, u.device)
    bk = max(bw, 16 if _interpreting() else 128)
    _cut_kernel[(nt, B, triton.cdiv(topk, bk) + 1)](  # (the last program of each tile: its reach row)
        snapshot_ptr=sp, u_ptr=u, pos_ptr=pos, q_pos_ptr=qpos, theta_u_ptr=thu, theta_pos_ptr=thp,
        cut_ptr=cut, pool_idx_ptr=pi, pool_u_ptr=pu, flush_ptr=flush, reach_ptr=reach,
        stride_sb=sp.stride(0), stride_st=sp.stride(1), n_queries=L, n_ext=u.shape[1], n_tiles=nt, topk=topk,
        tail=tail, window=window, G=G, BK=bk, BW=bw, num_warps=4,
    )
    return cut, pi, pu, flush, reach


def _by_position(cut, pi, pu, pos):
    """The forward's pool tiles [B, nt, K] in ascending key position (naive.position_order): summed in an order
    that does not depend on the scans' slot history (issue 24). The backward keeps the stable slots its pool
    walk follows; its dq recomputes p from the log-sum-exp in any order. The plain reference of
    _by_position_triton (a segmented sort and three gathers: eight launches a layer)."""
    order = position_order(pi, pos)
    return cut.gather(-1, order), pi.gather(-1, order), pu.gather(-1, order)


def _by_position_triton(cut, pi, pu, pos):
    """_by_position in one launch: a program per query tile sorts its K slots (_by_position_kernel)."""
    B, nt, K = pi.shape
    out = tuple(torch.empty_like(t) for t in (cut, pi, pu))
    _by_position_kernel[(nt, B)](cut_ptr=cut, pool_idx_ptr=pi, pool_u_ptr=pu, pos_ptr=pos, cut_out_ptr=out[0],
                                 pool_idx_out_ptr=out[1], pool_u_out_ptr=out[2], n_ext=pos.shape[1], n_tiles=nt,
                                 topk=K, KP=triton.next_power_of_2(K), num_warps=4)
    return out


class _SparseKTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ext, v_ext, u_ext, pos_ext, q_pos, theta_u, theta_pos, tau, block_pool, meta):
        topk, window, tail_slots, variant, scale, block = meta
        B, L, H, D = q.shape
        G = max(block, QUERY_TILE)  # the kernels' query tile: its pool is the snapshot of its first block
        nt = -(-L // G)
        prec, cfg = _config(D, q.dtype)
        q, k_ext, v_ext = q.contiguous(), k_ext.contiguous(), v_ext.contiguous()
        dev = q.device
        # Scan outputs go in as they come (int64 / float64): the kernels cast.
        u = u_ext.detach().contiguous()  # [B, N]
        pos = pos_ext.to(dev).contiguous()
        qpos = q_pos.to(dev).contiguous()
        thu = theta_u.to(dev).contiguous()
        thp = theta_pos.to(dev).contiguous()
        tau_c = tau.detach().contiguous()
        if topk > 0:
            bp = block_pool.to(dev)[:, : nt * (G // block) : G // block]  # [B, nt, K] (a strided view)
            if bp.stride(-1) != 1:
                bp = bp.contiguous()
            cut, pi, pu, flush, reach = _cut(bp, u, pos, qpos, thu, thp, L, G, topk, cfg["walk"]["BN"], tail_slots,
                                             window)
            cut_f, pi_f, pu_f = _by_position_triton(cut, pi, pu, pos)
        else:
            cut = pi = flush = reach = torch.full((B, nt, 1), -1, dtype=torch.int32, device=dev)
            pu = torch.full((B, nt, 1), float("inf"), device=dev)
            cut_f, pi_f, pu_f = cut, pi, pu
        o, lse = sparsek_fwd(q, k_ext, v_ext, u, pos, qpos, thu, thp, tau_c, cut_f, pi_f, pu_f, reach, topk=topk,
                             window=window, tail=tail_slots, scale=scale, G=G, variant=VARIANT_CODE[variant], prec=prec,
                             launch=cfg["fwd"])
        ctx.save_for_backward(q, k_ext, v_ext, u, pos, qpos, thu, thp, tau_c, cut, pi, pu, flush, reach, o, lse)
        ctx.meta = (topk, window, tail_slots, scale, G, VARIANT_CODE[variant], prec, cfg, u_ext.dtype, tau.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k_ext, v_ext, u, pos, qpos, thu, thp, tau, cut, pi, pu, flush, reach, o, lse = ctx.saved_tensors
        topk, window, tail_slots, scale, G, variant, prec, cfg, u_dtype, tau_dtype = ctx.meta
        dq, dk, dv, du, dtau = sparsek_bwd(
            q, k_ext, v_ext, u, pos, qpos, thu, thp, tau, cut, pi, pu, flush, reach, o, lse, do.contiguous(),
            topk=topk, window=window, tail=tail_slots, scale=scale, G=G, variant=variant, prec=prec, launch=cfg,
        )
        return dq, dk, dv, du.to(u_dtype), None, None, None, None, dtau.to(tau_dtype), None, None


def sparsek_fwd(
    q: torch.Tensor,  # [B, L, H, D]
    k_ext: torch.Tensor,  # [B, N, Hkv, D]
    v_ext: torch.Tensor,  # [B, N, Hkv, D]
    u: torch.Tensor,  # [B, N] (detached)
    pos: torch.Tensor,  # [B, N] int64
    q_pos: torch.Tensor,  # [B, L] int64
    theta_u: torch.Tensor,  # [B, L] float64
    theta_pos: torch.Tensor,  # [B, L] int64
    tau: torch.Tensor,  # [B, L] (detached)
    cut: torch.Tensor,  # [B, nt, K] int32: the cut kernel's outputs, pool tiles by position (_by_position)
    pool_idx: torch.Tensor,  # [B, nt, K] int32
    pool_u: torch.Tensor,  # [B, nt, K] float32
    reach: torch.Tensor,  # [B, nt, G] int32
    *,
    topk: int,
    window: int,
    tail: int,
    scale: float,
    G: int,  # the query tile
    variant: int,  # VARIANT_CODE
    prec: str,  # the dots' input precision
    launch: dict,  # LAUNCH's fwd entry: BN, num_warps, num_stages, maxnreg (optional)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: o [B, L, H, D] in q's dtype and the base-2 log-sum-exp [B, H, L] (float32)."""
    B, L, H, D = q.shape
    N, Hkv = k_ext.shape[1], k_ext.shape[2]
    nt = triton.cdiv(L, G)
    o = _empty((B, L, H, D), q.dtype, q.device)
    lse = _empty((B, H, L), torch.float32, q.device)
    _fwd_kernel[(nt, B * H)](
        q_ptr=q, k_ptr=k_ext, v_ptr=v_ext, u_ptr=u, pos_ptr=pos, q_pos_ptr=q_pos, theta_u_ptr=theta_u,
        theta_pos_ptr=theta_pos, tau_ptr=tau, cut_ptr=cut, pool_idx_ptr=pool_idx, pool_u_ptr=pool_u, reach_ptr=reach,
        o_ptr=o, lse_ptr=lse,
        **_qkv_strides(q, k_ext, v_ext),
        stride_ob=o.stride(0), stride_ol=o.stride(1), stride_oh=o.stride(2),
        n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_tiles=nt, topk=topk, window=window, tail=tail,
        scale2=scale * LOG2E.value, G=G, BN=launch["BN"], D=D, VARIANT=variant, HAS_TOPK=topk > 0, PREC=prec,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], maxnreg=launch.get("maxnreg"),
    )
    return o, lse


def sparsek_bwd(
    q: torch.Tensor,  # [B, L, H, D]
    k_ext: torch.Tensor,  # [B, N, Hkv, D]
    v_ext: torch.Tensor,  # [B, N, Hkv, D]
    u: torch.Tensor,  # [B, N]
    pos: torch.Tensor,  # [B, N] int64
    q_pos: torch.Tensor,  # [B, L] int64
    theta_u: torch.Tensor,  # [B, L] float64
    theta_pos: torch.Tensor,  # [B, L] int64
    tau: torch.Tensor,  # [B, L]
    cut: torch.Tensor,  # [B, nt, K] int32: the cut kernel's outputs, in the scans' stable slots
    pool_idx: torch.Tensor,  # [B, nt, K] int32
    pool_u: torch.Tensor,  # [B, nt, K] float32
    flush: torch.Tensor,  # [B, nt, ceil(K / walk BN)] int32
    reach: torch.Tensor,  # [B, nt, G] int32
    o: torch.Tensor,  # [B, L, H, D] the forward's output
    lse: torch.Tensor,  # [B, H, L] its base-2 log-sum-exp
    do: torch.Tensor,  # [B, L, H, D] contiguous
    *,
    topk: int,
    window: int,
    tail: int,
    scale: float,
    G: int,
    variant: int,
    prec: str,
    launch: dict,  # LAUNCH's entries: dq (BN, num_warps, num_stages, maxnreg), walk and band (also MQ, KEY_MAJOR)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels: dq [B, L, H, D], dk and dv [B, N, Hkv, D], du [B, N] and dtau [B, L] (float32).

    dq and dtau query-major (the dq kernel also writes delta and zeroes the pool sums); then key-major:
    the pool walk's sums (atomic adds unless DETERMINISTIC or torch's deterministic algorithms), and
    the band pass, which adds them and writes every ext row's dk, dv, du exactly once."""
    B, L, H, D = q.shape
    N, Hkv = k_ext.shape[1], k_ext.shape[2]
    nt = triton.cdiv(L, G)
    dq_cfg, walk, band = launch["dq"], launch["walk"], launch["band"]
    walk_mq, band_mq = min(G, walk["MQ"]), min(G, band["MQ"])
    dev = q.device
    det = DETERMINISTIC or torch.are_deterministic_algorithms_enabled()
    delta = _empty((B, H, L), torch.float32, dev)  # dO_i . o_i, written by the dq kernel
    if topk > 0:  # the pool walk's sums, zeroed by the dq kernel (no memset launches)
        dkp = _empty((B, N, Hkv, D), torch.float32, dev)
        dvp = _empty((B, N, Hkv, D), torch.float32, dev)
        dup = _empty((B, Hkv, N), torch.float32, dev)
    else:
        dkp = dvp = dup = lse  # (unused)
    dq = _empty((B, L, H, D), q.dtype, dev)
    dtau = _empty((B, H, L), torch.float32, dev)
    _dq_kernel[(nt, B * H)](  # the forward's pool layout and cut
        q_ptr=q, k_ptr=k_ext, v_ptr=v_ext, u_ptr=u, pos_ptr=pos, q_pos_ptr=q_pos, theta_u_ptr=theta_u,
        theta_pos_ptr=theta_pos, tau_ptr=tau, cut_ptr=cut, pool_idx_ptr=pool_idx, pool_u_ptr=pool_u, reach_ptr=reach,
        do_ptr=do, o_ptr=o, lse_ptr=lse, delta_ptr=delta, dq_ptr=dq, dtau_ptr=dtau, dk_pool_ptr=dkp, dv_pool_ptr=dvp,
        du_pool_ptr=dup,
        **_qkv_strides(q, k_ext, v_ext),
        stride_dob=do.stride(0), stride_dol=do.stride(1), stride_doh=do.stride(2),
        n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_tiles=nt, topk=topk, window=window, tail=tail, scale=scale,
        zero_rows=triton.cdiv(N, nt), G=G, BN=dq_cfg["BN"], D=D, VARIANT=variant, HAS_TOPK=topk > 0, PREC=prec,
        num_warps=dq_cfg["num_warps"], num_stages=dq_cfg["num_stages"], maxnreg=dq_cfg.get("maxnreg"),
    )
    dk = _empty(k_ext.shape, k_ext.dtype, dev)  # [B, N, Hkv, D]
    dv = _empty(v_ext.shape, v_ext.dtype, dev)
    dub = _empty((B, Hkv, N), torch.float32, dev)
    if topk > 0:  # the pool walk follows the scans' stable slots (a key never moves while pooled)
        seg = nt if det else POOL_SEGMENT
        _dkv_pool_kernel[(triton.cdiv(topk, walk["BN"]), triton.cdiv(nt, seg), B * Hkv)](
            q_ptr=q, k_ptr=k_ext, v_ptr=v_ext, u_ptr=u, pos_ptr=pos, q_pos_ptr=q_pos, theta_u_ptr=theta_u,
            theta_pos_ptr=theta_pos, tau_ptr=tau, cut_ptr=cut, pool_idx_ptr=pool_idx, pool_u_ptr=pool_u, flush_ptr=flush,
            do_ptr=do, lse_ptr=lse, delta_ptr=delta, dk_pool_ptr=dkp, dv_pool_ptr=dvp, du_pool_ptr=dup,
            **_qkv_strides(q, k_ext, v_ext),
            stride_dob=do.stride(0), stride_dol=do.stride(1), stride_doh=do.stride(2),
            n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_tiles=nt, topk=topk, window=window, scale=scale,
            segment=seg, G=G, MQ=walk_mq, BN=walk["BN"], D=D, VARIANT=variant, PREC=prec, ATOMIC=seg < nt,
            KEY_MAJOR=walk["KEY_MAJOR"], num_warps=walk["num_warps"], num_stages=walk["num_stages"],
            maxnreg=walk.get("maxnreg"),
        )
    _dkv_band_kernel[(triton.cdiv(N, band["BN"]), B * Hkv)](
        q_ptr=q, k_ptr=k_ext, v_ptr=v_ext, u_ptr=u, pos_ptr=pos, q_pos_ptr=q_pos, theta_u_ptr=theta_u,
        theta_pos_ptr=theta_pos, tau_ptr=tau, reach_ptr=reach, do_ptr=do, lse_ptr=lse, delta_ptr=delta,
        dk_pool_ptr=dkp, dv_pool_ptr=dvp, du_pool_ptr=dup, dk_ptr=dk, dv_ptr=dv, du_ptr=dub,
        **_qkv_strides(q, k_ext, v_ext),
        stride_dob=do.stride(0), stride_dol=do.stride(1), stride_doh=do.stride(2),
        stride_dkb=dk.stride(0), stride_dkn=dk.stride(1), stride_dkh=dk.stride(2),
        n_queries=L, n_ext=N, n_heads=H, group=H // Hkv, n_tiles=nt, topk=topk, window=window, tail=tail, scale=scale,
        G=G, MQ=band_mq, BN=band["BN"], D=D, VARIANT=variant, HAS_TOPK=topk > 0, PREC=prec,
        KEY_MAJOR=band["KEY_MAJOR"], num_warps=band["num_warps"], num_stages=band["num_stages"],
        maxnreg=band.get("maxnreg"),
    )
    return dq, dk, dv, dub.sum(1), dtau.sum(1)  # du, dtau: summed over the heads


def sparsek_attention_core_triton(
    q: torch.Tensor,  # [B, L, H, D]
    k_ext: torch.Tensor,  # [B, N, Hkv, D]
    v_ext: torch.Tensor,  # [B, N, Hkv, D]
    u_ext: torch.Tensor,  # [B, N]
    pos_ext: torch.Tensor,  # [B, N] int64 (-1: empty)
    q_pos: torch.Tensor,  # [B, L] int64 (-1: padding)
    theta_u: torch.Tensor,  # [B, L] float64
    theta_pos: torch.Tensor,  # [B, L] int64
    tau: torch.Tensor,  # [B, L] (differentiable)
    block_pool: torch.Tensor,  # [B, nb, K] int64 ext indices in stable slots (as both scans give them)
    *,
    topk: int,
    window: int,
    tail_slots: int,
    variant: str = "hard_k_soft_v",
    scale: float | None = None,
    block: int = 64,
) -> torch.Tensor:
    """Same contract as naive.sparsek_attention_core_naive; o [B, L, H, D] in q's dtype.

    Shapes or dtypes the kernels do not take go to the naive core, with a warning.
    """
    why = unsupported(block, q.shape[-1], q.dtype)
    if why is not None:
        warnings.warn(f"SparseK Triton kernels: {why}; using the naive core", stacklevel=2)
        return sparsek_attention_core_naive(
            q, k_ext, v_ext, u_ext, pos_ext, q_pos, theta_u, theta_pos, tau, block_pool,
            topk=topk, window=window, tail_slots=tail_slots, variant=variant, scale=scale, block=block,
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    meta = (topk, window, tail_slots, variant, float(scale), block)
    return _SparseKTriton.apply(q, k_ext, v_ext, u_ext, pos_ext, q_pos, theta_u, theta_pos, tau, block_pool, meta)
