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
