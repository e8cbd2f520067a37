"""benchmarks/card_numerics.py on the CPU (--small): it runs, reads the recipe's product shapes, and its bf16
products' errors against float64 are bfloat16-sized (so a card whose error is far larger stands out)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_card_numerics_small_reports_every_product_of_the_recipe_with_its_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "card_numerics.py"), "--small", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "card_numerics.json").read_text())
    assert report["device"] == "cpu" and report["recipe"] == "recall-circuit"
    rows = report["products"]
    assert {r["product"] for r in rows} == {"forward", "input_grad", "weight_grad"}
    assert all(r["in"] == 256 for r in rows)  # recall-circuit's d_model
    for r in rows:
        for key in ("rel_err_bf16_reduce_on", "rel_err_bf16_reduce_off"):
            assert 1e-5 < r[key] < 2e-2, r  # bf16 outputs of a float32 accumulation: ~2^-9, never exact
        assert r["same_bits"] and r["kernels_bf16_reduce_on"], r  # the CPU has no reduced-precision split-K
    assert "attention" in " ".join(report["sdpa"]["kernels"])
