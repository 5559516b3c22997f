"""The types at the engine's door: what ``Engine.submit`` refuses, and what it returns.

``RequestError`` carries the HTTP status and the field at fault (named as the engine names
it: ``prompt``, ``max_new_tokens``, ``rid``, a grammar field), so a server answers it as it
is. A ``Handle`` is one client request, all of its ``n`` samples: the engine thread pushes
each sample's deltas into it, the caller's event loop reads them, and closing it (or leaving
``deltas`` early: a client gone) aborts what is unfinished and frees its memory.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import AsyncIterator, Callable


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class Handle:
    def __init__(self, rid: str, rids: list[str], close: Callable[["Handle"], None]):
        self.rid, self.rids = rid, rids
        self._close = close
        self._closed = False
        self._items: deque[tuple[int, dict]] = deque()
        self._guard = threading.Lock()
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def put(self, index: int, delta: dict) -> None:
        """Sample ``index``'s news (the engine thread)."""
        with self._guard:
            self._items.append((index, delta))
            wake = self._wake
        if wake is not None:
            try:
                wake[0].call_soon_threadsafe(wake[1].set)
            except RuntimeError:   # the reader's loop is gone: nobody to wake
                pass

    async def deltas(self) -> AsyncIterator[tuple[int, dict]]:
        """``(sample index, delta)`` as the samples advance, until every one has finished."""
        event = asyncio.Event()
        with self._guard:
            self._wake = (asyncio.get_running_loop(), event)
        left = len(self.rids)
        try:
            while left:
                event.clear()
                with self._guard:
                    items, self._items = self._items, deque()
                if not items:
                    await event.wait()
                    continue
                for i, delta in items:
                    left -= delta["finish_reason"] is not None
                    yield i, delta
        finally:
            with self._guard:
                self._wake = None
            self.close()

    def close(self) -> None:
        """Abort the unfinished samples and forget them (idempotent)."""
        if not self._closed:
            self._closed = True
            self._close(self)
