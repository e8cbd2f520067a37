"""What a run reports: `metrics.jsonl` on disk and the console display.

`MetricsLogger` appends one JSON object per step to RUN_DIR/metrics.jsonl (and, with
`logging.tensorboard`, the same scalars as TensorBoard events in RUN_DIR/tensorboard).
`ProgressDisplay` shows the run live (rich) on a terminal, or prints plain
lines every `logging.every` steps when the output is a file or a pipe.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from longtrain.console import make_console
from longtrain.train.diagnostics import selection_table, summary_line
from longtrain.train.run_dir import write_atomically

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# Record keys drawn as TensorBoard scalars (lists and counters stay in metrics.jsonl only).
TENSORBOARD_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "memory_bytes", "valid_loss", "valid_ppl")
RATE_WINDOW_S = 30.0  # tokens/s and the ETA are measured over the last this-many seconds of training


WANDB_ID_FILE = "wandb-id"  # logging.wandb: the W&B run this run dir logs to (a resume continues it)


def wandb_missing() -> str | None:
    """None when logging.wandb can log, else what to install."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return "logging.wandb needs the wandb package: pip install 'longtrain[wandb]'"
    return None


def wandb_settings(run_dir: str | Path, *, project: str, name: str, config: dict) -> dict:
    """wandb.init's arguments for this run dir: its W&B run id (made once, kept in RUN_DIR/wandb-id),
    files under RUN_DIR/wandb, no console capture (longtrain prints its own lines)."""
    import secrets

    id_file = Path(run_dir) / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:
        run_id = secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
    return {"project": project, "name": name, "id": run_id, "resume": "allow", "dir": str(run_dir), "config": config}


def tensorboard_missing() -> str | None:
    """None when TensorBoard event files can be written, else what to install."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        return "logging.tensorboard needs the tensorboard package: pip install 'longtrain[tensorboard]'"
    return None


def missing_extras(logging) -> str | None:
    """What the recipe's `logging:` section asks for that is not installed (wandb, tensorboard), in words."""
    return (logging.wandb and wandb_missing()) or (logging.tensorboard and tensorboard_missing()) or None


class MetricsLogger:
    """Appends step records to metrics.jsonl, consistent with the checkpoint resumed from.

    Opening it with `start_step=N` keeps only the records of steps ≤ N (and
    drops a line torn by a kill), so after a resume the file holds each step
    once, exactly as a run straight through would have written it; TensorBoard
    events after step N are purged the same way.
    """

    def __init__(self, run_dir: str | Path, *, start_step: int = 0, tensorboard: bool = False, wandb: dict | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), purge_step=start_step + 1)
        self._wandb = None
        if wandb is not None:  # wandb_settings(...): a W&B run beside metrics.jsonl
            import wandb as wandb_lib

            self._wandb = wandb_lib.init(**wandb, settings=wandb_lib.Settings(console="off", silent=True))

    def log(self, record: dict[str, Any]) -> None:
        if "step" not in record:
            raise ValueError("a metrics record needs a `step`")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a killed run keeps every step it finished
        if self._tb is not None:
            for key in TENSORBOARD_SCALARS:
                if isinstance(record.get(key), (int, float)):
                    self._tb.add_scalar(key, record[key], global_step=record["step"])
            for layer in record.get("selection") or []:  # selection/<statistic>/layer<i>
                for key, value in layer.items():
                    if key != "layer" and isinstance(value, (int, float)):
                        self._tb.add_scalar(f"selection/{key}/layer{layer['layer']}", value, global_step=record["step"])
            self._tb.flush()
        if self._wandb is not None:  # the same scalars as TensorBoard's, under the same names
            scalars = {key: record[key] for key in TENSORBOARD_SCALARS if isinstance(record.get(key), (int, float))}
            for layer in record.get("selection") or []:
                scalars |= {f"selection/{key}/layer{layer['layer']}": value for key, value in layer.items()
                            if key != "layer" and isinstance(value, (int, float))}
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _truncate_after(self, step: int) -> None:
        kept = [r for r in read_metrics(self.path) if r["step"] <= step] if self.path.exists() else []
        why = f"to keep its steps up to {step}, where the run resumes" if step else "to start the run's metrics"
        write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept), why=why)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; lines that do not parse (a torn last line) are skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """The process's peak so far: CUDA memory allocated by tensors on a GPU, resident memory on the CPU (the OS's
    high-water mark: never below what the process held at any moment, unlike its current size)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # Linux: VmHWM, this program's own peak. Not ru_maxrss, which execve keeps from the process it replaced: a fit
    # started by a large process (pytest, a notebook, a launcher) would report its parent's size.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


# ------------------------------------------------------------------ display


@dataclass
class RowProgress:
    """Where one batch row is: which document (counted from 0) and how far into it."""

    doc: int
    position: int  # tokens of the document already processed
    length: int | None = None  # tokens in the document, when known

    def describe(self) -> str:
        if self.length:
            return f"doc {self.doc} · {100 * self.position / self.length:.0f}%"
        return f"doc {self.doc} · {self.position:,} tok"


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int  # tokens trained on since step 0, cumulative
    seconds: float = 0.0  # time this step trained (validation and checkpoint saves left out)
    rows: Sequence[RowProgress] = field(default_factory=list)
    cache_fill: float | None = None  # used fraction of the per-layer KV cache, 0..1
    memory_bytes: int | None = None
    selection: list[dict] | None = None  # per-layer pool statistics (train/diagnostics.py), on log steps


class ProgressDisplay:
    """Live rich display on a terminal; plain lines every `every` steps otherwise.

    Use as a context manager around the loop and call `update` after each
    optimizer step. Tokens/s and the ETA come from the steps of the last
    RATE_WINDOW_S seconds of training, each step timed on its own (`StepStats.seconds`),
    so a slow start, a validation pass or a checkpoint save does not skew them.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        start_tokens: int = 0,
        every: int = 10,
        live: bool = True,
        console: Console | None = None,
    ):
        self.console = console or make_console()
        self.total = total_steps
        self.every = every
        self.live_enabled = live and self.console.is_terminal
        self._last_tokens = start_tokens
        self._window: deque[tuple[float, int]] = deque()  # (seconds, tokens) of recent steps
        self._live: Live | None = None
        self._selection: list[dict] | None = None  # the latest per-layer selection statistics

    def __enter__(self) -> ProgressDisplay:
        if self.live_enabled:
            self._live = Live(Text("starting…"), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def message(self, text: str) -> None:
        """A line that stays (validation results, checkpoints saved, warnings)."""
        self.console.print(text, soft_wrap=True, markup=False)

    def update(self, s: StepStats) -> None:
        self._window.append((s.seconds, s.tokens - self._last_tokens))
        self._last_tokens = s.tokens
        while len(self._window) > 1 and sum(t for t, _ in self._window) - self._window[0][0] >= RATE_WINDOW_S:
            self._window.popleft()
        self._selection = s.selection or self._selection
        if self._live is not None:
            self._live.update(self._render(s), refresh=True)
        if self.logs(s.step):
            self.console.print(self.line(s), soft_wrap=True, markup=False)
            if s.selection:
                self.console.print("  " + summary_line(s.selection), soft_wrap=True, markup=False)

    def logs(self, step: int) -> bool:
        """Whether step `step` prints a log line (every `logging.every` steps, and the last)."""
        return step % self.every == 0 or step == self.total

    def line(self, s: StepStats) -> str:
        """The plain one-line summary of a step."""
        parts = [
            f"step {s.step}/{self.total}",
            f"loss {s.loss:.4f}",
            f"ppl {_ppl(s.loss):.2f}",
            f"lr {s.lr:.2e}",
            f"gnorm {s.grad_norm:.3f}",
            f"{_si(self.tokens_per_s())} tok/s",
        ]
        if s.cache_fill is not None:
            parts.append(f"cache {100 * s.cache_fill:.0f}%")
        if s.memory_bytes is not None:
            parts.append(f"mem {gib(s.memory_bytes)}")
        parts.append(f"eta {_duration(self._eta(s))}")
        return " | ".join(parts)

    def _render(self, s: StepStats) -> Group:
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            Text(f"step {s.step}/{self.total}", style="bold"),
            ProgressBar(total=self.total, completed=s.step, width=40),
            Text(f"eta {_duration(self._eta(s))}"),
        )
        stats = Table.grid(padding=(0, 2))
        # Text cells, never markup strings: a value can never be read as a style tag.
        stats.add_row(
            Text.assemble("loss ", (f"{s.loss:.4f}", "bold")),
            Text(f"ppl {_ppl(s.loss):.2f}"),
            Text(f"lr {s.lr:.2e}"),
            Text(f"gnorm {s.grad_norm:.3f}"),
            Text(f"{_si(self.tokens_per_s())} tok/s"),
            Text(f"cache {100 * s.cache_fill:.0f}%" if s.cache_fill is not None else ""),
            Text(f"mem {gib(s.memory_bytes)}" if s.memory_bytes is not None else ""),
        )
        rows = Text("  ".join(f"row {i}: {r.describe()}" for i, r in enumerate(s.rows)), style="dim")
        if not self._selection:
            return Group(bar, stats, rows)
        return Group(bar, stats, rows, selection_table(self._selection))

    def tokens_per_s(self) -> float:
        """Training throughput over the recent window."""
        seconds = sum(t for t, _ in self._window)
        return sum(n for _, n in self._window) / seconds if seconds > 0 else 0.0

    def _eta(self, s: StepStats) -> float:
        seconds = sum(t for t, _ in self._window)
        if not self._window or seconds <= 0:
            return float("inf")
        return (self.total - s.step) * seconds / len(self._window)


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def gib(n: float) -> str:
    """A size for people: GiB, or MiB below one GiB (the progress display, memory warnings)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def read_numbers(records: list[dict], keys: Sequence[str], flag: torch.Tensor | None) -> tuple[int, bool]:
    """Replace the device tensors under `keys` in `records` by their numbers, reading them and `flag`
    ([] bool on the device, or None) in one host sync; returns (how many were read, the flag's value)."""
    unread = [(r, key) for r in records for key in keys if isinstance(r.get(key), torch.Tensor)]
    flags = [flag] if flag is not None else []
    if not unread and not flags:
        return 0, False
    values = torch.stack([r[key].detach().float().reshape(()) for r, key in unread] + [f.float() for f in flags])
    numbers = values.tolist()
    for (r, key), value in zip(unread, numbers):
        r[key] = value
    return len(unread), bool(flags) and numbers[-1] > 0
