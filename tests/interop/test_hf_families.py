"""Qwen2, Mistral, Llama 3 and scaled RoPE: imports give transformers' logits, exports load back in it."""

import json

import pytest
import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.train.checkpoint import load_checkpoint
from tests.interop import hf_models as hf

runner = CliRunner()
ORIGINAL = 32  # max_position_embeddings of the RoPE-scaled models; the tests read 3x beyond it

ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},  # longtrain fixes it at factor x 32 = 96 tokens
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "mscale": 0.7,
                      "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def imported(model, tmp_path, *import_args):
    hf.save(model, tmp_path / "hf", hf.tokenizer())
    result = cli("import", tmp_path / "hf", "--out", tmp_path / "run", *import_args)
    assert result.exit_code == 0, result.output
    return load_checkpoint(tmp_path / "run")


def chunked_logits(lt, tokens, chunk):
    cache, got = lt.empty_cache(tokens.shape[0]), []
    for s in range(0, tokens.shape[1], chunk):
        out = lt(tokens[:, s : s + chunk], cache=cache)
        cache = out.cache
        got.append(out.logits)
    return torch.cat(got, 1)


@pytest.mark.parametrize("kind", list(ROPE))
@torch.no_grad()
def test_scaled_rope_gives_transformers_logits_beyond_the_original_context(kind, tmp_path):
    torch.manual_seed(0)
    params = ROPE[kind] | {"rope_theta": 5000.0}
    model = hf.llama(max_position_embeddings=ORIGINAL, rope_parameters=params, hidden_size=64)  # head size 16
    loaded = imported(model, tmp_path, "--attention", "full")
    assert loaded.recipe.model.rope_scaling.type == params["rope_type"]
    tokens = torch.randint(0, 298, (2, 3 * ORIGINAL))
    want = model(tokens).logits
    assert hf.rel_diff(loaded.model(tokens).logits, want) <= 1e-4
    assert hf.rel_diff(chunked_logits(loaded.model, tokens, 40), want) <= 1e-4
    # Not plain RoPE: the same weights without the scaling give other logits beyond the original context.
    plain = hf.llama(max_position_embeddings=ORIGINAL, rope_theta=5000.0, hidden_size=64)
    plain.load_state_dict(model.state_dict())
    assert hf.rel_diff(plain(tokens).logits, want) > 1e-3

    # The export computes the same in transformers (dynamic: as plain RoPE with longtrain's NTK base).
    assert cli("export", tmp_path / "run", "--out", tmp_path / "out").exit_code == 0
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert hf.rel_diff(back(tokens).logits, want) <= 1e-4


@pytest.mark.parametrize("tied", [True, False])
@torch.no_grad()
def test_qwen2_qkv_biases_tied_or_untied(tied, tmp_path):
    torch.manual_seed(1)
    model = hf.qwen2(tie_word_embeddings=tied)
    assert model.model.layers[0].self_attn.q_proj.bias is not None and model.model.layers[0].self_attn.o_proj.bias is None
    loaded = imported(model, tmp_path, "--attention", "full")
    m = loaded.recipe.model
    assert (m.qkv_bias, m.tied_embeddings, m.kv_heads) == (True, tied, 2)
    tokens = torch.randint(0, 298, (2, 45))
    want = model(tokens).logits
    assert hf.rel_diff(loaded.model(tokens).logits, want) <= 1e-4
    assert hf.rel_diff(chunked_logits(loaded.model, tokens, 16), want) <= 1e-4
    assert cli("export", tmp_path / "run", "--out", tmp_path / "out").exit_code == 0
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert hf.rel_diff(back(tokens).logits, want) <= 1e-4


@pytest.mark.parametrize("attention", ["full", "sw"])
@torch.no_grad()
def test_mistral_sliding_window_as_full_or_as_longtrain_sw(attention, tmp_path):
    torch.manual_seed(2)
    model = hf.mistral()
    loaded = imported(model, tmp_path, "--attention", attention)
    a = loaded.recipe.attention
    assert (a.max_context, a.window) == ((16, 0) if attention == "full" else (None, 16))
    tokens = torch.randint(0, 298, (2, 50))  # 3 windows
    want = model(tokens).logits
    assert hf.rel_diff(loaded.model(tokens).logits, want) <= 1e-4
    assert hf.rel_diff(chunked_logits(loaded.model, tokens, 20), want) <= 1e-4
    # Without its window the model computes something else past 16 tokens.
    whole = hf.mistral(sliding_window=None)
    whole.load_state_dict(model.state_dict())
    assert hf.rel_diff(whole(tokens).logits, want) > 1e-3
    assert cli("export", tmp_path / "run", "--out", tmp_path / "out").exit_code == 0
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert json.loads((tmp_path / "out/config.json").read_text())["sliding_window"] == 16
    assert hf.rel_diff(back(tokens).logits, want) <= 1e-4


@torch.no_grad()
def test_llama3_shape_large_vocab_gqa_and_llama3_rope(tmp_path):
    """Llama 3's layout at a tiny width: 8 query heads on 2 KV heads, a vocabulary far larger than the
    tokenizer (rows past it are never produced by it), llama3 RoPE, theta 500000."""
    torch.manual_seed(3)
    rope = ROPE["llama3"] | {"rope_theta": 500000.0}
    model = hf.llama(vocab_size=4096, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                     max_position_embeddings=ORIGINAL, rope_parameters=rope, bos_token_id=1, eos_token_id=[2, 3])
    loaded = imported(model, tmp_path, "--attention", "full")
    tokens = torch.randint(0, 4096, (1, 80))
    assert hf.rel_diff(loaded.model(tokens).logits, model(tokens).logits) <= 1e-4


def test_unsupported_rope_type_and_qwen2_windows_are_refused(tmp_path):
    model = hf.llama(rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0, "short_factor": [1.0] * 4,
                                      "long_factor": [2.0] * 4, "original_max_position_embeddings": 16},
                     max_position_embeddings=64)
    hf.save(model, tmp_path / "hf", hf.tokenizer())
    result = cli("import", tmp_path / "hf", "--out", tmp_path / "run")
    assert result.exit_code == 1 and "RoPE scaling 'longrope' is not supported" in " ".join(result.output.split())
    hf.save(hf.qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=1), tmp_path / "q", hf.tokenizer())
    result = cli("import", tmp_path / "q", "--out", tmp_path / "run")
    assert result.exit_code == 1 and "use_sliding_window = True" in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()


def plain_tokenizer():
    """A BPE whose special tokens have none of the usual end-of-document names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|begin|>", "<|eot_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([hf.text(7, 2000)], trainer)
    return tok


@pytest.mark.parametrize("where", ["config", "generation_config", "nowhere"])
def test_end_of_document_from_the_models_eos_token_id(where, tmp_path):
    from longtrain.data.tokenizer import EOD, eod_id

    tok = plain_tokenizer()
    eot = tok.token_to_id("<|eot_id|>")
    model = hf.llama(eos_token_id=[eot] if where == "config" else None)
    hf.save(model, tmp_path / "hf", tok)
    if where == "generation_config":
        (tmp_path / "hf/generation_config.json").write_text(json.dumps({"eos_token_id": [eot, 0]}))
    result = cli("import", tmp_path / "hf", "--out", tmp_path / "run", "--attention", "full")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    loaded = load_checkpoint(tmp_path / "run")
    if where == "nowhere":
        assert loaded.recipe.tokenizer.eod_token is None and "is added as token 290" in out and "tokenizer.eod_token" in out
        assert eod_id(loaded.tokenizer) == tok.get_vocab_size() and loaded.tokenizer.token_to_id(EOD) is not None
        return
    file = "config.json" if where == "config" else "generation_config.json"
    assert f"end of document: '<|eot_id|>' (eos_token_id {eot} of {file})" in out
    assert loaded.recipe.tokenizer.eod_token == "<|eot_id|>"
    assert eod_id(loaded.tokenizer) == eot and loaded.tokenizer.get_vocab_size() == tok.get_vocab_size()  # nothing added
    # A fine-tuning recipe that takes its tokenizer from the import keeps the token.
    from longtrain.train.init import load_fit_recipe

    r = load_fit_recipe("finetune-llama", [f"train.init_from={tmp_path / 'run'}", "attention.topk=8", "attention.window=8"])
    assert r.tokenizer.eod_token == "<|eot_id|>"


@torch.no_grad()
def test_import_into_a_linear_type_and_export_refuses_it(tmp_path):
    """A Llama imported as sparsek+linear+sw: its weights, phi's maps the identity; export has no layout for phi."""
    torch.manual_seed(4)
    model = hf.llama()
    loaded = imported(model, tmp_path, "--attention", "sparsek+linear+sw", "--topk", "4", "--window", "4")
    lt = loaded.model
    assert lt.cfg.attention == "sparsek+linear+sw"
    assert torch.equal(lt.blocks[0].attn.phi_weight[0], torch.eye(lt.cfg.head_dim))
    # the linear types' default gain (learned) starts as a fresh model's: 1/F per head
    assert lt.cfg.linear_gain == "learned"
    assert torch.allclose(lt.blocks[0].attn.linear_gain(), torch.full((lt.cfg.heads,), 1 / lt.cfg.head_dim))
    assert torch.equal(lt.blocks[0].attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    result = cli("export", tmp_path / "run", "--out", tmp_path / "out")
    assert result.exit_code != 0 and "linear attention" in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "llama3"])
def test_rope_scaling_reads_the_same_from_transformers_4_and_5_configs(kind):
    from longtrain.interop.hf_families import LLAMA, model_section

    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 40, "vocab_size": 320, "max_position_embeddings": 64}
    params = {k: v for k, v in ROPE[kind].items() if k != "rope_type"}
    v4 = base | {"rope_theta": 5000.0, "rope_scaling": {"type": kind, **params}}
    v5 = base | {"rope_parameters": {"rope_type": kind, "rope_theta": 5000.0, **params}}
    a, b = model_section(LLAMA, v4), model_section(LLAMA, v5)
    assert a == b and a["rope_theta"] == 5000.0 and a["rope_scaling"]["type"] == kind
    assert a["rope_scaling"].get("original_context") == (None if kind == "linear" else 64 if kind == "dynamic" else ORIGINAL)
