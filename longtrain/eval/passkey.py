"""Passkey retrieval, generated here: can the model fetch a number from far back in its context?

The usual prompt (Mohtashami & Jaggi's, used by LongLoRA and others): an instruction, filler
sentences repeated, "The pass key is NNNNN. Remember it." at a given depth of the filler, more
filler, and a request for the key. Greedy decoding; a trial counts when the first number the model
writes is the key. A grid of context lengths (1k, 2k, 4k, ... up to --max-len tokens) times depths
(0, 0.25, 0.5, 0.75, 1) with --trials random keys per cell. The table prints each length beside
the model's KV budget (k + w): past it, a sliding window alone cannot see the key.

Prompts are built from token pieces, so every prompt of a length has exactly that many tokens
(a partial filler after the instruction makes up the rest): a length's prompts run as one batch.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from longtrain.eval.tasks import EvalContext, EvalOptions, EvalUsageError, Task, TaskResult, register
from longtrain.generate import Decoder, prefill
from longtrain.model.chunks import resolve_chunk_size

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it."
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FIRST_LENGTH = 1024
ANSWER_TOKENS = 8  # greedy tokens read for the answer
ROWS = 8  # prompts decoded side by side
MAX_CPU_FULL = 16384  # full attention on the CPU past this: O(L^2) per prompt, minutes per cell


@dataclass
class PasskeyPrompt:
    ids: list[int]
    key: str
    needle_start: int  # token index where the needle sentence starts
    needle_end: int


def lengths_up_to(max_len: int, first: int = FIRST_LENGTH) -> list[int]:
    """first (1024), twice that, ... up to max_len (and max_len itself when it is not on the way)."""
    out, n = [], first
    while n <= max_len:
        out.append(n)
        n *= 2
    if not out or out[-1] != max_len:
        out.append(max_len)
    return out


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> PasskeyPrompt:
    """A prompt of exactly `length` tokens with the key's sentence at `depth` (0..1) of the filler."""

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    intro, filler, needle, question = enc(INSTRUCTION), enc(FILLER), enc(NEEDLE.format(key=key)), enc(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        need = len(intro) + len(needle) + len(question)
        raise ValueError(f"a passkey prompt needs at least {need} tokens; asked for {length}")
    n_fill, pad = divmod(room, len(filler))
    before = round(depth * n_fill)
    head = intro + filler[len(filler) - pad :] + filler * before  # a partial filler makes the length exact
    ids = head + needle + filler * (n_fill - before) + question
    return PasskeyPrompt(ids=ids, key=key, needle_start=len(head), needle_end=len(head) + len(needle))


def answer_is_key(text: str, key: str) -> bool:
    """Exact match: the first number in the model's continuation is the key."""
    m = re.search(r"\d+", text)
    return m is not None and m.group(0) == key


@torch.no_grad()
def answer(model, tokenizer, prompts: list[PasskeyPrompt], chunk_size: int) -> list[str]:
    """Greedy continuations (ANSWER_TOKENS tokens) of equally long prompts, decoded side by side."""
    ids = torch.tensor([p.ids for p in prompts], dtype=torch.int64)
    cache, logits = prefill(model, ids, chunk_size=chunk_size)
    decoder = Decoder(model, cache, cuda_graph=False)  # a few steps: a graph's capture would cost more
    out = []
    for step in range(ANSWER_TOKENS):
        token = logits.argmax(-1)  # [B]
        out.append(token.cpu())
        if step + 1 < ANSWER_TOKENS:
            logits = decoder.step(token)
    tokens = torch.stack(out, 1).tolist()
    return [tokenizer.decode(t) for t in tokens]


def passkey_grid(model, tokenizer, *, max_len: int, trials: int, chunk_size: int, seed: int = 0, progress=None) -> list[dict]:
    """Accuracy per (length, depth) over `trials` random keys: [{length, depth, trials, accuracy, correct}]."""
    rng = random.Random(seed)
    cells = []
    lengths = lengths_up_to(max_len)
    if progress is not None:
        progress.start("passkey", sum(lengths) * len(DEPTHS) * trials)
    for length in lengths:
        prompts = [
            passkey_prompt(tokenizer, length, depth, str(rng.randint(10000, 99999))) for depth in DEPTHS for _ in range(trials)
        ]
        correct = []
        for s in range(0, len(prompts), ROWS):
            batch = prompts[s : s + ROWS]
            texts = answer(model, tokenizer, batch, chunk_size)
            correct += [answer_is_key(t, p.key) for t, p in zip(texts, batch)]
            if progress is not None:
                progress.advance(length * len(batch))
        for i, depth in enumerate(DEPTHS):
            hits = sum(correct[i * trials : (i + 1) * trials])
            cells.append({"length": length, "depth": depth, "trials": trials, "accuracy": hits / trials, "correct": hits})
    return cells


# ----------------------------------------------------------------------------- the eval task


def kv_budget(cfg) -> int | None:
    """Keys a query can see: k + w (None for full attention: all of them)."""
    return None if cfg.attention == "full" else cfg.topk + cfg.window


def run(ctx: EvalContext) -> TaskResult:
    model, opts = ctx.ckpt.model, ctx.opts
    chunk = resolve_chunk_size(opts.chunk_size, ctx.ckpt.recipe.train.chunk_size)
    cells = passkey_grid(
        model, ctx.ckpt.tokenizer, max_len=opts.max_len, trials=opts.trials, chunk_size=chunk, seed=opts.seed,
        progress=ctx.progress,
    )
    budget = kv_budget(model.cfg)
    rows = [("KV budget (k + w)", "all keys (full attention)" if budget is None else f"{budget:,} tokens")]
    for length in sorted({c["length"] for c in cells}):
        row = [c for c in cells if c["length"] == length]
        mean = sum(c["accuracy"] for c in row) / len(row)
        by_depth = " ".join(f"{c['accuracy']:.2f}" for c in row)
        beyond = " ›k+w" if budget is not None and length > budget else ""
        rows.append((f"passkey at {length:,} tokens", f"{mean:.2f}  (depths {by_depth}){beyond}"))
    legend = "" if budget is None else "; ›k+w: longer than the KV budget"  # full attention has none
    return TaskResult(json=cells, rows=rows, notes=[f"passkey: accuracy per length, then per depth 0, .25, .5, .75, 1{legend}"])


def check(recipe, opts: EvalOptions) -> None:
    if opts.trials < 1:
        raise EvalUsageError(f"must be at least 1; got {opts.trials}", arg="trials")
    if opts.max_len < 256:
        raise EvalUsageError(f"must be at least 256 tokens (the prompt's instruction and question); got {opts.max_len}", arg="max_len")
    if recipe.attention.type == "full" and opts.device == "cpu" and opts.max_len > MAX_CPU_FULL:
        raise EvalUsageError(
            f"{{arg}} {opts.max_len:,} with a full-attention model on the CPU: every prompt costs O(length²) "
            f"attention and keeps every key, which takes far too long here. Use {{arg}} {MAX_CPU_FULL:,} or less, "
            "or a CUDA device.", arg="max_len",
        )


def plot(fig, spec, entries: list[tuple[str, list]]) -> None:
    """Accuracy heatmaps (length x depth), one per checkpoint."""
    from matplotlib.gridspec import GridSpecFromSubplotSpec

    grid = GridSpecFromSubplotSpec(1, len(entries), subplot_spec=spec, wspace=0.35)
    for i, (label, cells) in enumerate(entries):
        ax = fig.add_subplot(grid[0, i])
        lengths = sorted({c["length"] for c in cells})
        depths = sorted({c["depth"] for c in cells})
        acc = [[next(c["accuracy"] for c in cells if c["length"] == n and c["depth"] == d) for n in lengths] for d in depths]
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        for y, row in enumerate(acc):
            for x, a in enumerate(row):
                ax.text(x, y, f"{a:.2f}", ha="center", va="center", fontsize="x-small", color="white" if a < 0.6 else "black")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths], fontsize="small")
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize="small")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("depth of the key")
        ax.set_title(f"passkey: {label}", fontsize="small")
        fig.colorbar(im, ax=ax, label="accuracy")


register(Task("passkey", "passkey retrieval", run, plot=plot, check=check, order=1, reads=("max_len", "trials")))
