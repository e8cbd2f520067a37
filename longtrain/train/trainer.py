"""`longtrain fit`: chunk-recurrent training (the paper's Algorithm 3), resumable exactly.

The loop reads top-down and delegates: data (longtrain.data), the model and its per-row cache
(longtrain.model), checkpoints, optimizer, RNG and metrics (longtrain.train.*).

Per optimizer step, `grad_accum` chunks: each row of the batch reads its document chunk by chunk;
a row that starts a new document has its cache reset; the forward continues from the cache, the
loss backpropagates into this chunk only (the cache is detached), and the new cache carries on.
Everything that decides the next step (weights, optimizer, caches, data position, RNG) is in the
checkpoint, so a resumed run continues bitwise where it stopped.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from longtrain.data import IGNORE, DocumentStream, PreparedCorpus, iter_valid_chunks, prepare_corpus
from longtrain.model import LM, LMConfig, ModelCache
from longtrain.train import checkpoint as ckpt
from longtrain.train.checkpointer import checkpoint_files
from longtrain.train.init import apply_freeze, init_from_checkpoint
from longtrain.train.metrics import MetricsLogger, ProgressDisplay, RowProgress, StepStats, peak_memory_bytes
from longtrain.train.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from longtrain.train.recipe import Recipe, recipe_hash, recipe_to_yaml
from longtrain.train.rng import capture_rng, restore_rng, seed_everything


class TrainingError(Exception):
    """A run that cannot go on (NaN loss, a checkpoint that does not fit); the message says why."""


@dataclass
class FitResult:
    run_dir: Path
    steps: int  # last completed step
    tokens: int
    seconds: float
    last_loss: float
    final_valid_loss: float | None
    best_valid_loss: float | None
    checkpoint: Path | None
    interrupted: bool = False


@dataclass
class TrainState:
    """What changes every step, besides the model and optimizer."""

    step: int = 0
    tokens: int = 0
    best_valid_loss: float | None = None


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is cuda but no CUDA device is visible; use `--set train.device=cpu`")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def fit(recipe: Recipe, *, run_dir: Path | None = None, resume: str = "auto", console=None) -> FitResult:
    run_dir = Path(run_dir) if run_dir else recipe.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = recipe.train
    device = pick_device(cfg.device)
    seed_everything(cfg.seed)
    manager = ckpt.CheckpointManager(run_dir, recipe.checkpoint.keep, directory=recipe.checkpoint.dir)
    resume_from = _checkpoint_to_resume(manager, resume)

    # Data first: it trains or loads the tokenizer, which fixes the vocabulary.
    corpus = prepare_corpus(recipe.data, recipe.tokenizer, run_dir=run_dir, seed=cfg.seed, progress=recipe.logging.progress)
    (run_dir / "recipe.yaml").write_text(recipe_to_yaml(recipe))

    model_cfg = LMConfig.from_recipe(recipe.model, recipe.attention, vocab_size=recipe.model.vocab_size or corpus.vocab_size)
    if model_cfg.vocab_size < corpus.vocab_size:
        raise TrainingError(
            f"the tokenizer has {corpus.vocab_size} tokens but model.vocab_size is {model_cfg.vocab_size}: "
            "token ids would index past the embedding. Use the model's own tokenizer, or a larger model.vocab_size"
        )
    model = LM(model_cfg).to(device)
    init_notes = init_from_checkpoint(model, cfg.init_from, recipe) if cfg.init_from and resume_from is None else []
    optimizer = build_optimizer(model, cfg)
    stream = DocumentStream(corpus.train, batch_rows=cfg.batch_docs, chunk_size=cfg.chunk_size, seed=cfg.seed)
    cache = model.empty_cache(cfg.batch_docs, device=device, dtype=torch.float32)
    hashes = _hashes(recipe, run_dir)
    state = TrainState()

    aside = None
    if resume_from is not None:
        cache = _restore(resume_from, model, optimizer, stream, state, hashes, device)
    elif manager.steps() and resume == "never":
        shutil.rmtree(manager.dir)  # asked to start over: old checkpoints would mix with new ones
    elif manager.steps():  # none of them is complete: keep them for inspection, start clean
        aside = manager.dir.with_name(f"{manager.dir.name}.unusable-{time.strftime('%Y%m%d-%H%M%S')}")
        manager.dir.rename(aside)

    display = ProgressDisplay(
        cfg.steps, start_step=state.step, start_tokens=state.tokens, every=recipe.logging.every,
        live=recipe.logging.progress, console=console,
    )
    _print_summary(display, recipe, model, corpus, run_dir, resume_from, state)
    for note in init_notes:
        display.message(note)
    if aside is not None:
        display.message(f"warning: no complete checkpoint to resume from; moved the unusable ones to {aside}")

    stop = _StopSignal()
    t_start = time.monotonic()
    last_loss, valid_loss, saved = float("nan"), None, resume_from
    warned_overflow = False
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with stop, display, MetricsLogger(run_dir, start_step=state.step) as metrics:
        while state.step < cfg.steps and not stop.requested:
            step = state.step + 1
            lr = lr_at(step, cfg)
            set_lr(optimizer, lr, step=step, cfg=cfg)
            apply_freeze(model, cfg.freeze, step)
            model.train()
            loss_sum, step_tokens = torch.zeros((), device=device), 0
            for _ in range(cfg.grad_accum):
                chunk = stream.next_chunk()
                step_tokens += int(chunk.lengths.sum())  # counted on the CPU, before the copy
                chunk = chunk.to(device)
                cache = cache.reset_rows(chunk.reset)  # a new document starts with an empty cache
                with autocast:
                    out = model(chunk.tokens, cache=cache, lengths=chunk.lengths)
                loss = lm_loss(out.logits, chunk.targets)
                (loss / cfg.grad_accum).backward()  # gradients stop at the (detached) cache
                cache = out.cache
                loss_sum += loss.detach()  # summed on the device: one host sync per step, below
                if out.overflowed and not warned_overflow:
                    warned_overflow = True
                    display.message(
                        "warning: a layer's SparseK threshold state hit its cap (attention.threshold_cap); "
                        "thresholds are approximate from here. Raise attention.threshold_cap to keep them exact."
                    )
            last_loss = loss_sum.item() / cfg.grad_accum
            if not math.isfinite(last_loss):
                where = f"; the last good checkpoint is {saved}" if saved else ""
                raise TrainingError(
                    f"loss is {last_loss} at step {step}: stopping without saving{where}. "
                    "Lower train.lr or raise train.warmup_steps, then resume."
                )
            grad_norm = clip_grad_norm(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step, state.tokens = step, state.tokens + step_tokens

            rows = stream.progress()["rows"]
            memory = peak_memory_bytes(device)
            record = {
                "step": step, "loss": last_loss, "tokens": state.tokens, "lr": lr, "grad_norm": grad_norm,
                "memory_bytes": memory, "doc_positions": [r["offset"] for r in rows],
                "elapsed_s": round(time.monotonic() - t_start, 4),  # since this process started the loop
            }
            if cfg.valid_every and (step % cfg.valid_every == 0 or step == cfg.steps) and len(corpus.valid):
                valid_loss = evaluate(model, corpus, cfg, device)
                if state.best_valid_loss is None or valid_loss < state.best_valid_loss:
                    state.best_valid_loss = valid_loss
                record |= {"valid_loss": valid_loss, "valid_ppl": math.exp(min(valid_loss, 700))}
                display.message(f"step {step}: validation loss {valid_loss:.4f} (ppl {math.exp(min(valid_loss, 700)):.2f})")
            metrics.log(record)
            display.update(StepStats(
                step=step, loss=last_loss, lr=lr, grad_norm=grad_norm, tokens=state.tokens,
                rows=[RowProgress(r["doc"], r["offset"], r["len"]) for r in rows],
                cache_fill=cache.fill(), memory_bytes=memory,
            ))

            if step % recipe.checkpoint.every == 0 or step == cfg.steps or stop.requested:
                saved = _save(manager, model, optimizer, cache, stream, state, hashes, corpus, recipe)
                display.message(f"saved checkpoint {saved}")
                _test_only_kill_after(step)

    return FitResult(
        run_dir=run_dir, steps=state.step, tokens=state.tokens, seconds=time.monotonic() - t_start,
        last_loss=last_loss, final_valid_loss=valid_loss, best_valid_loss=state.best_valid_loss,
        checkpoint=saved, interrupted=stop.requested,
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions that have a target."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def evaluate(model: LM, corpus: PreparedCorpus, cfg, device: torch.device) -> float:
    """Validation loss over held-out documents, read chunk-recurrently like training."""
    model.eval()
    rows = min(cfg.batch_docs, len(corpus.valid))
    cache = model.empty_cache(rows, device=device, dtype=torch.float32)
    total, count = 0.0, 0
    chunks = iter_valid_chunks(
        corpus.valid, cfg.chunk_size, batch_rows=rows, max_docs=cfg.valid_docs, max_tokens=cfg.valid_tokens
    )
    for chunk in chunks:
        chunk = chunk.to(device)
        cache = cache.reset_rows(chunk.reset)
        out = model(chunk.tokens, cache=cache, lengths=chunk.lengths)
        cache = out.cache
        n = int((chunk.targets != IGNORE).sum())
        if n:
            total += float(lm_loss(out.logits, chunk.targets)) * n
            count += n
    model.train()
    return total / max(count, 1)


# ------------------------------------------------------------------ checkpoints


def _hashes(recipe: Recipe, run_dir: Path) -> dict[str, str]:
    """What a checkpoint must match to be resumed: model shape, attention, tokenizer."""
    return {
        "model": recipe_hash(recipe, ("model",)),
        "attention": recipe_hash(recipe, ("attention",)),
        "tokenizer": hashlib.sha256((run_dir / "tokenizer.json").read_bytes()).hexdigest(),
    }


def _checkpoint_to_resume(manager: ckpt.CheckpointManager, resume: str) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return manager.latest_complete()
    path = Path(resume)
    problem = ckpt.validate(path) if path.is_dir() else f"no checkpoint directory at {path}"
    if problem:
        raise TrainingError(f"--resume {resume}: {problem}")
    return path


def _save(manager, model, optimizer, cache: ModelCache, stream, state: TrainState, hashes, corpus, recipe) -> Path:
    opt_tensors, opt_info = ckpt.optimizer_to_checkpoint(optimizer.state_dict())
    meta = {
        "step": state.step,
        "tokens": state.tokens,
        "best_valid_loss": state.best_valid_loss,
        "data_stream": stream.state_dict(),
        "corpus": corpus.fingerprint,
        "rng": capture_rng(),
        "optimizer": opt_info,
        "hashes": hashes,
    }
    tensors = {"model": model.state_dict(), "optimizer": opt_tensors, "cache": cache.state_dict()}
    files = checkpoint_files(recipe, corpus.tokenizer)  # self-contained
    return manager.save(state.step, tensors=tensors, meta=meta, files=files)


def _restore(path: Path, model, optimizer, stream, state: TrainState, hashes, device) -> ModelCache:
    tensors, meta = ckpt.load(path)
    ckpt.check_compatible(meta, hashes, path=path)
    ckpt.check_shapes(tensors["model"], model.state_dict())
    model.load_state_dict(tensors["model"])
    optimizer.load_state_dict(ckpt.optimizer_from_checkpoint(tensors["optimizer"], meta["optimizer"]))
    stream.load_state_dict(meta["data_stream"])
    restore_rng(meta["rng"])
    state.step, state.tokens, state.best_valid_loss = meta["step"], meta["tokens"], meta.get("best_valid_loss")
    return ModelCache.from_state_dict({k: v.to(device) for k, v in tensors["cache"].items()})


def _test_only_kill_after(step: int) -> None:
    """Tests simulate a crash: SIGKILL right after checkpoint `LONGTRAIN_TEST_KILL_AFTER` is saved."""
    if os.environ.get("LONGTRAIN_TEST_KILL_AFTER") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


class _StopSignal:
    """SIGINT/SIGTERM ask the loop to finish its step, save a checkpoint and return."""

    requested = False

    def __enter__(self):
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _print_summary(display, recipe: Recipe, model: LM, corpus: PreparedCorpus, run_dir, resume_from, state) -> None:
    cfg, att = recipe.train, recipe.attention
    lines = [
        f"longtrain fit {recipe.name} → {run_dir}",
        f"model: {recipe.model.style}, {recipe.model.layers} layers × {recipe.model.d_model}, "
        f"{model.num_params() / 1e6:.2f}M parameters, vocab {model.cfg.vocab_size}",
        f"attention: {att.type} (k={att.topk}, w={att.window}, {att.variant}); KV cache "
        + (f"{att.topk + max(att.window - 1, 0)} entries per layer per row" if att.type != "full" else "grows with the document"),
        f"batch: {cfg.batch_docs} documents × {cfg.chunk_size} tokens × {cfg.grad_accum} chunks = "
        f"{cfg.batch_docs * cfg.chunk_size * cfg.grad_accum:,} tokens per step, {cfg.steps} steps",
        f"data: {len(corpus.train)} training documents ({corpus.train.n_tokens:,} tokens), "
        f"{len(corpus.valid)} validation documents",
    ]
    if resume_from is not None:
        lines.append(f"resuming from {resume_from} (step {state.step}, {state.tokens:,} tokens)")
    for line in lines:
        display.message(line)
