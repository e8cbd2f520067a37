"""Data parallelism on PyTorch's own stack: torchrun's environment, the process group, DDP or FSDP2.

    torchrun --nproc_per_node N -m longtrain.cli fit RECIPE          # one machine, N ranks
    torchrun --nnodes M --node_rank I --nproc_per_node N \\
             --rdzv_backend c10d --rdzv_endpoint HOST:PORT -m longtrain.cli fit RECIPE   # M machines

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; `setup` reads them, binds the rank
to its GPU (LOCAL_RANK) and opens the process group: NCCL on GPUs, gloo on CPUs. Without those
variables the run is one process, as before, with no process group (except FSDP, which needs
one: it then runs as a world of one).

Rows: each rank streams its own `batch_docs` rows of the global batch (global row g =
rank · batch_docs + r, see longtrain.data.stream). The loss of a chunk is the token-weighted mean
over every rank's rows: each rank divides its summed loss by the chunk's target count over all
ranks (which the stream knows without communication), and as DDP and FSDP average gradients over
the ranks, each rank's loss is scaled by the world size first, so the averaged gradient is the
gradient of the global mean: what one process with all the rows computes, up to the order of the
sums.

Models: `ddp` replicates the model (DistributedDataParallel, gradients all-reduced); `fsdp` shards
parameters, gradients and optimizer state with FSDP2 (`fully_shard` per block, then the root),
with bf16 compute and fp32 gradient reduction on GPUs through its MixedPrecisionPolicy (the
SparseK scorers keep fp32 parameters: scores decide the selection, see DESIGN.md section 2).
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longtrain.errors import LaunchError  # noqa: F401  (raised here; defined with the others)

PARALLEL = ("ddp", "fsdp")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the ranks of the run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # on this machine
    local_world_size: int = 1
    launched: bool = False  # by torchrun (the environment names the ranks)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, writes metrics and run files, and commits checkpoints."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """A process group is open (collectives work)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def launch_env(environ: dict[str, str] | None = None) -> Ranks:
    """The ranks torchrun (or any launcher that sets RANK and WORLD_SIZE) describes; one process otherwise."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return Ranks()
    world = int(env["WORLD_SIZE"])
    return Ranks(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
        launched=True,
    )


def setup(parallel: str, device: torch.device) -> tuple[Ranks, torch.device, list[str]]:
    """Open the process group if the run needs one; returns (ranks, this rank's device, notes).

    `device` is the recipe's choice (cpu or cuda); each rank takes GPU LOCAL_RANK. The notes are
    lines for the run's summary (rank 0 prints them; warnings carry the rank of who wrote them).
    """
    if parallel not in PARALLEL:
        raise ValueError(f"train.parallel must be one of {PARALLEL}, got {parallel!r}")
    ranks = launch_env()
    notes: list[str] = []
    if device.type == "cuda":
        if ranks.launched and ranks.local_rank >= torch.cuda.device_count():
            raise LaunchError(
                f"{ranks.describe()} has local rank {ranks.local_rank} but this machine shows "
                f"{torch.cuda.device_count()} GPU(s): use --nproc_per_node {torch.cuda.device_count()} or fewer"
            )
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"

    if ranks.launched and not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    elif not ranks.launched and parallel == "fsdp" and not dist.is_initialized():
        # FSDP needs a process group even alone: a world of one, in this process.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        notes.append(
            "note: train.parallel is fsdp but the run was not launched by torchrun: running as world size 1 "
            "(fully_shard over one rank shards nothing). Launch with `torchrun --nproc_per_node N -m "
            "longtrain.cli fit ...` to shard over N GPUs."
        )
    if ranks.parallel:
        install_rank_prefix(ranks.rank)
    if device.type == "cpu" and ranks.local_world_size > 1 and ranks.local_rank == 0:
        cores = available_cores()
        if ranks.local_world_size > cores:
            notes.append(rank_message(ranks,
                f"warning: {ranks.local_world_size} ranks on this machine share {cores} CPU core(s): they compete "
                f"for the cores and each step waits for the slowest. Use --nproc_per_node {cores} or fewer, with "
                "train.batch_docs raised to keep ranks × train.batch_docs (the global batch) the same."
            ))
    return ranks, device, notes


def teardown(drop: list | None = None) -> None:
    """Close the process group (every rank, at the end of the run, also after an error).

    `drop`: what holds on to the group (a model, FSDP's mesh), released first. The group must be
    destroyed while Python is fully alive: if what holds it outlives it until interpreter shutdown,
    gloo's destructor waits on worker threads that wait for the GIL (a hang).
    """
    if drop is not None:
        drop.clear()
        gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------ messages


def install_rank_prefix(rank: int) -> None:
    """Python warnings of this process start with `[rank N]` (every rank logs its own)."""
    plain = warnings.formatwarning

    def with_rank(message, category, filename, lineno, line=None):
        return f"[rank {rank}] " + plain(message, category, filename, lineno, line)

    if getattr(warnings.formatwarning, "_longtrain_rank", None) != rank:
        with_rank._longtrain_rank = rank  # type: ignore[attr-defined]
        warnings.formatwarning = with_rank


def rank_message(ranks: Ranks, text: str) -> str:
    """`text` with the rank in front when there are several ranks."""
    return f"[rank {ranks.rank}] {text}" if ranks.parallel else text


def print_for_rank(ranks: Ranks, text: str) -> None:
    """A warning from a rank other than 0 (rank 0 prints through the run's display): stderr, rank first."""
    print(rank_message(ranks, text), file=sys.stderr, flush=True)


# ------------------------------------------------------------------ collectives (no-ops alone)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks, in place (and returned); unchanged without a process group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class LateVotes:
    """A device scalar per step, read on the host one step later without waiting for the newer work.

    `push(v)` starts v's copy to pinned host memory and returns the previous step's value: on CUDA
    it waits for that copy's event alone (long done by then), not for the step queued since.
    """

    def __init__(self):
        self.pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def push(self, value: torch.Tensor) -> float:
        before = self.read()
        if value.device.type == "cuda":
            host = torch.empty((), dtype=value.dtype, pin_memory=True).copy_(value, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self.pending = (host, done)
        else:
            self.pending = (value.clone(), None)
        return before

    def read(self) -> float:
        if self.pending is None:
            return 0.0
        host, done = self.pending
        if done is not None:
            done.synchronize()
        return float(host)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (a small picklable object)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def on_main(fn, ranks: Ranks):
    """`fn()` on rank 0 alone, its result (or its exception) on every rank.

    For decisions one rank makes for all (which checkpoint to resume, whether the run dir is
    free): every rank then goes on, or raises the same error, together.
    """
    if not ranks.active or ranks.world_size == 1:
        return fn()
    outcome: tuple[Any, BaseException | None] = (None, None)
    if ranks.is_main:
        try:
            outcome = (fn(), None)
        except Exception as e:  # sent to every rank, raised by all
            outcome = (None, e)
    result, error = broadcast_object(outcome)
    if error is not None:
        raise error
    return result


class OtherRankDisplay:
    """The display of ranks other than 0: no progress, no lines; warnings go to stderr with the rank."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def __enter__(self) -> OtherRankDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def message(self, text: str) -> None:
        if text.startswith("warning"):
            print_for_rank(self.ranks, text)

    def update(self, stats) -> None:
        pass

    def tokens_per_s(self) -> float:
        return 0.0


class NoMetrics:
    """Ranks other than 0 write no metrics.jsonl."""

    def __enter__(self) -> NoMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def log(self, record: dict) -> None:
        pass


# ------------------------------------------------------------------ the model


@contextmanager
def hold_run_dir(run_dir, ranks: Ranks):
    """Rank 0 holds the run dir (run_dir.RunLock) for the whole run; if it is busy, every rank stops
    with the same error."""
    from longtrain.train.run_dir import RunLock

    lock = RunLock(run_dir)
    on_main(lambda: lock.__enter__() and None, ranks)
    try:
        yield
    finally:
        if ranks.is_main:
            lock.__exit__(None, None, None)


def wrap_model(
    model: nn.Module, parallel: str, device: torch.device, ranks: Ranks, *, compute_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The model as the ranks train it: FSDP2 (sharded), or the LM itself (ddp: one replica per rank).

    ddp replicas start from rank 0's weights (broadcast here) and stay equal because every rank
    steps with the same averaged gradients (`average_gradients`, once per step). There is no DDP
    wrapper: its hooks would reduce inside every chunk's backward, where a CUDA graph replays the pass.
    `compute_dtype` (train.precision): FSDP gathers the parameters in it for the forward.
    """
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Inputs are not cast: the per-row cache carries float64 score statistics and fp32 scores.
        if compute_dtype != torch.float32:  # bf16 compute, fp32 gradient reduction; the fp32 master copy stays sharded
            mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        else:  # fp32 (the CPU's default)
            mp = MixedPrecisionPolicy(cast_forward_inputs=False)
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for block in getattr(model, "blocks", []):
            scorer = getattr(getattr(block, "attn", None), "scorer", None)
            if scorer is not None:  # SparseK scores stay fp32 (they decide the selection)
                fully_shard(scorer, mp_policy=fp32)
            fully_shard(block, mp_policy=mp)
        # The root holds the embedding (tied to the head in gpt2 style), the final norm and head.
        fully_shard(model, mp_policy=mp)
        return model
    if ranks.world_size > 1:
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
    return model


def is_replicated(model: nn.Module, ranks: Ranks) -> bool:
    """ddp with several ranks: each holds the whole model, and `average_gradients` keeps them equal."""
    return ranks.world_size > 1 and not is_sharded(model)


@torch.no_grad()
def average_gradients(params: list[nn.Parameter], world_size: int) -> None:
    """Average the accumulated gradients over the ranks, in place: one all-reduce per dtype of one flat buffer.

    Called once per optimizer step, after its last chunk, so the chunks' passes (and their CUDA graph)
    hold no communication. Every rank has the same parameters with gradients (same model, same freeze).
    """
    grads = [p.grad for p in params if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        group = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in group])  # [sum of sizes]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size)
        parts = flat.split([g.numel() for g in group])
        torch._foreach_copy_(group, [part.view_as(g) for part, g in zip(parts, group)])


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """FSDP: inside, backward reduce-scatters gradients only if `enabled` (off for all but the last
    chunk of a gradient-accumulation step: the sum is the same, with one reduction instead of many).
    Replicas reduce nothing in the backward (`average_gradients` does, after the step's last chunk)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


# ------------------------------------------------------------------ full state for checkpoints


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> tuple[dict, dict]:
    """(model state_dict, optimizer state_dict) of the whole model on rank 0, on the CPU; ({}, {}) elsewhere.

    The optimizer's is in torch's own layout (state keyed by parameter position), the layout a
    single process saves, so a checkpoint reads the same whatever wrote it.
    """
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=options)  # collectives: every rank calls
        optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
        if not ranks.is_main:
            return {}, {}
        return model_sd, _positional(optim_sd)
    if not ranks.is_main:  # replicas: rank 0's copy is everyone's
        return {}, {}
    return model.state_dict(), optimizer.state_dict()


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict | None, optim_sd: dict | None, ranks: Ranks
) -> None:
    """Load full states (read by rank 0 alone when there is a process group) into every rank's model and optimizer."""
    if not ranks.active:
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_sd if ranks.is_main else {}, options=options)
    named = _fqn_layout(model, optimizer, optim_sd) if ranks.is_main else {}
    set_optimizer_state_dict(model, optimizer, named, options=options)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters, in torch's positional order (group by group)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _positional(named: dict) -> dict:
    """A name-keyed optimizer state_dict (torch.distributed.checkpoint's) in torch's positional layout."""
    order = [name for group in named["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups, start = [], 0
    for group in named["param_groups"]:
        n = len(group["params"])
        groups.append({**group, "params": list(range(start, start + n))})
        start += n
    return {"state": {index[name]: s for name, s in named["state"].items()}, "param_groups": groups}


def _fqn_layout(model: nn.Module, optimizer: torch.optim.Optimizer, positional: dict) -> dict:
    """Inverse of `_positional`, with the names of this model's parameters."""
    names = _param_names(model, optimizer)
    groups = []
    for group in positional["param_groups"]:
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    return {"state": {names[int(i)]: s for i, s in positional["state"].items()}, "param_groups": groups}
