"""benchmarks/linear_mass.py (issue 38): the linear part's share of a SparseK+Linear+SW query's denominator."""

import sys
from pathlib import Path

import torch

from longtrain.model import LM, LMConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import linear_mass  # noqa: E402


def test_the_linear_share_at_init_is_most_of_the_denominator_and_grows_with_position():
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=97, layers=2, d_model=64, heads=4, kv_heads=2, style="llama",
                        attention="sparsek+linear+sw", topk=8, window=8, linear_norm="sum")).eval()
    ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(1))
    rows = linear_mass.shares(model, ids, every=16)
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.5 < r["0-256"] < r["256-1024"] < r["1024-2048"] < 1
    assert all("attend" not in vars(b.attn) for b in model.blocks)  # the spies are gone: the class's method again


def test_mean_norm_holds_the_linear_share_about_level_and_below_sums():
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(1))
    by_norm = {}
    for norm in ("sum", "mean"):
        torch.manual_seed(0)
        model = LM(LMConfig(vocab_size=97, layers=2, d_model=64, heads=4, kv_heads=2, style="llama",
                            attention="sparsek+linear+sw", topk=8, window=8, linear_norm=norm)).eval()
        by_norm[norm] = linear_mass.shares(model, ids, every=16)
    for s, m in zip(by_norm["sum"], by_norm["mean"]):
        assert m["1024-2048"] < 0.9 * s["1024-2048"]
        assert abs(m["1024-2048"] - m["256-1024"]) < 0.1  # level: about one averaged key's weight everywhere


def test_a_learned_gain_starts_the_linear_part_near_one_key():
    """linear_gain learned starts at 1/F: the linear part weighs about one key, a small share, F times below mean's
    odds (share / (1 - share)) at every position."""
    ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(1))
    by_gain = {}
    for gain in ("fixed", "learned"):
        torch.manual_seed(0)
        model = LM(LMConfig(vocab_size=97, layers=2, d_model=64, heads=4, kv_heads=2, style="llama",
                            attention="sparsek+linear+sw", topk=8, window=8, linear_norm="mean", linear_gain=gain)).eval()
        by_gain[gain] = linear_mass.shares(model, ids, every=16)
    F = 64 // 4
    for fixed, learned in zip(by_gain["fixed"], by_gain["learned"]):
        for bucket in ("256-1024", "1024-2048"):
            odds = lambda s: s / (1 - s)  # noqa: E731
            assert abs(odds(fixed[bucket]) / odds(learned[bucket]) - F) < 0.2 * F, (bucket, fixed, learned)
