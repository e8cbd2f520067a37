"""SparseK selection: which older keys each query keeps (the scan of Algorithm 2) and the threshold state.

Three implementations of one scan: the plain-Python heaps (the reference), the compiled host scan
(numba) and the device scan (a wavelet tree over the chunk's score ranks, Triton).
"""

from longtrain.ops.selection.prefix import prefix_thresholds

__all__ = ["prefix_thresholds"]
