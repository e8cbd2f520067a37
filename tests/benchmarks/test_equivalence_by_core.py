"""benchmarks/equivalence_by_core.py on the CPU (--small): every (attention, core, dtype, chunk) row, and on the CPU
every one bitwise in bf16 (the linear types' float64 sums; issue 38)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_equivalence_by_core_small_reports_every_case_and_bf16_is_bitwise_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "equivalence_by_core.py"), "--small", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "equivalence_by_core.json").read_text())
    rows = report["rows"]
    assert report["device"] == "cpu" and len(rows) == 3 * 2 * 3
    assert {(r["attention"], r["backend"]) for r in rows} == {("sparsek+sw", "auto"), ("sparsek+linear+sw", "naive"),
                                                              ("sparsek+linear+sw", "auto")}
    for r in rows:
        if r["dtype"] == "bfloat16":
            assert r["max_abs_logit_diff"] == 0.0 and r["worst_layer"] == 1.0, r
        else:
            assert r["max_abs_logit_diff"] < 1e-5 and r["worst_layer"] > 0.999, r
