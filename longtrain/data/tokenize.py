"""`tokenize_source`: a source's documents as token documents, through the token cache, with a progress bar.

Long documents are cut into pieces of about PIECE_CHARS characters at line breaks and encoded in
parallel batches; a byte-level tokenizer gives the same tokens as encoding the whole text at once.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from tokenizers import Tokenizer

from longtrain.errors import DataError

from .cache import EntryWriter, TokenDocs, cached_tokens
from .sources import Source
from .tokenizer import eod_id

BATCH_CHARS = 1_000_000  # characters per encode_batch call: ~100 MB of encodings at most
PIECE_CHARS = 65_536  # long documents are encoded in pieces of about this size, in parallel
_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def check_kept(docs: TokenDocs, stats: dict, source: Source, min_doc_tokens: int) -> None:
    """Refuse a source that gave no documents: every one empty, or every one under min_doc_tokens."""
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
