"""The decode side: reserve pages, register with P's bootstrap server, wait for the prefill, fetch its pages.

D's view of a room (SGLang's ``KVPoll``): ``Bootstrapping`` until pages are reserved and P's
bootstrap server took the registration; ``WaitingForInput`` while P prefills (D polls the room,
which is also its heartbeat: P unreachable for heartbeat interval x max failures fails the room);
``Transferring`` while it fetches; ``Success`` once P is told. Any failure gives the reserved pages
back, tells P if it can, and raises ``TransferFailed`` with the reason.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np

from serve.disaggregation.config import DisaggregationConfig, KVPoll, count_states
from serve.disaggregation.handoff import Prefilled, Reservation, TransferFailed
from serve.disaggregation.transfer import KVTransfer


class DecodeSide:
    def __init__(self, config: DisaggregationConfig, transfer: KVTransfer, engine):
        self.config, self.transfer, self.engine = config, transfer, engine
        self.identity = engine.page_identity.hex()
        self.states: dict[int, KVPoll] = {}   # rooms in progress (``/server_info``)
        self.failed = 0
        self._session: aiohttp.ClientSession | None = None
        # fetches (which may hang on a dead P: the transfer cannot be cancelled) and the engine's page
        # calls (they wait for its lock) stay off the event loop and out of the default executor
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="pd-decode")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def rooms(self) -> dict[str, int]:
        """Rooms in progress by state (``/server_info``)."""
        return count_states(self.states.values())

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def receive(self, room: int, host: str, port: int, prompt_tokens: int,
                      dp_rank: int | None) -> tuple[Reservation, Prefilled]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.heartbeat_interval))
        url = f"http://{host}:{port}/rooms/{room}"
        self.states[room] = KVPoll.Bootstrapping
        reservation = None
        try:
            reservation = await self._reserve(prompt_tokens, dp_rank)
            meta = await self._until_ready(url, room, host, port)
            self.states[room] = KVPoll.Transferring
            state = await self._fetch(url, room, host, meta)
            await self._tell(url, ok=True)
            return reservation, state
        except BaseException as e:   # the request is cancelled too (its client went away)
            self.failed += 1
            if reservation is not None:
                await self._off_loop(self.engine.release, reservation)
            await self._tell(url, ok=False, why=str(e) if isinstance(e, TransferFailed) else "")
            raise
        finally:
            self.states.pop(room, None)

    async def _reserve(self, prompt_tokens: int, dp_rank: int | None) -> Reservation:
        deadline = time.monotonic() + self.config.waiting_timeout
        while (r := await self._off_loop(self.engine.reserve, prompt_tokens, dp_rank)) is None:   # full for now
            if time.monotonic() > deadline:
                raise TransferFailed(f"no room for the prompt's pages within {self.config.waiting_timeout:g} s")
            await asyncio.sleep(self.config.poll_interval * 10)
        return r

    async def _call(self, method: str, url: str, params: dict | None = None) -> dict | None:
        """P's answer, or None when P could not be reached; TransferFailed when what answered is not a
        megajax bootstrap server."""
        try:
            async with self._session.request(method, url, params=params) as resp:
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        if not isinstance(answer, dict) or "state" not in answer:
            raise TransferFailed(f"{url} is not a prefill server's bootstrap server (check bootstrap_port)")
        return answer

    async def _until_ready(self, url: str, room: int, host: str, port: int) -> dict:
        c = self.config
        start = last = time.monotonic()
        method = "PUT"   # register, then (long-)poll
        while True:
            answer = await self._call(method, url)
            now = time.monotonic()
            if answer is None:
                if now - last > c.heartbeat_timeout:
                    raise TransferFailed(f"Losing connection with prefill instance (bootstrap_addr: {host}:{port})")
                await asyncio.sleep(c.poll_interval)
            else:
                last = now
                if answer["state"] == KVPoll.Failed.name:
                    raise TransferFailed(answer["error"] or f"bootstrap room {room} failed on the prefill side")
                if answer.get("identity") != self.identity:
                    raise TransferFailed("the prefill server serves another model, page size or KV dtype")
                if method == "PUT":
                    method, self.states[room] = "GET", KVPoll.WaitingForInput
                if answer["ready"]:
                    return answer
            if now - start > c.waiting_timeout:
                raise TransferFailed(f"bootstrap room {room}: no prefilled state within {c.waiting_timeout:g} s")

    async def _fetch(self, url: str, room: int, host: str, meta: dict) -> Prefilled:
        pages = None
        if meta["shape"] is not None:
            answer = await self._call("POST", f"{url}/pull")
            if answer is None or "address" not in answer:
                raise TransferFailed(f"bootstrap room {room}: the prefill server did not offer its pages "
                                     f"({(answer or {}).get('error', 'unreachable')})")
            # P's transfer port, on the host the router named (P may listen on 0.0.0.0)
            address = f"{host}:{answer['address'].rsplit(':', 1)[1]}"
            job = asyncio.ensure_future(self._off_loop(
                lambda: np.asarray(self.transfer.fetch(address, room, tuple(meta["shape"]), meta["dtype"]))))
            deadline = time.monotonic() + self.config.waiting_timeout
            while not job.done():   # P must stay reachable while its pages come
                await asyncio.wait({job}, timeout=self.config.heartbeat_interval)
                if not job.done() and (await self._call("GET", url) is None or time.monotonic() > deadline):
                    job.cancel()
                    raise TransferFailed(f"bootstrap room {room}: the transfer from the prefill server broke off")
            pages = job.result()
        return Prefilled(meta["n_pages"], pages, meta["first"], meta["cached_tokens"], meta["logprob"],
                         [tuple(x) for x in meta["top_logprobs"]])

    async def _tell(self, url: str, ok: bool, why: str = "") -> None:
        with contextlib.suppress(TransferFailed):   # (what answered is no bootstrap server: nothing to tell)
            await self._call("DELETE", url, {"ok": str(int(ok)), **({"why": why} if why else {})})
