"""`longtrain cache clear` deletes only with consent: asked on a terminal, --yes elsewhere."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from longtrain.cli import app


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A token cache holding one tokenized corpus and its tokenizer (2 items)."""
    from longtrain.data import DataConfig, TokenizerConfig, prepare_corpus

    folder = tmp_path / "cache"
    monkeypatch.setenv("LONGTRAIN_CACHE", str(folder))
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"d{i}.txt").write_text(f"document {i}: " + "the river and the house " * 200)
    prepare_corpus(DataConfig(source="files", path=str(tmp_path / "docs"), min_doc_tokens=10),
                   TokenizerConfig(vocab_size=300), progress=False)
    return folder


def run(*args, **kw):
    return CliRunner().invoke(app, ["cache", *args], **kw)


def files(folder) -> list:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_without_a_terminal_it_deletes_nothing_and_asks_for_yes(cache):
    kept = files(cache)
    res = run("clear")  # CliRunner's stdin is no terminal, as in a script or a pipe
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "deleted nothing: this would delete 2 items" in text and "stdin is not a terminal, so it cannot ask" in text
    assert "run `longtrain cache clear --yes`" in text and "without asking" not in text
    assert files(cache) == kept
    res = run("clear", "--yes")
    assert res.exit_code == 0 and "deleted 2 items" in res.output, res.output
    assert not files(cache) and "is empty" in run("list").output


def test_on_a_terminal_it_asks_first(cache, monkeypatch):
    import longtrain.cli.cache as cache_verb

    monkeypatch.setattr(cache_verb, "can_ask", lambda: True)
    kept = files(cache)
    res = run("clear", input="n\n")
    assert res.exit_code == 1 and "delete 2 items" in res.output and "deleted nothing" in res.output, res.output
    assert files(cache) == kept
    res = run("clear", input="y\n")
    assert res.exit_code == 0 and "deleted 2 items" in res.output, res.output
    assert not files(cache)
