"""Recipe sections `data:` and `tokenizer:` (pydantic v2).

The recipe schema (longtrain/train/recipe.py) embeds these two models; the
keys are the ones documented in the recipe (issue 4).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

# The validation context key under which load_recipe asks DataConfig to refuse settings its source
# does not read: {"file": the recipe file's data section (None: a saved, resolved recipe, not checked),
# "overrides": the fields a --set wrote}. Without it (a DataConfig built in code) nothing is refused.
UNUSED_CHECK = "data_unused_check"


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


def unused_fields(source: str, filler: str | None, valid: Any) -> dict[str, str]:
    """{field: why it has no effect, and what to set instead} for the data fields that `source` (with
    recall's `filler`, and `valid`) does not read."""
    reads_files = source == "files" or (source == "recall" and filler == "files")
    valid_files = isinstance(valid, str)
    with_source = f"with data.source {source!r}"
    unused: dict[str, str] = {}
    if not reads_files:
        unused["path"] = (
            f"{with_source} and data.recall.filler {filler!r}: to write the recall documents over the files at "
            "data.path, set data.recall.filler: files (--set data.recall.filler=files)" if source == "recall" else
            f"{with_source} (it reads {'the Python standard library' if source == 'stdlib' else 'the hub data set data.name'}): "
            "to train on the files at data.path, set data.source: files (--set data.source=files)"
        )
    if source != "hub":
        for name in ("name", "split"):
            unused[name] = (f"{with_source}: it is for a hub data set; to read one, set data.source: hub "
                            "(--set data.source=hub)")
    if not (reads_files or valid_files or source == "hub"):
        unused["text_field"] = (f"{with_source} and no data.valid path: it names the text column of files and hub data "
                                "sets (data.source: files or hub, or a data.valid path)")
    if not (reads_files or valid_files):
        unused["on_bad_file"] = (f"{with_source} and no data.valid path: it is for local files (data.source: files, "
                                 "or a data.valid path)")
    if source == "recall":
        unused["min_doc_tokens"] = f"{with_source}: its documents are data.recall.doc_tokens long; set that instead"
    return unused


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

    def unused_settings(self) -> dict[str, str]:
        """{field: why it has no effect} for each field set away from its default that this source does not read."""
        unused = unused_fields(self.source, self.recall.filler if self.recall else None, self.valid)
        return {name: why for name, why in unused.items() if getattr(self, name) != type(self).model_fields[name].default}

    @model_validator(mode="after")
    def _no_unused_settings(self, info: ValidationInfo) -> DataConfig:
        """A recipe's data setting that its source does not read is refused, not silently ignored (the run
        would train on something else than the user meant). Checked where load_recipe asks (UNUSED_CHECK):
        every --set, and each value of the recipe file that the file's own source does not read; a value
        of the file that only a --set of data.source (or data.recall.filler) leaves unused is not refused,
        the --set says what to read. A saved run's recipe is not checked (it trained as it is)."""
        check = (info.context or {}).get(UNUSED_CHECK)
        if check is None:
            return self
        file, overrides = check.get("file"), check.get("overrides", {})
        in_file = unused_fields(*_source_of(file)) if isinstance(file, dict) else {}
        problems = []
        for name, why in self.unused_settings().items():
            if name in overrides or (name in in_file and name in file):
                fix = "drop that --set" if name in overrides else "remove it from the recipe"
                text = f"{getattr(self, name)!r} has no effect {why}, or {fix}"
                problems.append(InitErrorDetails(type=PydanticCustomError("value_error", "{text}", {"text": text}),
                                                 loc=(name,), input=getattr(self, name)))
        if problems:  # one error per setting, each at its own key (the recipe's message names it, and its --set)
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self


def _source_of(data: dict) -> tuple[str, str | None, Any]:
    """(source, recall filler, valid) of a recipe file's data section as written (defaults where it says nothing)."""
    source = data.get("source", "stdlib")
    recall = data.get("recall") if isinstance(data.get("recall"), dict) else {}
    return str(source), recall.get("filler", "words") if source == "recall" else None, data.get("valid")


class TokenizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # an existing tokenizer.json, or null to train one
    vocab_size: int = Field(8192, ge=260)  # byte-level BPE trained on the corpus
    # The end-of-document token by name (a model's own eos, set by `longtrain import` when the tokenizer
    # has none of the usual names); null: the first of EOD_CANDIDATES, else <|endoftext|> is added.
    eod_token: str | None = None
