"""GPU checks of decoding (skipped without CUDA): the CUDA-graph decoder replays exactly what eager decoding
computes, and decoding follows the chunked forward (Triton kernels, device scan) in float32."""

import pytest
import torch

from longtrain.generate import Decoder, prefill
from longtrain.model import LM, LMConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [
    dict(attention="sparsek+sw", topk=64, window=64),
    dict(attention="sw", window=128),
    dict(style="llama", kv_heads=2, score_groups="per_kv_head", attention="sparsek+sw", topk=32, window=32),
]


@pytest.mark.parametrize("kw", CASES)
@torch.no_grad()
def test_graph_replay_equals_eager_decoding_and_the_forward(kw):
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=512, layers=2, d_model=128, heads=4, **kw)).cuda().eval()
    tokens = torch.randint(0, 512, (2, 700), device="cuda")
    cache, _ = prefill(model, tokens[:, :600], chunk_size=256)
    graph, eager = Decoder(model, cache, cuda_graph=True), Decoder(model, cache, cuda_graph=False)
    ref_cache, ref = cache, []
    for t in range(600, 700):
        out = model(tokens[:, t : t + 1], cache=ref_cache)  # the chunk op on one token
        ref_cache = out.cache
        ref.append(out.logits[:, 0])
    for i, t in enumerate(range(600, 700)):
        a, b = graph.step(tokens[:, t]), eager.step(tokens[:, t])
        assert torch.equal(a, b), t  # the same kernels, replayed
        assert (a - ref[i]).abs().max() < 1e-3, t
    assert torch.equal(graph.cache.seen, eager.cache.seen)
    for x, y in zip(graph.cache.layers, eager.cache.layers):
        assert torch.equal(x.attn.pool_pos.sort(1).values, y.attn.pool_pos.sort(1).values)
