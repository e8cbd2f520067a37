"""SparseK attention: the selection scan, the naive reference, the Triton kernels and the public op."""

from longtrain.ops.attention.cache import SparseKCache
from longtrain.ops.attention.naive import VARIANTS
from longtrain.ops.attention.op import ChunkSelection, sparsek_attention, sparsek_attention_chunk
from longtrain.ops.attention.prefix import prefix_thresholds

__all__ = [
    "VARIANTS",
    "ChunkSelection",
    "SparseKCache",
    "prefix_thresholds",
    "sparsek_attention",
    "sparsek_attention_chunk",
]
