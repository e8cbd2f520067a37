"""What a fresh-clone user trial ran into: each command line that cannot work is refused with a message
that names the problem and the fix (exit 2 for the command line or recipe, 1 for what is on disk), and a
refused `fit` writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from longtrain.cli import app
from longtrain.errors import RecipeError
from longtrain.train.recipe import RECIPES_DIR, RESOLVED_HEADER, load_recipe, recipe_to_yaml
from tests.train.tiny import write_corpus


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


def test_fit_refuses_a_run_dir_the_system_will_not_make(here):
    """mkdir fails for a reason of the system's (here /proc takes no folders): a usage error naming it, no traceback."""
    check(invoke("fit", "quickstart", "--run-dir", "/proc/longtrain-test/run", "--set", "train.steps=1"), 2,
          "run dir /proc/longtrain-test/run cannot be made", "choose another --run-dir")


def test_a_run_that_fails_before_it_starts_leaves_no_runs_folder(here):
    """The run dir's parents that fit made (runs/) go too when the run never started."""
    check(invoke("fit", "quickstart", "--set", "data.source=files", "--set", "data.path=missing"), 2, "data.path 'missing'")
    assert not (here / "runs").exists()


# ----------------------------------------------------------------------------- verify-equivalence --checkpoint


def test_verify_equivalence_checkpoint_must_be_a_folder_with_a_checkpoint(here):
    (here / "notes.txt").write_text("my notes\n")
    check(invoke("verify-equivalence", "--checkpoint", "notes.txt"), 2,
          "notes.txt is a file, not a folder: give --checkpoint a checkpoint folder", "or a run dir")
    check(invoke("verify-equivalence", "--checkpoint", "no-such-run"), 2,
          "no-such-run does not exist: give --checkpoint a checkpoint folder", "or a run dir")
    (here / "empty").mkdir()  # there, but nothing in it: what is on disk (exit 1), saying what is missing
    check(invoke("verify-equivalence", "--checkpoint", "empty"), 1,
          "empty is neither a checkpoint (no meta.json) nor a run dir with checkpoints", "longtrain fit")


# ----------------------------------------------------------------------------- a folder argument, in every verb


FOLDER_ARGS = {  # verb: (its command line with {path} for the folder, what its message says to give)
    "eval": (["eval", "{path}"], "give a checkpoint folder"),
    "generate": (["generate", "{path}", "--prompt", "x"], "give a checkpoint folder"),
    "export": (["export", "{path}", "--out", "hf"], "give a checkpoint folder"),
    "verify-equivalence": (["verify-equivalence", "--checkpoint", "{path}"], "give --checkpoint a checkpoint folder"),
    "fit --resume": (["fit", "quickstart", "--run-dir", "r", "--resume", "{path}", "--dry-run"],
                     "give --resume a checkpoint folder"),
    "import": (["import", "{path}", "--out", "imported"], "give a Hugging Face model folder"),
    "plot": (["plot", "{path}", "--out", "x.png"], "give run directories written by `longtrain fit`"),
}


@pytest.mark.parametrize("verb", FOLDER_ARGS)
def test_every_verb_says_alike_that_a_folder_argument_is_missing_or_a_file(here, verb):
    """One check (longtrain.path_args.input_folder) in every verb: exit 2, the same words, a near name suggested."""
    args, give = FOLDER_ARGS[verb]
    (here / "my-run").mkdir()
    (here / "notes.txt").write_text("my notes\n")
    before = tree(here)
    line = lambda path: [a.format(path=path) for a in args]  # noqa: E731
    check(invoke(*line("my-runn")), 2, "my-runn does not exist: " + give, "did you mean my-run?")
    check(invoke(*line("no/such-run")), 2, "no/such-run does not exist (nor does its folder no): " + give)
    check(invoke(*line("notes.txt")), 2, "notes.txt is a file, not a folder: " + give)
    assert tree(here) == before  # nothing written: no run dir, no output


# ----------------------------------------------------------------------------- verify-equivalence chunk sizes


def test_verify_equivalence_refuses_chunks_that_read_the_document_whole(here):
    check(invoke("verify-equivalence", "--chunk-size", "8192", "--tokens", "4096"), 2,
          "--chunk-size 8,192 is not smaller than --tokens 4,096", "nothing to verify",
          "give a --chunk-size below 4,096, or --tokens above 8,192")
    check(invoke("verify-equivalence", "--chunk-size", "100", "--chunk-size", "300", "--tokens", "300"), 2,
          "--chunk-size 300 is not smaller than --tokens 300")
    check(invoke("verify-equivalence", "--tokens", "1000"), 2,
          "every default chunk size (1,024, 4,096, 3,001) is at least --tokens 1,000", "--chunk-size below 1,000")
    (here / "short.txt").write_text("a short text of a few bytes")  # the default model reads bytes: 27 tokens
    check(invoke("verify-equivalence", "--text", "short.txt", "--tokens", "500", "--chunk-size", "10", "--chunk-size", "100"),
          2, "--chunk-size 100 is not smaller than the 27 tokens of --text short.txt",
          "give a --chunk-size below 27, or a --text longer than 100 tokens")


def test_verify_equivalence_leaves_out_default_chunks_the_document_fits_in(here):
    res = invoke("verify-equivalence", "--tokens", "1100", "--json", "out.json")
    check(res, 0, "default chunk sizes 4096, 3001 left out: not smaller than the document's 1,100 tokens", "PASSED")
    assert [r["chunk_size"] for r in json.loads((here / "out.json").read_text())["runs"]] == [1024]


# ----------------------------------------------------------------------------- fit gutenberg-sparsek without books


def test_missing_books_name_the_folders_and_the_set_that_fixes_them(here):
    check(invoke("fit", "gutenberg-sparsek", "--dry-run"), 2,
          "data.path '../shared/data/gutenberg/train' and data.valid '../shared/data/gutenberg/valid' do not exist",
          f"from the working directory, {here}", "--set data.path=DIR --set data.valid=DIR", "--set data.valid=0.02")
    assert tree(here) == {}
    write_corpus(here / "books", n_docs=5, words=1500)
    check(invoke("fit", "gutenberg-sparsek", "--set", "data.path=books", "--dry-run"), 2,
          "data.valid '../shared/data/gutenberg/valid' does not exist", "--set data.valid=DIR")
    # what the messages say works (smaller numbers only so that the tiny corpus is enough)
    small = ["--set", "tokenizer.vocab_size=320", "--set", "data.min_doc_tokens=300"]
    check(invoke("fit", "gutenberg-sparsek", "--set", "data.path=books", "--set", "data.valid=books", *small, "--dry-run"),
          0, "dry run: would start a fresh run")
    check(invoke("fit", "gutenberg-sparsek", "--set", "data.path=books", "--set", "data.valid=0.2", *small, "--dry-run"),
          0, "dry run: would start a fresh run")
    assert not (here / "runs").exists()


# ----------------------------------------------------------------------------- fit: a data.path or train.init_from not there


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "fit"])
def test_a_missing_data_path_or_init_source_is_a_usage_error_and_writes_nothing(here, dry_run):
    """The recipe cannot work as it is (exit 2), whatever a run would meet later; the message names the setting and
    its --set, and neither a new run dir nor an existing one is touched."""
    (here / "old").mkdir()
    (here / "old" / "notes.txt").write_text("my notes\n")
    (here / "a-file").write_text("x")
    small = ["--set", "train.steps=2", *dry_run]
    for run_dir in ("new", "old"):
        before = tree(here)
        check(invoke("fit", "--run-dir", run_dir, "--set", "data.source=files", "--set", "data.path=no-books", *small), 2,
              "data.path 'no-books' does not exist", "--set data.path=DIR")
        check(invoke("fit", "--run-dir", run_dir, "--set", "train.init_from=no-run", *small), 2,
              "train.init_from: no-run does not exist: give a checkpoint folder", "--set train.init_from=DIR")
        check(invoke("fit", "--run-dir", run_dir, "--set", "train.init_from=a-file", *small), 2,
              "train.init_from: a-file is a file, not a folder", "--set train.init_from=DIR")
        assert tree(here) == before  # no run dir made, the old one as it was, no token cache
    (here / "empty").mkdir()  # there, but no checkpoint in it: what is on disk (exit 1)
    check(invoke("fit", "--run-dir", "new", "--set", "train.init_from=empty", *small), 1,
          "train.init_from: empty is neither a checkpoint")
    assert not (here / "new").exists()


def previous_run(here: Path) -> None:
    """A real run in here/old (to be left as it is), and what the refusals below point at."""
    check(invoke("fit", "--run-dir", "old", "--set", "train.steps=2"), 0)
    (here / "empty").mkdir()
    (here / "notes").mkdir()
    (here / "notes" / "notes.md").write_text("my notes\n")


def test_a_missing_tokenizer_is_a_usage_error_and_writes_nothing(here):
    """tokenizer.path not there, or a folder: the recipe cannot work as it is (exit 2), before any file is read; the
    message names the setting, where a relative one was looked for and its --set, and neither a new run dir nor one
    that holds a previous run is touched, with or without --dry-run. A file that does not load: exit 1."""
    previous_run(here)
    (here / "bad.json").write_text("not a tokenizer")
    for dry_run in ([], ["--dry-run"]):
        small = ["--set", "train.steps=4", *dry_run]
        for run_dir in ("new", "old"):
            before = tree(here)
            check(invoke("fit", "--run-dir", run_dir, "--set", "tokenizer.path=no-tokenizer.json", *small), 2,
                  "tokenizer.path 'no-tokenizer.json' does not exist", f"from the working directory, {here}",
                  "--set tokenizer.path=FILE", "--set tokenizer.path=null")
            check(invoke("fit", "--run-dir", run_dir, "--set", f"tokenizer.path={here / 'notes'}", *small), 2,
                  f"tokenizer.path '{here / 'notes'}' is a folder, not a tokenizer.json", "--set tokenizer.path=FILE")
            check(invoke("fit", "--run-dir", run_dir, "--set", "tokenizer.path=bad.json", *small), 1,  # there: exit 1
                  "The tokenizer file 'bad.json' does not load")
            assert tree(here) == before  # no run dir made, the old run as it was, no token cache
    assert not (here / "new").exists()


def test_a_data_glob_that_matches_no_files_is_a_usage_error_and_writes_nothing(here):
    """A data.path or data.valid glob that matches no files (an empty folder, one of other files, one not there), for
    each source that reads data.path: exit 2 before any file is read, saying what it looked for, what is there instead
    and the --set; nothing written, with or without --dry-run."""
    previous_run(here)
    books = ["gutenberg-sparsek", "--set", "tokenizer.vocab_size=320", "--set", "data.min_doc_tokens=300"]
    for dry_run in ([], ["--dry-run"]):
        small = ["--set", "train.steps=4", *dry_run]
        for run_dir in ("new", "old"):
            before = tree(here)
            check(invoke("fit", "--run-dir", run_dir, "--set", "data.source=files", "--set", "data.path=empty/*.txt",
                         *small), 2,
                  "data.path 'empty/*.txt' matches no files", f"it looked for files matching {here / 'empty' / '*.txt'}",
                  "empty is empty", "--set data.path=GLOB")
            check(invoke("fit", *books, "--run-dir", run_dir, "--set", "data.path=notes/**/*.txt",
                         "--set", "data.valid=empty/*.jsonl", *small), 2,
                  "data.path 'notes/**/*.txt' matches no files", "notes holds notes.md, none of them",
                  "--set data.path=GLOB", "data.valid 'empty/*.jsonl' matches no files", "--set data.valid=0.02")
            check(invoke("fit", *books, "--run-dir", run_dir, "--set", "data.path=no-books/*.txt",
                         "--set", "data.valid=0.2", *small), 2,
                  "data.path 'no-books/*.txt' matches no files", "the folder no-books does not exist")
            check(invoke("fit", "quickstart", "--run-dir", run_dir, "--set", "data.source=recall",
                         "--set", "data.recall.filler=files", "--set", "data.path=notes/*.txt", *small), 2,
                  "data.path 'notes/*.txt' matches no files")
            assert tree(here) == before  # no run dir made, the old run as it was, no token cache
    assert not (here / "new").exists()


def test_data_of_no_readable_type_is_a_usage_error_and_writes_nothing(here):
    """A data.path folder, glob or file (or a data.valid) whose files are none of a type fit reads: exit 2 (it was 1)
    before any file is read, saying what the files are and the --set; nothing written, with or without --dry-run."""
    previous_run(here)  # notes/ holds notes.md
    (here / "scans").mkdir()
    for name in ("a.pdf", "b.pdf", "README"):
        (here / "scans" / name).write_text("not a document type fit reads\n")
    books = ["gutenberg-sparsek", "--set", "tokenizer.vocab_size=320", "--set", "data.min_doc_tokens=300"]
    for dry_run in ([], ["--dry-run"]):
        small = ["--set", "train.steps=4", *dry_run]
        for run_dir in ("new", "old"):
            before = tree(here)
            check(invoke("fit", *books, "--run-dir", run_dir, "--set", "data.path=scans", *small), 2,
                  "No readable documents in 'scans': none of its 3 files ends in .txt, .jsonl, .json, .parquet",
                  "(it holds 2 .pdf, 1 no suffix)", "--set data.path=DIR")
            check(invoke("fit", *books, "--run-dir", run_dir, "--set", "data.path=scans/*.pdf",
                         "--set", "data.valid=notes/notes.md", *small), 2,
                  "No readable documents in 'scans/*.pdf'", "No readable documents in 'notes/notes.md'",
                  "(it holds 1 .md)", "--set data.valid=DIR")
            assert tree(here) == before  # no run dir made, the old run as it was, no token cache
    assert not (here / "new").exists()


# ----------------------------------------------------------------------------- a GPU recipe without a GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "fit"])
def test_a_gpu_recipe_without_a_gpu_is_a_usage_error(here, dry_run):
    """pg19 sets train.device: cuda; on a machine without one it cannot work whatever is on disk: exit 2 (it was 1),
    as `generate --device cuda` is, with the --set that runs it anyway, and nothing written."""
    check(invoke("fit", "pg19", "--run-dir", "r", *dry_run), 2,
          "train.device is cuda but no CUDA device is visible", "--set train.device=cpu")
    assert tree(here) == {}


# ----------------------------------------------------------------------------- clean a folder that is no run dir


def test_clean_refuses_a_folder_that_is_not_a_run_dir_and_deletes_nothing(here):
    """Not "nothing to clean" (nor a `*.replaced-…` file of someone else's deleted): exit 2, saying what it is."""
    (here / "photos" / "2024").mkdir(parents=True)
    (here / "photos" / "notes.txt").write_text("my notes\n")
    (here / "photos" / "album.replaced-20240101-000000").mkdir()  # a name like those fit moves aside
    before = tree(here)
    for delete in ([], ["--delete"]):
        check(invoke("clean", "photos", *delete), 2, "photos is not a longtrain run directory",
              "recipe.yaml", "give a run directory written by `longtrain fit`", "Nothing was deleted")
    check(invoke("clean", "no-such-run"), 2, "no-such-run does not exist: give a run directory")
    check(invoke("clean", "photos/notes.txt"), 2, "photos/notes.txt is a file, not a folder: give a run directory")
    assert tree(here) == before
    (here / "photos" / "recipe.yaml").write_text("name: x\n")  # a run dir (fit writes its recipe first): listed
    check(invoke("clean", "photos"), 0, "1 moved-aside item", "nothing deleted")


# ----------------------------------------------------------------------------- a misspelt key: where it came from


def test_a_misspelt_key_says_whether_a_set_or_the_recipe_file_wrote_it(here):
    """`--set trian.steps=5` makes a section `trian`: its error names that --set and the one meant (it named neither,
    so it read as a fault of the recipe file); a misspelt key in a recipe file is the file's (its name, no --set)."""
    check(invoke("fit", "--set", "trian.steps=5", "--run-dir", "r"), 2,
          "trian: unknown key (from --set trian.steps=5)", "did you mean `train`? (--set train.steps=5)")
    check(invoke("fit", "--set", "train.stpes=5", "--set", "modle=3", "--dry-run"), 2,
          "train.stpes: unknown key (from --set train.stpes=5)", "did you mean `steps`? (--set train.steps=5)",
          "modle: unknown key (from --set modle=3)", "did you mean `model`? (--set model=3)")
    text = (RECIPES_DIR / "quickstart.yaml").read_text()
    (here / "mine.yaml").write_text(text.replace("\ntrain:\n", "\ntrian:\n"))
    res = invoke("fit", "mine.yaml", "--set", "trian.steps=5", "--dry-run")  # the file has `trian`: the file's key
    check(res, 2, "recipe mine.yaml has 2 problems", "trian: unknown key hint: did you mean `train`?")
    assert "(from --set" not in flat(res)
    assert sorted(p.name for p in here.iterdir()) == ["mine.yaml"]


# ----------------------------------------------------------------------------- data settings the source ignores


@pytest.mark.parametrize(
    "recipe, setting, fix",
    [
        ("quickstart", "data.path=/nonexistent", "set data.source: files (--set data.source=files)"),
        ("quickstart", "data.name=pg19", "set data.source: hub"),
        ("quickstart", "data.split=test", "set data.source: hub"),
        ("quickstart", "data.text_field=body", "data.source: files or hub, or a data.valid path"),
        ("quickstart", "data.on_bad_file=skip", "data.source: files, or a data.valid path"),
        ("pg19", "data.path=books", "set data.source: files"),
        ("recall-sparsek", "data.path=books", "set data.recall.filler: files (--set data.recall.filler=files)"),
        ("recall-sparsek", "data.min_doc_tokens=100", "data.recall.doc_tokens"),
    ],
)
def test_a_data_setting_the_source_does_not_read_is_refused(here, recipe, setting, fix):
    key = setting.partition("=")[0]
    check(invoke("fit", recipe, "--set", setting, "--dry-run"), 2, f"{key}:", "has no effect with data.source", fix,
          f"(from --set {setting})")
    check(invoke("fit", recipe, "--set", setting), 2, f"{key}:", "has no effect")
    assert tree(here) == {}


def test_a_recipe_file_that_sets_what_its_source_ignores_is_refused(here):
    text = (RECIPES_DIR / "quickstart.yaml").read_text()
    (here / "mine.yaml").write_text(text.replace("  source: stdlib\n", "  source: stdlib\n  path: books\n"))
    check(invoke("fit", "mine.yaml", "--dry-run"), 2, "data.path: 'books' has no effect with data.source 'stdlib'",
          "or remove it from the recipe")
    # the fix it names loads
    assert load_recipe(here / "mine.yaml", ["data.source=files"]).data.path == "books"


def test_what_a_set_of_the_source_leaves_unused_and_saved_recipes_still_load(here):
    # quickstart's min_doc_tokens: 2048 is unused by recall; the --set says what to read, so it is not refused
    assert load_recipe("quickstart", ["data.source=recall"]).data.source == "recall"
    # a run saved before these checks, with a setting its source ignored, still loads (eval, generate, resume)
    saved = recipe_to_yaml(load_recipe("quickstart")).replace("  path: null\n", "  path: /nonexistent\n")
    assert saved.startswith(RESOLVED_HEADER) and "/nonexistent" in saved
    (here / "recipe.yaml").write_text(saved)
    assert load_recipe(here / "recipe.yaml").data.path == "/nonexistent"
    with pytest.raises(RecipeError, match="data.name: 'pg19' has no effect"):
        load_recipe(here / "recipe.yaml", ["data.name=pg19"])  # but a --set on it is checked
    for setting in ("data.source=files", "data.valid=0.1", "data.min_doc_tokens=100"):  # these the source reads
        load_recipe("quickstart", [setting] + (["data.path=books"] if setting == "data.source=files" else []))
