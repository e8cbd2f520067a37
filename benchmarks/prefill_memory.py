"""What a long prefill holds at its peak: the CUDA allocations alive then, by the code that made them (issue 33).

    PYTHONPATH=. python benchmarks/prefill_memory.py --out OUT_DIR [--prompts 65536,1048576] [--attentions sparsek+sw,sw]
    PYTHONPATH=. python benchmarks/prefill_memory.py --out /tmp/pm --small   # a 2 x 128 model, short prompts (a GPU still)

generate.py's random 12 x 768 model (bf16, SparseK+SW k = w = 512 and SW 1024), one prompt per length prefilled in
longtrain's chunks after an untimed warm-up of the same shapes (generate.py's warm_prefix). With the allocator's
history recorded (torch.cuda.memory._record_memory_history), the peak of the prefill alone (after the warm-up) and
of warm-up plus prefill are found by replaying the allocation events, and the blocks alive at each peak are summed
by the innermost longtrain (else torch) frame that allocated them. The difference between the lengths' tables is
what grows with the prompt. Writes OUT/prefill_memory.json and OUT/prefill_memory.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import FULL, FULL_ATTN, SMALL, SMALL_ATTN, SMALL_PROMPTS, _fresh, single_prompt, warm_prefix  # noqa: E402

from longtrain.generate import prefill, prefill_chunk_for  # noqa: E402
from longtrain.model import LM, LMConfig  # noqa: E402


def where(frames: list[dict]) -> str:
    """The innermost frame in longtrain's code (else the innermost Python frame) as file:line function."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    mine = [f for f in py if "/longtrain/" in f["filename"] or "/benchmarks/" in f["filename"]]
    f = (mine or py or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{f['filename'].split('/longtrain/')[-1].split('/site-packages/')[-1]}:{f['line']} {f['name']}"


def alive_at_peak(events: list[dict], start: int = 0) -> tuple[int, dict[int, dict]]:
    """(peak bytes, the blocks alive at the peak) over events[start:], counting blocks alive before `start` too."""
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_at = -1
    for n, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if n >= start and cur > peak:
            peak, peak_at = cur, n
    live = {}
    for e in events[:peak_at + 1]:  # replayed to the peak: its blocks
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] in ("free_requested", "free_completed"):
            live.pop(e["addr"], None)
    return peak, live


def by_site(live: dict[int, dict]) -> dict[str, int]:
    sites: collections.Counter = collections.Counter()
    for e in live.values():
        sites[where(e.get("frames", []))] += e["size"]
    return dict(sites.most_common())


def measure(model: LM, n: int, chunk: int, dev: torch.device) -> dict:
    prompt = single_prompt(model, n)
    start = _fresh(dev)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    prefill(model, warm_prefix(prompt, chunk), chunk_size=chunk)  # the kernels' compile and autotuning
    torch.cuda.synchronize(dev)
    warm_peak = torch.cuda.max_memory_allocated(dev) - start
    torch.cuda.reset_peak_memory_stats(dev)
    card = torch.cuda.current_device()
    mark = len(torch.cuda.memory._snapshot()["device_traces"][card])
    cache, _ = prefill(model, prompt, chunk_size=chunk)
    torch.cuda.synchronize(dev)
    prefill_peak = torch.cuda.max_memory_allocated(dev) - start
    events = torch.cuda.memory._snapshot()["device_traces"][card]
    torch.cuda.memory._record_memory_history(enabled=None)
    _, live_all = alive_at_peak(events)
    _, live_prefill = alive_at_peak(events, mark)
    return {"prompt_tokens": n, "chunk": chunk, "warm_peak_above_start": warm_peak, "prefill_peak_above_start": prefill_peak,
            "events": len(events), "trace_complete": len(events) < 2_000_000,
            "alive_at_prefill_peak": by_site(live_prefill), "alive_at_overall_peak": by_site(live_all),
            "kv_cache_bytes": cache.nbytes()}


def table(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| attention | prompt | warm-up peak above start MiB | prefill peak above start MiB |", "|---|---|---|---|"]
    lines += [f"| {r['attention']} | {r['prompt_tokens']:,} | {r['warm_peak_above_start'] / mib:,.1f} | "
              f"{r['prefill_peak_above_start'] / mib:,.1f} |" for r in rows]
    for name in dict.fromkeys(r["attention"] for r in rows):
        rs = [r for r in rows if r["attention"] == name]
        if len(rs) < 2:
            continue
        a, b = rs[0], rs[-1]
        sites = set(a["alive_at_prefill_peak"]) | set(b["alive_at_prefill_peak"])
        diff = sorted(((b["alive_at_prefill_peak"].get(s, 0) - a["alive_at_prefill_peak"].get(s, 0), s) for s in sites), reverse=True)
        lines += ["", f"{name}: alive at the prefill's peak, {b['prompt_tokens']:,} minus {a['prompt_tokens']:,} tokens "
                  f"(MiB, by allocating site; the largest differences)", "", "| MiB | site |", "|---|---|"]
        shown = diff[:8] + [x for x in diff[8:][-4:] if x[0] < 0]  # the largest growths, then the largest shrinks
        lines += [f"| {d / mib:+,.2f} | `{s}` |" for d, s in shown if d]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", help="prompt lengths (default 65536,1048576; --small: generate.py's small ones)")
    ap.add_argument("--attentions", default="sparsek+sw,sw")
    ap.add_argument("--chunk", type=int, help="prefill chunk (default: prefill_chunk_for the device; --small: 512)")
    ap.add_argument("--small", action="store_true", help="a 2 x 128 model and short prompts: checks the script")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_memory.py reads the CUDA allocator's history: it needs a GPU")
    dev = torch.device("cuda")
    base, attns = (SMALL, SMALL_ATTN) if a.small else (FULL, FULL_ATTN)
    prompts = tuple(int(p) for p in a.prompts.split(",")) if a.prompts else SMALL_PROMPTS if a.small else (65536, 1 << 20)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, kw in attns:
        if name not in a.attentions.split(","):
            continue
        torch.manual_seed(0)
        model = LM(LMConfig(**base, **kw)).to(dev, torch.bfloat16).eval()
        chunk = prefill_chunk_for(model, 1, a.chunk or (512 if a.small else None))
        for n in prompts:
            rows.append({"attention": name, **measure(model, n, chunk, dev)})
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("alive")}), flush=True)
        del model
        _fresh(dev)
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "model": base, "rows": rows}
    (a.out / "prefill_memory.json").write_text(json.dumps(report, indent=1))
    (a.out / "prefill_memory.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
