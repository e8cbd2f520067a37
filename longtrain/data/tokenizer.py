"""Tokenizers through the `tokenizers` library: load a tokenizer.json, or
train a byte-level BPE on the training documents.

Every document ends with an end-of-document token (EOD), so the model learns
where documents stop. Training reads a bounded, deterministic sample (an equal
share of the first characters of every document) so it takes seconds even on
a large corpus.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from longtrain.errors import DataError, DataPathMissing

EOD = "<|endoftext|>"
# End-of-document tokens of common pretrained tokenizers, tried in this order.
EOD_CANDIDATES = (EOD, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
TRAIN_SAMPLE_CHARS = 16_000_000  # enough for a few-thousand-token vocabulary; ~10 s on 2 cores


def tokenizer_path_problem(path: str | Path) -> str | None:
    """What is wrong with `path` as a tokenizer.path (not there, or a folder), where a relative one was looked for,
    and the `--set` that fixes it; None when it is a file (whether that file loads is load_tokenizer's to say)."""
    p = Path(path).expanduser()
    if p.is_file():
        return None
    where = "" if p.is_absolute() else f" (relative paths are read from the working directory, {Path.cwd()})"
    if p.is_dir():
        inside = p / "tokenizer.json"
        named = f" (--set tokenizer.path={inside})" if inside.is_file() else " (--set tokenizer.path=FILE)"
        return f"tokenizer.path {str(path)!r} is a folder{where}, not a tokenizer.json. Give the file itself{named}"
    return (f"tokenizer.path {str(path)!r} does not exist{where}. Give a tokenizer.json that exists, in the recipe or "
            "with --set tokenizer.path=FILE, or train one on the corpus with --set tokenizer.path=null")


def load_tokenizer(path: str | Path, eod_token: str | None = None) -> Tokenizer:
    """A tokenizer.json; `eod_token` names its end-of-document token (tokenizer.eod_token), else one of
    EOD_CANDIDATES is used, else <|endoftext|> is added. A path that is not there (or a folder): DataPathMissing
    (exit 2); a file that does not load, or lacks `eod_token`: DataError (exit 1)."""
    p = Path(path).expanduser()
    problem = tokenizer_path_problem(path)
    if problem is not None:
        raise DataPathMissing(problem)
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception with a serde message
        raise DataError(
            f"The tokenizer file {str(path)!r} does not load ({e}). "
            "It must be a tokenizer.json saved by the `tokenizers` library; or set tokenizer.path: null to train one."
        ) from e
    if eod_token is not None:
        if tok.token_to_id(eod_token) is None:
            raise DataError(f"tokenizer.eod_token {eod_token!r} is not a token of {str(path)!r}; name one of its tokens, or null")
        tok.longtrain_eod = eod_token  # read by eod_id and tokenizer_hash
    elif eod_id(tok) is None:
        # A tokenizer without one gets ours, as a special token at the end of its vocabulary.
        tok.add_special_tokens([EOD])
    return tok


def tokenizer_hash(tok: Tokenizer) -> str:
    """A hash of the whole tokenizer (vocabulary, merges, pre-tokenizer): part of every token cache key."""
    named = getattr(tok, "longtrain_eod", None)  # another end-of-document token: other token streams
    return hashlib.blake2b((tok.to_str() + (f"\0{named}" if named else "")).encode(), digest_size=16).hexdigest()


def eod_id(tok: Tokenizer) -> int | None:
    named = getattr(tok, "longtrain_eod", None)  # tokenizer.eod_token, set by load_tokenizer
    for name in (named,) if named else EOD_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def sample_for_training(
    docs: Iterable[str], n_docs: int | None, budget: int = TRAIN_SAMPLE_CHARS
) -> Iterator[str]:
    """The first budget/n_docs characters of each document, in 64k-char pieces.

    With an unknown number of documents, the first 256k characters of each
    until the budget is spent.
    """
    share = max(budget // n_docs, 1) if n_docs else 262_144
    used = 0
    for text in docs:
        head = text[: min(share, budget - used)]
        used += len(head)
        for i in range(0, len(head), 65536):
            yield head[i : i + 65536]
        if used >= budget:
            return


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) with the EOD special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown token
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
