"""Does a matmul's row depend on how many rows it is computed with? (issue 24)

A chunked pass computes the model's linear layers on chunk-sized row counts, the unchunked pass on the
whole document; if the library picks kernels whose per-row sums differ by row count, the two passes
differ by a rounding step there, which a deep bf16 model carries into its selections. Prints, per
shape of the gutenberg-sparsek model and per dtype, the fraction of outputs that differ between one
matmul over 1M rows and the same rows in chunks, and (decode: one token a step, issue 33) the first 512 rows
one at a time and 64 at a time.
"""

import torch


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    M = 1 << 20 if dev == "cuda" else 1 << 14
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for k, n in ((256, 256), (256, 1024), (1024, 256), (256, 2048), (128, 384)):
            x = torch.randn(M, k, device=dev, generator=g).to(dtype)
            w = torch.randn(n, k, device=dev, generator=g).to(dtype) * k**-0.5
            whole = torch.nn.functional.linear(x, w)
            cells = []
            for c in (4096, 3001, 1000, 777):
                part = torch.cat([torch.nn.functional.linear(x[s : s + c], w) for s in range(0, M, c)])
                cells.append(f"{c}: {(part != whole).float().mean().item():.2e}")
            for c in (64, 1):  # a decode step's row counts, on the first 512 rows
                part = torch.cat([torch.nn.functional.linear(x[s : s + c], w) for s in range(0, 512, c)])
                cells.append(f"{c}: {(part != whole[:512]).float().mean().item():.2e}")
            print(f"{str(dtype):15} [{M}, {k}] x [{k}, {n}]  differing outputs  " + ", ".join(cells), flush=True)
            del x, whole


if __name__ == "__main__":
    main()
