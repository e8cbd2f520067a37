"""benchmarks/recall_errors.py: each query's error is classified as the module doc says (on a document whose
predictions are written by hand), and the script runs end to end on a real run (a 2-step recall-circuit fit)."""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_the_errors_are_classified_as_documented(tmp_path):
    import recall_errors as re_
    from longtrain.data import DataConfig, TokenizerConfig, prepare_corpus
    from longtrain.data.config import RecallConfig
    from longtrain.data.recall import Symbols, generate_document, word_filler
    from longtrain.eval.recall import value_positions

    cfg = RecallConfig(docs=12, doc_tokens=512, facts=6, min_distance=20, max_distance=300, key_length=2,
                       value_length=2, seed=4)
    corpus = prepare_corpus(DataConfig(source="recall", valid=0.25, recall=cfg.model_dump()),
                            TokenizerConfig(vocab_size=300), cache_dir=tmp_path, progress=False)
    tok = corpus.tokenizer
    doc = generate_document(cfg, Symbols.of(tok), word_filler(tok, cfg.doc_tokens - 1), cfg.seed, 0)
    pos = value_positions(cfg, doc)  # [F, 2]
    pred = np.full(len(doc.tokens) + 1, -1, dtype=np.int64)
    for f in range(cfg.facts):
        pred[pos[f] - 1] = doc.values[f]  # every query right ...
    order = np.argsort(doc.query_pos)
    last, first = order[-1], order[0]  # ... but the last query gets the first-queried fact's value
    earlier = [g for g in range(cfg.facts) if doc.fact_pos[g] < doc.query_pos[last] and g != last
               and tuple(doc.values[g]) != tuple(doc.values[last])]
    pred[pos[last] - 1] = doc.values[earlier[0]]
    wrong = (doc.values[first][0] + 1 - Symbols.of(tok).values[0]) % 10 + Symbols.of(tok).values[0]
    pred[pos[first][0] - 1] = wrong  # and the first-queried one a wrong first digit
    counts = re_.classify(cfg, [doc], [pred], far=0)
    keys_share = any(a == b for a, b in zip(doc.tokens[doc.fact_pos[earlier[0]] + 2 : doc.fact_pos[earlier[0]] + 4],
                                            doc.tokens[doc.fact_pos[last] + 2 : doc.fact_pos[last] + 4]))
    other = "another fact, keys share a letter" if keys_share else "another fact, keys share none"
    assert counts == {"correct": cfg.facts - 2, other: 1, "digits -x": 1}
    by_distance = re_.first_token_by_distance(cfg, [doc], [pred], bin_tokens=1000)
    assert by_distance == {0: ((cfg.facts - 2) / cfg.facts, cfg.facts)}  # the two wrong first tokens


def test_the_script_runs_on_a_real_recall_run(tmp_path):
    import recall_errors as re_
    from typer.testing import CliRunner

    from longtrain.cli.app import app

    run = tmp_path / "run"
    sets = ["train.steps=2", "model.layers=1", "model.d_model=32", "model.heads=2", "train.batch_docs=2",
            "data.recall.docs=200", "train.device=cpu", "checkpoint.every=2", "train.valid_every=0", "train.compile=false"]
    res = CliRunner().invoke(app, ["fit", "recall-circuit", "--run-dir", str(run), *[x for s in sets for x in ("--set", s)]])
    assert res.exit_code == 0, res.output[-2000:]
    out = re_.analyse(run, docs=4, far=32, bin_tokens=64)
    assert out["step"] == 2 and out["queries"] > 0
    assert abs(sum(out["share"].values()) - 1.0) < 1e-9
    assert sum(n for _, n in out["first_token_by_distance"].values()) == 4 * 12  # every query of 4 documents
