"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM: finish the step, save, then exit 128 + signal.

The exit code tells a script an interrupted run (130 for SIGINT, 143 for SIGTERM, the shell's
convention) from a finished one (0). A second Ctrl-C stops at once, without saving.
"""

from __future__ import annotations

import os
import signal


class StopSignal:
    """While entered, SIGINT/SIGTERM set `signum` instead of killing; the loop checks `requested`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 for SIGINT, 143 for SIGTERM); 0 when none arrived."""
        return 128 + self.signum if self.signum is not None else 0

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal stops at once
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def kill_for_tests_after(step: int, rank: int = 0) -> None:
    """Tests simulate a crash: SIGKILL right after checkpoint `LONGTRAIN_TEST_KILL_AFTER` is saved.

    Under torchrun only rank `LONGTRAIN_TEST_KILL_RANK` dies, if set (the launcher then stops the others).
    """
    if os.environ.get("LONGTRAIN_TEST_KILL_AFTER") == str(step) and os.environ.get("LONGTRAIN_TEST_KILL_RANK", str(rank)) == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)


def signal_for_tests_at(step: int, rank: int = 0) -> None:
    """Tests send one rank a SIGINT after step N: `LONGTRAIN_TEST_SIGINT_AT=N:RANK` (the others must follow)."""
    if os.environ.get("LONGTRAIN_TEST_SIGINT_AT") == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGINT)
