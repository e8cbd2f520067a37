"""What a user types first: -h, --version, shell completion, `longtrain recipes`."""

from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

from longtrain import __version__
from longtrain.cli import app
from longtrain.train.recipe import RECIPES_DIR, builtin_recipes


def invoke(*args, **kwargs):
    return CliRunner().invoke(app, list(args), prog_name="longtrain", **kwargs)


VERBS = ("cache", "clean", "eval", "export", "fit", "generate", "import", "inspect", "plot", "recipes", "verify-equivalence",
         "version")


def test_short_and_long_help_list_every_verb():
    registered = [c.name for c in app.registered_commands] + [g.name for g in app.registered_groups]
    assert sorted(registered) == sorted(VERBS)  # a new verb is added here too
    for flag in ("-h", "--help"):
        r = invoke(flag)
        assert r.exit_code == 0, r.output
        listed = {line.split()[1] for line in r.output.splitlines() if len(line.split()) > 1 and line.split()[0] == "│"}
        assert set(VERBS) <= listed, r.output
    r = invoke("fit", "-h")
    assert r.exit_code == 0 and "--dry-run" in r.output and "--resume" in r.output


def test_version_flag_and_verb():
    for args in (["--version"], ["-V"]):
        r = invoke(*args)
        assert r.exit_code == 0 and r.output.strip() == f"longtrain {__version__}"
    assert invoke("version").output.strip() == __version__


def test_shell_completion_is_enabled_and_completes_verbs():
    r = invoke("--show-completion", "bash")
    assert r.exit_code == 0 and "_LONGTRAIN_COMPLETE=complete_bash" in r.output
    env = {"_LONGTRAIN_COMPLETE": "complete_bash", "COMP_WORDS": "longtrain re", "COMP_CWORD": "1"}
    r = invoke(env=env)
    assert r.output.split() == ["recipes"]


def test_recipes_lists_every_builtin_with_its_description():
    r = invoke("recipes")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    for name in builtin_recipes():
        [line] = [x for x in lines if x.startswith(name + " ")]
        first = (RECIPES_DIR / f"{name}.yaml").read_text().splitlines()[0]
        assert first.endswith(line[len(name):].strip()) and len(line) > len(name) + 20
    assert "quickstart" in r.output and "(the default)" in r.output
    for line in lines[:-1]:  # whole sentences, for users (no cut-off lines, no issue numbers)
        assert line.rstrip().endswith((".", ")")) and "issue" not in line, line


def test_help_is_quick_to_start():
    """Verb modules import their heavy parts lazily: `longtrain -h` does not load torch."""
    code = "import sys; from longtrain.cli import app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_python_warnings_print_like_the_other_messages(tmp_path):
    """A warning from deep inside (a corrupt newest checkpoint is skipped) reads `warning: ...`, no file:line."""
    from tests.eval.test_inspect import write_checkpoint

    write_checkpoint(tmp_path / "run", dict(type="sparsek+sw", topk=6, window=8))
    (tmp_path / "run/checkpoints/step-00000002").mkdir()  # a newer checkpoint, but empty
    cmd = [sys.executable, "-m", "longtrain.cli", "export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert out.returncode == 0, out.stderr
    [line] = [x for x in out.stderr.splitlines() if "skipping checkpoint" in x]
    assert line.startswith("warning: skipping checkpoint") and "step-00000002" in line
    assert "Warning:" not in out.stderr and ".py:" not in out.stderr


def test_fit_dry_run_names_what_the_linear_part_weighs(tmp_path):
    """The run's attention line: a linear type's linear_norm, linear_gain and linear_rope (their defaults unless set), which decide
    what its linear part adds; nothing more for a type without one."""
    base = ("fit", "quickstart", "--run-dir", str(tmp_path / "run"), "--dry-run")
    r = invoke(*base, "--set", "attention.type=linear+sw", "--set", "attention.topk=0")
    assert r.exit_code == 0, r.output
    assert "attention: linear+sw (k=0, w=64, hard_k_soft_v, linear part mean, learned gain, phi after RoPE);" in r.output
    r = invoke(*base, "--set", "attention.type=sparsek+linear+sw", "--set", "attention.linear_gain=fixed",
               "--set", "attention.linear_rope=unrotated")
    assert "attention: sparsek+linear+sw (k=64, w=64, hard_k_soft_v, linear part mean, fixed gain, phi without RoPE);" in r.output
    r = invoke(*base)
    assert "attention: sparsek+sw (k=64, w=64, hard_k_soft_v);" in r.output
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
