"""The Python API for scripts: `from longtrain import load`.

    from longtrain import load
    lm = load("runs/books")                                   # a run dir or a checkpoint folder
    out = lm.generate(["The river", "Chapter one"], max_new_tokens=50, temperature=0.8, stop=["\\n\\n"])
    print(out[0].text, out[0].stopped)                        # one Completion per prompt
    print(lm.score("The river was quiet.")[0].mean())         # per-token loss (nats)

`Model.generate` is what `longtrain generate` runs: the prompts prefilled side by side in chunks and
decoded together (longtrain.generate.generate_batch); `Model.score` reads texts the same way and
returns each token's loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from longtrain.errors import UsageError
from longtrain.generate import (
    Completion,
    Generation,
    Sampling,
    generate_batch,
    pad_prompts,
    prefill_chunk_for,
    read_prompts,
)
from longtrain.model.chunks import resolve_chunk_size


def load(checkpoint: str | Path, *, device: str = "auto", dtype: str | None = None) -> "Model":
    """A checkpoint folder or run dir (its newest complete checkpoint) ready to generate and score.

    device: auto | cpu | cuda; dtype: float32 | bfloat16 | float64 (default: bfloat16 on cuda, float32 on cpu).
    Bad arguments (a path that does not exist or is a file among them) raise longtrain.errors.UsageError; a
    folder without a usable checkpoint CheckpointError.
    """
    from longtrain.device import DTYPES, pick_device, pick_dtype
    from longtrain.path_args import checkpoint_arg
    from longtrain.train.checkpoint import load_checkpoint

    device = pick_device(device)
    dtype = pick_dtype(dtype, device)
    path = checkpoint_arg(checkpoint)
    return Model(load_checkpoint(path, device=device, dtype=DTYPES[dtype]), device=device, dtype=dtype)


class Model:
    """A loaded checkpoint: `.generate(prompts)`, `.score(texts)`, `.tokenizer`, `.model` (the LM)."""

    def __init__(self, ckpt, *, device: str, dtype: str):
        self.checkpoint = ckpt
        self.model = ckpt.model
        self.tokenizer = ckpt.tokenizer
        self.device, self.dtype = device, dtype
        self.chunk_size = resolve_chunk_size(None, ckpt.recipe.train.chunk_size, prefill=True)
        self.last: Generation | None = None  # the last generate's timings and memory

    def prefill_chunk(self, rows: int, requested: int | None = None) -> int:
        """The chunk a prefill of `rows` prompts reads (model.chunks.prefill_chunk_size): `requested`, else longer
        chunks on a GPU, where a prefill in short chunks is launch-bound."""
        return prefill_chunk_for(self.model, rows, requested, self.checkpoint.recipe.train.chunk_size)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        max_new_tokens: int | Sequence[int] = 200,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        sampling: Sampling | Sequence[Sampling] | None = None,  # per-row settings (instead of the four above)
        stop: str | Sequence[str] | Sequence[Sequence[str]] = (),  # stop texts: for every row, or a list per row
        stop_at_end_of_document: bool = True,
        chunk_size: int | None = None,
        compile: bool = False,
        exact: bool = False,  # every step through the chunked forward's attention and selection (slower)
        on_token: Callable[[int, int], None] | None = None,  # (row, token) as tokens come
        on_prefill: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """One Completion (text, tokens, stopped, prompt_tokens) per prompt, the prompts decoded together.

        Greedy by default (temperature 0). A row stops at its max_new_tokens, at the end-of-document
        token, or once its text holds a stop text (its `text` is cut before it). exact: each token read as a
        one-token chunk (Decoder's exact), so in bf16 the logits equal one forward pass over prompt and output bit for
        bit; slower than the default step, which rounds its attention apart in bf16.
        """
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [self.encode(t) for t in texts]
        empty = [i for i, x in enumerate(ids) if not x]
        if empty:
            which = "the prompt" if len(texts) == 1 else f"prompt {empty[0]}"
            raise UsageError(f"{which} is empty: give some text to continue")
        if sampling is None:
            sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        for setting in [sampling] if isinstance(sampling, Sampling) else sampling:
            for name, problem in setting.problems():
                raise UsageError(problem, arg=name)
        for n in [max_new_tokens] if isinstance(max_new_tokens, int) else max_new_tokens:
            if n < 1:
                raise UsageError(f"must be at least 1; got {n}", arg="max_new_tokens")
        from longtrain.data.tokenizer import eod_id

        self.last = generate_batch(
            self.model, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=[stop] if isinstance(stop, str) else stop,
            eod_id=eod_id(self.tokenizer) if stop_at_end_of_document else None, tokenizer=self.tokenizer,
            chunk_size=self.prefill_chunk(len(ids), chunk_size), compile=compile, exact=exact, on_token=on_token,
            on_prefill=on_prefill,
        )
        return self.last.rows

    @torch.no_grad()
    def score(self, texts: str | Sequence[str], *, chunk_size: int | None = None) -> list[torch.Tensor]:
        """Per text, the loss (nats, float32 [n - 1] on the CPU) of each token after the first given those before it."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        encoded = [self.encode(t) for t in texts]
        empty = [i for i, x in enumerate(encoded) if not x]
        if empty:
            raise UsageError(f"text {empty[0]} is empty: scoring needs at least one token")
        ids, lengths = pad_prompts(encoded)
        chunk = chunk_size or min(self.chunk_size, 2048)  # [B, chunk, V] logits per chunk
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # the token each position predicts (the last: none)
        losses = torch.zeros(ids.shape, dtype=torch.float32)  # [B, T]
        for s, n, out in read_prompts(self.model, ids, lengths, chunk_size=chunk):
            L = out.hidden.shape[1]
            logits = self.model.head(out.hidden).float()  # [B, L, V]
            target = nxt[:, s : s + L].to(logits.device)
            losses[:, s : s + L] = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(-1, L).cpu()
            del out, logits  # freed before the next chunk runs
        return [losses[r, : int(lengths[r]) - 1].clone() for r in range(len(texts))]
