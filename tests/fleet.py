"""Helpers for the tests that start ``python -m serve.fleet`` (the SGLang gateway over megajax workers)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    """A run of ``n`` consecutive ports nothing listens on."""
    for _ in range(100):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            first = socks[0].getsockname()[1]
            for i, s in enumerate(socks[1:], 1):
                s.bind(("127.0.0.1", first + i))
            return list(range(first, first + n))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def call(url: str, body: dict | None = None, timeout: float = 300, method: str | None = None) -> tuple[int, object]:
    """``(status, JSON body or raw bytes)``; status -1 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
            return r.status, json.loads(text) if text.startswith((b"{", b"[")) else text
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text.startswith(b"{") else text
    except OSError as e:
        return -1, repr(e)


def answer(url: str, timeout: float = 60) -> object:
    """``url``'s 200 answer, asked again while a worker is too busy (compiling) to answer in time."""
    deadline = time.time() + timeout
    while (got := call(url, timeout=5))[0] != 200:
        assert time.time() < deadline, got
        time.sleep(0.2)
    return got[1]


def healthy_workers(router: str) -> int:
    code, body = call(f"{router}/workers", timeout=2)
    return sum(w["is_healthy"] for w in body["workers"]) if code == 200 and isinstance(body, dict) else 0


def status(logs: Path) -> dict:
    return json.loads((logs / "fleet.json").read_text())


@contextlib.contextmanager
def fleet(logs: Path, fleet_args: list[str], worker_args: list[str], workers: int, env: dict | None = None):
    """Start a fleet (the gateway's health checks every second); yield ``(router URL, ports)`` once
    the gateway has ``workers`` healthy ones; stop it, and check its children went with it."""
    ports = free_ports(2 + 2 * workers)   # the gateway, its metrics, bootstrap servers, workers
    router_port, metrics_port, bootstrap, base = ports[0], ports[1], ports[2], ports[2 + workers]
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve.fleet", *fleet_args, "--port", str(router_port), "--worker-base-port", str(base),
         "--router-metrics-port", str(metrics_port), "--bootstrap-base-port", str(bootstrap), "--log-dir", str(logs),
         "--router-arg=--health-check-interval-secs=1", "--router-arg=--health-check-timeout-secs=1", "--",
         *worker_args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})})
    router = f"http://127.0.0.1:{router_port}"
    deadline = time.time() + 600
    try:
        while healthy_workers(router) < workers:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the fleet did not come up"
            time.sleep(0.5)
        yield router, {"bootstrap": bootstrap}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    for w in status(logs)["workers"]:   # the fleet's children went with it
        try:
            os.kill(w["pid"], 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {w['url']} (pid {w['pid']}) outlived its fleet")
