"""The `recall` data source: long documents with key -> value facts planted in running text and
queried once, far later (issue 17). It shows whether the SparseK pool carries what matters from
far beyond the window.

A document is `doc_tokens` - 1 tokens of filler with `facts` pairs of lines written over it, then
the end-of-document token (so a `doc_tokens` that is a multiple of the chunk size fills every chunk):

    fact   "\\n@qxj=729\\n"      (newline, '@', key letters, '=', value digits, newline)
    query  "\\n?qxj=729\\n"      the same key and value, `distance` tokens later

Documents are built at the token level, so every position is exact: the distance of a pair is the
query line's start minus the fact line's start (also the distance between their first value tokens),
drawn log-uniformly from [min_distance, max_distance]. Every symbol ('\\n', '@', '?', '=', a-z,
0-9) must be one token of the tokenizer (a byte-level BPE always has them), so a value is exactly
`value_length` tokens and its exact match is well defined: the argmax at each value position,
teacher-forced, equals the value token at every position iff greedy decoding after the query's '='
writes the value. Keys are distinct within a document and values uniform and independent of
everything else, so a model that cannot see the fact matches a value with probability
10^-value_length (per symbol 1/10): the chance level.

Filler: `words` (random common English words, built in), `stdlib` (the standard library's source)
or `files` (the documents under data.path, e.g. books): a window of `doc_tokens` - 1 tokens at a random
offset of a random filler document long enough. Document i is a function of (seed, i) only.

Training goes through the ordinary path: the tokenizer is trained on (or loaded for) the filler, and
`GeneratedDocs` (TokenDocs' interface, each document generated when it is first read; keyed by the
recall settings, the tokenizer and the filler's content) is read by `DocumentStream` like any corpus,
so chunks, the KV cache, resume and validation (a `data.valid` fraction) all work unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from longtrain.errors import DataError

from .cache import TokenDocs
from .config import DataConfig, RecallConfig, line_length
from .sources import Source, files_source
from .stdlib import stdlib_source
from .tokenize import tokenize_source
from .tokenizer import eod_id, tokenizer_hash

GENERATOR_VERSION = 1  # part of the cache key: bump when the documents a config makes change
KEY_SYMBOLS = "abcdefghijklmnopqrstuvwxyz"
VALUE_SYMBOLS = "0123456789"
NEWLINE, FACT, QUERY, EQUALS = "\n", "@", "?", "="
LATER_SETTINGS = ("key_letters", "filler_words")  # RecallConfig fields added after GENERATOR_VERSION 1
PLACEMENT_TRIES = 200  # random placements tried per fact before the document counts as too full

# Filler words: common English words, so a tokenizer trained on them has whole-word tokens.
FILLER_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her all she there would their we him been has when who will more no if out "
    "so said what up its about into than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right used take "
    "three river house letter morning captain garden window silence evening mountain quiet ship coffee "
    "wander road night water light stone field friend voice door table paper winter summer forest"
).split()


def chance_level(cfg: RecallConfig) -> dict[str, float]:
    """What a model that cannot see the fact scores: exact match and per value symbol."""
    return {"exact": float(len(VALUE_SYMBOLS)) ** -cfg.value_length, "symbol": 1.0 / len(VALUE_SYMBOLS)}


@dataclass
class Symbols:
    """Token ids of the task's symbols in one tokenizer."""

    newline: int
    fact: int
    query: int
    equals: int
    keys: np.ndarray  # [26] int32, a..z
    values: np.ndarray  # [10] int32, 0..9

    @classmethod
    def of(cls, tok: Tokenizer) -> Symbols:
        def one(s: str) -> int:
            ids = tok.encode(s, add_special_tokens=False).ids
            if len(ids) != 1:
                raise DataError(
                    f"The recall task needs {s!r} to be one token, but this tokenizer splits it into {len(ids)}. "
                    "Use a byte-level BPE (tokenizer.path: null trains one) or a tokenizer with single-character tokens."
                )
            return ids[0]

        ids = [one(s) for s in (NEWLINE, FACT, QUERY, EQUALS)]
        keys = np.array([one(s) for s in KEY_SYMBOLS], dtype=np.int32)
        values = np.array([one(s) for s in VALUE_SYMBOLS], dtype=np.int32)
        if len(set(ids) | set(keys.tolist()) | set(values.tolist())) != 4 + len(keys) + len(values):
            raise DataError("The recall task's symbols are not distinct tokens in this tokenizer; use a byte-level BPE.")
        return cls(*ids, keys=keys, values=values)


@dataclass
class RecallDoc:
    """One generated document and where its facts are."""

    tokens: np.ndarray  # [doc_tokens - 1] int32 (no EOD)
    fact_pos: np.ndarray  # [F] int64 start of each fact line
    query_pos: np.ndarray  # [F] int64 start of its query line (fact_pos + distance)
    values: np.ndarray  # [F, value_length] int32 value token ids

    @property
    def distances(self) -> np.ndarray:
        return self.query_pos - self.fact_pos


def value_offset(cfg: RecallConfig) -> int:
    """Offset of the first value token within a line."""
    return cfg.key_length + 3


# ----------------------------------------------------------------------------- filler


class Filler:
    """Draws `n` filler tokens at a time: random words, or a window of a tokenized corpus."""

    def __init__(self, *, words: list[np.ndarray] | None = None, docs: TokenDocs | None = None, n: int):
        self.n = n
        if words is not None:
            self.word_lengths = np.array([len(w) for w in words], dtype=np.int64)
            self.word_tokens = np.concatenate(words).astype(np.int32)
            self.word_starts = np.cumsum(self.word_lengths) - self.word_lengths
            self.docs = None
        else:
            lengths = docs.lengths - 1  # without the EOD
            self.docs, self.long = docs, np.flatnonzero(lengths >= n)
            if len(self.long) == 0:
                raise DataError(
                    f"No filler document has {n} tokens (the longest has {int(lengths.max(initial=0))}): "
                    "lower data.recall.doc_tokens or use longer filler documents."
                )
            weights = lengths[self.long].astype(np.float64) - n + 1  # every window equally likely
            self.cum = np.cumsum(weights) / weights.sum()

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        if self.docs is None:
            # Every word is at least one token: n words always cover n tokens.
            w = rng.integers(0, len(self.word_lengths), size=self.n)
            lens = self.word_lengths[w]
            starts = np.repeat(self.word_starts[w] - (np.cumsum(lens) - lens), lens)
            return self.word_tokens[starts + np.arange(int(lens.sum()))][: self.n]
        d = int(self.long[min(np.searchsorted(self.cum, rng.random(), side="right"), len(self.long) - 1)])
        doc = self.docs.doc(d)
        o = int(rng.integers(0, len(doc) - 1 - self.n + 1))
        return np.asarray(doc[o : o + self.n], dtype=np.int32)


def word_filler(tok: Tokenizer, n: int, n_words: int = 0) -> Filler:
    """Random words of FILLER_WORDS (its first n_words; 0: all) as `n` tokens at a time."""
    words = [np.array(tok.encode(" " + w, add_special_tokens=False).ids, dtype=np.int32)
             for w in FILLER_WORDS[: n_words or None]]
    return Filler(words=words, n=n)


def words_source(n_texts: int = 16, words_per_text: int = 20_000) -> Source:
    """Random filler words as text: what the tokenizer is trained on for `filler: words`."""

    def documents() -> Iterator[str]:
        for i in range(n_texts):
            rng = np.random.default_rng([GENERATOR_VERSION, i])
            yield " ".join(FILLER_WORDS[j] for j in rng.integers(0, len(FILLER_WORDS), words_per_text))

    key = hashlib.blake2b(f"recall-words:{GENERATOR_VERSION}:{n_texts}:{words_per_text}:{' '.join(FILLER_WORDS)}".encode(), digest_size=16)
    return Source(
        description="random common English words",
        fingerprint=key.hexdigest(),
        total_bytes=None,
        n_docs=n_texts,
        invalid_utf8=0,
        documents=documents,
    )


def filler_source(data: DataConfig) -> Source:
    kind = data.recall.filler
    if kind == "words":
        return words_source()
    if kind == "stdlib":
        return stdlib_source()
    return files_source(data.path, data.text_field, on_bad_file=data.on_bad_file)


def make_filler(
    data: DataConfig, tok: Tokenizer, cache_dir: Path, progress: bool = True, *, source: Source | None = None
) -> tuple[Filler, str]:
    """The filler for `tok` and a fingerprint of its content (part of the cache key). `source`: the
    `filler_source(data)` the caller opened already (a files source reads every byte to hash them)."""
    cfg = data.recall
    source = source if source is not None else filler_source(data)
    n = cfg.doc_tokens - 1  # filler tokens per document, before its EOD
    if cfg.filler == "words":
        return word_filler(tok, n, cfg.filler_words), source.fingerprint
    docs, _ = tokenize_source(source, tok, n + 1, cache_dir, tokenizer_hash(tok), "filler", progress)
    return Filler(docs=docs, n=n), source.fingerprint


# ----------------------------------------------------------------------------- documents


def log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniform: each doubling of distance is equally likely."""
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


TRAIN_STREAM, EVAL_STREAM = 0, 1  # evaluation documents never coincide with training ones, for any seed


def generate_document(
    cfg: RecallConfig, sym: Symbols, filler: Filler, seed: int, index: int, stream: int = TRAIN_STREAM
) -> RecallDoc:
    """Document `index` of (stream, seed): a function of (cfg, tokenizer, filler, stream, seed, index) only."""
    rng = np.random.default_rng([GENERATOR_VERSION, stream, seed, index])
    n, F, Lk, Lv = cfg.doc_tokens - 1, cfg.facts, cfg.key_length, cfg.value_length
    line = line_length(cfg)
    tokens = filler.draw(rng).copy()
    taken = np.zeros(n + 1, dtype=bool)
    fact_pos = np.zeros(F, dtype=np.int64)
    query_pos = np.zeros(F, dtype=np.int64)
    for f in range(F):
        for _ in range(PLACEMENT_TRIES):
            d = log_uniform(rng, cfg.min_distance, cfg.max_distance)
            p = int(rng.integers(0, n - line - d + 1))
            if not taken[p : p + line].any() and not taken[p + d : p + d + line].any():
                break
        else:
            raise DataError(
                f"Could not place {F} facts in a document of {cfg.doc_tokens} tokens with distances "
                f"{cfg.min_distance}..{cfg.max_distance} (lines of {line} tokens): lower data.recall.facts "
                "or the distances, or raise data.recall.doc_tokens."
            )
        taken[p : p + line] = taken[p + d : p + d + line] = True
        fact_pos[f], query_pos[f] = p, p + d
    # Distinct keys as numbers in base key_letters; values uniform digits, independent of everything else.
    A = cfg.key_letters
    keys: set[int] = set()
    while len(keys) < F:
        keys.update(int(k) for k in rng.integers(0, A**Lk, size=F - len(keys)))
    key_digits = np.array([[(k // A**i) % A for i in reversed(range(Lk))] for k in sorted(keys)], dtype=np.int64)
    key_digits = key_digits[rng.permutation(F)]
    values = sym.values[rng.integers(0, 10, size=(F, Lv))]  # [F, Lv]
    for f in range(F):
        body = np.concatenate([sym.keys[key_digits[f]], [sym.equals], values[f], [sym.newline]])
        tokens[fact_pos[f] : fact_pos[f] + line] = np.concatenate([[sym.newline, sym.fact], body])
        tokens[query_pos[f] : query_pos[f] + line] = np.concatenate([[sym.newline, sym.query], body])
    order = np.argsort(fact_pos, kind="stable")
    return RecallDoc(tokens.astype(np.int32), fact_pos[order], query_pos[order], values[order].astype(np.int32))


def generate_documents(
    cfg: RecallConfig, tok: Tokenizer, filler: Filler, *, seed: int, n_docs: int, stream: int = EVAL_STREAM
) -> tuple[TokenDocs, list[RecallDoc]]:
    """`n_docs` documents in memory (each with EOD last); by default of the evaluation stream."""
    sym, eod = Symbols.of(tok), eod_id(tok)
    docs = [generate_document(cfg, sym, filler, seed, i, stream) for i in range(n_docs)]
    tokens = np.concatenate([np.append(d.tokens, np.int32(eod)) for d in docs]).astype(np.int32)
    ends = np.cumsum([len(d.tokens) + 1 for d in docs]).astype(np.int64)
    return TokenDocs(tokens, ends - ends[0], ends, np.arange(n_docs, dtype=np.int64)), docs


class GeneratedDocs:
    """Recall documents made when read: TokenDocs' interface (len, doc, lengths, n_tokens, source_ids,
    subset) over `generate_document`, so a 30-step run generates the documents it reads, not all
    `recall.docs` of them, and nothing goes to the token cache. Every document is doc_tokens long
    (EOD last); the last few read are kept, since the stream reads each one chunk by chunk."""

    RECENT = 512  # documents kept in memory: several chunks' rows, times the rows of a batch

    def __init__(self, make, length: int, source_ids: np.ndarray):
        self._make, self._length = make, length
        self.source_ids = np.asarray(source_ids, dtype=np.int64)  # [n] index of each document in the stream
        self.lengths = np.full(len(self.source_ids), length, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.source_ids)

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document i (int32, read-only, EOD last)."""
        return self._make(int(self.source_ids[i]))

    @property
    def n_tokens(self) -> int:
        return self._length * len(self)

    def subset(self, index: np.ndarray) -> GeneratedDocs:
        return GeneratedDocs(self._make, self._length, self.source_ids[np.asarray(index, dtype=np.int64)])

    def __repr__(self) -> str:
        return f"GeneratedDocs({len(self)} recall documents of {self._length} tokens)"


def recall_documents(data: DataConfig, tok: Tokenizer, filler: Filler, filler_key: str) -> tuple[GeneratedDocs, dict]:
    """The training stream's `recall.docs` documents (seed `recall.seed`), generated as they are read."""
    cfg = data.recall
    sym, eod = Symbols.of(tok), eod_id(tok)
    # settings added later stay out at their defaults, so documents made before them keep their key
    later = {k for k in LATER_SETTINGS if getattr(cfg, k) == RecallConfig.model_fields[k].default}
    settings = json.dumps(cfg.model_dump(mode="json", exclude=later), sort_keys=True)
    key = hashlib.blake2b(
        f"recall:{GENERATOR_VERSION}:{settings}:{tokenizer_hash(tok)}:{filler_key}".encode(), digest_size=16
    ).hexdigest()

    @functools.lru_cache(maxsize=GeneratedDocs.RECENT)
    def make(i: int) -> np.ndarray:
        tokens = np.append(generate_document(cfg, sym, filler, cfg.seed, i).tokens, np.int32(eod)).astype(np.int32)
        tokens.flags.writeable = False  # shared by every reader of document i
        return tokens

    make(0)  # settings that cannot place the facts fail here, before training, not at a later read
    docs = GeneratedDocs(make, cfg.doc_tokens, np.arange(cfg.docs))
    return docs, {"key": key, "cache_hit": False, "generated": True, "docs_read": cfg.docs, "kept": len(docs), "tokens": docs.n_tokens}


def describe(cfg: RecallConfig) -> str:
    """One line for `fit`'s summary: the task and its chance level."""
    chance = chance_level(cfg)
    return (
        f"recall: {cfg.docs} documents of {cfg.doc_tokens} tokens ({cfg.filler} filler"
        f"{f' of {cfg.filler_words} words' if cfg.filler_words else ''}), {cfg.facts} facts each, "
        f"distances {cfg.min_distance}..{cfg.max_distance}, keys of {cfg.key_length} letters"
        f"{'' if cfg.key_letters == len(KEY_SYMBOLS) else f' of the first {cfg.key_letters}'}, values of "
        f"{cfg.value_length} digits (chance: exact {chance['exact']:.2g}, per digit {chance['symbol']:.2g})"
    )

