"""What the CUDA graph of a training chunk is captured from (longtrain.train.step_graph; the replays themselves run
in tests/gpu/test_step_graph_gpu.py)."""

import torch

from longtrain.model import LM, LMConfig
from longtrain.train.step_graph import capturable, shapes


@torch.no_grad()
def test_a_growing_cache_is_captured_only_empty():
    full = LM(LMConfig(vocab_size=61, layers=2, d_model=32, heads=2, attention="full"))
    empty = full.empty_cache(2)
    after = full(torch.randint(0, 61, (2, 12)), cache=empty).cache
    assert capturable(empty) and not capturable(after)
    assert shapes(after) != shapes(empty)  # it grew: the graph hands out its own buffers, not the input's
    assert capturable(after.reset_rows(torch.tensor([True, True])).keep_last(0))  # what ChunkReader hands a new pair

    sparse = LM(LMConfig(vocab_size=61, layers=2, d_model=32, heads=2, attention="sparsek+sw", topk=4, window=6))
    start = sparse.empty_cache(2)
    nxt = sparse(torch.randint(0, 61, (2, 12)), cache=start).cache
    assert capturable(start) and capturable(nxt) and shapes(nxt) == shapes(start)  # fixed size: replayed in place
