"""SparseK attention: the naive reference, the Triton kernels, the per-layer cache and the public op."""

from longtrain.ops.selection import select
from longtrain.ops.sparsek_attention.cache import SparseKCache
from longtrain.ops.sparsek_attention.decode import (
    sparsek_attention_decode,
    sparsek_attention_decode_reference,
)
from longtrain.ops.sparsek_attention.naive import VARIANTS
from longtrain.ops.sparsek_attention.op import (
    ChunkSelection, ExtendedKeys, attend, lay_out_keys, next_cache, sparsek_attention, sparsek_attention_chunk,
    starts_inside_tile,
)

__all__ = [
    "VARIANTS",
    "ChunkSelection",
    "ExtendedKeys",
    "SparseKCache",
    "attend",
    "lay_out_keys",
    "next_cache",
    "select",
    "sparsek_attention",
    "sparsek_attention_chunk",
    "sparsek_attention_decode",
    "sparsek_attention_decode_reference",
    "starts_inside_tile",
]
