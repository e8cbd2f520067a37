"""longtrain checkpoints as an lm-evaluation-harness model ("longtrain"); needs `pip install 'longtrain[eval]'`.

Importing this module registers the model with lm-eval. lm-eval finds models only among those
imported, so its own `lm_eval` command does not know this one; run it through

    python -m longtrain.eval.lm_eval_model --model longtrain \\
        --model_args checkpoint=RUN,device=cuda,dtype=bfloat16 --tasks lambada_openai

(every `lm_eval` flag works), or `longtrain eval RUN --task lm-eval:TASKS`, or from Python:
`import longtrain.eval.lm_eval_model` and then `lm_eval.simple_evaluate(model="longtrain", ...)`.

  loglikelihood            log p(continuation | context): the context is read once (chunked, the
                           cache carried) and reused by the requests that share it; the
                           continuation is read from that cache. Tokens as lm-eval's HF model: the
                           context's trailing spaces move to the continuation, the pair is encoded
                           whole and split where the context alone ends.
  loglikelihood_rolling    log p(text), every token after the end-of-document token: the whole
                           text in chunks with the cache carried, however long (no window rolling).
  generate_until           greedy (or sampled, do_sample) continuations through the batched decoder
                           (`batch_size` rows at a time), cut before the first `until` string.

Log-likelihood requests are read one at a time; max_batch_size is accepted and unused.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from longtrain.data.stream import IGNORE
from longtrain.data.tokenizer import eod_id
from longtrain.generate import Sampling, generate_batch, prefill
from longtrain.model.chunks import ChunkReader, resolve_chunk_size, split_rows
from longtrain.model.loss import SLICE_ELEMENTS

DEFAULT_MAX_GEN_TOKS = 256


@register_model("longtrain")
class LongtrainLM(LM):
    def __init__(
        self,
        checkpoint: str | None = None,
        device: str = "auto",
        dtype: str | None = None,
        chunk_size: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        batch_size: int | str | None = None,  # generate_until: requests decoded side by side ("auto": 1)
        max_batch_size: int | None = None,  # lm-eval passes it; unused
        loaded=None,  # a LoadedCheckpoint instead of checkpoint (longtrain eval)
    ):
        super().__init__()
        if loaded is None:
            from longtrain.device import DTYPES, pick_device, pick_dtype
            from longtrain.train.checkpoint import load_checkpoint

            if checkpoint is None:
                raise ValueError("model_args needs checkpoint=RUN_DIR_OR_CHECKPOINT")
            device = pick_device(device)
            loaded = load_checkpoint(str(checkpoint), device=device, dtype=DTYPES[pick_dtype(dtype, device)])
        self.ckpt = loaded
        self.model, self.tok = loaded.model, loaded.tokenizer
        self.dev = self.model.embed.weight.device
        self.eod = eod_id(self.tok)  # every longtrain tokenizer has one (load_tokenizer adds it)
        self.chunk = resolve_chunk_size(None if chunk_size is None else int(chunk_size), loaded.recipe.train.chunk_size, prefill=True)
        self.max_gen_toks = int(max_gen_toks)
        self.rows = int(batch_size) if str(batch_size).isdigit() and int(batch_size) > 0 else 1
        self._context = None  # (context tokens but the last, the cache after them): shared by consecutive requests

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "LongtrainLM":
        """model_args first: lm-eval's own --device (and batch sizes) only where model_args leave them out."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "LongtrainLM":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------------- tokens

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens) as lm-eval's HF model splits them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        n = len(self.encode(context))
        return whole[:n], whole[n:]

    # ------------------------------------------------------------------------- scoring

    @torch.no_grad()
    def read_scored(self, ids: list[int], cache, seen: int) -> tuple[float, bool]:
        """ids read on from `cache` (which holds `seen` tokens): (sum of log p(ids[i+1] | all before), whether
        every one of those tokens is the argmax), in float64 sums of float32 (float64 models: float64) logits."""
        reader = ChunkReader(cache, self.dev)
        rows = split_rows(torch.tensor([ids], dtype=torch.int64), self.chunk, seen=torch.tensor([seen]))
        total, greedy = 0.0, True
        slice_rows = max(1, SLICE_ELEMENTS // self.model.embed.weight.shape[0])
        for host, _, out in reader(rows, lambda chunk, c: self.model.hidden(chunk.tokens, cache=c)):
            keep = host.targets[0] != IGNORE  # [L]
            h = out.hidden[0][keep.to(self.dev)]  # [n, d]
            targets = host.targets[0][keep].to(self.dev)  # [n]
            for s in range(0, h.shape[0], slice_rows):
                logits = self.model.head(h[s : s + slice_rows])  # [m, V]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                t = targets[s : s + slice_rows]
                logp = torch.log_softmax(logits, -1).gather(1, t[:, None])[:, 0]  # [m]
                total += float(logp.double().sum())
                greedy = greedy and bool((logits.argmax(-1) == t).all())
        return total, greedy

    def context_cache(self, before: list[int]):
        """The cache after `before` (the context but its last token), computed once for consecutive requests."""
        if self._context is None or self._context[0] != before:
            if before:
                cache, _ = prefill(self.model, torch.tensor([before], dtype=torch.int64), chunk_size=self.chunk)
            else:
                cache = self.model.empty_cache(1, device=self.dev)
            self._context = (before, cache)
        return self._context[1].clone()  # reading on must not change the shared one

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(log p(continuation | context), greedy): an empty context starts after the end-of-document token."""
        if not continuation:
            raise ValueError("an empty continuation has no log-likelihood")
        context = context or [self.eod]
        cache = self.context_cache(context[:-1])
        return self.read_scored(context[-1:] + continuation, cache, len(context) - 1)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            result = self.score(*self.encode_pair(context, continuation))
            self.cache_hook.add_partial("loglikelihood", req.args, result)
            out.append(result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            total, _ = self.read_scored([self.eod] + self.encode(text), self.model.empty_cache(1, device=self.dev), 0)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            out.append(total)
        return out

    # ------------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations cut before the first `until` string (or at the end-of-document token), `batch_size`
        requests decoded side by side, each with its own settings."""
        out = []
        args = [req.args for req in requests]
        for s in range(0, len(args), self.rows):
            batch = args[s : s + self.rows]
            prompts, max_new, stops, sampling = [], [], [], []
            for context, kwargs in batch:
                kwargs = dict(kwargs or {})
                until = kwargs.get("until") or []
                stops.append([until] if isinstance(until, str) else list(until))
                max_new.append(int(kwargs.get("max_gen_toks", self.max_gen_toks)))
                temperature = float(kwargs.get("temperature", 0.0) or 0.0)
                greedy = not kwargs.get("do_sample", False) or temperature <= 0
                sampling.append(Sampling(temperature=0.0 if greedy else temperature, top_k=int(kwargs.get("top_k", 0) or 0),
                                         top_p=float(kwargs.get("top_p", 1.0) or 1.0)))
                prompts.append(self.encode(context) or [self.eod])
            gen = generate_batch(self.model, prompts, max_new_tokens=max_new, sampling=sampling, stop=stops,
                                 eod_id=self.eod, tokenizer=self.tok, chunk_size=self.chunk)
            for a, row in zip(batch, gen.rows):
                self.cache_hook.add_partial("generate_until", a, row.text)
                out.append(row.text)
        return out


if __name__ == "__main__":  # `python -m longtrain.eval.lm_eval_model ...`: lm-eval's command, with this model registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
