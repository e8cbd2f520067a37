"""The exported remote code runs SparseK in transformers: logits equal longtrain's, generate() works."""

import json

import pytest
import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.train.checkpoint import load_checkpoint
from tests.interop import hf_models as hf

runner = CliRunner()


def cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


CASES = {
    # a Llama with mimic scores, shared scoring vector, hard keys / soft values
    "llama-sparsek+sw": (lambda: hf.llama(), ["--topk", 5, "--window", 4]),
    # Qwen2 (q/k/v biases, tied head) with yarn RoPE, one scoring vector per KV head, soft keys and values
    "qwen2-per-kv-head-yarn": (
        lambda: hf.qwen2(max_position_embeddings=32, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 8000.0}),
        ["--topk", 3, "--window", 3, "--score-groups", "per_kv_head", "--score-init", "random"],
    ),
    "mistral-sparsek": (lambda: hf.mistral(), ["--attention", "sparsek", "--topk", 6]),
    "llama-sw": (lambda: hf.llama(), ["--attention", "sw", "--window", 7]),
    # GPT-NeoX layout: fused q/k/v, a quarter of each head rotated, parallel residual; and sequential with a tied head
    "gpt_neox-sparsek+sw": (lambda: hf.gpt_neox(), ["--topk", 5, "--window", 4]),
    "gpt_neox-sequential-tied": (lambda: hf.gpt_neox(use_parallel_residual=False, tie_word_embeddings=True),
                                 ["--topk", 4, "--window", 6, "--score-init", "random"]),
}


def with_variant(run, variant, out):
    """The run's checkpoint saved again with another attention.variant."""
    from longtrain.train.checkpoint import CheckpointManager
    from longtrain.train.checkpoint import checkpoint_files

    loaded = load_checkpoint(run)
    r = loaded.recipe
    recipe = r.model_copy(update={"attention": r.attention.model_copy(update={"variant": variant})})
    CheckpointManager(out, keep=1).save(0, tensors={"model": loaded.model.state_dict()}, meta=loaded.meta,
                                        files=checkpoint_files(recipe, loaded.tokenizer))
    return out


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_trust_remote_code_runs_sparsek_with_longtrains_logits(name, tmp_path):
    from transformers import AutoModelForCausalLM

    build, args = CASES[name]
    torch.manual_seed(0)
    hf.save(build(), tmp_path / "hf", hf.tokenizer())
    cli("import", tmp_path / "hf", "--out", tmp_path / "run", *args)
    run = tmp_path / "run"
    if name.startswith("qwen2"):
        run = with_variant(run, "soft_kv", tmp_path / "soft")
    lt = load_checkpoint(run).model
    cli("export", run, "--out", tmp_path / "out")
    assert (tmp_path / "out/modeling_longtrain.py").is_file() and "auto_map" in json.loads((tmp_path / "out/config.json").read_text())

    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__name__ == "LongtrainForCausalLM"
    tokens = torch.randint(0, 298, (2, 36))
    want = lt(tokens).logits
    assert hf.rel_diff(remote(tokens).logits, want) <= 1e-4
    # Through its cache, 26 tokens then 10: the same logits.
    first = remote(tokens[:, :26])
    rest = remote(tokens[:, 26:], cache=first.cache)
    assert hf.rel_diff(torch.cat([first.logits, rest.logits], 1), want) <= 1e-4
    # Without remote code the folder loads as its standard family: full attention (other logits), or for
    # a sliding window alone, Mistral's window (the same logits).
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(plain).__name__ != "LongtrainForCausalLM"
    if name == "llama-sw":
        assert type(plain).__name__ == "MistralForCausalLM" and hf.rel_diff(plain(tokens).logits, want) <= 1e-4
    else:
        assert hf.rel_diff(plain(tokens).logits, want) > 1e-3

    # generate(): greedy tokens equal longtrain's greedy continuation.
    out = remote.generate(tokens[:1, :20], max_new_tokens=6, do_sample=False)
    seq = tokens[:1, :20]
    for _ in range(6):
        seq = torch.cat([seq, lt(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


def test_the_remote_threshold_equals_longtrains_operator():
    """modeling_longtrain.py's plain sparsek_threshold against longtrain.ops' (ties, n just above k, wide spreads)."""
    import importlib.util
    import sys
    from pathlib import Path

    from longtrain.ops import sparsek_threshold

    folder = Path(__file__).resolve().parents[2] / "longtrain/interop/remote"
    try:  # as a package of its own, as transformers loads it (its relative import of configuration_longtrain)
        spec = importlib.util.spec_from_file_location("longtrain_remote", folder / "__init__.py", submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["longtrain_remote"] = package
        spec.loader.exec_module(package)
        from longtrain_remote import modeling_longtrain as remote
    finally:
        for name in [m for m in sys.modules if m.startswith("longtrain_remote")]:
            del sys.modules[name]
    g = torch.Generator().manual_seed(0)
    for n, k, scale in ((5, 4, 1.0), (9, 3, 0.1), (40, 7, 3.0), (64, 1, 10.0), (17, 16, 0.01)):
        z = torch.randn(6, n, generator=g, dtype=torch.float64) * scale
        z[0, 1:3] = z[0, 0]  # ties
        z[1, :k] = z[1, k:].max() + 1 + torch.rand(k, generator=g, dtype=torch.float64)  # f flat at k: the smallest tau
        assert torch.allclose(remote.sparsek_threshold(z, k), sparsek_threshold(z, k), rtol=0, atol=1e-12)
