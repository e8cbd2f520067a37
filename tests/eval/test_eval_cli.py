"""`longtrain eval` through the CLI on real tiny checkpoints: several at once, the JSON schema, the plot, bad input."""

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.eval import passkey
from longtrain.data import TokenizerConfig, default_cache_dir, prepare_corpus
from longtrain.eval.documents import eval_documents
from longtrain.train.checkpoint.storage import CheckpointManager, load, validate
from longtrain.train.checkpoint import load_recipe_and_tokenizer, resolve_checkpoint

runner = CliRunner()
PPL_FAST = ["--docs", "2", "--tokens", "200"]  # what ppl reads
FAST = [*PPL_FAST, "--max-len", "256", "--trials", "1"]  # and passkey: --task all


def evaluate(*args):
    return runner.invoke(app, ["eval", *args])


def _depth_of(tokenizer, prompt) -> float:
    """The depth whose passkey prompt (same length, same key) is this prompt's tokens."""
    depths = [d for d in passkey.DEPTHS if passkey.passkey_prompt(tokenizer, len(prompt.ids), d, prompt.key).ids == prompt.ids]
    assert len(depths) == 1, depths  # the depths' prompts differ at this length (not at 256: no room for filler)
    return depths[0]


def _stub_answer(monkeypatch, knows, *, decode: bool = True) -> list[list[int]]:
    """Stub passkey's `answer` (around the real one: with `decode`, the model still decodes): the true key where
    knows(model, tokenizer, prompt), else a wrong number (the key and a 0). Returns each batch's prompt lengths."""
    batches, real = [], passkey.answer

    def stub(model, tokenizer, prompts, chunk_size):
        batches.append([len(p.ids) for p in prompts])
        texts = real(model, tokenizer, prompts, chunk_size) if decode else [""] * len(prompts)
        assert len(texts) == len(prompts) and all(isinstance(t, str) for t in texts)
        return [f" {p.key}. Remember" if knows(model, tokenizer, p) else f" {p.key}0 {t}" for p, t in zip(prompts, texts)]

    monkeypatch.setattr(passkey, "answer", stub)
    return batches


def _expect(cells, lengths, trials, hit):
    """Cells per (length, depth) in order; accuracy 1 where hit(length, depth), else 0."""
    assert [(c["length"], c["depth"]) for c in cells] == [(n, d) for n in lengths for d in passkey.DEPTHS]
    for c in cells:
        h = hit(c["length"], c["depth"])
        assert c["trials"] == trials and c["accuracy"] == (1.0 if h else 0.0) and c["correct"] == (trials if h else 0), c


def test_two_checkpoints_one_table_one_json_one_plot(runs, tmp_path, monkeypatch):
    batches = _stub_answer(monkeypatch, lambda model, tok, p: model.cfg.attention == "sparsek+sw")  # sw never knows
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    res = evaluate(str(runs["sparsek"]), str(runs["sw"]), *FAST, "--json", str(out), "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert "sparsek/step-00000005" in res.output and "sw/step-00000005" in res.output
    assert "positions [0, 1k)" in res.output and "passkey at 256 tokens" in res.output and "KV budget" in res.output

    results = json.loads(out.read_text())["results"]
    assert [r["attention"] for r in results] == ["sparsek+sw (k=8, w=8)", "sw (w=16)"]
    assert [r["kv_budget"] for r in results] == [16, 16]
    for r in results:
        assert set(r) >= {"checkpoint", "attention", "kv_budget", "ppl", "passkey"}
        p = r["ppl"]
        assert isinstance(p["loss"], float) and isinstance(p["ppl"], float) and isinstance(p["tokens"], int)
        assert p["tokens"] == sum(b["tokens"] for b in p["buckets"]) > 0
        for b in p["buckets"]:
            assert set(b) == {"start", "end", "tokens", "loss", "ppl"}
        assert [(c["length"], c["depth"]) for c in r["passkey"]] == [(256, d) for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    _expect(results[0]["passkey"], [256], 1, lambda n, d: True)
    _expect(results[1]["passkey"], [256], 1, lambda n, d: False)
    assert batches == [[256] * 5] * 2  # one batch of the five depths per checkpoint
    table = " ".join(res.output.split())
    assert "1.00 (depths 1.00 1.00 1.00 1.00 1.00)" in table and "0.00 (depths 0.00 0.00 0.00 0.00 0.00)" in table
    assert results[0]["ppl"]["tokens"] == results[1]["ppl"]["tokens"]  # the same documents for both
    assert results[0]["ppl"]["loss"] != results[1]["ppl"]["loss"]  # different models
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_passkey_grid_scores_each_depth_and_length_apart(runs, tmp_path, monkeypatch):
    """Several lengths, trials spilling over a batch of ROWS prompts: each cell counts its own prompts."""
    batches = _stub_answer(monkeypatch, lambda model, tok, p: _depth_of(tok, p) == 0.5, decode=False)
    out = tmp_path / "passkey.json"
    res = evaluate(str(runs["sw"]), "--task", "passkey", "--max-len", "1500", "--trials", "3", "--json", str(out))
    assert res.exit_code == 0, res.output
    _expect(json.loads(out.read_text())["results"][0]["passkey"], [1024, 1500], 3, lambda n, d: d == 0.5)
    assert batches == [[1024] * passkey.ROWS, [1024] * 7, [1500] * passkey.ROWS, [1500] * 7]


def test_default_documents_are_the_runs_validation_split_from_fits_token_cache(runs, tmp_path):
    """The validation documents come through the cache `fit` filled: no second tokenization."""
    path = resolve_checkpoint(runs["sparsek"])
    recipe, tok = load_recipe_and_tokenizer(path)
    tok_file = tmp_path / "tok.json"
    tok_file.write_text(tok.to_str())
    corpus = prepare_corpus(recipe.data, TokenizerConfig(path=str(tok_file)), progress=False)
    entries = {p.name for p in default_cache_dir().iterdir() if p.is_dir()}
    docs = eval_documents(recipe, tok, None, progress=False)
    assert {p.name for p in default_cache_dir().iterdir() if p.is_dir()} == entries  # nothing new written
    assert len(docs) == len(corpus.valid) == 2
    assert all(np.array_equal(docs.doc(i), corpus.valid.doc(i)) for i in range(len(docs)))


def test_data_glob_and_single_task(runs, corpus, tmp_path):
    out = tmp_path / "ppl.json"
    res = evaluate(str(runs["sparsek"]), "--task", "ppl", "--data", str(corpus / "doc[01].txt"), "--docs", "5",
                   "--tokens", "150", "--chunk-size", "50", "--json", str(out))
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())["results"][0]
    assert "passkey" not in r and r["ppl"]["documents"] == 2 and r["ppl"]["chunk_size"] == 50
    assert r["ppl"]["tokens"] == 2 * 150
    one = evaluate(str(runs["sparsek"]), "--task", "ppl", "--data", str(corpus / "doc0.txt"), "--tokens", "100")
    assert one.exit_code == 0 and "all positions (1 doc)" in one.output


def test_full_attention_passkey_has_no_budget(runs, tmp_path):
    out = tmp_path / "full.json"
    res = evaluate(str(runs["full"]), "--task", "passkey", "--max-len", "256", "--trials", "1", "--json", str(out))
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())["results"][0]
    assert r["kv_budget"] is None and "all keys (full attention)" in res.output


def _check_error(res, code: int, *messages: str):
    assert res.exit_code == code, res.output
    for m in messages:
        assert m in res.output, res.output
    assert "Traceback" not in res.output


def test_a_path_that_is_no_checkpoint_or_run_dir(tmp_path):
    # an existing folder without a checkpoint: a CheckpointError, exit 1 (what is on disk is wrong)
    _check_error(evaluate(str(tmp_path), *FAST), 1, "neither a checkpoint", "longtrain fit")
    # no such path: exit 2, whatever is on disk the command line cannot work
    _check_error(evaluate(str(tmp_path / "nowhere"), *FAST), 2, "does not exist")


def test_a_run_dir_with_no_complete_checkpoint(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["sparsek"], run)
    step = next((run / "checkpoints").iterdir())
    (step / "model.safetensors").write_bytes(b"truncated")
    _check_error(evaluate(str(run), *FAST), 1, "none has intact weights", "model.safetensors is truncated")
    assert "resume" not in evaluate(str(run), *FAST).output  # resuming a run with no checkpoint starts at step 1


def test_read_only_verbs_need_only_the_weights(runs, tmp_path):
    """Issue 31: intact weights but a damaged optimizer.safetensors: eval, generate, export and inspect
    read the checkpoint (a run dir picks it, not an older one)."""
    run = tmp_path / "run"
    shutil.copytree(runs["sparsek"], run)
    old = next((run / "checkpoints").iterdir())
    tensors, meta = load(old)
    files = {name: (old / name).read_bytes() for name in ("recipe.yaml", "tokenizer.json")}
    step = CheckpointManager(run, keep=3).save(
        9, tensors={**tensors, "optimizer": {"state.0.exp_avg": torch.ones(4)}}, meta={"step": 9}, files=files
    )
    (step / "optimizer.safetensors").write_bytes(b"damaged")
    assert "optimizer.safetensors" in validate(step)
    assert resolve_checkpoint(run) == step
    for target in (run, step):
        res = evaluate(str(target), "--task", "ppl", *PPL_FAST)
        assert res.exit_code == 0 and "step-00000009" in res.output, res.output
    res = runner.invoke(app, ["generate", str(run), "--prompt", "the river", "--max-new-tokens", "3"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["export", str(step), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0 and (tmp_path / "hf/model.safetensors").is_file(), res.output
    (tmp_path / "t.txt").write_text("the river and the house")
    res = runner.invoke(app, ["inspect", str(step), "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "i.html")])
    assert res.exit_code == 0, res.output


def test_a_checkpoint_without_a_tokenizer_anywhere(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["sparsek"], run)
    step = next((run / "checkpoints").iterdir())
    (step / "tokenizer.json").unlink()
    meta = json.loads((step / "meta.json").read_text())  # keep the checkpoint complete: drop the file's record
    meta["files"] = {k: v for k, v in meta.get("files", {}).items() if k != "tokenizer.json"}
    (step / "meta.json").write_text(json.dumps(meta))
    _check_error(evaluate(str(step), *FAST), 1, "no tokenizer.json", "copy the run's tokenizer.json")


def test_data_that_matches_no_documents(runs, tmp_path):
    _check_error(evaluate(str(runs["sparsek"]), "--data", str(tmp_path / "none-*.txt"), *FAST), 2, "matches no files")
    (tmp_path / "notes.md").write_text("not a document type")
    _check_error(evaluate(str(runs["sparsek"]), "--data", str(tmp_path), *FAST), 2, "No readable documents")


def test_max_len_too_long_for_full_attention_on_the_cpu_is_a_hint_not_a_hang(runs):
    _check_error(evaluate(str(runs["full"]), "--max-len", "100000", "--device", "cpu"), 2, "--max-len 100,000",
        "Use --max-len 16,384 or less, or a CUDA device")


def test_bad_options(runs, tmp_path):
    ckpt = str(runs["sparsek"])
    _check_error(evaluate(ckpt, "--task", "recal"), 2, "--task must be one of all, ppl, passkey")
    _check_error(evaluate(ckpt, "--trials", "0"), 2, "--trials")
    _check_error(evaluate(ckpt, "--docs", "0"), 2, "--docs")
    _check_error(evaluate(ckpt, "--plot", str(tmp_path / "x.jpg")), 2, "must end in .png")
    _check_error(evaluate(ckpt, "--json", str(tmp_path / "no" / "x.json")), 2, "does not exist")
    _check_error(evaluate(ckpt, "--dtype", "float16"), 2, "--dtype")


def test_an_option_no_chosen_task_reads_is_refused(runs, monkeypatch):
    """Not ignored: passkey's lengths come from --max-len, so --tokens there would change nothing."""
    from longtrain.eval import runner as eval_runner

    monkeypatch.setattr(eval_runner, "load_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))
    ckpt = str(runs["sparsek"])
    _check_error(evaluate(ckpt, "--task", "passkey", "--tokens", "1024"), 2,
                 "--tokens 1024 has no effect with --task passkey: only ppl and recall read it")
    _check_error(evaluate(ckpt, "--task", "ppl", "--max-len", "4096"), 2,
                 "--max-len 4096 has no effect with --task ppl: only passkey and ruler read it")
    _check_error(evaluate(ckpt, "--task", "ruler", "--docs", "3"), 2, "--docs 3 has no effect", "run --task ppl")
    _check_error(evaluate(ckpt, "--task", "ppl", "--recall-scale", "2"), 2, "only recall reads it")
    _check_error(evaluate(ckpt, "--task", "passkey", "--limit", "5"), 2, "only lm-eval reads it")


def test_a_recall_runs_documents_are_its_held_out_recall_documents(tmp_path):
    """`data.source: recall`: eval reads the generated documents `fit` held out, not their filler."""
    from longtrain.data.recall import FILLER_WORDS, Symbols
    from longtrain.data.tokenizer import train_bpe
    from longtrain.model import LM, LMConfig
    from longtrain.train.checkpoint import CheckpointManager
    from longtrain.train.checkpoint import checkpoint_files
    from longtrain.train.recipe import load_recipe

    rng = np.random.default_rng(0)
    tok = train_bpe([" ".join(rng.choice(FILLER_WORDS, 3000))], vocab_size=300)
    recall = {"docs": 6, "doc_tokens": 192, "facts": 2, "min_distance": 16, "max_distance": 96, "key_length": 2,
              "value_length": 2, "seed": 3}
    recipe = load_recipe("quickstart", [
        "model.layers=2", "model.d_model=32", "model.heads=2", "attention.topk=8", "attention.window=8",
        "data.source=recall", f"data.recall={json.dumps(recall)}", "data.valid=0.34",
        "tokenizer.vocab_size=300", "train.chunk_size=64", "train.batch_docs=2", "train.device=cpu",
    ])
    model = LM(LMConfig.from_recipe(recipe.model, recipe.attention, vocab_size=tok.get_vocab_size()))
    run = tmp_path / "run"
    CheckpointManager(run, keep=1).save(1, tensors={"model": model.state_dict()}, meta={}, files=checkpoint_files(recipe, tok))

    tok_file = tmp_path / "tok.json"
    tok_file.write_text(tok.to_str())
    valid = prepare_corpus(recipe.data, TokenizerConfig(path=str(tok_file)), progress=False).valid
    docs = eval_documents(recipe, tok, None, progress=False)
    assert len(docs) == len(valid) == 2
    assert all(np.array_equal(docs.doc(i), valid.doc(i)) for i in range(len(docs)))
    sym = Symbols.of(tok)
    assert all((docs.doc(i) == sym.query).sum() == recall["facts"] for i in range(len(docs)))  # recall documents

    out = tmp_path / "ppl.json"
    res = evaluate(str(run), "--task", "ppl", "--docs", "8", "--device", "cpu", "--json", str(out))
    assert res.exit_code == 0, res.output
    ppl = json.loads(out.read_text())["results"][0]["ppl"]
    assert ppl["documents"] == 2 and ppl["tokens"] == 2 * (recall["doc_tokens"] - 1)


def test_checkpoint_paths_in_eval_generate_and_inspect(runs, tmp_path):
    """No such path or a file: exit 2 (the command line cannot work); a folder without a checkpoint: exit 1,
    saying what is missing; a run dir, its checkpoints folder and a checkpoint folder all work."""
    page = tmp_path / "page.txt"
    page.write_text("the river and the house by the window")
    step = next((runs["sparsek"] / "checkpoints").iterdir())
    (tmp_path / "empty").mkdir()
    verbs = {
        "eval": lambda c: ["eval", c, "--task", "ppl", *PPL_FAST],
        "generate": lambda c: ["generate", c, "--prompt", "the river", "--max-new-tokens", "2"],
        "inspect": lambda c: ["inspect", c, "--text", str(page), "--out", str(tmp_path / "i.html")],
    }
    for verb, args in verbs.items():
        run = lambda c: runner.invoke(app, args(str(c)))  # noqa: E731
        _check_error(run(tmp_path / "nowhere"), 2, f"checkpoint {tmp_path / 'nowhere'} does not exist",
                     "give a checkpoint folder")
        _check_error(run(runs["sparsek"].parent / "sparsk"), 2, f"did you mean {runs['sparsek']}?")  # a typo
        _check_error(run(page), 2, f"checkpoint {page} is a file, not a folder")
        _check_error(run(step / "model.safetensors"), 2, "is a file, not a folder", f"give its checkpoint folder {step}")
        _check_error(run(tmp_path / "empty"), 1, "neither a checkpoint (no meta.json)", "train one with `longtrain fit`")
        for accepted in (runs["sparsek"], step.parent, step):
            res = run(accepted)
            assert res.exit_code == 0, (verb, accepted, res.output)


def test_recall_documents_are_tokens_long(runs, tmp_path):
    """--tokens sets the recall documents' length (the facts at the training's density, the farthest distance
    what fits); full attention's legend names no KV budget, SparseK's explains its mark."""
    out = tmp_path / "recall.json"
    res = evaluate(str(runs["full"]), str(runs["sparsek"]), "--task", "recall", "--tokens", "600", "--docs", "1",
                   "--device", "cpu", "--json", str(out))
    assert res.exit_code == 0, res.output
    full, sparsek = json.loads(out.read_text())["results"]
    for r in (full, sparsek):  # RecallConfig's defaults: 4,096 tokens, 8 facts, distances 256–2,048, lines of 10 tokens
        s = r["recall"]["settings"]
        assert (s["doc_tokens"], s["facts"], s["min_distance"], s["max_distance"]) == (600, 1, 256, 589), s
    text = " ".join(res.output.split())
    assert "documents of 600 tokens (1 fact each, queried 256–589 tokens later)" in text
    assert "recall, full attention: every earlier token stays in the KV cache (no KV budget)" in text
    assert "›16(k+w): at least 16 times the KV budget (k + w keys a query sees)" in text  # the sparsek column's
    alone = evaluate(str(runs["full"]), "--task", "recall", "--tokens", "600", "--docs", "1", "--device", "cpu")
    assert alone.exit_code == 0 and "›16(k+w)" not in alone.output and "KV budget (k" not in alone.output, alone.output
    for args, message in [
        (["--tokens", "100"], "--tokens 100 is too short for a recall document"),
        (["--tokens", "600", "--recall-scale", "2"], "--tokens and --recall-scale both set the length"),
        (["--tokens", "600", "--recall-max-distance", "700"], "give at most 589, or a larger --tokens"),
    ]:
        _check_error(evaluate(str(runs["sparsek"]), "--task", "recall", *args), 2, message)
