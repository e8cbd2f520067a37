"""The score distillation loss (train.score_distill): a signal for every key, the forward unchanged."""

import torch

from longtrain.model import LM, LMConfig
from longtrain.model.score_distill import score_distill_loss
from longtrain.ops.sparsek_attention import SparseKCache, sparsek_attention_chunk

from .test_model import SMALL, chunked


def test_its_gradient_reaches_keys_the_lm_loss_never_selects_float64():
    torch.manual_seed(0)
    B, L, H, D, topk, window = 2, 57, 2, 8, 3, 5
    q, k, v = (torch.randn(B, L, H, D, dtype=torch.float64) for _ in range(3))
    u = torch.randn(B, L, dtype=torch.float64, requires_grad=True)
    cache = SparseKCache.empty(B, topk, window, H, D, dtype=torch.float64, score_dtype=torch.float64, device="cpu")
    o, _, _ = sparsek_attention_chunk(q, k, v, u, cache, variant="hard_k_soft_v", backend="naive")
    (o * torch.randn_like(o)).sum().backward()
    lm_grad = u.grad.clone()
    older = torch.arange(L) < L - window  # keys some query sees as a candidate
    unselected = (lm_grad == 0) & older[None]  # no selected query's gate reached them
    assert unselected.sum() >= 10  # hard selection: most old keys get nothing from the LM loss

    u.grad = None
    loss = score_distill_loss(q, k, u[..., None], torch.ones(B, L, dtype=torch.bool), window=window, queries=16)
    loss.backward()
    assert (u.grad[unselected] != 0).float().mean() > 0.9  # the distillation reaches them
    assert torch.autograd.gradcheck(
        lambda s: score_distill_loss(q, k, s, torch.ones(B, L, dtype=torch.bool), window=window, queries=7),
        (u.detach()[..., None].clone().requires_grad_(),),
    )


def test_it_is_the_kl_from_dense_attention_to_softmax_of_the_scores():
    torch.manual_seed(1)
    B, L, H, D, w = 1, 12, 2, 4, 3
    q, k = torch.randn(B, L, H, D, dtype=torch.float64), torch.randn(B, L, H, D, dtype=torch.float64)
    u = torch.randn(B, L, 1, dtype=torch.float64)
    got = score_distill_loss(q, k, u, torch.ones(B, L, dtype=torch.bool), window=w, queries=100)
    want = []
    for t in range(w, L):  # every query with an older key (queries >= L - w: all of them)
        keys = torch.arange(t - w + 1)
        p = torch.stack([(q[0, t, h] @ k[0, keys, h].T / D**0.5).softmax(-1) for h in range(H)]).mean(0)
        s = u[0, keys, 0].log_softmax(-1)
        want.append((p * (p.log() - s)).sum())
    assert torch.allclose(got, torch.stack(want).mean(), atol=1e-12)


def test_it_leaves_outputs_and_chunked_equals_unchunked_unchanged_float64():
    torch.manual_seed(2)
    model = LM(LMConfig(**SMALL, attention="sparsek+sw", topk=6, window=8)).double().train()
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 150))
    plain = model(tokens).logits
    model.set_score_distill(32)
    whole = model(tokens)
    assert whole.score_distill is not None and whole.score_distill.requires_grad
    assert torch.equal(whole.logits, plain)
    parts, _, _ = chunked(model, tokens, 37)
    assert (parts - whole.logits).abs().max() < 1e-9
    # only the scoring vectors learn from it
    model.zero_grad()
    whole.score_distill.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(n.endswith("scorer.weight") for n in grads)
