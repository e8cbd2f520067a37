"""benchmarks/fit_profile.py's attribution of kernels a CUDA graph replays (no launching range): by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fit_profile  # noqa: E402


def test_graph_replayed_kernels_are_grouped_by_name():
    group = fit_profile.kernel_group
    # SparseK+SW's core and the linear types' core (its backward is one `_bwd_kernel`)
    assert group("_dkv_pool_kernel", None) == group("_bwd_kernel", None) == "attention kernels"
    assert group("_key_sum_kernel", None) == "attention kernels"
    # fla's chunked kernels are the linear sums, not the core, even where their names hold "bwd_kernel"
    assert group("chunk_bwd_kernel_dh", None) == group("chunk_fwd_kernel_o", None) == "linear sums"
    assert group("chunk_bwd_kernel_dh", "linear sums") == "linear sums"  # launched in a range: the range's group
    assert group("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", None) == "matmuls"
    assert group("keys_kernel", None) == "scan"
