"""Tokenize a folder of documents cold, then warm through the token cache.

    python benchmarks/data_pipeline.py [FOLDER] [--vocab-size 8192] [--min-doc-tokens 4096]

Each phase runs in its own process so its peak RSS is its own. Cold starts
from an empty cache (trains the tokenizer, tokenizes, writes the cache); warm
opens the same cache. Prints a table and writes data_pipeline.json beside
this script.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = HERE.parent / ".." / "shared" / "data" / "gutenberg" / "train"


def phase(folder: str, cache: str, vocab_size: int, min_doc_tokens: int) -> dict:
    from longtrain.data import DataConfig, TokenizerConfig, prepare_corpus

    t0 = time.perf_counter()
    corpus = prepare_corpus(
        DataConfig(source="files", path=folder, min_doc_tokens=min_doc_tokens),
        TokenizerConfig(vocab_size=vocab_size),
        cache_dir=Path(cache) / "tokens",
    )
    seconds = time.perf_counter() - t0
    s = corpus.stats["train"]
    return {
        "documents": s["docs_read"],
        "kept": s["kept"],
        "tokens": s["tokens"],
        "seconds": seconds,
        "tokenize_seconds": s["seconds"],  # the token cache step alone (cold: encode + write)
        "tokens_per_s": s["tokens"] / seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "cache_hit": s["cache_hit"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default=str(DEFAULT))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--min-doc-tokens", type=int, default=4096)
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase, print JSON
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.folder, args.cache, args.vocab_size, args.min_doc_tokens)))
        return

    rows = {}
    with tempfile.TemporaryDirectory(prefix="longtrain-bench-") as cache:
        for name in ("cold", "warm"):
            cmd = [sys.executable, __file__, args.folder, "--phase", name, "--cache", cache,
                   "--vocab-size", str(args.vocab_size), "--min-doc-tokens", str(args.min_doc_tokens)]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows[name] = json.loads(out.strip().splitlines()[-1])

    print(f"\n{args.folder}  (vocab {args.vocab_size}, {os.cpu_count()} CPUs)")
    print(f"{'phase':<6} {'documents':>9} {'kept':>5} {'tokens':>12} {'seconds':>8} {'tokens/s':>11} {'peak RSS MB':>11}")
    for name, r in rows.items():
        print(f"{name:<6} {r['documents']:>9} {r['kept']:>5} {r['tokens']:>12,} {r['seconds']:>8.2f} "
              f"{r['tokens_per_s']:>11,.0f} {r['peak_rss_mb']:>11.0f}")
    result = {"folder": str(Path(args.folder).resolve()), "vocab_size": args.vocab_size,
              "min_doc_tokens": args.min_doc_tokens, "cpus": os.cpu_count(), **rows}
    (HERE / "data_pipeline.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {HERE / 'data_pipeline.json'}")


if __name__ == "__main__":
    main()
