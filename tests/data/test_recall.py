"""The recall data source: deterministic documents, facts queried at the requested distances."""

import numpy as np
import pytest

from longtrain.data import DataConfig, DataError, DocumentStream, TokenizerConfig, prepare_corpus
from longtrain.data.config import RecallConfig
from longtrain.data.recall import (
    EVAL_STREAM,
    Symbols,
    chance_level,
    generate_document,
    generate_documents,
    line_length,
    make_filler,
    value_offset,
    word_filler,
)

from .corpora import make_text

CFG = dict(docs=12, doc_tokens=512, facts=6, min_distance=20, max_distance=300, key_length=2, value_length=3, seed=4)


def prepare(tmp_path, valid=0.25, cache="cache", **over):
    data = DataConfig(source="recall", valid=valid, recall={**CFG, **over})
    return prepare_corpus(data, TokenizerConfig(vocab_size=300), cache_dir=tmp_path / cache, progress=False)


def test_documents_are_deterministic_and_generated_as_they_are_read(tmp_path, monkeypatch):
    from longtrain.data import recall

    made = []
    real = recall.generate_document
    monkeypatch.setattr(recall, "generate_document", lambda *a, **k: made.append(a[4]) or real(*a, **k))
    first = prepare(tmp_path, docs=4000)
    assert made == [0] and len(first.train) + len(first.valid) == 4000  # only the first, as a check
    assert not any((tmp_path / "cache").glob("*/tokens.bin.*")) and len(list((tmp_path / "cache").iterdir())) <= 4
    first.train.doc(7), first.train.doc(7), first.valid.doc(0)
    assert made == [0, int(first.train.source_ids[7]), int(first.valid.source_ids[0])]  # once each, when read
    first = prepare(tmp_path)
    rebuilt = prepare(tmp_path, cache="other-cache")  # the same documents from another cache
    for a, b in ((first.train, rebuilt.train), (first.valid, rebuilt.valid)):
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            np.testing.assert_array_equal(a.doc(i), b.doc(i))
    assert len(first.train) + len(first.valid) == CFG["docs"]
    assert set(first.train.lengths) == {CFG["doc_tokens"]}  # EOD included: whole chunks of 256
    other = prepare(tmp_path, seed=5)
    assert not np.array_equal(other.train.doc(0), first.train.doc(0))


def test_queries_lie_at_the_requested_distances(tmp_path):
    corpus = prepare(tmp_path)
    cfg, tok = RecallConfig(**CFG), corpus.tokenizer
    sym = Symbols.of(tok)
    filler = word_filler(tok, cfg.doc_tokens - 1)
    line, v0 = line_length(cfg), value_offset(cfg)
    distances = []
    for i in range(40):
        doc = generate_document(cfg, sym, filler, cfg.seed, i)
        assert len(doc.tokens) == cfg.doc_tokens - 1
        d = doc.distances
        assert ((d >= cfg.min_distance) & (d <= cfg.max_distance)).all()
        distances.append(d)
        starts = np.concatenate([doc.fact_pos, doc.query_pos])
        spans = np.sort(starts)
        assert (np.diff(spans) >= line).all() and spans[-1] + line <= len(doc.tokens)  # lines never overlap
        keys = set()
        for f, q, value in zip(doc.fact_pos, doc.query_pos, doc.values):
            fact, query = tok.decode(doc.tokens[f : f + line].tolist()), tok.decode(doc.tokens[q : q + line].tolist())
            assert fact[:2] == "\n@" and query[:2] == "\n?" and fact[2:] == query[2:]
            key, val = fact[2:-1].split("=")
            assert len(key) == cfg.key_length and key.isalpha() and len(val) == cfg.value_length and val.isdigit()
            np.testing.assert_array_equal(doc.tokens[q + v0 : q + v0 + cfg.value_length], value)
            keys.add(key)
        assert len(keys) == cfg.facts  # distinct keys: a query has one answer
    # Log-uniform: each half of the log-range gets about half of the queries.
    d = np.concatenate(distances)
    mid = np.sqrt(cfg.min_distance * cfg.max_distance)
    assert 0.35 < (d < mid).mean() < 0.65


def test_training_documents_are_the_generated_ones_and_eval_documents_differ(tmp_path):
    corpus = prepare(tmp_path, valid=None)
    cfg, tok = RecallConfig(**CFG), corpus.tokenizer
    filler = word_filler(tok, cfg.doc_tokens - 1)
    doc = generate_document(cfg, Symbols.of(tok), filler, cfg.seed, 0)
    all_docs = [corpus.train.doc(i) for i in range(len(corpus.train))] + [corpus.valid.doc(i) for i in range(len(corpus.valid))]
    assert any(np.array_equal(d[:-1], doc.tokens) and d[-1] == corpus.eod_id for d in all_docs)
    evals, _ = generate_documents(cfg, tok, filler, seed=cfg.seed, n_docs=3, stream=EVAL_STREAM)
    assert not any(np.array_equal(evals.doc(0), d) for d in all_docs)


def test_stream_reads_recall_documents_in_whole_chunks(tmp_path):
    corpus = prepare(tmp_path)
    stream = DocumentStream(corpus.train, batch_rows=2, chunk_size=256, seed=0)
    for _ in range(6):
        chunk = stream.next_chunk()
        assert (chunk.lengths == 256).all()


def test_files_filler_and_a_filler_too_short(tmp_path, monkeypatch):
    import longtrain.data.sources

    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"b{i}.txt").write_text(make_text(i, 900))
    opened = []  # every files source opened reads (and hashes) every byte of the books
    files_source = longtrain.data.sources.files_source
    monkeypatch.setattr("longtrain.data.recall.files_source", lambda *a, **k: opened.append(a) or files_source(*a, **k))
    data = DataConfig(source="recall", path=str(books), recall={**CFG, "filler": "files", "docs": 4})
    corpus = prepare_corpus(data, TokenizerConfig(vocab_size=300), cache_dir=tmp_path / "c", progress=False)
    assert len(opened) == 1  # the filler books are read once, for the tokenizer and the filler both
    assert len(corpus.train) == 4
    text = corpus.tokenizer.decode(corpus.train.doc(0).tolist())
    assert "@" in text and "?" in text and " the " in text
    long = DataConfig(source="recall", path=str(books), recall={**CFG, "filler": "files", "doc_tokens": 50_000, "max_distance": 300})
    with pytest.raises(DataError, match="No filler document has 49999 tokens"):
        make_filler(long, corpus.tokenizer, tmp_path / "c", progress=False)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(recall={"min_distance": 5}), "shorter than a fact line"),
        (dict(recall={"max_distance": 5000, "doc_tokens": 4096}), "does not fit"),
        (dict(recall={"min_distance": 900, "max_distance": 800}), "exceeds"),
        (dict(recall={"filler": "files"}), "needs data.path"),
        (dict(valid="some/folder"), "must be a fraction"),
        (dict(recall={"key_letters": 3, "key_length": 2, "facts": 10}), "fewer than recall.facts"),
        (dict(path="books", recall={"filler": "files", "filler_words": 3}), "applies to filler: words"),
    ],
)
def test_bad_recall_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(source="recall", **settings)


def test_recall_settings_need_the_recall_source():
    with pytest.raises(ValueError, match="use data.source: recall"):
        DataConfig(source="stdlib", recall={"facts": 3})


def test_too_many_facts_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="Could not place 40 facts"):
        prepare(tmp_path, facts=40)


def test_chance_level():
    assert chance_level(RecallConfig(value_length=3)) == {"exact": pytest.approx(1e-3), "symbol": 0.1}


def test_a_tokenizer_without_single_symbol_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(DataError, match="to be one token"):
        Symbols.of(tok)


def test_key_letters_draws_keys_from_the_first_letters(tmp_path):
    corpus = prepare(tmp_path)
    tok = corpus.tokenizer
    sym = Symbols.of(tok)
    filler = word_filler(tok, CFG["doc_tokens"] - 1)
    v0 = value_offset(RecallConfig(**CFG))
    few = RecallConfig(**{**CFG, "key_letters": 3})
    letters = set()
    for i in range(20):
        doc = generate_document(few, sym, filler, few.seed, i)
        keys = [tuple(doc.tokens[p + 2 : p + v0 - 1]) for p in doc.fact_pos]
        assert len(set(keys)) == few.facts  # distinct within a document
        letters.update(t for key in keys for t in key)
    assert letters == set(sym.keys[:3].tolist())  # a, b, c and nothing else
    # the default (26) makes the facts it made before key_letters existed (pinned from then), so runs resume
    # on the same data
    doc = generate_document(RecallConfig(**CFG), sym, filler, 4, 0)
    assert [tok.decode(doc.tokens[p + 2 : p + 9].tolist()) for p in doc.fact_pos] == [
        "ge=481\n", "cn=622\n", "vj=452\n", "ie=957\n", "tp=421\n", "qa=013\n"]
    assert doc.fact_pos.tolist() == [0, 20, 36, 207, 366, 435] and doc.query_pos.tolist() == [224, 53, 142, 289, 417, 486]


def test_filler_words_draws_the_filler_from_the_first_words(tmp_path):
    from longtrain.data.recall import FILLER_WORDS

    corpus = prepare(tmp_path, filler_words=2)
    tok = corpus.tokenizer
    cfg = RecallConfig(**{**CFG, "filler_words": 2})
    doc = generate_document(cfg, Symbols.of(tok), word_filler(tok, cfg.doc_tokens - 1, 2), cfg.seed, 0)
    facts = np.zeros(len(doc.tokens), dtype=bool)
    for p in (*doc.fact_pos, *doc.query_pos):
        facts[p : p + line_length(cfg)] = True
    allowed = {t for w in FILLER_WORDS[:2] for t in tok.encode(" " + w, add_special_tokens=False).ids}
    assert set(doc.tokens[~facts].tolist()) <= allowed  # (a cut word at the start may leave part of one)
    assert len(tok.get_vocab()) > 100  # the tokenizer still learned the whole word list
    assert not np.array_equal(corpus.train.doc(0), prepare(tmp_path, cache="c2").train.doc(0))
