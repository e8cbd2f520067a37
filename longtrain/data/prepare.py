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

import glob
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from longtrain.errors import DataError, DataPathMissing

from .cache import TokenDocs, cached_file, default_cache_dir
from .config import DataConfig, TokenizerConfig
from .recall import filler_source, make_filler, recall_documents
from .sources import (
    BUILDERS,
    Source,
    files_source,
    glob_files,
    hub_source,
    listed_files,
    no_readable_files,
    readable_files,
    unmatched_glob,
)
from .stdlib import stdlib_source
from .tokenize import check_kept, tokenize_source
from .tokenizer import (
    TRAIN_SAMPLE_CHARS,
    eod_id,
    load_tokenizer,
    sample_for_training,
    tokenizer_hash,
    tokenizer_path_problem,
    train_bpe,
)


def load_source(data: DataConfig) -> Source:
    """The documents `data:` names: the embedded stdlib corpus, local files, a hub dataset, or recall's filler."""
    if data.source == "stdlib":
        return stdlib_source()
    if data.source == "files":
        return files_source(data.path, data.text_field, on_bad_file=data.on_bad_file)
    if data.source == "recall":  # the filler the recall documents are written over
        return filler_source(data)
    return hub_source(data.name, data.split, data.text_field)


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
        filler, filler_key = make_filler(data, tok, cache_dir, progress, source=source)
        return recall_documents(data, tok, filler, filler_key)
    source = source if source is not None else load_source(data)
    tok_hash = tokenizer_hash(tok)
    docs, stats = tokenize_source(source, tok, data.min_doc_tokens, cache_dir, tok_hash, "train", progress)
    check_kept(docs, stats, source, data.min_doc_tokens)
    return docs, stats


def check_paths_exist(data: DataConfig, tokenizer: TokenizerConfig | None = None) -> None:
    """Refuse missing data paths (data.path where the source reads it, a data.valid path), globs of theirs that match
    no files, paths whose files are none of a type that is read, and a tokenizer.path that is not a file, in one
    DataPathMissing (a usage error: exit 2) that names each, where a relative one was looked for, and the `--set` that
    fixes it. Before any file is read."""
    wanted = []
    if data.source == "files" or (data.source == "recall" and data.recall.filler == "files"):
        wanted.append(("data.path", data.path))
    if isinstance(data.valid, str):
        wanted.append(("data.valid", data.valid))
    missing = [(key, value) for key, value in wanted
               if value and not glob.has_magic(value) and not Path(value).expanduser().exists()]
    unmatched = [(key, value) for key, value in wanted if value and glob.has_magic(value)
                 and not Path(value).expanduser().exists() and not glob_files(value)]
    problems = []
    if missing:
        relative = any(not Path(value).expanduser().is_absolute() for _, value in missing)
        where = f" (relative paths are read from the working directory, {Path.cwd()})" if relative else ""
        found = " and ".join(f"{key} {value!r}" for key, value in missing)
        sets = " ".join(f"--set {key}=DIR" for key, _ in missing)
        fraction = (" (data.valid may be a fraction of the training documents instead, e.g. --set data.valid=0.02)"
                    if any(key == "data.valid" for key, _ in missing) else "")
        what = "does not exist" if len(missing) == 1 else "do not exist"
        give = "a file, folder or glob that exists" if len(missing) == 1 else "files, folders or globs that exist"
        problems.append(f"{found} {what}{where}. Give {give}, in the recipe or with {sets}{fraction}")
    kinds = ", ".join(BUILDERS)
    for key, value in unmatched:
        fraction = " (or a fraction of the training documents, e.g. --set data.valid=0.02)" if key == "data.valid" else ""
        problems.append(f"{unmatched_glob(value, key)}. Give a glob that matches {kinds} files, or their folder (read "
                        f"with its subfolders), in the recipe or with --set {key}=GLOB or --set {key}=DIR{fraction}")
    for key, value in wanted:  # there, but no file of a type that is read (a folder of .md notes, a .pdf)
        if value and (key, value) not in missing + unmatched:
            files = listed_files(value, key)
            if not readable_files(files):
                problems.append(f"{no_readable_files(files, value)}. Give files ending in {kinds}, their folder or a "
                                f"glob, in the recipe or with --set {key}=DIR or --set {key}=GLOB")
    if tokenizer is not None and tokenizer.path and (problem := tokenizer_path_problem(tokenizer.path)):
        problems.append(problem)
    if problems:
        raise DataPathMissing("; and ".join(problems))


def prepare_corpus(
    data: DataConfig,
    tokenizer: TokenizerConfig,
    *,
    cache_dir: Path | None = None,
    seed: int = 0,  # noqa: ARG001  accepted from the trainer; the corpus and split never depend on it
    progress: bool = True,
) -> PreparedCorpus:
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    check_paths_exist(data, tokenizer)  # every missing path in one message, with the --set that fixes each
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
        check_kept(valid, stats["valid"], valid_source, data.min_doc_tokens)

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
