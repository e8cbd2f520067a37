"""Perplexity by position: bucket arithmetic, and the chunked stream equals one unchunked pass."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from longtrain.data.cache import TokenDocs
from longtrain.eval.perplexity import PositionLoss, bucket_edges, perplexity_by_position
from longtrain.model import LM, LMConfig


def test_bucket_edges_double_up_to_the_longest_document():
    assert bucket_edges(1) == [0, 1024]
    assert bucket_edges(1024) == [0, 1024]
    assert bucket_edges(1025) == [0, 1024, 2048]
    assert bucket_edges(5000) == [0, 1024, 2048, 4096, 8192]


def test_token_counts_add_up_and_buckets_hold_their_positions():
    rng = np.random.default_rng(0)
    acc = PositionLoss(bucket_edges(9000))
    positions = np.concatenate([[0, 1023, 1024, 2047, 2048, 4095, 4096, 8999], rng.integers(0, 9000, 3000)])
    nll = rng.random(len(positions)) * 5
    acc.add(positions[:100], nll[:100])  # in two calls, as chunks come
    acc.add(positions[100:], nll[100:])
    res = acc.result()
    assert res["tokens"] == len(positions) == sum(b["tokens"] for b in res["buckets"])
    assert math.isclose(res["loss"], nll.mean(), rel_tol=1e-12)
    assert math.isclose(sum(b["loss"] * b["tokens"] for b in res["buckets"]) / res["tokens"], res["loss"], rel_tol=1e-12)
    assert [(b["start"], b["end"]) for b in res["buckets"]] == [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8192), (8192, 16384)]
    for b in res["buckets"]:
        inside = (positions >= b["start"]) & (positions < b["end"])
        assert b["tokens"] == inside.sum() and math.isclose(b["loss"], nll[inside].mean(), rel_tol=1e-12)
        assert math.isclose(b["ppl"], math.exp(b["loss"]))
    with pytest.raises(ValueError, match="outside the buckets"):
        acc.add(np.array([20000]), np.array([1.0]))


@pytest.mark.parametrize("max_tokens", [None, 1100])
def test_the_chunked_stream_equals_one_pass_per_document(max_tokens):
    """float64: the loss of every document read in chunks of 200 (3 side by side) equals an unchunked pass."""
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=50, layers=2, d_model=32, heads=2, attention="sparsek+sw", topk=8, window=8)).double().eval()
    lengths = [1300, 500, 1150, 40]
    tokens = torch.randint(0, 50, (sum(lengths),), dtype=torch.int32).numpy()
    ends = np.cumsum(lengths)
    docs = TokenDocs(tokens, ends - np.array(lengths), ends, np.arange(len(lengths)))
    res = perplexity_by_position(model, docs, chunk_size=200, rows=3, max_tokens=max_tokens)

    nll, pos = [], []
    with torch.no_grad():
        for d, n in enumerate(lengths):
            doc = torch.from_numpy(docs.doc(d).astype(np.int64))
            keep = min(n - 1, max_tokens or n)  # positions with a target, within the first max_tokens
            logits = model(doc[None, : keep + 1]).logits[0, :keep]
            nll.append(F.cross_entropy(logits, doc[1 : keep + 1], reduction="none"))
            pos.append(torch.arange(keep))
    nll, pos = torch.cat(nll), torch.cat(pos)
    assert res["tokens"] == len(nll) == sum(b["tokens"] for b in res["buckets"])
    assert abs(res["loss"] - float(nll.mean())) <= 1e-9
    for b in res["buckets"]:
        inside = (pos >= b["start"]) & (pos < b["end"])
        assert b["tokens"] == int(inside.sum()) and abs(b["loss"] - float(nll[inside].mean())) <= 1e-9
    assert res["documents"] == 4 and res["chunk_size"] == 200 and len(res["buckets"]) == 2


def test_a_chunk_runs_with_no_earlier_chunks_activations_alive(earlier_chunks_alive):
    """The reader and the loop drop each chunk's hidden states before the next chunk runs: the peak memory of a
    long evaluation is one chunk's."""
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=50, layers=2, d_model=32, heads=2, attention="sparsek+sw", topk=8, window=8)).eval()
    tokens = torch.randint(0, 50, (900,), dtype=torch.int32).numpy()
    docs = TokenDocs(tokens, np.array([0]), np.array([900]), np.arange(1))
    alive_at_call = earlier_chunks_alive(model)
    res = perplexity_by_position(model, docs, chunk_size=200, rows=1)
    assert res["tokens"] == 899 and alive_at_call == [0] * 5
