"""The Triton kernels compile for the H100 (sm_90) with the launch settings the GPU path uses.

The interpreter tests (test_triton.py) never run Triton's GPU compiler, which has crashed on kernels the
interpreter ran (benchmarks/gpu_notes.md, v6a): this compiles every kernel of one fwd+bwd per head dim
through benchmarks/kernels_aot.py (no GPU needed: Triton's wheel ships ptxas and cuobjdump) and reads its
report. Without those tools it skips on a developer's machine and fails in CI (.ci/run sets CI=true), so CI
never passes without having compiled the kernels.
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


@pytest.fixture(scope="module")
def cuda_tools():
    missing = [t for t in ("ptxas", "cuobjdump") if not os.path.exists(os.path.join(TOOLS, t))]
    if missing:
        why = f"Triton {triton.__version__} ships without {missing} in {TOOLS}"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI must compile the kernels for sm_90 (install a Triton wheel that has them)")
        pytest.skip(why)


# (kernels_aot.py's arguments, the kernels it reports): SparseK+SW's fwd+bwd, the linear types' core (issue 38), and
# the op's small kernels (pool tiles by position, tau's gradient)
CORES = {"sparsek": (["T=2048"], KERNELS), "linear": (["--linear", "T=1024", "B=1"], ["lbwd", "lfwd"]),
         "linear-native": (["--linear", "T=1024", "B=1", "fwd.native=1", "bwd.native=1"], ["lbwd", "lfwd"]),
         "glue": (["--glue"], ["bypos", "tkeys", "tsums"])}  # the op's small kernels (the same at both head dims)


@pytest.mark.parametrize("core", sorted(CORES))
@pytest.mark.parametrize("D", [64, 128])
def test_kernels_compile_for_sm90(D, core, cuda_tools):
    args, kernels = CORES[core]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "benchmarks/kernels_aot.py", f"D={D}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): m for m in re.finditer(r"^(\w+) .*regs +(\d+) .*shared +(\d+) B .*programs/SM (\d+)$",
                                               proc.stdout, re.M)}
    assert sorted(rows) == sorted(kernels), proc.stdout + proc.stderr[-3000:]
    for name, m in rows.items():
        regs, programs = int(m.group(2)), int(m.group(4))
        assert 0 < regs <= 255 and programs >= 1, m.group(0)
