"""A tiny real `longtrain fit` setup (generated corpus, 2-layer model) shared by the trainer and CLI tests."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.train.metrics import read_metrics

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have "
    "an they you were her all she there would their we him been has when who will more no if out so said "
    "river house letter morning captain garden window silence evening mountain quiet ship coffee wander"
).split()


def write_corpus(folder: Path, n_docs: int = 5, words: int = 3500) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        rng = random.Random(d)
        text = " ".join(rng.choice(WORDS) + ("." if rng.random() < 0.08 else "") for _ in range(words))
        (folder / f"doc{d}.txt").write_text(text)


RECIPE = """
model: {{style: gpt2, layers: 2, d_model: 32, heads: 2, mlp_ratio: 2.0}}
attention: {{type: sparsek+sw, topk: 8, window: 8}}
data: {{source: files, path: {corpus}, min_doc_tokens: 300, valid: 0.2}}
tokenizer: {{vocab_size: 320}}
train: {{steps: {steps}, chunk_size: 48, batch_docs: 2, lr: 3.0e-3, warmup_steps: 2, seed: 3, device: cpu,
         valid_every: 4, valid_docs: 1, valid_tokens: 96}}
checkpoint: {{every: {every}, keep: 3}}
logging: {{every: 1, progress: false}}
"""


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """(tmp_path, recipe(steps, every, name) -> path of a tiny recipe over a generated corpus)."""
    write_corpus(tmp_path / "corpus")
    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path / "cache"))

    def recipe(steps=10, every=4, name="tiny"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(RECIPE.format(corpus=tmp_path / "corpus", steps=steps, every=every))
        return path

    return tmp_path, recipe


def cli(*args):
    """`longtrain ARGS` in this process (typer's CliRunner); output is not a terminal."""
    return CliRunner().invoke(app, [str(a) for a in args])


def cli_command(*args) -> list[str]:
    return [sys.executable, "-m", "longtrain.cli", *map(str, args)]


def run_cli(*args, env_extra=None):
    """`longtrain ARGS` as a real subprocess."""
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(cli_command(*args), env=env, capture_output=True, text=True, timeout=600)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def logged_steps(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl's step records in file order (a resumed run's repeats would show, unlike in losses)."""
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
