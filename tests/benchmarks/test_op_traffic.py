"""benchmarks/op_traffic.py: the glue's bytes are counted where they are written, and the kernels and the linear
sums are not counted."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_op_traffic_counts_the_glue_of_both_ops():
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "op_traffic.py"), "--rows", "1", "--tokens", "48",
                          "--heads", "2", "--head-dim", "16", "--budget", "8", "--top", "1000"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    totals = {line.split(":")[0]: float(line.split(":")[1].split()[0]) for line in res.stdout.splitlines()
              if line.startswith("sparsek")}
    assert set(totals) == {"sparsek+sw", "sparsek+linear+sw"}, res.stdout
    assert 0 < totals["sparsek+sw"] < totals["sparsek+linear+sw"], totals
    assert "| cat | ops/sparsek_attention/op.py:" in res.stdout  # the key layout's concatenation, found at its line
    assert "linear_triton.py" in res.stdout  # the Triton core's wrapper: counted (its kernels are not)
    # the causal linear sums (fla's kernels on a GPU) are left out: no row from the naive sums' lines
    import inspect

    from longtrain.ops.linear_attention.naive import causal_linear_attention_naive

    lines, first = inspect.getsourcelines(causal_linear_attention_naive)
    here = "ops/linear_attention/naive.py:"
    sums = {f"{here}{n}" for n in range(first, first + len(lines))}
    counted = {row.split("|")[4].strip() for row in res.stdout.splitlines() if row.startswith("| ") and here in row}
    assert not counted & sums, counted  # the sums' lines are not counted
    # the feature maps (the chunk op's own Functions in linear.py since issue 38's glue work) are counted
    assert "| elu | ops/sparsek_attention/linear.py:" in res.stdout


def test_the_counter_skips_views_and_counts_writes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from op_traffic import Uncounted, WriteCounter

    x = torch.zeros(4, 8)
    with WriteCounter() as c:
        x.t()  # a view: nothing written
        y = x + 1  # 32 float32 written
        with Uncounted():
            x * 2
    assert y.shape == (4, 8)
    assert sum(b for _, b in c.rows.values()) == 32 * 4
