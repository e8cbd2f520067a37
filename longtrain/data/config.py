"""Recipe sections `data:` and `tokenizer:` (pydantic v2).

The recipe schema (longtrain/train/recipe.py) embeds these two models; the
keys are the ones documented in the recipe (issue 4).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def line_length(cfg: RecallConfig) -> int:
    """Tokens of one fact or query line of the recall task: newline, marker, key, '=', value, newline."""
    return cfg.key_length + cfg.value_length + 4


class RecallConfig(BaseModel):
    """`data.recall:` the long-range recall task (longtrain/data/recall.py).

    Each document is `doc_tokens` tokens of filler with `facts` key -> value facts planted in it,
    each queried once later, `min_distance`..`max_distance` tokens after it (log-uniform, so every
    doubling of distance gets the same share of queries). Everything follows from `seed`.
    """

    model_config = ConfigDict(extra="forbid")

    docs: int = Field(2000, ge=1, description="documents generated (training plus a `data.valid` fraction)")
    doc_tokens: int = Field(
        4096, ge=16, description="tokens per document, its end-of-document token included (a multiple of "
        "train.chunk_size wastes no chunk)"
    )
    facts: int = Field(8, ge=1, description="facts planted per document, each queried once")
    min_distance: int = Field(256, ge=1, description="fewest tokens from a fact to its query")
    max_distance: int = Field(2048, ge=1, description="most tokens from a fact to its query")
    key_length: int = Field(3, ge=1, le=12, description="key symbols (a-z): key_letters^key_length keys")
    # Keys drawn from the first key_letters letters only: with few letters the facts of a document share
    # letters, so a circuit that matches one letter of the key recalls the wrong fact (a harder curriculum).
    key_letters: int = Field(26, ge=2, le=26, description="letters keys are drawn from (the first N of a-z; 26: all)")
    value_length: int = Field(3, ge=1, le=32, description="value symbols (0-9): an exact guess has chance 10^-value_length")
    # words: random common English words (built in); stdlib: the Python standard library's source;
    # files: the documents under data.path (e.g. a folder of books).
    filler: Literal["words", "stdlib", "files"] = "words"
    # words filler: draw from the first filler_words words only (0: all). Few words make the filler easy to
    # predict, so its loss stops drowning the gradient of the recalled values (a quieter curriculum stage);
    # the tokenizer still learns every word.
    filler_words: int = Field(0, ge=0, description="words filler: the first N words only (0: all of them)")
    seed: int = Field(0, ge=0, description="seed of the generator (independent of train.seed)")

    @model_validator(mode="after")
    def _distances_fit(self) -> RecallConfig:
        line = line_length(self)
        if self.key_letters**self.key_length < self.facts:
            raise ValueError(
                f"recall.key_letters ({self.key_letters}) and key_length ({self.key_length}) make "
                f"{self.key_letters**self.key_length} keys, fewer than recall.facts ({self.facts}), and a "
                "document's keys are distinct: raise key_letters or key_length, or lower facts"
            )
        if self.filler_words and self.filler != "words":
            raise ValueError(f"recall.filler_words applies to filler: words, not {self.filler!r}; remove it")
        if self.min_distance > self.max_distance:
            raise ValueError(f"recall.min_distance ({self.min_distance}) exceeds recall.max_distance ({self.max_distance})")
        if self.min_distance < line:
            raise ValueError(
                f"recall.min_distance ({self.min_distance}) is shorter than a fact line ({line} tokens): "
                f"a query would overlap its fact; use at least {line}"
            )
        if self.max_distance + line > self.doc_tokens - 1:
            raise ValueError(
                f"recall.max_distance ({self.max_distance}) plus a line ({line} tokens) does not fit in "
                f"recall.doc_tokens ({self.doc_tokens}, one of them the end-of-document token); "
                "raise doc_tokens or lower max_distance"
            )
        return self


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # stdlib: the Python standard library's .py files (exists on every machine);
    # files: local .txt/.jsonl/.json/.parquet; hub: a `datasets` hub name;
    # recall: generated documents with facts planted and queried far apart (see RecallConfig).
    source: Literal["stdlib", "files", "hub", "recall"] = "stdlib"
    path: str | None = None  # files: a file, a folder (recursive) or a glob; recall: filler files
    name: str | None = None  # hub: a data set name, e.g. pg19
    split: str = "train"
    text_field: str = "text"
    # Shorter documents are dropped, never packed together (as in the paper).
    min_doc_tokens: int = Field(4096, ge=1)
    # Held-out validation documents: a path, or a fraction of the corpus.
    valid: str | float | None = None
    recall: RecallConfig | None = None  # source recall: the task's knobs (null: the defaults)
    # files: a file that cannot be read or parsed (or a .txt that is mostly not text) stops the run
    # (error), or is left out and listed in the run's summary (skip).
    on_bad_file: Literal["error", "skip"] = "error"

    @field_validator("valid")
    @classmethod
    def _valid_fraction(cls, v: str | float | None) -> str | float | None:
        if isinstance(v, float) and not 0.0 < v < 1.0:
            raise ValueError(f"valid as a fraction must be in (0, 1), got {v}")
        if isinstance(v, str) and not v.strip():
            raise ValueError("valid must be null, a path, or a fraction in (0, 1)")
        return v

    @model_validator(mode="after")
    def _source_needs(self) -> DataConfig:
        if self.source == "files" and not self.path:
            raise ValueError("data.source 'files' needs data.path (a file, folder or glob)")
        if self.source == "hub" and not self.name:
            raise ValueError("data.source 'hub' needs data.name (a data set name, e.g. pg19)")
        if self.source == "recall":
            self.recall = self.recall or RecallConfig()
            if self.recall.filler == "files" and not self.path:
                raise ValueError("data.recall.filler 'files' needs data.path (a folder of text files, e.g. books)")
            if isinstance(self.valid, str):
                raise ValueError(
                    "data.source 'recall' generates its documents: data.valid must be a fraction "
                    f"(e.g. 0.02), not a path ({self.valid!r})"
                )
        elif self.recall is not None:
            raise ValueError(f"data.recall is set but data.source is {self.source!r}; use data.source: recall")
        return self


class TokenizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # an existing tokenizer.json, or null to train one
    vocab_size: int = Field(8192, ge=260)  # byte-level BPE trained on the corpus
    # The end-of-document token by name (a model's own eos, set by `longtrain import` when the tokenizer
    # has none of the usual names); null: the first of EOD_CANDIDATES, else <|endoftext|> is added.
    eod_token: str | None = None
