"""Operators: the SparseK projection and SparseK attention."""

from longtrain.ops.sparsek import sparsek, sparsek_threshold

__all__ = ["sparsek", "sparsek_threshold"]
