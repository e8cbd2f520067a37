"""The documents `longtrain eval` reads, as token documents in the checkpoint's tokenizer.

Default: the run's validation documents, found the way `fit` found them (the recipe's `data:`
section, `longtrain.data.prepare.corpus_documents`): a fraction of the source held out by position
(for `data.source: recall`, of the generated recall documents, not of their filler), or a separate
path. They go through the same on-disk token cache, keyed by content, tokenizer and
`min_doc_tokens`, so on the machine that trained the run nothing is tokenized again. A checkpoint
copied elsewhere reads its recipe's data source there (the cache is rebuilt once).

`--data PATH|GLOB`: any text/jsonl/json/parquet files, read through `datasets` like `fit`'s
`data.source: files`; documents of at least 2 tokens are kept.
"""

from __future__ import annotations

from longtrain.data import DataError, TokenDocs, default_cache_dir
from longtrain.data.prepare import corpus_documents, split_held_out
from longtrain.data.sources import files_source
from longtrain.data.tokenize import tokenize_source
from longtrain.data.tokenizer import tokenizer_hash
from longtrain.errors import EvalError, EvalUsageError

MIN_TOKENS = 2  # a document needs a token to predict


def eval_documents(recipe, tokenizer, data: str | None, *, progress: bool = True) -> TokenDocs:
    """The documents at `data` (a PATH|GLOB), or the run's validation documents (data=None)."""
    cache_dir = default_cache_dir()
    tok = tokenizer_hash(tokenizer)
    try:
        if data is not None:
            docs, _ = tokenize_source(files_source(data, "text", "{arg}"), tokenizer, MIN_TOKENS, cache_dir, tok, "eval", progress)
            return docs
        d = recipe.data
        if d.valid is None:
            raise EvalError(
                "the run has no validation documents (its recipe's data.valid is null): "
                "pass {arg} PATH|GLOB with documents to evaluate on", arg="data",
            )
        if isinstance(d.valid, str):
            source = files_source(d.valid, d.text_field, "data.valid")
            docs, _ = tokenize_source(source, tokenizer, d.min_doc_tokens, cache_dir, tok, "valid", progress)
            return docs
        docs, _ = corpus_documents(d, tokenizer, cache_dir, progress)  # recall: the generated documents
        _, valid = split_held_out(docs, d.valid)
    except DataError as e:
        if data is not None:
            raise EvalUsageError(f"{{arg}} {data}: {e}", arg="data") from None
        raise EvalError(
            f"the run's validation documents (its recipe's data section): {e}; "
            "pass {arg} PATH|GLOB to evaluate on other documents", arg="data",
        ) from None
    if len(valid) == 0:
        raise EvalError("the run's validation split holds no documents: pass {arg} PATH|GLOB", arg="data")
    return valid
