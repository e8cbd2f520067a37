"""verify-equivalence: a document read in chunks must give what one unchunked pass gives.

The reference runs the whole document through the model at once (layer by layer; the op's
block-wise reference is O(n·(k+w))) and keeps only the final hidden states and the per-query
selection fingerprints. Each chunked pass then streams the document chunk by chunk through the
fixed-size cache and compares, chunk by chunk, its logits against the reference hidden states
projected through the head piece by piece: [T, V] logits never exist at once.

Pass criteria (docs/DESIGN.md section 3): float64 needs identical selected sets at every layer and query
and logits within 1e-9; float32 and bf16 round differently in the two passes, so their thresholds
are defaults the user can change. A threshold state that overflowed its cap always fails.

LONGTRAIN_FAULT=drop_pool (tests only) empties every layer's pool between chunks, so a broken
cache is known to be caught.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from longtrain.model import LM, LMConfig, ModelCache
from longtrain.ops.sparsek_attention import SparseKCache

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# (max |logit difference|, min selection agreement) per dtype. One rounding flip at the k-th score
# can keep two pools apart for many queries, so bf16 agreement varies a lot between chunk sizes
# (0.91 to 1.0 seen on an H100 at 65,536 tokens) while its logits stay within 1e-2.
DEFAULT_THRESHOLDS = {"float64": (1e-9, 1.0), "float32": (1e-2, 0.99), "bfloat16": (0.5, 0.8)}
DEFAULT_CHUNK_SIZES = (1024, 4096, 3001)
# The default model: small enough that 262,144 tokens in float64 take minutes on two CPU cores.
DEFAULT_MODEL = dict(vocab_size=256, layers=2, d_model=128, heads=4, attention="sparsek+sw", topk=64, window=64)
PIECE = 2048  # rows of reference logits projected at a time
FAULTS = ("drop_pool",)


class UsageError(Exception):
    """Bad flags or paths; the message is for the user (exit 2)."""


@dataclass
class PassStats:
    seconds: float
    peak_mem_bytes: int
    loss: float
    overflowed: bool


@dataclass
class Run:
    chunk_size: int
    max_abs_logit_diff: float
    selection_agreement: float
    loss_diff: float
    peak_mem_bytes: int
    seconds: float
    overflowed: bool
    passed: bool = False


@dataclass
class Report:
    passed: bool
    runs: list[Run]
    reference: PassStats
    tokens: int
    dtype: str
    device: str
    max_logit_diff: float
    min_agreement: float
    model: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- measuring


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator peak, or sampled RSS on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        _trim_heap()  # give freed pages back, so the baseline is what is really in use
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            return
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def bytes(self) -> int:
        return int(self.peak - self.base)


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the baseline may include freed pages
        pass


def _nll_sum(logits: torch.Tensor, tokens: torch.Tensor, start: int) -> float:
    """Summed next-token loss of logits [n, V] for positions start .. start+n-1 of tokens [T]."""
    targets = tokens[start + 1 : start + 1 + logits.shape[0]]
    if targets.numel() == 0:
        return 0.0
    return float(F.cross_entropy(_wide(logits[: targets.numel()]), targets, reduction="sum"))


def _wide(x: torch.Tensor) -> torch.Tensor:
    """float64 stays float64; float32 and bf16 are compared in float32."""
    return x if x.dtype == torch.float64 else x.float()


# ----------------------------------------------------------------------------- the two passes


@torch.no_grad()
def reference_pass(model: LM, tokens: torch.Tensor):
    """One unchunked pass: final hidden states [T, d], fingerprints per selecting layer, stats."""
    T = tokens.numel()
    with PeakMemory(tokens.device) as mem:
        t0 = time.perf_counter()
        out = model.hidden(tokens[None])
        h = out.hidden[0]  # [T, d]
        nll = sum(_nll_sum(model.head(h[s : s + PIECE]), tokens, s) for s in range(0, T, PIECE))
        _sync(tokens.device)
        seconds = time.perf_counter() - t0
    fps = {i: s.fingerprint for i, s in enumerate(out.selections) if s is not None}  # [rows, T]
    return h, fps, PassStats(seconds, mem.bytes, nll / max(T - 1, 1), out.overflowed)


@torch.no_grad()
def chunked_pass(model: LM, tokens: torch.Tensor, chunk: int, ref_h: torch.Tensor, ref_fps: dict, fault: str | None) -> tuple[Run, float]:
    """Stream the document in chunks through the cache, comparing with the reference as it goes."""
    T = tokens.numel()
    max_diff, same, total, nll, overflowed, seconds = 0.0, 0, 0, 0.0, False, 0.0
    with PeakMemory(tokens.device) as mem:
        cache = model.empty_cache(1, device=tokens.device, dtype=ref_h.dtype)
        for s in range(0, T, chunk):
            t0 = time.perf_counter()
            out = model(tokens[None, s : s + chunk], cache=cache)
            _sync(tokens.device)
            seconds += time.perf_counter() - t0
            cache = _inject(out.cache, fault)
            logits = out.logits[0]  # [c, V]
            ref = model.head(ref_h[s : s + logits.shape[0]])
            max_diff = max(max_diff, float((_wide(logits) - _wide(ref)).abs().max()))
            nll += _nll_sum(logits, tokens, s)
            for i, fp in ref_fps.items():
                got = out.selections[i].fingerprint  # [rows, c]
                same += int((got == fp[:, s : s + got.shape[1]]).sum())
                total += got.numel()
            overflowed |= out.overflowed
    agreement = same / total if total else 1.0
    run = Run(chunk, max_diff, agreement, 0.0, mem.bytes, seconds, overflowed)
    return run, nll / max(T - 1, 1)


def _inject(cache: ModelCache, fault: str | None) -> ModelCache:
    """Test-only fault injection: corrupt the cache between chunks."""
    if fault == "drop_pool":
        for layer in cache.layers:
            if isinstance(layer.attn, SparseKCache):
                layer.attn.pool_pos.fill_(-1)
                layer.attn.pool_u.fill_(-float("inf"))
                layer.attn.pool_k.zero_()
                layer.attn.pool_v.zero_()
    return cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def _warm_up(model: LM, tokens: torch.Tensor, chunk_sizes: list[int]) -> None:
    """On CUDA, run each chunk length once first, so kernel compiles and graph captures stay out of
    the timed passes (an odd length compiles its own kernel variants once)."""
    if tokens.device.type != "cuda":
        return
    T = tokens.numel()
    for n in sorted({min(c, T) for c in chunk_sizes} | {T % c for c in chunk_sizes if T % c}):
        model(tokens[None, :n])
    _sync(tokens.device)


def verify(
    model: LM,
    tokens: torch.Tensor,  # [T] long, on the model's device
    chunk_sizes: list[int],
    *,
    dtype: str,
    max_logit_diff: float,
    min_agreement: float,
    fault: str | None = None,
    on_run=None,  # called with each Run as it finishes (for live output)
) -> Report:
    model.eval()
    _warm_up(model, tokens, chunk_sizes)
    ref_h, ref_fps, ref = reference_pass(model, tokens)
    runs = []
    for chunk in chunk_sizes:
        run, loss = chunked_pass(model, tokens, chunk, ref_h, ref_fps, fault)
        run.loss_diff = abs(loss - ref.loss)
        run.passed = (
            not run.overflowed and not ref.overflowed
            and run.max_abs_logit_diff <= max_logit_diff and run.selection_agreement >= min_agreement
        )
        runs.append(run)
        if on_run:
            on_run(run)
    return Report(
        passed=all(r.passed for r in runs), runs=runs, reference=ref, tokens=tokens.numel(), dtype=dtype,
        device=str(tokens.device), max_logit_diff=max_logit_diff, min_agreement=min_agreement, model=model.cfg.to_dict(),
    )


# ----------------------------------------------------------------------------- inputs


def load_model(recipe: Path | None, checkpoint: Path | None, seed: int):
    """(model, tokenizer or None) from a recipe (random init), a checkpoint or run dir, or the small default."""
    if recipe is not None and checkpoint is not None:
        raise UsageError("give --recipe or --checkpoint, not both")
    torch.manual_seed(seed)
    if recipe is None and checkpoint is None:
        return LM(LMConfig(**DEFAULT_MODEL)), None
    if checkpoint is not None:
        from longtrain.train.checkpoint import CheckpointError
        from longtrain.train.checkpointer import load_checkpoint

        try:
            loaded = load_checkpoint(checkpoint)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        return loaded.model, loaded.tokenizer

    from longtrain.data import DataError
    from longtrain.data.tokenizer import load_tokenizer
    from longtrain.train.recipe import RecipeError, load_recipe

    try:
        r = load_recipe(recipe)
    except RecipeError as e:
        raise UsageError(str(e)) from None
    try:
        tokenizer = load_tokenizer(r.tokenizer.path) if r.tokenizer.path else None
    except DataError as e:
        raise UsageError(str(e)) from None
    vocab = tokenizer.get_vocab_size() if tokenizer is not None else r.tokenizer.vocab_size
    try:
        model = LM(LMConfig.from_recipe(r.model, r.attention, vocab_size=vocab))
    except ValueError as e:
        raise UsageError(f"recipe {recipe}: {e}") from None
    return model, tokenizer


def load_tokens(text: Path | None, n: int, vocab: int, tokenizer, seed: int) -> torch.Tensor:
    """The first n tokens of a text file (the model's tokenizer, else UTF-8 bytes), or random tokens."""
    if text is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (n,), generator=g)
    if not text.is_file():
        raise UsageError(f"--text {text}: no such file")
    if tokenizer is None:
        if vocab < 256:
            raise UsageError(f"--text without a tokenizer needs a byte vocabulary (>= 256); the model has {vocab}")
        with open(text, "rb") as f:
            ids = list(f.read(n))
    else:
        # A token is rarely longer than 16 characters: tokenize a prefix, not the whole file.
        ids = tokenizer.encode(text.read_text(encoding="utf-8", errors="replace")[: 16 * n]).ids[:n]
    if len(ids) < 2:
        raise UsageError(f"--text {text} has fewer than 2 tokens")
    return torch.tensor(ids, dtype=torch.int64)


# ----------------------------------------------------------------------------- the command


def run_command(
    *,
    recipe: Path | None,
    checkpoint: Path | None,
    text: Path | None,
    tokens: int,
    chunk_sizes: list[int] | None,
    dtype: str | None,
    device: str,
    seed: int,
    json_path: Path | None,
    max_logit_diff: float | None,
    min_agreement: float | None,
    console,
) -> int:
    """Everything behind `longtrain verify-equivalence`; returns the exit code (UsageError: 2)."""
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    dtype = dtype or ("float64" if device == "cpu" else "float32")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if tokens < 2:
        raise UsageError(f"--tokens must be at least 2; got {tokens}")
    chunk_sizes = list(chunk_sizes or DEFAULT_CHUNK_SIZES)
    if any(c < 1 for c in chunk_sizes):
        raise UsageError(f"--chunk-size must be >= 1; got {chunk_sizes}")
    fault = os.environ.get("LONGTRAIN_FAULT") or None
    if fault is not None and fault not in FAULTS:
        raise UsageError(f"LONGTRAIN_FAULT must be one of {FAULTS}; got {fault!r}")
    if json_path is not None and not json_path.parent.is_dir():
        raise UsageError(f"--json {json_path}: folder {json_path.parent} does not exist")
    d_max, a_min = DEFAULT_THRESHOLDS[dtype]
    d_max = d_max if max_logit_diff is None else max_logit_diff
    a_min = a_min if min_agreement is None else min_agreement

    model, tokenizer = load_model(recipe, checkpoint, seed)
    dev = torch.device(device)
    model = model.to(dev, DTYPES[dtype])
    if dtype == "float64" and model.cfg.backend == "auto":
        model.cfg.backend = "naive"  # the Triton core has no float64; the attention layers share this cfg
    doc = load_tokens(text, tokens, model.cfg.vocab_size, tokenizer, seed).to(dev)
    cfg = model.cfg
    console.print(
        f"model: {cfg.style}, {cfg.layers} layers × {cfg.d_model}, {cfg.heads} heads, {cfg.attention} "
        f"(k={cfg.topk}, w={cfg.window}), {model.num_params() / 1e6:.2f}M parameters; "
        f"{doc.numel():,} tokens, {dtype} on {device}"
    )
    report = verify(
        model, doc, chunk_sizes, dtype=dtype, max_logit_diff=d_max, min_agreement=a_min, fault=fault,
        on_run=lambda r: console.print(f"  chunk {r.chunk_size}: {r.seconds:.1f} s", highlight=False),
    )
    render(report, console)
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=1))
    return 0 if report.passed else 1


def render(report: Report, console) -> None:
    from rich.table import Table

    mib = 2**20
    ref = report.reference
    t = Table(title=f"chunked vs unchunked, {report.tokens:,} tokens, {report.dtype}")
    for col in ("chunk size", "selection agreement", "max |Δ logit|", "Δ loss", "peak memory", "time", "result"):
        t.add_column(col, justify="right")
    t.add_row("unchunked", "—", "—", f"loss {ref.loss:.6f}", f"{ref.peak_mem_bytes / mib:,.0f} MiB", f"{ref.seconds:.1f} s",
              "[red]overflow[/]" if ref.overflowed else "")
    for r in report.runs:
        verdict = "[green]pass[/]" if r.passed else ("[red]overflow[/]" if r.overflowed else "[red]FAIL[/]")
        t.add_row(str(r.chunk_size), f"{r.selection_agreement:.6f}", f"{r.max_abs_logit_diff:.2e}", f"{r.loss_diff:.2e}",
                  f"{r.peak_mem_bytes / mib:,.0f} MiB", f"{r.seconds:.1f} s", verdict)
    console.print(t)
    need = f"selection agreement ≥ {report.min_agreement}, max |Δ logit| ≤ {report.max_logit_diff:g}, no threshold overflow"
    console.print(("[bold green]PASSED[/] " if report.passed else "[bold red]FAILED[/] ") + f"({need})")
