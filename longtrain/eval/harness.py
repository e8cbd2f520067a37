"""`longtrain eval --task lm-eval:TASKS`: lm-evaluation-harness tasks on a checkpoint (longtrain.eval.lm_eval_model).

TASKS: comma-separated lm-eval task or group names (`lm-eval ls tasks` lists them), or paths to
task YAML files (a local task: its folder is added to lm-eval's task search path). --limit caps the
examples per task, --seed seeds lm-eval's sampling of few-shot examples. The table shows each
task's metrics with their standard errors; --json holds lm-eval's results and sample counts.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from longtrain.eval.tasks import (
    EvalContext,
    EvalError,
    EvalOptions,
    EvalUsageError,
    Task,
    TaskResult,
    register,
)

INSTALL = "pip install 'longtrain[eval]'"
NETWORK_ERRORS = ("ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError",
                  "HFValidationError", "MaxRetryError", "NameResolutionError")


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise EvalError(f"lm-eval needs lm-evaluation-harness, which is not installed: {INSTALL}", arg="task") from None


def parse_tasks(argument: str | None) -> tuple[list[str], list[str]]:
    """(task names, folders of local task YAML files) of `--task lm-eval:TASKS`."""
    if not argument:
        raise EvalUsageError("{arg} lm-eval needs task names: {arg} lm-eval:TASK,TASK,... (e.g. lm-eval:lambada_openai)", arg="task")
    import yaml

    names, folders = [], []
    for entry in (e.strip() for e in argument.split(",")):
        path = Path(entry).expanduser()
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise EvalUsageError(f"lm-eval:{entry}: no such task file", arg="task")
            task = (yaml.safe_load(path.read_text()) or {}).get("task")
            if not isinstance(task, str):
                raise EvalUsageError(f"lm-eval:{entry}: the YAML names no `task:`; it is not an lm-eval task file", arg="task")
            names.append(task)
            folders.append(str(path.resolve().parent))
        elif entry:
            names.append(entry)
    return names, sorted(set(folders))


_MANAGERS: dict = {}


def task_manager(folders: list[str], local_only: bool):
    """lm-eval's TaskManager over its own tasks and `folders` (only `folders` when every task is a local file:
    indexing lm-eval's thousands of task files takes a while)."""
    from lm_eval.tasks import TaskManager

    key = (tuple(folders), local_only)
    if key not in _MANAGERS:
        _MANAGERS[key] = TaskManager(include_path=folders or None, include_defaults=not local_only)
    return _MANAGERS[key]


def resolve(argument: str | None):
    """(TaskManager, task names), the names checked against lm-eval's list."""
    names, folders = parse_tasks(argument)
    require_lm_eval()
    local_only = len(folders) > 0 and all(Path(e.strip()).suffix in (".yaml", ".yml") for e in argument.split(","))
    manager = task_manager(folders, local_only)
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        hints = {n: difflib.get_close_matches(n, known, n=3) for n in unknown}
        close = "; ".join(f"{n}: did you mean {', '.join(h)}?" for n, h in hints.items() if h)
        raise EvalUsageError(
            f"lm-eval: no lm-eval task named {', '.join(unknown)}" + (f" ({close})" if close else "")
            + "; `lm-eval ls tasks` lists them, or give a task YAML file's path", arg="task",
        )
    return manager, names


def is_network_error(e: BaseException) -> bool:
    while e is not None:
        if type(e).__name__ in NETWORK_ERRORS or "offline" in str(e).lower() or "couldn't reach" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def metric_rows(results: dict) -> list[tuple[str, str]]:
    """One row per task and metric: 'value ± stderr' (sample_len, the example count, is in --json's n-samples)."""
    rows = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)) or metric in ("alias", "sample_len"):
                continue
            err = metrics.get(f"{metric}_stderr,{filt}")
            cell = f"{value:.4f}" + (f" ± {err:.4f}" if isinstance(err, (int, float)) else "")
            rows.append((f"{task} {metric}" + (f" ({filt})" if filt not in ("", "none") else ""), cell))
    return rows


def run(ctx: EvalContext) -> TaskResult:
    import lm_eval

    from longtrain.eval.lm_eval_model import LongtrainLM

    opts = ctx.opts
    manager, names = resolve(opts.extra.get("task_argument"))
    model = LongtrainLM(loaded=ctx.ckpt, chunk_size=opts.chunk_size)
    try:
        out = lm_eval.simple_evaluate(
            model=model, tasks=names, task_manager=manager, limit=opts.extra.get("limit"), random_seed=opts.seed,
            numpy_random_seed=opts.seed, torch_random_seed=opts.seed, fewshot_random_seed=opts.seed,
            log_samples=False, bootstrap_iters=1000,
        )
    except Exception as e:
        if is_network_error(e):
            raise EvalError(
                f"lm-eval:{','.join(names)}: a task's dataset must be downloaded from the Hugging Face hub, "
                f"which cannot be reached ({type(e).__name__}: {e}). Connect to the network once (the datasets "
                "cache keeps it), or use a local task YAML file", arg="task",
            ) from None
        raise
    results = {t: {k: v for k, v in m.items() if isinstance(v, (int, float, str))} for t, m in out["results"].items()}
    return TaskResult(json={"tasks": names, "results": results, "n-samples": out.get("n-samples", {})},
                      rows=metric_rows(results), notes=["lm-eval: value ± standard error, per task and metric"])


def check(recipe, opts: EvalOptions) -> None:
    limit = opts.extra.get("limit")
    if limit is not None and limit < 1:
        raise EvalUsageError(f"must be at least 1; got {limit}", arg="limit")
    resolve(opts.extra.get("task_argument"))


register(Task("lm-eval", "lm-evaluation-harness", run, in_all=False, check=check, argument="TASK,TASK,...", order=5, reads=("limit",)))
