"""SparseK attention kernels against SDPA (flash, full causal) and FlexAttention (sliding window).

    PYTHONPATH=. python benchmarks/attention.py [--out DIR] [--quick]

First checks the kernels (bf16, NaN-poisoned outputs) against the naive core in float32 at a few
realistic shapes (longtrain/ops/sparsek_attention/kernel_check.py,
    as the GPU test), then times forward and forward+backward (do_bench medians, ms) for
T in 2k..128k with at least 16k tokens per batch, H = 12, k = w = 512, D = 64 (and 128 at some T).
Prints one table and writes attention.json beside it (or under --out).
Needs CUDA; imports only longtrain.ops and that check (no data or training stack).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from longtrain.ops.sparsek_attention import triton_bwd, triton_core, triton_fwd
from longtrain.ops.sparsek_attention.kernel_check import (  # noqa: F401
    CHECKS, G, H, K, TOKENS, W, check, core, grads_of, leaves, prepare,
)


def bench(fn, reps_ms=200):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")


def useful_flops(B, T, D, span):
    """Forward FLOPs of the attended pairs: 4 D per (query, key, head); span keys at most."""
    i = torch.arange(T, dtype=torch.float64)
    pairs = torch.minimum(i + 1, torch.tensor(float(span))).sum().item()
    return 4.0 * D * H * B * pairs


def sk_case(T, D, seed):
    """One benchmark case (bf16, H heads, 16k tokens per batch, k = K, w = W, seeded): its tensors, the
    core's prepared inputs and the SparseK core's forward (.fwd) and forward+backward (.fwd_bwd) on them."""
    B = max(1, TOKENS // T)
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))  # [B, T, H, D]
    keys, scan, scan_s = prepare(q, k, v, torch.randn(B, T, device="cuda"), topk=K, window=W)
    a = leaves(q, keys, scan)
    do = torch.randn_like(q)
    kw = dict(window=W, variant="hard_k_soft_v")

    def fwd():
        with torch.no_grad():
            core(*a[:2], scan, a[2], **kw, backend="triton")

    def fwd_bwd():
        o = core(*a[:2], scan, a[2], **kw, backend="triton")
        torch.autograd.grad(o, grads_of(*a), do)

    return SimpleNamespace(B=B, q=q, k=k, v=v, do=do, keys=keys, scan=scan, kw=kw, scan_s=scan_s, fwd=fwd,
                           fwd_bwd=fwd_bwd)


def time_case(T, D, do_naive):
    c = sk_case(T, D, seed=T + D)
    B, q, k, v, do = c.B, c.q, c.k, c.v, c.do
    dev = "cuda"
    row = dict(T=T, B=B, D=D)
    row["scan_ms"] = c.scan_s * 1e3  # the op's layout + selection scan (GPU on CUDA), one warm call, synchronised
    sk_f, sk_fb = c.fwd, c.fwd_bwd

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sk_fb()
    torch.cuda.synchronize()
    row["sk_extra_mem_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    row["sk_fwd"], row["sk_fb"] = bench(sk_f), bench(sk_fb)
    row["scan_share"] = row["scan_ms"] / (row["scan_ms"] + row["sk_fb"])

    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot_ = do.transpose(1, 2).contiguous()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_f():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def sdpa_fb():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.autograd.grad(o, [qt, kt, vt], dot_)

    row["sdpa_fwd"], row["sdpa_fb"] = bench(sdpa_f), bench(sdpa_fb)

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.reset()  # a fresh compile per shape: past the recompile limit flex runs eagerly (T x T)
        flex = torch.compile(flex_attention, dynamic=False)
        sw = 2 * W

        def mask_mod(b, h, qi, ki):
            return (ki <= qi) & (qi - ki < sw)

        bm = create_block_mask(mask_mod, None, None, T, T, device=dev, _compile=True)  # no T x T mask in memory

        def flex_f():
            with torch.no_grad():
                flex(qt, kt, vt, block_mask=bm)

        def flex_fb():
            o = flex(qt, kt, vt, block_mask=bm)
            torch.autograd.grad(o, [qt, kt, vt], dot_)

        row["flex_fwd"], row["flex_fb"] = bench(flex_f), bench(flex_fb)
    except Exception as e:  # report, don't hide
        row["flex_error"] = repr(e)[:200]
        row["flex_fwd"] = row["flex_fb"] = float("nan")

    if do_naive:
        r = leaves(q, c.keys, c.scan)

        def naive_f():
            return core(*r[:2], c.scan, r[2], **c.kw, backend="naive")

        def naive_fb():
            torch.autograd.grad(naive_f(), grads_of(*r), do)

        with torch.device(dev):  # naive.block_key_indices builds its band on the default device
            with torch.no_grad():
                row["naive_fwd"] = bench(naive_f, 100)
            row["naive_fb"] = bench(naive_fb, 100)
    else:
        row["naive_fwd"] = row["naive_fb"] = float("nan")

    fl = useful_flops(B, T, D, K + W)
    row["sk_tflops_fwd"] = fl / row["sk_fwd"] / 1e9
    row["sk_tflops_fb"] = 3.5 * fl / row["sk_fb"] / 1e9  # backward = 2.5 forward (FA2 convention)
    return row


def profile(T=16384, D=64):
    """Per-kernel device time of one SparseK forward+backward (torch.profiler), to see where time goes."""
    step = sk_case(T, D, seed=T + D).fwd_bwd

    step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"profile T={T} D={D} (5 steps)")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=40))


# The SparseK core's kernels by their short names (fwd, dq, pool walk, band pass), as LAUNCH names them.
SK_KERNELS = dict(fwd=triton_fwd._fwd_kernel, dq=triton_bwd._dq_kernel, walk=triton_bwd._dkv_pool_kernel,
                  band=triton_bwd._dkv_band_kernel)


def programs_per_sm(regs: int, num_warps: int, shared: int) -> tuple[int, int]:
    """Programs of one kernel that fit on a Hopper SM (64k registers, allocated per warp in units of 256;
    228 KB of shared memory, 1 KB reserved per program): (by registers, by shared memory)."""
    return 65536 // (-(-regs * 32 // 256) * 256 * num_warps), 228 * 1024 // (shared + 1024)


def kernel_resources(D=64):
    """Registers, local memory (Triton's n_spills: 4-byte words) and shared memory of each compiled kernel
    after one SparseK fwd+bwd at head dim D, and the programs per SM they allow (programs_per_sm)."""
    sk_case(4096, D, seed=D).fwd_bwd()
    torch.cuda.synchronize()
    for name, fn in SK_KERNELS.items():
        for cache in fn.device_caches.values():  # Triton 3.6: (kernel cache, ...) per device
            for k in cache[0].values():
                k._init_handles()
                md = k.metadata
                by_regs, by_smem = programs_per_sm(k.n_regs, md.num_warps, md.shared)
                print(f"resources D={D} {name}: {k.n_regs} registers, n_spills {k.n_spills}, {md.shared} B shared, "
                      f"{md.num_stages} stages; programs per SM: {by_regs} by registers, {by_smem} by shared memory",
                      flush=True)
            cache[0].clear()  # the next head dim's kernels alone


def ncu_step(T=16384, D=64):
    """One SparseK fwd+bwd and one FlexAttention SW-1024 fwd+bwd inside a CUDA profiler range, after a
    warm-up of each: run under `ncu --profile-from-start off` to read the kernels' hardware counters."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    c = sk_case(T, D, seed=T + D)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (c.q, c.k, c.v))  # [B, H, T, D]
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki < 2 * W), None, None, T, T, device="cuda",
                           _compile=True)

    def step():
        c.fwd_bwd()
        o = flex(qt, kt, vt, block_mask=bm)
        torch.autograd.grad(o, [qt, kt, vt], c.do.transpose(1, 2))

    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


_ABSENT = object()  # a launch setting the table did not have: undoing removes it


# Alternatives tried one at a time by --sweep, per head dim: "kernel.setting" keys change LAUNCH[D], plain
# names change triton_core's globals.
SWEEP = {
    64: ({"fwd.BN": 128}, {"band.KEY_MAJOR": False, "walk.KEY_MAJOR": False}, {"band.MQ": 32}, {"walk.MQ": 32},
         dict(POOL_SEGMENT=16), dict(POOL_SEGMENT=64), {"band.num_warps": 8}, {"dq.num_stages": 2},
         {"fwd.num_stages": 3}, {"walk.num_stages": 3}, {"band.num_stages": 2}, {"fwd.maxnreg": _ABSENT},
         {"dq.maxnreg": _ABSENT}, {"band.maxnreg": _ABSENT, "band.MQ": 64}, {"fwd.maxnreg": 128}, {"dq.maxnreg": 128}),
    # D = 128: the defaults spill in every kernel (Triton 3.6 sm_90); these do not, or less
    128: ({"fwd.num_warps": 8}, {"fwd.BN": 32}, {"fwd.BN": 32, "fwd.num_warps": 8}, {"dq.BN": 32},
          {"dq.BN": 32, "dq.num_warps": 8}, {"band.num_warps": 8}, {"band.MQ": 16},
          {"band.BN": 32, "band.KEY_MAJOR": False}, {"fwd.num_stages": 1, "fwd.maxnreg": 168}),
}


def apply_settings(cfg: dict, D: int) -> dict:
    """Set cfg's launch settings for head dim D (see SWEEP); returns what to pass back to undo it."""
    saved = {}
    for n, x in cfg.items():
        if "." in n:
            kern, key = n.split(".")
            entry = triton_core.LAUNCH[D][kern]
            saved[n] = entry.get(key, _ABSENT)
            if x is _ABSENT:
                entry.pop(key, None)
            else:
                entry[key] = x
        else:
            saved[n] = getattr(triton_core, n)
            setattr(triton_core, n, x)
    return saved


def sweep(D=64):
    """Time launch settings of the kernels one at a time from triton_core's defaults (fwd+bwd at 16k and 64k);
    keep a change only where it is faster at both."""
    cases = {T: sk_case(T, D, seed=T) for T in (16384, 65536)}

    def run(cfg):
        saved = apply_settings(cfg, D)
        try:
            return dict(cfg, D=D, fb16k=bench(cases[16384].fwd_bwd), fb64k=bench(cases[65536].fwd_bwd))
        except Exception as e:  # a setting the compiler rejects: report it, go on
            return dict(cfg, D=D, error=repr(e)[:200], fb16k=float("inf"), fb64k=float("inf"))
        finally:
            apply_settings(saved, D)

    out = {"runs": [run({})]}
    print("sweep", out["runs"][-1], flush=True)
    chosen = {}
    for cfg in SWEEP[D]:
        r = run(dict(chosen, **cfg))
        out["runs"].append(r)
        print("sweep", r, flush=True)
        if r["fb16k"] < out["runs"][0]["fb16k"] and r["fb64k"] < out["runs"][0]["fb64k"]:
            chosen.update(cfg)
    apply_settings(chosen, D)
    out["chosen"] = chosen
    print("chosen", D, chosen, flush=True)
    cases.clear()  # free the inputs
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--quick", action="store_true", help="T <= 16k, D = 64 only")
    ap.add_argument("--cases", default="", help="only these TxD cases, e.g. 2048x64,65536x128 (split a long run)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--sweep", default="", help="pick the kernels' launch settings first at these head dims, e.g. 64,128")
    ap.add_argument("--profile", type=int, default=0, help="profile SparseK fwd+bwd at this T and exit")
    ap.add_argument("--profile-d", type=int, default=64, help="head dim of --profile")
    ap.add_argument("--resources", default="", help="registers, shared memory and programs per SM of the kernels "
                    "at these head dims, e.g. 64,128, and exit")
    ap.add_argument("--ncu", type=int, default=0, help="one SparseK and one Flex step at this T in a profiler range (for ncu)")
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version())
    import triton

    res["triton"] = triton.__version__
    print(f"# {res['device']}  torch {res['torch']}  triton {res['triton']}", flush=True)
    if ns.profile:
        profile(ns.profile, ns.profile_d)
        return
    if ns.resources:
        for D in ns.resources.split(","):
            kernel_resources(int(D))
        return
    if ns.ncu:
        ncu_step(ns.ncu)
        return
    if not ns.no_check:
        res["checks"] = []
        for c in CHECKS:
            e = check(**c)
            res["checks"].append(dict(case={n: str(x) for n, x in c.items()}, rel_rms=e))
            ok = all(x <= 5e-3 for x in e.values())
            print("check", c, " ".join(f"{n}={x:.1e}" for n, x in e.items()), "OK" if ok else "FAIL", flush=True)
    if ns.sweep:
        res["sweep"] = {D: sweep(int(D)) for D in ns.sweep.split(",")}
    Ts = [2048, 4096, 8192, 16384] + ([] if ns.quick else [32768, 65536, 131072])
    cases = [(T, 64) for T in Ts] + ([] if ns.quick else [(T, 128) for T in (4096, 16384, 65536)])
    if ns.cases:
        want = {tuple(int(x) for x in c.split("x")) for c in ns.cases.split(",")}
        cases = [c for c in cases if c in want]
    res["rows"] = []
    path = os.path.join(ns.out, "attention.json")
    for T, D in cases:
        row = time_case(T, D, do_naive=T <= 8192)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
        with open(path, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump(res, f, indent=1)
    hdr = (
        "|  T  |  B |  D | SK fwd | SK f+b | SDPA f+b | Flex-SW1024 f+b | naive f+b | SDPA/SK | SK/Flex "
        "| scan ms (GPU) | SK TFLOP/s f+b | extra MiB |"
    )
    settings = {D: s["chosen"] for D, s in res.get("sweep", {}).items()} or "default"
    print(f"\n{res['device']}, bf16, H={H}, k=w={K}, ms (do_bench medians); settings {settings}\n")
    print(hdr)
    print("|---" * (hdr.count("|") - 1) + "|")
    for r in res["rows"]:
        print(
            f"| {r['T']} | {r['B']} | {r['D']} | {r['sk_fwd']:.3f} | {r['sk_fb']:.3f} | {r['sdpa_fb']:.3f} | "
            f"{r['flex_fb']:.3f} | {r['naive_fb']:.2f} | {r['sdpa_fb'] / r['sk_fb']:.2f} | "
            f"{r['sk_fb'] / r['flex_fb']:.2f} | "
            f"{r['scan_ms']:.2f} | {r['sk_tflops_fb']:.0f} | {r['sk_extra_mem_mb']:.0f} |"
        )
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
