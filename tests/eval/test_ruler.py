"""RULER's tasks: each generator is deterministic, fits its length and puts the needles and answers where it
says; scoring is RULER's exact match; `longtrain eval --task ruler` runs, scores and refuses bad input."""

import json
import re
from collections import Counter

import pytest
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.eval.ruler import task as ruler_task
from longtrain.eval.ruler.prompts import (
    NEEDLE,
    NOISE,
    TASKS,
    Niah,
    PromptTooLong,
    book_sentences,
    make_sample,
)
from longtrain.eval.ruler.scoring import match_all, postprocess, string_match_all

# The shortest length each task fits in the tests' 300-token vocabulary (prompts cost more tokens there).
LENGTH = {name: 1024 for name in TASKS} | {"vt": 2048, "cwe": 8192}


@pytest.fixture(scope="module")
def haystack(corpus):
    return book_sentences([p.read_text() for p in sorted(corpus.glob("*.txt"))])


def sample(name, tokenizer, haystack, **kw):
    return make_sample(name, tokenizer, kw.pop("length", LENGTH[name]), haystack=haystack, **kw)


@pytest.mark.parametrize("name", list(TASKS))
def test_samples_are_deterministic_and_fill_their_length(name, tokenizer, haystack):
    a, b = sample(name, tokenizer, haystack, seed=3, index=1), sample(name, tokenizer, haystack, seed=3, index=1)
    assert a.ids == b.ids and a.answers == b.answers
    other = sample(name, tokenizer, haystack, seed=3, index=2)
    assert other.answers != a.answers
    assert a.ids == tokenizer.encode(a.text, add_special_tokens=False).ids
    length, budget = LENGTH[name], LENGTH[name] - TASKS[name].max_new_tokens
    assert len(a.ids) <= budget
    # the most haystack that fits: one more unit would not
    bigger = make_sample(name, tokenizer, length, seed=3, index=1, haystack=haystack, guess=a.haystack_units + 1)
    assert bigger.haystack_units == a.haystack_units
    assert len(a.ids) > budget // 2 and a.haystack_units > TASKS[name].min_units


@pytest.mark.parametrize("name", [n for n, spec in TASKS.items() if isinstance(spec, Niah)])
def test_needles_sit_where_the_sample_says(name, tokenizer, haystack):
    spec = TASKS[name]
    s = sample(name, tokenizer, haystack, index=5)
    assert len(s.needles) == spec.keys * spec.values == len(s.depths)
    assert s.depths == sorted(s.depths) and all(0 <= d <= 1 for d in s.depths)
    for (offset, needle), depth in zip(s.needles, s.depths):
        assert s.text[offset : offset + len(needle)] == needle
        assert s.text.count(needle) == 1
        if spec.haystack == "repeat":  # the needle follows depth x n noise sentences
            assert s.text[:offset].count(NOISE) == round(depth * s.haystack_units)
    pattern = re.escape(NEEDLE).replace(r"\{type_v\}", r"\w+").replace(r"\{key\}", "(.+?)").replace(r"\{value\}", "(.+?)")
    found = [re.fullmatch(pattern, n).groups() for _, n in s.needles]
    keys = {k for k, _ in found}
    asked = [k for k in keys if k in s.text.split("\n")[-1]]  # the question names the asked keys
    assert len(asked) == spec.queries
    assert sorted(s.answers) == sorted(v for k, v in found if k in asked)
    if spec.haystack == "needle":  # the haystack is other keys' needles, none with an asked key
        assert s.text.count("One of the special magic") == s.haystack_units + len(s.needles)
    if spec.values * spec.queries == 1:
        assert s.text.startswith("A special magic number is hidden") or s.text.startswith("A special magic uuid is hidden")
        assert s.text.endswith("mentioned in the provided text is")
    else:
        assert s.text.endswith("mentioned in the provided text are")


def test_variable_tracking_chain(tokenizer, haystack):
    s = sample("vt", tokenizer, haystack, index=2)
    main = s.text.index("Memorize and track", 1)  # the in-context example first, its answer written out
    assert s.text.startswith("Memorize and track") and s.text[:main].endswith(" they are: " + " ".join(
        re.findall(r"VAR ([A-Z]{3}) =", s.text[:main])) + "\n\n")
    assert s.needles[0][0] > main
    statements = [n for _, n in s.needles]
    value = re.fullmatch(r"VAR [A-Z]{5} = (\d{5})\.", statements[0]).group(1)
    assert statements == [f"VAR {s.answers[0]} = {value}."] + [
        f"VAR {s.answers[i + 1]} = VAR {s.answers[i]}." for i in range(4)
    ]
    offsets = [o for o, _ in s.needles]
    assert offsets == sorted(offsets) and all(s.text[o : o + len(n)] == n for o, n in s.needles)
    assert s.text.endswith(f"5 variables are assigned the value {value}, they are: ")


def test_common_words_counts(tokenizer, haystack):
    s = sample("cwe", tokenizer, haystack, index=1)
    main = s.text.split("\nBelow is a numbered list")[-1]  # after the in-context example
    listed = Counter(re.findall(r"\d+\. ([a-z]+)", main.split("\nQuestion:")[0]))
    assert len(s.answers) == 10 and all(listed[w] == 30 for w in s.answers)
    assert set(listed.values()) == {30, 3} and len(listed) == s.haystack_units


def test_frequent_words_counts(tokenizer, haystack):
    s = sample("fwe", tokenizer, haystack, index=1)
    context = s.text.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    ranked = [w for w, _ in Counter(context.split()).most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.answers


def test_too_short_and_lengths(tokenizer):
    with pytest.raises(PromptTooLong, match="needs at least"):
        make_sample("cwe", tokenizer, 1024)
    assert ruler_task.ruler_lengths(16384) == [4096, 8192, 16384]
    assert ruler_task.ruler_lengths(20000) == [4096, 8192, 16384, 20000]
    assert ruler_task.ruler_lengths(1500) == [1500]


def test_scoring_is_rulers_string_match_all():
    assert postprocess("  12\x0034 \n") == "12\n34"
    assert match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert match_all("ABCDE abcde", ["abcde"]) == 1.0  # case-insensitive
    assert match_all(" 123456", ["1234567"]) == 0.0
    assert string_match_all(["a b", "c", "x"], [["a", "b"], ["c", "d"], ["y"]]) == pytest.approx(100 * 1.5 / 3)
    with pytest.raises(ValueError):
        string_match_all(["a"], [])


# ----------------------------------------------------------------------------- the eval task


def test_eval_task_scores_the_continuations(runs, tmp_path, monkeypatch, corpus):
    """Through the CLI: prompts reach the model, continuations are scored per task and length."""
    seen = []

    def answer_half(model, tokenizer, prompts, max_new_tokens, chunk_size):
        out = []
        for ids in prompts:
            seen.append((len(ids), max_new_tokens))
            s = next(x for x in made if x.ids == ids)
            out.append(" " + " ".join(s.answers[: (len(s.answers) + 1) // 2]) if s.index == 0 else " nothing")
        return out

    made = []
    real = ruler_task.make_sample
    monkeypatch.setattr(ruler_task, "make_sample", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    monkeypatch.setattr(ruler_task, "continuations", answer_half)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["eval", str(runs["sparsek"]), "--task", "ruler:niah_single_1,niah_multivalue",
                                   "--max-len", "1024", "--trials", "2", "--data", str(corpus / "*.txt"), "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())["results"][0]["ruler"]
    assert r["lengths"] == [1024] and r["tasks"] == ["niah_single_1", "niah_multivalue"]
    scores = {c["task"]: c["score"] for c in r["cells"]}
    assert scores == {"niah_single_1": 50.0, "niah_multivalue": 25.0}  # sample 0: all / half of the answers
    assert all(n <= 1024 - m for n, m in seen) and len(seen) == 4
    assert "KV budget (k + w)" in res.output and "›k+w" in res.output


def test_eval_task_runs_the_model(runs, tmp_path, monkeypatch):
    """The real model: the prediction is its greedy continuation of the prompt, scored by RULER's match."""
    from longtrain.data.tokenizer import eod_id
    from longtrain.generate import generate_batch
    from longtrain.train.checkpoint import load_checkpoint

    made = []
    real = ruler_task.make_sample
    monkeypatch.setattr(ruler_task, "make_sample", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(app, ["eval", str(runs["sw"]), "--task", "ruler:niah_single_1", "--max-len", "512",
                                   "--trials", "1", "--device", "cpu", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    cell = json.loads(out.read_text())["results"][0]["ruler"]["cells"][0]
    (s,) = made
    got = cell["samples"][0]
    assert got["prompt_tokens"] == len(s.ids) <= 512 - 128 and got["answers"] == s.answers and s.max_new_tokens == 128
    ckpt = load_checkpoint(runs["sw"])  # float32 on the cpu, as the eval ran
    want = generate_batch(ckpt.model, [s.ids], max_new_tokens=s.max_new_tokens, eod_id=eod_id(ckpt.tokenizer),
                          tokenizer=ckpt.tokenizer).rows[0]
    assert len(want.tokens) == s.max_new_tokens or want.stopped == "end_of_document"
    assert isinstance(got["prediction"], str) and got["prediction"] == want.text
    assert got["score"] == match_all(want.text, s.answers) and cell["score"] == 100 * got["score"]
    assert png.stat().st_size > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--task", "ruler:niah_single_1,nope"], "no RULER task nope; the tasks are niah_single_1"),
    (["--task", "ruler:cwe", "--max-len", "1024"], "the RULER task cwe needs at least"),
    (["--task", "ruler", "--trials", "0"], "--trials must be at least 1"),
    (["--task", "nope"], "ruler[:TASK,TASK,...]"),
    (["--task", "passkey:x"], "--task passkey takes no argument"),
])
def test_bad_input_is_refused_before_the_model_loads(runs, args, message, monkeypatch):
    from longtrain.eval import runner

    monkeypatch.setattr(runner, "load_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))
    res = CliRunner().invoke(app, ["eval", str(runs["sparsek"]), *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
