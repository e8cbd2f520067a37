"""Generation speed and memory: decode tokens/s and peak GPU memory after prompts of 4k, 64k and 1M tokens.

    PYTHONPATH=. python benchmarks/generate.py --out OUT_DIR            # the device run (about 5 minutes on an H100)
    PYTHONPATH=. python benchmarks/generate.py --small --out /tmp/gen   # a tiny CPU version, to check the script

A 12 x 768 model (gpt2 style, 12 heads, vocab 8192, random weights, bf16) with SparseK+SW (k = w =
512), a sliding window of 1024 (the same KV budget) and full attention (where it fits). Per row:
the prompt (random tokens) is prefilled in chunks of 8192, then NEW tokens are decoded greedily,
the sampled token fed back on the device (no host round trip per token):

  - decode tok/s (graph): `longtrain.generate.Decoder`, the decode step replayed as a CUDA graph;
  - decode tok/s (eager): the same step launched op by op;
  - chunk op, L = 1: the chunk op on one token (`model(tokens[:, None], cache)`), the path a token
    took before the decode step (first prompt length only);
  - peak memory: the CUDA allocator's peak over prefill and decoding, weights included;
  - peak above start: that peak less what was allocated when the row started (the weights and, on
    the H100, about one KV cache left behind by each earlier row in the same process).

With SparseK+SW the cache holds k + w - 1 entries per layer whatever the prompt, so the 64k and 1M
rows must need the same memory within 5% (peak above start): the script checks and reports it. Full attention
is skipped at 1M: its O(n^2) prefill alone would take far longer than this benchmark. Writes
OUT/generate.json and OUT/generate.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from longtrain.generate import Decoder, prefill
from longtrain.model import LM, LMConfig

FULL = dict(vocab_size=8192, layers=12, d_model=768, heads=12, style="gpt2")
FULL_ATTN = [("sparsek+sw", dict(attention="sparsek+sw", topk=512, window=512)),
             ("sw", dict(attention="sw", window=1024)),
             ("full", dict(attention="full"))]
FULL_PROMPTS = (4096, 65536, 1 << 20)
SMALL = dict(vocab_size=512, layers=2, d_model=64, heads=4, style="gpt2")
SMALL_ATTN = [("sparsek+sw", dict(attention="sparsek+sw", topk=16, window=16)),
              ("sw", dict(attention="sw", window=32)),
              ("full", dict(attention="full"))]
SMALL_PROMPTS = (256, 2048, 8192)
FULL_ATTENTION_MAX = 65536  # longer prompts: full attention's O(n^2) prefill is beyond this benchmark


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak: only indicative


@torch.no_grad()
def decode_rate(model: LM, cache, first: torch.Tensor, steps: int, *, cuda_graph: bool) -> tuple[float, float, str | None]:
    """(tokens/s, seconds to set up, why no graph) of `steps` greedy decode steps from `cache`, tokens fed back on the device."""
    dev = first.device
    t0 = time.perf_counter()
    dec = Decoder(model, cache, cuda_graph=None if cuda_graph else False)  # a failed capture: eager, and says why
    token = first
    for _ in range(2):  # warm: allocator, first launches
        token = dec.step(token).argmax(-1)
    _sync(dev)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        token = dec.step(token).argmax(-1)
    _sync(dev)
    return steps / (time.perf_counter() - t0), setup, dec.graph_error


@torch.no_grad()
def chunk_op_rate(model: LM, cache, first: torch.Tensor, steps: int) -> float:
    """tokens/s of one-token chunks through the chunk op (scan, extended layout, core): the path before decode."""
    token = first
    for _ in range(2):
        out = model(token[:, None], cache=cache)
        cache, token = out.cache, out.logits[:, -1].argmax(-1)
    _sync(first.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(token[:, None], cache=cache)
        cache, token = out.cache, out.logits[:, -1].argmax(-1)
    _sync(first.device)
    return steps / (time.perf_counter() - t0)


def run_row(model: LM, name: str, n_prompt: int, *, chunk: int, new: int, legacy: bool, dev: torch.device) -> dict:
    row = {"attention": name, "prompt_tokens": n_prompt}
    if name == "full" and n_prompt > FULL_ATTENTION_MAX:
        return row | {"skipped": f"full attention's O(n^2) prefill of {n_prompt:,} tokens is beyond this benchmark"}
    g = torch.Generator().manual_seed(n_prompt)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, n_prompt), generator=g)  # stays on the host: chunks go over
    if dev.type == "cuda":
        gc.collect()  # the previous row's decoders (CUDA graphs, caches) must not count in this row's peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        row["allocated_at_start_bytes"] = torch.cuda.memory_allocated(dev)  # the weights, and nothing else
    _sync(dev)
    t0 = time.perf_counter()
    cache, logits = prefill(model, prompt, chunk_size=chunk)
    _sync(dev)
    row["prefill_s"] = time.perf_counter() - t0
    row["prefill_tokens_per_s"] = n_prompt / row["prefill_s"]
    first = logits.argmax(-1)
    graph = dev.type == "cuda" and name != "full"
    rate, setup, graph_error = decode_rate(model, cache, first, new, cuda_graph=graph)
    row |= {"decode_tokens": new, "decode_tokens_per_s": rate, "cuda_graph": graph and graph_error is None,
            "decode_setup_s": setup}
    if graph_error:
        row["cuda_graph_error"] = graph_error
    if graph:
        row["decode_tokens_per_s_eager"] = decode_rate(model, cache, first, max(new // 4, 8), cuda_graph=False)[0]
    if legacy and name != "full":
        row["chunk_op_tokens_per_s"] = chunk_op_rate(model, cache, first, max(new // 8, 8))
    row["peak_memory_bytes"] = peak_bytes(dev)
    row["kv_cache_bytes"] = cache.nbytes()
    row["kv_entries_per_layer"] = cache.kv_entries_per_layer
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for generate.json and generate.md")
    ap.add_argument("--small", action="store_true", help="a tiny model and short prompts on the CPU (checks the script)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens decoded per row (default 256; --small 16)")
    ap.add_argument("--prompts", type=str, default=None, help="comma-separated prompt lengths")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 8192; --small 512)")
    ap.add_argument("--attentions", type=str, default=None, help="comma-separated subset of sparsek+sw,sw,full")
    args = ap.parse_args()

    dev = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    base, attns, prompts = (SMALL, SMALL_ATTN, SMALL_PROMPTS) if args.small else (FULL, FULL_ATTN, FULL_PROMPTS)
    if args.prompts:
        prompts = tuple(int(p) for p in args.prompts.split(","))
    if args.attentions:
        attns = [(n, kw) for n, kw in attns if n in args.attentions.split(",")]
    new = args.new_tokens or (16 if args.small else 256)
    chunk = args.chunk or (512 if args.small else 8192)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console()

    rows = []
    for name, kw in attns:
        torch.manual_seed(0)
        model = LM(LMConfig(**base, **kw)).to(dev, dtype).eval()
        for i, n in enumerate(prompts):
            row = run_row(model, name, n, chunk=chunk, new=new, legacy=i == 0, dev=dev)
            rows.append(row)
            console.print(json.dumps(row), highlight=False)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    sk = {r["prompt_tokens"]: r for r in rows if r["attention"] == "sparsek+sw" and "peak_memory_bytes" in r}
    big = sorted(sk)[-2:]
    check = None
    if len(big) == 2:
        # The row's own memory: its peak over what was allocated when it started (the weights, and on a
        # GPU whatever earlier rows left behind: ~one KV cache per row was measured there, see benchmarks/README).
        a, b = (working_bytes(sk[n]) for n in big)
        check = {"prompts": big, "working_bytes": [a, b], "peak_memory_bytes": [sk[n]["peak_memory_bytes"] for n in big],
                 "ratio": b / a, "within_5_percent": abs(b / a - 1) <= 0.05}
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "commit": _commit(), "dtype": str(dtype).removeprefix("torch."),
        "model": {**base, "params": sum(p.numel() for p in LM(LMConfig(**base, **attns[0][1])).parameters())},
        "prefill_chunk": chunk, "new_tokens": new, "rows": rows, "sparsek_peak_memory_check": check,
    }
    (args.out / "generate.json").write_text(json.dumps(report, indent=1))
    table = render(report)
    console.print(table)
    (args.out / "generate.md").write_text(markdown(report))
    if check is not None:
        verdict = "yes" if check["within_5_percent"] else "NO"
        console.print(f"SparseK+SW peak above start at {big[0]:,} vs {big[1]:,} tokens: ratio {check['ratio']:.4f}; within 5%: {verdict}")


def working_bytes(r: dict) -> int:
    """A row's peak memory above what was allocated when it started (the whole peak where not recorded)."""
    return r["peak_memory_bytes"] - r.get("allocated_at_start_bytes", 0)


def _cells(r: dict) -> list[str]:
    mib = 2**20
    if "skipped" in r:
        return [r["attention"], f"{r['prompt_tokens']:,}", "skipped", "", "", "", "", "", "", r["skipped"]]
    return [
        r["attention"], f"{r['prompt_tokens']:,}", f"{r['prefill_tokens_per_s']:,.0f}", f"{r['decode_tokens_per_s']:,.1f}",
        f"{r['decode_tokens_per_s_eager']:,.1f}" if "decode_tokens_per_s_eager" in r else "—",
        f"{r['chunk_op_tokens_per_s']:,.1f}" if "chunk_op_tokens_per_s" in r else "—",
        f"{r['peak_memory_bytes'] / mib:,.0f}", f"{working_bytes(r) / mib:,.0f}", f"{r['kv_entries_per_layer']:,}",
        f"{r['kv_cache_bytes'] / mib:,.1f}",
    ]


HEAD = ["attention", "prompt tokens", "prefill tok/s", "decode tok/s", "decode tok/s (eager)", "chunk op, L = 1 (tok/s)",
        "peak memory (MiB)", "peak above start (MiB)", "KV entries / layer", "cache (MiB)"]


def render(report: dict) -> Table:
    t = Table(title=f"generation on {report['device']} ({report['dtype']}, {report['new_tokens']} new tokens)")
    for h in HEAD:
        t.add_column(h, justify="right")
    for r in report["rows"]:
        t.add_row(*_cells(r))
    return t


def markdown(report: dict) -> str:
    lines = [f"generation on {report['device']}, {report['dtype']}, commit {report['commit']}, "
             f"{report['new_tokens']} new tokens, prefill chunks of {report['prefill_chunk']}", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in report["rows"]]
    c = report["sparsek_peak_memory_check"]
    if c:
        lines += ["", f"SparseK+SW peak above start {c['prompts'][0]:,} vs {c['prompts'][1]:,} tokens: ratio {c['ratio']:.4f} "
                      f"(within 5%: {'yes' if c['within_5_percent'] else 'no'})"]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    if os.environ.get("LONGTRAIN_COMMIT"):  # a copy of the tree without its git history (the device)
        return os.environ["LONGTRAIN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
