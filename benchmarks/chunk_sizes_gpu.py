"""Diagnose per-chunk cost on CUDA: time each chunk call and count compiled Triton variants.

    PYTHONPATH=. python benchmarks/chunk_sizes_gpu.py

A 2-layer model (verify-equivalence's default size) reads 65,536 random tokens in chunks of
4096 and of 3001, float32, Triton backend. Prints per-chunk wall times and, after each chunk size,
how many compiled variants each kernel holds (a growing count means recompilation).
"""

import time

import torch

from longtrain.model import LM, LMConfig
from longtrain.ops.sparsek_attention import triton_bwd, triton_fwd


def variants() -> dict:
    out = {}
    for mod in (triton_fwd, triton_bwd):
        for name in dir(mod):
            fn = getattr(mod, name)
            if name.endswith("_kernel") and hasattr(fn, "device_caches"):
                try:
                    out[name] = sum(len(c[0]) for c in fn.device_caches.values())
                except (TypeError, IndexError, KeyError):  # another Triton's cache layout
                    out[name] = "?"
    return out


def main():
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=256, layers=2, d_model=128, heads=4, attention="sparsek+sw", topk=64, window=64)
    model = LM(cfg).cuda().eval()
    tokens = torch.randint(0, 256, (1, 65536), device="cuda")
    for chunk in (4096, 3001, 4096, 3001):
        cache = model.empty_cache(1, device="cuda", dtype=torch.float32)
        times = []
        with torch.no_grad():
            for s in range(0, tokens.shape[1], chunk):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model(tokens[:, s : s + chunk], cache=cache)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                cache = out.cache
        print(f"chunk {chunk}: {len(times)} calls, total {sum(times):.2f} s, first 4 {[round(t, 3) for t in times[:4]]}, "
              f"median {sorted(times)[len(times) // 2]:.3f} s, max {max(times):.3f} s; variants {variants()}", flush=True)


if __name__ == "__main__":
    main()
