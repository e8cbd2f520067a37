"""Tiny random Hugging Face models built with `transformers` and saved locally (no download)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer

from longtrain.data.tokenizer import train_bpe

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have "
    "an they you were her all she there would their we him been has when who will more no if out so said "
    "river house letter morning captain garden window silence evening mountain quiet ship coffee wander"
).split()
VOCAB = 320  # embedding rows of the tiny models; the tokenizer has fewer tokens


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + ("." if rng.random() < 0.08 else "") for _ in range(words))


def write_corpus(folder: Path, n_docs: int = 4, words: int = 2500) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        (folder / f"doc{d}.txt").write_text(text(d, words))
    return folder


def tokenizer() -> Tokenizer:
    return train_bpe([text(100 + i, 3000) for i in range(3)], 300)


def _perturb(model) -> None:
    """Random norm gains and biases, so a mix-up of norms or biases cannot go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)


def llama(**kw):
    """GQA (4 query heads, 2 KV heads), untied head, rope_theta 5000."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=40, rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**(cfg | kw)))
    _perturb(model)
    return model.eval()


def qwen2(**kw):
    """Biases on q, k and v (none on o), GQA, tied head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=40, rope_theta=8000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(Qwen2Config(**(cfg | kw)))
    _perturb(model)
    return model.eval()


def mistral(**kw):
    """A Llama with a sliding window of 16 keys."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=40, rope_theta=5000.0, rms_norm_eps=1e-6, sliding_window=16, tie_word_embeddings=False)
    model = MistralForCausalLM(MistralConfig(**(cfg | kw)))
    _perturb(model)
    return model.eval()


def gpt_neox(**kw):
    """Partial rotary (a quarter of each 16-dim head), parallel residual, untied head, biases."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
               rotary_pct=0.25, rotary_emb_base=2000, use_parallel_residual=True, tie_word_embeddings=False,
               max_position_embeddings=512)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**(cfg | kw)))
    _perturb(model)
    return model.eval()


def save(model, folder: Path, tok: Tokenizer, **kw) -> Path:
    model.save_pretrained(folder, **kw)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max())
