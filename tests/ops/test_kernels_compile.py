"""The Triton kernels compile for the H100 (sm_90) with the launch settings the GPU path uses.

The interpreter tests (test_triton.py) never run Triton's GPU compiler, which has crashed on kernels the
interpreter ran (benchmarks/gpu_notes.md, v6a): this compiles every kernel of one fwd+bwd per head dim
through benchmarks/kernels_aot.py (no GPU needed) and reads its report.
"""

import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KERNELS = ["fwd", "dq", "walk", "band"]  # (attention.SK_KERNELS)


@pytest.mark.skipif(not os.path.exists(os.path.join(TOOLS, "cuobjdump")), reason="Triton without its CUDA tools")
@pytest.mark.parametrize("D", [64, 128])
def test_kernels_compile_for_sm90(D):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "benchmarks/kernels_aot.py", f"D={D}", "T=2048"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): m for m in re.finditer(r"^(\w+) .*regs (\d+) .*shared +(\d+) B .*programs/SM (\d+)$",
                                               proc.stdout, re.M)}
    assert sorted(rows) == sorted(KERNELS), proc.stdout
    for name, m in rows.items():
        regs, programs = int(m.group(2)), int(m.group(4))
        assert 0 < regs <= 255 and programs >= 1, m.group(0)
