"""Loss curves of one or several runs from their metrics.jsonl, drawn with matplotlib.

Left: training loss per step (faint) and its trailing mean (solid). Right: validation loss at
each validation pass. The x axis is tokens trained by default, so runs with different batch
sizes line up; `x="step"` plots against optimizer steps.
"""

from __future__ import annotations

from pathlib import Path

from longtrain.errors import NoMetricsError, PlotError  # noqa: F401  (raised here; defined with the others)
from longtrain.path_args import input_folder
from longtrain.train.metrics import METRICS_FILE, read_metrics

X_LABELS = {"tokens": "tokens trained", "step": "optimizer step"}
RUN_DIRS = "run directories written by `longtrain fit` (e.g. runs/quickstart)"


def load_runs(run_dirs: list[Path]) -> dict[str, list[dict]]:
    """{label: records} per run dir; the label is the folder name, or the path where names repeat."""
    names = [Path(d).name for d in run_dirs]
    runs = {}
    for d, name in zip(run_dirs, names):
        input_folder(d, RUN_DIRS, error=PlotError)  # no such path, or a file: the argument cannot work (exit 2)
        path = Path(d) / METRICS_FILE
        if not path.is_file():  # a folder, with nothing to plot in it (exit 1)
            raise NoMetricsError(f"{d} has no {METRICS_FILE}: give {RUN_DIRS}")
        records = [r for r in read_metrics(path) if isinstance(r.get("loss"), (int, float))]
        if not records:
            raise NoMetricsError(f"{path} holds no step yet: let the run train a step first")
        runs[str(d) if names.count(name) > 1 else name] = records
    return runs


def trailing_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_runs(run_dirs: list[Path], out: Path, *, x: str = "tokens") -> Path:
    """Draw the runs' curves into `out` (its suffix picks the format: .png, .pdf, .svg)."""
    if x not in X_LABELS:
        raise PlotError(f"must be one of {', '.join(X_LABELS)}; got {x!r}", arg="x")
    out = Path(out)
    if out.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise PlotError(f"{out}: give a file ending in .png (or .pdf, .svg)", arg="out")
    if not out.parent.is_dir():
        raise PlotError(f"{out}: folder {out.parent} does not exist", arg="out")
    runs = load_runs(run_dirs)

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True, constrained_layout=True)
    any_valid = False
    for i, (label, records) in enumerate(runs.items()):
        color = f"C{i % 10}"
        xs, loss = [r[x] for r in records], [r["loss"] for r in records]
        window = max(1, len(loss) // 50)
        ax_train.plot(xs, loss, color=color, alpha=0.25, linewidth=0.8)
        ax_train.plot(xs, trailing_mean(loss, window), color=color, label=label, linewidth=1.6)
        valid = [(r[x], r["valid_loss"]) for r in records if isinstance(r.get("valid_loss"), (int, float))]
        if valid:
            any_valid = True
            ax_valid.plot(*zip(*valid), color=color, marker="o", label=label)
    ax_train.set(title="training loss (faint: per step; solid: trailing mean)", xlabel=X_LABELS[x], ylabel="loss")
    ax_valid.set(title="validation loss", xlabel=X_LABELS[x], ylabel="loss")
    if any_valid:
        ax_valid.legend()
    else:
        ax_valid.text(0.5, 0.5, "no validation passes in these runs\n(train.valid_every)", ha="center",
                      va="center", transform=ax_valid.transAxes)
    ax_train.legend()
    for ax in (ax_train, ax_valid):
        ax.grid(alpha=0.3)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
