"""Every error reaches the user through `LongtrainError`: its message, and its class's exit code, in every verb."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from typer.testing import CliRunner

import longtrain
from longtrain import errors
from longtrain.cli import app

PACKAGE = Path(longtrain.__file__).parent


def invoke(*args):
    return CliRunner().invoke(app, list(args), prog_name="longtrain")


def _check(res, code: int, *messages: str) -> None:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, (SystemExit, type(None))), res.output
    for m in messages:
        assert m in res.output, res.output


@pytest.mark.parametrize(
    "args, code",
    [
        # a path that does not exist: a UsageError (longtrain.path_args.checkpoint_arg or verify-equivalence's check)
        (["eval", "{missing}"], 2),
        (["generate", "{missing}", "--prompt", "x"], 2),
        (["inspect", "{missing}", "--text", "{tmp}/page.txt", "--out", "{tmp}/page.html"], 2),
        (["export", "{missing}", "--out", "{tmp}/hf"], 2),
        (["verify-equivalence", "--checkpoint", "{missing}"], 2),
    ],
    ids=lambda a: a[0] if isinstance(a, list) else str(a),
)
def test_a_missing_checkpoint_is_named_in_every_verb(tmp_path, args, code):
    (tmp_path / "page.txt").write_text("a page of words")
    missing = str(tmp_path / "no-such-run")
    res = invoke(*[a.format(missing=missing, tmp=tmp_path) for a in args])
    _check(res, code, f"{missing} does not exist")


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_missing_resume_checkpoint_or_import_folder_exits_2(tmp_path, kind):
    path = tmp_path / "nope"
    if kind == "file":
        path.write_text("x")
    what = "does not exist" if kind == "missing" else "is a file, not a folder"
    _check(invoke("fit", "quickstart", "--run-dir", str(tmp_path / "r"), "--resume", str(path), "--dry-run"), 2,
           f"error: {path} {what}: give --resume a checkpoint folder")
    _check(invoke("import", str(path), "--out", str(tmp_path / "run")), 2, f"{path} {what}: give a Hugging Face model folder")
    assert not (tmp_path / "run").exists() and not (tmp_path / "r").exists()


def test_usage_errors_exit_2_and_name_the_flag(tmp_path):
    # checked by the cli layer
    _check(invoke("generate", str(tmp_path), "--prompt", "x", "--top-p", "0"), 2, "--top-p must be in (0, 1]")
    # raised by a domain function about its argument `device`: the verb names its flag
    _check(invoke("eval", str(tmp_path), "--device", "tpu"), 2, "--device must be auto, cpu or cuda; got 'tpu'")
    # a RecipeError (a UsageError) from the recipe parser
    _check(invoke("fit", "quickstart", "--set", "train.lr", "--dry-run"), 2, "expected KEY=VALUE")


def test_other_errors_exit_1(tmp_path):
    (tmp_path / "hf").mkdir()
    _check(invoke("import", str(tmp_path / "hf"), "--out", str(tmp_path / "run")), errors.HFFormatError.exit_code,
           "config.json")
    assert errors.HFFormatError.exit_code == 1


def test_arg_is_named_by_the_flag_only_in_the_cli():
    e = errors.UsageError("must be at least 1; got 0", arg="max_len")
    assert str(e) == "max_len must be at least 1; got 0"  # for a caller of the Python API
    assert e.naming("--max-len") == "--max-len must be at least 1; got 0"
    e = errors.EvalError("no documents: pass {arg} PATH", arg="data")
    assert str(e) == "no documents: pass data PATH" and e.naming("--data") == "no documents: pass --data PATH"
    assert errors.UsageError("no arg").naming("--x") == "no arg"


def test_other_arguments_a_fix_names_are_flags_only_in_the_cli():
    e = errors.CheckpointError("start over with `{resume} never` or another {run_dir}", names=("resume", "run_dir"))
    assert str(e) == "start over with `resume never` or another run_dir"
    assert e.naming("", {"resume": "--resume", "run_dir": "--run-dir"}) == "start over with `--resume never` or another --run-dir"
    busy = errors.RunDirBusy("runs/x", "process pid 7")
    assert (busy.run_dir, busy.holder) == ("runs/x", "process pid 7") and "choose another run_dir" in str(busy)


def _exception_classes() -> dict[str, str]:
    """{class name: module path} of every class in longtrain/ that derives from an exception type by name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.endswith(("Error", "Exception", "Busy")) or b == "LongtrainError" for b in bases):
                    found[node.name] = str(path.relative_to(PACKAGE))
    return found


def test_every_exception_class_is_a_longtrain_error_defined_in_errors_py():
    classes = _exception_classes()
    assert set(classes.values()) == {"errors.py"}, classes  # one module holds them all
    for name in classes:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.LongtrainError)
        assert cls.exit_code == (2 if issubclass(cls, errors.UsageError) else 1), name
    assert len(classes) >= 13
