"""L3 of the hierarchical cache: pages in storage that outlives the process and is shared by instances.

``HiCacheStorage`` is the interface, after SGLang's (``mem_cache/hicache_storage.py``): batch ``get``,
``set`` and ``exists`` by page key (serve/kv_pages.py), the payload a page's bytes. ``FileStorage``
(``--hicache-storage-backend file``) keeps one file a page in a directory any number of engines may
share:

- a file is ``<key hex>.page``: a header (magic, format version, the model identity, the key, the
  payload's length and its BLAKE2b checksum) then the payload. Written to a temporary file in the same
  directory and renamed over the name (``os.replace`` is atomic), so a reader sees a whole page or none,
  and two writers of one key write the same bytes;
- a read checks all of it; a page that is truncated, corrupted or of another model is a miss, logged
  once (one line) and removed so the next write replaces it. Nothing a file holds can raise past here;
- ``max_bytes`` bounds the directory: a write that takes it past the bound first removes the least
  recently used pages (a read touches its file's mtime), whichever engine wrote them; a page that
  another engine removes while this one reads it is a miss;
- a write that fails (a full disk, a read-only directory) is a lost backup, not an error: ``set``
  returns False for it and the failure is logged once per kind.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence

log = logging.getLogger("megajax")

_MAGIC, _VERSION = b"MJKVPAGE", 1
_HEADER = struct.Struct("<8sH32s32sQ16s")   # magic, version, identity, key, payload bytes, checksum
_SUFFIX = ".page"
_STALE_TMP_S = 600   # a temporary file this old belongs to a writer that died


class HiCacheStorage(ABC):
    """Pages by key; every method is safe to call from several threads."""

    @abstractmethod
    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's payload, or None (absent or unreadable)."""

    @abstractmethod
    def batch_set(self, keys: Sequence[bytes], values: Sequence[bytes]) -> list[bool]:
        """Store each page (one already there is left as it is); whether each is stored."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (a prefix: the rest is no use without it)."""


def _checksum(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class FileStorage(HiCacheStorage):
    def __init__(self, directory: str | Path, identity: bytes, page_bytes: int, max_bytes: int | None = None):
        if len(identity) != 32:
            raise ValueError("a model identity is 32 bytes (serve/kv_pages.py's model_identity)")
        self.dir = Path(directory)
        self.identity, self.page_bytes, self.max_bytes = identity, page_bytes, max_bytes
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--hicache-storage-dir {self.dir}: {e.strerror or e}") from None
        self._lock = threading.Lock()
        self._failures: set[str] = set()   # kinds of write failure already logged
        self.stats = {"read_bytes": 0, "written_bytes": 0, "bad_pages": 0, "failed_writes": 0, "evicted_pages": 0}
        self._size = self._scan_size()

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + _SUFFIX)

    # ------------------------------------------------------------------ reads
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if not self._path(key).is_file():
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._get(k) for k in keys]

    def _get(self, key: bytes) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read(_HEADER.size + self.page_bytes + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("hicache storage: cannot read %s (%s): a miss", path.name, e)
            return None
        why = self._invalid(blob, key)
        if why is not None:
            with self._lock:
                self.stats["bad_pages"] += 1
            log.warning("hicache storage: %s %s: a miss (removed)", path.name, why)
            self._remove(path)
            return None
        with self._lock:
            self.stats["read_bytes"] += self.page_bytes
        try:
            os.utime(path)   # recently used: evicted last (a read-only or shared directory may refuse)
        except OSError:
            pass
        return blob[_HEADER.size:]

    def _invalid(self, blob: bytes, key: bytes) -> str | None:
        """Why ``blob`` is not this model's page ``key`` (None: it is)."""
        if len(blob) < _HEADER.size:
            return "is truncated"
        magic, version, identity, stored_key, n, digest = _HEADER.unpack_from(blob)
        payload = blob[_HEADER.size:]
        if magic != _MAGIC or version != _VERSION:
            return "is not a page of this format"
        if identity != self.identity:
            return "belongs to another model"
        if stored_key != key:
            return "holds another page"
        if n != self.page_bytes or len(payload) != n:
            return "is truncated" if len(payload) < n else "has the wrong size"
        if _checksum(payload) != digest:
            return "fails its checksum"
        return None

    # ------------------------------------------------------------------ writes
    def batch_set(self, keys: Sequence[bytes], values: Sequence[bytes]) -> list[bool]:
        return [self._set(k, v) for k, v in zip(keys, values)]

    def _set(self, key: bytes, payload: bytes) -> bool:
        if len(payload) != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {len(payload)}")
        path = self._path(key)
        if path.is_file():
            return True
        size = _HEADER.size + len(payload)
        if self.max_bytes is not None and not self._make_room(size):
            return self._failed("the size bound (--hicache-storage-size) is below one page")
        tmp = self.dir / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, _VERSION, self.identity, key, len(payload), _checksum(payload)))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            self._remove(tmp)
            return self._failed({errno.ENOSPC: "the disk is full", errno.EROFS: "the directory is read-only",
                                 errno.EACCES: "the directory is not writable"}.get(e.errno, str(e)))
        with self._lock:
            self._size += size
            self.stats["written_bytes"] += len(payload)
        return True

    def _failed(self, why: str) -> bool:
        with self._lock:
            self.stats["failed_writes"] += 1
            first = why not in self._failures
            self._failures.add(why)
        if first:
            log.warning("hicache storage: cannot write pages to %s: %s; they stay misses", self.dir, why)
        return False

    def _make_room(self, size: int) -> bool:
        """Remove least recently used pages until ``size`` more bytes fit the bound (other engines
        write here too: the directory is measured again when the running count says it is full)."""
        if size > self.max_bytes:
            return False
        with self._lock:
            if self._size + size <= self.max_bytes:
                return True
            pages = self._listing()
            total = sum(s for _, _, s in pages)
            pages.sort()
            target = min(self.max_bytes - size, int(0.9 * self.max_bytes))   # a margin: not a rescan a write
            removed = 0
            for _, path, s in pages:
                if total <= target:
                    break
                if self._remove(path):
                    total -= s
                    removed += 1
            self._size = total
            self.stats["evicted_pages"] += removed
            return total <= target

    def _listing(self) -> list[tuple[float, Path, int]]:
        """``(mtime, path, bytes)`` of every page file; stale temporary files are removed."""
        out, now = [], time.time()
        with os.scandir(self.dir) as it:
            for e in it:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.endswith(_SUFFIX):
                    out.append((st.st_mtime, Path(e.path), st.st_size))
                elif e.name.startswith(".tmp-") and now - st.st_mtime > _STALE_TMP_S:
                    self._remove(Path(e.path))
        return out

    def _scan_size(self) -> int:
        return sum(s for _, _, s in self._listing())

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False


def make_storage(backend: str, directory: str, identity: bytes, page_bytes: int,
                 max_bytes: int | None) -> HiCacheStorage:
    if backend != "file":
        raise ValueError(f"hicache storage backend must be file, not {backend!r}")
    return FileStorage(directory, identity, page_bytes, max_bytes)
