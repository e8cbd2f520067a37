"""`longtrain eval --task ruler`: RULER's synthetic tasks at 4k, 8k, ... --max-len tokens, scored as RULER.

`--task ruler` runs all eleven tasks, `--task ruler:niah_single_1,vt` a few. Per task and length,
--trials samples (RULER's own runs use 500; the default here, 4, is a quick look); each prompt
ends with the task's answer prefix and the model continues it greedily for the task's token budget
(RULER's tokens_to_generate: 128 for niah, 30 vt, 120 cwe, 50 fwe) or until the end-of-document
token, ROWS prompts side by side. Scores are string_match_all in percent, so they read as RULER's
tables for a base model. The essay haystacks are text of the evaluation documents (--data, else the run's validation
split). The table prints each length next to the KV budget (k + w): past it, a sliding window
alone cannot see the needle.
"""

from __future__ import annotations

import torch

from longtrain.data.tokenizer import eod_id
from longtrain.eval.passkey import kv_budget, lengths_up_to
from longtrain.eval.ruler.prompts import (
    TASKS,
    PromptTooLong,
    book_sentences,
    check_room,
    make_sample,
    uses_book_text,
)
from longtrain.eval.ruler.scoring import match_all
from longtrain.eval.tasks import (
    EvalContext,
    EvalOptions,
    EvalUsageError,
    Task,
    TaskResult,
    register,
)
from longtrain.generate import generate_batch
from longtrain.model.chunks import resolve_chunk_size

FIRST_LENGTH = 4096  # RULER's shortest


def ruler_lengths(max_len: int) -> list[int]:
    """4096, 8192, ... up to max_len (and max_len itself; only it when it is below 4096)."""
    return lengths_up_to(max_len, first=FIRST_LENGTH)


def selected_tasks(argument: str | None) -> list[str]:
    """The tasks of `--task ruler[:a,b]`, in RULER's order."""
    if not argument:
        return list(TASKS)
    names = [n.strip() for n in argument.split(",") if n.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise EvalUsageError(f"ruler:{argument}: no RULER task {', '.join(unknown) or '(empty)'}; "
                             f"the tasks are {', '.join(TASKS)}", arg="task")
    return [n for n in TASKS if n in names]


ROWS = 8  # prompts decoded side by side


@torch.no_grad()
def continuations(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, chunk_size: int) -> list[str]:
    """Greedy continuations of the prompts (any lengths, ROWS at a time): `max_new_tokens` each, or up to the
    end-of-document token."""

    out = []
    for s in range(0, len(prompts), ROWS):
        gen = generate_batch(model, prompts[s : s + ROWS], max_new_tokens=max_new_tokens, eod_id=eod_id(tokenizer),
                             tokenizer=tokenizer, chunk_size=chunk_size)
        out += [row.text for row in gen.rows]
    return out


def haystack_text(ctx: EvalContext, tokens: int) -> list[str]:
    """Sentences of the evaluation documents, about `tokens` tokens of them (they repeat past that)."""
    docs = ctx.documents()
    texts, have = [], 0
    for i in range(len(docs)):
        take = docs.doc(i)[: tokens - have]
        texts.append(ctx.ckpt.tokenizer.decode(take.tolist()))
        have += len(take)
        if have >= tokens:
            break
    return book_sentences(texts)


def run(ctx: EvalContext) -> TaskResult:
    model, tok, opts = ctx.ckpt.model, ctx.ckpt.tokenizer, ctx.opts
    names = selected_tasks(opts.extra.get("task_argument"))
    lengths = ruler_lengths(opts.max_len)
    chunk = resolve_chunk_size(opts.chunk_size, ctx.ckpt.recipe.train.chunk_size, prefill=True)
    haystack = haystack_text(ctx, 2 * max(lengths)) if any(uses_book_text(n) for n in names) else None
    ctx.progress.start("ruler", len(names) * opts.trials * sum(lengths))
    cells = []
    for length in lengths:
        for name in names:
            made, guess = [], None
            for i in range(opts.trials):
                made.append(make_sample(name, tok, length, seed=opts.seed, index=i, haystack=haystack, guess=guess))
                guess = made[-1].haystack_units
            preds = continuations(model, tok, [s.ids for s in made], made[0].max_new_tokens, chunk)
            samples = [{"prompt_tokens": len(s.ids), "answers": s.answers, "prediction": p, "score": match_all(p, s.answers)}
                       for s, p in zip(made, preds)]
            ctx.progress.advance(length * len(made))
            score = 100 * sum(x["score"] for x in samples) / len(samples)
            cells.append({"task": name, "length": length, "score": score, "samples": samples})

    budget = kv_budget(model.cfg)
    rows = [("KV budget (k + w)", "all keys (full attention)" if budget is None else f"{budget:,} tokens")]
    for length in lengths:
        mean = sum(c["score"] for c in cells if c["length"] == length) / len(names)
        beyond = " ›k+w" if budget is not None and length > budget else ""
        rows.append((f"ruler average at {length:,} tokens", f"{mean:.1f}{beyond}"))
    for name in names:
        by_length = [f"{c['score']:.1f}" for c in cells if c["task"] == name]
        rows.append((name, " ".join(by_length)))
    short = " ".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths)
    legend = "" if budget is None else "; ›k+w: longer than the KV budget"  # full attention has none
    notes = [f"ruler: string_match_all in percent, {opts.trials} samples per task and length; per task at {short} tokens{legend}"]
    return TaskResult(json={"lengths": lengths, "tasks": names, "trials": opts.trials, "cells": cells}, rows=rows, notes=notes)


def check(recipe, opts: EvalOptions) -> None:
    selected_tasks(opts.extra.get("task_argument"))
    if opts.trials < 1:
        raise EvalUsageError(f"must be at least 1; got {opts.trials}", arg="trials")


def check_prompts(tokenizer, opts: EvalOptions) -> None:
    """--max-len too short for a task's template (and in-context example) and answer: refused before any model loads."""
    for name in selected_tasks(opts.extra.get("task_argument")):
        for length in ruler_lengths(opts.max_len):
            try:
                check_room(name, tokenizer, length)
            except PromptTooLong as e:
                raise EvalUsageError(
                    f"{{arg}} {opts.max_len:,}: the RULER task {name} needs at least {e.needed:,} tokens at "
                    f"{length:,} (its template and answer, in this tokenizer); raise {{arg}} or leave {name} "
                    "out (ruler:TASK,TASK,... as the task)", arg="max_len",
                ) from None


def plot(fig, spec, entries: list[tuple[str, dict]]) -> None:
    """Score heatmaps (task x length), one per checkpoint."""
    from matplotlib.gridspec import GridSpecFromSubplotSpec

    grid = GridSpecFromSubplotSpec(1, len(entries), subplot_spec=spec, wspace=0.5)
    for i, (label, res) in enumerate(entries):
        ax = fig.add_subplot(grid[0, i])
        lengths, names = res["lengths"], res["tasks"]
        score = {(c["task"], c["length"]): c["score"] for c in res["cells"]}
        grid_scores = [[score[(n, length)] for length in lengths] for n in names]
        im = ax.imshow(grid_scores, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        for y, row in enumerate(grid_scores):
            for x, v in enumerate(row):
                ax.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize="x-small", color="white" if v < 60 else "black")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths], fontsize="small")
        ax.set_yticks(range(len(names)), names, fontsize="x-small")
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"RULER: {label}", fontsize="small")
        fig.colorbar(im, ax=ax, label="score (%)")


register(Task("ruler", "RULER (synthetic long-context tasks)", run, in_all=False, plot=plot, check=check,
              check_prompts=check_prompts, argument="TASK,TASK,...", order=4, reads=("data", "max_len", "trials")))
