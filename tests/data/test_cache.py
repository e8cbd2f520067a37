import json
import threading
import time

import numpy as np

from longtrain.data.cache import cached_file, cached_tokens, open_entry


def build_three(writer, calls=None):
    if calls is not None:
        calls.append(1)
        time.sleep(0.2)  # long enough for a second builder to arrive while the first holds the lock
    for i, n in enumerate([5, 3, 8]):
        writer.add(i, np.arange(n, dtype=np.int32) + 10 * i)
    return {"note": "three"}


def test_second_open_is_a_hit_with_identical_tokens(tmp_path):
    docs, manifest, hit = cached_tokens(tmp_path, "k", build_three)
    assert not hit and manifest["n_docs"] == 3 and manifest["note"] == "three"
    again, _, hit = cached_tokens(tmp_path, "k", lambda w: 1 / 0)  # a hit never builds
    assert hit
    assert [again.doc(i).tolist() for i in range(3)] == [docs.doc(i).tolist() for i in range(3)]
    assert again.doc(1).tolist() == [10, 11, 12] and again.n_tokens == 16


def test_corrupt_entries_are_detected_and_rebuilt(tmp_path):
    cached_tokens(tmp_path, "k", build_three)
    tokens = tmp_path / "k" / "tokens.bin"
    raw = bytearray(tokens.read_bytes())
    raw[5] ^= 0xFF  # same size, different content: only the checksum sees it
    tokens.write_bytes(bytes(raw))
    assert open_entry(tmp_path / "k") is None
    docs, _, hit = cached_tokens(tmp_path, "k", build_three)
    assert not hit and docs.doc(0).tolist() == [0, 1, 2, 3, 4]

    tokens.write_bytes(tokens.read_bytes()[:-4])  # truncated
    assert cached_tokens(tmp_path, "k", build_three)[2] is False
    (tmp_path / "k" / "manifest.json").write_text("{not json")
    assert cached_tokens(tmp_path, "k", build_three)[2] is False
    assert json.loads((tmp_path / "k" / "manifest.json").read_text())["n_tokens"] == 16
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_two_runs_at_once_build_once(tmp_path):
    calls, results = [], []
    runs = [
        threading.Thread(target=lambda: results.append(cached_tokens(tmp_path, "k", lambda w: build_three(w, calls))))
        for _ in range(2)
    ]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert len(calls) == 1
    assert sorted(hit for _, _, hit in results) == [False, True]
    assert results[0][0].doc(2).tolist() == results[1][0].doc(2).tolist()


def test_cached_file_makes_once(tmp_path):
    made = []
    make = lambda: made.append(1) or "content"  # noqa: E731
    assert cached_file(tmp_path / "t" / "a.json", make) == "content"
    assert cached_file(tmp_path / "t" / "a.json", make) == "content"
    assert made == [1]


def test_cache_list_and_clear_through_the_cli(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from longtrain.cli import app
    from longtrain.data import DataConfig, TokenizerConfig, prepare_corpus

    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path / "cache"))
    run = lambda *args, **kw: CliRunner().invoke(app, ["cache", *args], **kw)  # noqa: E731
    assert "is empty" in run("list").output
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"d{i}.txt").write_text(f"document {i}: " + "the river and the house " * 200)
    prepare_corpus(DataConfig(source="files", path=str(tmp_path / "docs"), min_doc_tokens=10),
                   TokenizerConfig(vocab_size=300), progress=False)
    listed = run("list")
    assert listed.exit_code == 0, listed.output
    assert "3 docs" in listed.output and "tokens" in listed.output and "tokenizer" in listed.output
    assert "2 items in" in listed.output and str(tmp_path / "cache") in listed.output
    refused = run("clear")  # not a terminal: asks for --yes instead of deleting
    assert refused.exit_code == 2 and "--yes" in refused.output and "2 items" in run("list").output
    cleared = run("clear", "--yes")
    assert cleared.exit_code == 0 and "deleted 2 items" in cleared.output
    assert "is empty" in run("list").output
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
