"""A regular (non-editable) `pip install .` in a fresh venv runs the README's quickstart from elsewhere.

The venv reuses this environment's packages (torch, datasets, ... through a .pth line, so
nothing is downloaded or reinstalled) but gets its own, installed copy of longtrain, built from a
copy of the sources: the test checks that this copy, not the checkout, is what runs, and that
it carries the built-in recipes.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "longtrain", "recipes")


def copy_sources(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    return src


def make_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv seeing this environment's packages (no download); returns (its python, its purelib)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_test_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python, Path(purelib)


def pip_install(python: Path, *args) -> None:
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-build-isolation", *args],
        capture_output=True, text=True, timeout=300,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr


def test_a_regular_install_runs_the_quickstart_from_another_directory(tmp_path):
    src = copy_sources(tmp_path)
    python, purelib = make_venv(tmp_path)
    venv = python.parent.parent
    pip_install(python, src)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # A fresh install compiles the numba scan on its first call (~20 s here, cached afterwards); this
    # test is about packaging, so the scan runs as plain Python (same results, numpy's overflow warnings).
    env |= {"NUMBA_DISABLE_JIT": "1", "PYTHONWARNINGS": "ignore::RuntimeWarning"}
    where = subprocess.run(
        [python, "-c", "import longtrain.train.recipe as r; print(r.__file__); print(r.RECIPES_DIR)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )
    module, recipes = map(Path, where.stdout.split())
    assert module.is_relative_to(venv) and recipes == purelib / "longtrain" / "recipes", where.stdout + where.stderr
    assert sorted(p.name for p in recipes.glob("*.yaml")) == sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))

    fit = subprocess.run([venv / "bin" / "longtrain", "fit", "--set", "train.steps=2"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0, fit.stdout + fit.stderr
    assert "longtrain fit quickstart → runs/quickstart" in fit.stdout
    assert "done: steps 1–2" in fit.stdout
    assert (elsewhere / "runs/quickstart/checkpoints/step-00000002/model.safetensors").is_file()


# Compiles one small jitted function of the scan, with numba's cache on, as any first run does.
COMPILE_ONE = "import numpy as np; from longtrain.ops.selection import host; host._f_push(np.zeros(2), 0, 1.0)"


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("regular", "editable"), ("editable", "regular")])
def test_the_readme_installs_in_either_order_leave_a_working_cli(tmp_path, first, then):
    """README's two commands in one folder: numba's cache must not stay behind in site-packages.

    pip does not record the files numba's `cache=True` writes beside the sources; after a regular
    install had compiled, `pip install -e` left `site-packages/longtrain/` holding only them, an
    empty namespace package that shadowed the editable install (`cannot import name '__version__'`).
    """
    src = copy_sources(tmp_path)
    python, purelib = make_venv(tmp_path)
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "NUMBA_CACHE_DIR")}
    env |= {"HOME": str(home)}
    longtrain = python.parent / "longtrain"
    for how in (first, then):
        pip_install(python, *(["-e", src] if how == "editable" else [src]))
        ran = subprocess.run([python, "-c", COMPILE_ONE], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        for verb in (["--version"], ["recipes"]):
            cli = subprocess.run([longtrain, *verb], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=120)
            assert cli.returncode == 0, f"after {first} then {then}, `longtrain {verb[0]}`: {cli.stdout}{cli.stderr}"
    assert not list((purelib / "longtrain").rglob("*.nbi")) and not list(src.rglob("*.nbi"))
    assert list((home / ".cache/longtrain/numba").rglob("*.nbi")), "numba's cache is in the user cache"
