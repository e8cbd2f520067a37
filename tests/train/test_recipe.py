"""Recipe loading: every bad input gets a precise message; overrides and round trips work."""

from __future__ import annotations

import pytest

from longtrain.train.recipe import (
    RECIPES_DIR,
    RecipeError,
    builtin_recipes,
    load_recipe,
    recipe_hash,
    recipe_to_yaml,
    resolve_recipe_path,
)

MINIMAL = """\
model: {layers: 2, d_model: 64, heads: 4}
attention: {type: sparsek+sw, topk: 8, window: 8}
train: {steps: 10, warmup_steps: 2}
"""


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(*args) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(*args)
    return str(e.value)


def test_all_shipped_recipes_load():
    assert {"quickstart", "gutenberg-sparsek", "gutenberg-sw", "pg19"} <= set(builtin_recipes())
    for name in builtin_recipes():
        if name.startswith("finetune-"):  # the model comes from train.init_from (tests/interop loads them)
            assert "train.init_from is not set" in error_of(name)
            continue
        assert load_recipe(name).name == name


def test_default_is_quickstart_and_names_resolve():
    assert resolve_recipe_path(None) == RECIPES_DIR / "quickstart.yaml"
    assert resolve_recipe_path("pg19") == RECIPES_DIR / "pg19.yaml"
    assert load_recipe(None).data.source == "stdlib"


def test_gutenberg_pair_has_equal_kv_budget():
    sk, sw = load_recipe("gutenberg-sparsek"), load_recipe("gutenberg-sw")
    assert sk.attention.type == "sparsek+sw" and sw.attention.type == "sw"
    assert sw.attention.window == sk.attention.topk + sk.attention.window
    assert sw.attention.topk == 0
    assert sk.model == sw.model and sk.train == sw.train and sk.data == sw.data


def test_missing_file_names_the_path(tmp_path):
    msg = error_of(tmp_path / "nope.yaml")
    assert "not found" in msg and "nope.yaml" in msg and "quickstart" in msg


def test_yaml_syntax_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, "model:\n  layers: 2\n   d_model: 64\n")
    assert f"{path}:3:" in error_of(path) and "YAML syntax error" in error_of(path)


def test_duplicate_key_is_an_error_with_its_line(tmp_path):
    msg = error_of(write(tmp_path, MINIMAL + "train: {steps: 5}\n"))
    assert ":4:" in msg and "duplicate key `train`" in msg


def test_unknown_key_suggests_the_known_one(tmp_path):
    msg = error_of(write(tmp_path, MINIMAL.replace("layers", "layer")))
    assert "model.layer: unknown key" in msg and "did you mean `layers`?" in msg


def test_wrong_type_and_out_of_range(tmp_path):
    msg = error_of(write(tmp_path, MINIMAL.replace("steps: 10", "steps: ten").replace("d_model: 64", "d_model: 4")))
    assert "train.steps: Input should be a valid integer" in msg and "'ten'" in msg
    assert "model.d_model: Input should be greater than or equal to 8" in msg
    assert "hint: hidden size" in msg


def test_every_problem_is_listed_at_once(tmp_path):
    text = """\
model: {style: gtp2, layers: 0, d_model: 64, heads: 4, headz: 2}
attention: {type: sw, topk: 8, window: 8}
train: {steps: 10, warmup_steps: 2, betas: [0.9, 1.5]}
data: {sorce: stdlib}
chekpoint: {}
"""
    msg = error_of(write(tmp_path, text))
    assert "has 7 problems" in msg
    for expected in (
        "model.style", "did you mean `gpt2`?", "model.layers", "model.headz", "did you mean `heads`?",
        "attention type sw has no `topk`", "train.betas[1]", "data.sorce", "did you mean `source`?",
        "chekpoint: unknown key", "did you mean `checkpoint`?",
    ):
        assert expected in msg, expected


def test_missing_required_key(tmp_path):
    msg = error_of(write(tmp_path, MINIMAL.replace("steps: 10, ", "")))
    assert "train.steps: required key is missing" in msg


def test_cross_field_checks(tmp_path):
    assert "needs `window` > 0" in error_of(write(tmp_path, MINIMAL.replace("window: 8", "window: 0")))
    assert "multiple of heads" in error_of(write(tmp_path, MINIMAL.replace("d_model: 64", "d_model: 66")))
    msg = error_of(write(tmp_path, MINIMAL), ["model.vocab_size=1000", "tokenizer.vocab_size=4096"])
    assert "  - model.vocab_size (1000) is smaller than tokenizer.vocab_size (4096)" in msg
    msg = error_of(write(tmp_path, MINIMAL), ["train.scorer_unit_norm=true", "attention.timestep_norm=false"])
    assert "train.scorer_unit_norm rescales the scoring vectors" in msg and "hint:" in msg
    # A warmup longer than the run is not an error: the run warms up over its first tenth (see test_optim).
    assert load_recipe(write(tmp_path, MINIMAL.replace("warmup_steps: 2", "warmup_steps: 20"))).train.warmup() == 1


def test_empty_section_takes_the_defaults(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL + "logging:\n  # every: 5\n"))
    assert r.logging.every == 10


def test_unused_attention_sizes_become_zero(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL.replace("type: sparsek+sw, topk: 8, ", "type: sw, ")))
    assert (r.attention.topk, r.attention.window) == (0, 8)
    assert r.model.kv_heads == r.model.heads


def test_linear_types_refuse_what_they_cannot_run(tmp_path):
    path = write(tmp_path, MINIMAL)
    r = load_recipe(path, ["attention.type=linear+sw", "attention.topk=0"])
    assert (r.attention.type, r.attention.topk, r.attention.window) == ("linear+sw", 0, 8)
    msg = error_of(path, ["attention.type=sparsek+linear+sw", "attention.score_groups=per_kv_head"])
    assert "attention.score_groups shared" in msg
    # linear_norm weighs a linear part: on a type without one it is named, with the fix
    msg = error_of(path, ["attention.linear_norm=mean"])
    assert "linear_norm mean" in msg and "sparsek+linear+sw" in msg
    r = load_recipe(path, ["attention.type=sparsek+linear+sw"])
    assert r.attention.linear_norm == "mean"  # the default of the linear types
    from longtrain.model import LMConfig
    assert LMConfig.from_recipe(r.model, r.attention, 64).linear_norm == "mean"
    assert load_recipe(path, ["attention.type=linear+sw", "attention.topk=0", "attention.linear_norm=sum"]).attention.linear_norm == "sum"
    assert load_recipe(path).attention.linear_norm == "sum"  # no linear part: sum changes nothing
    # linear_gain learned scales a linear part: likewise; on a linear type it reaches the model's config
    msg = error_of(path, ["attention.linear_gain=learned"])
    assert "linear_gain learned" in msg and "remove linear_gain" in msg
    r = load_recipe(path, ["attention.type=sparsek+linear+sw", "attention.linear_gain=learned"])
    assert LMConfig.from_recipe(r.model, r.attention, 64).linear_gain == "learned"
    assert load_recipe(path, ["attention.type=sparsek+linear+sw"]).attention.linear_gain == "learned"  # their default
    fixed = load_recipe(path, ["attention.type=linear+sw", "attention.topk=0", "attention.linear_gain=fixed"])
    assert fixed.attention.linear_gain == "fixed"
    assert load_recipe(path).attention.linear_gain == "fixed"  # no linear part: fixed changes nothing
    # linear_rope unrotated changes what a linear part's phi reads: likewise
    msg = error_of(path, ["attention.linear_rope=unrotated"])
    assert "linear_rope unrotated" in msg and "remove linear_rope" in msg
    r = load_recipe(path, ["attention.type=sparsek+linear+sw", "attention.linear_rope=unrotated"])
    assert LMConfig.from_recipe(r.model, r.attention, 64).linear_rope == "unrotated"
    assert load_recipe(path, ["attention.type=sparsek+linear+sw"]).attention.linear_rope == "rotated"
    # issue 38: the Triton core has a linear part
    assert load_recipe(path, ["attention.type=sparsek+linear+sw", "attention.backend=triton"]).attention.backend == "triton"


def test_overrides_parse_yaml_scalars(tmp_path):
    r = load_recipe(
        write(tmp_path, MINIMAL),
        ["train.lr=3e-4", "attention.type=sw", "attention.topk=null", "checkpoint.keep=7", "logging.progress=false"],
    )
    assert r.train.lr == 3e-4 and r.attention.type == "sw" and r.attention.topk == 0
    assert r.checkpoint.keep == 7 and r.logging.progress is False


def test_an_override_fills_a_section_the_recipe_leaves_null(tmp_path):
    """A resolved recipe (a run dir's recipe.yaml) writes an unset section as null: --set fills it in."""
    resolved = write(tmp_path, recipe_to_yaml(load_recipe("quickstart")), "resolved.yaml")
    assert "recall: null" in resolved.read_text()
    r = load_recipe(resolved, ["data.source=recall", "data.recall.filler=files", "data.path=books"])
    assert r.data.recall.filler == "files"


def test_bad_overrides(tmp_path):
    path = write(tmp_path, MINIMAL)
    msg = error_of(path, ["train.chunk_sz=3"])
    assert "train.chunk_sz: unknown key (from --set train.chunk_sz=3)" in msg and "`chunk_size`" in msg
    msg = error_of(path, ["train.steps.x=1", "nonsense"])
    assert "`train.steps` is a value, not a section" in msg and "--set nonsense: expected KEY=VALUE" in msg
    assert "train.steps: Input should be greater than or equal to 1" in error_of(path, ["train.steps=0"])


def test_resolved_recipe_round_trips(tmp_path):
    original = load_recipe("quickstart", ["train.lr=1e-5"])
    again = load_recipe(write(tmp_path, recipe_to_yaml(original), "resolved.yaml"))
    assert again == original


def test_hash_tracks_model_but_not_training_or_backend(tmp_path):
    path = write(tmp_path, MINIMAL)
    base = recipe_hash(load_recipe(path))
    assert recipe_hash(load_recipe(path, ["train.lr=1e-5", "attention.backend=naive"])) == base
    assert recipe_hash(load_recipe(path, ["model.layers=3"])) != base
    assert recipe_hash(load_recipe(path, ["attention.topk=16"])) != base
    assert recipe_hash(load_recipe(path, ["tokenizer.vocab_size=4096"])) != base


# The fine-tuning recipes take their model from train.init_from (tests/interop runs them).
SCRATCH_RECIPES = [name for name in builtin_recipes() if not name.startswith("finetune-")]


@pytest.mark.parametrize("name", SCRATCH_RECIPES)
def test_one_override_makes_a_smoke_run_of_any_builtin(name):
    r = load_recipe(name, ["train.steps=20"])
    assert r.train.steps == 20 and r.train.warmup() == 2  # warmup_steps (40 to 500) exceeds the run: a tenth
    assert not any(r.train.validates_at(s) for s in range(1, 21))  # no full validation pass in a smoke run
    full = load_recipe(name)
    if full.train.valid_every:  # the real run validates on schedule and at its end
        assert full.train.validates_at(full.train.valid_every) and full.train.validates_at(full.train.steps)


@pytest.mark.parametrize("name", SCRATCH_RECIPES)
def test_recipe_comments_state_the_parameter_count_a_run_prints(name):
    """The header's "N.NM parameters" is what `fit` prints for that recipe (vocab = tokenizer.vocab_size)."""
    import re

    import torch

    from longtrain.model import LM, LMConfig

    r = load_recipe(name)
    header = "".join(line for line in (RECIPES_DIR / f"{name}.yaml").read_text().splitlines(True) if line.startswith("#"))
    stated = [float(x) for x in re.findall(r"(\d+(?:\.\d+)?)M(?:-parameter| parameters)", header)]
    assert stated, f"{name}.yaml does not state its parameter count"
    with torch.device("meta"):
        model = LM(LMConfig.from_recipe(r.model, r.attention, vocab_size=r.tokenizer.vocab_size))
    for millions in stated:
        assert millions == pytest.approx(model.num_params() / 1e6, rel=0.01), (name, millions)


def test_recipe_description_is_the_first_comment_line(tmp_path):
    from longtrain.train.recipe import recipe_description

    assert recipe_description(write(tmp_path, "# r: a small test recipe\n" + MINIMAL)) == "a small test recipe"
    assert recipe_description(write(tmp_path, "# just words\n" + MINIMAL)) == "just words"
    assert recipe_description(write(tmp_path, MINIMAL)) == ""


def test_a_run_saved_before_linear_norm_keeps_the_sum_it_trained_with_and_its_hashes(tmp_path):
    """attention.linear_norm came later with mean as the linear types' default: a resolved recipe of a run saved
    before it (no linear_norm key) computed sum, so it loads as sum and its attention hash is the one it saved."""
    import yaml

    from longtrain.train.recipe import recipe_hash, recipe_to_yaml

    for type_, sets in (("sparsek+linear+sw", []), ("sparsek+sw", [])):
        new = load_recipe(write(tmp_path, MINIMAL), [f"attention.type={type_}", "attention.linear_norm=sum", *sets])
        text = recipe_to_yaml(new)
        old = yaml.safe_load(text)
        del old["attention"]["linear_norm"]
        saved = tmp_path / f"saved-{type_}.yaml"
        saved.write_text(text.splitlines(keepends=True)[0] + yaml.safe_dump(old, sort_keys=False))
        back = load_recipe(saved)
        assert back.attention.linear_norm == "sum"
        assert recipe_hash(back, ("attention",)) == recipe_hash(new, ("attention",))
        dump = new.model_dump(mode="json", include={"attention"})
        assert "linear_norm" in dump["attention"]  # saved from now on
    # a recipe a user writes (no header) takes the type's defaults: mean, and a learned gain
    user = load_recipe(write(tmp_path, MINIMAL), ["attention.type=sparsek+linear+sw"])
    assert user.attention.linear_norm == "mean" and user.attention.linear_gain == "learned"
    # linear_gain came later still, with learned as the linear types' default from 2026-12-04: a saved recipe without
    # it trained with a fixed gain (what the code computed), so it loads as fixed with the hash it saved
    fixed = load_recipe(write(tmp_path, MINIMAL), ["attention.type=sparsek+linear+sw", "attention.linear_gain=fixed"])
    fixed_hash = recipe_hash(fixed, ("attention",))
    text = recipe_to_yaml(fixed)
    old = yaml.safe_load(text)
    del old["attention"]["linear_gain"]
    saved = tmp_path / "saved-gain.yaml"
    saved.write_text(text.splitlines(keepends=True)[0] + yaml.safe_dump(old, sort_keys=False))
    back = load_recipe(saved)
    assert back.attention.linear_gain == "fixed" and recipe_hash(back, ("attention",)) == fixed_hash
    assert "linear_gain" in yaml.safe_load(recipe_to_yaml(user))["attention"]  # saved from now on
    assert recipe_hash(user, ("attention",)) != fixed_hash  # another model: its checkpoints are not this one's
    # linear_rope came later again: a saved recipe without it read phi after RoPE, with the hash it saved
    unrot = load_recipe(write(tmp_path, MINIMAL), ["attention.type=sparsek+linear+sw", "attention.linear_rope=unrotated"])
    old = yaml.safe_load(recipe_to_yaml(user))
    del old["attention"]["linear_rope"]
    saved = tmp_path / "saved-rope.yaml"
    saved.write_text(recipe_to_yaml(user).splitlines(keepends=True)[0] + yaml.safe_dump(old, sort_keys=False))
    back = load_recipe(saved)
    assert back.attention.linear_rope == "rotated" and recipe_hash(back, ("attention",)) == recipe_hash(user, ("attention",))
    assert recipe_hash(unrot, ("attention",)) != recipe_hash(user, ("attention",))
    assert fixed_hash != recipe_hash(load_recipe(write(tmp_path, MINIMAL), ["attention.type=sparsek+linear+sw",
                                                                           "attention.linear_norm=sum",
                                                                           "attention.linear_gain=fixed"]), ("attention",))
