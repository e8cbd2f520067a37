"""What a fresh-clone user trial ran into: each command line that cannot work is refused with a message
that names the problem and the fix (exit 2 for the command line or recipe, 1 for what is on disk), and a
refused `fit` writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from longtrain.cli import app


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], prog_name="longtrain")


def flat(res) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(res.output.split())


def check(res, code: int, *messages: str) -> None:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, (SystemExit, type(None))), res.output
    for m in messages:
        assert m in flat(res), res.output


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder`, with a file's bytes (None: a folder)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.fixture
def here(tmp_path, monkeypatch):
    """tmp_path as the working directory, with the token cache inside it (so "nothing written" covers it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path


# ----------------------------------------------------------------------------- fit --run-dir FILE


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "fit"])
def test_fit_refuses_a_run_dir_that_is_a_file_and_writes_nothing(here, dry_run):
    (here / "notes.txt").write_text("my notes\n")
    before = tree(here)
    check(invoke("fit", "quickstart", "--run-dir", "notes.txt", *dry_run), 2,
          "run dir notes.txt is a file, not a folder", "choose another --run-dir")
    check(invoke("fit", "quickstart", "--run-dir", "notes.txt/run", *dry_run), 2,
          "run dir notes.txt/run cannot be made: notes.txt is a file", "--run-dir")
    check(invoke("fit", "quickstart", "--set", "checkpoint.dir=notes.txt/ckpts", *dry_run), 2,
          "checkpoint folder notes.txt/ckpts cannot be made", "--set checkpoint.dir=DIR")
    assert tree(here) == before  # the file as it was, no runs/ folder, no token cache
    (here / "run").mkdir()
    (here / "run" / "checkpoints").write_text("not a folder")
    before = tree(here)
    check(invoke("fit", "quickstart", "--run-dir", "run", *dry_run), 2, "checkpoint folder run/checkpoints is a file")
    assert tree(here) == before


def test_a_run_that_fails_before_it_starts_leaves_no_runs_folder(here):
    """The run dir's parents that fit made (runs/) go too when the run never started."""
    check(invoke("fit", "quickstart", "--set", "data.source=files", "--set", "data.path=missing"), 1, "data.path 'missing'")
    assert not (here / "runs").exists()
