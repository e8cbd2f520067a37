"""benchmarks/fit_throughput.py's table: an attention beyond the fixed columns (the linear types, issue 38) gets a
column and its training time per token against SparseK+SW's."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fit_throughput  # noqa: E402


def test_the_linear_types_get_a_column_and_a_time_ratio(capsys):
    r = lambda tps: {"tokens_per_s": tps, "mfu": 0.2, "peak_mem_bytes": 2**30}  # noqa: E731
    results = {"device": "X", "commit": "c", "steps": 30, "flat": [],
               "rows": [{"model": "12x768", "chunk": 4096, "rows": 4, "sparsek+sw": r(300e3), "sw": r(400e3),
                         "sparsek+linear+sw": r(240e3)}]}
    fit_throughput.print_table(results)
    head, rule, line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("|")]
    assert "| sparsek+linear+sw |" in head and head.endswith(" sparsek+linear+sw time / SK+SW |")
    assert "240.0k (20.0%, 1.0)" in line and line.endswith(" 1.25 |")  # 300k / 240k: 1.25x the time
    assert head.count("|") == line.count("|") == rule.count("|")
    assert " 0.75 |" in line  # SK+SW / SW still there
