"""How a prefilled prompt's pages cross from P's process to D's (``--disaggregation-transfer-backend``).

The interface is the part a Mooncake or NIXL backend would implement: P ``offer``s one array under
the request's bootstrap room when D asks for it; D ``fetch``es it by P's ``address`` and the room,
knowing its shape and dtype from the bootstrap server. Pull, not push: P holds nothing for a D that
never asks, and P's page pool is free again the moment its prefill ends (the offer is a copy). An
offer expires after ``ttl`` seconds, so a D that dies between asking and fetching leaks nothing for
longer than that.

``jax-transfer``: ``jax.experimental.transfer``, a transfer server in each process (TCP through the
host; CPU and GPU alike).
"""
from __future__ import annotations

import datetime
import threading
from typing import Protocol

import jax


class KVTransfer(Protocol):
    def address(self) -> str:
        """Where the other side of a pair reaches this process's transfers."""

    def offer(self, room: int, pages: jax.Array, ttl: float) -> None:
        """(P) Make ``pages`` fetchable, once, under ``room``, for ``ttl`` seconds."""

    def fetch(self, address: str, room: int, shape: tuple[int, ...], dtype: str) -> jax.Array:
        """(D) The array P at ``address`` offered under ``room`` (blocks until it is there)."""


class JaxTransfer:
    def __init__(self, host: str = "127.0.0.1"):
        from jax.experimental import transfer

        self._device = jax.local_devices()[0]
        self._server = transfer.start_transfer_server(self._device.client, f"{host}:0", [f"{host}:0"])
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()

    def address(self) -> str:
        return self._server.address()

    def offer(self, room: int, pages: jax.Array, ttl: float) -> None:
        # the server registers only single-device arrays a peer can pull whole: gather a sharded one;
        # an expired offer is dropped (its buffers freed) at the server's next offer
        expires = datetime.datetime.now() + datetime.timedelta(seconds=ttl)
        self._server.await_pull(room, [jax.device_put(pages, self._device)], timeout=expires)

    def fetch(self, address: str, room: int, shape: tuple[int, ...], dtype: str) -> jax.Array:
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self._connections[address] = self._server.connect(address)
        spec = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=jax.sharding.SingleDeviceSharding(self._device))
        return jax.block_until_ready(conn.pull(room, [spec])[0])


def make_transfer(backend: str, host: str = "127.0.0.1") -> KVTransfer:
    """The backend ``--disaggregation-transfer-backend`` names (``DisaggregationConfig`` checked it)."""
    return {"jax-transfer": JaxTransfer}[backend](host)
