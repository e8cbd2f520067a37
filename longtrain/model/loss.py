"""The LM head and its cross-entropy, slice by slice: no [N, V] float32 logits at once.

`linear_cross_entropy(h, weight, targets)` is the summed next-token loss of the logits `h @ weightᵀ`,
the same (to rounding) as `linear_cross_entropy_reference`, the plain F.linear + F.cross_entropy
beside it. It walks the rows in slices: per slice, the logits in the compute dtype (bf16 under
autocast), their log-sum-exp in float32, the loss and, when a gradient is wanted, the gradient of
the loss with respect to the slice's hidden rows and the head weight (softmax − one-hot, two
matmuls), so backward only scales them by the incoming gradient (Liger-Kernel's fused linear
cross-entropy idea, in plain PyTorch). Memory: one slice of logits plus dh [N, d] and dW [V, d] in
float32, instead of [N, V] logits in bf16, their float32 copy and its gradient (at 16k rows and a
vocabulary of 8192: about 0.2 GiB instead of 1.3 GiB). The matmul work is the same as unfused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # longtrain.data.IGNORE: positions without a target
SLICE_ELEMENTS = 2**25  # logits per slice: 128 MiB in float32 (4096 rows at a vocabulary of 8192)


def linear_cross_entropy_reference(
    h: torch.Tensor,  # [..., d] final hidden states
    weight: torch.Tensor,  # [V, d] the head
    targets: torch.Tensor,  # [...] int64, IGNORE_INDEX where there is none
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum over the targets of −log softmax(h Wᵀ)[target], in float32 (float64 for float64 inputs)."""
    logits = F.linear(h, weight)  # [..., V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum")


def loss_slice(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, want_grad: bool):
    """One slice: (summed loss, d loss / d logits in the logits' dtype or None). h [n, d], targets [n].

    Tensors in, tensors out, so `torch.compile` can fuse it (the logits' float32 pass, softmax and
    one-hot in one kernel); the trainer compiles it with `train.compile`.
    """
    logits = F.linear(h, weight)  # [n, V] in the compute dtype
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(lf, dim=-1)  # [n]
    keep = targets != ignore_index
    safe = torch.where(keep, targets, 0)
    picked = lf.gather(1, safe[:, None])[:, 0]  # [n]
    loss = torch.where(keep, lse - picked, 0.0).sum()
    if not want_grad:
        return loss, None
    w = keep[:, None].to(lf.dtype)  # [n, 1]: rows without a target get no gradient
    grad = torch.exp(lf - lse[:, None]) * w  # softmax [n, V]
    grad.scatter_add_(1, safe[:, None], -w)  # − one-hot, in place: no second [n, V] tensor
    return loss, grad.to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients; backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, slice_rows, slice_fn):
        acc = torch.promote_types(h.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=h.device)
        dh = torch.empty(h.shape, dtype=acc, device=h.device) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        w_g = None  # the head in the gradient's dtype, cast once
        for start in range(0, h.shape[0], slice_rows):
            hs = h[start : start + slice_rows]  # [n, d]
            loss, g = slice_fn(hs, weight, targets[start : start + slice_rows], ignore_index, True)
            total += loss
            if dh is not None:
                w_g = weight.to(g.dtype) if w_g is None else w_g
                dh[start : start + slice_rows] = g @ w_g  # [n, d]
            if dw is not None:
                dw += g.t() @ hs.to(g.dtype)  # [V, d], summed over the slices in float32
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        dh, dw = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        gh = (dh * grad_total).to(h_dtype) if dh is not None else None
        gw = (dw * grad_total).to(w_dtype) if dw is not None else None
        return gh, gw, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,  # [..., d] final hidden states
    weight: torch.Tensor,  # [V, d] the head
    targets: torch.Tensor,  # [...] int64, IGNORE_INDEX where there is none
    *,
    ignore_index: int = IGNORE_INDEX,
    slice_rows: int | None = None,  # rows per slice; default: SLICE_ELEMENTS // V
    slice_fn: Callable | None = None,  # loss_slice, or a compiled version of it
) -> torch.Tensor:
    """Sum over the targets of −log softmax(h Wᵀ)[target]: linear_cross_entropy_reference, slice by slice."""
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)  # [N, d], [N]
    rows = slice_rows or max(1, SLICE_ELEMENTS // weight.shape[0])
    fn = slice_fn or loss_slice
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(flat_h, weight, flat_t, ignore_index, rows, fn)
    total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    for start in range(0, flat_h.shape[0], rows):
        total += fn(flat_h[start : start + rows], weight, flat_t[start : start + rows], ignore_index, False)[0]
    return total
