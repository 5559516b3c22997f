"""L2 of the hierarchical cache: a bounded pool of pages in host memory, by page key, least recently used out.

A page enters while its device→host copy may still be in flight (``HostPage`` holds the device row and
has started the copy, ``copy_to_host_async``), so demoting a page never waits for the step running on
the device; the first reader that needs its bytes waits for that copy only. Thread-safe: the scheduler
puts and takes pages, the storage threads put prefetched pages and read pages to back up.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class HostPage:
    """One page's contents: a row of a device array being copied to the host, or host bytes."""
    __slots__ = ("_device", "_row", "_host", "from_storage")

    def __init__(self, device=None, row: int = 0, host: np.ndarray | None = None, from_storage: bool = False):
        self._device, self._row, self._host = device, row, host
        self.from_storage = from_storage  # prefetched from L3, not yet loaded onto the device

    def array(self) -> np.ndarray:
        # No lock: the scheduler and a storage thread may both land the same page; both get the
        # same bytes, and neither waits on another page's copy.
        host = self._host
        if host is None:
            device = self._device
            if device is None:   # another thread landed it in between
                return self._host
            # a copy, not a view: the batch's other rows may leave L2 before this one
            host = np.asarray(device)[self._row].copy()
            self._host, self._device = host, None   # the device batch goes when its last page has landed
        return host


class HostPool:
    def __init__(self, capacity_pages: int):
        if capacity_pages < 1:
            raise ValueError(f"the host pool must hold at least one page, got {capacity_pages}")
        self.capacity = capacity_pages
        self._pages: OrderedDict[bytes, HostPage] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def put(self, key: bytes, page: HostPage) -> list[tuple[bytes, HostPage]]:
        """Hold ``page`` (most recently used); the pages pushed out to make room."""
        with self._lock:
            if key in self._pages:
                self._pages.move_to_end(key)
                return []
            self._pages[key] = page
            out = []
            while len(self._pages) > self.capacity:
                out.append(self._pages.popitem(last=False))
            return out

    def get(self, key: bytes) -> HostPage | None:
        with self._lock:
            page = self._pages.get(key)
            if page is not None:
                self._pages.move_to_end(key)
            return page

    def prefix(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the pool holds."""
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._pages:
                n += 1
            return n

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
