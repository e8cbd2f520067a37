"""Selection diagnostics: checked against direct computations, and present in metrics.jsonl after a fit."""

import random

import pytest
import torch

from longtrain.model import LM, LMConfig
from longtrain.train.diagnostics import SelectionDiagnostics, summary_line
from longtrain.train.metrics import read_metrics
from longtrain.train.recipe import load_recipe
from longtrain.train.trainer import fit

STATS = {"layer", "pool_age_mean", "pool_age_max", "pool_churn", "tau", "active", "u_mean", "u_std"}


def run_chunks(model, chunks, batch=2, reset_first_row_at=None):
    """Forward chunks [B, L] through the cache; yields (cache before, output) like the trainer."""
    cache = model.empty_cache(batch, dtype=torch.float32)
    for n, tokens in enumerate(chunks):
        if n == reset_first_row_at:
            cache = cache.reset_rows(torch.tensor([True] + [False] * (batch - 1)))
        out = model(tokens, cache=cache)
        yield cache, out
        cache = out.cache


@pytest.mark.parametrize("attention, topk, window, groups", [("sparsek+sw", 6, 5, "shared"), ("sparsek", 6, 0, "shared"),
                                                             ("sparsek+sw", 4, 3, "per_kv_head")])
def test_statistics_match_a_direct_computation(attention, topk, window, groups):
    """Every layer's statistics (computed for all layers at once) against loops over that layer's pools and queries."""
    model = LM(LMConfig(vocab_size=50, layers=3, d_model=16, heads=2, attention=attention, topk=topk, window=window,
                        eps_slope=0.01, score_groups=groups))
    chunks = [torch.randint(0, 50, (2, 20)) for _ in range(4)]
    diag = SelectionDiagnostics(model)
    want = {layer: dict(ages=[], age_max=0.0, new=0, slots=0, taus=[], actives=[], us=[]) for layer in range(3)}
    for n, (before, out) in enumerate(run_chunks(model, chunks, reset_first_row_at=2)):
        diag.update(before, out)
        for layer, w in want.items():
            a0, a1, sel = before.layers[layer].attn, out.cache.layers[layer].attn, out.selections[layer]
            for b in range(a1.seen.shape[0]):  # op rows (a row per group with per-KV-head scorers)
                seen0, seen1 = int(a0.seen[b]), int(a1.seen[b])
                pool = [int(p) for p in a1.pool_pos[b] if p >= 0]
                w["ages"] += [seen1 - 1 - p for p in pool]
                w["age_max"] = max([w["age_max"]] + [seen1 - 1 - p for p in pool])
                if seen0 > 0:  # churn: new entries against the previous pool, as sets
                    old = {int(p) for p in a0.pool_pos[b] if p >= 0}
                    w["new"] += len(set(pool) - old)
                    w["slots"] += len(pool)
                for i in range(20):
                    if torch.isfinite(sel.tau[b, i]):
                        w["taus"].append(float(sel.tau[b, i]))
                        w["actives"].append(int(sel.n_active[b, i]))
                    w["us"].append(float(sel.u[b, i]) - 0.01 * (seen0 + i))
    stats = diag.read()
    assert [s["layer"] for s in stats] == [0, 1, 2]
    for s, w in zip(stats, want.values()):
        assert s["pool_age_mean"] == pytest.approx(sum(w["ages"]) / len(w["ages"]))
        assert s["pool_age_max"] == w["age_max"]
        assert s["pool_churn"] == pytest.approx(w["new"] / w["slots"])
        assert s["tau"] == pytest.approx(sum(w["taus"]) / len(w["taus"]))
        assert s["active"] == pytest.approx(sum(w["actives"]) / len(w["actives"]))
        mean = sum(w["us"]) / len(w["us"])
        assert s["u_mean"] == pytest.approx(mean)
        assert s["u_std"] == pytest.approx((sum((u - mean) ** 2 for u in w["us"]) / len(w["us"])) ** 0.5, rel=1e-6)
    assert len({(s["tau"], s["u_mean"]) for s in stats}) == 3  # the layers differ: a mix-up of layers would show
    assert diag.read() is None  # read starts over
    assert "churn" in summary_line(stats)


def test_a_model_that_selects_nothing_has_no_statistics():
    model = LM(LMConfig(vocab_size=50, layers=1, d_model=16, heads=2, attention="sw", window=4))
    diag = SelectionDiagnostics(model)
    for before, out in run_chunks(model, [torch.randint(0, 50, (2, 10))]):
        diag.update(before, out)
    assert diag.read() is None


WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which but".split()

RECIPE = """
model: {{style: gpt2, layers: 2, d_model: 32, heads: 2, mlp_ratio: 2.0}}
attention: {attention}
data: {{source: files, path: {corpus}, min_doc_tokens: 200}}
tokenizer: {{vocab_size: 300}}
train: {{steps: 6, chunk_size: 48, batch_docs: 2, lr: 3.0e-3, warmup_steps: 1, device: cpu}}
checkpoint: {{every: 100}}
logging: {{every: 2, progress: false}}
"""


def test_diagnostics_appear_in_metrics_jsonl_every_log_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in range(3):
        rng = random.Random(d)
        (corpus / f"d{d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(1500)))
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(attention="{type: sparsek+sw, topk: 8, window: 8}", corpus=corpus))
    fit(load_recipe(path), run_dir=tmp_path / "run", resume="never")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "selection" in r] == [2, 4, 6]
    for r in records:
        if "selection" in r:
            assert [s["layer"] for s in r["selection"]] == [0, 1]
            for s in r["selection"]:
                assert set(s) == STATS
                assert 0 <= s["pool_age_mean"] <= s["pool_age_max"]
                assert 0 <= s["pool_churn"] <= 1 and s["active"] >= 1
                assert s["u_std"] > 0


def test_the_live_display_shows_a_row_per_layer():
    import io

    from rich.console import Console

    from longtrain.train.metrics import ProgressDisplay, StepStats

    stats = [{"layer": i, "pool_age_mean": 1234.0, "pool_age_max": 4000.0, "pool_churn": 0.05, "tau": 0.5,
              "active": 3.0, "u_mean": 0.0, "u_std": 1.0} for i in range(2)]
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with ProgressDisplay(10, every=5, console=console) as display:
        display.update(StepStats(step=5, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=100, seconds=0.1, selection=stats))
        display.update(StepStats(step=6, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=200, seconds=0.1))
    from rich.text import Text

    text = Text.from_ansi(out.getvalue()).plain
    assert "pool age" in text and "1,234" in text and "selection (2 layers)" in text
