import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from longtrain.data import DataConfig, DocumentStream, TokenizerConfig, prepare_corpus
from longtrain.data.prepare import is_held_out
from longtrain.data.stdlib import stdlib_source

from .corpora import GUTENBERG_VALID, make_text


def prepare(tmp_path, data: DataConfig, vocab_size=300, **kw):
    return prepare_corpus(
        data, TokenizerConfig(vocab_size=vocab_size, **kw), cache_dir=tmp_path / "cache", progress=False,
    )


def test_folder_of_text_files_end_to_end(tmp_path, books):
    corpus = prepare(tmp_path, DataConfig(source="files", path=str(books), min_doc_tokens=600))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["books", "cache"]  # nothing written outside the cache
    assert corpus.vocab_size == corpus.tokenizer.get_vocab_size() <= 300
    assert corpus.tokenizer.id_to_token(corpus.eod_id) == "<|endoftext|>"
    stats = corpus.stats["train"]
    assert stats["docs_read"] == 6 and stats["kept"] + stats["dropped"] == 6 and stats["dropped"] >= 1
    assert len(corpus.valid) == 0
    for i in range(len(corpus.train)):
        doc = corpus.train.doc(i)
        assert doc.dtype == np.int32 and doc[-1] == corpus.eod_id and len(doc) > 600
        assert (doc[:-1] != corpus.eod_id).all()
    # the documents round-trip through the tokenizer (one document per file, sorted)
    texts = {make_text(i + 1, 400 + 200 * i) for i in range(6)}
    assert corpus.tokenizer.decode(corpus.train.doc(0)[:-1].tolist()) in texts


def test_cached_second_load_is_identical_and_faster(tmp_path, books):
    data = DataConfig(source="files", path=str(books), min_doc_tokens=10, valid=0.5)
    t0 = time.perf_counter()
    cold = prepare(tmp_path, data)
    t1 = time.perf_counter()
    warm = prepare(tmp_path, data)
    t2 = time.perf_counter()
    assert not cold.stats["train"]["cache_hit"] and warm.stats["train"]["cache_hit"]
    assert warm.fingerprint == cold.fingerprint and warm.tokenizer.to_str() == cold.tokenizer.to_str()
    for a, b in ((cold.train, warm.train), (cold.valid, warm.valid)):
        assert len(a) == len(b) and all(np.array_equal(a.doc(i), b.doc(i)) for i in range(len(a)))
    assert t2 - t1 < t1 - t0


def test_valid_fraction_holds_out_documents_never_trained_on(tmp_path, books):
    corpus = prepare(tmp_path, DataConfig(source="files", path=str(books), min_doc_tokens=10, valid=0.34))
    assert corpus.valid.source_ids.tolist() == [i for i in range(6) if is_held_out(i, 0.34)] == [2, 5]
    assert set(corpus.train.source_ids.tolist()).isdisjoint(corpus.valid.source_ids.tolist())
    stream = DocumentStream(corpus.train, batch_rows=2, chunk_size=64, seed=0)
    used = {int(corpus.train.source_ids[d]) for _ in range(50) for d in stream.next_chunk().doc_index}
    assert used == {0, 1, 3, 4}


def test_valid_path_jsonl_and_parquet_with_text_field(tmp_path, books):
    rows = [{"body": make_text(100 + i, 300), "id": i} for i in range(3)]
    (tmp_path / "valid.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "train.parquet")
    data = DataConfig(
        source="files", path=str(tmp_path / "*.parquet"), text_field="body", min_doc_tokens=10,
        valid=str(tmp_path / "valid.jsonl"),
    )
    corpus = prepare(tmp_path, data)
    assert len(corpus.train) == 2 and len(corpus.valid) == 3
    assert corpus.tokenizer.decode(corpus.valid.doc(2)[:-1].tolist()) == rows[2]["body"]


def test_changing_a_file_changes_the_cache_key(tmp_path, books):
    data = DataConfig(source="files", path=str(books), min_doc_tokens=10)
    first = prepare(tmp_path, data)
    (books / "book0.txt").write_text(make_text(99, 500))
    second = prepare(tmp_path, data)
    assert second.fingerprint != first.fingerprint and not second.stats["train"]["cache_hit"]


def test_stdlib_source_yields_long_deterministic_documents():
    a, b = stdlib_source(), stdlib_source()
    assert a.fingerprint == b.fingerprint
    docs = list(a.documents())
    assert len(docs) == a.n_docs >= 20
    lengths = sorted(len(d) for d in docs)
    assert lengths[len(lengths) // 2] > 50_000  # median document is long
    assert docs[0].startswith("# ---- file: ")
    assert not any("/test/" in d[:200] or "site-packages" in d[:200] for d in docs)
    assert docs == list(b.documents())


@pytest.mark.skipif(not GUTENBERG_VALID.is_dir(), reason="needs ../shared/data/gutenberg/valid")
def test_books_from_gutenberg_with_a_given_tokenizer(tmp_path, tiny_tokenizer):
    tok_path = tmp_path / "given.json"
    tiny_tokenizer.save(str(tok_path))
    data = DataConfig(source="files", path=str(GUTENBERG_VALID), min_doc_tokens=4096)
    corpus = prepare(tmp_path, data, path=str(tok_path))
    assert corpus.tokenizer.to_str() == tiny_tokenizer.to_str()
    assert len(corpus.train) == len(list(GUTENBERG_VALID.glob("*.txt")))
    assert corpus.train.n_tokens > 1_000_000
    first = corpus.tokenizer.decode(corpus.train.doc(0)[:200].tolist())
    assert first in sorted(GUTENBERG_VALID.glob("*.txt"))[0].read_text()


def test_a_loaded_tokenizer_without_an_end_of_document_token_gets_one(tmp_path, books):
    from tokenizers import models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"the": 0, "[UNK]": 1}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(tmp_path / "plain.json"))
    corpus = prepare(tmp_path, DataConfig(source="files", path=str(books), min_doc_tokens=10), path=str(tmp_path / "plain.json"))
    assert corpus.eod_id == 2 and corpus.vocab_size == 3
    assert corpus.train.doc(0)[-1] == 2 and set(corpus.train.doc(0)[:-1].tolist()) <= {0, 1}
