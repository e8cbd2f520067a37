"""Several ranks on GPUs (skipped without CUDA): FSDP with fit's defaults (compiled blocks) trains, and ddp
ranks replay their chunks from CUDA graphs and train as one process with all the rows (train.deterministic).

Each run is a real `torchrun` with NCCL over the GPUs there are (one rank per GPU, at most 2; FSDP on
one GPU runs as a world of one without torchrun)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.train.tiny import write_corpus

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

RECIPE = """
model: {{style: llama, layers: 2, d_model: 64, heads: 2, vocab_size: 320}}
attention: {{type: sparsek+sw, topk: 8, window: 16}}
data: {{source: files, path: {corpus}, min_doc_tokens: 300, valid: 0.2}}
tokenizer: {{vocab_size: 320}}
train: {{steps: 6, chunk_size: 96, batch_docs: {rows}, lr: 3.0e-3, warmup_steps: 2, seed: 3, device: cuda,
         deterministic: true}}
checkpoint: {{every: 6, keep: 1}}
logging: {{every: 1, progress: false}}
"""
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def fit(tmp_path, name, ranks, rows, *sets):
    path = tmp_path / f"{name}.yaml"
    path.write_text(RECIPE.format(corpus=tmp_path / "corpus", rows=rows))
    args = ["fit", str(path), "--run-dir", str(tmp_path / name), *[a for s in sets for a in ("--set", s)]]
    launch = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    env = dict(os.environ, **NO_MULTICAST, LONGTRAIN_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([*launch, "-m", "longtrain.cli", *args], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    metrics = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return r.stdout, {m["step"]: m["loss"] for m in metrics}


def test_fsdp_with_compiled_blocks_trains_as_one_process(tmp_path):
    """On one GPU FSDP runs as a single rank: the compiled blocks' wrapping still runs."""
    write_corpus(tmp_path / "corpus", n_docs=8)
    ranks = min(2, torch.cuda.device_count())
    _, one = fit(tmp_path, "one", 1, 4)
    out, fsdp = fit(tmp_path, "fsdp", ranks, 4 // ranks, "train.parallel=fsdp")
    assert "compiled around the attention op" in out
    assert all(abs(one[s] - fsdp[s]) <= 2e-2 * one[s] for s in one)  # bf16 rounding, sharded sums


def test_ddp_with_graphs_trains_as_one_process(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("ddp needs two GPUs (this machine has one)")
    write_corpus(tmp_path / "corpus", n_docs=8)
    _, one = fit(tmp_path, "one", 1, 4)
    out, ddp = fit(tmp_path, "ddp", 2, 2)
    assert "one CUDA graph per chunk" in out
    assert all(abs(one[s] - ddp[s]) <= 2e-2 * one[s] for s in one)
