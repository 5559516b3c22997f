"""The prefill side: bootstrap rooms and the bootstrap server D talks to (``--disaggregation-bootstrap-port``).

A room (the router's ``bootstrap_room``) moves through SGLang's ``KVPoll`` states:

    Bootstrapping    the request arrived (or D registered first); P waits for D to register
    WaitingForInput  D registered: P prefills (the request with ``max_new_tokens`` 1)
                     ... the prefill ends: its state is ready (``ready`` in GET's answer)
    Transferring     D asked for it (``POST .../pull``): the pages are offered to D's fetch
    Success          D acknowledged (``DELETE``): the room closes (P's request ended with its prefill)
    Failed           D never registered within the bootstrap timeout, went silent (its polls are
                     its heartbeat) for heartbeat interval x max failures, the prefill was aborted,
                     or D gave up (``DELETE`` with ``ok`` false); the request on P ends too. The
                     timeouts are applied when a room is touched and by ``sweep`` (every heartbeat
                     interval), which drops a silent D's state

The bootstrap server's routes: ``GET /health``; ``PUT /rooms/{room}`` (D registers); ``GET
/rooms/{room}`` (D polls: state, and once ready what to fetch); ``POST /rooms/{room}/pull``;
``DELETE /rooms/{room}``. Rooms are reached from aiohttp handlers (P's server and this one, one
event loop) and from the engine loop's thread (``exporter``): one lock.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from aiohttp import web

from serve.disaggregation.config import DisaggregationConfig, KVPoll, count_states
from serve.disaggregation.handoff import Prefilled, TransferFailed
from serve.disaggregation.transfer import KVTransfer


@dataclass
class Room:
    state: KVPoll = KVPoll.Bootstrapping
    created: float = 0.0
    seen: float = 0.0  # D's last contact
    prefilled: Prefilled | None = None
    error: str = ""


class PrefillSide:
    def __init__(self, config: DisaggregationConfig, transfer: KVTransfer, identity: bytes):
        self.config, self.transfer, self.identity = config, transfer, identity.hex()
        self._rooms: dict[int, Room] = {}
        self._lock = threading.Lock()
        self.failed = 0

    # ------------------------------------------------------------------ rooms
    def _room(self, room: int) -> Room:
        r = self._rooms.get(room)
        if r is None:
            now = time.monotonic()
            r = self._rooms[room] = Room(created=now, seen=now)
        return r

    def _fail(self, room: int, why: str) -> None:
        r = self._rooms.get(room)
        if r is not None and r.state not in (KVPoll.Success, KVPoll.Failed):
            r.state, r.error, r.prefilled = KVPoll.Failed, why, None
            self.failed += 1

    def _check(self, room: int) -> Room:
        """The room, after its timeouts (lock held)."""
        r, now, c = self._room(room), time.monotonic(), self.config
        if r.state == KVPoll.Bootstrapping and now - r.created > c.bootstrap_timeout:
            self._fail(room, f"bootstrap room {room}: the decode server did not register within "
                             f"{c.bootstrap_timeout:g} s")
        elif r.state in (KVPoll.WaitingForInput, KVPoll.Transferring) and now - r.seen > c.heartbeat_timeout:
            self._fail(room, f"bootstrap room {room}: lost the decode server (no contact for "
                             f"{c.heartbeat_timeout:g} s)")
        return r

    async def prefill_allowed(self, room: int) -> None:
        """(P's request handler) Wait for D to register; TransferFailed when it does not."""
        while True:
            with self._lock:
                r = self._check(room)
                if r.state == KVPoll.Failed:
                    raise TransferFailed(r.error)
                if r.state != KVPoll.Bootstrapping:   # D registered
                    return
            await asyncio.sleep(self.config.poll_interval)

    def exporter(self, room: int):
        """The engine's ``export`` for the request of ``room`` (called on the engine loop's thread)."""
        def export(state: Prefilled | None) -> None:
            with self._lock:
                r = self._rooms.get(room)   # gone: it failed and was swept
                if state is None:
                    self._fail(room, f"bootstrap room {room}: the prefill was aborted")
                elif r is not None and r.state == KVPoll.WaitingForInput:
                    r.prefilled = state
        return export

    def sweep(self) -> None:
        """Apply the rooms' timeouts (a silent D's state is dropped here, not when someone next asks)
        and forget the failed rooms no request handler is waiting on any more."""
        with self._lock:
            now = time.monotonic()
            for room in list(self._rooms):
                r = self._check(room)
                if r.state == KVPoll.Failed and now - r.seen > 2 * self.config.bootstrap_timeout:
                    del self._rooms[room]

    def rooms(self) -> dict[str, int]:
        """Rooms by state (``/server_info``)."""
        with self._lock:
            return count_states(r.state for r in self._rooms.values())

    # ------------------------------------------------------------------ the bootstrap server
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", lambda request: web.Response(text="OK"))
        app.router.add_put("/rooms/{room}", self._register)
        app.router.add_get("/rooms/{room}", self._poll)
        app.router.add_post("/rooms/{room}/pull", self._pull)
        app.router.add_delete("/rooms/{room}", self._close)
        return app

    def _contact(self, request: web.Request) -> tuple[int, Room]:
        """(Lock held.) The room a bootstrap request names, after its timeouts; D was just heard from."""
        try:
            room = int(request.match_info["room"])
        except ValueError:
            raise web.HTTPBadRequest(text="a bootstrap room is an integer") from None
        r = self._check(room)
        r.seen = time.monotonic()
        return room, r

    def _answer(self, r: Room) -> web.Response:
        out = {"state": r.state.name, "error": r.error, "ready": r.prefilled is not None, "identity": self.identity}
        if r.prefilled is not None:
            p = r.prefilled
            out.update(n_pages=p.n_pages, first=p.first, cached_tokens=p.cached_tokens,
                       logprob=p.logprob,
                       top_logprobs=p.top_logprobs,
                       shape=None if p.pages is None else list(p.pages.shape),
                       dtype=None if p.pages is None else p.pages.dtype.name)
        return web.json_response(out)

    async def _register(self, request: web.Request) -> web.Response:
        with self._lock:
            _, r = self._contact(request)
            if r.state == KVPoll.Bootstrapping:
                r.registered, r.state = True, KVPoll.WaitingForInput
            return self._answer(r)

    async def _poll(self, request: web.Request) -> web.Response:
        """A long poll: the answer comes when the room is ready or failed, or after a heartbeat interval
        (D's next poll is its next heartbeat), so D's requests cost P one HTTP request a second, not
        one every few milliseconds."""
        deadline = time.monotonic() + min(self.config.heartbeat_interval / 2, 1.0)
        while True:
            with self._lock:
                _, r = self._contact(request)
                if r.prefilled is not None or r.state == KVPoll.Failed or time.monotonic() > deadline:
                    return self._answer(r)
            await asyncio.sleep(self.config.poll_interval)

    async def _pull(self, request: web.Request) -> web.Response:
        with self._lock:
            room, r = self._contact(request)
            if r.prefilled is None or r.state != KVPoll.WaitingForInput:
                return web.json_response({"state": r.state.name, "error": r.error or "nothing to pull"}, status=409)
            r.state = KVPoll.Transferring
            if r.prefilled.pages is not None:
                self.transfer.offer(room, r.prefilled.pages, self.config.waiting_timeout)
            r.prefilled = None   # the offer holds its copy now
            return web.json_response({"state": r.state.name, "address": self.transfer.address()})

    async def _close(self, request: web.Request) -> web.Response:
        ok = request.query.get("ok", "1") == "1"
        with self._lock:
            room, r = self._contact(request)
            pageless = r.prefilled is not None and r.prefilled.pages is None   # nothing to pull: D has it all
            if ok and (r.state == KVPoll.Transferring or pageless):
                r.state = KVPoll.Success
                del self._rooms[room]
            else:
                self._fail(room, request.query.get("why", f"bootstrap room {room}: the decode server gave up"))
            return web.json_response({"state": r.state.name})
