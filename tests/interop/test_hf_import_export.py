"""`longtrain import` / `longtrain export` against real `transformers` models built and saved here."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.model.scoring import mimic_score_weight
from longtrain.train.checkpoint import load_checkpoint
from tests.interop import hf_models as hf

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """HF folders: each family unsharded and sharded, a sequential tied GPT-NeoX, a bfloat16 Llama."""
    root = tmp_path_factory.mktemp("hf")
    tok = hf.tokenizer()
    torch.manual_seed(0)
    models = {"llama": hf.llama(), "gpt_neox": hf.gpt_neox(),
              "gpt_neox-sequential-tied": hf.gpt_neox(use_parallel_residual=False, tie_word_embeddings=True, rotary_pct=1.0)}
    dirs = {}
    for name, model in list(models.items()):
        dirs[name] = hf.save(model, root / name, tok)
        if name in ("llama", "gpt_neox"):
            dirs[name + "-sharded"] = hf.save(model, root / f"{name}-sharded", tok, max_shard_size="20KB")
            models[name + "-sharded"] = model
    models["llama-bf16"] = hf.llama().to(torch.bfloat16)
    dirs["llama-bf16"] = hf.save(models["llama-bf16"], root / "llama-bf16", tok)
    return models, dirs, tok


@pytest.mark.parametrize("name", ["llama", "llama-sharded", "gpt_neox", "gpt_neox-sharded", "gpt_neox-sequential-tied"])
@torch.no_grad()
def test_full_attention_import_gives_transformers_logits(folders, name, tmp_path):
    models, dirs, _ = folders
    if name.endswith("sharded"):
        assert len(list(dirs[name].glob("*.safetensors"))) > 1 and (dirs[name] / "model.safetensors.index.json").is_file()
    result = cli("import", dirs[name], "--out", tmp_path / "run", "--attention", "full")
    assert result.exit_code == 0, result.output
    lt = load_checkpoint(tmp_path / "run").model
    tokens = torch.randint(0, 298, (2, 45))
    want = models[name](tokens).logits  # [B, T, V]
    assert hf.rel_diff(lt(tokens).logits, want) <= 1e-4
    # Chunk by chunk through the cache (positions continue across chunks): the same logits.
    cache, got = lt.empty_cache(2), []
    for s in range(0, 45, 16):
        out = lt(tokens[:, s : s + 16], cache=cache)
        cache = out.cache
        got.append(out.logits)
    assert hf.rel_diff(torch.cat(got, 1), want) <= 1e-4


@pytest.mark.parametrize("name,dtype", [("llama-bf16", "bfloat16"), ("gpt_neox", "float32")])
@torch.no_grad()
def test_round_trip_is_bitwise_and_export_loads_in_transformers(folders, name, dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    models, dirs, tok = folders
    assert cli("import", dirs[name], "--out", tmp_path / "run", "--attention", "full").exit_code == 0
    result = cli("export", tmp_path / "run", "--out", tmp_path / "out", "--dtype", dtype)
    assert result.exit_code == 0, result.output
    before, after = load_file(dirs[name] / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert set(before) == set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    written = (tmp_path / "out/tokenizer.json").read_text()
    assert written == tok.to_str() or json.loads(written) == json.loads(tok.to_str())

    # transformers runs the export (in float32) as longtrain runs the import.
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 298, (2, 30))
    assert hf.rel_diff(exported(tokens).logits, load_checkpoint(tmp_path / "run").model(tokens).logits) <= 1e-4


@torch.no_grad()
def test_sparsek_import_mimic_scores_and_export_carries_them(folders, tmp_path):
    from transformers import AutoModelForCausalLM

    models, dirs, _ = folders
    result = cli("import", dirs["llama"], "--out", tmp_path / "run", "--topk", 8, "--window", 8)
    assert result.exit_code == 0, result.output
    loaded = load_checkpoint(tmp_path / "run")
    lt, recipe = loaded.model, loaded.recipe
    assert (recipe.attention.type, recipe.attention.topk, recipe.attention.window) == ("sparsek+sw", 8, 8)
    for blk in lt.blocks:  # mimic: W_Q W_Kᵀ 1 / ||·||, over 4 query heads reading 2 KV heads
        a = blk.attn
        assert torch.equal(a.scorer.weight, mimic_score_weight(a.q_proj.weight, a.k_proj.weight, 4, 2, 1))
    assert torch.isfinite(lt(torch.randint(0, 298, (1, 64))).logits).all()

    assert cli("export", tmp_path / "run", "--out", tmp_path / "out").exit_code == 0
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["longtrain_sparsek"] | {"note": ""} == {
        "attention": "sparsek+sw", "topk": 8, "window": 8, "variant": "hard_k_soft_v", "score_groups": "shared",
        "timestep_norm": True, "eps_slope": 1e-3, "qkv_bias": False, "layout": "llama", "parallel_residual": False,
        "rotary_pct": 1.0, "note": "",
    }
    assert "ignores" in config["longtrain_sparsek"]["note"]
    tensors = load_file(tmp_path / "out/model.safetensors")
    assert tensors["model.layers.1.self_attn.sparsek_score.weight"].shape == (1, 32)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()  # ignores the extras: full attention
    tokens = torch.randint(0, 298, (1, 20))
    assert hf.rel_diff(plain(tokens).logits, models["llama"](tokens).logits) <= 1e-4

    # Importing the export takes its scoring vectors back instead of initialising new ones.
    assert cli("import", tmp_path / "out", "--out", tmp_path / "again", "--topk", 8, "--window", 8, "--score-init", "random").exit_code == 0
    again = load_checkpoint(tmp_path / "again").model
    assert all(torch.equal(a.attn.scorer.weight, b.attn.scorer.weight) for a, b in zip(again.blocks, lt.blocks))
    # A random init is seeded and differs from mimic.
    assert cli("import", dirs["llama"], "--out", tmp_path / "rnd", "--window", 8, "--topk", 8, "--score-init", "random").exit_code == 0
    rnd = load_checkpoint(tmp_path / "rnd").model
    assert not torch.allclose(rnd.blocks[0].attn.scorer.weight, lt.blocks[0].attn.scorer.weight)


# ----------------------------------------------------------------------------- bad input


def edited(src, dst, **config_changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text()) | config_changes
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def refused(*args) -> str:
    result = cli(*args)
    assert result.exit_code == 1, result.output
    return " ".join(result.output.split())  # rich wraps long lines


def test_folder_without_config_or_weights(folders, tmp_path):
    _, dirs, _ = folders
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in refused("import", tmp_path / "empty", "--out", tmp_path / "r1")
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    shutil.copy(dirs["llama"] / "config.json", only_config)
    assert "has no weights" in refused("import", only_config, "--out", tmp_path / "r2")
    (only_config / "pytorch_model.bin").write_bytes(b"x")
    assert "pytorch_model.bin: convert it first" in refused("import", only_config, "--out", tmp_path / "r2")
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()  # nothing written


def test_unsupported_model_type_and_settings(folders, tmp_path):
    _, dirs, _ = folders
    gpt2 = edited(dirs["llama"], tmp_path / "gpt2", model_type="gpt2")
    assert "model_type 'gpt2' is not supported (supported: llama, mistral, qwen2, gpt_neox)" in refused("import", gpt2, "--out",
        tmp_path / "r")
    unnamed = edited(dirs["llama"], tmp_path / "unnamed", model_type=None)
    assert "config.json names no model_type" in refused("import", unnamed, "--out", tmp_path / "r")
    scaled = edited(dirs["llama"], tmp_path / "scaled", rope_parameters={"rope_type": "linear", "rope_theta": 5000.0})
    assert "RoPE scaling 'linear' lacks its factor or original context" in refused("import", scaled, "--out", tmp_path / "r")


def test_weights_that_disagree_with_the_config(folders, tmp_path):
    _, dirs, _ = folders
    wider = edited(dirs["gpt_neox"], tmp_path / "wider", intermediate_size=100)
    msg = refused("import", wider, "--out", tmp_path / "r")
    assert "disagree with config.json" in msg and "gpt_neox.layers.0.mlp.dense_h_to_4h.weight: weights (96, 64) vs config (100, 64)" in msg
    deeper = edited(dirs["llama"], tmp_path / "deeper", num_hidden_layers=3)
    assert "the weights lack" in refused("import", deeper, "--out", tmp_path / "r")


def test_tokenizer_larger_than_the_embedding(folders, tmp_path):
    _, _, tok = folders
    small = hf.save(hf.llama(vocab_size=200), tmp_path / "small", tok)
    msg = refused("import", small, "--out", tmp_path / "r")
    assert f"tokenizer.json has {tok.get_vocab_size()} tokens" in msg and "the embedding has 200 rows" in msg


def test_existing_run_and_export_folder_are_not_touched(folders, tmp_path):
    _, dirs, _ = folders
    assert cli("import", dirs["llama"], "--out", tmp_path / "run", "--attention", "full").exit_code == 0
    files = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert "already holds a run" in refused("import", dirs["gpt_neox"], "--out", tmp_path / "run")
    (tmp_path / "out").mkdir()
    (tmp_path / "out/keep.txt").write_text("mine")
    assert "is not an empty folder" in refused("export", tmp_path / "run", "--out", tmp_path / "out")
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == files
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert cli("import", dirs["llama"], "--out", tmp_path / "r", "--attention", "full", "--topk", 4).exit_code == 2


def test_importing_an_export_keeps_its_attention_settings_unless_flags_say_otherwise(folders, tmp_path):
    _, dirs, _ = folders
    assert cli("import", dirs["llama"], "--out", tmp_path / "run", "--attention", "sparsek", "--topk", 12).exit_code == 0
    assert cli("export", tmp_path / "run", "--out", tmp_path / "out").exit_code == 0
    again = cli("import", tmp_path / "out", "--out", tmp_path / "again")
    assert again.exit_code == 0, again.output
    att = load_checkpoint(tmp_path / "again").recipe.attention
    assert (att.type, att.topk, att.window, att.score_groups) == ("sparsek", 12, 0, "shared")
    assert "attention: sparsek (k=12, w=0); topk, attention, score_groups from config.json's longtrain_sparsek" in again.output
    assert "fine-tune: longtrain fit finetune-llama --set train.init_from=" in again.output and "recipes/" not in again.output
    flags = cli("import", tmp_path / "out", "--out", tmp_path / "flags", "--attention", "sparsek+sw", "--window", 16)
    assert flags.exit_code == 0, flags.output
    att = load_checkpoint(tmp_path / "flags").recipe.attention
    assert (att.type, att.topk, att.window) == ("sparsek+sw", 12, 16)  # k still the export's, w and type the flags'
    plain = cli("import", dirs["gpt_neox"], "--out", tmp_path / "plain")
    att = load_checkpoint(tmp_path / "plain").recipe.attention
    assert (att.type, att.topk, att.window) == ("sparsek+sw", 512, 512)
    assert "longtrain fit finetune-pythia" in plain.output
    wrong = cli("import", tmp_path / "out", "--out", tmp_path / "wrong", "--window", 8)
    assert wrong.exit_code == 1 and "attention sparsek (config.json's longtrain_sparsek) has no window" in " ".join(wrong.output.split())
