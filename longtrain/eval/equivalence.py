"""verify-equivalence: a document read in chunks must give what one unchunked pass gives.

The reference runs the whole document through the model at once (layer by layer; the op's
block-wise reference is O(n·(k+w))) and keeps only the final hidden states and the per-query
selection fingerprints. Each chunked pass then streams the document chunk by chunk through the
fixed-size cache and compares, chunk by chunk, its logits against the reference hidden states
projected through the head piece by piece: [T, V] logits never exist at once.

Precisions: float64 and float32 cast the model's weights; "bfloat16" runs bf16 autocast over float32
weights, as `longtrain fit` trains on CUDA (float32 residual stream, norms and scores; bf16 matmuls and
attention); "bfloat16-weights" casts the whole model to bf16 (a bf16 residual stream).

Pass criteria (docs/DESIGN.md section 3): float64 needs identical selected sets at every layer and query
and logits within 1e-9; float32 and bf16 round differently in the two passes, so their thresholds
are defaults the user can change. Selection agreement is measured per selecting layer and the worst
layer must pass; the first query where a layer's selected sets differ is reported with the two
passes' theta position and tau there. A threshold state that overflowed its cap always fails.

LONGTRAIN_FAULT=drop_pool (tests only) empties every layer's pool between chunks, so a broken
cache is known to be caught; drop_linear_state zeroes the linear types' linear state.
"""

from __future__ import annotations

import ctypes
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from longtrain.data.tokenizer import load_tokenizer
from longtrain.errors import UsageError
from longtrain.model import LM, LMConfig, ModelCache
from longtrain.model.chunks import ChunkReader, split_rows
from longtrain.ops.sparsek_attention import SparseKCache
from longtrain.ops.sparsek_attention.linear import SparseKLinearCache
from longtrain.train.checkpoint import load_checkpoint
from longtrain.train.init import read_init_source
from longtrain.train.recipe import load_recipe

# Precision mode -> (weight dtype, autocast dtype or None).
PRECISIONS = {
    "float64": (torch.float64, None),
    "float32": (torch.float32, None),
    "bfloat16": (torch.float32, torch.bfloat16),  # as `longtrain fit` trains: autocast over float32 weights
    "bfloat16-weights": (torch.bfloat16, None),  # the whole model in bf16
}
DTYPES = {name: w for name, (w, _) in PRECISIONS.items()}
# (max |logit difference|, min selection agreement per layer) per precision. A rounding flip at the
# k-th score keeps two pools apart for many queries (DESIGN.md fact 1), so agreement is a rate of
# flips times their length: measured at 1M tokens on an H100 (README, "Chunked = unchunked").
DEFAULT_THRESHOLDS = {"float64": (1e-9, 1.0), "float32": (1e-2, 0.9999), "bfloat16": (0.5, 0.999),
                      "bfloat16-weights": (0.5, 0.999)}
DEFAULT_CHUNK_SIZES = (1024, 4096, 3001)
# The default model: small enough that 262,144 tokens in float64 take minutes on two CPU cores.
DEFAULT_MODEL = dict(vocab_size=256, layers=2, d_model=128, heads=4, attention="sparsek+sw", topk=64, window=64)
PIECE = 2048  # rows of reference logits projected at a time
FAULTS = ("drop_pool", "drop_linear_state")


@dataclass
class PassStats:
    seconds: float
    peak_mem_bytes: int
    loss: float
    overflowed: bool


@dataclass
class LayerAgreement:
    """One selecting layer of one chunked pass against the reference."""

    layer: int
    agreement: float  # fraction of (row, query) pairs whose selected sets are identical
    first_divergence: int | None  # first query position whose selected set differs (None: none)
    # At first_divergence: each pass's theta position (the k-th largest candidate) and tau.
    theta_pos: tuple[int, int] | None = None  # (reference, chunked)
    tau: tuple[float, float] | None = None  # (reference, chunked)


@dataclass
class Run:
    chunk_size: int
    max_abs_logit_diff: float
    selection_agreement: float  # over all selecting layers
    loss_diff: float
    peak_mem_bytes: int
    seconds: float
    overflowed: bool
    layers: list[LayerAgreement] = field(default_factory=list)
    passed: bool = False

    @property
    def worst_agreement(self) -> float:
        return min((la.agreement for la in self.layers), default=self.selection_agreement)


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
    # Per selecting layer: fingerprint, theta position, tau [rows, T] (to compare and to explain).
    sels = {i: (s.fingerprint, s.theta_pos, s.tau) for i, s in enumerate(out.selections) if s is not None}
    return h, sels, PassStats(seconds, mem.bytes, nll / max(T - 1, 1), out.overflowed)


class _LayerTally:
    """Agreement of one layer, counted on the device (one host sync per chunk for all layers)."""

    def __init__(self, layer: int, device: torch.device):
        self.layer = layer
        self.same = torch.zeros((), dtype=torch.int64, device=device)
        self.total = 0
        self.first: LayerAgreement | None = None

    def add(self, s: int, got, ref) -> torch.Tensor:
        """Count chunk [s, s + c) of one layer; returns its per-query mismatch [c] (bool)."""
        fp = ref[0]  # (fingerprint, theta_pos, tau) [rows, T] of the reference
        c = got.fingerprint.shape[1]
        diff = got.fingerprint != fp[:, s : s + c]  # [rows, c]
        self.same += diff.numel() - diff.sum()
        self.total += diff.numel()
        return diff.any(0)

    def note_first(self, s: int, col: int, got, ref) -> None:
        """Record the first divergent query (column col of chunk s): theta position and tau of each pass."""
        fp, thp, tau = ref
        row = int((got.fingerprint[:, col] != fp[:, s + col]).nonzero()[0, 0])
        self.first = LayerAgreement(
            self.layer, 0.0, s + col,
            theta_pos=(int(thp[row, s + col]), int(got.theta_pos[row, col])),
            tau=(float(tau[row, s + col]), float(got.tau[row, col])),
        )

    def result(self) -> LayerAgreement:
        agreement = int(self.same) / self.total if self.total else 1.0
        if self.first is None:
            return LayerAgreement(self.layer, agreement, None)
        self.first.agreement = agreement
        return self.first


@torch.no_grad()
def chunked_pass(model: LM, tokens: torch.Tensor, chunk: int, ref_h: torch.Tensor, ref_sels: dict, fault: str | None) -> tuple[Run, float]:
    """Stream the document in chunks through the cache, comparing with the reference as it goes."""
    T = tokens.numel()
    dev = tokens.device
    max_diff, nll, overflowed, seconds = 0.0, 0.0, False, 0.0
    tallies = {i: _LayerTally(i, dev) for i in ref_sels}

    def timed_forward(piece, cache):
        nonlocal seconds
        t0 = time.perf_counter()
        out = model(piece.tokens, cache=cache)
        _sync(dev)
        seconds += time.perf_counter() - t0
        _inject(out.cache, fault)
        return out

    with PeakMemory(dev) as mem:
        reader = ChunkReader(model.empty_cache(1, device=dev, dtype=ref_h.dtype), dev)
        for host, _, out in reader(split_rows(tokens[None], chunk), timed_forward):
            s = int(host.doc_offset[0])  # the chunk's first position
            logits = out.logits[0]  # [c, V]
            ref = model.head(ref_h[s : s + logits.shape[0]])
            max_diff = max(max_diff, float((_wide(logits) - _wide(ref)).abs().max()))
            nll += _nll_sum(logits, tokens, s)
            undecided = [i for i, t in tallies.items() if t.first is None]
            bad = {i: tallies[i].add(s, out.selections[i], ref_sels[i]) for i in tallies}
            if undecided:  # the first divergent query of the layers that had none so far (one sync)
                firsts = torch.stack([torch.where(bad[i].any(), bad[i].int().argmax(), -1) for i in undecided]).tolist()
                for i, col in zip(undecided, firsts):
                    if col >= 0:
                        tallies[i].note_first(s, col, out.selections[i], ref_sels[i])
            overflowed |= out.overflowed
    layers = [t.result() for t in tallies.values()]
    same = sum(int(t.same) for t in tallies.values())
    total = sum(t.total for t in tallies.values())
    agreement = same / total if total else 1.0
    run = Run(chunk, max_diff, agreement, 0.0, mem.bytes, seconds, overflowed, layers)
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
    if fault == "drop_linear_state":
        for layer in cache.layers:
            if isinstance(layer.attn, SparseKLinearCache):
                layer.attn.lin_kv.zero_()
                layer.attn.lin_k.zero_()
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


def precision_context(dtype: str, device: torch.device):
    """The autocast a precision mode runs under (nullcontext for the weight-dtype modes)."""
    autocast = PRECISIONS[dtype][1]
    return torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext()


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
    """Both passes under `dtype`'s precision mode (the model's weights already cast by the caller)."""
    model.eval()
    with precision_context(dtype, tokens.device):
        _warm_up(model, tokens, chunk_sizes)
        ref_h, ref_sels, ref = reference_pass(model, tokens)
        runs = []
        for chunk in chunk_sizes:
            run, loss = chunked_pass(model, tokens, chunk, ref_h, ref_sels, fault)
            run.loss_diff = abs(loss - ref.loss)
            run.passed = (
                not run.overflowed and not ref.overflowed
                and run.max_abs_logit_diff <= max_logit_diff and run.worst_agreement >= min_agreement
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
    """(model, tokenizer or None) from a recipe (random init), a checkpoint or run dir (not both), or the small default."""
    torch.manual_seed(seed)
    if recipe is None and checkpoint is None:
        return LM(LMConfig(**DEFAULT_MODEL)), None
    if checkpoint is not None:
        loaded = load_checkpoint(checkpoint)  # CheckpointError (exit 1)
        return loaded.model, loaded.tokenizer

    r = load_recipe(recipe, init_source=read_init_source)  # RecipeError (exit 2); an unreadable train.init_from: CheckpointError
    tokenizer = load_tokenizer(r.tokenizer.path, r.tokenizer.eod_token) if r.tokenizer.path else None  # missing: exit 2; bad: 1
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
        raise UsageError(f"{text}: no such file", arg="text")
    if tokenizer is None:
        if vocab < 256:
            raise UsageError(f"without a tokenizer needs a byte vocabulary (>= 256); the model has {vocab}", arg="text")
        with open(text, "rb") as f:
            ids = list(f.read(n))
    else:
        # A token is rarely longer than 16 characters: tokenize a prefix, not the whole file.
        ids = tokenizer.encode(text.read_text(encoding="utf-8", errors="replace")[: 16 * n]).ids[:n]
    if len(ids) < 2:
        raise UsageError(f"{text} has fewer than 2 tokens", arg="text")
    return torch.tensor(ids, dtype=torch.int64)


def render(report: Report, console) -> None:
    from rich.table import Table

    mib = 2**20
    ref = report.reference
    t = Table(title=f"chunked vs unchunked, {report.tokens:,} tokens, {report.dtype}")
    for col in ("chunk size", "agreement", "worst layer", "max |Δ logit|", "Δ loss", "peak memory", "time", "result"):
        t.add_column(col, justify="right")
    t.add_row("unchunked", "—", "—", "—", f"loss {ref.loss:.6f}", f"{ref.peak_mem_bytes / mib:,.0f} MiB",
              f"{ref.seconds:.1f} s", "[red]overflow[/]" if ref.overflowed else "")
    for r in report.runs:
        verdict = "[green]pass[/]" if r.passed else ("[red]overflow[/]" if r.overflowed else "[red]FAIL[/]")
        worst = min(r.layers, key=lambda la: la.agreement, default=None)
        t.add_row(str(r.chunk_size), f"{r.selection_agreement:.6f}",
                  f"{worst.agreement:.6f} (L{worst.layer})" if worst else "—", f"{r.max_abs_logit_diff:.2e}",
                  f"{r.loss_diff:.2e}", f"{r.peak_mem_bytes / mib:,.0f} MiB", f"{r.seconds:.1f} s", verdict)
    console.print(t)
    if report.runs and report.runs[0].layers:
        console.print(_layer_table(report))
    need = (f"selection agreement ≥ {report.min_agreement} at every layer, max |Δ logit| ≤ {report.max_logit_diff:g}, "
            "no threshold overflow")
    console.print(("[bold green]PASSED[/] " if report.passed else "[bold red]FAILED[/] ") + f"({need})")


def _layer_table(report: Report):
    """Per selecting layer and chunk size: agreement, and the first query whose selected set differs."""
    from rich.table import Table

    t = Table(title="selection agreement per layer (first divergent query position)")
    t.add_column("layer", justify="right")
    for r in report.runs:
        t.add_column(f"chunk {r.chunk_size}", justify="right")
    for li, la0 in enumerate(report.runs[0].layers):
        cells = []
        for r in report.runs:
            la = r.layers[li]
            first = "—" if la.first_divergence is None else f"{la.first_divergence:,}"
            cells.append(f"{la.agreement:.6f} ({first})")
        t.add_row(str(la0.layer), *cells)
    return t
