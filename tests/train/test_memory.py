"""The training-memory estimate counts what the linear attention types' naive core keeps for the backward."""

import torch

from longtrain.train import memory
from longtrain.train.recipe import load_recipe


def test_linear_types_add_the_naive_core_activations():
    def estimate(kind):
        r = load_recipe("quickstart", [f"attention.type={kind}", "attention.topk=64", "attention.window=64"])
        return r, memory.estimate_training_bytes(r, n_params=10**6, vocab_size=2048, position=4096,
                                                 compute_dtype=torch.float32)

    r, plain = estimate("sparsek+sw")
    _, linear = estimate("sparsek+linear+sw")
    m, t = r.model, r.train
    per_query = m.heads * (64 + 64 + 63) * 48
    assert abs(linear - plain - memory.FRAGMENTATION * m.layers * t.batch_docs * t.chunk_size * per_query) <= 1


def test_activation_checkpointing_keeps_one_blocks_activations_and_each_blocks_input():
    def estimate(*sets):
        r = load_recipe("quickstart", list(sets))
        return r, memory.estimate_training_bytes(r, n_params=10**6, vocab_size=2048, position=4096, compute_dtype=torch.float32)

    r, plain = estimate()
    _, ac = estimate("train.activation_checkpointing=true")
    m, t = r.model, r.train
    per_token = memory.activation_bytes_per_token(m.style, m.mlp_ratio, torch.float32)
    saved_acts = (m.layers - 1) * t.batch_docs * t.chunk_size * m.d_model * per_token
    kept_inputs = m.layers * t.batch_docs * t.chunk_size * m.d_model * 4
    assert plain - ac > memory.FRAGMENTATION * (saved_acts - kept_inputs) > 0
    assert "train.activation_checkpointing=true" in memory.advice(r)
    assert "activation_checkpointing" not in memory.advice(load_recipe("quickstart", ["train.activation_checkpointing=true"]))
