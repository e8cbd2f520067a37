"""The compiled scan against the plain-Python reference: same result on every query, any chunking."""

import numpy as np
import pytest
import torch

from longtrain.ops.selection import SelectionState, lay_out_scores, next_state
from longtrain.ops.selection.host import scan_chunk_host
from longtrain.ops.selection.naive import scan_chunk_naive


def run(scan, u, k, w, chunk, cap, block):
    """Scan rows of u chunk by chunk, the op's way: the carried state, then the chunk's scores."""
    B, T = u.shape
    state, out = SelectionState.empty(B, k, w, score_dtype=u.dtype, cap=cap), []
    for s in range(0, T, chunk):
        keys = lay_out_scores(state, u[:, s: s + chunk])
        r = scan(keys, state, window=w, block=block)
        state = next_state(state, keys, r)
        out.append(r)
    return out, state


def rows_of_threshold_state(t):
    """Per row: the saturated and the fractional scores (as sets: the heaps' orders differ), tau, sum, overflow."""
    rows = []
    for b in range(t.thr_u.shape[0]):
        n = int(t.thr_count[b])
        vals, sat = t.thr_u[b, :n], t.thr_saturated[b, :n]
        rows.append((sorted(vals[sat].tolist()), sorted(vals[~sat].tolist()), float(t.tau[b]), float(t.thr_sum[b]),
                     int(t.overflow[b])))
    return rows


@pytest.mark.parametrize("k,w,chunk,cap,block", [
    (8, 5, 1000, 1024, 16), (8, 0, 37, 1024, 16), (0, 6, 50, 1024, 8), (30, 3, 64, 1024, 64),
    (5, 2, 13, 7, 4),  # a cap small enough to overflow: the approximation must match too
    (200, 10, 300, 1600, 64),  # k larger than most candidate sets
])
def test_compiled_scan_equals_python_reference(k, w, chunk, cap, block):
    rng = np.random.default_rng(k * 31 + w)
    u = rng.normal(size=(3, 700)) * rng.choice([0.3, 2.0]) + np.arange(700) * 1e-3
    u[:, 100:120] = 1.0  # exact ties
    u = torch.from_numpy(u)
    ref, ref_state = run(scan_chunk_naive, u, k, w, chunk, cap, block)
    got, got_state = run(scan_chunk_host, u, k, w, chunk, cap, block)
    for a, b in zip(ref, got):
        for name in ("theta_u", "theta_pos", "tau", "n_active", "fingerprint", "block_pool", "final_pool"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name  # the same pool slots too
        assert rows_of_threshold_state(a.threshold) == rows_of_threshold_state(b.threshold)
    for name in ("pool_u", "pool_pos", "tail_u", "seen", "thr_count"):
        assert torch.equal(getattr(ref_state, name), getattr(got_state, name)), name
    if cap == 7:
        assert got_state.overflowed


@pytest.mark.parametrize("lengths", [[300, 300], [300, 170]])
def test_scans_keep_each_key_in_one_slot(lengths):
    """The block pools come in stable slots (the kernels' backward walks them slot by slot)."""
    B, T, K, G = 2, 300, 12, 16
    u = torch.from_numpy(np.random.default_rng(0).normal(size=(B, T)) + np.arange(T) * 3e-3)
    state = SelectionState.empty(B, K, 5, score_dtype=u.dtype)
    keys = lay_out_scores(state, u, torch.tensor(lengths))
    bp = scan_chunk_naive(keys, state, window=5, block=G).block_pool
    sp = scan_chunk_host(keys, state, window=5, block=G).block_pool
    assert torch.equal(sp, bp)  # the compiled scan hands out the same slots
    for b in range(B):
        slot_of = {}
        for t in range(bp.shape[1]):
            for s, e in enumerate(sp[b, t].tolist()):
                if e >= 0:
                    assert slot_of.setdefault(e, s) == s  # never moves
        assert len(slot_of) > K  # keys did leave and enter: slots were reused


def test_the_next_state_holds_none_of_the_scans_chunk_sized_buffer():
    """Issue 33: the device scan hands back its outputs as views of one buffer (ScanResult.clone); the next state
    copies the threshold state out, so a cache does not keep the chunk's per-query outputs and block pools alive
    (a long prefill's peak held a second chunk's worth of them per layer)."""
    u = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 600)))
    state = SelectionState.empty(2, 16, 8, score_dtype=u.dtype, cap=256)
    keys = lay_out_scores(state, u)
    scan = scan_chunk_host(keys, state, window=8, block=16).clone()  # one buffer, as the device scan returns
    buffer = scan.fingerprint.untyped_storage().data_ptr()
    assert scan.threshold.thr_u.untyped_storage().data_ptr() == buffer  # the views the state used to keep
    nxt = next_state(state, keys, scan)
    for name, t in nxt.tensors().items():
        assert t.untyped_storage().data_ptr() != buffer, name
        assert t.untyped_storage().nbytes() < scan.fingerprint.untyped_storage().nbytes(), name
    for name, t in scan.threshold.tensors().items():
        assert torch.equal(getattr(nxt, name), t), name
