"""One training chunk replayed from a CUDA graph (`train.cuda_graphs`): forward, loss and backward in one launch.

A chunk of the 12-layer model is a few thousand kernel launches (projections, the op's scan and
kernels, the cache update, the backward of each). Queued one by one from Python they take longer
than the GPU takes to run them: the GPU waits for the host. Every chunk of a run has the same
shape (the stream pads a document's last chunk), so the trainer captures its chunk pass once --
forward, loss, backward into the gradients, the selection statistics and the next cache -- and
replays it for every chunk after: the same kernels on the same inputs, so the same results as
running the pass eagerly (tests/gpu/test_step_graph_gpu.py compares them on the device).

What a capture needs, and how it is provided here:
  - inputs at fixed addresses: the chunk's tokens, lengths, targets and loss weight are copied into
    the graph's buffers, and the cache lives in the graph's own buffers, which each replay updates
    in place (as generate.Decoder does when decoding);
  - gradients at fixed addresses: created before the capture, zeroed in place (not freed) by the
    optimizer step, accumulated into by every replay as backward does;
  - no host synchronisation inside: the training pass already makes none (tests/ops/test_host_sync.py).
A full-attention cache grows, so its graph is captured for chunks that start from an empty cache
(documents of one chunk, as the recall circuit's; `ChunkReader` drops the reset rows' dead keys) and
hands out the next cache in its own output buffers; other chunks run eagerly (`fits`).
`graph_unusable` says where a graph cannot be used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from longtrain.device import warm_up_aside
from longtrain.model.cache import ModelCache


@dataclass
class ChunkInputs:
    """One chunk as the training pass reads it, on the device."""

    tokens: torch.Tensor  # [B, L] int64
    lengths: torch.Tensor  # [B] int64
    targets: torch.Tensor  # [B, L] int64, IGNORE where there is none
    weight: torch.Tensor  # [] float32: 1 / the targets of the chunk over every rank (its share of the mean loss)


@dataclass
class ChunkResult:
    """What the training pass of one chunk leaves (besides the gradients it accumulates)."""

    loss_sum: torch.Tensor  # [] summed cross-entropy over this rank's targets, detached
    cache: ModelCache  # the cache the next chunk continues from
    overflow: torch.Tensor | None  # [] bool: a threshold state hit its cap (None: nothing selects)
    stats: torch.Tensor | None  # [layers, 11] SelectionDiagnostics.chunk_stats (None: nothing selects)
    score_distill: torch.Tensor | None = None  # [] train.score_distill's loss, detached (None: off)


ChunkPass = Callable[[ChunkInputs, ModelCache], ChunkResult]


class ChunkGraph:
    """`chunk_pass` captured for one chunk shape, with its input buffers, its cache and the gradients it writes."""

    def __init__(self, chunk_pass: ChunkPass, inputs: ChunkInputs, cache: ModelCache, params: list[torch.nn.Parameter]):
        self.inputs = ChunkInputs(**{f.name: getattr(inputs, f.name).clone() for f in fields(ChunkInputs)})
        self.cache = cache.clone()  # the graph's own: every replay leaves the next cache in it
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grads = [p.grad for p in params]  # held: the graph writes into them
        with warm_up_aside(self.inputs.tokens.device):  # warm up off the capture (lazy initialisation, workspaces)
            warm = chunk_pass(self.inputs, self.cache)
        torch._foreach_zero_(self.grads)  # the warm-up's gradients: a capture starts a step, from zero
        # a fixed-size cache goes back into the graph's own; a growing one (full attention) comes out longer
        # than it went in, so the replays hand out their output buffers (valid until the next replay)
        self.in_place = shapes(warm.cache) == shapes(self.cache)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = chunk_pass(self.inputs, self.cache)
            if self.in_place:
                self.cache.copy_(out.cache)  # the next cache, in place
        self.out = ChunkResult(loss_sum=out.loss_sum, cache=self.cache if self.in_place else out.cache,
                               overflow=out.overflow, stats=out.stats, score_distill=out.score_distill)
        self.replays = 0

    def fits(self, inputs: ChunkInputs, cache: ModelCache) -> bool:
        """Whether a chunk of these inputs from this cache replays the graph (the same shapes as captured)."""
        return (all(getattr(inputs, f.name).shape == getattr(self.inputs, f.name).shape for f in fields(ChunkInputs))
                and (self.in_place or shapes(cache) == shapes(self.cache)))  # a fixed-size cache always fits

    def __call__(self, inputs: ChunkInputs, cache: ModelCache) -> ChunkResult:
        """Replay on `inputs` from `cache`. The result's tensors are the graph's buffers: the next replay
        overwrites them (its cache is this graph's cache, which is meant to be carried on)."""
        torch._foreach_copy_([getattr(self.inputs, f.name) for f in fields(ChunkInputs)],
                             [getattr(inputs, f.name) for f in fields(ChunkInputs)])
        self.cache.copy_(cache)  # nothing to copy when the trainer carries the graph's own cache on
        self.graph.replay()
        self.replays += 1
        return self.out


def shapes(cache: ModelCache) -> list[torch.Size]:
    return [t.shape for t in cache.tensors()]


def capturable(cache: ModelCache) -> bool:
    """Whether a chunk from `cache` is one to capture: any from a fixed-size cache, from a growing one (full
    attention) only from an empty one, whose shapes repeat (documents of one chunk)."""
    return not cache.grows or cache.kv_entries_per_layer == 0


def graph_unusable(recipe, *, device_type: str, precision: str) -> str | None:
    """Why a run of `recipe` replays no CUDA graph of its chunks (None: it does, where train.cuda_graphs
    allows); device_type and precision: the run's, resolved (cuda or cpu; bf16, fp16 or fp32)."""
    cfg = recipe.train
    if not cfg.cuda_graphs:
        return "train.cuda_graphs is false"
    if device_type != "cuda":
        return "not on CUDA"
    if cfg.parallel == "fsdp":
        return "fsdp gathers and reduces parameters in every chunk's pass"
    if recipe.model.dropout > 0:
        return "dropout draws new masks per chunk"
    if precision == "fp16":
        return "fp16 loss scaling"
    if cfg.activation_checkpointing:
        # the backward reruns each block's forward (the attention op and its selection included) inside the
        # replay; equal to eager on the CPU (tests/model), not yet compared under a captured graph on a GPU
        return "train.activation_checkpointing (its recomputation is not yet checked under a CUDA graph)"
    if cfg.freeze is not None and cfg.freeze.steps > 0:
        # On an H100 a graph captured after the frozen steps matched eager passes bitwise with eager
        # blocks, but with compiled blocks the first thawed step's gradient norm differed by 0.2%
        # (perhaps Inductor timing its reduction configs for the thawed variants); off until resolved
        return "train.freeze"
    return None
