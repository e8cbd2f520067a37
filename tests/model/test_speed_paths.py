"""The trainer's fast paths in the model: the sliced head loss, compiled blocks, max_context, the cache dtype.

Each is checked against its plain counterpart on fresh random inputs in float64 (compiled with the
aot_eager backend: the same graphs without Inductor's code generation, which is slow on a CI CPU).
"""

import pytest
import torch

from longtrain.model import LM, LMConfig
from longtrain.model.loss import linear_cross_entropy, linear_cross_entropy_reference

SMALL = dict(vocab_size=61, layers=2, d_model=32, heads=4)


def make(**kw) -> LM:
    torch.manual_seed(0)
    return LM(LMConfig(**{**SMALL, **kw})).double()


@pytest.mark.parametrize("N, V, rows", [(37, 53, 10), (64, 29, 64), (5, 300, 1)])
def test_sliced_loss_equals_cross_entropy_and_keeps_no_full_logits(N, V, rows):
    torch.manual_seed(N)
    h = torch.randn(N, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[::3] = -100  # positions without a target
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        got = linear_cross_entropy(h, w, t, slice_rows=rows)
    ref = linear_cross_entropy_reference(h, w, t)
    assert abs(got.item() - ref.item()) <= 1e-10 * abs(ref.item())
    g_got = torch.autograd.grad(got * 1.5, (h, w))
    g_ref = torch.autograd.grad(ref * 1.5, (h, w))
    for a, b in zip(g_got, g_ref):
        assert (a - b).abs().max() <= 1e-12
    assert sorted(saved) == sorted([(N, 16), (V, 16)])  # what backward keeps: dh and dW, never [N, V] logits
    with torch.no_grad():  # validation: the loss alone
        assert abs(linear_cross_entropy(h, w, t, slice_rows=rows).item() - ref.item()) <= 1e-10 * abs(ref.item())


def test_sliced_loss_under_bf16_autocast_matches_to_rounding():
    torch.manual_seed(1)
    h = torch.randn(2, 40, 32, requires_grad=True)
    w = torch.randn(97, 32, requires_grad=True)
    t = torch.randint(0, 97, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, ref = linear_cross_entropy(h, w, t, slice_rows=16), linear_cross_entropy_reference(h, w, t)
    assert got.dtype == ref.dtype == torch.float32
    assert abs(got.item() - ref.item()) <= 1e-3 * ref.item()
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_forward_with_targets_is_the_loss_of_the_logits():
    model = make(attention="sparsek+sw", topk=4, window=6)
    tokens = torch.randint(0, 61, (2, 50))
    targets = torch.randint(0, 61, (2, 50))
    targets[1, 30:] = -100
    out = model(tokens, targets=targets)
    ref = linear_cross_entropy_reference(model(tokens).hidden, model.unembed.weight if model.unembed else model.embed.weight, targets)
    assert out.logits is None and abs(out.loss_sum.item() - ref.item()) <= 1e-9 * ref.item()
    out.loss_sum.backward()
    assert model.embed.weight.grad is not None  # gpt2 ties the head to the embedding


def test_compiled_blocks_equal_eager_chunked_and_unchunked():
    torch._dynamo.reset()
    kw = dict(style="llama", kv_heads=2, attention="sparsek+sw", topk=5, window=8)
    eager, compiled = make(**kw), make(**kw)
    compiled.compile_blocks(backend="aot_eager")
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints keep their names
    tokens, targets = torch.randint(0, 61, (2, 90)), torch.randint(0, 61, (2, 90))
    ref = eager(tokens, targets=targets)
    cache, loss = compiled.empty_cache(2, dtype=torch.float64), 0.0
    for s in range(0, 90, 30):  # chunked and compiled: the same hidden states and loss as one eager pass
        out = compiled(tokens[:, s : s + 30], cache=cache, targets=targets[:, s : s + 30])
        assert (out.hidden - ref.hidden[:, s : s + 30]).abs().max() <= 1e-9
        cache, loss = out.cache, loss + out.loss_sum
    assert abs(loss.item() - ref.loss_sum.item()) <= 1e-9 * ref.loss_sum.item()
    first = eager(tokens[:, :30], targets=targets[:, :30]).loss_sum
    first.backward()  # gradients of the first chunk: compiled == eager
    compiled.zero_grad()
    compiled(tokens[:, :30], targets=targets[:, :30]).loss_sum.backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-9, name


@torch.no_grad()
def test_max_context_is_a_sliding_window_for_full_attention():
    full, sw = make(attention="full", max_context=12), make(attention="sw", window=12)
    sw.load_state_dict(full.state_dict())  # the same weights (neither has a scorer)
    tokens = torch.randint(0, 61, (2, 80))
    ref = sw(tokens).logits
    assert (full(tokens).logits - ref).abs().max() <= 1e-9  # unchunked
    cache, parts = full.empty_cache(2, dtype=torch.float64), []
    for s in range(0, 80, 7):  # chunks shorter and longer than nothing in particular
        out = full(tokens[:, s : s + 7], cache=cache)
        cache, parts = out.cache, parts + [out.logits]
        assert cache.layers[0].attn.full_k.shape[1] <= 11  # the last max_context - 1 keys
    assert (torch.cat(parts, 1) - ref).abs().max() <= 1e-9
    with pytest.raises(ValueError, match="max_context"):
        make(attention="sw", window=4, max_context=8)


@torch.no_grad()
def test_kv_dtype_cast_and_keep_last():
    model = make(attention="sparsek+sw", topk=4, window=6)
    cache = model(torch.randint(0, 61, (2, 30))).cache
    half = cache.with_kv_dtype(torch.bfloat16)
    a, b = cache.layers[0].attn, half.layers[0].attn
    assert b.pool_k.dtype == b.tail_v.dtype == torch.bfloat16
    assert b.pool_u.dtype == a.pool_u.dtype and b.thr_u.dtype == torch.float64  # scores and thresholds keep theirs
    assert torch.equal(b.pool_k.double(), a.pool_k.to(torch.bfloat16).double())
    assert half.keep_last(3).layers[0].attn is b  # fixed-size caches are left alone

    full = make(attention="full")
    cache = full(torch.randint(0, 61, (2, 30))).cache
    cut = cache.reset_rows(torch.tensor([True, False])).keep_last(10)
    attn = cut.layers[1].attn
    assert attn.full_k.shape[1] == 10 and torch.equal(attn.full_pos[1], torch.arange(20, 30))
    assert (attn.full_pos[0] == -1).all()


@torch.no_grad()
@pytest.mark.parametrize("attention", ["sparsek+sw", "sparsek+linear+sw", "full"])
def test_cache_clone_is_equal_and_shares_nothing(attention):
    # The CUDA-graph decoder and training step update their copy in place: the caller's cache must not move with it.
    model = make(attention=attention, topk=4, window=6) if attention != "full" else make(attention="full")
    cache = model(torch.randint(0, 61, (2, 30))).cache
    copy = cache.clone()
    pairs = list(zip(cache.tensors(), copy.tensors()))
    assert len(pairs) > 3
    for a, b in pairs:
        assert torch.equal(a, b) and (a.numel() == 0 or a.data_ptr() != b.data_ptr())
    assert [type(la.attn) for la in copy.layers] == [type(la.attn) for la in cache.layers]
    if attention != "full":  # the sizes (k, w) come along
        assert [la.attn.sizes() for la in copy.layers] == [la.attn.sizes() for la in cache.layers]
    copy.seen.add_(1)
    assert not torch.equal(cache.seen, copy.seen)
    if attention == "full":  # a full-attention cache grows: copy_ needs equal shapes
        return
    # copy_ writes another cache into this one's own tensors
    fresh = model.empty_cache(2)
    kept = fresh.tensors()
    assert fresh.copy_(cache) is fresh and all(a is b for a, b in zip(fresh.tensors(), kept))
    assert all(torch.equal(a, b) for a, b in zip(fresh.tensors(), cache.tensors()))


@torch.no_grad()
def test_full_attention_reader_drops_the_reset_rows_dead_keys():
    """A full-attention cache entering a chunk keeps the longest current document's keys (its doc_offset), not the
    dead keys of rows that start a new document: with documents of one chunk each (the recall circuit) every chunk
    attends to its own keys only, where it attended to one chunk of dead keys more. The logits are the same."""
    from longtrain.data.stream import Chunk
    from longtrain.model.chunks import ChunkReader

    model = make(attention="full")
    L = 12
    tokens = torch.randint(0, 61, (4, 2, L))  # 4 chunks of 2 rows

    def chunk(i, reset, offset):
        return Chunk(tokens=tokens[i], targets=torch.full((2, L), -100), lengths=torch.full((2,), L),
                     reset=torch.tensor(reset), doc_index=torch.arange(2), doc_offset=torch.tensor(offset),
                     doc_len=torch.full((2,), 3 * L))

    # chunk 0: both rows start; chunk 1: both go on; chunk 2: row 0 starts anew, row 1 goes on; chunk 3: both start
    plan = [([True, True], [0, 0]), ([False, False], [L, L]), ([True, False], [0, 2 * L]), ([True, True], [0, 0])]
    seen_keys, logits = [], []

    def forward(c, cache):
        seen_keys.append(cache.layers[0].attn.full_k.shape[1])
        out = model(c.tokens, cache=cache, lengths=c.lengths)
        logits.append(out.logits)
        return out

    reader = ChunkReader(model.empty_cache(2), torch.device("cpu"))
    for i, (reset, offset) in enumerate(plan):
        reader.read(chunk(i, reset, offset), forward)
    assert seen_keys == [0, L, 2 * L, 0]  # chunk 2: row 1's 2L keys (row 0's dead ones go with the cut)
    # each row's logits as the same documents read without a shared cache
    whole = model(torch.cat([tokens[0], tokens[1], tokens[2]], 1)[1:]).logits[0]  # row 1: one document of 3 chunks
    assert torch.allclose(torch.cat([logits[0][1], logits[1][1], logits[2][1]]), whole, atol=1e-10)
    for i, row in ((2, 0), (3, 0), (3, 1)):  # documents of one chunk
        assert torch.allclose(logits[i][row], model(tokens[i][row:row + 1]).logits[0], atol=1e-10)
