"""SparseK selection: which older keys each query keeps (the scan of Algorithm 2) and the threshold state.

Three implementations of one scan, one signature: the plain-Python heaps (naive.py, the reference),
the compiled host scan (host.py, numba) and the device scan (device.py: a wavelet tree over the
chunk's score ranks, Triton). state.py holds the data they share; chunk.py the stages of one chunk.
"""

from longtrain.ops.selection.chunk import SCANS, lay_out_scores, next_state, select
from longtrain.ops.selection.prefix import PrefixThresholds, prefix_thresholds
from longtrain.ops.selection.state import (
    ExtendedScores, ScanResult, SelectionState, ThresholdState, default_threshold_cap,
)
from longtrain.ops.selection.threshold import ThresholdFn

__all__ = [
    "SCANS",
    "ExtendedScores",
    "PrefixThresholds",
    "ScanResult",
    "SelectionState",
    "ThresholdFn",
    "ThresholdState",
    "default_threshold_cap",
    "lay_out_scores",
    "next_state",
    "prefix_thresholds",
    "select",
]
