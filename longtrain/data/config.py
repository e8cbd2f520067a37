"""Recipe sections `data:` and `tokenizer:` (pydantic v2).

The recipe schema (longtrain/train/recipe.py) embeds these two models; the
keys are the ones documented in the recipe (issue 4).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # stdlib: the Python standard library's .py files (exists on every machine);
    # files: local .txt/.jsonl/.json/.parquet; hub: a `datasets` hub name.
    source: Literal["stdlib", "files", "hub"] = "stdlib"
    path: str | None = None  # files: a file, a folder (recursive) or a glob
    name: str | None = None  # hub: a data set name, e.g. pg19
    split: str = "train"
    text_field: str = "text"
    # Shorter documents are dropped, never packed together (as in the paper).
    min_doc_tokens: int = Field(4096, ge=1)
    # Held-out validation documents: a path, or a fraction of the corpus.
    valid: str | float | None = None

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
        return self


class TokenizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # an existing tokenizer.json, or null to train one
    vocab_size: int = Field(8192, ge=260)  # byte-level BPE trained on the corpus
