"""Compile the SparseK kernels for the H100 (sm_90) on a machine without a GPU and report, per kernel, what
ptxas made of them: registers, local memory (spills), shared memory, static SASS instructions, tensor-core
instructions and the programs per SM those allow. For launch-setting and kernel work between device calls
(benchmarks/gpu_notes.md): a setting that spills or drops to fewer programs per SM shows here in seconds.

    python benchmarks/kernels_aot.py [D=128] [T=4096] [kernel.key=value ...] [--dump DIR]
    python benchmarks/kernels_aot.py --linear [D=128] [T=4096] [B=1] [bwd.QB=64 ...]   # the SparseK+Linear+SW core's kernels
    python benchmarks/kernels_aot.py --glue [T=4096]   # the op's small kernels: pool tiles by position, tau's gradient

--linear compiles the linear types' core (linear_triton.py: lfwd, lbwd with its LAUNCH entry) for one
chunk of the op with the same sizes, every variant, and reports the first variant's kernels.

Settings as in kernels_ab.py (LAUNCH[D] entries, e.g. walk.num_stages=2 band.maxnreg=168; =none removes
one). --dump writes each kernel's TTGIR, PTX and SASS under DIR. The shapes are sk_case's (bf16, H = 12,
k = w = 512, 16k tokens per batch); the selection scan runs on the CPU, the kernels are compiled, not run.
Codegen depends on the Triton version: for numbers that match `attention.py --resources` on the device,
run it with the device image's Triton (3.6.0; `pip install triton==3.6.0` into a side venv).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU even where the CPU tests interpret
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # attention.py beside it, longtrain above (installed or not)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import attention as A  # noqa: E402

ARCH = 90  # H100 / H200


class _CompileOnlyDriver:
    """Stands in for the CUDA driver: names the target; kernels are compiled, never launched."""

    def get_current_target(self):
        return GPUTarget("cuda", ARCH, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _compile_only() -> list:
    """Point Triton at a stand-in driver and make every kernel launch compile instead of run; returns the list
    each launch appends (JIT function, launch settings, compiled kernel) to."""
    triton.runtime.driver.set_active(_CompileOnlyDriver())
    compiled = []

    def launcher(self, grid):
        def launch(*args, **kw):
            kernel = self.run(*args, grid=grid, warmup=True, **kw)  # compiles (or takes the cache), no launch
            compiled.append((self, kw, kernel))
        return launch

    JITFunction.__getitem__ = launcher
    return compiled


def compile_all(D: int, T: int, settings: dict) -> list:
    """(JIT function, launch settings, compiled kernel) for each kernel launch of one fwd+bwd."""
    compiled = _compile_only()
    A.apply_settings(settings, D)
    B = max(1, A.TOKENS // T)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, A.H, D, dtype=torch.bfloat16) for _ in range(3))  # [B, T, H, D]
    keys, scan, _ = A.prepare(q, k, v, torch.randn(B, T), topk=A.K, window=A.W)
    a = A.leaves(q, keys, scan)
    o = A.core(*a[:2], scan, a[2], window=A.W, variant="hard_k_soft_v", backend="triton")
    o.backward(torch.randn_like(o))  # the backward kernels see unwritten buffers: nothing runs
    return compiled


LINEAR_VARIANTS = ("hard_k_soft_v", "soft_kv", "straight_through")


def compile_linear(D: int, T: int, B: int | None = None) -> list:
    """(JIT function, launch settings, compiled kernel) for each kernel launch of one SparseK+Linear+SW chunk
    fwd+bwd per variant (bf16, A.H heads, k = A.K, w = A.W; phi the identity map; B rows, default sk_case's)."""
    from longtrain.ops.sparsek_attention.linear import SparseKLinearCache, sparsek_linear_attention_chunk

    compiled = _compile_only()
    B = B or max(1, A.TOKENS // T)
    torch.manual_seed(0)
    for variant in LINEAR_VARIANTS:
        q, k, v = (torch.randn(B, T, A.H, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        u = torch.randn(B, T, requires_grad=True)
        phi = torch.eye(D).repeat(A.H, 1, 1).requires_grad_()
        cache = SparseKLinearCache.empty(B, A.K, A.W, A.H, D, dtype=torch.bfloat16, features=D)
        o, _, _ = sparsek_linear_attention_chunk(q, k, v, u, phi, cache, variant=variant, backend="triton",
                                                 linear_backend="naive", scan="host")
        o.backward(torch.randn_like(o))  # the backward kernel sees unwritten buffers: nothing runs
    return compiled


def compile_glue(T: int) -> list:
    """(JIT function, launch settings, compiled kernel) for the op's small kernels at sk_case's sizes: the forward's
    pool tiles by position (triton_core._by_position_triton) and tau's gradient (threshold_triton.py)."""
    from longtrain.ops.selection.threshold_triton import threshold_grad_triton
    from longtrain.ops.sparsek_attention import triton_core

    compiled = _compile_only()
    B = max(1, A.TOKENS // T)
    nt = -(-T // triton_core.QUERY_TILE)
    i32 = torch.zeros(B, nt, A.K, dtype=torch.int32)
    triton_core._by_position_triton(i32, i32, i32.float(), torch.zeros(B, A.K + A.W - 1 + T, dtype=torch.int64))
    u = torch.zeros(B, T)
    threshold_grad_triton(u, u.double(), u.long(), torch.full((B,), T), u, A.W)
    return compiled


def report(name: str, kw: dict, kernel, dump: str | None) -> str:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([f"{tools}/cuobjdump", "--dump-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(kernel.asm[ext])
        with open(os.path.join(dump, f"{name}.sass"), "w") as f:
            f.write(sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    md = kernel.metadata
    programs = min(A.programs_per_sm(regs, md.num_warps, md.shared))
    n = {key: len(re.findall(pat, sass, re.M)) for key, pat in
         dict(ldl=r"\bLDL", stl=r"\bSTL", sass=r"^\s+/\*[0-9a-f]{4,}\*/", hgmma=r"\bHGMMA", hmma=r"\bHMMA").items()}
    settings = " ".join(f"{x}={kw[x]}" for x in ("QB", "BN", "MQ", "num_warps", "num_stages", "maxnreg", "DOTS") if kw.get(x) is not None)
    return (f"{name:5s} {settings:44s} regs {regs:3d}  stack {stack:4d} B  spill ld/st {n['ldl']:3d}/{n['stl']:3d}  "
            f"shared {md.shared:6d} B  SASS {n['sass']:5d}  HGMMA {n['hgmma']:3d}  HMMA {n['hmma']:3d}  "
            f"programs/SM {programs}")


def main(argv: list[str]) -> None:
    dump = None
    linear, glue = "--linear" in argv, "--glue" in argv
    argv = [a for a in argv if a not in ("--linear", "--glue")]
    if "--dump" in argv:
        i = argv.index("--dump")
        dump, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    opts = dict(a.split("=", 1) for a in argv)
    D, T = int(opts.pop("D", 64)), int(opts.pop("T", 4096))
    settings = {n: A._ABSENT if x == "none" else int(x) for n, x in opts.items()}
    if glue:
        from longtrain.ops.selection import threshold_triton as TT
        from longtrain.ops.sparsek_attention import triton_fwd as F

        print(f"# Triton {triton.__version__}, sm_{ARCH}, T = {T}; the op's small kernels")
        names = {F._by_position_kernel: "bypos", TT._query_sums_kernel: "tsums", TT._key_grads_kernel: "tkeys"}
        compiled = compile_glue(T)
    elif linear:
        from longtrain.ops.sparsek_attention import linear_triton as LT

        key = max([x for x in LT.LAUNCH if x <= D], default=min(LT.LAUNCH))
        for name, x in settings.items():  # fwd.QB=64, bwd.num_warps=8: this run's LAUNCH[D] entry
            if name != "B":
                kernel, field = name.split(".", 1)
                LT.LAUNCH[key][kernel][field] = x
        print(f"# Triton {triton.__version__}, sm_{ARCH}, D = {D}, T = {T}; SparseK+Linear+SW, linear_triton.LAUNCH"
              f"[{key}] with {opts or 'no changes'}")
        names = {LT._fwd_kernel: "lfwd", LT._bwd_kernel: "lbwd"}
        compiled = compile_linear(D, T, int(opts.get("B", 0)) or None)
    else:
        print(f"# Triton {triton.__version__}, sm_{ARCH}, D = {D}, T = {T}; LAUNCH[{D}] with {opts or 'no changes'}")
        names = {fn: name for name, fn in A.SK_KERNELS.items()}  # (the cut kernel is not reported)
        compiled = compile_all(D, T, settings)
    seen = set()
    for fn, kw, kernel in compiled:
        if fn in names and fn not in seen:  # (one line per kernel: every launch shares its settings)
            seen.add(fn)
            print(report(names[fn], kw, kernel, dump), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
