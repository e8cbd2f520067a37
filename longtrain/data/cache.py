"""The token cache: tokenized documents stored once on disk.

One entry is a folder named by its key (a hash of corpus content, tokenizer
and `min_doc_tokens`):

    tokens.bin      int32, every kept document's tokens back to back (EOD last)
    offsets.npy     int64 [n+1], document i is tokens[offsets[i]:offsets[i+1]]
    source_ids.npy  int64 [n], position of each document in the source's order
    manifest.json   counts, build statistics and a checksum of tokens.bin

An entry is built in a temporary folder and renamed into place (atomic), under
an exclusive `flock` on `<key>.lock`, so two runs never write the same entry
and a reader never sees half of one. An entry whose files disagree with its
manifest is treated as absent and rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from longtrain.paths import user_cache_root

FORMAT = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("LONGTRAIN_CACHE") or user_cache_root() / "tokens")


class TokenDocs:
    """Token documents backed by a memory-mapped array; optionally a subset of an entry."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, source_ids: np.ndarray):
        self.tokens, self.starts, self.ends, self.source_ids = tokens, starts, ends, source_ids

    @classmethod
    def empty(cls) -> TokenDocs:
        z = np.zeros(0, np.int64)
        return cls(np.zeros(0, np.int32), z, z, z)

    def __len__(self) -> int:
        return len(self.starts)

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document i (int32, read-only, EOD last)."""
        return self.tokens[self.starts[i] : self.ends[i]]

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def subset(self, index: np.ndarray) -> TokenDocs:
        index = np.asarray(index, dtype=np.int64)
        return TokenDocs(self.tokens, self.starts[index], self.ends[index], self.source_ids[index])

    def __repr__(self) -> str:
        return f"TokenDocs({len(self)} documents, {self.n_tokens:,} tokens)"


def checksum(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def open_entry(entry: Path, *, verify: bool = True) -> tuple[TokenDocs, dict] | None:
    """The entry's documents and manifest, or None if it is absent or corrupt."""
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        if manifest.get("format") != FORMAT:
            return None
        n_tokens, n_docs = manifest["n_tokens"], manifest["n_docs"]
        offsets = np.load(entry / "offsets.npy")
        source_ids = np.load(entry / "source_ids.npy")
        tokens_path = entry / "tokens.bin"
        if (
            tokens_path.stat().st_size != 4 * n_tokens
            or offsets.shape != (n_docs + 1,)
            or source_ids.shape != (n_docs,)
            or offsets[0] != 0
            or offsets[-1] != n_tokens
            or np.any(np.diff(offsets) <= 0)
        ):
            return None
        if verify and checksum(tokens_path) != manifest["checksum"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # An entry where every document was dropped is empty; np.memmap refuses empty files.
    tokens = np.memmap(tokens_path, dtype=np.int32, mode="r") if n_tokens else np.zeros(0, np.int32)
    return TokenDocs(tokens, offsets[:-1], offsets[1:], source_ids), manifest


@contextmanager
def _locked(path: Path):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class EntryWriter:
    """Appends documents to a new entry's files; `finish` writes the manifest."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._tokens = open(folder / "tokens.bin", "wb")
        self._hash = hashlib.blake2b(digest_size=16)
        self.offsets = [0]
        self.source_ids: list[int] = []

    def add(self, source_id: int, ids: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
        self._tokens.write(data)
        self._hash.update(data)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.source_ids.append(source_id)

    def finish(self, info: dict) -> None:
        self._tokens.close()
        np.save(self.folder / "offsets.npy", np.array(self.offsets, dtype=np.int64))
        np.save(self.folder / "source_ids.npy", np.array(self.source_ids, dtype=np.int64))
        manifest = {
            "format": FORMAT,
            "n_docs": len(self.source_ids),
            "n_tokens": self.offsets[-1],
            "checksum": self._hash.hexdigest(),
            **info,
        }
        (self.folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def cached_tokens(
    cache_dir: Path, key: str, build: Callable[[EntryWriter], dict]
) -> tuple[TokenDocs, dict, bool]:
    """Open entry `key`, building it with `build(writer) -> info` if absent or corrupt.

    Returns (documents, manifest, hit). `build` may raise; nothing is left behind.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / key
    if (found := open_entry(entry)) is not None:  # entries appear by rename: no lock needed to read
        return (*found, True)
    with _locked(cache_dir / f"{key}.lock"):
        if (found := open_entry(entry)) is not None:  # another run built it while we waited
            return (*found, True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=cache_dir))
        try:
            writer = EntryWriter(tmp)
            writer.finish(build(writer))
            if entry.exists():  # corrupt: move it aside, then drop it
                trash = Path(tempfile.mkdtemp(prefix=f"{key}.old-", dir=cache_dir))
                entry.rename(trash / "entry")
                shutil.rmtree(trash, ignore_errors=True)
            tmp.rename(entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    found = open_entry(entry, verify=False)  # just written and checksummed while writing
    assert found is not None, f"token cache entry {entry} unreadable right after writing"
    return (*found, False)


def cached_file(path: Path, make: Callable[[], str]) -> str:
    """Text at `path`, made by `make()` once and written atomically under a lock."""
    if path.is_file():
        return path.read_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        if path.is_file():
            return path.read_text()
        text = make()
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
        return text



# ----------------------------------------------------------------------------- `longtrain cache`


@dataclass
class CacheItem:
    """One thing in the token cache: an entry (tokenized documents), a trained tokenizer, or a
    build that never finished (its temporary folder)."""

    path: Path
    kind: str  # "tokens", "tokenizer" or "unfinished"
    what: str  # the corpus it holds, as its manifest says
    size: int  # bytes on disk
    written: float  # modification time (seconds since the epoch)
    docs: int | None = None
    tokens: int | None = None

    @property
    def key(self) -> str:
        return self.path.name.split(".", 1)[0]


def disk_size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cache_items(cache_dir: Path) -> list[CacheItem]:
    """What the cache folder holds, oldest first."""
    items: list[CacheItem] = []
    if not cache_dir.is_dir():
        return items
    for path in cache_dir.iterdir():
        if path.is_dir() and path.name == "tokenizers":
            for tok in path.glob("*.json"):
                items.append(CacheItem(tok, "tokenizer", "a trained BPE tokenizer", tok.stat().st_size, tok.stat().st_mtime))
        elif path.is_dir() and (".tmp-" in path.name or ".old-" in path.name):
            items.append(CacheItem(path, "unfinished", "a build that did not finish", disk_size(path), path.stat().st_mtime))
        elif path.is_dir():
            try:
                manifest = json.loads((path / "manifest.json").read_text())
            except (OSError, ValueError):
                manifest = {}
            what = str(manifest.get("source", "unreadable entry (it is rebuilt when needed)"))
            items.append(CacheItem(path, "tokens", what, disk_size(path), path.stat().st_mtime,
                                   manifest.get("n_docs"), manifest.get("n_tokens")))
    return sorted(items, key=lambda item: item.written)


def clear_cache(items: list[CacheItem]) -> tuple[list[CacheItem], list[CacheItem]]:
    """Delete the items; returns (deleted, in use). An entry whose lock another process holds (it is
    being built) is left alone; a run that has an entry open keeps reading it (the files live on
    until it closes them)."""
    deleted, busy = [], []
    for item in items:
        lock = item.path.parent / f"{item.path.name if item.kind == 'tokenizer' else item.key}.lock"
        with open(lock, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy.append(item)
                continue
            if item.path.is_dir():
                shutil.rmtree(item.path, ignore_errors=True)
            else:
                item.path.unlink(missing_ok=True)
            if item.kind != "unfinished":
                lock.unlink(missing_ok=True)
            deleted.append(item)
    return deleted, busy


def age(seconds_since_epoch: float) -> str:
    """`3 h ago`, `12 d ago`: how long ago a cache item was written."""
    ago = max(0.0, time.time() - seconds_since_epoch)
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if ago >= length:
            return f"{ago / length:.0f} {unit} ago"
    return "just now"
