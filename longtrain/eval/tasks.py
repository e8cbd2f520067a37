"""The tasks `longtrain eval` runs: a registry the CLI dispatches on.

A task is a function `run(ctx) -> TaskResult`: `ctx` holds the loaded checkpoint (`ctx.ckpt`, a
`longtrain.train.checkpoint.LoadedCheckpoint`: model in eval mode, recipe, tokenizer), the
command's options (`ctx.opts`), a progress reporter and the evaluation documents (`ctx.documents()`,
read on first use). It returns a JSON-able result (stored under the task's name in `--json`) and
rows for the table (label, cell: one column per checkpoint). Optionally a task checks the options
before any model is loaded, and draws its part of `--plot`. It names the options only some tasks read
(TASK_OPTIONS) in `reads`: one set that no chosen task reads is refused rather than ignored.

Adding a task is a few lines in its own module:

    from longtrain.eval.tasks import Task, TaskResult, register

    def run(ctx) -> TaskResult:
        ...
        return TaskResult(json={...}, rows=[("recall @ 4k", "0.75")])

    register(Task("recall", "associative recall", run, in_all=False, reads=("docs", "tokens")))

and one import line in `longtrain/eval/runner.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longtrain.errors import EvalError, EvalUsageError  # noqa: F401  (raised here; defined with the others)
from longtrain.eval.documents import eval_documents


@dataclass
class EvalOptions:
    """What `longtrain eval` was asked; tasks read the fields they need."""

    data: str | None = None  # PATH|GLOB of documents (None: the run's validation documents)
    docs: int = 8  # documents at most
    tokens: int | None = None  # tokens per document at most (None: whole documents)
    chunk_size: int | None = None  # None: the recipe's train.chunk_size
    max_len: int = 8192  # passkey: longest context
    trials: int = 4  # passkey: random keys per (length, depth)
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)  # options of tasks added later


# The options only some tasks read, with the value that means "not set" (EvalOptions' fields, else in opts.extra).
# The chunk size, seed, device and dtype are every task's.
TASK_OPTIONS: dict[str, Any] = {"data": None, "docs": 8, "tokens": None, "max_len": 8192, "trials": 4,
                                "recall_scale": 1, "recall_max_distance": None, "limit": None}


def check_options_are_read(opts: EvalOptions, tasks: list[Task], registry: dict[str, Task]) -> None:
    """EvalUsageError for an option set to other than its default that none of `tasks` reads: it would be ignored
    silently (e.g. --tokens with --task passkey, whose lengths come from --max-len)."""
    for name, unset in TASK_OPTIONS.items():
        value = getattr(opts, name) if hasattr(opts, name) else opts.extra.get(name, unset)
        if value == unset or any(name in t.reads for t in tasks):
            continue
        chosen = ", ".join(t.name for t in tasks)
        readers = [t.name for t in registry.values() if name in t.reads]
        raise EvalUsageError(f"{{arg}} {value} has no effect with --task {chosen}: only {' and '.join(readers)} "
                             f"read{'s' if len(readers) == 1 else ''} it; drop it, or run --task {readers[0]}", arg=name)


@dataclass
class TaskResult:
    json: Any  # stored under the task's name in each checkpoint's entry of --json
    rows: list[tuple[str, str]]  # (label, cell) rows of the terminal table, one column per checkpoint
    notes: list[str] = field(default_factory=list)  # lines printed under the table


@dataclass
class Task:
    name: str  # the --task value and the JSON key
    title: str  # the table section's heading
    run: Callable[[EvalContext], TaskResult]
    in_all: bool = True  # part of --task all
    plot: Callable[..., None] | None = None  # (fig, subplot spec, [(label, json)]): its panel(s) of --plot
    check: Callable[..., None] | None = None  # (recipe, opts): raises EvalUsageError before any model loads
    check_prompts: Callable[..., None] | None = None  # (tokenizer, opts): the same, for what needs the tokenizer
    argument: str | None = None  # what --task NAME:ARGUMENT takes (None: no argument), in opts.extra["task_argument"]
    order: int = 100  # place in the table and in --task's choices (then by name)
    reads: tuple[str, ...] = ()  # the TASK_OPTIONS it reads (a set one that no chosen task reads is refused)


@dataclass
class EvalContext:
    """What a task gets: one checkpoint, the options, progress, and the documents (read once, on demand)."""

    ckpt: Any  # LoadedCheckpoint
    opts: EvalOptions
    progress: "Progress"
    _documents: Any = None

    def documents(self):
        """The evaluation documents (`--data`, or the run's validation split) in this checkpoint's tokenizer."""
        if self._documents is None:
            bar = self.progress.bar
            if bar is not None:
                bar.stop()  # tokenizing (on a cache miss) shows a bar of its own
            try:
                self._documents = eval_documents(self.ckpt.recipe, self.ckpt.tokenizer, self.opts.data, progress=bar is not None)
            finally:
                if bar is not None:
                    bar.start()
        return self._documents


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    TASKS[task.name] = task
    return task


def registered_tasks() -> dict[str, Task]:
    """The registry, in table order (`longtrain.eval.runner` imports the task modules, which register)."""
    return dict(sorted(TASKS.items(), key=lambda item: (item[1].order, item[0])))


class Progress:
    """Where a long task reports progress: a rich bar on a terminal, nothing otherwise (tests)."""

    def __init__(self, bar=None):
        self.bar = bar
        self._task = None

    def start(self, description: str, total: int) -> None:
        if self.bar is not None:
            if self._task is not None:
                self.bar.remove_task(self._task)
            self._task = self.bar.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None and self._task is not None:
            self.bar.advance(self._task, n)


def checkpoint_label(path: Path) -> str:
    """A short name for a column: run/step-XXXXXXXX."""
    return f"{path.parent.parent.name}/{path.name}" if path.parent.name == "checkpoints" else path.name
