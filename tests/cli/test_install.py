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

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "longtrain", "recipes")


def test_a_regular_install_runs_the_quickstart_from_another_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_test_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-build-isolation", src],
        capture_output=True, text=True, timeout=300,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr

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
    assert module.is_relative_to(venv) and recipes == Path(purelib) / "longtrain" / "recipes", where.stdout + where.stderr
    assert sorted(p.name for p in recipes.glob("*.yaml")) == sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))

    fit = subprocess.run([venv / "bin" / "longtrain", "fit", "--set", "train.steps=2"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0, fit.stdout + fit.stderr
    assert "longtrain fit quickstart → runs/quickstart" in fit.stdout
    assert "done: steps 1–2" in fit.stdout
    assert (elsewhere / "runs/quickstart/checkpoints/step-00000002/model.safetensors").is_file()
