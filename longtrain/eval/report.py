"""What `longtrain eval` shows and writes: one table (a column per checkpoint), `--json`, `--plot`.

JSON: {"results": [{"checkpoint", "step", "attention", "kv_budget", "<task>": result, ...}]}: each
checkpoint's entry holds every number its tasks returned, under the task's name ("ppl",
"passkey", ...). kv_budget is k + w (null for full attention).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from longtrain.eval.tasks import Task, TaskResult


@dataclass
class CheckpointReport:
    label: str  # the column's heading
    path: str
    step: int
    attention: str  # e.g. "sparsek+sw (k=64, w=64)"
    kv_budget: int | None
    results: dict[str, TaskResult] = field(default_factory=dict)  # by task name

    def to_json(self) -> dict:
        entry = {"checkpoint": self.path, "step": self.step, "attention": self.attention, "kv_budget": self.kv_budget}
        entry.update({name: r.json for name, r in self.results.items()})
        return entry


def render(console, reports: list[CheckpointReport], tasks: list[Task]) -> None:
    """One rich table: a section per task, a row per label, a column per checkpoint."""
    from rich.table import Table

    table = Table(title="longtrain eval", title_justify="left")
    table.add_column("", style="bold")
    for r in reports:
        table.add_column(f"{r.label}\n{r.attention}", justify="right")
    for task in tasks:
        labels: list[str] = []
        for r in reports:  # rows in order of first appearance: checkpoints may differ (e.g. bucket counts)
            labels += [label for label, _ in r.results[task.name].rows if label not in labels]
        table.add_row(f"[underline]{task.title}[/]", *[""] * len(reports))
        for label in labels:
            cells = [dict(r.results[task.name].rows).get(label, "—") for r in reports]
            table.add_row(label, *cells)
        table.add_section()
    console.print(table)
    notes = []  # every checkpoint's (a legend can depend on its attention), each once
    for task in tasks:
        for r in reports:
            notes += [n for n in r.results[task.name].notes if n not in notes]
    for note in notes:
        console.print(note, style="dim")


def write_json(path: Path, reports: list[CheckpointReport]) -> None:
    path.write_text(json.dumps({"results": [r.to_json() for r in reports]}, indent=1))


def write_plot(path: Path, reports: list[CheckpointReport], tasks: list[Task]) -> list[str]:
    """A PNG with each plotting task's panel(s), one row per task; returns the tasks drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    drawn = [t for t in tasks if t.plot is not None]
    if not drawn:
        return []
    fig = plt.figure(figsize=(max(7, 4.5 * len(reports)), 4.2 * len(drawn)), layout="constrained")
    grid = fig.add_gridspec(len(drawn), 1)
    for i, task in enumerate(drawn):
        task.plot(fig, grid[i, 0], [(r.label, r.results[task.name].json) for r in reports])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [t.name for t in drawn]
