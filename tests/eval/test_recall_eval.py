"""`measure_recall`: exact match per distance bucket, checked against models whose memory is known.

Two stand-in models read the documents chunk by chunk through a cache, as the trainer does:
a perfect memory (keeps every token) and one that only remembers the last `reach` tokens. The
first must recall every query, the second exactly the queries whose fact lies within its reach, so
a wrong position, distance or bucket in the measurement shows up as a wrong accuracy.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longtrain.data.config import DataConfig, RecallConfig, TokenizerConfig
from longtrain.data.recall import FILLER_WORDS, Symbols, generate_documents, make_filler, value_offset
from longtrain.data.tokenizer import train_bpe
from longtrain.eval.recall import bucket_rows, default_edges, measure_recall, recall_config
from longtrain.model import LM, LMConfig
from longtrain.train.recipe import AttentionConfig, ModelConfig, Recipe, TrainConfig

RECALL = dict(docs=4, doc_tokens=600, facts=8, min_distance=12, max_distance=400, key_length=2, value_length=2, seed=1)


@pytest.fixture(scope="module")
def tok():
    rng = np.random.default_rng(0)
    return train_bpe([" ".join(rng.choice(FILLER_WORDS, 3000))], vocab_size=300)


def recipe(chunk=128, **attention):
    return Recipe(
        model=ModelConfig(layers=2, d_model=32, heads=2),
        attention=AttentionConfig(**(attention or dict(type="sparsek+sw", topk=8, window=8))),
        data=DataConfig(source="recall", recall=RECALL),
        tokenizer=TokenizerConfig(vocab_size=300),
        train=TrainConfig(steps=1, chunk_size=chunk, warmup_steps=0),
    )


@dataclass
class Memory:
    """The stand-in model's cache: the last `reach` tokens of each row."""

    tokens: list[list[int]]
    grows = False  # as a SparseK cache: carried on as it is

    def reset_rows(self, mask):
        return Memory([[] if m else t for t, m in zip(self.tokens, mask.tolist())])


class RecallingModel(torch.nn.Module):
    """Predicts a query's value by finding its fact among the tokens it remembers."""

    def __init__(self, tok, cfg: RecallConfig, reach: int | None):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.sym, self.cfg, self.reach, self.vocab = Symbols.of(tok), cfg, reach, tok.get_vocab_size()
        self.head_rows = 0

    def empty_cache(self, rows, **_):
        return Memory([[] for _ in range(rows)])

    def head(self, h):
        """The hidden states are the logits already; counts the positions it is asked about."""
        self.head_rows += h.shape[0]
        return h

    def hidden(self, tokens, cache, lengths):
        B, L = tokens.shape
        logits = torch.zeros(B, L, self.vocab)
        new = []
        Lk, Lv, v0 = self.cfg.key_length, self.cfg.value_length, value_offset(self.cfg)
        for b in range(B):
            seen = list(cache.tokens[b])
            for i in range(int(lengths[b])):
                seen.append(int(tokens[b, i]))
                guess = self.sym.values[0]
                # Inside a query line's value: its key sits at a fixed offset back.
                for t in range(Lv):
                    start = len(seen) - v0 - t  # where the query line starts if we predict value token t
                    if start >= 0 and seen[start : start + 2] == [self.sym.newline, self.sym.query]:
                        key = seen[start + 2 : start + 2 + Lk]
                        window = seen if self.reach is None else seen[-self.reach :]
                        for j in range(len(window) - v0 - Lv):  # the fact line with the same key
                            if window[j : j + 2] == [self.sym.newline, self.sym.fact] and window[j + 2 : j + 2 + Lk] == key:
                                guess = window[j + v0 + t]
                logits[b, i, guess] = 1.0
            new.append(seen if self.reach is None else seen[-self.reach :])
        return SimpleNamespace(hidden=logits, cache=Memory(new))


def loaded(tok, model, chunk=128):
    return SimpleNamespace(model=model, recipe=recipe(chunk), tokenizer=tok)


def test_perfect_memory_recalls_everything(tok, tmp_path):
    cfg = RecallConfig(**RECALL)
    model = RecallingModel(tok, cfg, None)
    buckets = measure_recall(loaded(tok, model), docs=4, cache_dir=tmp_path)
    assert [b["start"] for b in buckets] == default_edges(cfg)[:-1] == [12, 24, 48, 96, 192, 384]
    assert model.head_rows == 4 * cfg.facts * cfg.value_length  # only the value positions reach the head
    assert sum(b["trials"] for b in buckets) == 4 * cfg.facts
    assert all(b["accuracy"] == 1.0 and b["symbol_accuracy"] == 1.0 for b in buckets if b["trials"])


def test_a_limited_memory_recalls_exactly_what_it_reaches(tok, tmp_path):
    cfg = RecallConfig(**RECALL)
    reach = 96 + value_offset(cfg) + cfg.value_length  # sees a fact's whole line up to distance 96
    edges = [12, 60, 96, 97, 200, 401]
    buckets = measure_recall(loaded(tok, RecallingModel(tok, cfg, reach), chunk=50), docs=4, edges=edges, cache_dir=tmp_path)
    near = [b for b in buckets if b["end"] <= 97 and b["trials"]]
    far = [b for b in buckets if b["start"] >= 97 and b["trials"]]
    assert near and far
    assert all(b["accuracy"] == 1.0 for b in near)
    # Beyond its reach it guesses '0' for every digit: exact only when the value is all zeros.
    assert all(b["accuracy"] < 0.5 for b in far)


def test_a_real_model_is_read_through_its_cache(tok, tmp_path):
    """A random LM read in chunks of 100 through its cache scores what one unchunked pass per document
    predicts (float32 on the CPU: chunked = unchunked to the bit). Its digit embeddings are scaled up so
    the argmax at a value position is some digit, often the right one: the scores are not all zero."""
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=tok.get_vocab_size(), layers=2, d_model=32, heads=2, topk=8, window=8)).eval()
    with torch.no_grad():
        model.embed.weight[torch.from_numpy(Symbols.of(tok).values).long()] *= 20  # tied head: digits win the argmax
    ckpt = loaded(tok, model, chunk=100)
    buckets = measure_recall(ckpt, docs=3, min_distance=12, max_distance=200, cache_dir=tmp_path)

    data, cfg = recall_config(ckpt.recipe, min_distance=12, max_distance=200)
    filler, _ = make_filler(data, tok, tmp_path, progress=False)
    _, docs = generate_documents(cfg, tok, filler, seed=cfg.seed, n_docs=3)
    dist, exact, symbol = [], [], []
    for doc in docs:
        with torch.no_grad():
            pred = model(torch.from_numpy(doc.tokens).long()[None]).logits[0].argmax(-1).numpy()  # unchunked
        v = doc.query_pos[:, None] + value_offset(cfg) + np.arange(cfg.value_length)[None]  # [F, Lv]
        hit = pred[v - 1] == doc.tokens[v]
        dist += doc.distances.tolist()
        exact += hit.all(1).tolist()
        symbol += hit.mean(1).tolist()
    dist, exact, symbol = np.array(dist), np.array(exact), np.array(symbol)
    assert [b["start"] for b in buckets] == default_edges(cfg)[:-1]
    for b in buckets:
        m = (dist >= b["start"]) & (dist < b["end"])
        assert b["trials"] == m.sum()
        if b["trials"]:
            assert b["accuracy"] == exact[m].mean() and b["symbol_accuracy"] == pytest.approx(symbol[m].mean(), abs=1e-12)
    assert sum(b["trials"] for b in buckets) == 3 * cfg.facts and symbol.mean() > 0


def test_bad_edges_are_refused(tok, tmp_path):
    cfg = RecallConfig(**RECALL)
    with pytest.raises(ValueError, match="increasing"):
        measure_recall(loaded(tok, RecallingModel(tok, cfg, None)), docs=1, edges=[50, 20], cache_dir=tmp_path)


def test_eval_task_recall_through_the_cli(tok, tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from longtrain.cli import app
    from longtrain.train.checkpoint import CheckpointManager
    from longtrain.train.checkpoint import checkpoint_files

    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path / "cache"))
    r = recipe(chunk=128)
    model = LM(LMConfig.from_recipe(r.model, r.attention, vocab_size=tok.get_vocab_size()))
    CheckpointManager(tmp_path / "run", keep=1).save(1, tensors={"model": model.state_dict()}, meta={}, files=checkpoint_files(r, tok))
    out = tmp_path / "e.json"
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "run"), "--task", "recall", "--docs", "2", "--recall-scale", "2",
                                   "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    entry = json.loads(out.read_text())["results"][0]["recall"]
    assert entry["settings"]["doc_tokens"] == 1200 and entry["settings"]["facts"] == 16
    assert entry["chance"]["exact"] == pytest.approx(0.01)
    assert sum(b["trials"] for b in entry["buckets"]) == 2 * 16
    bad = CliRunner().invoke(app, ["eval", str(tmp_path / "run"), "--task", "recall", "--recall-max-distance", "5000"])
    assert bad.exit_code == 2 and "does not fit" in " ".join(bad.output.split())


def test_side_by_side_rows_line_up_for_other_distance_ranges():
    """recall-circuit (8..256) beside recall-sparsek (16..2048): one row per doubling range."""
    def rows(lo, hi):
        edges = default_edges(RecallConfig(**{**RECALL, "doc_tokens": 4096, "min_distance": lo, "max_distance": hi}))
        buckets = [{"start": a, "end": b, "trials": 4, "accuracy": 0.5} for a, b in zip(edges, edges[1:])]
        return dict(bucket_rows(buckets, budget=8))

    circuit, sparsek = rows(8, 256), rows(16, 2048)
    assert set(circuit) & set(sparsek) == {f"recall at {s:,}–{2 * s - 1:,}" for s in (16, 32, 64, 128)}
    assert circuit["recall at 128–255"] == "0.500  (4 queries, to 256) ›16(k+w)"
    assert sparsek["recall at 128–255"] == "0.500  (4 queries) ›16(k+w)"
    assert sparsek["recall at 1,024–2,047"] == "0.500  (4 queries, to 2,048) ›16(k+w)"
