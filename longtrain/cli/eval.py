"""`longtrain eval`: perplexity by position, passkey retrieval and long-range recall for one or more checkpoints."""

from __future__ import annotations

from pathlib import Path

import typer

from longtrain.cli.app import app


@app.command("eval")
def eval_(
    checkpoints: list[str] = typer.Argument(..., help="checkpoint folders or run dirs (a run dir: its newest complete checkpoint)",
        show_default=False),
    data: str = typer.Option(None, "--data", help="PATH|GLOB of documents (default: the run's validation documents)"),
    docs: int = typer.Option(8, "--docs", help="documents to read, at most"),
    tokens: int = typer.Option(None, "--tokens",
        help="tokens per document, at most (default: whole documents); recall: the length of its generated documents, "
             "with the training's density of facts (default: the training's length)"),
    chunk_size: int = typer.Option(None, "--chunk-size", help="tokens per chunk (default: the recipe's train.chunk_size)"),
    task: str = typer.Option("all", "--task",
        help="ppl | passkey | recall | ruler[:TASK,...] | lm-eval:TASK,... | all (all: ppl and passkey)"),
    max_len: int = typer.Option(8192, "--max-len",
        help="passkey, ruler: the longest context, in tokens (passkey 1k, 2k, ...; ruler 4k, 8k, ... up to it)"),
    trials: int = typer.Option(4, "--trials", help="passkey: random keys per length and depth; ruler: samples per task and length"),
    limit: int = typer.Option(None, "--limit", help="lm-eval: examples per task, at most (default: all)"),
    seed: int = typer.Option(0, "--seed", help="seed of the passkeys, of the RULER samples and of lm-eval's few-shot sampling"),
    recall_scale: int = typer.Option(1, "--recall-scale",
        help="recall: documents this many times the training length, with as many times the facts (or --tokens N)"),
    recall_max_distance: int = typer.Option(None, "--recall-max-distance",
        help="recall: the farthest fact-to-query distance (default: the training's, at most what a --tokens document holds)"),
    json_path: Path = typer.Option(None, "--json", help="write every number as JSON here"),
    plot_path: Path = typer.Option(None, "--plot", help="write a PNG: loss by position, passkey heatmaps"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    dtype: str = typer.Option(None, "--dtype", help="float32 | bfloat16 | float64 (default: float32 on cpu, bfloat16 on cuda)"),
) -> None:
    """Measure checkpoints: loss by position in the document (does the model use far context?), passkey retrieval,
    (--task recall) exact recall of planted facts by distance, (--task ruler) RULER's synthetic tasks,
    (--task lm-eval:TASKS) lm-evaluation-harness tasks."""
    from longtrain.console import make_console
    from longtrain.eval.runner import run_eval
    from longtrain.eval.tasks import EvalOptions

    opts = EvalOptions(data=data, docs=docs, tokens=tokens, chunk_size=chunk_size, max_len=max_len, trials=trials,
                       seed=seed, device=device, dtype=dtype,
                       extra={"recall_scale": recall_scale, "recall_max_distance": recall_max_distance, "limit": limit})
    run_eval(checkpoints, opts, task=task, json_path=json_path, plot_path=plot_path, console=make_console())
