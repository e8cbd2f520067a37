"""Generated documents for the data tests."""

from pathlib import Path

import numpy as np

from longtrain.data.cache import TokenDocs

GUTENBERG_VALID = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gutenberg" / "valid"
WORDS = "the a of and to in is was he she it that his her for with on as at by long story old ship sea".split()


def make_text(seed: int, n_words: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n_words)) + ".\n"


def synthetic_docs(lengths) -> TokenDocs:
    """Documents whose tokens encode (document, position): doc d token p = d*100000 + p."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    tokens = np.concatenate([d * 100_000 + np.arange(n) for d, n in enumerate(lengths)]).astype(np.int32)
    return TokenDocs(tokens, starts, ends, np.arange(len(lengths)))
