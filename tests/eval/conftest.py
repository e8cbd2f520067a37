"""Tiny real checkpoints for the eval and generate tests: a generated corpus, a BPE trained on it, random weights."""

import random
from pathlib import Path

import pytest
import torch

from longtrain.data.tokenizer import train_bpe
from longtrain.model import LM, LMConfig
from longtrain.train.checkpoint import CheckpointManager
from longtrain.train.checkpoint import checkpoint_files
from longtrain.train.recipe import load_recipe

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have "
    "river house letter morning captain garden window silence evening mountain quiet ship coffee wander"
).split()
ATTENTION = {
    "sparsek": ["attention.type=sparsek+sw", "attention.topk=8", "attention.window=8"],
    "sw": ["attention.type=sw", "attention.topk=null", "attention.window=16"],
    "full": ["attention.type=full", "attention.topk=null", "attention.window=null"],
}


def write_corpus(folder: Path, n_docs: int = 6, words: int = 900) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        rng = random.Random(d)
        (folder / f"doc{d}.txt").write_text(" ".join(rng.choice(WORDS) + ("." if rng.random() < 0.1 else "") for _ in range(words)))
    return folder


def make_checkpoint(run: Path, corpus: Path, tokenizer, attention: str, *, step: int = 5, seed: int = 0) -> Path:
    """A run dir with one real, self-contained checkpoint of a random 2 x 32 model."""
    recipe = load_recipe("quickstart", [
        "model.layers=2", "model.d_model=32", "model.heads=2", "model.mlp_ratio=2.0", *ATTENTION[attention],
        "data.source=files", f"data.path={corpus}", "data.min_doc_tokens=100", "data.valid=0.34",
        "tokenizer.vocab_size=300", "train.chunk_size=64", "train.batch_docs=2", "train.device=cpu",
    ])
    torch.manual_seed(seed)
    model = LM(LMConfig.from_recipe(recipe.model, recipe.attention, vocab_size=tokenizer.get_vocab_size()))
    return CheckpointManager(run, keep=2).save(
        step, tensors={"model": model.state_dict()}, meta={"step": step}, files=checkpoint_files(recipe, tokenizer)
    )


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "books")


@pytest.fixture(scope="session")
def tokenizer(corpus):
    return train_bpe([p.read_text() for p in sorted(corpus.glob("*.txt"))], 300)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, corpus, tokenizer) -> dict[str, Path]:
    """Run dirs by attention type: sparsek (k = w = 8), its sw twin (w = 16) and full attention."""
    root = tmp_path_factory.mktemp("runs")
    return {name: make_checkpoint(root / name, corpus, tokenizer, name, seed=i).parent.parent for i, name in enumerate(ATTENTION)}


@pytest.fixture(autouse=True)
def token_cache(tmp_path_factory, monkeypatch):
    """One token cache for the session's tests, never the user's."""
    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "token-cache"))


@pytest.fixture
def earlier_chunks_alive(monkeypatch):
    """watch(model) -> a list that gets, at every `model.hidden` call, how many earlier calls' hidden states are
    still alive: all 0 when a chunked reader frees each chunk's activations before the next chunk runs."""
    import weakref

    def watch(model) -> list[int]:
        hidden, alive_at_call, previous = model.hidden, [], []

        def watched(*args, **kwargs):
            alive_at_call.append(sum(r() is not None for r in previous))
            out = hidden(*args, **kwargs)
            previous.append(weakref.ref(out.hidden))
            return out

        monkeypatch.setattr(model, "hidden", watched)
        return alive_at_call

    return watch
