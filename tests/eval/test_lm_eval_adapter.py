"""The lm-evaluation-harness adapter: its log-likelihoods are the model's own per-token loss, its generations
the decoder's; a local YAML task runs through lm-eval and `longtrain eval --task lm-eval:...`; bad input."""

import importlib.util
import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.data import IGNORE
from longtrain.data.tokenizer import eod_id
from longtrain.generate import generate
from longtrain.train.checkpoint import load_checkpoint

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-evaluation-harness is an optional extra: pip install 'longtrain[eval]'")

CONTEXT = "the captain wrote a letter in the morning and the house was quiet"
CHOICES = [" by the river.", " to his garden", " silence"]


def request(kind, *args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@torch.no_grad()
def own_loss(model, ids: list[int], scored_from: int) -> tuple[float, bool]:
    """(−summed loss, greedy) of ids[scored_from:] by the model's own unchunked forward with targets."""
    x = torch.tensor([ids[:-1]])
    targets = torch.tensor([ids[1:]])
    targets[:, : scored_from - 1] = IGNORE
    loss = model(x, targets=targets).loss_sum
    logits = model(x).logits[0, scored_from - 1 :]
    return -float(loss), bool((logits.argmax(-1) == torch.tensor(ids[scored_from:])).all())


@pytest.fixture(scope="module", params=["sparsek", "sw", "full"])
def adapter(request, runs):
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-evaluation-harness is an optional extra: pip install 'longtrain[eval]'")
    from longtrain.eval.lm_eval_model import LongtrainLM

    ckpt = load_checkpoint(runs[request.param], dtype=torch.float64)
    return LongtrainLM(loaded=ckpt, chunk_size=16)  # many chunks: the cache is carried


def test_loglikelihood_is_the_models_own_loss(adapter):
    reqs = [request("loglikelihood", CONTEXT + " ", c) for c in CHOICES] + [request("loglikelihood", "", CONTEXT)]
    got = adapter.loglikelihood(reqs)
    for r, (ll, greedy) in zip(reqs, got):
        ctx, cont = adapter.encode_pair(*r.args)
        assert cont and adapter.tok.decode(ctx + cont) == r.args[0] + r.args[1]
        ctx = ctx or [eod_id(adapter.tok)]
        want, want_greedy = own_loss(adapter.model, ctx + cont, len(ctx))
        assert ll == pytest.approx(want, rel=1e-9, abs=1e-9)
        assert greedy == want_greedy


def test_rolling_loglikelihood_scores_every_token_after_the_eod(adapter):
    text = " ".join([CONTEXT] * 6)  # ~15 chunks of 16 tokens
    (got,) = adapter.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    ids = [eod_id(adapter.tok)] + adapter.encode(text)
    assert got == pytest.approx(own_loss(adapter.model, ids, 1)[0], rel=1e-9)


def test_generate_until_is_the_decoders_text_cut_at_the_stop(adapter):
    (free,) = adapter.generate_until([request("generate_until", CONTEXT, {"until": ["\u2603"], "max_gen_toks": 12})])
    eod = eod_id(adapter.tok)
    out = generate(adapter.model, adapter.encode(CONTEXT), max_new_tokens=12, chunk_size=16, eod_id=eod).rows[0].tokens
    assert free == adapter.tok.decode([t for t in out if t != eod])
    stop = free.strip()[:2]
    if stop:
        (cut,) = adapter.generate_until([request("generate_until", CONTEXT, {"until": [stop], "max_gen_toks": 12})])
        assert cut == free.split(stop)[0]


def test_generate_until_in_batches_gives_each_requests_own_text(adapter):
    reqs = [request("generate_until", c, {"until": ["\u2603"], "max_gen_toks": n})
            for c, n in [(CONTEXT, 5), ("the ship", 9), ("in the morning the river was", 3)]]
    alone = [adapter.generate_until([r])[0] for r in reqs]
    adapter.rows = 3
    try:
        assert adapter.generate_until(reqs) == alone
    finally:
        adapter.rows = 1


# ----------------------------------------------------------------------------- through lm-eval


def write_task(folder, name="longtrain_tiny_mc", dataset="json"):
    rows = [{"context": CONTEXT, "choices": [c.strip() for c in CHOICES], "label": 0},
            {"context": "the ship was on the river in the evening", "choices": ["and the mountain", "quiet house"], "label": 1}]
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kwargs = f"dataset_kwargs:\n  data_files:\n    test: {data}\n" if dataset == "json" else ""
    yaml = folder / f"{name}.yaml"
    yaml.write_text(
        f"task: {name}\ndataset_path: {dataset}\n{kwargs}test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return yaml, rows


@needs_lm_eval
def test_a_local_task_through_longtrain_eval_scores_as_computed_directly(runs, tmp_path):
    yaml, rows = write_task(tmp_path)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["eval", str(runs["sparsek"]), "--task", f"lm-eval:{yaml}", "--json", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())["results"][0]["lm-eval"]
    assert got["tasks"] == ["longtrain_tiny_mc"] and got["n-samples"]["longtrain_tiny_mc"]["effective"] == 2

    from longtrain.eval.lm_eval_model import LongtrainLM

    lm = LongtrainLM(loaded=load_checkpoint(runs["sparsek"]))
    correct = []
    for r in rows:  # lm-eval's multiple choice: context, then " " + choice; the best log-likelihood wins
        lls = [lm.score(*lm.encode_pair(r["context"], " " + c))[0] for c in r["choices"]]
        correct.append(max(range(len(lls)), key=lls.__getitem__) == r["label"])
    assert got["results"]["longtrain_tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(rows))
    assert "longtrain_tiny_mc acc" in res.output and "sample_len" not in res.output


@needs_lm_eval
def test_offline_hub_task_says_so(runs, tmp_path, monkeypatch):
    yaml, _ = write_task(tmp_path, "longtrain_hub_task", dataset="longtrain-tests/no-such-dataset")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    res = CliRunner().invoke(app, ["eval", str(runs["sparsek"]), "--task", f"lm-eval:{yaml}"])
    assert res.exit_code == 1, res.output
    assert "downloaded from the Hugging Face hub, which cannot be reached" in " ".join(res.output.split())


@needs_lm_eval
def test_unknown_task_names_are_refused_with_close_ones(runs, monkeypatch):
    from longtrain.eval import harness

    class Manager:
        all_tasks = ["lambada_openai", "lambada_standard", "hellaswag"]

    monkeypatch.setattr(harness, "task_manager", lambda folders, local_only: Manager())
    res = CliRunner().invoke(app, ["eval", str(runs["sparsek"]), "--task", "lm-eval:lambada_opnai"])
    assert res.exit_code == 2
    assert "no lm-eval task named lambada_opnai (lambada_opnai: did you mean lambada_openai" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["eval", str(runs["sparsek"]), "--task", "lm-eval"])
    assert res.exit_code == 2 and "--task lm-eval needs task names" in res.output


def test_missing_lm_eval_names_the_install_line(runs, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    res = CliRunner().invoke(app, ["eval", str(runs["sparsek"]), "--task", "lm-eval:hellaswag"])
    assert res.exit_code == 1
    assert "pip install 'longtrain[eval]'" in res.output


@needs_lm_eval
def test_model_args_come_before_lm_evals_own_flags(runs):
    """`lm_eval --model longtrain --model_args checkpoint=RUN,device=cpu` with lm-eval's --device cuda: model_args win."""
    from lm_eval.api.registry import get_model

    import longtrain.eval.lm_eval_model  # noqa: F401  (registers "longtrain")

    lm = get_model("longtrain").create_from_arg_string(
        f"checkpoint={runs['sw']},device=cpu,dtype=float64,chunk_size=16", {"device": "cuda", "batch_size": 4}
    )
    assert lm.dev.type == "cpu" and lm.model.embed.weight.dtype == torch.float64 and lm.chunk == 16
