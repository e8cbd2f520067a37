"""SparseK attention core on Triton kernels: same signature and results as naive.py's core.

Forward: triton_fwd (O and a base-2 log-sum-exp per query and head). Backward: triton_bwd (dq and
dtau query-major; dk, dv, du key-major; the pool keys' sums use a few atomic adds per key unless
DETERMINISTIC or torch.use_deterministic_algorithms is on). Gradients go to q, k_ext, v_ext, u_ext
(direct mask term) and tau (its chain to u is ThresholdFn's, in scan.py).
The selection scan stays on the CPU (scan.py); its outputs arrive here as tensors.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton

from longtrain.ops.attention.naive import sparsek_attention_core_naive
from longtrain.ops.attention.triton_bwd import _dkv_band_kernel, _dkv_pool_kernel, _dq_kernel, stable_slots
from longtrain.ops.attention.triton_fwd import LOG2E, VARIANT_CODE, _fwd_kernel

# Fill every kernel-written buffer with NaN first, so a value never written shows (tests set it).
POISON = False
# Backward without atomics (bitwise reproducible); also on under torch.use_deterministic_algorithms.
DETERMINISTIC = False
# Launch settings (benchmarks/attention.py --sweep measures alternatives): query blocks per program
# of the pool walk in the fast (atomic) mode; warps (None: 4 for D <= 64, else 8) and pipeline stages.
POOL_SEGMENT = 16
FWD_WARPS = None
FWD_STAGES = 2
BWD_WARPS = None


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


def _config(block: int, D: int, dtype: torch.dtype):
    """Key tile, dot precision, default warps, forward warps, backward warps."""
    bn = 16 if _interpreting() else 64  # key tile
    prec = "ieee" if dtype == torch.float32 else "tf32"  # float32 checks want exact fp32 dots
    warps = 4 if D <= 64 else 8
    if D > 64:  # the knobs are tuned at D = 64
        return bn, prec, warps, warps, warps
    return bn, prec, warps, FWD_WARPS or warps, BWD_WARPS or warps


def _empty(shape, dtype, device):
    x = torch.empty(shape, dtype=dtype, device=device)
    return x.fill_(float("nan")) if POISON else x


class _SparseKTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ext, v_ext, u_ext, pos_ext, q_pos, theta_u, theta_pos, tau, block_pool, meta):
        topk, window, tail_slots, variant, scale, block = meta
        B, L, H, D = q.shape
        N, Hkv = k_ext.shape[1], k_ext.shape[2]
        nb = -(-L // block)
        bn, prec, _, fwd_warps, bwd_warps = _config(block, D, q.dtype)
        q, k_ext, v_ext = q.contiguous(), k_ext.contiguous(), v_ext.contiguous()
        u = u_ext.detach().contiguous()  # [B, N]
        pos = pos_ext.to(torch.int32).contiguous()
        qpos = q_pos.to(torch.int32).contiguous()
        thu = theta_u.to(u.dtype).contiguous()  # exact: theta is one of the u values (or +-inf)
        thp = theta_pos.clamp(-(2**31), 2**31 - 1).to(torch.int32).contiguous()
        tau_c = tau.detach().contiguous()
        if topk > 0:
            bp = block_pool[:, :nb].to(torch.int32).contiguous()  # [B, nb, K]
        else:
            bp = torch.full((B, nb, 1), -1, dtype=torch.int32, device=q.device)
        o = _empty((B, L, H, D), q.dtype, q.device)
        lse = _empty((B, H, L), torch.float32, q.device)  # base-2 log-sum-exp
        common = dict(G=block, BN=bn, D=D, VARIANT=VARIANT_CODE[variant], HAS_TOPK=topk > 0, PREC=prec)
        _fwd_kernel[(nb, B * H)](
            q, k_ext, v_ext, u, pos, qpos, thu, thp, tau_c, bp, o, lse,
            q.stride(0), q.stride(1), q.stride(2), k_ext.stride(0), k_ext.stride(1), k_ext.stride(2),
            v_ext.stride(0), v_ext.stride(1), v_ext.stride(2), o.stride(0), o.stride(1), o.stride(2),
            bp.stride(0), bp.stride(1),
            L, N, H, H // Hkv, topk, window, tail_slots, scale * LOG2E,
            num_warps=fwd_warps, num_stages=FWD_STAGES, **common,
        )
        ctx.save_for_backward(q, k_ext, v_ext, u, pos, qpos, thu, thp, tau_c, bp, o, lse)
        ctx.meta = (topk, window, tail_slots, scale, block, dict(common, num_warps=bwd_warps), u_ext.dtype, tau.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k_ext, v_ext, u, pos, qpos, thu, thp, tau, bp, o, lse = ctx.saved_tensors
        topk, window, tail_slots, scale, block, common, u_dtype, tau_dtype = ctx.meta
        B, L, H, D = q.shape
        N, Hkv = k_ext.shape[1], k_ext.shape[2]
        nb = -(-L // block)
        bn = common["BN"]
        do = do.contiguous()
        delta = _empty((B, H, L), torch.float32, q.device)  # dO_i . o_i, written by the dq kernel
        dq = _empty((B, L, H, D), q.dtype, q.device)
        dtau = _empty((B, H, L), torch.float32, q.device)
        strides = (
            q.stride(0), q.stride(1), q.stride(2), k_ext.stride(0), k_ext.stride(1), k_ext.stride(2),
            v_ext.stride(0), v_ext.stride(1), v_ext.stride(2), do.stride(0), do.stride(1), do.stride(2),
        )
        _dq_kernel[(nb, B * H)](
            q, k_ext, v_ext, u, pos, qpos, thu, thp, tau, bp, do, o, lse, delta, dq, dtau,
            *strides, bp.stride(0), bp.stride(1),
            L, N, H, H // Hkv, topk, window, tail_slots, scale,
            num_stages=1, **common,
        )
        # Key-major passes: pool sums first (zeroed fp32 buffers), then the band pass adds them and
        # writes the final dk, dv, du (every ext row exactly once).
        dk = _empty(k_ext.shape, k_ext.dtype, q.device)  # [B, N, Hkv, D]
        dv = _empty(v_ext.shape, v_ext.dtype, q.device)
        dub = _empty((B, Hkv, N), torch.float32, q.device)
        dkp = dvp = dup = dub  # unused without a pool
        if topk > 0:
            sp = stable_slots(bp, N).contiguous()  # [B, nb, K]
            dkp = torch.zeros((B, N, Hkv, D), dtype=torch.float32, device=q.device)
            dvp = torch.zeros_like(dkp)
            dup = torch.zeros((B, Hkv, N), dtype=torch.float32, device=q.device)
            det = DETERMINISTIC or torch.are_deterministic_algorithms_enabled()
            seg = nb if det else POOL_SEGMENT
            _dkv_pool_kernel[(triton.cdiv(topk, bn), triton.cdiv(nb, seg), B * Hkv)](
                q, k_ext, v_ext, u, pos, qpos, thu, thp, tau, sp, do, lse, delta, dkp, dvp, dup,
                *strides, sp.stride(0), sp.stride(1),
                L, N, H, H // Hkv, nb, topk, window, scale, seg,
                G=block, BN=bn, D=D, VARIANT=common["VARIANT"], PREC=common["PREC"], ATOMIC=seg < nb,
                num_warps=common["num_warps"], num_stages=1,
            )
        _dkv_band_kernel[(triton.cdiv(N, bn), B * Hkv)](
            q, k_ext, v_ext, u, pos, qpos, thu, thp, tau, do, lse, delta, dkp, dvp, dup, dk, dv, dub,
            *strides, dk.stride(0), dk.stride(1), dk.stride(2),
            L, N, H, H // Hkv, nb, topk, window, tail_slots, scale,
            num_stages=1, **common,
        )
        du = dub.sum(1).to(u_dtype)  # [B, N]: summed over kv heads
        return (dq, dk, dv, du, None, None, None, None,
                dtau.sum(1).to(tau_dtype), None, None)


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
    block_pool: torch.Tensor,  # [B, nb, K] int64 ext indices
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
