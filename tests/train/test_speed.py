"""The trainer's speed levers on a tiny run: no host sync per step, NaN still stops before a save,
precision and the KV cache's dtype across resumes, train.compile, and full attention's memory advice."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
from safetensors.torch import load_file

import longtrain.model.attention as attention_module
import longtrain.model.model as model_module
from longtrain.train.metrics import read_metrics
from longtrain.train.recipe import RecipeError, load_recipe
from longtrain.train.step_graph import shapes
from longtrain.train import summary
from longtrain.train.trainer import Trainer

from .tiny import cli, logged_steps, losses, write_corpus

FULL = ("--set", "attention.type=full", "--set", "attention.topk=0", "--set", "attention.window=0")


class SyncCounter:
    """Counts what reads a tensor back to the host (on CUDA: a sync, or a device-to-host copy).

    The step runs on CPU tensors here, so every tensor counts as a device tensor: host-side decisions
    in the step must read the host copies through numpy (on a GPU, .numpy() of a device tensor raises).
    Calls inside the attention op (its CPU scan reads back by design; on CUDA the device scan runs)
    and inside the optimizer (the CPU's for-each AdamW reads its CPU step counters; on CUDA the fused
    one runs) are not counted.
    """

    READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        self.active, self.paused, self.calls = False, 0, []
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name), name))
        monkeypatch.setattr(torch.cuda, "synchronize", self._counted(torch.cuda.synchronize, "cuda.synchronize"))
        monkeypatch.setattr(attention_module, "sparsek_attention_chunk", self._paused(attention_module.sparsek_attention_chunk))
        monkeypatch.setattr(torch.optim.AdamW, "step", self._paused(torch.optim.AdamW.step))

    def _counted(self, real, name):
        def read(*args, **kwargs):
            if self.active and not self.paused:
                where = traceback.extract_stack(limit=3)[0]
                self.calls.append(f"{name} at {where.filename.split('longtrain/')[-1]}:{where.lineno}")
            return real(*args, **kwargs)
        return read

    def _paused(self, real):
        def call(*args, **kwargs):
            self.paused += 1
            try:
                return real(*args, **kwargs)
            finally:
                self.paused -= 1
        return call


def test_a_step_reads_nothing_back_except_at_log_lines(workspace, monkeypatch):
    tmp, recipe = workspace
    r = load_recipe(recipe(steps=6, every=100), ["logging.every=3", "train.valid_every=0", "train.grad_accum=2"])
    counter, per_step = SyncCounter(monkeypatch), []
    real_step = Trainer.train_step

    def counted_step(self):
        counter.active, start = True, len(counter.calls)
        try:
            return real_step(self)
        finally:
            counter.active = False
            per_step.append(counter.calls[start:])

    monkeypatch.setattr(Trainer, "train_step", counted_step)
    result = Trainer(r, run_dir=tmp / "run").train()
    assert result.steps == 6
    # steps 3 and 6 print a log line: one read of every pending loss and gradient norm, one of the cache
    # fill, one of the selection diagnostics (a copy to the host, then a list)
    assert [len(c) for c in per_step] == [0, 0, 4, 0, 0, 4], per_step
    assert [c.split(" ")[0] for c in per_step[2]] == ["tolist", "__float__", "cpu", "tolist"], per_step[2]
    assert logged_steps(tmp / "run") == list(range(1, 7))  # every step is in metrics.jsonl


def test_nan_between_log_lines_stops_before_the_next_checkpoint(workspace, monkeypatch):
    tmp, recipe = workspace
    calls, real = {"n": 0}, model_module.linear_cross_entropy

    def poisoned(h, weight, targets, **kw):
        calls["n"] += 1
        loss = real(h, weight, targets, **kw)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(model_module, "linear_cross_entropy", poisoned)
    r = cli("fit", recipe(steps=8, every=2), "--run-dir", tmp / "nan", "--set", "logging.every=5", "--set", "train.valid_every=0")
    assert r.exit_code == 1, r.output
    assert "loss is nan at step 3" in r.output and "step-00000002" in r.output  # read back before step 4's save
    assert (tmp / "nan/checkpoints/step-00000002").is_dir() and not (tmp / "nan/checkpoints/step-00000004").exists()
    assert logged_steps(tmp / "nan") == [1, 2]  # the good steps are written


def test_precision_cache_dtype_and_loss_scaler_across_resumes(workspace, monkeypatch):
    tmp, recipe = workspace
    path, run = recipe(steps=2, every=2), tmp / "p"
    assert cli("fit", path, "--run-dir", run, "--set", "train.valid_every=0").exit_code == 0  # fp32, the CPU's default
    ckpt = lambda step: run / "checkpoints" / f"step-{step:08d}"  # noqa: E731
    assert load_file(ckpt(2) / "cache.rank00000.safetensors")["layers.0.pool_k"].dtype == torch.float32

    # an fp32 cache (as older runs saved it) resumes under fp16: cast on load; the scaler's state is saved
    fp16 = ["--set", "train.precision=fp16", "--set", "train.valid_every=0"]
    r = cli("fit", path, "--run-dir", run, "--set", "train.steps=4", *fp16)
    assert r.exit_code == 0 and "compute: fp16 autocast, KV cache in fp16, loss scaling" in r.output, r.output
    cache = load_file(ckpt(4) / "cache.rank00000.safetensors")
    assert cache["layers.0.pool_k"].dtype == cache["layers.1.tail_v"].dtype == torch.float16
    assert cache["layers.0.pool_u"].dtype == torch.float32 and cache["layers.0.thr_u"].dtype == torch.float64
    saved = json.loads((ckpt(4) / "meta.json").read_text())["grad_scaler"]
    assert set(saved) >= {"scale", "_growth_tracker"}

    seen = {}
    real_step = Trainer.train_step

    def first_step(self):
        seen.setdefault("scaler", self.scaler.state_dict())
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", first_step)
    r = cli("fit", path, "--run-dir", run, "--set", "train.steps=5", *fp16)
    assert r.exit_code == 0, r.output
    assert seen["scaler"] == saved  # the loss scale goes on where it was
    assert all(torch.isfinite(torch.tensor(list(losses(run).values()))))


def test_compiled_run_resumes_bitwise_and_matches_eager(workspace, monkeypatch):
    tmp, recipe = workspace
    monkeypatch.setenv("LONGTRAIN_COMPILE_BACKEND", "aot_eager")  # the graphs, without Inductor's slow CPU codegen
    torch._dynamo.reset()
    path = recipe(steps=4, every=2)
    on = ["--set", "train.compile=true", "--set", "train.valid_every=0"]
    r = cli("fit", path, "--run-dir", tmp / "straight", *on)
    assert r.exit_code == 0 and "compiled around the attention op" in r.output, r.output
    assert cli("fit", path, "--run-dir", tmp / "resumed", "--set", "train.steps=2", *on).exit_code == 0
    assert cli("fit", path, "--run-dir", tmp / "resumed", *on).exit_code == 0
    a, b = (load_file(tmp / d / "checkpoints/step-00000004/model.safetensors") for d in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert cli("fit", path, "--run-dir", tmp / "eager", "--set", "train.valid_every=0").exit_code == 0
    compiled, eager = losses(tmp / "straight"), losses(tmp / "eager")
    assert all(abs(compiled[s] - eager[s]) <= 1e-4 * eager[s] for s in eager)


def test_full_attention_is_refused_before_and_explains_out_of_memory(workspace, monkeypatch):
    tmp, recipe = workspace
    path = recipe(steps=4, every=100)
    monkeypatch.setenv("LONGTRAIN_DEVICE_MEMORY", "1MiB")
    for dry_run in (("--dry-run",), ()):  # issue 31: refused before training, the dry run alike; nothing written
        r = cli("fit", path, "--run-dir", tmp / "oom", *dry_run, *FULL)
        assert r.exit_code == 1, r.output
        assert "error: this run needs about" in r.output and "has 1 MiB" in r.output
        assert "train.chunk_size" in r.output and "attention.max_context" in r.output and "sparsek+sw" in r.output
        assert not (tmp / "oom").exists()
    monkeypatch.delenv("LONGTRAIN_DEVICE_MEMORY")

    def out_of_memory(self):
        if self.state.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self)

    real = Trainer.optimizer_step
    monkeypatch.setattr(Trainer, "optimizer_step", out_of_memory)
    r = cli("fit", path, "--run-dir", tmp / "oom", "--set", "checkpoint.every=1", *FULL)
    assert r.exit_code == 1
    assert "out of memory at step 2" in r.output and "Tried to allocate 20.00 GiB" in r.output, r.output
    assert "--set train.chunk_size=24" in r.output and "attention.max_context" in r.output
    assert "step-00000001" in r.output and "Traceback" not in r.output


def test_full_attention_cache_is_cut_to_the_longest_document_and_max_context(workspace):
    tmp, recipe = workspace
    write_corpus(tmp / "short", n_docs=6, words=150)  # documents of a few hundred tokens: rows move on
    for cap in (None, 40):
        sets = [f"attention.{k}" for k in ("type=full", "topk=0", "window=0")]
        sets += [f"data.path={tmp / 'short'}", "train.valid_every=0", "logging.every=10", "data.valid=null", "data.min_doc_tokens=50"]
        sets += [f"attention.max_context={cap}"] if cap else []
        t = Trainer(load_recipe(recipe(steps=12, every=100), sets), run_dir=tmp / f"full-{cap}")
        t.train()
        keys = t.reader.cache.layers[0].attn.full_k.shape[1]
        positions = read_metrics(tmp / f"full-{cap}" / "metrics.jsonl")[-1]["doc_positions"]
        assert max(positions) < 12 * 48  # the rows went on to other documents
        assert keys == (cap - 1 if cap else max(positions)), (keys, positions)


def test_recipe_refuses_max_context_without_full_attention_and_fp16_with_fsdp(workspace):
    tmp, recipe = workspace
    with pytest.raises(RecipeError, match="max_context caps full attention"):
        load_recipe(recipe(), ["attention.max_context=64"])
    with pytest.raises(RecipeError, match="fp16 is not supported with train.parallel fsdp"):
        load_recipe(recipe(), ["train.precision=fp16", "train.parallel=fsdp"])


def test_cuda_graphs_are_used_where_a_run_allows_them(workspace, monkeypatch):
    """The reasons a run trains without CUDA graphs, as its summary line states them (CUDA pretended:
    the decision reads the recipe and the device type only; the graphs themselves: tests/gpu)."""
    tmp, recipe = workspace
    path = recipe()

    def unusable(*overrides):
        return Trainer(load_recipe(path, list(overrides)), run_dir=tmp / "r").graph_unusable()

    assert unusable() == "not on CUDA"
    monkeypatch.setattr(Trainer, "device_type", lambda self: "cuda")
    assert unusable() is None
    assert "false" in unusable("train.cuda_graphs=false")
    full = ("attention.type=full", "attention.topk=0", "attention.window=0")
    assert unusable(*full) is None  # chunks from an empty cache replay (tests/gpu: documents of one chunk)
    assert "start every row's document" in summary.graph_note(Trainer(load_recipe(path, list(full)), run_dir=tmp / "r"))
    assert unusable("attention.type=sparsek+linear+sw") is None  # issue 38: replayed like eager on an H100 (tests/gpu)
    assert "dropout" in unusable("model.dropout=0.1")
    assert "fp16" in unusable("train.precision=fp16")
    assert "freeze" in unusable("train.freeze.steps=2")
    t = Trainer(load_recipe(path, []), run_dir=tmp / "r")
    assert t.compiles and "one CUDA graph per chunk" in summary.graph_note(t)  # both on by default on CUDA
    assert not Trainer(load_recipe(path, ["train.compile=false"]), run_dir=tmp / "r").compiles


class StandInGraph:
    """ChunkGraph's interface around the eager pass (CUDA graphs need a GPU; tests/gpu replays real ones):
    checks when the trainer captures and that its gradients, kept and zeroed in place, add up as eager ones."""

    built: list[int] = []

    def __init__(self, chunk_pass, inputs, cache, params):
        StandInGraph.built.append(len(params))
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.params, self.grads, self.chunk_pass = params, [p.grad for p in params], chunk_pass
        self.cache_shapes, self.replays = shapes(cache), 0

    def fits(self, inputs, cache):
        return shapes(cache) == self.cache_shapes

    def __call__(self, inputs, cache):
        assert all(p.grad is g for p, g in zip(self.params, self.grads))  # never freed between steps
        self.replays += 1
        return self.chunk_pass(inputs, cache)


def test_trainer_captures_at_its_second_step_and_falls_back_if_the_capture_fails(workspace, monkeypatch):
    import longtrain.train.trainer as trainer_module

    tmp, recipe = workspace
    path = recipe(steps=4, every=2)
    common = ["--set", "train.grad_accum=2", "--set", "train.valid_every=0"]
    assert cli("fit", path, "--run-dir", tmp / "eager", *common).exit_code == 0

    monkeypatch.setattr(Trainer, "graph_unusable", lambda self: None)  # as on CUDA
    monkeypatch.setattr(trainer_module, "ChunkGraph", StandInGraph)
    StandInGraph.built = []
    r = cli("fit", path, "--run-dir", tmp / "graph", *common)
    assert r.exit_code == 0, r.output
    assert len(StandInGraph.built) == 1 and StandInGraph.built[0] > 0  # captured once, with every parameter
    assert losses(tmp / "graph") == losses(tmp / "eager")

    def broken(self, *args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StandInGraph, "__init__", broken)
    r = cli("fit", path, "--run-dir", tmp / "fallback", *common)
    assert r.exit_code == 0 and "training without CUDA graphs: its capture failed" in r.output, r.output
    assert losses(tmp / "fallback") == losses(tmp / "eager")


def test_full_attention_is_captured_from_an_empty_cache_and_replayed_for_documents_of_one_chunk(workspace, monkeypatch):
    """Full attention's cache grows: the trainer captures its chunk pass only from an empty cache and replays it
    for chunks whose cache has the captured shapes. With documents of one chunk (the recall circuit's) that is every
    chunk after the capture, since ChunkReader drops the reset rows' keys; with longer documents no chunk of a
    step's start ever comes empty here, so nothing is captured."""
    import longtrain.train.trainer as trainer_module

    tmp, recipe = workspace
    monkeypatch.setattr(Trainer, "graph_unusable", lambda self: None)  # as on CUDA
    monkeypatch.setattr(trainer_module, "ChunkGraph", StandInGraph)
    full = ["attention.type=full", "attention.topk=0", "attention.window=0", "train.valid_every=0"]
    one_chunk = ["data.source=recall", "data.recall.docs=120", "data.recall.doc_tokens=96", "data.recall.facts=2",
                 "data.recall.min_distance=10", "data.recall.max_distance=40", "train.chunk_size=96", "data.valid=0.05"]
    StandInGraph.built = []
    t = Trainer(load_recipe(recipe(steps=6, every=100), full + one_chunk), run_dir=tmp / "one-chunk")
    t.train()
    assert len(StandInGraph.built) == 1 and t.chunk_graph.replays == 5  # captured at step 2, steps 2..6 replayed

    StandInGraph.built = []
    t = Trainer(load_recipe(recipe(steps=6, every=100), full), run_dir=tmp / "long-docs")  # documents of many chunks
    t.train()
    assert StandInGraph.built == [] and t.chunk_graph is None
