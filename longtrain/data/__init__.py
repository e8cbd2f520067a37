"""Long-document data pipeline: sources, tokenizer, token cache, document streams."""

from longtrain.errors import DataError

from .cache import TokenDocs, default_cache_dir
from .config import DataConfig, TokenizerConfig
from .prepare import PreparedCorpus, prepare_corpus
from .stream import IGNORE, Chunk, DocumentStream, iter_valid_chunks

__all__ = [
    "IGNORE",
    "Chunk",
    "DataConfig",
    "DataError",
    "DocumentStream",
    "PreparedCorpus",
    "TokenDocs",
    "TokenizerConfig",
    "default_cache_dir",
    "iter_valid_chunks",
    "prepare_corpus",
]
