"""longtrain: train language models on long documents with SparseK attention."""

__version__ = "0.1.0"
