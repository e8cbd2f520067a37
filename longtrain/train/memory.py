"""How much device memory a training run needs, before it starts; and what to say when it runs out.

`estimate_training_bytes` adds up, for one chunk of a step (per rank):
  - weights, gradients and AdamW's two moments in float32 (16 bytes per parameter), plus the
    compute-dtype copies autocast makes of the weights;
  - the activations autograd keeps per layer: measured once on a small copy of one block (same style,
    MLP ratio and precision, on the CPU) and scaled to d_model, plus the attention op's own (queries,
    the keys and values it reads, output);
  - the KV cache, twice (the chunk's input cache and the one it builds);
  - full attention only: the keys grow with the position (up to the longest document, or
    attention.max_context), and the chunk's mask [B, L, keys] (one tensor shared by the layers);
  - the head's loss: one slice of logits and the head's gradients (longtrain.model.loss);
  - on the CPU, the naive attention core's scores: for each block of 64 queries it scores k + w + 63
    keys and keeps what the backward needs (`naive_core_bytes_per_score`, measured), plus one step of
    them being built or differentiated (CUDA's kernels keep no scores); the linear types' naive core
    (CPU or backend naive) keeps ~48 bytes per query, head and scored key, their Triton core only
    per-query tensors (under train.deterministic, plus its backward's scratch for one layer: at most
    linear_triton.SCRATCH_BYTES unless one query block's takes more);
and 15% for the allocator's fragmentation and kernel workspaces (on the CPU also CPU_RUNTIME_BYTES, what a
step allocates beyond its tensors). `benchmarks/memory_estimate.py`
measures it against the peak a short fit adds (CPU: within 1.5x at three pool sizes, tested). The
summary adds, on the CPU, what the process already holds (Python, torch, the data); a run whose total
exceeds the device's memory is refused before it starts, with the remedies (`advice`).

`device_memory_bytes` is the device's total memory (psutil's total RAM on the CPU). The environment
variable LONGTRAIN_DEVICE_MEMORY (bytes, or e.g. "12GiB") overrides it, to rehearse a smaller device.
"""

from __future__ import annotations

import functools
import os
import re

import psutil
import torch

from longtrain.model.attention_types import kv_entries, linear
from longtrain.model.loss import SLICE_ELEMENTS

DEVICE_MEMORY_ENV = "LONGTRAIN_DEVICE_MEMORY"
FRAGMENTATION = 1.15
# A CPU step's allocations beyond its tensors (per-thread malloc arenas, oneDNN scratch, autograd's worker):
# benchmarks/memory_estimate.py measured peaks 30-90 MiB above the tensor estimate at k = 256 to 1,024.
CPU_RUNTIME_BYTES = 48 * 2**20
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{DEVICE_MEMORY_ENV}={text!r}: expected bytes, e.g. 80GiB or 85899345920")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device` (LONGTRAIN_DEVICE_MEMORY overrides it)."""
    if os.environ.get(DEVICE_MEMORY_ENV):
        return parse_bytes(os.environ[DEVICE_MEMORY_ENV])
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def process_bytes() -> int:
    """The process's resident memory now."""
    return psutil.Process().memory_info().rss


@functools.lru_cache(maxsize=1)
def runtime_bytes() -> int:
    """What a first training step adds to the process besides its tensors (measured once: a tiny step on
    the CPU): the libraries' code it pages in (autograd, oneDNN, the optimizer) and the compiled selection
    scan; about 320 MiB here, which quickstart's 110 MiB estimate left out of the ~800 MiB its `mem` showed.
    0 once a step has run in this process."""
    from longtrain.model.model import LM, LMConfig

    before = process_bytes()
    with torch.random.fork_rng(devices=[]):
        model = LM(LMConfig(vocab_size=8, layers=1, d_model=8, heads=1, attention="sparsek+sw", topk=2, window=2))
        tokens = torch.zeros(2, 16, dtype=torch.long)
        model(tokens, targets=tokens).loss_sum.backward()
        torch.optim.AdamW(model.parameters()).step()
    return max(0, process_bytes() - before)


@functools.lru_cache(maxsize=32)
def activation_bytes_per_token(style: str, mlp_ratio: float, dtype: torch.dtype) -> float:
    """Bytes autograd keeps per token and per unit of d_model for one block outside the attention op.

    Measured on a block of width 64 (the same style, MLP ratio and autocast dtype) with
    saved-tensor hooks; weight copies are left out (they are counted with the weights).
    """
    from longtrain.model.model import LM, LMConfig, rope_angles

    d, B, L = 64, 2, 47  # an odd token count: no weight's size is a multiple of it
    cfg = LMConfig(vocab_size=8, layers=1, d_model=d, heads=1, style=style, mlp_ratio=mlp_ratio, attention="sw", window=2)
    with torch.random.fork_rng(devices=[]):  # the run's random streams (dropout, a resumed RNG) stay untouched
        blk = LM(cfg).blocks[0]
        x = torch.randn(B, L, d, requires_grad=True)
    weights = {tuple(p.shape) for p in blk.parameters()} | {tuple(p.shape[::-1]) for p in blk.parameters()}
    rope = rope_angles(torch.arange(L)[None].expand(B, L), cfg.rotary_dim, cfg.rope_theta)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() % (B * L) == 0 and tuple(t.shape) not in weights:  # activations, not (copies of) weights
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            h, q, k, v = blk.enter(x, *rope)
            blk.leave(x, q)  # q stands in for the op's output (same shape)
    return sum(saved.values()) / (B * L * d)


QUERY_BLOCK = 64  # the attention cores' query tile (the op's `block`)
NAIVE_STEP_SCORES = 1 << 24  # the naive core scores at most this many (query, head, key) at a time (max_scores)


@functools.lru_cache(maxsize=32)
def naive_core_bytes_per_score(heads: int, kv_heads: int, head_dim: int, variant: str, dtype: torch.dtype) -> float:
    """Bytes autograd keeps in the naive attention core (the CPU's) per query, head and key it scores.

    The core gathers, for each block of 64 queries, its k + w + 63 keys and scores them all: the scores,
    softmax and gates it keeps for the backward grow with k (at k = 100,000 they were 24 GB of a
    quickstart run). Measured on one block at two pool sizes with saved-tensor hooks (the slope).
    """
    from longtrain.ops.sparsek_attention.naive import sparsek_attention_core_naive

    G, w = QUERY_BLOCK, 8

    def saved_bytes(K: int) -> int:
        N = K + (w - 1) + G  # [pool K][tail w - 1][chunk G]
        with torch.random.fork_rng(devices=[]):
            q = torch.randn(1, G, heads, head_dim, dtype=dtype, requires_grad=True)
            k = torch.randn(1, N, kv_heads, head_dim, dtype=dtype, requires_grad=True)
            v = torch.randn(1, N, kv_heads, head_dim, dtype=dtype, requires_grad=True)
            u = torch.randn(1, N, requires_grad=True)
        tau = torch.zeros(1, G, requires_grad=True)
        pos = torch.arange(N)[None]
        inputs = {t.untyped_storage().data_ptr() for t in (q, k, v, u, tau, pos)}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in inputs:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sparsek_attention_core_naive(
                q, k, v, u, pos, pos[:, N - G :], torch.full((1, G), -float("inf"), dtype=torch.float64),
                torch.zeros(1, G, dtype=torch.long), tau, torch.arange(K)[None, None], topk=K, window=w,
                tail_slots=w - 1, variant=variant, block=G,
            )
        return sum(saved.values())

    return (saved_bytes(192) - saved_bytes(64)) / (128 * G * heads)


def linear_core_is_naive(backend: str, head_dim: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether the linear types' SparseK part runs on the naive core: on the CPU, or where linear.triton_kernels_run
    says the kernels do not run for `backend`, the head dim or dtype (phi keeps the head dim)."""
    from longtrain.ops.sparsek_attention.linear import triton_kernels_run

    return device_type == "cpu" or not triton_kernels_run(backend, device_type, block=QUERY_BLOCK, head_dim=head_dim,
                                                          phi_dim=head_dim, dtype=dtype)


def linear_triton_scratch_bytes(B: int, L: int, H: int, scored: int, D: int) -> int:
    """The linear types' Triton core under train.deterministic: the backward's scratch (a slab of query tiles:
    linear_triton.scratch_tiles, at most linear_triton.SCRATCH_BYTES unless one block takes more; phi keeps the
    head dim) and the sort of the slab's key-list entries (int64: their ext rows, sorted, order; ~24 bytes each)."""
    from longtrain.ops.sparsek_attention.linear_triton import launch_settings, scratch_tiles

    _, slab, scratch = scratch_tiles(B, L, H, scored, D, D, QUERY_BLOCK)
    blocks = -(-slab * launch_settings(D, QUERY_BLOCK)["bwd"]["QB"] // QUERY_BLOCK)
    return scratch + B * blocks * scored * 24


def estimate_training_bytes(recipe, *, n_params: int, vocab_size: int, position: int, compute_dtype: torch.dtype,
                            n_trainable: int | None = None, device_type: str = "cuda") -> int:
    """Peak memory of one training chunk with the rows at document position `position` (per rank).

    device_type: "cpu" trains through the naive attention core, whose scores grow with k + w
    (naive_core_bytes_per_score); CUDA's kernels keep no scores."""
    m, att, cfg = recipe.model, recipe.attention, recipe.train
    e = torch.empty((), dtype=compute_dtype).element_size()
    d, layers, B, L = m.d_model, m.layers, cfg.batch_docs, cfg.chunk_size
    H, Hkv = m.heads, m.kv_heads or m.heads
    D = d // H
    mlp_ratio = (m.intermediate_size / d) if m.intermediate_size else m.mlp_ratio

    trainable = n_params if n_trainable is None else n_trainable  # LoRA: the frozen weights have no grads or moments
    state = n_params * (4 + (e if e < 4 else 0)) + trainable * 12
    acts = layers * B * L * d * activation_bytes_per_token(m.style, mlp_ratio, compute_dtype)
    scratch = 0  # a backward's transient buffers beyond what the layers keep
    kv = Hkv * D * 2 * e  # bytes of one cached key and its value
    if att.type == "full":
        keys = min(position, (att.max_context - 1 + L) if att.max_context else position)  # the chunk sees
        # the chunk's input cache and the one it builds (whose keys SDPA keeps for the backward);
        # grouped-query attention repeats the keys for SDPA's masked kernels
        cache = layers * B * (max(keys - L, 0) + keys) * kv
        op_keys = layers * B * keys * kv * (H // Hkv) if H != Hkv else 0
        mask = B * L * keys * e
    else:
        cached = kv_entries(att.type, att.topk or 0, att.window or 0)
        cache = 2 * layers * B * cached * kv
        op_keys = layers * B * (cached + L) * kv  # the op's [pool][tail][chunk] keys and values
        mask = 0
        scored = (att.topk or 0) + (att.window or 0) + QUERY_BLOCK - 1  # keys a query block scores
        blocks = -(-L // QUERY_BLOCK) * QUERY_BLOCK  # queries, padded to whole blocks
        if linear(att.type) and linear_core_is_naive(att.backend, D, compute_dtype, device_type):
            # the naive core keeps, per query and head, ~48 float32 bytes of each of its k + w + 63
            # gathered keys for the backward (measured: 120 KB a query at k = w = 128, 8 heads)
            op_keys += layers * B * L * H * scored * 48
        elif linear(att.type):  # the Triton core keeps no scores: phi of the queries and of the op's keys, the
            # float32 linear sums beyond the window, two float32 statistics per query and head, a flag per
            # query, and each block's key list (int32)
            op_keys += layers * B * (L * H * D * e + (cached + L) * Hkv * D * e + L * H * (D + 1) * 4
                                     + L * H * 8 + L * 4 + blocks // QUERY_BLOCK * scored * 4)
            if cfg.deterministic:  # its deterministic backward's scratch, one layer's at a time (transient)
                scratch = linear_triton_scratch_bytes(B, L, H, scored, D)
        elif device_type == "cpu":  # the naive core: what it keeps, and one step's scores being built or
            # differentiated (1.5 times what it keeps of them: the middle of what benchmarks/memory_estimate.py
            # measured at k = 256 to 2048, whose peaks vary by ±15% between runs)
            per_score = naive_core_bytes_per_score(H, Hkv, D, att.variant, compute_dtype)
            scores = B * blocks * H * scored  # per layer
            op_keys += (layers * scores + 1.5 * min(scores, NAIVE_STEP_SCORES)) * per_score
    op = layers * B * (2 * L * H * D * e + 4 * L * H) + op_keys  # q and o, a float32 row statistic
    if cfg.activation_checkpointing:  # each block keeps its float32 input; the backward recomputes one block at a time
        acts, op = layers * B * L * d * 4 + acts // layers, op // layers
    rows = max(1, SLICE_ELEMENTS // vocab_size)
    loss = min(rows, B * L) * vocab_size * (2 * e + 8) + B * L * d * 4 + vocab_size * d * 4
    embed = 3 * B * L * d * 4  # the embedding's output, the final norm's input and output
    runtime = CPU_RUNTIME_BYTES if device_type == "cpu" else 0
    return int(FRAGMENTATION * (state + acts + op + cache + mask + loss + embed + scratch)) + runtime


def longest_position(corpus, cfg) -> int:
    """The furthest document position a run reaches: its longest training document, or validation's."""
    train = int(corpus.train.lengths.max()) if len(corpus.train) else 0
    valid = min(int(corpus.valid.lengths.max()), cfg.valid_tokens) if cfg.valid_every and len(corpus.valid) else 0
    return max(train, valid, 1)


def max_context_that_fits(recipe, *, budget: int, **kw) -> int | None:
    """The largest attention.max_context (a power of two ≥ 1024) whose estimate fits in `budget` bytes."""
    fits = None
    mc = 1024
    while mc <= 2**24:
        r = recipe.model_copy(update={"attention": recipe.attention.model_copy(update={"max_context": mc})})
        if estimate_training_bytes(r, position=mc + recipe.train.chunk_size, **kw) > budget:
            break
        fits, mc = mc, mc * 2
    return fits


def advice(recipe, *, suggest_max_context: int | None = None, naive_linear_core: bool = False) -> str:
    """What to change when a run does not fit its device. naive_linear_core: the run is on a GPU and its attention
    would run the naive core (linear_core_is_naive: attention.backend naive, or a head dim the kernels do not take), whose
    kept scores are then most of the estimate."""
    cfg, att = recipe.train, recipe.attention
    tips = []
    if naive_linear_core and linear(att.type):  # first: 38.9 against 6.3 GiB (12 x 768, k = w = 512, 4096 x 1)
        tips.append(f"--set attention.backend=triton (the Triton kernels keep no scores; attention.backend "
                    f"{att.backend} runs the naive core, which keeps ~48 bytes per query, head and scored key for the backward)")
    tips += [f"a smaller train.chunk_size (now {cfg.chunk_size}; --set train.chunk_size={max(cfg.chunk_size // 2, 1)}), "
            f"or fewer train.batch_docs (now {cfg.batch_docs})"]
    if att.type == "full":
        mc = f"--set attention.max_context={suggest_max_context}" if suggest_max_context else "--set attention.max_context=N"
        tips.append(f"cap full attention's cache with {mc} (each query then sees the last N keys: a sliding window)")
        tips.append("or train with attention.type sparsek+sw, whose cache has a fixed size")
    elif att.topk or att.window:
        tips.append(f"a smaller attention.topk or attention.window (now {att.topk or 0} and {att.window or 0}: the "
                    "cache and, on the CPU, the scores each query block keeps grow with k + w)")
    if att.type != "full" and cfg.precision in ("fp32",):
        tips.append("or train.precision bf16")
    if not cfg.activation_checkpointing:
        tips.append("or --set train.activation_checkpointing=true (blocks recomputed in the backward: less memory, same results)")
    return "; ".join(tips)
