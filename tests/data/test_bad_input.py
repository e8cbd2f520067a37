"""Each bad input gets a DataError whose message names the problem."""

import json

import numpy as np
import pytest

from longtrain.data import DataConfig, DataError, TokenizerConfig, prepare_corpus
from longtrain.data.sources import files_source

from .corpora import make_text


def prepare(tmp_path, **data):
    tok = data.pop("tokenizer", TokenizerConfig(vocab_size=300))
    cfg = DataConfig(**{"source": "files", "min_doc_tokens": 10, **data})
    return prepare_corpus(cfg, tok, cache_dir=tmp_path / "cache", progress=False)


def test_missing_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-folder")
    with pytest.raises(DataError, match="no-such-folder.*does not exist"):
        prepare(tmp_path, path=missing)
    with pytest.raises(DataError, match="matches no files"):
        prepare(tmp_path, path=str(tmp_path / "*.txt"))
    (tmp_path / "a.txt").write_text(make_text(0, 100))
    with pytest.raises(DataError, match="data.valid .*held-out.*does not exist"):
        prepare(tmp_path, path=str(tmp_path / "a.txt"), valid=str(tmp_path / "held-out"))


def test_folder_without_readable_documents(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a supported type")
    with pytest.raises(DataError, match="No readable documents"):
        prepare(tmp_path, path=str(tmp_path / "empty"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(DataError, match="No readable documents"):
        prepare(tmp_path, path=str(tmp_path / "blank"))


def test_every_document_too_short_says_how_many_and_the_longest(tmp_path, books):
    with pytest.raises(DataError, match=r"All 6 documents .* shorter than data.min_doc_tokens = 100000 .*longest has \d+"):
        prepare(tmp_path, path=str(books), min_doc_tokens=100_000)


def test_jsonl_without_the_text_field_names_field_and_columns(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("\n".join(json.dumps({"body": make_text(i, 50)}) for i in range(3)))
    with pytest.raises(DataError, match=r"no field 'text' \(its fields: body\).*text_field"):
        prepare(tmp_path, path=str(f))


def test_tokenizer_file_that_does_not_load(tmp_path, books):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"this is": "not a tokenizer"}')
    with pytest.raises(DataError, match="tokenizer.json.*does not load"):
        prepare(tmp_path, path=str(books), tokenizer=TokenizerConfig(path=str(bad)))
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path, path=str(books), tokenizer=TokenizerConfig(path=str(tmp_path / "nope.json")))


def test_invalid_utf8_is_replaced_and_counted(tmp_path, capsys):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "good.txt").write_text(make_text(1, 300))
    (folder / "bad.txt").write_bytes(make_text(2, 300).encode() + b"\xff\xfe tail \xc3")
    assert files_source(str(folder)).invalid_utf8 == 3
    corpus = prepare(tmp_path, path=str(folder))
    assert corpus.stats["train"]["invalid_utf8_bytes"] == 3
    assert len(corpus.train) == 2
    assert "\ufffd" in corpus.tokenizer.decode(corpus.train.doc(0).tolist())  # bad.txt sorts first
    assert "3 bytes of invalid UTF-8" in capsys.readouterr().err


def test_valid_fraction_that_leaves_no_validation_documents(tmp_path, books):
    with pytest.raises(DataError, match="0 for validation"):
        prepare(tmp_path, path=str(books), valid=0.1)


def test_hub_data_set_that_cannot_be_reached(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # never touch the network in tests
    with pytest.raises(DataError, match="no-such-user/no-such-set.*Without a network"):
        prepare(tmp_path, source="hub", name="no-such-user/no-such-set")


def test_a_file_that_is_mostly_not_text_is_refused(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "book.txt").write_text(make_text(1, 300))
    noise = np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes()
    (folder / "random.txt").write_bytes(noise)  # random bytes named .txt
    with pytest.raises(DataError, match=r"random.txt is mostly not text: .* \(4\d%\) are not UTF-8 \(at most 10%"):
        prepare(tmp_path, path=str(folder))
    # Just under the threshold still trains (with the count reported): Latin-1 accents, say.
    text = make_text(2, 300).encode()
    (folder / "random.txt").write_bytes(text + b"\xe9" * int(0.1 * len(text)))
    assert prepare(tmp_path, path=str(folder)).stats["train"]["invalid_utf8_bytes"] == int(0.1 * len(text))


def test_on_bad_file_skip_leaves_bad_files_out_and_lists_them(tmp_path, monkeypatch):
    """A binary .txt and a .jsonl that does not parse: `error` stops naming the file and the setting,
    `skip` trains on the rest and the summary lists both (also on a token-cache hit)."""
    from tests.train.tiny import RECIPE, cli, write_corpus

    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path / "cache"))
    write_corpus(tmp_path / "corpus")
    (tmp_path / "corpus/blob.txt").write_bytes(bytes(range(128, 256)) * 64)
    (tmp_path / "corpus/rows.jsonl").write_text('{"text": "' + "the river " * 400 + '"}\n{"text": broken\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(corpus=tmp_path / "corpus", steps=2, every=2))
    refused = cli("fit", recipe, "--run-dir", tmp_path / "run", "--dry-run")
    msg = " ".join(refused.output.split())
    assert refused.exit_code == 1 and "blob.txt is mostly not text" in msg and "data.on_bad_file: skip" in msg
    for _ in range(2):  # the second reads the token cache
        r = cli("fit", recipe, "--run-dir", tmp_path / "run", "--dry-run", "--set", "data.on_bad_file=skip")
        assert r.exit_code == 0, r.output
        [line] = [x for x in r.output.splitlines() if "skipped (data.on_bad_file: skip)" in x]
        assert line.startswith("warning: 2 files of the train data skipped") and "blob.txt is mostly not text" in line
        assert "rows.jsonl does not parse" in line
        assert "data: 4 training documents" in r.output  # the five good ones, one held out
