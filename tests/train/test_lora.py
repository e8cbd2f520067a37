"""LoRA adapters: merged weights give the adapter model's logits; only adapters and scoring vectors learn."""

import pytest
import torch

from longtrain.model import LM, LMConfig
from longtrain.train.init import apply_freeze
from longtrain.train.lora import add_lora, merge_lora
from longtrain.train.recipe import FreezeConfig, LoraConfig, RecipeError


def adapted(style="llama", targets=None, **kw):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=60, layers=2, d_model=32, heads=4, kv_heads=2, style=style, attention="sparsek+sw",
                   topk=4, window=4, **kw)
    model = LM(cfg).double()
    lora = LoraConfig(rank=3, alpha=6.0, **({"targets": targets} if targets else {}))
    line = add_lora(model, lora)
    return cfg, model, line


@torch.no_grad()
def test_merged_weights_give_the_adapter_models_logits():
    cfg, model, line = adapted()
    tokens = torch.randint(0, 60, (2, 30))
    before = model(tokens).logits
    base = LM(cfg).double()
    base.load_state_dict(merge_lora(model.state_dict()))
    # B = 0: the adapters start as a no-op, to float64 rounding: on an AMD EPYC machine the two models' o_proj outputs
    # differed by 1e-18 (MKL promises the same bits only for operands of the same memory alignment, unless CNR is set)
    assert (base(tokens).logits - before).abs().max() <= 1e-13
    for name, p in model.named_parameters():
        if name.endswith(".lora.b"):
            p.normal_(0, 0.3)
    after = model(tokens).logits
    assert (after - before).abs().max() > 1e-2  # the adapters now change the model
    merged = LM(cfg).double()
    merged.load_state_dict(merge_lora(model.state_dict()))
    assert (merged(tokens).logits - after).abs().max() <= 1e-10
    assert "LoRA rank 3 (alpha 6) on q_proj, k_proj, v_proj, o_proj, gate, up, down" in line


def test_only_adapters_and_scoring_vectors_learn_even_after_a_freeze_thaws():
    _, model, _ = adapted(targets=["q_proj", "down"])
    learn = {n for n, p in model.named_parameters() if p.requires_grad}
    assert learn == {f"blocks.{i}.{m}.lora.{ab}" for i in range(2) for m in ("attn.q_proj", "mlp.down") for ab in "ab"} | {
        f"blocks.{i}.attn.scorer.weight" for i in range(2)}
    model(torch.randint(0, 60, (1, 20))).logits.sum().backward()
    assert all((p.grad is not None) == (n in learn) for n, p in model.named_parameters())
    freeze = FreezeConfig(steps=1)  # scorer-first, then "everything": everything LoRA trains
    assert apply_freeze(model, freeze, 1) == len(list(model.parameters())) - 2
    apply_freeze(model, freeze, 2)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == learn


def test_a_target_the_model_lacks_is_refused():
    with pytest.raises(RecipeError, match=r"train.lora.targets \['gate'\] are not projections of this gpt2 model"):
        adapted(style="gpt2", targets=["q_proj", "gate"])


def test_adapter_gradients_in_float64():
    """Gradients through the hooked linear (input, A, B) against finite differences, and its output."""
    from torch.func import functional_call

    from longtrain.train.lora import LoRA, _add_adapter_output

    torch.manual_seed(1)
    linear = torch.nn.Linear(5, 4).double()
    linear.lora = LoRA(linear, rank=2, alpha=3.0, dropout=0.0).double()
    linear.register_forward_hook(_add_adapter_output)

    def f(x, a, b):
        return functional_call(linear, {"lora.a": a, "lora.b": b}, (x,), strict=False)

    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x, a, b))
    want = x @ linear.weight.T + linear.bias + x @ a.T @ b.T * 1.5  # alpha / rank
    assert torch.allclose(f(x, a, b), want, rtol=0, atol=1e-12)
