"""One engine over the devices of several processes (``--nnodes``): process 0 serves, the others follow.

Under ``jax.distributed`` a program over a mesh that spans processes runs only when every process
dispatches it with the same inputs (JAX's multi-controller model). Every process builds the same
engine (the checkpoint read by shard, ``checkpoints.hf``) and so runs the same start-up step;
from then on process 0 alone schedules: before it dispatches a step it sends the step's host input
to the followers, which dispatch the same step and nothing else. What a step returns is
replicated, so process 0 reads its samples from its own devices.

The channel: each follower connects to process 0 at the ``--dist-init-addr`` host, port + 1, and
reads each step as a small JSON header (replay rows, whether a ban is sent) and the input's arrays
in NumPy's format (no pickles: nothing on the wire is code), rebuilt in ``StepInput``'s structure;
the usual all-allowed ban is not sent (each process has it on its devices). The followers exit
when process 0 closes the channel (at its exit, before JAX's shutdown barrier, which every
process must reach). Other device work of one process (the hierarchical cache's copies,
disaggregation, EPLB moves, the scorer) would need its own message; those features refuse
``--nnodes`` > 1 for now.
"""
from __future__ import annotations

import atexit
import io
import json
import logging
import socket
import struct
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:   # (this module is imported before jax.distributed starts: nothing that starts JAX's backend)
    from serve.runner import ModelRunner, StepInput

log = logging.getLogger("megajax")
_LENGTH = struct.Struct("!Q")


def check_supported(args) -> None:
    """ValueError naming a ``python -m serve`` flag whose device work is not yet sent to the
    followers (checked before ``jax.distributed`` waits for the other processes)."""
    if args.dp_size * args.ep_size == 1:
        raise ValueError("--nnodes > 1 runs one engine over every process's devices: --dp-size x --ep-size "
                         "must count them all")
    refused = {"--enable-hierarchical-cache": args.enable_hierarchical_cache,
               "--disaggregation-mode": args.disaggregation_mode != "null",
               "--ep-num-redundant-experts": args.ep_num_redundant_experts > 0,
               "--enable-eplb": args.enable_eplb,
               "--engram-placement host": args.engram_placement != "device"}
    if bad := [flag for flag, on in refused.items() if on]:
        raise ValueError(f"{', '.join(bad)}: not served across processes (--nnodes > 1) yet")


def channel_address(dist_init_addr: str) -> tuple[str, int]:
    host, port = dist_init_addr.rsplit(":", 1)
    return host, int(port) + 1


class StepBroadcast:
    """Process 0's end: the followers' connections, and ``send`` of each step before it is dispatched."""

    def __init__(self, address: tuple[str, int], followers: int, timeout: float = 300.0):
        server = socket.create_server(address, reuse_port=False)
        server.settimeout(timeout)
        self._peers = []
        try:
            for _ in range(followers):
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._peers.append(conn)
        except socket.timeout:
            raise RuntimeError(f"only {len(self._peers)} of {followers} follower processes connected to "
                               f"{address[0]}:{address[1]} within {timeout:.0f} s") from None
        finally:
            server.close()
        # closed before JAX's own exit handler (registered earlier, so run later) waits for every
        # process at its shutdown barrier: the followers see the channel end and reach it too
        atexit.register(self.close)

    def send(self, runner: ModelRunner, inp: StepInput, replay_rows: int | None) -> None:
        ban = None if inp.ban is runner.no_ban(len(inp.logit_slots)) else inp.ban
        arrays = jax.tree.leaves(inp._replace(ban=None)) + ([] if ban is None else [ban])
        payload = _frame(json.dumps({"replay_rows": replay_rows, "ban": ban is not None}).encode(), *arrays)
        for peer in self._peers:
            peer.sendall(payload)

    def close(self) -> None:
        for peer in self._peers:
            peer.close()
        self._peers = []


def follow(runner: ModelRunner, address: tuple[str, int], timeout: float = 300.0) -> int:
    """A follower's loop: dispatch each step process 0 sends until it closes the channel; the
    steps followed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection(address, timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"process 0 did not open {address[0]}:{address[1]} within {timeout:.0f} s") from None
            time.sleep(0.2)
    conn.settimeout(None)
    structure = jax.tree.structure(runner.empty_input(runner.buckets.decode[0])._replace(ban=None))
    steps, out = 0, None
    with conn, conn.makefile("rb") as f:
        while (header := _read(f)) is not None:
            meta = json.loads(header)
            arrays = [np.load(io.BytesIO(_read(f)), allow_pickle=False) for _ in range(structure.num_leaves)]
            inp = structure.unflatten(arrays)
            rows = len(inp.logit_slots)
            inp = inp._replace(ban=np.load(io.BytesIO(_read(f)), allow_pickle=False) if meta["ban"]
                               else runner.no_ban(rows))
            if out is not None:
                out.block_until_ready()   # at most two steps queued here, as on process 0
            out = runner.step(inp, meta["replay_rows"])
            steps += 1
    log.info("process 0 closed the step channel after %d steps", steps)
    return steps


def _frame(header: bytes, *arrays) -> bytes:
    parts = [header]
    for a in arrays:
        buf = io.BytesIO()
        np.save(buf, np.asarray(a), allow_pickle=False)
        parts.append(buf.getvalue())
    return b"".join(_LENGTH.pack(len(p)) + p for p in parts)


def _read(f) -> bytes | None:
    """One length-prefixed part; None at the end of the channel."""
    header = f.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    n = _LENGTH.unpack(header)[0]
    data = f.read(n)
    if len(data) < n:
        raise ConnectionError("process 0 closed the step channel mid-step")
    return data
