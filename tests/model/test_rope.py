"""model.rope_scaling from a recipe: the paper's NTK-aware interpolation from a target length."""

import pytest
import torch

from longtrain.model import LM, LMConfig
from longtrain.model.rope import inverse_frequencies, rope_angles
from longtrain.train.recipe import RecipeError, load_recipe, recipe_hash


def test_recipe_ntk_from_target_length_is_the_papers_base_change():
    r = load_recipe("quickstart", ["model.rope_scaling.type=dynamic", "model.rope_scaling.target_length=8192",
                                   "model.rope_scaling.original_context=2048"])
    cfg = LMConfig.from_recipe(r.model, r.attention, vocab_size=300)
    assert cfg.rope_scaling["type"] == "dynamic" and cfg.rope_scaling["target_length"] == 8192
    R = cfg.rotary_dim
    inv, attention = inverse_frequencies(R, cfg.rope_theta, cfg.rope_scaling)
    # NTK-aware: base x s^(R/(R-2)) with s = 8192 / 2048 = 4
    want = (cfg.rope_theta * 4 ** (R / (R - 2))) ** -(torch.arange(0, R, 2, dtype=torch.float64) / R)
    assert torch.allclose(inv, want, rtol=1e-12) and attention == 1.0
    assert inv[0] == 1.0 and inv[-1] < (cfg.rope_theta ** -((R - 2) / R)) / 3.9  # lowest frequency ~ /4, highest kept
    # The same model without scaling hashes as before the key existed (old runs still resume).
    plain = load_recipe("quickstart")
    assert recipe_hash(plain) != recipe_hash(r)


# Every type, original_context 16 (linear has none); the dynamic one's NTK base is set by target_length 48.
SCALINGS = {
    "yarn": {"type": "yarn", "factor": 4.0, "original_context": 16},
    "dynamic": {"type": "dynamic", "factor": 2.0, "original_context": 16, "target_length": 48},
    "linear": {"type": "linear", "factor": 4.0},
    "llama3": {"type": "llama3", "factor": 4.0, "original_context": 16},
}
ATTENTIONS = {"full": dict(attention="full"), "sparsek+sw": dict(attention="sparsek+sw", topk=8, window=8)}


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("kind", SCALINGS)
@torch.no_grad()
def test_scaling_reaches_the_model_and_chunking_keeps_it(kind, attention):
    torch.manual_seed(0)
    scaling = SCALINGS[kind]
    cfg = dict(vocab_size=50, layers=1, d_model=32, heads=2, style="llama", **ATTENTIONS[attention])
    scaled, plain = LM(LMConfig(**cfg, rope_scaling=scaling)).double().eval(), LM(LMConfig(**cfg)).double().eval()
    plain.load_state_dict(scaled.state_dict())
    # 70 tokens in chunks of 13: chunks start at 13, 26, ..., 65, past original_context (16) and target_length (48).
    T, chunk = 70, 13
    tokens = torch.randint(0, 50, (1, T))
    ref = scaled(tokens).logits
    assert not torch.allclose(ref, plain(tokens).logits, atol=1e-4)
    cache, parts = scaled.empty_cache(1, dtype=torch.float64), []
    for s in range(0, T, chunk):
        out = scaled(tokens[:, s : s + chunk], cache=cache)
        cache = out.cache
        parts.append(out.logits)
    assert (torch.cat(parts, 1) - ref).abs().max() <= 1e-9
    assert cache.seen.tolist() == [T]
    if kind == "yarn":
        cos, sin = rope_angles(torch.arange(40)[None], 16, 10000.0, scaling)
        assert torch.allclose(cos**2 + sin**2, torch.full_like(cos, (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2))


@pytest.mark.parametrize("sets,message", [
    (["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8"], "needs `original_context`"),
    (["model.rope_scaling.type=linear"], "needs `factor`, or `target_length` and `original_context`"),
    (["model.rope_scaling.type=ntk", "model.rope_scaling.factor=2"], "model.rope_scaling.type"),
])
def test_incomplete_scaling_is_refused_with_the_fix(sets, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("quickstart", sets)
