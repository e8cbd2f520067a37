"""What `fit` says about a run: the summary before it starts, memory estimates and advice, the
out-of-memory message, and the dry run's plan.

Text only: each function reads a `Trainer` (its recipe, model, ranks, data and resume point) and
returns lines; the trainer decides when to print them.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from longtrain.console import plural as _n
from longtrain.errors import TrainingError
from longtrain.device import machine, machine_words, same_numerics
from longtrain.data.cache import disk_size
from longtrain.model.attention_types import kv_entries, linear
from longtrain.train import memory
from longtrain.train.metrics import gib
from longtrain.train.run_dir import set_aside

if TYPE_CHECKING:
    from longtrain.train.trainer import Trainer


def skipped_files(stats: dict) -> list[str]:
    """data.on_bad_file skip: the files left out, by split (at most ten named per split)."""
    out = []
    for split, s in stats.items():
        skipped = s.get("skipped") or []
        if skipped:
            named = "; ".join(f"{f} {why}" for f, why in skipped[:10]) + (f"; and {len(skipped) - 10} more" if len(skipped) > 10 else "")
            out.append(f"warning: {_n(len(skipped), 'file')} of the {split} data skipped (data.on_bad_file: skip): {named}")
    return out


@dataclass
class FitResult:
    run_dir: Path
    start_step: int  # the step this session started from (0, or the checkpoint's)
    steps: int  # last completed step
    tokens: int  # trained on since step 0
    session_tokens: int  # trained on in this session
    seconds: float  # wall clock of this session's training loop
    train_seconds: float  # of which training steps: validation and checkpoint saves left out
    last_loss: float | None  # None when this session ran no step
    final_valid_loss: float | None
    best_valid_loss: float | None
    checkpoint: Path | None
    stopped_by: int | None = None  # the signal that stopped the run early (SIGINT, SIGTERM)
    out_of_patience: str | None = None  # train.early_stopping stopped the run: why, in words
    best_checkpoint: Path | None = None  # checkpoint.keep_best: the checkpoint of the best validation loss
    forked_from: Path | None = None  # --fork: the checkpoint (often another run's) this run started from

    @property
    def session_steps(self) -> int:
        return self.steps - self.start_step

    @property
    def exit_code(self) -> int:
        """0 for a run that finished, 128 + signal for one a signal stopped (130 SIGINT, 143 SIGTERM)."""
        return 128 + self.stopped_by if self.stopped_by is not None else 0


def linear_settings(att) -> str:
    """', linear part mean, learned gain, phi after RoPE' for the linear types (the settings that decide what their
    linear part weighs), '' for the others."""
    if not linear(att.type):
        return ""
    phi = "phi after RoPE" if att.linear_rope == "rotated" else "phi without RoPE"
    return f", linear part {att.linear_norm}, {att.linear_gain} gain, {phi}"


def run_summary(t: Trainer) -> list[str]:
    """What is about to run: model, attention and KV budget, batch, data, resume point, notes."""
    r, cfg, att, model = t.recipe, t.cfg, t.recipe.attention, t.model
    kv = kv_entries(att.type, att.topk, att.window)
    lines = [
        f"longtrain fit {r.name} → {t.run_dir}",
        f"model: {r.model.style}, {r.model.layers} layers × {r.model.d_model}, "
        f"{model.num_params() / 1e6:.2f}M parameters, vocab {model.cfg.vocab_size}",
        *([t.lora_line] if t.lora_line else []),
        f"attention: {att.type}"
        + (" (every earlier key)" if att.type == "full" else
           f" (k={att.topk}, w={att.window}, {att.variant}{linear_settings(att)})") + f"{attention_origin(t)}; "
        "KV cache "
        + (f"{kv} entries per layer per row" if kv is not None else "grows with the document"),
        f"batch: {_n(cfg.batch_docs * t.ranks.world_size, 'document')} × {cfg.chunk_size} tokens × "
        f"{_n(cfg.grad_accum, 'chunk')} = {cfg.batch_docs * t.ranks.world_size * cfg.chunk_size * cfg.grad_accum:,} "
        f"tokens per step, {_n(cfg.steps, 'step')}",
        f"data: {_n(len(t.corpus.train), 'training document')} ({t.corpus.train.n_tokens:,} tokens), "
        f"{_n(len(t.corpus.valid), 'validation document')}",
    ]
    lines += skipped_files(t.corpus.stats)
    if r.data.source == "recall":  # the task, its distances and its chance level
        from longtrain.data.recall import describe

        lines.append(describe(r.data.recall))
    if t.ranks.parallel or t.cfg.parallel == "fsdp":
        lines.append(ranks_line(t))
    lines.append(
        f"compute: {t.precision}" + (" autocast" if t.precision != "fp32" else "")
        + f", KV cache in {t.precision}" + (", loss scaling" if t.precision == "fp16" else "")
        + (", compiled around the attention op" if t.compiles else "")
        + (", activation checkpointing (each block recomputed in the backward)" if cfg.activation_checkpointing else "")
        + graph_note(t)
        + (", deterministic" if cfg.deterministic else "")
        + (", the scoring vectors' gradient clipped apart" if cfg.clip_scorer_apart else "")
        + (", the scoring vectors kept at length 1" if cfg.scorer_unit_norm else "")
    )
    if cfg.score_distill > 0:
        lines.append(f"score distillation: weight {cfg.score_distill} over {cfg.score_distill_queries} sampled "
                     "queries per chunk and row (the scores learn where dense attention goes)")
    lines.append(f"machine: {machine_words(this_machine(t))}")
    lines += memory_lines(t) + disk_lines(t)
    if t.resume_from is not None:
        how = "forking (a new run) from" if t.fork else "resuming from"
        loaded = f", loaded in {t.restore_seconds:.1f} s" if t.restore_seconds is not None else ""
        lines.append(f"{how} {t.resume_from} (step {t.state.step}, {t.state.tokens:,} tokens{loaded})")
    return lines + notes(t)


def this_machine(t: Trainer) -> dict:
    """The `machine` record of this run's device (the one train.device would pick, in a dry run)."""
    return machine(memory_device(t), t.ranks.world_size)


def machine_change(t: Trainer) -> str | None:
    """A note when the resumed checkpoint was saved on another machine or software (what decides the rounding)."""
    if t.resume_from is None or not t.saved_on or same_numerics(t.saved_on, this_machine(t)):
        return None
    why = ("train.deterministic repeats a run bit for bit on one kind of device and software only, so this run "
           "now differs from one that stayed there" if t.cfg.deterministic else "the rounding differs from there on")
    return f"note: the checkpoint was saved on {machine_words(t.saved_on)}: {why}"


def attention_origin(t: Trainer) -> str:
    """Fine-tuning: whether k and w are train.init_from's or the recipe's."""
    att = t.recipe.attention
    used = [k for k in ("topk", "window") if getattr(att, k)]
    if not t.cfg.init_from or not used:
        return ""
    name = {"topk": "k", "window": "w"}
    taken = [name[k] for k in used if k in t.recipe._from_init_source]
    own = [name[k] for k in used if k not in t.recipe._from_init_source]
    parts = ([f"{', '.join(own)} from the recipe"] if own else []) + ([f"{', '.join(taken)} from train.init_from"] if taken else [])
    return "; " + ", ".join(parts)


def memory_device(t: Trainer) -> torch.device:
    return t.device if hasattr(t, "device") else torch.device(t.device_type())


def estimate_memory(t: Trainer, position: int) -> int:
    """Estimated peak memory of a step with the rows at `position` (longtrain.train.memory)."""
    return memory.estimate_training_bytes(
        t.recipe, n_params=t.model.num_params(), vocab_size=t.model.cfg.vocab_size,
        position=position, compute_dtype=t.compute_dtype,
        n_trainable=sum(p.numel() for p in t.model.parameters() if p.requires_grad), device_type=t.device_type(),
    )


def memory_need(t: Trainer, position: int) -> tuple[int, str]:
    """(bytes the run needs at `position`, in words): on the CPU what the process already holds (Python,
    torch, the data) plus the training estimate, as the progress line's `mem` counts; on CUDA the estimate."""
    if memory_device(t).type == "cuda":
        need = estimate_memory(t, position)
        return need, gib(need)
    # first: the estimate's own probes page in some of the same libraries
    held = (getattr(t, "held_bytes", 0) or memory.process_bytes()) + memory.runtime_bytes()
    need = estimate_memory(t, position)
    return held + need, (f"{gib(held + need)} ({gib(need)} for training on top of the {gib(held)} this process holds "
                         "with the libraries a step runs)")


def memory_lines(t: Trainer) -> list[str]:
    """The estimated peak memory at the furthest position the run reaches, and the machine's memory."""
    att = t.recipe.attention
    position = memory.longest_position(t.corpus, t.cfg)
    _, need = memory_need(t, position)
    dev = memory_device(t)
    have = memory.device_memory_bytes(dev)
    where = f"{gib(have)} of {dev}" if dev.type == "cuda" else f"{gib(have)} of RAM"
    per = " per rank" if t.ranks.parallel else ""
    if att.type == "full":
        grows = f"full attention: it grows with the position, up to the longest document ({position:,} tokens)"
        if att.max_context:
            grows = f"full attention capped at attention.max_context = {att.max_context:,} keys"
        return [f"memory: about {need}{per} at document position {position:,} ({grows}); {where}"]
    return [f"memory: about {need}{per} at any document position (the KV cache has a fixed size); {where}"]


def memory_refusal(t: Trainer) -> str | None:
    """Why the run cannot fit its device's memory (checked before anything is written), or None."""
    position = memory.longest_position(t.corpus, t.cfg)
    need, words = memory_need(t, position)
    dev = memory_device(t)
    have = memory.device_memory_bytes(dev)
    if need <= have:
        return None
    return (f"this run needs about {words} at document position {position:,} but {dev} has {gib(have)}: it would run "
            f"out of memory. To fit: {fit_advice(t, have)}. (If you know it fits, {memory.DEVICE_MEMORY_ENV}=SIZE "
            "states the memory to plan for.)")


def checkpoint_bytes(t: Trainer) -> int:
    """About one checkpoint's size: the newest one's, else float32 weights, AdamW's two moments, the caches."""
    if existing := t.checkpoints.existing():
        return disk_size(existing[-1])
    cache = t.model.empty_cache(t.cfg.batch_docs, device="meta", dtype=t.compute_dtype)
    caches = sum(v.numel() * v.element_size() for v in cache.state_dict().values()) * t.ranks.world_size
    return 12 * t.model.num_params() + caches + len(t.corpus.tokenizer.to_str())


def disk_lines(t: Trainer) -> list[str]:
    """How much disk the checkpoints need at once (checkpoint.keep, plus one while saving with keep = 1), and
    a warning when the checkpoint folder's file system has less free."""
    ck = t.recipe.checkpoint
    size = checkpoint_bytes(t)
    at_once = max(ck.keep, 2) + (1 if ck.keep_best else 0)  # keep ≥ 2: the oldest goes before a save
    folder = next(p for p in (t.checkpoints.dir, *t.checkpoints.dir.parents) if p.exists())
    free = shutil.disk_usage(folder).free
    have = free + sum(disk_size(p) for p in t.checkpoints.existing())  # the run's own checkpoints make room too
    how = "the old one is deleted after the new one is complete" if ck.keep == 1 else "the oldest is deleted before a save"
    line = (f"disk: a checkpoint is about {gib(size) if size >= 10 * 2**20 else f'{size / 2**20:.2f} MiB'}; "
            f"checkpoint.keep = {ck.keep} needs room for {at_once} "
            f"({gib(at_once * size)}; {how}); {gib(free)} free for {t.checkpoints.dir}")
    if at_once * size <= have:
        return [line]
    return [line, f"warning: the checkpoints need about {gib(at_once * size)} but {t.checkpoints.dir} has {gib(free)} free: a save "
            f"will fail. Free some space, lower checkpoint.keep (now {ck.keep}) or set checkpoint.dir on another disk"]


def fit_advice(t: Trainer, have: int) -> str:
    """What to change so the run fits in `have` bytes; full attention: the largest max_context that does."""
    fits = None
    if t.recipe.attention.type == "full":
        fits = memory.max_context_that_fits(
            t.recipe, budget=int(0.9 * have), n_params=t.model.num_params(),
            vocab_size=t.model.cfg.vocab_size, compute_dtype=t.compute_dtype, device_type=t.device_type(),
        )
    att, kind = t.recipe.attention, t.device_type()
    naive = kind != "cpu" and memory.linear_core_is_naive(
        att.backend, t.model.cfg.d_model // t.model.cfg.heads, t.compute_dtype, kind)
    return memory.advice(t.recipe, suggest_max_context=fits, naive_linear_core=naive)


def ranks_line(t: Trainer) -> str:
    """How the batch is spread over the ranks, and how rows take documents."""
    w, b = t.ranks.world_size, t.cfg.batch_docs
    kind = t.device_type()
    backend = f"{'nccl' if kind == 'cuda' else 'gloo'} on {kind}"
    how = "each rank holds a shard of the parameters, gradients and optimizer state (FSDP2)" if t.cfg.parallel == "fsdp" \
        else "each rank holds the whole model, gradients averaged once per step (DDP)"
    return (
        f"ranks: {_n(w, 'rank')} ({t.cfg.parallel}, {backend}): {how}; rank r reads global "
        f"rows r·{b} .. r·{b}+{b - 1} of {w * b}. A row that finishes a document takes the next of one shuffled "
        f"order shared by all rows, so the {_n(len(t.corpus.train), 'training document')} need not divide among "
        f"the ranks, and {w} × {b} rows read what 1 × {w * b} would"
    )


def notes(t: Trainer) -> list[str]:
    """Settings the run adjusted, or that deserve a second look."""
    cfg, out = t.cfg, list(t.rank_notes)
    if cfg.warmup() != cfg.warmup_steps:
        instead = f"the first {_n(cfg.warmup(), 'step')} (a tenth of the run)" if cfg.warmup() else "no warmup"
        out.append(f"note: train.warmup_steps ({cfg.warmup_steps}) exceeds train.steps ({cfg.steps}): {instead} instead")
    if cfg.valid_every and cfg.steps < cfg.valid_every and len(t.corpus.valid):
        out.append(f"note: no validation: the run is shorter than train.valid_every ({cfg.valid_every}); "
                   f"--set train.valid_every={cfg.steps} validates at its end")
    if changed := machine_change(t):
        out.append(changed)
    if warning := t.stream.too_few_documents():
        out.append(f"warning: {warning}")
    if aside := set_aside(t.run_dir, t.checkpoints.dir):
        size = gib(sum(disk_size(p) for p in aside))
        names = ", ".join(p.name for p in aside[:3]) + (", ..." if len(aside) > 3 else "")
        out.append(f"note: {_n(len(aside), 'item')} moved aside ({size}: {names}); "
                   f"`longtrain clean {t.run_dir}` lists them, with --delete deletes them")
    return out


def graph_note(t: Trainer) -> str:
    """The summary's words on CUDA graphs (nothing on the CPU)."""
    why = t.graph_unusable()
    if why is None and t.recipe.attention.type == "full":  # a growing cache: only chunks from an empty one replay
        return ", one CUDA graph for chunks that start every row's document (from the second step; later chunks eager)"
    if why is None:
        return ", one CUDA graph per chunk (from the second step)"
    return "" if why == "not on CUDA" else f", no CUDA graph: {why}"


@contextmanager
def out_of_memory_help(t: Trainer):
    """An out-of-memory error inside becomes a TrainingError that says what to change, not a traceback."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError (CUDA), or the CPU allocator's RuntimeError
        text = str(e)
        if not (isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()):
            raise
        raise TrainingError(out_of_memory_message(t, text)) from None


def out_of_memory_message(t: Trainer, error: str) -> str:
    step = t.state.step + 1
    positions = [offset for _, offset in t.stream.rows] if hasattr(t, "stream") else []
    where = f" (document positions {', '.join(f'{p:,}' for p in positions)})" if positions else ""
    dev = memory_device(t)
    have = memory.device_memory_bytes(dev)
    first = error.strip().splitlines()[0][:300] if error.strip() else "out of memory"
    resume = (f"The last checkpoint is {t.last_saved}: rerun the same command with the change to resume from it."
              if t.last_saved else "No checkpoint was saved yet; rerun with the change.")
    return (f"out of memory at step {step}{where} on {dev} ({gib(have)}): {first}\n"
            f"To fit: {fit_advice(t, have)}.\n{resume}")


def dry_run_plan(t: Trainer) -> str:
    """What `fit --dry-run` says the run would do."""
    cfg = t.cfg
    if t.state.step >= cfg.steps:
        plan = f"already finished at step {t.state.step}: fit would do nothing"
    elif why := t.out_of_patience():
        plan = f"already stopped early at step {t.state.step} ({why}): fit would do nothing"
    elif t.resume_from is not None and t.fork:
        plan = (f"would start a new run from the state of {t.resume_from} (--fork), moving this run's checkpoints "
                f"and metrics aside, and train steps {t.state.step + 1}–{cfg.steps}")
    elif t.resume_from is not None:
        plan = f"would resume from {t.resume_from} and train steps {t.state.step + 1}–{cfg.steps}"
    elif old := t.checkpoints.existing():
        how = "moving them aside" if t.resume == "never" else "moving the unusable ones aside"
        plan = f"would start over, {how}: {_n(len(old), 'checkpoint')} in {t.checkpoints.dir}"
    else:
        plan = f"would start a fresh run of {_n(cfg.steps, 'step')}"
    if cfg.init_from and t.resume_from is None and t.state.step < cfg.steps:
        plan += f", starting from the weights of {cfg.init_from}"
    return plan

def nan_loss_message(loss: float, step: int, last_saved: Path | None) -> str:
    """Why the run stops at a NaN or infinite loss, and what to change."""
    where = f"; the last good checkpoint is {last_saved}" if last_saved else ""
    return (f"loss is {loss} at step {step}: stopping without saving{where}. "
            "Lower train.lr or raise train.warmup_steps, then resume.")


def overflow_warning(step: int) -> str:
    """The trainer's warning when a threshold state overflowed (read at log lines)."""
    return (f"a layer's SparseK threshold state hit its cap (attention.threshold_cap) by step {step} "
            "(it is read at log lines, so it may have happened up to logging.every steps earlier); "
            "thresholds are approximate from there. Raise attention.threshold_cap to keep them exact.")


def out_of_patience_message(state, stop) -> str:
    """Why train.early_stopping (`stop`) ends the run at TrainState `state`."""
    at = f" (at step {state.best_step})" if state.best_step is not None else ""
    passes = f"{stop.patience} validation pass{'es' if stop.patience != 1 else ''}"
    return (f"validation loss has not improved by more than {stop.min_delta:g} for {passes}; "
            f"the best was {state.best_valid_loss:.4f}{at}")
