"""Generation speed and memory: prefill and decode tokens/s, single and batched, and decode == chunked forward in bf16.

    PYTHONPATH=. python benchmarks/generate.py --out OUT_DIR --compile  # the device run (under 8 minutes on an H100)
    PYTHONPATH=. python benchmarks/generate.py --small --out /tmp/gen   # a tiny CPU version, to check the script

A 12 x 768 model (gpt2 style, 12 heads, vocab 8192, random weights, bf16) with SparseK+SW (k = w =
512), a sliding window of 1024 (the same KV budget) and full attention (where it fits).

  single   one prompt (random tokens) of 4k, 64k and 1M tokens, prefilled in longtrain's chunks (65,536 tokens here), then NEW
           tokens decoded greedily, the sampled token fed back on the device (no host round trip):
             - graph: `longtrain.generate.Decoder`, the whole step (every layer, the sampler, the
               cache written back, the token fed back) replayed as one CUDA graph;
             - compiled: the same with the step through torch.compile first (--compile);
             - eager: the same step launched op by op;
  batched  BATCH rows (default 64) of prompts between half and all of BATCH_PROMPT tokens (different
           lengths: the ragged prefill), decoded together; tokens/s over all rows;
  modes    --modes in_place,rebuild: the graph decoding again with Decoder(in_place=True) (the ring layout,
           K/V written in place) or in_place=False (the cache rebuilt every step), and compiled with --compile;
           the other rows use Decoder's default (in place for several rows or a compiled step); --modes exact:
           Decoder(exact=True), each token a one-token chunk of the forward (eager; its logits bitwise the forward's);
           --modes floor: the step and the single rows' prefill with the attention op replaced by elementwise work
           on the op's inputs (attention_floor): the rest of their time, a floor; minus it, what the op costs;
  profile  --profile-prefill N: torch.profiler over the N-token prompt's prefill (wall against kernel time, launches);
           always: torch.profiler over 20 decode steps (CUDA): eager after the shortest prompt and in the batch,
           and with --compile the compiled step's graph replays (the profiler names the kernels a graph
           launches); the kernels by device time per step and the launches per step (JSON only);
  inductor --inductor freezing=0[,combo_kernels=0,...]: torch._inductor.config for the compiled rows, over
           Decoder's COMPILE_OPTIONS (freezing=0,combo_kernels=0: Inductor's defaults; issue 33's levers: freezing
           folds the weights into the step, so Inductor's concat-linear pass turns q, k, v and the MLP's gate and
           up into one product each; combo_kernels launches independent small kernels as one);
  warm     each prefill is timed after an untimed one of the same shapes (warm_prefix: a single prompt's
           first chunks; the batch itself), so that no row times the kernels' compile and autotuning;
  check    decode == chunked forward in bf16 (SparseK+SW): after a CHECK_PROMPT-token prompt, the same
           CHECK_TOKENS tokens once as one chunk through the forward (the chunk op, device scan) and
           once token by token through the decode step; per layer, the positions whose selection
           (fingerprint of the selected positions) differs, and the largest |logit difference|.

Peak memory is the CUDA allocator's peak over the row; "above start" subtracts what was allocated when
the row started. With SparseK+SW the cache holds k + w - 1 entries per layer whatever the prompt, so the
two longest single rows must need the same memory within 5%. Rows stop being started once --budget-s
seconds have passed (their entries say so); results are written after every row. Writes OUT/generate.json
and OUT/generate.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from rich.console import Console

from longtrain.generate import Decoder, exact_step, prefill, prefill_chunk_for
from longtrain.model import LM, LMConfig

FULL = dict(vocab_size=8192, layers=12, d_model=768, heads=12, style="gpt2")
FULL_ATTN = [("sparsek+sw", dict(attention="sparsek+sw", topk=512, window=512)),
             ("sw", dict(attention="sw", window=1024)),
             ("full", dict(attention="full"))]
FULL_PROMPTS = (4096, 65536, 1 << 20)
# --modes: Decoder keyword arguments; exact: one-token chunks of the forward (bitwise its logits; eager, not compiled);
# floor: Decoder's default with the attention op replaced (attention_floor: the step's cost without the op)
MODES = {"in_place": {"in_place": True}, "rebuild": {"in_place": False}, "exact": {"exact": True}, "floor": {}}
SMALL = dict(vocab_size=512, layers=2, d_model=64, heads=4, style="gpt2")
SMALL_ATTN = [("sparsek+sw", dict(attention="sparsek+sw", topk=16, window=16)),
              ("sw", dict(attention="sw", window=32)),
              ("full", dict(attention="full"))]
SMALL_PROMPTS = (256, 2048)
FULL_ATTENTION_MAX = 65536  # longer prompts: full attention's O(n^2) prefill is beyond this benchmark


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak: only indicative


def _fresh(dev: torch.device) -> int:
    """Forget the previous row (decoders, graphs, caches); what is still allocated (the weights)."""
    gc.collect()
    if dev.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


@torch.no_grad()
def decode_rate(model: LM, cache, logits: torch.Tensor, steps: int, *, graph: bool, compile: bool = False,
                profile: bool = False, **decoder_kw) -> dict:
    """Greedy decoding of `steps` tokens per row from `cache`, the sampled tokens fed back on the device:
    {tokens_per_s (all rows), setup_s (capture, compile), graph, compiled, error}; profile: and the
    kernels of 20 more steps (the graph's replays: the profiler names the kernels a graph launches)."""
    dev = logits.device
    t0 = time.perf_counter()
    # a failed capture: eager, says why
    dec = Decoder(model, cache, cuda_graph=None if graph else False, compile=compile, **decoder_kw)
    dec.start(logits)
    for _ in range(2):  # warm: allocator, first launches
        dec.advance()
    _sync(dev)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        dec.advance()
    _sync(dev)
    rate = steps * cache.batch_size / (time.perf_counter() - t0)
    out = {"tokens_per_s": rate, "setup_s": setup, "graph": dec.graph is not None, "compiled": dec.compiled,
           "error": dec.graph_error}
    if profile and dev.type == "cuda":
        try:
            out["profile"] = _profile_steps(dec, 20)
        except Exception as e:  # the profiler is a help, never the reason the row is lost
            out["profile"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def single_prompt(model: LM, n_prompt: int) -> torch.Tensor:
    """[1, n_prompt] random tokens, the same for every attention type (on the host: chunks go over)."""
    g = torch.Generator().manual_seed(n_prompt)
    return torch.randint(0, model.cfg.vocab_size, (1, n_prompt), generator=g)


def batched_prompts(model: LM, rows: int, n_prompt: int) -> list[list[int]]:
    """`rows` random prompts of n_prompt/2 .. n_prompt tokens (ragged)."""
    g = torch.Generator().manual_seed(rows)
    lengths = torch.randint(n_prompt // 2, n_prompt + 1, (rows,), generator=g).tolist()
    return [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def timed_prefill(model: LM, prompts, *, chunk: int, dev: torch.device, warm_with=None) -> tuple[object, torch.Tensor, float]:
    """prefill(model, prompts) and its seconds, after an untimed prefill of `warm_with` (if given): the kernels'
    first launches for these shapes (Triton's compile and autotuning) are then not timed."""
    if warm_with is not None:
        prefill(model, warm_with, chunk_size=chunk)
    _sync(dev)
    t0 = time.perf_counter()
    cache, logits = prefill(model, prompts, chunk_size=chunk)
    _sync(dev)
    return cache, logits, time.perf_counter() - t0


def warm_prefix(prompt: torch.Tensor, chunk: int) -> torch.Tensor:
    """The prompt's first chunks that hold every chunk shape its prefill meets: a chunk from the empty cache, one
    from a filled cache and the last partial one (min(n, 2 chunks + n mod chunk) tokens; a 1M prompt's 128 chunks
    repeat the second one's shapes)."""
    n = prompt.shape[1]
    return prompt[:, :min(n, 2 * chunk + n % chunk)]


def run_single(model: LM, name: str, n_prompt: int, *, chunk: int, new: int, dev: torch.device, profile: bool = False,
               modes: tuple[str, ...] = (), profile_prefill_at: int = 0, prefill_repeats: int = 1) -> dict:
    row = {"kind": "single", "attention": name, "rows": 1, "prompt_tokens": n_prompt}
    if name == "full" and n_prompt > FULL_ATTENTION_MAX:
        return row | {"skipped": f"full attention's O(n^2) prefill of {n_prompt:,} tokens is beyond this benchmark"}
    prompt = single_prompt(model, n_prompt)
    row["allocated_at_start_bytes"] = _fresh(dev)
    row["prefill_chunk"] = chunk = prefill_chunk_for(model, 1, chunk)
    cache, logits, row["prefill_s"] = timed_prefill(model, prompt, chunk=chunk, dev=dev, warm_with=warm_prefix(prompt, chunk))
    if prefill_repeats > 1:  # the same prefill again, warm: its spread (calls on one card have differed by 1.5x)
        row["prefill_s_all"] = [row["prefill_s"]]
        for _ in range(prefill_repeats - 1):
            del cache, logits  # one cache at a time: the row's peak stays one prefill's
            cache, logits, seconds = timed_prefill(model, prompt, chunk=chunk, dev=dev)
            row["prefill_s_all"].append(seconds)
        row["prefill_s"] = statistics.median(row["prefill_s_all"])
    row["prefill_tokens_per_s"] = n_prompt / row["prefill_s"]
    if "floor" in modes and name != "full":  # the same prefill with the attention op replaced (attention_floor), warmed the same way
        with attention_floor():
            floor_s = timed_prefill(model, prompt, chunk=chunk, dev=dev, warm_with=warm_prefix(prompt, chunk))[2]
        row["prefill_tokens_per_s_floor"] = n_prompt / floor_s
    if profile_prefill_at == n_prompt and dev.type == "cuda":
        row["prefill_profile"] = profile_prefill(model, prompt, chunk)
    graph = dev.type == "cuda" and name != "full"
    d = decode_rate(model, cache, logits, new, graph=graph)
    row |= {"decode_tokens": new, "decode_tokens_per_s": d["tokens_per_s"], "cuda_graph": d["graph"], "decode_setup_s": d["setup_s"]}
    if d["error"]:
        row["cuda_graph_error"] = d["error"]
    add_modes(model, row, cache, logits, new, modes, compile=False)
    if graph:
        row["decode_tokens_per_s_eager"] = decode_rate(model, cache, logits, max(new // 4, 8), graph=False)["tokens_per_s"]
        if profile:
            row["profile"] = _profile_or_error(model, cache, logits)
    row["peak_memory_bytes"] = peak_bytes(dev)
    row["kv_cache_bytes"] = cache.nbytes()
    row["kv_entries_per_layer"] = cache.kv_entries_per_layer
    return row


def run_batched(model: LM, name: str, rows: int, n_prompt: int, *, chunk: int, new: int, dev: torch.device,
                modes: tuple[str, ...] = ()) -> dict:
    """`rows` prompts of n_prompt/2 .. n_prompt tokens (ragged), prefilled side by side and decoded together."""
    prompts = batched_prompts(model, rows, n_prompt)
    lengths = [len(p) for p in prompts]
    row = {"kind": "batched", "attention": name, "rows": rows, "prompt_tokens": sum(lengths),
           "prompt_lengths": [min(lengths), max(lengths)], "allocated_at_start_bytes": _fresh(dev),
           "prefill_chunk": prefill_chunk_for(model, rows, chunk)}
    chunk = row["prefill_chunk"]
    # warmed: the ragged rows' shapes are new to the kernels (the single rows ran one row)
    cache, logits, row["prefill_s"] = timed_prefill(model, prompts, chunk=chunk, dev=dev, warm_with=prompts)
    row["prefill_tokens_per_s"] = sum(lengths) / row["prefill_s"]
    graph = dev.type == "cuda" and name != "full"
    d = decode_rate(model, cache, logits, new, graph=graph)
    row |= {"decode_tokens": new * rows, "decode_tokens_per_s": d["tokens_per_s"], "cuda_graph": d["graph"],
            "decode_setup_s": d["setup_s"]}
    if d["error"]:
        row["cuda_graph_error"] = d["error"]
    add_modes(model, row, cache, logits, new, modes, compile=False)
    if graph:
        row["profile"] = _profile_or_error(model, cache, logits)
    row["peak_memory_bytes"] = peak_bytes(dev)
    row["kv_cache_bytes"] = cache.nbytes()
    row["kv_entries_per_layer"] = cache.kv_entries_per_layer
    return row


def _profile_or_error(model: LM, cache, logits: torch.Tensor) -> dict:
    try:
        return profile_step(model, cache, logits)
    except Exception as e:  # the profiler is a help, never the reason the row is lost
        return {"error": f"{type(e).__name__}: {e}"}


@torch.no_grad()
def profile_step(model: LM, cache, logits: torch.Tensor, steps: int = 20) -> dict:
    """Where a decode step's device time goes: torch.profiler over `steps` eager steps (every kernel
    launched on its own, so each is named)."""
    dec = Decoder(model, cache, cuda_graph=False)
    dec.start(logits)
    for _ in range(3):
        dec.advance()
    return _profile_steps(dec, steps)


@torch.no_grad()
def _profile_steps(dec: Decoder, steps: int) -> dict:
    """`steps` more steps of `dec` under torch.profiler: per step, the kernels by device time and their
    count, the device's busy time and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.advance()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    return {"steps": steps, "graph": dec.graph is not None, "compiled": dec.compiled,
            "wall_us_per_step": wall / steps * 1e6, "device_us_per_step": total / steps,
            "launches_per_step": sum(e.count for e in kernels) / steps,
            "top": [{"kernel": e.key[:120], "us_per_step": e.self_device_time_total / steps, "per_step": e.count / steps}
                    for e in kernels[:25]]}


@torch.no_grad()
def profile_prefill(model: LM, prompt: torch.Tensor, chunk: int) -> dict:
    """Where a (warm) prefill's time goes: torch.profiler over one prefill of `prompt` in chunks of `chunk`: the wall
    time, the kernels' device time and count, the host time of the launches, the top kernels. Device time well
    below the wall time: the prefill is launch-bound (issue 33: chunks of 8192 were)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        prefill(model, prompt, chunk_size=chunk)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: -e.self_device_time_total)
    launch = [e for e in events if e.key == "cudaLaunchKernel"]
    return {"chunk": chunk, "wall_ms": wall * 1e3, "device_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
            "kernels": sum(e.count for e in kernels), "launch_host_ms": sum(e.self_cpu_time_total for e in launch) / 1e3,
            "top": [{"kernel": e.key[:120], "ms": e.self_device_time_total / 1e3, "count": e.count} for e in kernels[:25]]}


OPS = ("sparsek_attention_decode", "sparsek_linear_attention_decode", "sparsek_attention_chunk",
       "sparsek_linear_attention_chunk")  # the attention ops the model calls (model/attention.py), which the floor replaces


@contextmanager
def attention_floor():
    """Inside it, the attention op of every decode step and prefill chunk (the query or chunk against the cache, the
    selection, the cache's update) is a few elementwise operations on the op's inputs instead: o = q + k + v + u per
    head, the cache as it was. What a step or a prefill takes then is the rest of it (projections, norms, MLP, the
    scorer, the sampler, the launches): a floor under its time, so the real time minus the floor is what the op
    costs. Its tokens are meaningless."""
    from longtrain.model import attention

    def floor(q, k, v, u, *rest, **_):  # q [B, (L,) H, D], k, v [B, (L,) Hkv, D], u [B(, L)]; the cache last
        heads = q.shape[-2] // k.shape[-2]
        o = q + (k + v).repeat_interleave(heads, dim=-2) + u.to(q.dtype)[..., None, None]  # every input read
        return o, rest[-1], None

    saved = {name: getattr(attention, name) for name in OPS}
    for name in OPS:
        setattr(attention, name, floor)
    try:
        yield
    finally:
        for name, op in saved.items():
            setattr(attention, name, op)


def add_modes(model: LM, row: dict, cache, logits: torch.Tensor, new: int, modes: tuple[str, ...], *, compile: bool) -> None:
    """The row's graph decoding again in each of `modes` (Decoder's in_place), compiled or not:
    row["decode_tokens_per_s[_compiled]_<mode>"], and with a profile where the row has one."""
    for mode in modes:
        if row["attention"] not in ("sparsek+sw", "sw"):  # full attention's cache has no ring layout
            continue
        if compile and mode == "exact":  # the exact decoder runs eagerly: its rate is the uncompiled row's
            continue
        key = f"{'compiled_' if compile else ''}{mode}"
        try:
            with attention_floor() if mode == "floor" else nullcontext():
                c = decode_rate(model, cache, logits, new, graph=True, compile=compile,
                                profile=compile and "profile" in row, **MODES[mode])
        except Exception as e:  # the row keeps its other numbers
            row[f"error_{key}"] = f"{type(e).__name__}: {e}"
            continue
        row[f"decode_tokens_per_s_{key}"] = c["tokens_per_s"] if c["compiled"] or not compile else None
        if c["error"]:
            row[f"error_{key}"] = c["error"]
        elif c.get("profile"):
            row[f"profile_{key}"] = c["profile"]


def add_compiled(model: LM, row: dict, *, chunk: int, new: int, batch_prompt: int, dev: torch.device,
                 modes: tuple[str, ...] = ()) -> None:
    """The row's decoding again with the step through torch.compile (then captured): its tokens/s and setup time;
    modes: also in each of them (add_modes)."""
    prompts = single_prompt(model, row["prompt_tokens"]) if row["kind"] == "single" else \
        batched_prompts(model, row["rows"], batch_prompt)
    _fresh(dev)
    cache, logits = prefill(model, prompts, chunk_size=chunk)
    c = decode_rate(model, cache, logits, new, graph=True, compile=True, profile="profile" in row)
    row |= {"decode_tokens_per_s_compiled": c["tokens_per_s"] if c["compiled"] else None, "compile_setup_s": c["setup_s"]}
    if c["error"]:
        row["compile_error"] = c["error"]
    elif c.get("profile"):
        row["profile_compiled"] = c["profile"]
    add_modes(model, row, cache, logits, new, modes, compile=True)


@torch.no_grad()
def decode_equals_forward(model: LM, n_prompt: int, n_tokens: int, *, chunk: int, dev: torch.device,
                          exact: bool = False) -> dict:
    """The same n_tokens after an n_prompt-token prompt: one chunk through the forward against token-by-token decoding
    (exact: each token as a one-token chunk of the forward, Decoder's exact mode; else the decode step)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.cfg.vocab_size, (1, n_prompt + n_tokens), generator=g)
    _fresh(dev)
    cache, _ = prefill(model, ids[:, :n_prompt], chunk_size=chunk)
    ref = model(ids[:, n_prompt:].to(dev), cache=cache)  # the chunk op: the device scan, the Triton core
    ref_logits = ref.logits[0].float()  # [n, V]
    ref_fp = [None if s is None else s.fingerprint[0] for s in ref.selections]  # per layer [n]
    differ = [0] * len(ref_fp)
    worst, argmax_same = 0.0, 0
    step_cache = cache
    for t in range(n_tokens):
        token = ids[:, n_prompt + t].to(dev)
        out = exact_step(model, token, step_cache) if exact else model.decode(token, step_cache, selections=True)
        step_cache = out.cache
        lg = out.logits[0, 0].float()
        worst = max(worst, float((lg - ref_logits[t]).abs().max()))
        argmax_same += int(lg.argmax() == ref_logits[t].argmax())
        for layer, sel in enumerate(out.selections):
            if sel is not None and not torch.equal(sel.fingerprint[0, 0], ref_fp[layer][t]):
                differ[layer] += 1
    return {"kind": "check", "exact": exact, "prompt_tokens": n_prompt, "tokens": n_tokens,
            "dtype": str(model.embed.weight.dtype),
            "positions_with_other_selection_per_layer": differ, "selections_identical": not any(differ),
            "max_abs_logit_diff": worst, "argmax_agreement": argmax_same / n_tokens,
            "overflowed": step_cache.overflowed()}


def inductor_settings(text: str, error) -> dict:
    """--inductor's KEY=VALUE list (each value parsed as the setting's type of torch._inductor.config) over the
    compiled step's COMPILE_OPTIONS: the options every compiled row runs with."""
    import torch._inductor.config as config

    from longtrain import generate

    settings = {}
    for item in (x for x in text.split(",") if x):
        key, _, value = item.partition("=")
        if not hasattr(config, key):
            error(f"--inductor {key}: torch._inductor.config has no such setting (e.g. freezing, combo_kernels)")
        kind = type(getattr(config, key))
        settings[key] = value not in ("0", "false", "False") if kind is bool else kind(value)
    generate.COMPILE_OPTIONS = {**generate.COMPILE_OPTIONS, **settings}
    return generate.COMPILE_OPTIONS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for generate.json and generate.md")
    ap.add_argument("--small", action="store_true", help="a tiny model and short prompts on the CPU (checks the script)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens decoded per row (default 256; --small 8)")
    ap.add_argument("--prompts", type=str, default=None, help="comma-separated single-row prompt lengths")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: longtrain's for the rows and device, "
                    "model.chunks.prefill_chunk_size; --small 512)")
    ap.add_argument("--attentions", type=str, default=None, help="comma-separated subset of sparsek+sw,sw,full")
    ap.add_argument("--batch", type=int, default=None, help="rows decoded together (default 64; --small 4; 0: none)")
    ap.add_argument("--batch-prompt", type=int, default=None, help="longest batched prompt (default 4096; --small 64)")
    ap.add_argument("--compile", action="store_true", help="also time the step through torch.compile (CUDA)")
    ap.add_argument("--modes", default="", help="comma list of Decoder modes also timed (graph; compiled with --compile): "
                    "in_place, rebuild, exact, floor (the step without its attention op)")
    ap.add_argument("--check-prompt", type=int, default=None,
        help="decode == forward check: prompt (default 65536; --small 512; 0: no check)")
    ap.add_argument("--check-tokens", type=int, default=None, help="decode == forward check: tokens (default 1000; --small 20)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new row after this many seconds")
    ap.add_argument("--prefill-repeats", type=int, default=1, metavar="N",
                    help="time each single-row prefill N times (warm): prefill_s is their median, prefill_s_all all")
    ap.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                    help="torch.profiler over the single N-token prompt's prefill (CUDA; JSON only)")
    ap.add_argument("--inductor", default="", help="comma list KEY=VALUE of torch._inductor.config for the compiled "
                    "rows over Decoder's COMPILE_OPTIONS, e.g. freezing=0,combo_kernels=0 (Inductor's defaults)")
    args = ap.parse_args()
    inductor = inductor_settings(args.inductor, ap.error)
    modes = tuple(m for m in args.modes.split(",") if m)
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes takes {', '.join(MODES)}; got {bad}")

    t_start = time.perf_counter()
    dev = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    small = args.small
    base, attns, prompts = (SMALL, SMALL_ATTN, SMALL_PROMPTS) if small else (FULL, FULL_ATTN, FULL_PROMPTS)
    if args.prompts:
        prompts = tuple(int(p) for p in args.prompts.split(","))
    if args.attentions:
        attns = [(n, kw) for n, kw in attns if n in args.attentions.split(",")]
    new = args.new_tokens or (8 if small else 256)
    chunk = args.chunk or (512 if small else None)
    batch = args.batch if args.batch is not None else (4 if small else 64)
    batch_prompt = args.batch_prompt or (64 if small else 4096)
    check_prompt = args.check_prompt if args.check_prompt is not None else (512 if small else 65536)
    check_tokens = args.check_tokens or (20 if small else 1000)
    batch_new = max(new // 4, 8)  # steps of the batched rows
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console()
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "commit": _commit(), "dtype": str(dtype).removeprefix("torch."),
        "model": {**base, "params": sum(p.numel() for p in LM(LMConfig(**base, **attns[0][1])).parameters())},
        "prefill_chunk": chunk, "new_tokens": new, "rows": [], "check": None, "inductor": inductor,
    }

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    def add(row: dict) -> None:
        report["rows"].append(row)
        console.print(json.dumps(row), highlight=False)
        write(report, args.out)

    models = {}
    for name, kw in attns:  # first what every attention type is measured by; the compiled step after
        torch.manual_seed(0)
        model = LM(LMConfig(**base, **kw)).to(dev, dtype).eval()
        if check_prompt and name == "sparsek+sw" and not over_budget():
            report["check"] = decode_equals_forward(model, check_prompt, check_tokens, chunk=chunk, dev=dev)
            console.print(json.dumps(report["check"]), highlight=False)
            report["check_exact"] = decode_equals_forward(model, check_prompt, check_tokens, chunk=chunk, dev=dev,
                                                          exact=True)
            console.print(json.dumps(report["check_exact"]), highlight=False)
        for n in prompts:
            add({"kind": "single", "attention": name, "rows": 1, "prompt_tokens": n, "skipped": "time budget"} if over_budget()
                else run_single(model, name, n, chunk=chunk, new=new, dev=dev, profile=n == prompts[0], modes=modes,
                                profile_prefill_at=args.profile_prefill, prefill_repeats=args.prefill_repeats))
        if batch:
            add({"kind": "batched", "attention": name, "rows": batch, "skipped": "time budget"} if over_budget() else
                run_batched(model, name, batch, batch_prompt, chunk=chunk, new=batch_new, dev=dev, modes=modes))
        if name != "full":
            models[name] = model.cpu()  # kept for the compiled pass, off the GPU (its rows' peaks stay theirs)
        del model
        _fresh(dev)
    summarize(report, args.out)  # written now too: a run stopped during the compiled pass keeps the ratios
    if args.compile and dev.type == "cuda":
        # single rows first (SparseK+SW and SW: the ratio), then the batches; the shortest single prompt
        # only (a step does not depend on the prompt's length)
        order = [(kind, name) for kind in ("single", "batched") for name in ("sparsek+sw", "sw")]
        for kind, name in order:
            for row in report["rows"]:
                if (row["kind"], row["attention"]) != (kind, name) or "skipped" in row or name not in models:
                    continue
                if kind == "single" and row["prompt_tokens"] != prompts[0]:
                    continue
                if over_budget():
                    row["compile_error"] = "time budget"
                    continue
                try:
                    add_compiled(models[name].to(dev), row, chunk=chunk, new=new if kind == "single" else batch_new,
                                 batch_prompt=batch_prompt, dev=dev, modes=modes)
                except Exception as e:  # e.g. out of memory: the row keeps its plain numbers
                    row["compile_error"] = f"{type(e).__name__}: {e}"
                keys = ("kind", "attention", "rows", "decode_tokens_per_s_compiled", "compile_setup_s", "compile_error")
                console.print(json.dumps({k: v for k, v in row.items() if k in keys or k.startswith("decode_tokens_per_s_compiled_")}),
                              highlight=False)
                write(report, args.out)
                models[name].cpu()
                _fresh(dev)

    report["seconds"] = time.perf_counter() - t_start
    summarize(report, args.out)
    console.print(markdown(report), highlight=False)


def summarize(report: dict, out: Path) -> None:
    """The ratios and the memory check from the rows so far, written with them."""
    report["ratios"] = ratios(report["rows"])
    report["sparsek_peak_memory_check"] = memory_check(report["rows"])
    write(report, out)


def ratios(rows: list[dict]) -> dict:
    """SparseK+SW over SW: decode and prefill tokens/s per prompt length (single) and batched."""
    by = {(r["kind"], r["attention"], r.get("prompt_tokens") if r["kind"] == "single" else "batched"): r
          for r in rows if "skipped" not in r}
    out = {}
    for (kind, attn, key), r in by.items():
        sw = by.get((kind, "sw", key))
        if attn != "sparsek+sw" or sw is None:
            continue
        label = f"single {key:,}" if kind == "single" else f"batched ({r['rows']} rows)"
        out[label] = {"decode": r["decode_tokens_per_s"] / sw["decode_tokens_per_s"],
                                "prefill": r["prefill_tokens_per_s"] / sw["prefill_tokens_per_s"]}
        if r.get("decode_tokens_per_s_compiled") and sw.get("decode_tokens_per_s_compiled"):
            out[label]["decode_compiled"] = r["decode_tokens_per_s_compiled"] / sw["decode_tokens_per_s_compiled"]
    return out


def memory_check(rows: list[dict]) -> dict | None:
    """The two longest single SparseK+SW rows: their peak above start within 5%."""
    sk = {r["prompt_tokens"]: r for r in rows if r["kind"] == "single" and r["attention"] == "sparsek+sw" and "peak_memory_bytes" in r}
    big = sorted(sk)[-2:]
    if len(big) < 2:
        return None
    a, b = (working_bytes(sk[n]) for n in big)
    return {"prompts": big, "working_bytes": [a, b], "ratio": b / a, "within_5_percent": abs(b / a - 1) <= 0.05}


def working_bytes(r: dict) -> int:
    """A row's peak memory above what was allocated when it started."""
    return r["peak_memory_bytes"] - r.get("allocated_at_start_bytes", 0)


def _rate(r: dict, key: str) -> str:
    return f"{r[key]:,.1f}" if r.get(key) else "—"


HEAD = ["kind", "attention", "rows", "prompt tokens", "prefill chunk", "prefill tok/s", "decode tok/s (graph)", "compiled", "eager",
        "peak MiB", "above start MiB", "KV entries / layer"]


def _cells(r: dict) -> list[str]:
    mib = 2**20
    first = [r["kind"], r["attention"], str(r["rows"]), f"{r.get('prompt_tokens', 0):,}"]
    if "skipped" in r:
        return first + ["skipped: " + r["skipped"]] + [""] * (len(HEAD) - 5)
    return first + [
        f"{r['prefill_chunk']:,}" if r.get("prefill_chunk") else "", f"{r['prefill_tokens_per_s']:,.0f}",
        _rate(r, "decode_tokens_per_s"), _rate(r, "decode_tokens_per_s_compiled"),
        _rate(r, "decode_tokens_per_s_eager"), f"{r['peak_memory_bytes'] / mib:,.0f}", f"{working_bytes(r) / mib:,.0f}",
        f"{r['kv_entries_per_layer']:,}",
    ]


def markdown(report: dict) -> str:
    lines = [f"generation on {report['device']}, {report['dtype']}, commit {report['commit']}, {report['new_tokens']} new "
             f"tokens per single row, prefill chunks: {report['prefill_chunk'] or 'longtrain default'}", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in report["rows"]] + [""]
    for r in report["rows"]:
        other = {k.removeprefix("decode_tokens_per_s_"): v for k, v in r.items()
                 if k.startswith("decode_tokens_per_s_") and k.endswith(tuple(MODES)) and v}
        if other:
            lines.append(f"{r['kind']} {r['attention']}, {r['rows']} rows, other decoders (tokens/s): "
                         + ", ".join(f"{k} {v:,.1f}" for k, v in other.items()))
        if r.get("prefill_tokens_per_s_floor"):
            ms, ms_floor = (r["prompt_tokens"] / r[key] * 1e3 for key in ("prefill_tokens_per_s", "prefill_tokens_per_s_floor"))
            lines.append(f"{r['kind']} {r['attention']}, {r['prompt_tokens']:,} tokens, prefill: {ms:,.1f} ms, "
                         f"{ms_floor:,.1f} without the attention op, which takes {ms - ms_floor:,.1f}")
        for step, floor in (("decode_tokens_per_s", "floor"), ("decode_tokens_per_s_compiled", "compiled_floor")):
            if r.get(step) and other.get(floor):
                us, us_floor = (r["rows"] / rate * 1e6 for rate in (r[step], other[floor]))
                how = "compiled" if "compiled" in step else "graph" if r.get("cuda_graph") else "eager"
                lines.append(f"{r['kind']} {r['attention']}, {r['rows']} rows, {how}: {us:,.1f} us a step, "
                             f"{us_floor:,.1f} without the attention op, which takes {us - us_floor:,.1f}")
    for key, r in report.get("ratios", {}).items():
        lines.append(f"SparseK+SW / SW, {key}: decode {r['decode']:.2f}, prefill {r['prefill']:.2f}"
                     + (f", decode compiled {r['decode_compiled']:.2f}" if "decode_compiled" in r else ""))
    c = report.get("sparsek_peak_memory_check")
    if c:
        lines.append(f"\nSparseK+SW peak above start {c['prompts'][0]:,} vs {c['prompts'][1]:,} tokens: ratio {c['ratio']:.4f} "
                     f"(within 5%: {'yes' if c['within_5_percent'] else 'no'})")
    for key, step in (("check", "decode step"), ("check_exact", "exact decoding (one-token chunks)")):
        k = report.get(key)
        if k:
            lines.append(f"\n{step} == chunked forward ({k['dtype']}, {k['tokens']} tokens after {k['prompt_tokens']:,}): "
                         f"selections identical: {k['selections_identical']} (positions differing per layer "
                         f"{k['positions_with_other_selection_per_layer']}), max |Δ logit| {k['max_abs_logit_diff']:.3g}, "
                         f"argmax agreement {k['argmax_agreement']:.4f}")
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    (out / "generate.json").write_text(json.dumps(report, indent=1))
    (out / "generate.md").write_text(markdown(report))


def _commit() -> str:
    if os.environ.get("LONGTRAIN_COMMIT"):  # a copy of the tree without its git history (the device)
        return os.environ["LONGTRAIN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
