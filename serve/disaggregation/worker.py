"""A server's role in a disaggregated pair (``--disaggregation-mode``): the HTTP server's one door to it.

The router sends the same request to P and D with ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room``. ``prepare`` turns it into the engine submission for this side: on P the prefill
(``max_new_tokens`` 1, its state exported when it ends), on D the decode from P's state. A request
without a room is served whole, as a colocated server would (health probes, direct calls).
"""
from __future__ import annotations

import asyncio
import dataclasses

from aiohttp import web

from serve.disaggregation.config import DisaggregationConfig
from serve.disaggregation.decode import DecodeSide
from serve.disaggregation.prefill import PrefillSide
from serve.disaggregation.transfer import make_transfer
from serve.handle import RequestError
from serve.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    room: int
    host: str
    port: int


def bootstrap_of(body: dict, own_port: int) -> Bootstrap | None:
    """The router's bootstrap fields of a request body (None: not a disaggregated request)."""
    room = body.get("bootstrap_room")
    if room is None:
        return None
    if isinstance(room, list):
        raise RequestError("batched requests (a list of bootstrap rooms) are not supported by disaggregated "
                           "servers: send one prompt a request", "bootstrap_room")
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if type(room) is not int or room < 0:
        raise RequestError(f"bootstrap_room must be a non-negative integer, got {room!r}", "bootstrap_room")
    if not isinstance(host, str) or not host:
        raise RequestError("bootstrap_host (the prefill server's host) is required with bootstrap_room",
                           "bootstrap_host")
    if port is not None and (type(port) is not int or not 0 < port < 65536):
        raise RequestError(f"bootstrap_port must be a TCP port or null, got {port!r}", "bootstrap_port")
    return Bootstrap(room, host, own_port if port is None else port)   # null: the port this side was given


class PdWorker:
    def __init__(self, config: DisaggregationConfig, engine, host: str):
        self.config, self.host, self.engine = config, host, engine
        transfer = make_transfer(config.transfer_backend, host)
        self.prefill = PrefillSide(config, transfer, engine.page_identity) if config.mode == "prefill" else None
        self.decode = DecodeSide(config, transfer, engine) if config.mode == "decode" else None
        self._site: web.AppRunner | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        """P: the bootstrap server on ``--disaggregation-bootstrap-port``, and the rooms' timeouts swept
        every heartbeat interval."""
        if self.prefill is not None:
            self._site = web.AppRunner(self.prefill.app(), access_log=None)
            await self._site.setup()
            await web.TCPSite(self._site, self.host, self.config.bootstrap_port).start()
            self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            self.prefill.sweep()

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._site is not None:
            await self._site.cleanup()
        if self.decode is not None:
            await self.decode.close()

    async def prepare(self, body: dict, ids: list[int], params: SamplingParams,
                      dp_rank: int | None) -> tuple[SamplingParams, dict]:
        """``(params, engine.submit's disaggregation arguments)`` for a request; ``RequestError``
        (4xx) for bad bootstrap fields, ``TransferFailed`` when the pair fails."""
        b = bootstrap_of(body, self.config.bootstrap_port)
        if b is None:
            return params, {}
        self.engine.admissible(ids, params, dp_rank)   # both sides refuse it before either works on it
        if self.prefill is not None:
            await self.prefill.prefill_allowed(b.room)
            first = dataclasses.replace(params, max_new_tokens=1, min_new_tokens=min(params.min_new_tokens, 1))
            return first, {"export": self.prefill.exporter(b.room)}
        return params, {"prefilled": await self.decode.receive(b.room, b.host, b.port, len(ids), dp_rank)}

    def info(self) -> dict:
        side = self.prefill or self.decode
        return {"disaggregation_mode": self.config.mode, "disaggregation_bootstrap_port": self.config.bootstrap_port,
                "disaggregation_transfer_backend": self.config.transfer_backend, "failed_rooms": side.failed,
                "rooms": side.rooms()}
