"""`prepare_corpus`: from the recipe's `data:` and `tokenizer:` sections to
memory-mapped token documents ready for `DocumentStream`.

Steps: read the source, load or train the tokenizer (trained on training
documents only; the trained file is cached by corpus), tokenize through the
token cache with a progress bar, drop documents shorter than
`min_doc_tokens`, split train/valid. Nothing is written outside the cache: the
trainer writes the run's `tokenizer.json` once it has decided to run.

The validation fraction takes evenly spaced documents of the source order
(every 1/f-th), chosen before tokenizing, so the tokenizer never sees them
and the split is the same for every seed: validation numbers of two runs on
one corpus compare.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from tokenizers import Tokenizer

from longtrain.errors import DataError

from .cache import EntryWriter, TokenDocs, cached_file, cached_tokens, default_cache_dir
from .config import DataConfig, TokenizerConfig
from .sources import Source, files_source, load_source
from .tokenizer import TRAIN_SAMPLE_CHARS, eod_id, load_tokenizer, sample_for_training, tokenizer_hash, train_bpe

BATCH_CHARS = 1_000_000  # characters per encode_batch call: ~100 MB of encodings at most
PIECE_CHARS = 65_536  # long documents are encoded in pieces of about this size, in parallel
_CUT = re.compile(r"(?<=\S\n)(?=\S)")


@dataclass
class PreparedCorpus:
    tokenizer: Tokenizer
    eod_id: int
    vocab_size: int
    train: TokenDocs
    valid: TokenDocs  # empty when the recipe sets no validation data
    fingerprint: str  # corpus + tokenizer + min_doc_tokens + split; checkpoints store it
    stats: dict = field(default_factory=dict)  # per split: read/kept/dropped counts, cache hit, seconds


def is_held_out(i: int, fraction: float) -> bool:
    """Document i of the source order is a validation document (every 1/f-th)."""
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def split_held_out(docs: TokenDocs, fraction: float) -> tuple[TokenDocs, TokenDocs]:
    """(train, valid): the documents whose source index `is_held_out` go to valid."""
    held = np.array([is_held_out(int(i), fraction) for i in docs.source_ids], dtype=bool)
    return docs.subset(np.flatnonzero(~held)), docs.subset(np.flatnonzero(held))


def corpus_documents(
    data: DataConfig, tok: Tokenizer, cache_dir: Path, progress: bool = True, *, source: Source | None = None
) -> tuple[TokenDocs, dict]:
    """Every document of the recipe's source in `tok`, before a `data.valid` fraction splits them:
    the source tokenized, or for `recall` the generated documents (not their filler). `fit` and
    `eval` both read them here, so a run's validation documents are the same for both. `source`:
    `load_source(data)` when the caller has it already (opening a files source reads every byte)."""
    if data.source == "recall":
        from .recall import make_filler, recall_documents

        filler, filler_key = make_filler(data, tok, cache_dir, progress, source=source)
        return recall_documents(data, tok, filler, filler_key)
    source = source if source is not None else load_source(data)
    tok_hash = tokenizer_hash(tok)
    docs, stats = tokenize_source(source, tok, data.min_doc_tokens, cache_dir, tok_hash, "train", progress)
    _check_kept(docs, stats, source, data.min_doc_tokens)
    return docs, stats


def prepare_corpus(
    data: DataConfig,
    tokenizer: TokenizerConfig,
    *,
    cache_dir: Path | None = None,
    seed: int = 0,  # noqa: ARG001  accepted from the trainer; the corpus and split never depend on it
    progress: bool = True,
) -> PreparedCorpus:
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    source = load_source(data)  # recall: its filler (the generated documents come below)
    recall = data.source == "recall"
    fraction = data.valid if isinstance(data.valid, float) else None
    valid_source = (
        files_source(data.valid, data.text_field, "data.valid", on_bad_file=data.on_bad_file) if isinstance(data.valid, str) else None
    )

    # recall: the fraction holds out generated documents, not filler, so the tokenizer sees all filler.
    tok = _get_tokenizer(tokenizer, source, None if recall else fraction, cache_dir)
    eod = eod_id(tok)
    tok_hash = tokenizer_hash(tok)

    docs, train_stats = corpus_documents(data, tok, cache_dir, progress, source=source)
    stats = {"train": train_stats}
    train, valid = docs, TokenDocs.empty()
    if fraction is not None:
        train, valid = split_held_out(docs, fraction)
        if len(valid) == 0 or len(train) == 0:
            raise DataError(
                f"data.valid: {fraction} of {len(docs)} kept documents leaves "
                f"{len(train)} for training and {len(valid)} for validation. "
                "Use a fraction that leaves both non-empty, or a path to separate validation documents."
            )
    elif valid_source is not None:
        valid, stats["valid"] = tokenize_source(
            valid_source, tok, data.min_doc_tokens, cache_dir, tok_hash, "valid", progress
        )
        _check_kept(valid, stats["valid"], valid_source, data.min_doc_tokens)

    parts = [train_stats["key"], str(data.valid), stats.get("valid", {}).get("key", "")]
    return PreparedCorpus(
        tokenizer=tok,
        eod_id=eod,
        vocab_size=tok.get_vocab_size(),
        train=train,
        valid=valid,
        fingerprint=hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest(),
        stats=stats,
    )


def _get_tokenizer(cfg: TokenizerConfig, source: Source, fraction: float | None, cache_dir: Path) -> Tokenizer:
    if cfg.path:
        return load_tokenizer(cfg.path, cfg.eod_token)
    # Training is deterministic given its inputs, so the result is cached under their hash.
    key = f"{source.fingerprint}:{cfg.vocab_size}:{fraction}:{TRAIN_SAMPLE_CHARS}"
    name = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def train() -> str:
        docs = (t for i, t in enumerate(source.documents()) if fraction is None or not is_held_out(i, fraction))
        n = source.n_docs
        if n and fraction:
            n -= math.floor(n * fraction)  # the held-out count among the first n
        return train_bpe(sample_for_training(docs, n), cfg.vocab_size).to_str()

    return Tokenizer.from_str(cached_file(cache_dir / "tokenizers" / f"{name}.json", train))


def _check_kept(docs: TokenDocs, stats: dict, source: Source, min_doc_tokens: int) -> None:
    if stats["docs_read"] == 0:
        raise DataError(f"No readable documents in {source.description}: every document is empty.")
    if len(docs) == 0:
        raise DataError(
            f"All {stats['dropped']} documents of {source.description} are shorter than "
            f"data.min_doc_tokens = {min_doc_tokens} tokens (the longest has {stats['longest_dropped']}). "
            "Lower data.min_doc_tokens or use longer documents."
        )


def tokenize_source(
    source: Source,
    tok: Tokenizer,
    min_doc_tokens: int,
    cache_dir: Path,
    tok_hash: str,
    label: str,
    progress: bool = True,
) -> tuple[TokenDocs, dict]:
    """All documents of `source` with at least `min_doc_tokens` tokens, through the cache."""
    key = hashlib.blake2b(
        f"{source.fingerprint}:{tok_hash}:{min_doc_tokens}".encode(), digest_size=16
    ).hexdigest()
    t0 = time.perf_counter()

    def build(writer: EntryWriter) -> dict:
        read, dropped, longest_dropped = 0, 0, 0
        eod = eod_id(tok)
        with _TokenizeProgress(progress, label, source.total_bytes) as (bar, task):
            for source_id, ids in _encode(source.documents(), tok, bar, task):
                read += 1
                if len(ids) < min_doc_tokens:
                    dropped += 1
                    longest_dropped = max(longest_dropped, len(ids))
                else:
                    writer.add(source_id, np.append(ids, np.int32(eod)))
            if source.total_bytes:  # the bar advances by characters; bytes may be more
                bar.update(task, completed=source.total_bytes)
        return {
            "source": source.description,
            "docs_read": read,
            "dropped": dropped,
            "longest_dropped": longest_dropped,
            "invalid_utf8_bytes": source.invalid_utf8,
            "min_doc_tokens": min_doc_tokens,
            **({"skipped": [list(s) for s in source.skipped]} if source.skipped else {}),  # data.on_bad_file skip
        }

    docs, manifest, hit = cached_tokens(cache_dir, key, build)
    stats = {k: manifest[k] for k in ("docs_read", "dropped", "longest_dropped", "invalid_utf8_bytes")}
    stats.update(key=key, kept=len(docs), tokens=docs.n_tokens, cache_hit=hit, seconds=time.perf_counter() - t0,
                 skipped=[tuple(s) for s in manifest.get("skipped", [])])
    if source.invalid_utf8:
        Console(stderr=True).print(
            f"{label}: {source.invalid_utf8} bytes of invalid UTF-8 in {source.description} were replaced by U+FFFD.",
            style="yellow", markup=False, soft_wrap=True,
        )
    return docs, stats


def splits_exactly(tok: Tokenizer) -> bool:
    """Whether `split_pieces` keeps this tokenizer's output exact: a byte-level
    pre-tokenizer with its GPT-2 regex and no normalizer (as `train_bpe` makes)."""
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    return spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def split_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` in pieces of about `size` characters, cut only where a line
    starts with a non-space after a line that ends in one ("x\n|y"). The
    byte-level regex ends a pre-token at such a newline whatever follows, so
    encoding the pieces gives exactly the tokens of the whole text; the
    pieces of one long document then encode in parallel, in bounded memory.
    """
    pieces, start = [], 0
    while len(text) - start > size and (cut := _CUT.search(text, start + size)):
        pieces.append(text[start : cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def _encode(texts: Iterator[str], tok: Tokenizer, bar: Progress, task) -> Iterator[tuple[int, np.ndarray]]:
    """(source index, token ids) for every document, encoding ~BATCH_CHARS at a time."""
    split = split_pieces if splits_exactly(tok) else lambda text: [text]
    t0, n_tokens = time.perf_counter(), 0
    parts: list[np.ndarray] = []  # ids of the current document's pieces so far
    batch: list[tuple[int, str, bool]] = []  # (document, piece, last piece of its document)

    def flush() -> Iterator[tuple[int, np.ndarray]]:
        nonlocal n_tokens
        encodings = tok.encode_batch_fast([piece for _, piece, _ in batch], add_special_tokens=False)
        for (doc, piece, last), enc in zip(batch, encodings):
            parts.append(np.array(enc.ids, dtype=np.int32))
            n_tokens += len(parts[-1])
            bar.update(task, advance=len(piece), tokens=n_tokens, rate=n_tokens / (time.perf_counter() - t0))
            if last:
                bar.update(task, docs=doc + 1)
                yield doc, np.concatenate(parts)
                parts.clear()
        batch.clear()

    size = 0
    for doc, text in enumerate(texts):
        pieces = split(text)
        for i, piece in enumerate(pieces):
            batch.append((doc, piece, i == len(pieces) - 1))
            size += len(piece)
            if size >= BATCH_CHARS:
                yield from flush()
                size = 0
    yield from flush()


class _TokenizeProgress:
    """A rich bar over the source's bytes, showing documents, tokens and tokens/s."""

    def __init__(self, enabled: bool, label: str, total: int | None):
        self.bar = Progress(
            TextColumn(f"tokenizing {label}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[docs]:,} docs"),
            TextColumn("{task.fields[tokens]:,} tokens"),
            TextColumn("{task.fields[rate]:,.0f} tok/s"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self.task = self.bar.add_task(label, total=total, docs=0, tokens=0, rate=0.0)

    def __enter__(self):
        self.bar.start()
        return self.bar, self.task

    def __exit__(self, *exc):
        self.bar.stop()
