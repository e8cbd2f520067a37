"""The embedded default corpus: the Python standard library's own source.

Every machine that runs longtrain has it, so the quickstart recipe works
offline. The .py files under `sysconfig`'s stdlib directory are grouped into
long documents: one per top-level package (its files concatenated in sorted
order, each under a header line naming it), one per large top-level module,
and the small top-level modules concatenated in sorted order into documents
of about `GROUP_CHARS` characters, so they are not all dropped as too short.

Skipped, and why:
- site-packages / dist-packages: third-party code, different on every machine;
- test / tests / idle_test folders: test data including files written in
  deliberately broken encodings, and absent from many minimal installs, so
  the corpus would vary between machines with the same Python;
- __pycache__ and anything that is not a .py file.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from .sources import Source, invalid_utf8_bytes

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
GROUP_CHARS = 200_000  # a top-level module at least this long is a document of its own


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_groups(root: Path | None = None) -> list[list[Path]]:
    """Files of each document, in a fixed order (sorted names)."""
    root = root or stdlib_root()
    groups: list[list[Path]] = []
    small: list[Path] = []
    small_size = 0
    for entry in sorted(root.iterdir()):
        if entry.name in SKIP_DIRS or entry.name.startswith("."):
            continue
        if entry.is_dir():
            files = sorted(
                f
                for f in entry.rglob("*.py")
                if f.is_file() and not SKIP_DIRS.intersection(f.relative_to(root).parts[:-1])
            )
            if files:
                groups.append(files)
        elif entry.suffix == ".py" and entry.is_file():
            size = entry.stat().st_size
            if size >= GROUP_CHARS:
                groups.append([entry])
            else:
                small.append(entry)
                small_size += size
                if small_size >= GROUP_CHARS:
                    groups.append(small)
                    small, small_size = [], 0
    if small:
        groups.append(small)
    return groups


def stdlib_source(root: Path | None = None) -> Source:
    root = root or stdlib_root()
    groups = stdlib_groups(root)
    h = hashlib.blake2b(b"stdlib\n", digest_size=16)
    total, invalid = 0, 0
    for files in groups:
        for f in files:
            raw = f.read_bytes()
            total += len(raw)
            invalid += invalid_utf8_bytes(raw)
            h.update(f"{f.relative_to(root)}\0{len(raw)}\0".encode())
            h.update(raw)

    def documents() -> Iterator[str]:
        for files in groups:
            parts = []
            for f in files:
                text = f.read_bytes().decode("utf-8", errors="replace")
                parts.append(f"# ---- file: {f.relative_to(root).as_posix()} ----\n{text}")
            yield "\n".join(parts)

    return Source(
        description=f"the Python standard library in {root} ({len(groups)} documents)",
        fingerprint=h.hexdigest(),
        total_bytes=total,
        n_docs=len(groups),
        invalid_utf8=invalid,
        documents=documents,
    )
