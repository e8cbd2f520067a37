"""A chunk call on the device-scan path makes no host synchronisation (selection, attention, next cache).

On CUDA every layer of every chunk would otherwise stall the host until the GPU drains its queue. The CPU
cannot observe a real sync, so `HostSyncs` records every call that would make one on CUDA: a tensor read
into Python (item, bool, int, float, tolist, numpy, cpu, .to("cpu")), an op whose output size depends
on the data (nonzero, masked_select, unique, boolean-mask indexing), a tensor built from host data
(torch.tensor, from_numpy) and torch.cuda's synchronize calls. Work inside a Triton kernel launch is left
out: under TRITON_INTERPRET the interpreter itself copies the arguments to numpy and back.
tests/gpu/test_kernels_gpu.py runs the same call under torch.cuda.set_sync_debug_mode("error") on a GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

triton = pytest.importorskip("triton")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from longtrain.ops.sparsek_attention import SparseKCache, sparsek_attention_chunk  # noqa: E402

aten = torch.ops.aten
DATA_DEPENDENT = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique, aten._unique2,
                  aten.unique_dim, aten.unique_consecutive, aten.equal, aten.is_nonzero, aten.allclose,
                  aten.repeat_interleave, aten.lift_fresh}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSyncs(TorchDispatchMode):
    """Records (in .calls) what would synchronise the host with a CUDA device while it is active."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.calls: list[str] = []
        self.active = False
        self._in_kernel = 0
        for name in ("item", "tolist", "numpy", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, self._recording(getattr(torch.Tensor, name), f"Tensor.{name}"))
        to = torch.Tensor.to

        def to_host(t, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, str) and target.startswith("cpu"):
                self._record('Tensor.to("cpu")')
            return to(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", to_host)
        for owner, name in ((torch, "from_numpy"), (torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                            (torch.cuda.Event, "synchronize")):
            monkeypatch.setattr(owner, name, self._recording(getattr(owner, name), f"{owner.__name__}.{name}"))
        # A kernel launch under the interpreter: its own copies are not the op's.
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def launch(fn, *args, **kwargs):
            self._in_kernel += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._in_kernel -= 1

        monkeypatch.setattr(InterpretedFunction, "run", launch)

    def _record(self, what: str) -> None:
        if self.active and self._in_kernel == 0:
            self.calls.append(what)

    def _recording(self, fn, what):
        def wrapper(*args, **kwargs):
            self._record(what)
            return fn(*args, **kwargs)

        return wrapper

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in DATA_DEPENDENT:
            self._record(str(func))
        elif func.overloadpacket in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                self._record(f"{func} with a boolean mask")
        return func(*args, **kwargs)


def chunk_call(scan: str, backend: str = "triton"):
    """A second chunk (the cache holds a pool, a tail and a threshold state), forward and backward."""
    torch.manual_seed(0)
    B, L, H, Hkv, D, k, w = 2, 24, 2, 1, 16, 5, 4
    q, kk, v = (torch.randn(B, 2 * L, h, D, requires_grad=True) for h in (H, Hkv, Hkv))
    u = torch.randn(B, 2 * L, requires_grad=True)
    cache = SparseKCache.empty(B, k, w, Hkv, D)
    kw = dict(scan=scan, backend=backend, block=16, lengths=torch.tensor([L, L - 5]))
    _, cache, _ = sparsek_attention_chunk(q[:, :L], kk[:, :L], v[:, :L], u[:, :L], cache, **kw)

    def second():
        o, nxt, sel = sparsek_attention_chunk(q[:, L:], kk[:, L:], v[:, L:], u[:, L:], cache, **kw)
        o.square().sum().backward()
        return nxt, sel

    return second


@pytest.mark.parametrize("sync", [
    lambda x: x.sum().item(), lambda x: bool(x[0] > 0), lambda x: float(x.max()), lambda x: x[x > 0],
    lambda x: x.tolist(), lambda x: x.numpy(), lambda x: x.cpu(), lambda x: x.to("cpu", torch.float64),
    lambda x: torch.tensor([1, 2]), lambda x: x.nonzero(), lambda x: x.unique(),
])
def test_the_detector_sees_each_kind_of_sync(sync, monkeypatch):
    x = torch.randn(6)
    with HostSyncs(monkeypatch) as syncs:
        sync(x)
    assert syncs.calls
    with HostSyncs(monkeypatch) as quiet:
        (x * 2).cumsum(0).sort()[1].gather(0, torch.arange(3)).to(x.device)  # device work alone
    assert quiet.calls == []


def test_host_scan_path_is_seen_to_sync(monkeypatch):
    """The detector is not blind on the op: the CPU heap scan copies the scores and state to the host."""
    second = chunk_call(scan="host")
    with HostSyncs(monkeypatch) as syncs:
        second()
    assert any("numpy" in c for c in syncs.calls), syncs.calls


def test_device_scan_chunk_call_makes_no_host_sync(monkeypatch):
    second = chunk_call(scan="device")
    with HostSyncs(monkeypatch) as syncs:
        nxt, sel = second()
    assert syncs.calls == []
    assert nxt.seen.tolist() == [48, 38] and sel.fingerprint.shape == (2, 24)  # the call did run


@pytest.mark.parametrize("backend,topk", [("naive", 5), ("triton", 5), ("triton", 0)])
def test_linear_types_chunk_call_makes_no_host_sync(monkeypatch, backend, topk):
    """Issue 38: the linear types' chunk call too (its state update once set a mask from a host scalar: 24 syncs
    a step at 12 layers on the H100, and a copy no CUDA graph can capture)."""
    from longtrain.ops.sparsek_attention.linear import SparseKLinearCache, sparsek_linear_attention_chunk

    torch.manual_seed(0)
    B, L, H, Hkv, D, w = 2, 24, 2, 1, 16, 4
    q, kk, v = (torch.randn(B, 2 * L, h, D, requires_grad=True) for h in (H, Hkv, Hkv))
    u = torch.randn(B, 2 * L, requires_grad=True)
    phi = torch.eye(D).expand(Hkv, D, D).clone().requires_grad_()
    cache = SparseKLinearCache.empty(B, topk, w, Hkv, D, features=D)
    kw = dict(scan="device", backend=backend, block=16, lengths=torch.tensor([L, L - 5]))
    _, cache, _ = sparsek_linear_attention_chunk(q[:, :L], kk[:, :L], v[:, :L], u[:, :L], phi, cache, **kw)
    with HostSyncs(monkeypatch) as syncs:
        o, nxt, _ = sparsek_linear_attention_chunk(q[:, L:], kk[:, L:], v[:, L:], u[:, L:], phi, cache, **kw)
        o.square().sum().backward()
    assert syncs.calls == []
    assert nxt.seen.tolist() == [48, 38] and phi.grad is not None  # the call did run
