"""Training throughput of `longtrain fit` at a realistic size, against two anchors in the same run.

    python benchmarks/fit_throughput.py --out DIR [--cases 768x2048,768x4096,...] [--steps 25]
    python benchmarks/fit_throughput.py --out DIR --small        # a tiny CPU version, to check the script
    python benchmarks/fit_throughput.py --out DIR --set train.compile=false --label eager   # every fit run with it
    python benchmarks/fit_throughput.py --out DIR --ab train.cuda_graphs=false --anchors ''    # A/B in one table

For each row (model × chunk length; rows × chunk >= 16k tokens per step) it runs the real CLI,
`python -m longtrain.cli fit RECIPE` in a subprocess with fit's defaults (on CUDA: compiled blocks and
a CUDA graph per chunk), once per attention type (SparseK+SW k = w = 512,
SW 1024, SparseK-only k = 1024; `--attentions` also takes sparsek+linear+sw k = w = 512 (its SparseK part on
attention.backend auto's core: the Triton one on CUDA; sparsek+linear+sw-triton names it) and linear+sw 1024, whose MFU
counts the softmax part only), and reads tokens/s over steps 5..N-1 and the peak memory from
`metrics.jsonl`. The trainer reads the device back only at its log lines (logging.every = 5 here), so
`elapsed_s` is exact at steps 5, 10, ...: the rate is taken between step 5 and the last step. Two
anchors are measured in-process on the same token counts:
  bare  the same llama model as a plain torch.compile'd module, FlexAttention's sliding window of 1024,
        no chunk cache, no scan, fused AdamW, bf16 autocast: what the trainer's overhead is measured against;
  sdpa  the same with SDPA full causal attention over the chunk (no cache: what a user who truncates
        documents to the chunk length would run).
`--set KEY=VALUE` (repeatable) passes an override to every fit run; `--ab KEY=VALUE` (repeatable)
runs every fit a second time with it and adds a row per variant (e.g. train.cuda_graphs=false). The
trainer's own memory estimate (its `memory: about ...` line) is recorded beside the measured peak.
A last pair of runs reads one synthetic document of 1M+ tokens in one row (chunk 4096) with SparseK+SW
and SW and compares the peak memory when the row is at position 16k with the peak at the end.

MFU: model FLOPs per token = 6 · (parameters in matmuls: every parameter except the input embedding
table and the norms) + 12 · layers · heads · head_dim · (mean keys per query: k + w for SparseK+SW,
w for SW, k for SparseK, the causal mean for SDPA and Flex), divided by the GPU's dense bf16 peak
(989 TFLOP/s for the H100 SXM and the H200). Writes DIR/fit_throughput[-LABEL].json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}
ATTENTIONS = {  # name -> recipe attention section
    "sparsek+sw": {"type": "sparsek+sw", "topk": 512, "window": 512},
    "sw": {"type": "sw", "window": 1024},
    "sparsek": {"type": "sparsek", "topk": 1024},
    "sparsek+linear+sw": {"type": "sparsek+linear+sw", "topk": 512, "window": 512},  # issue 38 (fla-core on CUDA)
    # the same with the Triton core named (auto takes it on CUDA since issue 38; before, auto ran the naive core:
    # 21.9k against SparseK+SW's 184.8k tokens/s, 1 row, H200, 5622eef)
    "sparsek+linear+sw-triton": {"type": "sparsek+linear+sw", "topk": 512, "window": 512, "backend": "triton"},
    "linear+sw": {"type": "linear+sw", "window": 1024},
}
FULL_CASES = "768x2048,768x4096,768x8192,768x16384,1024x4096"
SHAPES = {768: dict(layers=12, d_model=768, heads=12), 1024: dict(layers=24, d_model=1024, heads=16),
          2048: dict(layers=16, d_model=2048, heads=16)}  # 2048: head dim 128, as Llama-3-style models above 1B (issue 34)
TOKENS_PER_STEP = 16384


# ----------------------------------------------------------------------------- data


def write_corpus(folder: Path, n_docs: int, words_per_doc: int, seed: int) -> None:
    """Documents of random words from a fixed lexicon: throughput does not depend on the text."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(6000)]
    for d in range(n_docs):
        words = rng.choices(lexicon, k=words_per_doc)
        (folder / f"doc{d:03d}.txt").write_text(" ".join(words) + "\n")


def train_tokenizer(corpus: Path, out: Path, vocab: int) -> Path:
    from longtrain.data.tokenizer import train_bpe

    texts = (p.read_text()[:2_000_000] for p in sorted(corpus.glob("*.txt")))
    train_bpe(texts, vocab).save(str(out))
    return out


# ----------------------------------------------------------------------------- longtrain fit


def recipe_yaml(shape: dict, attention: dict, *, chunk: int, rows: int, steps: int, corpus: Path, tokenizer: Path,
                device: str) -> str:
    att = ", ".join(f"{k}: {v}" for k, v in attention.items())
    model = ", ".join(f"{k}: {v}" for k, v in shape.items())
    return f"""
model: {{style: llama, {model}, mlp_ratio: 4.0}}
attention: {{{att}}}
data: {{source: files, path: {corpus}, min_doc_tokens: 1024, valid: null}}
tokenizer: {{path: {tokenizer}}}
train: {{steps: {steps}, chunk_size: {chunk}, batch_docs: {rows}, lr: 3.0e-4, warmup_steps: 2, device: {device},
         valid_every: 0, seed: 0}}
checkpoint: {{every: 1000000, keep: 1}}
logging: {{every: 5, progress: false}}
"""


def run_fit(name: str, yaml_text: str, work: Path, log_dir: Path, timeout: int, overrides: list[str] = ()) -> list[dict]:
    """One `longtrain fit` in a subprocess; returns its metrics.jsonl records ([] if it failed)."""
    recipe = work / f"{name}.yaml"
    recipe.write_text(yaml_text)
    run_dir = work / f"run-{name}"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", LONGTRAIN_CACHE=str(work / "cache"))
    cmd = [sys.executable, "-m", "longtrain.cli", "fit", str(recipe), "--run-dir", str(run_dir), "--resume", "never"]
    cmd += [arg for o in overrides for arg in ("--set", o)]
    t0 = time.monotonic()
    with open(log_dir / f"fit-{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=work).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"  {name}: exit {rc}, {time.monotonic() - t0:.0f} s", flush=True)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def memory_estimate(log: Path) -> float | None:
    """The trainer's estimate of its peak memory (GiB) from the `memory: about X GiB` line of a fit log."""
    m = re.search(r"memory: about ([0-9.]+) (GiB|MiB)", log.read_text(errors="replace")) if log.is_file() else None
    return float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1) if m else None


def rate(records: list[dict], first: int, last: int) -> float | None:
    by = {r["step"]: r for r in records}
    if first not in by or last not in by:
        return None
    return (by[last]["tokens"] - by[first]["tokens"]) / (by[last]["elapsed_s"] - by[first]["elapsed_s"])


# ----------------------------------------------------------------------------- the bare anchors


class BareBlock(nn.Module):
    """longtrain's llama block (RMSNorm, RoPE, SwiGLU; the same parameter shapes), with no cache."""

    def __init__(self, d: int, heads: int, hidden: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):  # x [B, T, d]; cos, sin [T, D/2]
        B, T, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))  # [B, H, T, D]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = self.attend(q, k, v).transpose(1, 2).reshape(B, T, d)
        x = x + self.o_proj(o)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class BareLM(nn.Module):
    def __init__(self, vocab: int, layers: int, d: int, heads: int, attend):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(BareBlock(d, heads, 4 * d, attend) for _ in range(layers))
        self.norm_f = nn.RMSNorm(d, eps=1e-5)
        self.unembed = nn.Linear(d, vocab, bias=False)
        self.head_dim = d // heads

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        inv = 10000.0 ** (-torch.arange(0, self.head_dim, 2, device=tokens.device, dtype=torch.float32) / self.head_dim)
        ang = torch.arange(T, device=tokens.device, dtype=torch.float32)[:, None] * inv
        cos, sin = ang.cos(), ang.sin()
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.unembed(self.norm_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def bare_attend(kind: str, T: int, window: int, device):
    if kind == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    mask = create_block_mask(sliding, B=None, H=None, Q_LEN=T, KV_LEN=T, device=device)
    flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
    return lambda q, k, v: flex(q, k, v, block_mask=mask)


def run_bare(kind: str, shape: dict, vocab: int, chunk: int, rows: int, steps: int, device: str) -> dict:
    torch.manual_seed(0)
    dev = torch.device(device)
    model = BareLM(vocab, shape["layers"], shape["d_model"], shape["heads"], bare_attend(kind, chunk, 1024, dev)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=dev.type == "cuda")
    step_fn = torch.compile(model) if dev.type == "cuda" else model
    tokens = torch.randint(0, vocab, (rows, chunk + 1), device=dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        with autocast:
            loss = step_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter())
    first, last = 4, steps - 1  # steps 5..N as in the fit rows (1-based)
    tps = rows * chunk * (last - first) / (times[last] - times[first])
    mem = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    params = sum(p.numel() for p in model.parameters())
    del model, opt, step_fn
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens_per_s": tps, "peak_mem_bytes": mem, "params": params}


# ----------------------------------------------------------------------------- FLOPs


def flops_per_token(shape: dict, vocab: int, keys_per_query: float) -> float:
    L, d = shape["layers"], shape["d_model"]
    matmul_params = L * (4 * d * d + 3 * d * 4 * d) + d * vocab  # attention + SwiGLU + unembedding
    return 6 * matmul_params + 12 * L * d * keys_per_query  # H · head_dim = d


def keys_per_query(kind: str, chunk: int) -> float:
    """Mean keys a query attends to (longtrain's rows: a full cache, every chunk after the first)."""
    if kind in ATTENTIONS:
        a = ATTENTIONS[kind]
        return a.get("topk", 0) + a.get("window", 0)
    if kind == "sdpa":
        return (chunk + 1) / 2
    if kind == "bare":  # Flex SW-1024 from position 0 of the chunk
        return sum(min(i + 1, 1024) for i in range(chunk)) / chunk
    raise ValueError(kind)


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default=FULL_CASES,
                    help="comma list of WIDTHxCHUNK (768 = 12 x 768, 1024 = 24 x 1024, 2048 = 16 x 2048, head dim 128)")
    ap.add_argument("--attentions", default="sparsek+sw,sw,sparsek")
    ap.add_argument("--anchors", default="bare,sdpa")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--flat-tokens", type=int, default=1_050_000, help="length of the memory-flatness document (0: skip)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per fit run")
    ap.add_argument("--small", action="store_true", help="a tiny CPU configuration that checks the script")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="override for every fit run (as fit's --set)")
    ap.add_argument("--ab", action="append", default=[], help="also run every fit with this override (a row per variant)")
    ap.add_argument("--label", default="", help="suffix of the JSON file and the run names (keeps A/B runs apart)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("FIT_THROUGHPUT_WORK", "/tmp/fit_throughput"))
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    global SHAPES, ATTENTIONS, TOKENS_PER_STEP
    vocab = 8192
    if args.small:
        SHAPES = {64: dict(layers=2, d_model=64, heads=2)}
        ATTENTIONS = {"sparsek+sw": {"type": "sparsek+sw", "topk": 16, "window": 16}, "sw": {"type": "sw", "window": 32}}
        args.cases, args.attentions, args.steps, TOKENS_PER_STEP, vocab = "64x128", "sparsek+sw,sw", 10, 256, 512
        args.flat_tokens = min(args.flat_tokens, 3000)

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    commit = os.environ.get("LONGTRAIN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"device {gpu}, commit {commit or '?'}", flush=True)

    corpus = work / "corpus"
    if not corpus.is_dir():
        write_corpus(corpus, n_docs=8, words_per_doc=120_000 if not args.small else 3000, seed=0)
    tokenizer = work / "tokenizer.json"
    if not tokenizer.is_file():
        train_tokenizer(corpus, tokenizer, vocab)

    results = {"device": gpu, "commit": commit, "steps": args.steps, "overrides": args.overrides, "rows": [], "flat": []}
    if args.steps % 5 or args.steps < 10:
        ap.error("--steps must be a multiple of 5 (the log lines, where elapsed_s is exact), at least 10")
    first, last = 5, args.steps
    label = f"-{args.label}" if args.label else ""
    out_json = args.out / f"fit_throughput{label}.json"
    for case in args.cases.split(","):
        width, chunk = (int(x) for x in case.split("x"))
        shape, rows = SHAPES[width], max(1, TOKENS_PER_STEP // chunk)
        row = {"model": f"{shape['layers']}x{shape['d_model']}", "chunk": chunk, "rows": rows}
        print(f"{row['model']} chunk {chunk} x {rows} rows", flush=True)
        for variant in [None, *args.ab]:
            for name in args.attentions.split(","):
                y = recipe_yaml(shape, ATTENTIONS[name], chunk=chunk, rows=rows, steps=args.steps, corpus=corpus,
                                tokenizer=tokenizer, device=device)
                run = f"{case}-{name}{label}" + (f"-{re.sub(r'[^A-Za-z0-9]+', '_', variant)}" if variant else "")
                recs = run_fit(run, y, work, args.out, args.timeout, [*args.overrides, *([variant] if variant else [])])
                tps = rate(recs, first, last)
                mem = max((r.get("memory_bytes") or 0 for r in recs), default=None)
                key = name if variant is None else f"{name} [{variant}]"
                row[key] = {"tokens_per_s": tps, "peak_mem_bytes": mem, "estimate_gib": memory_estimate(args.out / f"fit-{run}.log"),
                            "mfu": tps * flops_per_token(shape, vocab, keys_per_query(name, chunk)) / peak if tps and peak else None}
        for kind in args.anchors.split(",") if args.anchors else []:
            try:
                r = run_bare(kind if kind == "sdpa" else "flex", shape, vocab, chunk, rows, args.steps, device)
                r["mfu"] = r["tokens_per_s"] * flops_per_token(shape, vocab, keys_per_query(kind, chunk)) / peak if peak else None
            except Exception as e:  # an anchor that fails (e.g. OOM) is reported, not fatal
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            row[kind] = r
        results["rows"].append(row)
        out_json.write_text(json.dumps(results, indent=1))

    if args.flat_tokens:
        flat_corpus = work / "flat"
        if not flat_corpus.is_dir():
            write_corpus(flat_corpus, n_docs=1, words_per_doc=int(args.flat_tokens * 0.9), seed=1)
        chunk = 4096 if not args.small else 128
        shape = SHAPES[min(SHAPES)]
        for name in ("sparsek+sw", "sw"):
            # one row reads the document from position 0 to its end: steps = its length / chunk
            steps = args.flat_tokens // chunk
            y = recipe_yaml(shape, ATTENTIONS[name], chunk=chunk, rows=1, steps=steps, corpus=flat_corpus,
                            tokenizer=tokenizer, device=device)
            recs = run_fit(f"flat-{name}{label}", y, work, args.out, args.timeout * 2, args.overrides)
            def at(p):
                return max((r["memory_bytes"] for r in recs if r["doc_positions"][0] <= p and r["doc_positions"][0] > 0),
                           default=None)
            end = max((r["doc_positions"][0] for r in recs), default=0)
            results["flat"].append({"attention": name, "chunk": chunk, "last_position": end,
                                    "peak_at_16k": at(16384), "peak_at_end": at(end),
                                    "ratio": (at(end) / at(16384)) if at(16384) else None})
        out_json.write_text(json.dumps(results, indent=1))

    print_table(results, args.ab)


def print_table(results: dict, variants: list[str] = ()) -> None:
    gib = 2**30
    cols = ["sparsek+sw", "sw", "sparsek", "bare", "sdpa"]
    # the other attentions measured (the linear types): a column each, and its time per token against SparseK+SW's
    extra = [a for a in ATTENTIONS if a not in cols and any(a in row for row in results["rows"])]
    cols += extra
    sets = f", every fit with {' '.join(results['overrides'])}" if results.get("overrides") else ""
    print(f"\ntokens/s (MFU, peak GiB, trainer's estimate GiB) on {results['device']} at {results['commit']}, "
          f"steps 5..{results['steps']}{sets}")
    print("| model | chunk × rows | variant | " + " | ".join(cols) + " | SK+SW / SW | SW / bare | SK+SW / SDPA |"
          + "".join(f" {a} time / SK+SW |" for a in extra))
    print("|---" * (len(cols) + 6 + len(extra)) + "|")
    for row in results["rows"]:
        for variant in [None, *variants]:
            key = lambda c: c if variant is None or c in ("bare", "sdpa") else f"{c} [{variant}]"  # noqa: E731
            cells = []
            for c in cols:
                r = row.get(key(c)) or {}
                if r.get("tokens_per_s"):
                    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "?"
                    mem = f"{r['peak_mem_bytes'] / gib:.1f}" if r.get("peak_mem_bytes") else "?"
                    est = f", {r['estimate_gib']:.1f}" if r.get("estimate_gib") is not None else ""
                    cells.append(f"{r['tokens_per_s'] / 1e3:.1f}k ({mfu}, {mem}{est})")
                else:
                    cells.append(r.get("error", "—")[:40])
            t = lambda c: (row.get(key(c)) or {}).get("tokens_per_s")  # noqa: E731
            ratio = lambda a, b: f"{t(a) / t(b):.2f}" if t(a) and t(b) else "—"  # noqa: E731
            print(f"| {row['model']} | {row['chunk']} × {row['rows']} | {variant or 'base'} | " + " | ".join(cells)
                  + f" | {ratio('sparsek+sw', 'sw')} | {ratio('sw', 'bare')} | {ratio('sparsek+sw', 'sdpa')} |"
                  + "".join(f" {ratio('sparsek+sw', a)} |" for a in extra))
    for f in results["flat"]:
        print(f"memory flat, {f['attention']}: peak at 16k {f['peak_at_16k']}, at {f['last_position']:,} {f['peak_at_end']}, "
              f"ratio {f['ratio']}")


if __name__ == "__main__":
    main()
