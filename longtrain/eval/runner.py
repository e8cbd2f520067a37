"""Everything behind `longtrain eval`: check the options, load each checkpoint in turn, run its tasks, report.

Every option and every checkpoint's recipe is checked before the first model is loaded, so a bad
flag fails in a second, not after the first checkpoint's evaluation.
"""

from __future__ import annotations

import gc
from contextlib import nullcontext
from pathlib import Path

import torch

from longtrain.device import DTYPES, pick_device, pick_dtype
from longtrain.eval import harness, passkey, perplexity, recall  # noqa: F401  (each registers its task)
from longtrain.eval.passkey import kv_budget
from longtrain.eval.report import CheckpointReport, render, write_json, write_plot
from longtrain.eval.ruler import task as ruler_task  # noqa: F401  (registers its task)
from longtrain.eval.tasks import (
    EvalContext, EvalOptions, EvalUsageError, Progress, check_options_are_read, checkpoint_label, registered_tasks,
)
from longtrain.model.attention_types import describe
from longtrain.path_args import checkpoint_arg
from longtrain.train.checkpoint import load_checkpoint, load_recipe_and_tokenizer, resolve_checkpoint


def check_output(path: Path | None, arg: str, suffix: str | None = None) -> None:
    """A file to write (the argument `arg`) must be in a folder that exists, and end in `suffix`."""
    if path is None:
        return
    if not path.parent.is_dir():
        raise EvalUsageError(f"{path}: folder {path.parent} does not exist", arg=arg)
    if suffix and path.suffix.lower() != suffix:
        raise EvalUsageError(f"{path}: the file name must end in {suffix}", arg=arg)


def run_eval(
    checkpoints: list[str],
    opts: EvalOptions,
    *,
    task: str = "all",
    json_path: Path | None = None,
    plot_path: Path | None = None,
    console,
    live_progress: bool = True,
) -> list[CheckpointReport]:

    registry = registered_tasks()
    name, colon, argument = task.partition(":")
    if task == "all":
        tasks = [t for t in registry.values() if t.in_all]
    elif name in registry:
        tasks = [registry[name]]
        if colon and registry[name].argument is None:
            raise EvalUsageError(f"{name} takes no argument; got {task!r}", arg="task")
        opts.extra["task_argument"] = argument or None
    else:
        choices = ["all", *(f"{n}[:{t.argument}]" if t.argument else n for n, t in registry.items())]
        raise EvalUsageError(f"must be one of {', '.join(choices)}; got {task!r}", arg="task")
    if not checkpoints:
        raise EvalUsageError("give at least one checkpoint folder or run dir")
    check_options_are_read(opts, tasks, registry)
    opts.device = pick_device(opts.device)
    opts.dtype = pick_dtype(opts.dtype, opts.device)
    check_output(json_path, "json_path")
    check_output(plot_path, "plot_path", ".png")

    # UsageError: no such path, or a file; CheckpointError: a folder without a (whole) checkpoint
    paths = [resolve_checkpoint(checkpoint_arg(c)) for c in checkpoints]
    for path in paths:
        recipe, tokenizer = load_recipe_and_tokenizer(path)
        for t in tasks:
            if t.check is not None:
                t.check(recipe, opts)
            if t.check_prompts is not None:
                t.check_prompts(tokenizer, opts)

    labels = [checkpoint_label(p) for p in paths]
    labels = [f"{lab} ({i + 1})" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]
    reports = []
    for path, label in zip(paths, labels):
        ckpt = load_checkpoint(path, device=opts.device, dtype=DTYPES[opts.dtype])
        cfg = ckpt.model.cfg
        console.print(
            f"{label}: step {ckpt.step}, {cfg.style} {cfg.layers} × {cfg.d_model}, {describe(cfg.attention, cfg.topk, cfg.window)}, "
            f"{ckpt.model.num_params() / 1e6:.2f}M parameters, {opts.dtype} on {opts.device}",
            highlight=False,
        )
        report = CheckpointReport(
            label=label, path=str(path), step=ckpt.step, attention=describe(cfg.attention, cfg.topk, cfg.window), kv_budget=kv_budget(cfg)
        )
        with _progress_bar(console, live_progress) as bar:
            ctx = EvalContext(ckpt=ckpt, opts=opts, progress=Progress(bar))
            for t in tasks:
                report.results[t.name] = t.run(ctx)
        reports.append(report)
        del ckpt, ctx
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()

    render(console, reports, tasks)
    if json_path is not None:
        write_json(json_path, reports)
        console.print(f"wrote {json_path}", highlight=False)
    if plot_path is not None:
        drawn = write_plot(plot_path, reports, tasks)
        console.print(f"wrote {plot_path}" if drawn else f"no plot: none of the tasks ({task}) draws one", highlight=False)
    return reports


def _progress_bar(console, live: bool):
    """A rich bar with tokens/s and time left, on a terminal; nothing otherwise."""
    if not (live and console.is_terminal):
        return nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class TokensPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:,.0f} tok/s" if task.speed else "")

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"), TokensPerSecond(),
        TimeRemainingColumn(), console=console, transient=True,
    )
