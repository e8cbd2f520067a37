"""benchmarks/prefill_memory.py's replay of the CUDA allocator's history, on hand-made events (the script needs a GPU):
the peak, the blocks alive at it, and the table of what grows with the prompt."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("prefill_memory", ROOT / "benchmarks" / "prefill_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


EVENTS = [
    {"action": "alloc", "addr": 1, "size": 100, "frames": [frame("/x/torch/nn/functional.py", 5, "linear"),
                                                          frame("/r/longtrain/model/attention.py", 144, "project")]},
    {"action": "alloc", "addr": 2, "size": 50, "frames": [frame("/x/site-packages/torch/functional.py", 9, "einsum")]},
    {"action": "free_requested", "addr": 1, "size": 100},
    {"action": "free_completed", "addr": 1, "size": 100},  # freed once, however many events say so
    {"action": "alloc", "addr": 3, "size": 70, "frames": []},
    {"action": "segment_alloc", "addr": 9, "size": 1 << 20},  # segments are not blocks
]


def test_the_peak_and_its_blocks_by_the_innermost_longtrain_frame():
    pm = load()
    peak, live = pm.alive_at_peak(EVENTS)
    assert peak == 150 and set(live) == {1, 2}
    assert pm.by_site(live) == {"model/attention.py:144 project": 100, "torch/functional.py:9 einsum": 50}
    peak, live = pm.alive_at_peak(EVENTS, start=3)  # after the first block's free: block 2 (earlier) still counts
    assert peak == 120 and set(live) == {2, 3}


def test_the_table_shows_what_grows_with_the_prompt():
    pm = load()
    mib = 1 << 20

    def row(n, alive):
        return {"attention": "sparsek+sw", "prompt_tokens": n, "warm_peak_above_start": 3 * mib,
                "prefill_peak_above_start": 2 * mib, "alive_at_prefill_peak": alive}

    text = pm.table([row(65536, {"a": mib, "b": 2 * mib}), row(1048576, {"a": 4 * mib, "b": mib, "c": mib})])
    assert "| sparsek+sw | 1,048,576 | 3.0 | 2.0 |" in text
    lines = text.splitlines()
    growth = [x for x in lines if x.startswith("| +") or x.startswith("| -")]
    assert growth == ["| +3.00 | `a` |", "| +1.00 | `c` |", "| -1.00 | `b` |"]
