"""`longtrain inspect`: the selection picture of a text, as HTML and PNG, and its bad input."""

import html as html_lib
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.data.tokenizer import train_bpe
from longtrain.eval.inspect import selection_map
from longtrain.model import LM, LMConfig
from longtrain.train.checkpoint import CheckpointManager
from longtrain.train.checkpoint import checkpoint_files, load_checkpoint
from longtrain.train.recipe import AttentionConfig, ModelConfig, Recipe, TrainConfig

TEXT = (
    "It was a quiet morning on the river. The captain wrote a letter by the window,\n"
    "and the ship waited for the evening tide. " * 6
)


def write_checkpoint(run_dir: Path, attention: dict) -> Path:
    torch.manual_seed(0)
    tok = train_bpe([TEXT * 4], vocab_size=300)
    recipe = Recipe(
        model=ModelConfig(layers=3, d_model=32, heads=2),
        attention=AttentionConfig(**attention),
        train=TrainConfig(steps=1, chunk_size=40, warmup_steps=0),
    )
    model = LM(LMConfig.from_recipe(recipe.model, recipe.attention, vocab_size=tok.get_vocab_size()))
    manager = CheckpointManager(run_dir, keep=1)
    return manager.save(1, tensors={"model": model.state_dict()}, meta={}, files=checkpoint_files(recipe, tok))


@pytest.fixture(scope="module")
def sparsek_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("sparsek")
    write_checkpoint(run, dict(type="sparsek+sw", topk=6, window=8))
    (run / "page.txt").write_text(TEXT)
    return run


def invoke(*args):
    return CliRunner().invoke(app, ["inspect", *map(str, args)])


def test_writes_html_and_png_with_one_panel_per_layer(sparsek_run, tmp_path):
    html, png = tmp_path / "sel.html", tmp_path / "sel.png"
    for out in (html, png):
        r = invoke(sparsek_run, "--text", sparsek_run / "page.txt", "--out", out)
        assert r.exit_code == 0, r.output
        assert "layer(s) 0, 1, 2" in r.output
    page = html.read_text()
    assert page.count("<h2>layer") == 3
    assert page.count('class="pool') == 3 * 6  # k pool tokens boxed in each panel
    for panel in re.findall(r"<pre>(.*?)</pre>", page, flags=re.S):  # every character, once, in order
        assert html_lib.unescape(re.sub(r"<[^>]+>", "", panel)) == TEXT
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    one = tmp_path / "one.html"
    assert invoke(sparsek_run, "--text", sparsek_run / "page.txt", "--out", one, "--layer", "1").exit_code == 0
    assert one.read_text().count("<h2>layer") == 1


def test_the_map_matches_a_chunked_read_of_the_text(sparsek_run):
    loaded = load_checkpoint(sparsek_run)
    sm = selection_map(loaded, TEXT)
    ids = loaded.tokenizer.encode(TEXT).ids
    out = loaded.model(torch.tensor([ids]))  # one unchunked pass: the same scores and final pool
    for slot, layer in enumerate(sm.layers):
        np.testing.assert_allclose(sm.u[slot], out.selections[layer].u[0].double().numpy(), rtol=1e-5, atol=1e-6)
        pool = out.cache.layers[layer].attn.pool_pos[0]
        assert set(np.flatnonzero(sm.in_pool[slot])) == {int(p) for p in pool if p >= 0}
        # The pool holds the k highest-scoring candidates (older than the window).
        cand = sm.u[slot][: len(ids) - 8 + 1]  # positions <= T - w
        assert set(np.argsort(-cand, kind="stable")[:6]) == set(np.flatnonzero(sm.in_pool[slot]))


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--text", "missing.txt", "--out", "x.html"], 2, "no such file"),
        (["--text", "page.txt", "--out", "x.pdf"], 2, "must end in .html or .png"),
        (["--text", "page.txt", "--out", "x.html", "--layer", "3"], 2, "out of range: the model has 3 layers (0..2)"),
        (["--text", "empty.txt", "--out", "x.html"], 2, "is empty"),
        (["--text", "page.txt", "--out", "x.html", "--device", "tpu"], 2, "--device must be auto, cpu or cuda; got 'tpu'"),
    ],
)
def test_bad_input_is_named(sparsek_run, tmp_path, monkeypatch, args, code, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "page.txt").write_text(TEXT)
    (tmp_path / "empty.txt").write_text("  \n")
    r = invoke(sparsek_run, *args)
    assert r.exit_code == code
    assert message in " ".join(r.output.split())
    assert not (tmp_path / "x.html").exists()


@pytest.mark.parametrize("attention", [dict(type="sw", window=8), dict(type="full")])
def test_a_model_without_selection_is_refused(tmp_path, attention):
    write_checkpoint(tmp_path / "run", attention)
    (tmp_path / "page.txt").write_text(TEXT)
    r = invoke(tmp_path / "run", "--text", tmp_path / "page.txt", "--out", tmp_path / "x.html")
    assert r.exit_code == 2
    assert "selects nothing" in " ".join(r.output.split())
    assert not (tmp_path / "x.html").exists()


def test_a_missing_checkpoint_is_named(tmp_path):
    (tmp_path / "page.txt").write_text(TEXT)
    r = invoke(tmp_path / "nothing", "--text", tmp_path / "page.txt", "--out", tmp_path / "x.html")
    assert r.exit_code == 2 and "does not exist" in r.output


@pytest.mark.parametrize(
    "content, message",
    [(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4, "binary file"), (b"caf\xe9 au lait\n" * 3, "not UTF-8 text (byte 3")],
)
def test_a_binary_or_non_utf8_file_is_refused_before_the_checkpoint_is_read(tmp_path, content, message):
    (tmp_path / "blob").write_bytes(content)
    r = invoke(tmp_path / "no-checkpoint-here", "--text", tmp_path / "blob", "--out", tmp_path / "x.html")
    assert r.exit_code == 2 and message in " ".join(r.output.split())
    assert not (tmp_path / "x.html").exists()


def test_a_long_text_is_read_up_to_max_tokens(sparsek_run, tmp_path, monkeypatch):
    import longtrain.eval.inspect as inspect_module

    long = TEXT * 20
    (tmp_path / "long.txt").write_text(long)
    capped = invoke(sparsek_run, "--text", tmp_path / "long.txt", "--out", tmp_path / "cap.html", "--max-tokens", 100)
    assert capped.exit_code == 0, capped.output
    assert "read the first 100 tokens" in capped.output and "wrote" in capped.output
    tokens = int(re.search(r"MB\): (\d+) tokens", capped.output).group(1))
    assert 95 <= tokens <= 101
    monkeypatch.setattr(inspect_module, "MAX_TOKENS", 60)  # the default cap applies without the flag
    default = invoke(sparsek_run, "--text", tmp_path / "long.txt", "--out", tmp_path / "default.html")
    assert default.exit_code == 0 and "read the first 60 tokens" in default.output
    assert (tmp_path / "default.html").stat().st_size < (tmp_path / "cap.html").stat().st_size < 200_000


def test_a_png_too_tall_is_refused_before_the_model_pass(sparsek_run, tmp_path, monkeypatch):
    import longtrain.eval.inspect as inspect_module

    def no_pass(*args, **kwargs):
        raise AssertionError("the model pass ran before the size check")

    monkeypatch.setattr(inspect_module, "selection_map", no_pass)
    (tmp_path / "tall.txt").write_text("the ship\n" * 800)  # 800 rows per layer: 2,400 for three layers
    every = invoke(sparsek_run, "--text", tmp_path / "tall.txt", "--out", tmp_path / "x.png", "--max-tokens", 10_000)
    msg = " ".join(every.output.split())
    assert every.exit_code == 2 and "too tall for a PNG" in msg and "pick one layer with --layer" in msg
    (tmp_path / "tall.txt").write_text("the ship\n" * 1600)
    one = invoke(sparsek_run, "--text", tmp_path / "tall.txt", "--out", tmp_path / "x.png", "--layer", 1, "--max-tokens", 10_000)
    msg = " ".join(one.output.split())
    assert one.exit_code == 2 and "too tall for a PNG" in msg and "--layer" not in msg
    assert not (tmp_path / "x.png").exists()


def test_a_character_cut_by_the_bounded_read_is_dropped_not_refused():
    from longtrain.eval.inspect import InspectError, read_text

    cut_inside = "caféé".encode()[:-1]  # the last é's second byte is missing
    assert read_text(cut_inside, "f.txt", cut=True) == "café"
    with pytest.raises(InspectError, match="not UTF-8 text"):
        read_text(cut_inside, "f.txt")  # a whole file that ends mid-character is not UTF-8


@pytest.mark.parametrize("max_tokens, pool", [(5, 0), (10, 3), (None, 6)])
def test_the_legend_says_how_many_tokens_are_boxed(sparsek_run, tmp_path, max_tokens, pool):
    """k = 6, w = 8: the pool holds what left the window, min(k, T − w + 1) tokens; none at 5 tokens."""
    out = tmp_path / "sel.html"
    r = invoke(sparsek_run, "--text", sparsek_run / "page.txt", "--out", out,
               *(["--max-tokens", max_tokens] if max_tokens else []))
    assert r.exit_code == 0, r.output
    page = html_lib.unescape(out.read_text())
    legend = re.search(r"<p class=legend>(.*?)</p>", page, flags=re.S).group(1)
    assert page.count('class="pool') == 3 * pool  # what is boxed, in each of the 3 panels
    assert pool == 6 or "the 6 pool tokens" not in legend  # before: k whatever the pool held
    if pool == 0:
        assert "boxed: none, the pool holds no tokens yet at the end of these 5 tokens" in legend
        assert "underlined: all 5 tokens, all in the window of 8" in legend
    else:
        assert f"boxed: the {pool} tokens in the pool after the last token" in legend
        assert ("(it holds up to 6)" in legend) == (pool < 6) and "underlined: the last 8 tokens" in legend
    assert page.count(f"{pool} token{'s' if pool != 1 else ''} in the pool at the end") == 3
