"""Helpers for the tests that start ``python -m serve.fleet`` (the SGLang gateway over megajax workers)."""
from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from serve.fleet import launched

ROOT = Path(__file__).resolve().parents[1]


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


def status(logs: Path) -> dict:
    return json.loads((logs / "fleet.json").read_text())


@contextlib.contextmanager
def fleet(logs: Path, fleet_args: list[str], worker_args: list[str], workers: int, env: dict | None = None):
    """``serve.fleet.launched``, then a check that the fleet's children went with it."""
    with launched(logs, fleet_args, worker_args, workers, env) as got:
        yield got
    for w in status(logs)["workers"]:
        try:
            os.kill(w["pid"], 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {w['url']} (pid {w['pid']}) outlived its fleet")
