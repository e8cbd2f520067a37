"""SparseK attention: the naive reference, the Triton kernels, the per-layer cache and the public op."""

from longtrain.ops.sparsek_attention.cache import SparseKCache
from longtrain.ops.sparsek_attention.decode import (
    sparsek_attention_decode,
    sparsek_attention_decode_reference,
)
from longtrain.ops.sparsek_attention.naive import VARIANTS
from longtrain.ops.sparsek_attention.op import ChunkSelection, sparsek_attention, sparsek_attention_chunk

__all__ = [
    "VARIANTS",
    "ChunkSelection",
    "SparseKCache",
    "sparsek_attention",
    "sparsek_attention_chunk",
    "sparsek_attention_decode",
    "sparsek_attention_decode_reference",
]
