"""The hierarchical prefix cache: device pages (L1), a host pool (L2), shared storage (L3). SGLang's HiCache
(SERVING_CONVENTIONS §8), for V4.1's pages (serve/kv_pages.py: the global state only, chained keys).

Where each page lives. L1 is the radix cache over the device pages (serve/radix_cache.py), as without
tiers. L2 (serve/host_cache.py) and L3 (serve/cache_storage.py) are addressed by page key: a key is a
chained hash naming the page's whole prefix, so the keys of a prompt's pages are the path through a
prefix tree, and "which tier holds this node" is which of L1's tree, L2's table or L3's directory
holds the key; L3 is asked live (other engines write it), as SGLang does.

The flow of a request (``Scheduler`` calls these, on its thread):

1. ``ready``: while it waits, pages past what L1 and L2 hold are looked up in L3 and, when the hit is
   at least ``prefetch_threshold`` tokens, read into L2 by a storage thread. The prefetch policy says
   how long admission waits: ``best_effort`` not at all (it takes what has landed), ``wait_complete``
   until the prefetch is done, ``timeout`` until then or ``base + per_ki_token x tokens / 1024`` s.
2. ``match`` then ``load`` at admission: the pages after L1's prefix that L2 holds are written into
   fresh device pages (one scatter, dispatched behind the step in flight) and join the radix tree, so
   the hit, its encoder replay and ``cached_tokens`` are those of any device hit: every tier counts.
3. ``used`` (a device page committed by a finished request, or hit) and ``demote`` (a device page
   evicted) copy pages down, by the write policy: ``write_through`` copies a page to L2 and L3 when
   it is committed; ``write_through_selective`` once it has been used twice; ``write_back`` only when
   it is evicted: from L1 into L2, and from L2 into L3. Device→host copies are dispatched behind the
   running step and land on an I/O thread (which then frees their device rows); storage reads and
   writes run there too. Every policy keeps an evicted L1 page in L2.

What fails degrades to a miss: an unreadable page, a full or read-only storage directory, a page
evicted from L2 before it was loaded (admission then computes it).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, Sequence

import jax
import numpy as np

from serve.cache_storage import HiCacheStorage, make_storage
from serve.host_cache import HostPage, HostPool
from serve.kv_pages import PageLayout, page_keys

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
TIERS = ("device", "host", "storage")
log = logging.getLogger("megajax")


@dataclass(frozen=True)
class HiCacheConfig:
    """``--enable-hierarchical-cache`` and its options (SGLang's names and defaults)."""
    ratio: float = 2.0  # --hicache-ratio: host pool pages per device pool page
    size_gb: float = 0.0  # --hicache-size: the host pool in GB; over 0 it overrides the ratio
    write_policy: str = "write_through"
    storage_backend: str | None = None  # "file", or None: no L3
    storage_dir: str = "/tmp/hicache"
    storage_size_gb: float | None = None  # bound of the storage directory (None: unbounded)
    prefetch_policy: str = "best_effort"
    prefetch_threshold: int = 256  # tokens: shorter L3 hits are not fetched
    prefetch_timeout_base: float = 1.0  # seconds (policy timeout)
    prefetch_timeout_per_ki_token: float = 0.25

    def __post_init__(self):
        numbers = (self.ratio, self.size_gb, self.prefetch_threshold, self.prefetch_timeout_base,
                   self.prefetch_timeout_per_ki_token)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
            raise ValueError("the hicache sizes, prefetch threshold and timeouts must be numbers")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache write policy must be one of {', '.join(WRITE_POLICIES)}, "
                             f"not {self.write_policy!r}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"hicache storage prefetch policy must be one of {', '.join(PREFETCH_POLICIES)}, "
                             f"not {self.prefetch_policy!r}")
        if self.storage_backend not in (None, "file"):
            raise ValueError(f"hicache storage backend must be file, not {self.storage_backend!r}")
        if self.ratio <= 0 or self.size_gb < 0:
            raise ValueError("--hicache-ratio must be positive and --hicache-size not negative")
        if self.storage_size_gb is not None and self.storage_size_gb <= 0:
            raise ValueError("--hicache-storage-size must be positive")
        if self.prefetch_threshold < 0 or self.prefetch_timeout_base < 0 or self.prefetch_timeout_per_ki_token < 0:
            raise ValueError("the prefetch threshold and timeouts must not be negative")

    def host_pages(self, device_pages: int, page_bytes: int) -> int:
        if self.size_gb > 0:
            return max(int(self.size_gb * 1e9) // page_bytes, 1)
        return max(int(self.ratio * device_pages), 1)


class PageDevice(Protocol):
    """The device pools (serve/runner.py's ``ModelRunner``)."""

    def read_pages(self, pages: Sequence[int]) -> jax.Array: ...   # row i: pages[i] (padded past them)

    def write_pages(self, pages: Sequence[int], data: np.ndarray) -> None: ...


@dataclass
class _Prefetch:
    """An L3 read into L2 for one waiting request."""
    future: Future
    deadline: float  # when the timeout policy stops waiting for it (time.monotonic)


def _logged(fn):
    """``fn`` for the I/O threads: what goes wrong there is logged (and the work lost), never raised
    into nothing."""
    def run(*args):
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("hicache: %s failed", getattr(fn, "__name__", "a copy"))
    return run


class HiCache:
    def __init__(self, config: HiCacheConfig, layout: PageLayout, identity: bytes, device: PageDevice,
                 device_pages: int):
        self.config, self.layout, self.identity, self.device = config, layout, identity, device
        self.device_pages = device_pages
        self.host = HostPool(config.host_pages(device_pages, layout.page_bytes))
        self.storage: HiCacheStorage | None = None
        if config.storage_backend is not None:
            bound = None if config.storage_size_gb is None else int(config.storage_size_gb * 1e9)
            self.storage = make_storage(config.storage_backend, config.storage_dir, identity, layout.page_bytes,
                                        bound)
        # off the scheduler's thread: prefetches (storage reads) on one executor, device→host landings
        # and storage writes on another, so a backlog of writes never delays an admission's read
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="hicache-read")
        self._io = ThreadPoolExecutor(1, thread_name_prefix="hicache-write")
        self._threshold = {"write_through": 1, "write_through_selective": 2, "write_back": None}[config.write_policy]
        self._uses: dict[bytes, int] = {}   # device pages' uses, for write_through_selective
        self._prefetches: OrderedDict[str, _Prefetch] = OrderedDict()
        self._writes: list[Future] = []
        self._lock = threading.Lock()
        self.hit_tokens = dict.fromkeys(TIERS, 0)
        self.moved = {"device_to_host": 0, "host_to_device": 0, "storage_to_host": 0, "host_to_storage": 0}

    def keys(self, tokens: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]:
        """The page keys of ``tokens``' whole pages, continuing ``known`` (its first pages' keys)."""
        return page_keys(self.identity, tokens, self.layout.page_size, known)

    # ------------------------------------------------------------------ admission
    def ready(self, rid: str, keys: Sequence[bytes], local_pages: int) -> bool:
        """Whether a waiting request may be admitted now (module docstring, step 1); ``keys``: its
        usable prompt's page keys, ``local_pages``: how many of them the device holds."""
        if self.storage is None:
            return True
        op = self._prefetches.get(rid)
        if op is None:
            start = local_pages + self.host.prefix(keys[local_pages:])
            todo = keys[start:]
            if len(todo) * self.layout.page_size < max(self.config.prefetch_threshold, 1):
                return True   # nothing L3 could add that is worth a prefetch
            c = self.config
            wait = c.prefetch_timeout_base + c.prefetch_timeout_per_ki_token * len(todo) * self.layout.page_size / 1024
            op = self._prefetches[rid] = _Prefetch(self._reads.submit(_logged(self._prefetch), todo),
                                                   time.monotonic() + wait)
            while len(self._prefetches) > 4096:   # requests admitted long ago
                self._prefetches.popitem(last=False)
        if self.config.prefetch_policy == "best_effort" or op.future.done():
            return True
        return self.config.prefetch_policy == "timeout" and time.monotonic() >= op.deadline

    def _prefetch(self, keys: list[bytes]) -> None:
        """(A storage thread.) Read the stored prefix of ``keys`` into L2, page by page, so a best-effort
        admission takes what has landed."""
        n = self.storage.batch_exists(keys)
        if n * self.layout.page_size < self.config.prefetch_threshold:
            return
        for key in keys[:n]:
            payload = self.storage.batch_get([key])[0]
            if payload is None:
                return
            page = HostPage(host=np.frombuffer(payload, self.layout.np_dtype).copy(), from_storage=True)
            with self._lock:
                self.moved["storage_to_host"] += len(payload)
            self._spill(self.host.put(key, page))

    def match(self, keys: Sequence[bytes], device_pages: int) -> list[HostPage]:
        """The pages after the device's first ``device_pages`` of ``keys`` that L2 holds, in order."""
        out = []
        for key in keys[device_pages:]:
            page = self.host.get(key)
            if page is None:
                break
            out.append(page)
        return out

    def load(self, pages: Sequence[int], found: Sequence[HostPage]) -> dict[str, int] | None:
        """Write ``found`` into device ``pages``; the pages that came from each lower tier (None:
        the copy failed, logged, and the hit is a miss)."""
        try:
            data = np.stack([p.array() for p in found])
            self.device.write_pages(pages, data)
        except Exception:   # a failed copy must not take the engine loop with it
            log.exception("hicache: loading %d pages to the device failed: a miss", len(pages))
            return None
        tiers = {"host": 0, "storage": 0}
        for p in found:
            tiers["storage" if p.from_storage else "host"] += 1
            p.from_storage = False
        with self._lock:
            self.moved["host_to_device"] += data.nbytes
        return tiers

    def record_hit(self, device: int, host: int, storage: int) -> None:
        """An adopted hit's pages by the tier they came from."""
        ps = self.layout.page_size
        with self._lock:
            for tier, n in zip(TIERS, (device, host, storage)):
                self.hit_tokens[tier] += n * ps

    # ------------------------------------------------------------------ writes
    def used(self, keys: Sequence[bytes], pages: Sequence[int], first: int = 0) -> None:
        """Device ``pages`` (those of ``keys``, in order) were committed or hit; ``pages[first:]``
        count a use, and those the write policy says go down now are copied."""
        if self._threshold is None:
            return
        keys = keys[:len(pages)]
        down = []
        for j in range(first, len(keys)):
            n = 1
            if self._threshold > 1:   # counted only where a count decides
                n = self._uses[keys[j]] = self._uses.get(keys[j], 0) + 1
            if n >= self._threshold and keys[j] not in self.host:
                down.append(j)
        self._copy_down([keys[j] for j in down], [pages[j] for j in down], to_storage=True)

    def demote(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """The radix cache evicted ``pages``, the last pages of ``tokens``: keep them in L2 (before
        anything overwrites them: the copy is dispatched now)."""
        keys = self.keys(tokens)[-len(pages):]
        for k in keys:
            self._uses.pop(k, None)
        keep = [j for j, k in enumerate(keys) if k not in self.host]
        try:
            self._copy_down([keys[j] for j in keep], [pages[j] for j in keep], to_storage=self._threshold is not None)
        except Exception:   # the eviction goes on: these pages are then simply gone, as without the tiers
            log.exception("hicache: copying %d evicted pages to the host failed: they are dropped", len(keep))

    def _copy_down(self, keys: list[bytes], pages: list[int], to_storage: bool) -> None:
        if not keys:
            return
        rows = self.device.read_pages(pages)
        rows.copy_to_host_async()
        with self._lock:
            self.moved["device_to_host"] += len(keys) * self.layout.page_bytes
        held = [HostPage(rows, i) for i in range(len(keys))]
        for key, page in zip(keys, held):
            self._spill(self.host.put(key, page))
        if to_storage and self.storage is not None:
            self._write(keys, held)
        else:   # land the copies now, so the device rows are freed (not held as long as L2 keeps the pages)
            self._io.submit(_logged(lambda: [p.array() for p in held]))

    def _spill(self, evicted: list[tuple[bytes, HostPage]]) -> None:
        """Pages L2 pushed out: under write_back they go to L3 now (the other policies wrote them)."""
        if evicted and self._threshold is None and self.storage is not None:
            self._write([k for k, _ in evicted], [p for _, p in evicted])

    def _write(self, keys: list[bytes], held: list[HostPage]) -> None:
        @_logged
        def write():
            ok = self.storage.batch_set(keys, [p.array().tobytes() for p in held])
            with self._lock:
                self.moved["host_to_storage"] += sum(ok) * self.layout.page_bytes

        with self._lock:
            self._writes = [f for f in self._writes if not f.done()] + [self._io.submit(write)]

    # ------------------------------------------------------------------ lifecycle
    def warmup(self, max_pages: int) -> None:
        """Compile the page copies for up to ``max_pages`` pages (a request's) now, not at the first hit:
        reads of page 0 and writes past the pool, which are dropped."""
        n = 1
        while True:
            np.asarray(self.device.read_pages([0] * n))
            zeros = np.zeros((n, self.layout.page_bytes), self.layout.np_dtype)
            self.device.write_pages([self.device_pages] * n, zeros)
            if n >= max_pages:
                return
            n *= 2

    def drain(self) -> None:
        """Wait for the storage writes submitted so far (before a shutdown that must keep them)."""
        with self._lock:
            writes, self._writes = self._writes, []
        for f in writes:
            f.result()

    def flush(self) -> None:
        """``/flush_cache``: L2 is dropped with L1; L3, shared with other engines, stays."""
        self.drain()
        self.host.clear()
        self._uses.clear()

    def close(self) -> None:
        """Land the writes and stop the I/O threads (``Engine.stop``); a second call does nothing."""
        self.drain()
        self._reads.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True)

    def metrics(self) -> dict:
        """Per-tier hit tokens and bytes moved between tiers (``/metrics``, ``/get_load``)."""
        with self._lock:
            out = {"hit_tokens": dict(self.hit_tokens), "bytes_moved": dict(self.moved),
                   "host_pages": len(self.host), "host_capacity_pages": self.host.capacity}
        if self.storage is not None:
            out["storage"] = dict(self.storage.stats)
        return out
