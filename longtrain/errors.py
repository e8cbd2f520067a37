"""Every error longtrain raises for the user: one base, its exit code, and one class per kind of problem.

A message names the problem and the fix; the CLI prints it as `error: MESSAGE` without a traceback
and exits with the class's `exit_code` (`longtrain.cli.app` maps them, in one place):

  2  UsageError and its subclasses: the command line (or a recipe) cannot work whatever is on disk.
  1  every other LongtrainError: inputs that exist but cannot be used, or a run that cannot go on.

A domain function takes typed values and does not know the CLI's flags. When its message is about one
of its arguments, it says which with `arg` (the parameter's name, e.g. "max_len") and the CLI names
the flag that set it: the name goes where the message says `{arg}`, else in front of it.

    UsageError(f"must be at least 256; got {n}", arg="max_len")
        str(e): "max_len must be at least 256; got 100"      longtrain eval: "--max-len must be ..."
    EvalError("no validation documents: pass {arg} PATH|GLOB", arg="data")
        str(e): "... pass data PATH|GLOB"                      longtrain eval: "... pass --data PATH|GLOB"

A message that names other arguments as fixes (resume from elsewhere, another run dir) writes each as
`{name}` and lists it in `names`; the CLI puts the flag of each there, str(e) the bare name:

    CheckpointError("... start a fresh run with `{resume} never` or another {run_dir}", names=("resume", "run_dir"))
        str(e): "... `resume never` or another run_dir"         longtrain fit: "... `--resume never` or another --run-dir"

This module imports nothing of longtrain, so any module can raise these without an import cycle.
"""

from __future__ import annotations


class LongtrainError(Exception):
    """A problem the user can fix; the message says what and how (exit 1)."""

    exit_code = 1

    def __init__(self, message: str, *, arg: str | None = None, names: tuple[str, ...] = ()):
        self.message = message
        self.arg = arg  # the domain argument the message is about (None: not about one)
        self.names = names  # other domain arguments the message names as `{name}` (a fix: use another one)
        super().__init__(self.naming(arg or ""))

    def naming(self, flag: str, flags: dict[str, str] | None = None) -> str:
        """The message with `flag` (the CLI's flag for `arg`) where `{arg}` is, or in front, and each of
        `names` as `flags` spells it (else its bare name)."""
        text = self.message
        for name in self.names:
            text = text.replace("{" + name + "}", (flags or {}).get(name, name))
        if not self.arg:
            return text
        return text.replace("{arg}", flag) if "{arg}" in text else f"{flag} {text}"


class UsageError(LongtrainError):
    """Flags or arguments that cannot work; the message names the problem and the fix (exit 2)."""

    exit_code = 2


# ----------------------------------------------------------------------------- exit 2


class RecipeError(UsageError):
    """A recipe (or a --set override) that cannot be used."""


class EvalUsageError(UsageError):
    """`longtrain eval` options that cannot work with these checkpoints."""


class InspectError(UsageError):
    """Input `longtrain inspect` cannot use (a layer out of range, a picture too tall)."""


class PlotError(UsageError):
    """A run dir that does not exist, or an output path that cannot be written."""


class NoMetricsError(LongtrainError):
    """A run dir that exists but holds nothing to plot yet (exit 1)."""


class PromptTooLong(EvalUsageError, ValueError):
    """A RULER template (and in-context example) alone leave no room in `length` tokens."""

    def __init__(self, task: str, length: int, needed: int):
        super().__init__(f"a {task} prompt needs at least {needed:,} tokens (its template and answer); asked for {length:,}")
        self.task, self.length, self.needed = task, length, needed


# ----------------------------------------------------------------------------- exit 1


class CheckpointError(LongtrainError):
    """A checkpoint that cannot be written or used (missing, incomplete, or from another run).

    Exit 1 in every verb: it is about what is on disk, which can be wrong however right the command
    line is (a resumed run whose checkpoint another recipe wrote, a half-written folder). A checkpoint
    argument that does not exist, or is a file, is a UsageError instead (exit 2: longtrain.path_args).
    """


class DataError(LongtrainError):
    """Bad input to the data pipeline (a path, a file, a tokenizer)."""


class DataPathMissing(UsageError, DataError):
    """A data path the recipe names (data.path, data.valid, tokenizer.path) that does not exist, a glob of theirs that
    matches no files, or a tokenizer.path that is a folder: the recipe cannot work as it is (exit 2: a UsageError,
    defined here after its other base). Still a DataError, for callers that catch those."""


class EvalError(LongtrainError):
    """Evaluation inputs that exist but cannot be used (no documents, a hub without network)."""


class HFFormatError(LongtrainError):
    """A Hugging Face folder or config that longtrain cannot convert."""


class TrainingError(LongtrainError):
    """A run that cannot go on (NaN loss, a checkpoint that does not fit)."""


class RunDirBusy(LongtrainError):
    """Another process holds the run directory `run_dir` (`holder` says which)."""

    def __init__(self, run_dir, holder: str):
        super().__init__(f"run dir {run_dir} is in use by {holder}; wait for it to finish (or stop it: Ctrl-C saves a "
                         "checkpoint), or choose another {run_dir}", names=("run_dir",))
        self.run_dir, self.holder = run_dir, holder


class RunDirWriteError(LongtrainError):
    """A file of the run directory could not be written (a full disk, say); the file is as it was."""


class LaunchError(LongtrainError, RuntimeError):
    """The launch does not fit this machine (more ranks than GPUs); the message says what to change."""
