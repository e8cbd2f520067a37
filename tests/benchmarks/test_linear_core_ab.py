"""benchmarks/linear_core_ab.py's CPU version (the kernels under TRITON_INTERPRET=1): every row runs, a launch
variant included."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_linear_core_ab_small_times_every_row(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "linear_core_ab.py"), "--small", "--out", str(tmp_path),
                          "--try", "bwd.BN=16,bwd.QB=16"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "linear_core_ab.json").read_text())
    assert out["warm_chunks"] == 2  # timed from a filled cache, as in a fit
    rows = out["results"]
    assert [r["name"].split(",")[0].split(" ")[0] for r in rows] == ["sparsek+sw", "triton", "triton", "naive"]
    assert all(r.get("ms", 0) > 0 and "error" not in r for r in rows), rows
    assert rows[2]["name"] == "triton core, bwd.BN=16,bwd.QB=16"


def test_parse_reads_kernel_fields():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from linear_core_ab import parse

    assert parse("bwd.QB=64,bwd.num_warps=8,fwd.BN=16") == {"bwd": {"QB": 64, "num_warps": 8}, "fwd": {"BN": 16}}
