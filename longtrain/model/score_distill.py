"""An auxiliary loss that gives every key a learning signal for its SparseK score (issue 30).

With hard selection, the LM loss reaches a key's score u_j only while the key is selected (through the
mask m_ij). A key the scorer ranks low is never selected, so nothing tells the scorer it mattered: a
fact planted far back is lost for good. This loss distils where the model's own dense attention
goes into the scores, as DeepSeek's sparse attention trains its indexer: for a few sampled queries of
the chunk, their attention over the chunk's older keys (beyond the window, where selection decides)
is the teacher, softmax(u) over the same keys the student, and the loss is KL(teacher || student)
averaged over the sampled queries and score groups.

It changes the training signal only: the forward (outputs, selections, the cache) is the same with it
on or off, so chunked == unchunked still holds. The teacher is detached (q, k), and the scores are
recomputed from a detached attention input, so the gradient reaches the scoring vectors alone.
"""

from __future__ import annotations

import torch


def sampled_queries(length: int, window: int, count: int, device: torch.device) -> torch.Tensor:
    """`count` chunk offsets spread evenly over [window, length) (each has >= 1 older key in the chunk): [S].

    Device arithmetic only (no host list), so a CUDA graph can capture it.
    """
    span = length - window
    n = min(count, span)
    return window + torch.arange(n, device=device) * span // n


def score_distill_loss(
    q: torch.Tensor,  # [B, L, H, D] queries after RoPE (detached)
    k: torch.Tensor,  # [B, L, Hkv, D] keys after RoPE (detached)
    u: torch.Tensor,  # [B, L, G] importance scores (the student)
    valid: torch.Tensor,  # [B, L] bool
    *,
    window: int,
    queries: int,
) -> torch.Tensor:
    """KL(dense attention over older keys || softmax(u) over them), averaged over sampled queries: [] float32
    (float64 for float64 scores)."""
    B, L, H, D = q.shape
    G = u.shape[-1]
    if L <= window:  # no query of the chunk has an older key in it
        return u.sum() * 0.0
    t = sampled_queries(L, window, queries, q.device)  # [S]
    S = t.shape[0]
    keys = torch.arange(L, device=q.device)
    older = (keys[None, :] <= t[:, None] - window) & valid[:, None, :]  # [B, S, L]: candidates, within the chunk
    acc = torch.promote_types(u.dtype, torch.float32)  # float32, or float64 in a float64 model
    with torch.no_grad():
        kh = k.to(acc).repeat_interleave(H // k.shape[2], dim=2)  # [B, L, H, D]
        logits = torch.einsum("bshd,blhd->bhsl", q[:, t].to(acc), kh) * D**-0.5  # [B, H, S, L]
        logits = logits.masked_fill(~older[:, None], float("-inf"))
        teacher = logits.softmax(-1).view(B, G, H // G, S, L).mean(2)  # [B, G, S, L], the heads of each group
    student = u.to(acc).transpose(1, 2)[:, :, None, :].masked_fill(~older[:, None], float("-inf"))  # [B, G, 1|S, L]
    log_student = student.expand(B, G, S, L).log_softmax(-1)  # [B, G, S, L]
    terms = teacher * (teacher.clamp(min=1e-30).log() - log_student)
    kl = torch.where(older[:, None], terms, 0.0).sum(-1)  # [B, G, S]
    counted = valid[:, t]  # [B, S] real queries (not padding)
    return (kl * counted[:, None]).sum() / (counted.sum() * G).clamp(min=1)
