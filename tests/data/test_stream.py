import json

import numpy as np
import pytest
import torch

from longtrain.data import IGNORE, DataError, DocumentStream, iter_valid_chunks

from .corpora import synthetic_docs

LENGTHS = [37, 5, 64, 17, 100, 9, 33, 48]


def row_reads(chunks, b):
    """The documents row b read, in order: [(doc, inputs, targets)]."""
    reads: list[tuple[int, list, list]] = []
    for c in chunks:
        n = int(c.lengths[b])
        if n == 0:
            continue
        d = int(c.doc_index[b])
        if c.reset[b]:
            reads.append((d, [], []))
        doc, inputs, targets = reads[-1]
        assert d == doc and int(c.doc_offset[b]) == len(inputs)  # exactly where the last chunk stopped
        inputs += c.tokens[b, :n].tolist()
        targets += c.targets[b, :n].tolist()
        assert (c.targets[b, n:] == IGNORE).all()
    return reads


def test_chunks_never_mix_documents_and_targets_cross_chunk_boundaries():
    docs = synthetic_docs(LENGTHS)
    stream = DocumentStream(docs, batch_rows=3, chunk_size=8, seed=1)
    chunks = [stream.next_chunk() for _ in range(40)]
    for c in chunks:
        for b in range(3):
            n = int(c.lengths[b])
            # every token of the row's chunk comes from its one document (token // 100000)
            assert set((c.tokens[b, :n] // 100_000).tolist()) == {int(c.doc_index[b])}
    for b in range(3):
        reads = row_reads(chunks, b)
        assert len(reads) > len(LENGTHS) / 3  # rows went through several documents
        for d, inputs, targets in reads[:-1]:  # the last may still be being read
            doc = docs.doc(d).tolist()
            assert inputs == doc  # each position exactly once as an input
            assert targets == doc[1:] + [IGNORE]  # next token; none after the last


def test_resume_continues_at_exactly_the_next_token():
    docs = synthetic_docs(LENGTHS)
    make = lambda: DocumentStream(docs, batch_rows=2, chunk_size=7, seed=3)  # noqa: E731
    straight = make()
    expected = [straight.next_chunk() for _ in range(60)]  # several epochs
    first = make()
    for _ in range(23):
        first.next_chunk()
    state = json.loads(json.dumps(first.state_dict()))  # small and JSON-serialisable
    resumed = make()
    resumed.load_state_dict(state)
    for want in expected[23:]:
        assert_rows_equal(resumed.next_chunk(), want, slice(None))


def test_epochs_reshuffle_deterministically_and_cover_every_document():
    docs = synthetic_docs(LENGTHS)
    a = DocumentStream(docs, batch_rows=1, chunk_size=128, seed=5)
    b = DocumentStream(docs, batch_rows=1, chunk_size=128, seed=5)
    orders = [[int(a.next_chunk().doc_index[0]) for _ in LENGTHS] for _ in range(3)]
    assert [[int(b.next_chunk().doc_index[0]) for _ in LENGTHS] for _ in range(3)] == orders
    assert all(sorted(o) == list(range(len(LENGTHS))) for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    other = DocumentStream(docs, batch_rows=1, chunk_size=128, seed=6)
    assert [int(other.next_chunk().doc_index[0]) for _ in LENGTHS] != orders[0]


FIELDS = ("tokens", "targets", "lengths", "reset", "doc_index", "doc_offset", "doc_len")


def assert_rows_equal(got, want, rows):
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)[rows]), name


@pytest.mark.parametrize("world,b", [(2, 2), (3, 1), (4, 2)])
def test_ranks_read_exactly_the_rows_of_one_process_with_all_rows(world, b):
    # 8 documents: 3 ranks (or 4 × 2 = 8 rows) do not divide them evenly, and need not.
    docs = synthetic_docs(LENGTHS)
    one = DocumentStream(docs, batch_rows=world * b, chunk_size=16, seed=2)
    ranks = [DocumentStream(docs, batch_rows=b, chunk_size=16, seed=2, rank=r, world_size=world) for r in range(world)]
    for _ in range(40):  # several epochs
        want = one.next_chunk()
        got = [s.next_chunk() for s in ranks]
        for r, chunk in enumerate(got):
            assert_rows_equal(chunk, want, slice(r * b, (r + 1) * b))  # global row g = r·b + row
            assert chunk.global_targets == want.global_targets
        assert want.global_targets == want.n_targets == sum(c.n_targets for c in got)
        assert want.global_tokens == int(want.lengths.sum()) == sum(int(c.lengths.sum()) for c in got)
    states = [s.state_dict() for s in ranks]
    assert all(st == {**one.state_dict(), "world_size": world} for st in states)  # the same on every rank


def test_a_stream_resumes_with_another_world_size_and_the_same_total_rows():
    docs = synthetic_docs(LENGTHS)
    two = [DocumentStream(docs, batch_rows=2, chunk_size=7, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(13):
        for s in two:
            s.next_chunk()
    state = json.loads(json.dumps(two[0].state_dict()))
    for world, b in ((1, 4), (4, 1)):
        resumed = [DocumentStream(docs, batch_rows=b, chunk_size=7, seed=3, rank=r, world_size=world) for r in range(world)]
        for s in resumed:
            s.load_state_dict(state)
        straight = [DocumentStream(docs, batch_rows=2, chunk_size=7, seed=3, rank=r, world_size=2) for r in range(2)]
        for s in straight:
            s.load_state_dict(state)
        for _ in range(20):
            want = torch.cat([s.next_chunk().tokens for s in straight])
            assert torch.equal(torch.cat([s.next_chunk().tokens for s in resumed]), want)
    with pytest.raises(DataError, match=r"4 rows in total \(2 ranks × 2\), this one 6 \(3 × 2\).*= 4"):
        DocumentStream(docs, batch_rows=2, chunk_size=7, seed=3, rank=0, world_size=3).load_state_dict(state)


def test_a_mismatched_resume_is_a_clear_error():
    docs = synthetic_docs([10, 10])
    with pytest.raises(DataError, match="no documents"):
        DocumentStream(docs.subset(np.arange(0)), batch_rows=1, chunk_size=4, seed=0)
    state = DocumentStream(docs, batch_rows=2, chunk_size=4, seed=0).state_dict()
    with pytest.raises(DataError, match="seed"):
        DocumentStream(docs, batch_rows=2, chunk_size=4, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="rows"):
        DocumentStream(docs, batch_rows=3, chunk_size=4, seed=0).load_state_dict(state)
    # a checkpoint of the single-process stream from before global rows (it recorded rank 0 of 1)
    old = {**state, "rank": 0, "world_size": 1}
    DocumentStream(docs, batch_rows=2, chunk_size=4, seed=0).load_state_dict(old)


def test_progress_reports_each_row_position():
    docs = synthetic_docs(LENGTHS)
    s = DocumentStream(docs, batch_rows=2, chunk_size=4, seed=0)
    c = s.next_chunk()
    p = s.progress()
    assert p["docs"] == len(LENGTHS) and p["docs_started"] == 2 and p["epoch"] == 0
    assert [r["doc"] for r in p["rows"]] == c.doc_index.tolist()
    assert [r["len"] for r in p["rows"]] == c.doc_len.tolist()
    assert [r["offset"] for r in p["rows"]] == c.lengths.tolist()


def test_valid_chunks_read_every_document_once_one_per_row():
    docs = synthetic_docs(LENGTHS)
    chunks = list(iter_valid_chunks(docs, chunk_size=16, batch_rows=3))
    n_targets = sum(c.n_targets for c in chunks)
    assert n_targets == sum(n - 1 for n in LENGTHS)
    for b in range(3):
        for d, inputs, targets in row_reads(chunks, b):
            assert inputs == docs.doc(d).tolist()
            assert targets == docs.doc(d).tolist()[1:] + [IGNORE]
    seen = {int(d) for c in chunks for d in c.doc_index if d >= 0}
    assert seen == set(range(len(LENGTHS)))
    assert list(iter_valid_chunks(docs, 16, max_docs=2))[-1].doc_index.tolist() == [1]
    assert np.all([c.tokens.shape == (3, 16) for c in chunks])


def test_valid_chunks_stop_at_max_tokens():
    docs = synthetic_docs(LENGTHS)
    chunks = list(iter_valid_chunks(docs, chunk_size=16, batch_rows=3, max_tokens=20))
    # Each document is read to min(length, 20) rounded up to whole chunks of 16: at most 2 chunks per group.
    for b in range(3):
        for d, inputs, _ in row_reads(chunks, b):
            assert inputs == docs.doc(d).tolist()[: min(len(docs.doc(d)), 32)]
    assert len(chunks) == 2 + 2 + 2  # three groups (3 + 3 + 2 documents), each cut after two chunks


def test_fewer_documents_than_rows_is_reported():
    one = DocumentStream(synthetic_docs([200]), batch_rows=3, chunk_size=16, seed=0)
    chunk = one.next_chunk()
    assert torch.equal(chunk.tokens[0], chunk.tokens[1])  # what the warning is about: rows read the same tokens
    assert "1 training document for 3 batch rows" in one.too_few_documents()
    assert "lower train.batch_docs to 1" in one.too_few_documents()
    sharded = DocumentStream(synthetic_docs([200] * 5), batch_rows=3, chunk_size=16, seed=0, rank=1, world_size=2)
    assert "5 training documents for 6 rows in total (2 ranks × 3)" in sharded.too_few_documents()
    assert DocumentStream(synthetic_docs([200] * 3), batch_rows=3, chunk_size=16, seed=0).too_few_documents() is None


@pytest.mark.parametrize("world,b", [(2, 1), (3, 2)])
def test_valid_chunks_shard_rows_across_ranks_in_lockstep(world, b):
    docs = synthetic_docs(LENGTHS)
    one = list(iter_valid_chunks(docs, chunk_size=16, batch_rows=world * b, max_tokens=40))
    per_rank = [list(iter_valid_chunks(docs, chunk_size=16, batch_rows=b, max_tokens=40, rank=r, world_size=world)) for r in range(world)]
    assert all(len(chunks) == len(one) for chunks in per_rank)  # every rank in every forward
    for i, want in enumerate(one):
        for r in range(world):
            assert_rows_equal(per_rank[r][i], want, slice(r * b, (r + 1) * b))
            assert per_rank[r][i].global_targets == want.n_targets
    assert sum(c.n_targets for chunks in per_rank for c in chunks) == sum(min(n - 1, 48) for n in LENGTHS)  # 40 rounds up to 3 chunks
