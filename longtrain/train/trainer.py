"""`longtrain fit`: chunk-recurrent training (the paper's Algorithm 3), resumable exactly.

`Trainer.train()` is the outline, torchtitan's shape: hold the run dir, set up (data, model,
optimizer, the checkpoint to resume), start the run, then step: `train_step`, `validate` when due,
`log_step`, `save` when due. Each part is one method, so a feature (another precision, frozen
layers, data-parallel ranks) changes the method it concerns. Data, the model and its cache,
checkpoints, the optimizer, RNG and metrics live in their own modules (longtrain.data,
longtrain.model, longtrain.train.*).

Per optimizer step, `grad_accum` chunks: each row of the batch reads its document chunk by chunk;
a row that starts a new document has its cache reset; the forward continues from the cache, the
loss backpropagates into this chunk only (the cache is detached), and the new cache carries on.
Everything that decides the next step (weights, optimizer, caches, data position, RNG) is in the
checkpoint, so a resumed run continues bitwise where it stopped.

The run dir is safe to point at: one `fit` holds it at a time (`RunLock`), setup decides whether
and from where to resume before anything is written (a refused resume leaves the directory as
it was), and files a fresh start would replace are moved aside with a message, never deleted.

Speed: one process makes no host synchronisation in a step outside the attention op. The loss, the
gradient norm and the threshold-overflow flag stay on the device until `read_back`, at each log line
(`logging.every`) and before validation and checkpoints: that is where a NaN loss stops the run
(before anything is saved), where an overflow warning appears (so up to `logging.every` steps after
it happened) and where metrics.jsonl gets the steps since the last log line. On CUDA the model's
blocks around the op are compiled (`train.compile`) and each chunk's forward and backward is replayed
from one CUDA graph (`train.cuda_graphs`, longtrain.train.step_graph); the KV cache is kept in the
compute dtype (`train.precision`); the head's loss is computed slice by slice (longtrain.model.loss).

Under `torchrun` each rank runs this same loop on its own rows of the global batch
(longtrain.train.distributed): rank 0 alone holds the run dir, prints, writes metrics and run
files and commits checkpoints; decisions one rank takes for all (which checkpoint, whether to
stop) reach every rank, so they go on or stop together.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from longtrain.console import make_console
from longtrain.data import DocumentStream, PreparedCorpus, prepare_corpus
from longtrain.data.stream import Chunk
from longtrain.device import train_device
from longtrain.errors import TrainingError  # noqa: F401  (raised here; defined with the others)
from longtrain.model import LM, LMConfig, warn_threshold_overflow
from longtrain.model.chunks import ChunkReader, send
from longtrain.train import distributed
from longtrain.train.checkpoint import RECIPE_FILE, TOKENIZER_FILE, Checkpointer, RunCheckpoints, TrainState, run_hashes
from longtrain.train.determinism import deterministic
from longtrain.train.diagnostics import SelectionDiagnostics
from longtrain.train.distributed import Ranks
from longtrain.train.init import apply_freeze, check_init_source, imported_origin, init_from_checkpoint
from longtrain.train.lora import add_lora
from longtrain.train.metrics import (
    missing_extras,
    read_numbers,
    METRICS_FILE,
    TENSORBOARD_DIR,
    WANDB_ID_FILE,
    MetricsLogger,
    ProgressDisplay,
    RowProgress,
    StepStats,
    peak_memory_bytes,
    wandb_settings,
)
from longtrain.train.optim import build_optimizer, clip_grad_norms, lr_at, normalize_scorers, set_lr
from longtrain.train.checkpoint.ranks import Layout
from longtrain.train.recipe import Recipe, recipe_to_yaml
from longtrain.train.checkpoint.rng import seed_everything
from longtrain.train.run_dir import check_run_folders, run_dir_holder, write_atomically
from longtrain.train.signals import StopSignal, kill_for_tests_after, signal_for_tests_at
from longtrain.train import memory, summary
from longtrain.train.summary import FitResult
from longtrain.train.validation import evaluate
from longtrain.train.step_graph import ChunkGraph, ChunkInputs, ChunkResult, capturable, graph_unusable

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPILE_BACKEND_ENV = "LONGTRAIN_COMPILE_BACKEND"  # train.compile's backend: inductor, or aot_eager to debug
COMPILE_MODE_ENV = "LONGTRAIN_COMPILE_MODE"  # torch.compile's mode to try, e.g. max-autotune-no-cudagraphs


def fit(recipe: Recipe, *, run_dir: Path | None = None, resume: str = "auto", fork: bool = False, console=None) -> FitResult:
    """Train `recipe` into `run_dir` (what `longtrain fit` runs)."""
    return Trainer(recipe, run_dir=run_dir, resume=resume, fork=fork, console=console).train()


class Trainer:
    """One training run: a recipe, its run dir and a resume choice (auto | never | a checkpoint path);
    fork: the path's state starts this run afresh (it may belong to another run)."""

    def __init__(
        self, recipe: Recipe, *, run_dir: Path | None = None, resume: str = "auto", fork: bool = False, console=None,
    ):
        self.recipe, self.cfg = recipe, recipe.train
        self.run_dir = Path(run_dir) if run_dir else recipe.run_dir()
        self.resume, self.fork = resume, fork
        self.console = console or make_console()
        self.checkpoints = RunCheckpoints(self.run_dir, recipe.checkpoint)  # which one to resume, what is there
        check_run_folders(self.run_dir, self.checkpoints.dir, bool(recipe.checkpoint.dir))  # a file in the way: UsageError
        self.state = TrainState()
        self.stop = StopSignal()
        self.start = TrainState()  # where this session starts (the resumed checkpoint's state)
        self.resume_from: Path | None = None
        self.restore_seconds: float | None = None  # loading the resumed checkpoint
        self.saved_on: dict | None = None  # the machine that saved the resumed checkpoint (its meta's), if recorded
        self.last_saved: Path | None = None
        self.last_loss: float | None = None
        self.final_valid_loss: float | None = None
        self.train_seconds = 0.0
        self.init_notes: list[str] = []  # what train.init_from loaded
        self.lora_line: str | None = None  # train.lora: what trains and what is frozen
        self.ranks = Ranks()  # one process until start_ranks() reads torchrun's environment
        self.rank_notes: list[str] = []
        self.stop_agreed: int | None = None  # with several ranks: the signal any rank got, as all ranks know it
        self.votes = distributed.LateVotes()  # with several ranks: the stop votes, read a step late
        self._warned_overflow = False
        self.best_unsaved = False  # checkpoint.keep_best: this step's validation is a new best, not yet saved
        self.pending: list[dict] = []  # step records not yet written (their numbers may still be on the device)
        self.overflow: torch.Tensor | None = None  # [] bool on the device: a threshold state overflowed since the last read
        self.chunk_graph: ChunkGraph | None = None  # the training pass of one chunk as a CUDA graph (train.cuda_graphs)
        self.graphs_off: str | None = None  # why no graph is used (set in setup)

    # ------------------------------------------------------------------ the outline

    def train(self) -> FitResult:
        self.start_ranks()  # torchrun's ranks and their process group (none for one process)
        try:
            with distributed.hold_run_dir(self.run_dir, self.ranks), deterministic(self.cfg.deterministic):
                self.setup()  # nothing is written to the run dir before this returns
                if self.state.step >= self.cfg.steps or self.out_of_patience():  # finished: nothing to do or write
                    return self.result(seconds=0.0)
                if problem := summary.memory_refusal(self):  # before anything is written
                    raise TrainingError(problem)
                self.start_run()
                t_start = time.monotonic()
                with self.stop, self.display, self.metrics, summary.out_of_memory_help(self):
                    while self.state.step < self.cfg.steps and not self.stopping and not self.out_of_patience():
                        record = self.train_step()
                        if self.validation_due():
                            record |= self.validate()
                        self.log_step(record, elapsed=time.monotonic() - t_start)
                        if self.save_due():
                            self.save()
                return self.result(seconds=time.monotonic() - t_start)
        finally:
            self.stop_ranks()

    def stop_ranks(self) -> None:
        """Close the process group, if any, once what holds on to it is dropped (distributed.teardown)."""
        if self.ranks.active:
            held = ("train_model", "model", "optimizer", "reader", "checkpointer")
            distributed.teardown(drop=[self.__dict__.pop(name, None) for name in held])

    def start_ranks(self) -> None:
        """This process's rank, its device (GPU LOCAL_RANK under torchrun) and the process group."""
        try:
            self.ranks, self.device, self.rank_notes = distributed.setup(self.cfg.parallel, train_device(self.cfg.device))
        except distributed.LaunchError as e:
            raise TrainingError(str(e)) from None

    def layout(self) -> Layout:
        """This run's rows: ranks × train.batch_docs (global row g = rank · batch_docs + r)."""
        return Layout(self.ranks.world_size, self.cfg.batch_docs, self.cfg.parallel)

    # ------------------------------------------------------------------ setup: reads only

    def setup(self) -> None:
        """Data, model, optimizer, stream and the checkpoint to resume, all checked before the run starts."""
        seed_everything(self.cfg.seed)  # the same on every rank: every replica starts from the same weights
        if missing := missing_extras(self.recipe.logging):  # optional packages the recipe asks for
            raise TrainingError(missing)
        meta = self.read_inputs()
        if meta is not None and (meta["step"] >= self.cfg.steps or self.out_of_patience(TrainState.from_meta(meta))):
            self.state = self.start = TrainState.from_meta(meta)  # finished: no need to build anything
            return
        self.model = self.build_model(self.device)
        if self.cfg.init_from and self.resume_from is None:  # fine-tuning: weights only, the rest starts fresh
            self.init_notes = init_from_checkpoint(self.model, self.cfg.init_from, self.recipe)
            self.state.imported_from = imported_origin(self.cfg.init_from)  # export writes its HF config back
        self.model.set_score_distill(self.cfg.score_distill_queries if self.cfg.score_distill > 0 else 0)
        self.model.activation_checkpointing = self.cfg.activation_checkpointing  # blocks recomputed in the backward
        if self.compiles:  # before FSDP wraps it (torchtitan's order)
            mode = {"mode": os.environ[COMPILE_MODE_ENV]} if os.environ.get(COMPILE_MODE_ENV) else {}
            self.model.compile_blocks(backend=os.environ.get(COMPILE_BACKEND_ENV, "inductor"), **mode)
        self.train_model = self.parallelize()
        self.optimizer = self.build_optimizer()
        # fp16: the loss scaler (its scale and growth tracker are in the checkpoint); otherwise it passes through
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.stream = self.build_stream()
        self.reader = ChunkReader(self.model.empty_cache(self.cfg.batch_docs, device=self.device, dtype=self.compute_dtype),
                                  self.device)  # each row's documents, chunk by chunk through the cache
        self.selection = SelectionDiagnostics(self.model)  # per-layer pool statistics, summed on the device
        self.graphs_off = self.graph_unusable()
        self.checkpointer = Checkpointer(
            self.checkpoints, state=self.state, model=self.train_model, optimizer=self.optimizer, scaler=self.scaler,
            stream=self.stream, reader=self.reader, recipe=self.recipe, corpus=self.corpus, hashes=self.hashes,
            ranks=self.ranks, layout=self.layout(), device=self.device, cache_dtype=self.compute_dtype,
        )
        if self.resume_from is not None:
            t0 = time.perf_counter()
            self.checkpointer.restore(self.resume_from)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.restore_seconds = time.perf_counter() - t0  # read, checked and placed (sharded under fsdp)
        self.start = replace(self.state)  # a copy: the state changes every step

    def read_inputs(self) -> dict | None:
        """The corpus, and the checkpoint to resume with its meta checked against this recipe (or None)."""
        # rank 0 picks the checkpoint (validating it whole) and tells the others
        self.resume_from = distributed.on_main(lambda: self.checkpoints.to_resume(self.resume, fork=self.fork), self.ranks)
        self.last_saved = None if self.fork else self.resume_from  # a fork has saved nothing of its own yet
        if self.cfg.init_from and self.resume_from is None:  # a fresh fine-tuning run reads its source first
            check_init_source(self.cfg.init_from)
        self.corpus = self.prepare_data()
        wants = [k for k, on in (("checkpoint.keep_best", self.recipe.checkpoint.keep_best),
                                 ("train.early_stopping", self.cfg.early_stopping is not None)) if on]
        if wants and not len(self.corpus.valid):
            raise TrainingError(f"{' and '.join(wants)} compare validation losses, but the data has no validation "
                                "documents; set data.valid (a folder, or a fraction such as 0.02)")
        self.held_bytes = memory.process_bytes()  # what the process holds before the model: Python, torch, the data
        self.hashes = run_hashes(self.recipe, self.corpus.tokenizer)
        if self.resume_from is None:
            return None
        meta = self.checkpoints.check(self.resume_from, self.hashes, self.layout())
        self.saved_on = meta.get("machine")  # older checkpoints record none
        return meta

    def dry_run(self) -> list[str]:
        """What `fit` would do, without doing it: the resolved recipe, the summary and the plan.

        It writes nothing to the run dir (the token cache may fill: tokenizing is part of the check), and
        refuses what `fit` would refuse, with the same messages.
        """
        train_device(self.cfg.device)  # as start_ranks: no CUDA device is a clean refusal
        if missing := missing_extras(self.recipe.logging):  # optional packages the recipe asks for
            raise TrainingError(missing)
        meta = self.read_inputs()
        if meta is not None:
            self.state = TrainState.from_meta(meta)
        self.model = self.build_model(torch.device("meta"))  # sizes only: no memory, any machine
        self.stream = self.build_stream()
        if meta is not None and not (self.state.step >= self.cfg.steps or self.out_of_patience()):
            self.stream.load_state_dict(meta["data_stream"])  # as Checkpointer.restore: the same corpus and seed
        if self.state.step < self.cfg.steps and not self.out_of_patience() and (problem := summary.memory_refusal(self)):
            raise TrainingError(problem)
        plan = summary.dry_run_plan(self)
        holder = run_dir_holder(self.run_dir)
        busy = [f"note: the run dir is in use by {holder}: fit would be refused until it ends"] if holder else []
        return [*recipe_to_yaml(self.recipe).splitlines(), "", *summary.run_summary(self), *busy,
                f"dry run: {plan}; nothing was written"]

    def prepare_data(self) -> PreparedCorpus:
        """Tokenizer and token documents (it trains or loads the tokenizer, which fixes the vocabulary)."""
        r = self.recipe
        # every rank prepares it; the token cache's lock lets one rank tokenize and the others read its result
        return prepare_corpus(r.data, r.tokenizer, seed=self.cfg.seed, progress=r.logging.progress and self.ranks.is_main)

    def build_model(self, device: torch.device) -> LM:
        cfg = LMConfig.from_recipe(
            self.recipe.model, self.recipe.attention, vocab_size=self.recipe.model.vocab_size or self.corpus.vocab_size
        )
        if cfg.vocab_size < self.corpus.vocab_size:
            raise TrainingError(
                f"the tokenizer has {self.corpus.vocab_size} tokens but model.vocab_size is {cfg.vocab_size}: "
                "token ids would index past the embedding. Use the model's own tokenizer, or a larger model.vocab_size"
            )
        if device.type == "meta":  # sizes only (dry run): no memory, no init
            with torch.device("meta"):
                model = LM(cfg)
        else:
            model = LM(cfg).to(device)
        if self.cfg.lora is not None:  # adapters before init_from and resume: their tensors are in both
            self.lora_line = add_lora(model, self.cfg.lora)
        return model

    def parallelize(self) -> torch.nn.Module:
        """The model as the ranks train it: FSDP2 (train.parallel fsdp), or the LM itself (ddp replicas, one rank)."""
        return distributed.wrap_model(self.model, self.cfg.parallel, self.device, self.ranks, compute_dtype=self.compute_dtype)

    def build_optimizer(self) -> torch.optim.Optimizer:
        # FSDP: over the shards, after parallelize(); fused on CUDA (one kernel, no host sync)
        return build_optimizer(self.model, self.cfg, fused=self.device.type == "cuda")

    def build_stream(self) -> DocumentStream:
        cfg, ranks = self.cfg, self.ranks
        return DocumentStream(
            self.corpus.train, batch_rows=cfg.batch_docs, chunk_size=cfg.chunk_size, seed=cfg.seed,
            rank=ranks.rank, world_size=ranks.world_size,
        )

    def device_type(self) -> str:
        """cuda or cpu: this rank's device, or (a dry run starts none) the one train.device would pick."""
        if hasattr(self, "device"):
            return self.device.type
        return "cuda" if self.cfg.device == "cuda" or (self.cfg.device == "auto" and torch.cuda.is_available()) else "cpu"

    @property
    def precision(self) -> str:
        """train.precision, with auto resolved: bf16 on CUDA, fp32 on the CPU."""
        if self.cfg.precision != "auto":
            return self.cfg.precision
        return "bf16" if self.device_type() == "cuda" else "fp32"

    @property
    def compiles(self) -> bool:
        """train.compile, with unset resolved: on CUDA, not on the CPU (Inductor's CPU code takes long to build)."""
        return self.cfg.compile if self.cfg.compile is not None else self.device_type() == "cuda"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations and the KV cache take (weights and optimizer state stay float32)."""
        return COMPUTE_DTYPES[self.precision]

    def autocast(self):
        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # ------------------------------------------------------------------ the run starts: writes

    def start_run(self) -> None:
        """Set aside what a fresh start replaces, write the run's files, open metrics and display (rank 0)."""
        if not self.ranks.is_main:  # the others print only their warnings, and write nothing
            self.display, self.metrics = distributed.OtherRankDisplay(self.ranks), distributed.NoMetrics()
            return
        # what the run would otherwise overwrite or mix with (--resume never, --fork: the metrics too)
        moved = self.checkpoints.set_aside_previous(
            self.resume, resumed_step=self.state.step if self.resume_from is not None else None,
            forked_from=self.resume_from if self.fork else None,
            run_files=[self.run_dir / METRICS_FILE, self.run_dir / TENSORBOARD_DIR]
            + ([] if self.fork else [self.run_dir / WANDB_ID_FILE]),
        )
        log = self.recipe.logging
        wandb = wandb_settings(self.run_dir, project=log.wandb_project, name=self.recipe.name or self.run_dir.name,
                               config=self.recipe.model_dump(mode="json")) if log.wandb else None
        # metrics first: a resume drops its steps after the checkpoint (what a later attempt does alike), so a
        # write that fails (a full disk) leaves every file as it was; each write is atomic
        self.metrics = MetricsLogger(self.run_dir, start_step=self.state.step, tensorboard=log.tensorboard, wandb=wandb)
        try:
            write_atomically(self.run_dir / RECIPE_FILE, recipe_to_yaml(self.recipe), why="the resolved recipe")
            write_atomically(self.run_dir / TOKENIZER_FILE, self.corpus.tokenizer.to_str(pretty=True), why="the tokenizer")
        except BaseException:
            self.metrics.close()
            raise
        self.display = ProgressDisplay(
            self.cfg.steps, start_tokens=self.state.tokens, every=self.recipe.logging.every,
            live=self.recipe.logging.progress, console=self.console,
        )
        for line in summary.run_summary(self) + self.init_notes + moved:
            self.display.message(line)

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict:
        """One optimizer step over `grad_accum` chunks; returns its metrics record.

        One process reads nothing back from the device here (the op aside): the record's loss and
        gradient norm stay tensors until `read_back`, which runs when this step ends a log interval or
        precedes validation or a checkpoint.
        """
        t0 = time.perf_counter()
        cfg = self.cfg
        step = self.state.step + 1
        lr = lr_at(step, cfg)
        set_lr(self.optimizer, lr, step=step, cfg=cfg)
        apply_freeze(self.model, cfg.freeze, step)  # train.freeze: which parameters learn at this step
        self.train_model.train()
        loss_sum, step_tokens = torch.zeros((), device=self.device), 0
        distill_sum = None  # train.score_distill: the chunks' distillation losses, on the device
        for i in range(cfg.grad_accum):
            host = self.stream.next_chunk()
            step_tokens += host.global_tokens  # every rank's rows: the stream knows them all
            weight = send(torch.tensor(1.0 / max(host.global_targets, 1)), self.device)

            def train_pass(chunk: Chunk, cache, first_of_step=i == 0) -> ChunkResult:
                inputs = ChunkInputs(tokens=chunk.tokens, lengths=chunk.lengths, targets=chunk.targets, weight=weight)
                return self.run_chunk(inputs, cache, first_of_step=first_of_step)

            # FSDP: gradients are reduce-scattered once per step, in the backward of its last chunk
            with distributed.gradient_sync(self.train_model, i == cfg.grad_accum - 1):
                _, result = self.reader.read(host, train_pass)  # rows reset, the pass, the cache carried on
            self.selection.add(result.stats)  # this rank's rows
            loss_sum += result.loss_sum * weight  # this rank's share of the chunk's mean loss, on the device
            if result.score_distill is not None:
                distill_sum = result.score_distill.clone() if distill_sum is None else distill_sum + result.score_distill
            if result.overflow is not None:
                self.overflow = result.overflow.clone() if self.overflow is None else self.overflow | result.overflow
        if distributed.is_replicated(self.train_model, self.ranks):  # ddp: one all-reduce, after the last chunk
            distributed.average_gradients(self.trainable(), self.ranks.world_size)
        loss = self.agree(loss_sum) / cfg.grad_accum
        grad_norm = self.optimizer_step()
        self.state.step, self.state.tokens = step, self.state.tokens + step_tokens
        seconds = time.perf_counter() - t0  # without a sync: the time to queue the step (exact over a log interval)
        self.train_seconds += seconds
        record = {
            "step": step, "loss": loss, "tokens": self.state.tokens, "lr": lr, "grad_norm": grad_norm,
            "memory_bytes": peak_memory_bytes(self.device),  # rank 0's
            "doc_positions": [offset for _, offset in self.stream.rows],  # every rank's rows
            "step_s": round(seconds, 4),
        }
        if distill_sum is not None:  # rank 0's rows
            record["score_distill"] = distill_sum / cfg.grad_accum
        self.pending.append(record)
        if self.read_back_due():
            self.read_back()
        signal_for_tests_at(step, self.ranks.rank)
        return record

    def chunk_pass(self, inputs: ChunkInputs, cache) -> ChunkResult:
        """Forward, loss and backward of one chunk from `cache` (gradients stop at the detached cache):
        what a CUDA graph captures and replays (longtrain.train.step_graph)."""
        with self.autocast():
            out = self.train_model(inputs.tokens, cache=cache, lengths=inputs.lengths, targets=inputs.targets,
                                   check_overflow=False)
        # Gradients are averaged over the ranks: times the world size, the average is the sum of
        # the ranks' shares, the gradient of the global mean (one rank: the mean itself)
        scale = self.ranks.world_size / self.cfg.grad_accum
        loss = out.loss_sum * inputs.weight * scale
        if out.score_distill is not None:  # a mean per rank: averaged over the ranks as it is
            loss = loss + self.cfg.score_distill * out.score_distill / self.cfg.grad_accum
        self.scaler.scale(loss).backward()
        return ChunkResult(loss_sum=out.loss_sum.detach(), cache=out.cache, overflow=out.overflow,
                           stats=self.selection.chunk_stats(cache, out),
                           score_distill=None if out.score_distill is None else out.score_distill.detach())

    def run_chunk(self, inputs: ChunkInputs, cache, *, first_of_step: bool) -> ChunkResult:
        """One chunk's pass, replayed from the CUDA graph where the run allows one (captured at the first
        chunk of the session's second step: the first compiles the kernels), else eagerly."""
        # graphs_off: graph_unusable()'s reason, or a failed capture's
        if (self.chunk_graph is None and first_of_step and self.graphs_off is None and self.state.step > self.start.step
                and capturable(cache)):
            try:
                self.chunk_graph = ChunkGraph(self.chunk_pass, inputs, cache, self.trainable())
            except RuntimeError as e:  # an op that cannot be captured: the run goes on eagerly
                self.graphs_off = f"its capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                self.warn(f"training without CUDA graphs: {self.graphs_off}")
        if self.chunk_graph is not None and self.chunk_graph.fits(inputs, cache):
            return self.chunk_graph(inputs, cache)
        # eagerly (also a chunk of another shape after a capture: its backward adds into the same gradients)
        return self.chunk_pass(inputs, cache)

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.train_model.parameters() if p.requires_grad]

    def graph_unusable(self) -> str | None:
        """Why this run replays no CUDA graph of its chunks (None: it does, where train.cuda_graphs allows)."""
        return graph_unusable(self.recipe, device_type=self.device_type(), precision=self.precision)

    def optimizer_step(self) -> torch.Tensor:
        """Unscale (fp16), clip, step and clear the gradients; returns the norm before clipping, on the device.

        fp16: a step whose gradients hold inf or NaN is skipped (by the fused optimizer on the device) and
        the loss scale backs off.
        """
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norms(self.train_model, self.cfg.grad_clip, scorer_apart=self.cfg.clip_scorer_apart)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.cfg.scorer_unit_norm:
            normalize_scorers(self.train_model)
        # a CUDA graph writes into the gradients it was captured with: zero them in place
        self.optimizer.zero_grad(set_to_none=self.chunk_graph is None)
        return grad_norm

    def read_back_due(self) -> bool:
        """This step prints a log line, validates or saves a checkpoint: its numbers are needed now."""
        step = self.state.step
        return step % self.recipe.logging.every == 0 or self.validation_due() or self.save_due()

    def read_back(self) -> None:
        """The pending steps' losses and gradient norms from the device, in one host sync.

        A NaN or infinite loss stops the run here, before any validation or checkpoint of a later
        step: the steps before it are written to metrics.jsonl, the checkpoint on disk is the last good one.
        """
        unread, overflowed = read_numbers(self.pending, ("loss", "grad_norm", "score_distill"), self.overflow)
        if overflowed:
            self.warn_overflow()
        self.overflow = None
        if unread:
            self.pending[-1]["cache_fill"] = self.reader.cache.fill()  # for the display's log line
        step = self.state.step
        if self.pending and (step % self.recipe.logging.every == 0 or step == self.cfg.steps) and (selection := self.selection.read()):
            self.pending[-1]["selection"] = selection  # per layer (this rank's rows); one host read per log line
        for i, r in enumerate(self.pending):
            if not math.isfinite(r["loss"]):
                self.write_records(self.pending[:i])  # they have been through log_step
                del self.pending[:]
                raise TrainingError(summary.nan_loss_message(r["loss"], r["step"], self.last_saved))
        self.last_loss = self.pending[-1]["loss"] if self.pending else self.last_loss

    def agree(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The step's summed loss over every rank (on the device), and whether any rank was asked to stop.

        One all-reduce of [loss, stop votes] per step. The votes reach the host one step later
        (`distributed.LateVotes`: a copy that waits on that collective alone), so no rank waits for its
        GPU to drain, and every rank reads the same votes at the same step: they stop together.
        """
        if not self.ranks.parallel:
            return loss_sum
        vote = send(torch.tensor(float(self.stop.requested)), self.device)
        votes = distributed.all_reduce_sum(torch.stack([loss_sum.float(), vote]))
        if self.votes.push(votes[1]) and self.stop_agreed is None:  # the previous step's votes
            self.stop_agreed = next(s for s in distributed.all_gather_objects(self.stop.signum) if s is not None)
        return votes[0]

    @property
    def stopping(self) -> bool:
        """A signal asked the run to stop (with several ranks: any rank's, as of the last step)."""
        return self.stop_agreed is not None if self.ranks.parallel else self.stop.requested

    def warn(self, text: str) -> None:
        """A warning line, with the rank in front when there are several."""
        if self.ranks.is_main:
            self.display.message(distributed.rank_message(self.ranks, f"warning: {text}"))
        else:  # stderr: only rank 0 has a display
            distributed.print_for_rank(self.ranks, f"warning: {text}")

    def warn_overflow(self) -> None:
        if not self._warned_overflow:
            self._warned_overflow = True
            # the model's Python warning too (training reads the flag here, not in every forward)
            warn_threshold_overflow(stacklevel=2)
            self.warn(summary.overflow_warning(self.state.step))

    def validation_due(self) -> bool:
        return self.cfg.validates_at(self.state.step) and len(self.corpus.valid) > 0

    def validate(self) -> dict:
        """A validation pass; returns its part of the step's record."""
        t0 = time.perf_counter()
        loss = evaluate(  # sharded over the ranks, in the training's precision
            self.model, self.corpus, self.cfg, self.device, self.ranks, autocast=self.autocast, cache_dtype=self.compute_dtype,
        )
        self.final_valid_loss = loss
        if self.state.record_validation(loss, self.cfg.early_stopping):  # a new best: saved at this step with
            self.best_unsaved = self.recipe.checkpoint.keep_best  # checkpoint.keep_best, whatever checkpoint.every says
        ppl = math.exp(min(loss, 700))
        self.display.message(f"step {self.state.step}: validation loss {loss:.4f} (ppl {ppl:.2f})")
        return {"valid_loss": loss, "valid_ppl": ppl, "valid_s": round(time.perf_counter() - t0, 4)}

    def log_step(self, record: dict, *, elapsed: float) -> None:
        """metrics.jsonl (and TensorBoard), then the console: every pending step once this one has been read back."""
        record["elapsed_s"] = round(elapsed, 4)  # since this session's loop started (exact at read-back steps)
        if not any(isinstance(record[k], torch.Tensor) for k in ("loss", "grad_norm")):
            self.write_records(self.pending)
            del self.pending[:]

    def write_records(self, records: list[dict]) -> None:
        rows = self.stream.progress()["rows"]
        for record in records:
            stats = StepStats(
                step=record["step"], loss=record["loss"], lr=record["lr"], grad_norm=record["grad_norm"],
                tokens=record["tokens"], seconds=record["step_s"], rows=[RowProgress(r["doc"], r["offset"], r["len"]) for r in rows],
                cache_fill=record.pop("cache_fill", None), memory_bytes=record["memory_bytes"], selection=record.get("selection"),
            )
            self.display.update(stats)
            record["tokens_per_s"] = round(self.display.tokens_per_s(), 1)  # over the display's recent window
            self.metrics.log(record)

    def save_due(self) -> bool:
        step = self.state.step
        return (step % self.checkpoints.every == 0 or step == self.cfg.steps or self.stopping or self.best_unsaved
                or self.out_of_patience() is not None)

    def out_of_patience(self, state: TrainState | None = None) -> str | None:
        """Why train.early_stopping ends the run at `state` (this run's by default), or None while it goes on."""
        state, stop = state or self.state, self.cfg.early_stopping
        if stop is None or state.stale_validations < stop.patience:
            return None
        return summary.out_of_patience_message(state, stop)

    def save(self) -> None:
        """A checkpoint; with several ranks every rank writes its part and rank 0 commits it."""
        self.read_back()  # a NaN since the last read stops here, unsaved (a no-op when already read)
        self.write_records(self.pending)
        del self.pending[:]
        self.best_unsaved = False
        self.last_saved = self.checkpointer.save(self.state.step)
        self.display.message(f"saved checkpoint {self.last_saved}")
        kill_for_tests_after(self.state.step, self.ranks.rank)

    def result(self, *, seconds: float) -> FitResult:
        return FitResult(
            run_dir=self.run_dir, start_step=self.start.step, steps=self.state.step, tokens=self.state.tokens,
            session_tokens=self.state.tokens - self.start.tokens, seconds=seconds, train_seconds=self.train_seconds,
            last_loss=self.last_loss, final_valid_loss=self.final_valid_loss,
            best_valid_loss=self.state.best_valid_loss, checkpoint=self.last_saved,
            out_of_patience=self.out_of_patience(),
            best_checkpoint=self.checkpoints.best(self.state) if self.recipe.checkpoint.keep_best else None,
            stopped_by=self.stop_agreed if self.ranks.parallel else self.stop.signum,
            forked_from=self.resume_from if self.fork else None,
        )
