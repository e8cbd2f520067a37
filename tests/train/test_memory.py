"""The training-memory estimate counts what the linear attention types' naive core keeps for the backward."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longtrain.train import memory
from longtrain.train.recipe import load_recipe

from .tiny import cli, run_cli, workspace, write_corpus  # noqa: F401  (workspace: the tiny-run fixture)

REPO = Path(__file__).resolve().parents[2]


def test_linear_types_add_the_naive_core_activations():
    def estimate(kind, backend):
        r = load_recipe("quickstart", [f"attention.type={kind}", "attention.topk=64", "attention.window=64",
                                       f"attention.backend={backend}"])
        return r, memory.estimate_training_bytes(r, n_params=10**6, vocab_size=2048, position=4096,
                                                 compute_dtype=torch.float32)

    r, plain = estimate("sparsek+sw", "naive")
    _, linear = estimate("sparsek+linear+sw", "naive")
    m, t = r.model, r.train
    per_query = m.heads * (64 + 64 + 63) * 48
    assert abs(linear - plain - memory.FRAGMENTATION * m.layers * t.batch_docs * t.chunk_size * per_query) <= 1
    # issue 38: the Triton core (CUDA, backend triton) keeps per-query tensors, no scores
    _, plain = estimate("sparsek+sw", "triton")
    _, linear = estimate("sparsek+linear+sw", "triton")
    assert 0 < linear - plain < memory.FRAGMENTATION * m.layers * t.batch_docs * t.chunk_size * per_query / 4


def test_a_deterministic_run_adds_the_linear_triton_cores_scratch():
    """train.deterministic: the linear types' Triton core sums the keys' gradients through a scratch (one layer's at
    a time, a slab of query tiles): the estimate adds it once, bounded by linear_triton.SCRATCH_BYTES."""
    from longtrain.ops.sparsek_attention import linear_triton

    def estimate(*sets):
        r = load_recipe("quickstart", ["attention.type=sparsek+linear+sw", "attention.topk=64", "attention.window=64",
                                       "attention.backend=triton", *sets])
        return r, memory.estimate_training_bytes(r, n_params=10**6, vocab_size=2048, position=4096,
                                                 compute_dtype=torch.float32)

    r, fast = estimate()
    _, det = estimate("train.deterministic=true")
    m, t = r.model, r.train
    D = m.d_model // m.heads
    scratch = memory.linear_triton_scratch_bytes(t.batch_docs, t.chunk_size, m.heads, 64 + 64 + 63, D)
    assert 0 < scratch <= linear_triton.SCRATCH_BYTES * 1.01
    assert abs(det - fast - memory.FRAGMENTATION * scratch) <= 1
    assert estimate("attention.backend=naive", "train.deterministic=true")[1] == estimate("attention.backend=naive")[1]  # none
    assert estimate("attention.backend=auto", "train.deterministic=true")[1] == det  # auto runs the Triton core on CUDA


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



def test_the_advice_names_the_triton_core_first_when_a_linear_type_runs_the_naive_one_on_a_gpu():
    for det in (False, True):  # train.deterministic runs the Triton core too: nothing else to switch
        r = load_recipe("quickstart", ["attention.type=sparsek+linear+sw", f"train.deterministic={str(det).lower()}"])
        tip = memory.advice(r, naive_linear_core=True)
        assert tip.startswith("--set attention.backend=triton ("), tip
        assert "train.deterministic" not in tip
        assert "attention.backend" not in memory.advice(r)  # the Triton core already, or the CPU: nothing to switch
    plain = load_recipe("quickstart", [])
    assert "attention.backend" not in memory.advice(plain, naive_linear_core=True)  # no linear part


MEASURED_RECIPE = """
model: {{style: gpt2, layers: 2, d_model: 64, heads: 8, mlp_ratio: 2.0}}
attention: {{type: sparsek+sw, topk: 512, window: 64}}
data: {{source: files, path: {corpus}, min_doc_tokens: 300, valid: null}}
tokenizer: {{vocab_size: 320}}
train: {{steps: 5, chunk_size: 512, batch_docs: 1, lr: 3.0e-3, warmup_steps: 2, seed: 3, device: cpu, valid_every: 0}}
checkpoint: {{every: 100, keep: 1}}
logging: {{every: 1, progress: false}}
"""


@pytest.mark.slow
def test_the_cpu_estimate_is_within_one_and_a_half_times_the_measured_peak(tmp_path):
    """Issue 31: topk = 100,000 was estimated at 5.4 GiB and took 24 GB (the naive core's scores were not
    counted). A short fit at three pool and batch sizes (5 chunks of 512: the pool fills), in a subprocess: the peak
    resident memory it adds from before the model is built, beside the trainer's estimate."""
    write_corpus(tmp_path / "corpus", n_docs=3, words=3500)
    recipe = tmp_path / "measured.yaml"
    recipe.write_text(MEASURED_RECIPE.format(corpus=tmp_path / "corpus"))
    out = tmp_path / "memory.json"
    sizes = ["attention.topk=256", "attention.topk=1024", "attention.topk=2048 train.batch_docs=2"]
    cmd = [sys.executable, str(REPO / "benchmarks/memory_estimate.py"), str(recipe), "--steps", "5", "--out", str(out)]
    env = dict(os.environ, LONGTRAIN_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    run = subprocess.run([*cmd, *(x for s in sizes for x in ("--size", s))], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    results = json.loads(out.read_text()) if out.exists() else run.stdout + run.stderr
    assert [r["sets"] for r in results] == [s.split() for s in sizes], results
    for r in results:
        assert r["peak_bytes"] > 100 * 2**20 * (r["sets"] != [sizes[0]]), r  # the scores dominate what is measured
        assert 1 / 1.5 <= r["ratio"] <= 1.5, r


def test_a_pool_too_large_for_the_machine_is_refused_before_training(workspace, monkeypatch):
    """Issue 31: attention.topk = 100,000 on the CPU was estimated at 5.4 GiB, took 24 GB and was killed by
    the OS (a stale lock, empty metrics). Now its estimate counts the naive core's scores and a run that
    does not fit is refused before it writes anything, naming what to change."""
    tmp, recipe = workspace
    path = recipe(steps=2, every=100)
    r = cli("fit", path, "--run-dir", tmp / "r", "--dry-run")
    assert "for training on top of the" in r.output and "this process holds" in r.output, r.output
    monkeypatch.setenv("LONGTRAIN_DEVICE_MEMORY", "1GiB")
    for dry_run in (("--dry-run",), ()):
        r = cli("fit", path, "--run-dir", tmp / "r", "--set", "attention.topk=100000", *dry_run)
        assert r.exit_code == 1 and "error: this run needs about" in r.output and "has 1.0 GiB" in r.output, r.output
        assert "a smaller attention.topk or attention.window (now 100000 and 8" in r.output
        assert not (tmp / "r").exists()


def test_the_summary_total_is_what_the_progress_line_shows(workspace):
    """Issue 31: quickstart's summary said 110 MiB where its progress line showed ~890 MiB (the process's
    resident memory). On the CPU the total now counts what the process holds, with the libraries a
    training step pages in; a fresh process (the CLI as a user runs it)."""
    tmp, recipe = workspace
    r = run_cli("fit", recipe(steps=3, every=100), "--run-dir", tmp / "r")
    assert r.returncode == 0, r.stdout + r.stderr
    [total] = re.findall(r"^memory: about ([0-9.]+) (MiB|GiB)", r.stdout, re.M)
    shown = re.findall(r"\| mem ([0-9.]+) (MiB|GiB)", r.stdout)
    mib = {"MiB": 1, "GiB": 1024}
    estimate, peak = float(total[0]) * mib[total[1]], max(float(v) * mib[u] for v, u in shown)
    assert 1 / 1.5 <= estimate / peak <= 1.5, (estimate, peak, r.stdout)
