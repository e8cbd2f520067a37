"""`train.deterministic`: the same seed gives the same run, bit for bit, on the same machine and software.

Without it, two GPU runs of one seed drift apart from the first step, by rounding at first: atomic adds
land in the order the GPU schedules them (the op's pool backward, torch's scatter and index_add),
cuBLAS may split a product by its workspace, Inductor picks among kernel configs (reduction orders)
by timing them, and SDPA's backward may accumulate in any order. A small difference can flip a
selection or a training outcome (issue 30: a recall circuit that formed in one run of a seed and
not in the next). On, each of these takes its deterministic path: `torch.use_deterministic_algorithms`
(which the op's kernels follow too: longtrain.ops.sparsek_attention.triton_core), a fixed cuBLAS
workspace, cuDNN without benchmarking, and Inductor's deterministic mode (no on-device benchmarking).
It does not make two kinds of device agree: a seed's run on an H100 and on an H200 differ (measured: the recall
circuit of one seed formed on one and not the other; libraries that pick kernels by device, such as cuBLAS, are
the suspects). A checkpoint records its machine (longtrain.device.machine) and fit notes a resume elsewhere.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from collections.abc import Iterator

import torch


@contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """Inside, torch runs deterministically if `enabled`; the previous settings come back after."""
    if not enabled:
        yield
        return
    import torch._inductor.config as inductor

    # cuBLAS reads it when it creates its handle: before the run's first product on the GPU
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    has_mode = hasattr(inductor, "deterministic")  # Inductor's mode is newer than some torch releases
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, has_mode and inductor.deterministic)
    torch.use_deterministic_algorithms(True)  # Inductor follows it too (it filters its reduction configs)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if has_mode:
        inductor.deterministic = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:3]
        if has_mode:
            inductor.deterministic = before[3]
