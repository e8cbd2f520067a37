"""benchmarks/decode_kernels.py's CPU version (its kernels under TRITON_INTERPRET=1): it runs, and every split
count's attention equals attend_torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_decode_kernels_small_runs_and_every_split_matches_the_reference(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_kernels.py"), "--small", "--out", str(tmp_path),
                          "--batches", "1,3", "--splits", "1,2,5", "--iters", "2", "--sweep"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "decode_kernels.json").read_text())
    assert [r["rows"] for r in report["rows"]] == [1, 3]
    for r in report["rows"]:
        assert set(r["attend_max_abs_diff"]) == {"1", "2", "5"}
        assert max(r["attend_max_abs_diff"].values()) < 1e-5, r  # float32 on the CPU
        assert r["attend_ring_max_abs_diff"] < 1e-5, r  # the in-place decoder's ring tail
        assert len(r["sweep_us"]) == 2 and not any(isinstance(t, str) for t in r["sweep_us"].values()), r  # none wrong
