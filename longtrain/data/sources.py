"""Raw documents from the recipe's `data:` section, read through `datasets`.

A `Source` knows its documents (an iterator of strings, in a fixed order) and a
fingerprint of its content, so the token cache can be keyed by what is read
rather than by where it lives. Local files are hashed byte for byte (fast, and
a changed file invalidates the cache); hub data sets are keyed by name.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from longtrain.errors import DataError, DataPathMissing

# datasets builder per file extension; one document per .txt file, one per row otherwise.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# A .txt file with more than this fraction of bytes that are not UTF-8 text is refused: it is most
# likely binary data (about 43% of random bytes are invalid), and training on U+FFFD teaches
# nothing. Text in a legacy encoding (Latin-1 accents, a few percent of the bytes) stays below it.
MAX_INVALID_FRACTION = 0.10


@dataclass
class Source:
    description: str  # for messages: "12 files under books/"
    fingerprint: str  # hash of the content (or the hub name) that keys the token cache
    total_bytes: int | None  # for the progress bar; None when unknown (hub)
    n_docs: int | None  # when known before reading (one document per file); None for rows
    invalid_utf8: int  # bytes of invalid UTF-8 replaced by U+FFFD
    documents: Callable[[], Iterator[str]]  # a fresh iterator on every call, same order
    # data.on_bad_file skip: (file, why) of every file left out; complete once documents() has been read
    skipped: list[tuple[str, str]] = field(default_factory=list)


# ---------------------------------------------------------------- local files


def glob_files(pattern: str) -> list[Path]:
    """The files (not folders) a glob matches, `**` reaching into subfolders; unsorted."""
    return [Path(f) for f in glob.glob(str(Path(pattern).expanduser()), recursive=True) if os.path.isfile(f)]


def unmatched_glob(pattern: str, setting: str) -> str:
    """Why the glob `pattern` (of `setting`) matches no files: what it looked for (the pattern as read, from the
    working directory where it is relative) and what its folder holds instead."""
    p = Path(pattern).expanduser()
    looked = p if p.is_absolute() else Path.cwd() / p
    fixed = p.parts[: next((i for i, part in enumerate(p.parts) if glob.has_magic(part)), len(p.parts))]
    base = Path(*fixed) if fixed else Path(".")
    shown = str(base) if fixed else f"the working directory ({Path.cwd()})"
    if not base.exists():
        holds = f"the folder {shown} does not exist"
    elif not base.is_dir():
        holds = f"{shown} is a file, not a folder"
    else:
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in base.iterdir())
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        holds = (f"{shown} is empty" if not names else
                 f"{shown} holds {', '.join(names[:5])}{more}, none of them a file the pattern matches")
    return f"{setting} {pattern!r} matches no files (it looked for files matching {looked}): {holds}"


def find_files(path: str, setting: str = "data.path") -> list[Path]:
    """A file, a folder (searched recursively) or a glob; sorted, supported types only."""
    files = listed_files(path, setting)
    found = readable_files(files)
    if not found:  # the setting cannot work as it is (exit 2), as a path that is not there
        raise DataPathMissing(f"{no_readable_files(files, path)}. Point {setting} at text, jsonl/json or parquet files.")
    return found


def listed_files(path: str, setting: str = "data.path") -> list[Path]:
    """Every file (of any type) that `path` names: the file, a folder's files with its subfolders', or a glob's
    matches; unsorted. A path not there, or a glob that matches nothing: DataPathMissing."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        return [f for f in p.rglob("*") if f.is_file()]
    if glob.has_magic(str(p)):
        files = glob_files(path)
        if not files:  # the setting cannot work as it is, like a path that is not there (exit 2)
            raise DataPathMissing(f"{unmatched_glob(path, setting)}. Check the pattern in {setting}.")
        return files
    # as an unmatched glob: the setting cannot work as it is (exit 2)
    raise DataPathMissing(f"{setting} {path!r} does not exist. Give an existing file, folder or glob.")


def readable_files(files: Iterable[Path]) -> list[Path]:
    """The files of a type longtrain reads (BUILDERS' suffixes), sorted."""
    return sorted(f for f in files if f.suffix.lower() in BUILDERS)


def no_readable_files(files: list[Path], path: str) -> str:
    """Why `path`, whose files are `files`, gives no documents: none of them is of a type longtrain reads (what they
    are instead)."""
    kinds = ", ".join(BUILDERS)
    if not files:
        return f"No readable documents in {path!r}: it holds no files (it should hold files ending in {kinds})"
    ends = Counter(f.suffix.lower() or "no suffix" for f in files).most_common()
    held = ", ".join(f"{n} {end}" for end, n in ends[:5]) + (f" and {len(ends) - 5} other kinds" if len(ends) > 5 else "")
    return f"No readable documents in {path!r}: none of its {len(files)} files ends in {kinds} (it holds {held})"


def invalid_utf8_bytes(raw: bytes) -> int:
    """Number of bytes that are not valid UTF-8 (each becomes U+FFFD when read)."""
    try:
        raw.decode("utf-8")
        return 0
    except UnicodeDecodeError:
        # 'ignore' drops exactly the invalid bytes; the valid rest re-encodes to the same bytes.
        return len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))


def files_source(path: str, text_field: str = "text", setting: str = "data.path", *, on_bad_file: str = "error") -> Source:
    """The files of `path`. on_bad_file "skip": a file that cannot be read or parsed, or a .txt that is
    mostly not text, is left out (listed in `Source.skipped`) instead of stopping with a DataError."""
    files = find_files(path, setting)
    skip = on_bad_file == "skip"
    skipped: list[tuple[str, str]] = []
    h = hashlib.blake2b(digest_size=16)
    h.update(f"files:{text_field}\n".encode())
    if skip:  # what it leaves out is part of what the cache holds
        h.update(b"on_bad_file:skip\n")
    total, invalid, kept = 0, 0, []
    root = Path(path).expanduser()
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError as e:
            why = f"cannot be read ({e.strerror or e})"
            if skip:
                skipped.append((str(f), why))
                continue
            raise DataError(f"{f} {why}. Fix it, remove it from {setting}, or set data.on_bad_file: skip") from None
        if f.suffix.lower() == ".txt":
            bad = invalid_utf8_bytes(raw)
            if bad > MAX_INVALID_FRACTION * len(raw):
                if skip:
                    skipped.append((str(f), f"is mostly not text ({bad / len(raw):.0%} of its bytes are not UTF-8)"))
                    continue
                raise DataError(
                    f"{f} is mostly not text: {bad:,} of its {len(raw):,} bytes ({bad / len(raw):.0%}) are not "
                    f"UTF-8 (at most {MAX_INVALID_FRACTION:.0%} is accepted). Remove it from {setting}, "
                    "convert it to UTF-8 text first, or set data.on_bad_file: skip."
                )
            invalid += bad
        total += len(raw)
        kept.append(f)
        # Relative names, so a moved corpus keeps its cache.
        name = str(f.relative_to(root)) if root.is_dir() else f.name
        h.update(f"{name}\0{len(raw)}\0".encode())
        h.update(raw)
    if not kept:
        listed = "; ".join(f"{f} {why}" for f, why in skipped[:5])
        raise DataError(f"every file in {setting} {path!r} is bad, nothing is left to read: {listed}")
    groups: dict[str, list[str]] = {}
    for f in kept:
        groups.setdefault(BUILDERS[f.suffix.lower()], []).append(str(f))
    if not skip:
        _check_text_field(groups, text_field)

    def documents() -> Iterator[str]:
        for builder, paths in groups.items():
            if not skip or builder == "text":
                yield from _texts(_load(builder, paths), text_field, f"{builder} files in {path!r}")
                continue
            for p in paths:  # one file at a time, read whole before its documents go on: a bad one is left out entirely
                try:
                    texts = list(_texts(_load(builder, [p]), text_field, p))
                except DataError as e:
                    if not any(f == p for f, _ in skipped):  # documents() runs more than once (tokenizer, tokens)
                        skipped.append((p, f"does not parse ({str(e).removeprefix(f'Could not read {p}: ')[:200]})"))
                    continue
                yield from texts

    return Source(
        description=f"{len(kept)} files in {path!r}" + (f" ({len(skipped)} skipped)" if skipped else ""),
        fingerprint=h.hexdigest(),
        total_bytes=total,
        n_docs=len(kept) if list(groups) == ["text"] else None,
        invalid_utf8=invalid,
        documents=documents,
        skipped=skipped,
    )


def _load(builder: str, paths: list[str]) -> Iterable[dict]:
    import datasets

    kwargs = {"sample_by": "document", "encoding_errors": "replace"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=paths, split="train", streaming=True, **kwargs)
    except Exception as e:  # datasets raises many types; all mean "these files do not load"
        raise DataError(f"Could not read {builder} files ({paths[0]} ...): {e}") from e


def _check_text_field(groups: dict[str, list[str]], text_field: str) -> None:
    """Fail early, naming the file and its fields, when rows lack `text_field`.

    Only the first file of each kind is opened here (opening costs ~0.1 s);
    later files are checked row by row while they are read.
    """
    for builder, paths in groups.items():
        if builder == "text":
            continue
        p = paths[0]
        try:
            row = next(iter(_load(builder, [p])), None)
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"Could not read {p}: {e}. Is it valid {builder}?") from e
        if row is not None and text_field not in row:
            raise DataError(
                f"{p} has no field {text_field!r} (its fields: {', '.join(row) or 'none'}). "
                "Set data.text_field to the column that holds the document text."
            )


def _texts(rows: Iterable[dict], text_field: str, what: str) -> Iterator[str]:
    try:
        for row in rows:
            if text_field not in row:
                raise DataError(
                    f"A row of {what} has no field {text_field!r} (its fields: {', '.join(row)}). "
                    "Set data.text_field to the column that holds the document text."
                )
            text = row[text_field]
            if isinstance(text, str) and text:
                yield text
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"Could not read {what}: {e}") from e


# ---------------------------------------------------------------- hub


def hub_source(name: str, split: str = "train", text_field: str = "text") -> Source:
    import datasets

    try:
        rows = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:
        raise DataError(
            f"Could not open the data set {name!r} (split {split!r}) from the hub: {e}. "
            "Without a network, use data.source: files with a local path, or stdlib."
        ) from e
    key = hashlib.blake2b(f"hub:{name}:{split}:{text_field}".encode(), digest_size=16).hexdigest()
    return Source(
        description=f"hub data set {name!r} split {split!r}",
        fingerprint=key,
        total_bytes=None,
        n_docs=None,
        invalid_utf8=0,
        documents=lambda: _texts(rows, text_field, f"the data set {name!r}"),
    )
