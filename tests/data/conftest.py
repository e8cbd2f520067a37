"""Fixtures: small generated corpora and a tiny tokenizer, so data tests run in seconds."""

from pathlib import Path

import pytest

from longtrain.data.tokenizer import train_bpe

from .corpora import make_text


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_bpe([make_text(0, 5000)], vocab_size=300)


@pytest.fixture
def books(tmp_path) -> Path:
    """A folder of 6 text documents of 400-1500 words, one in a subfolder."""
    root = tmp_path / "books"
    (root / "more").mkdir(parents=True)
    for i in range(6):
        folder = root / "more" if i == 5 else root
        (folder / f"book{i}.txt").write_text(make_text(i + 1, 400 + 200 * i))
    return root
