"""Prefill/decode disaggregation (serve/disaggregation/) behind the gateway's PD mode, and its faults.

One fleet for the module (``python -m serve.fleet --prefill 1 --decode 1``) on the trained default
model, with SGLang's disaggregation timeouts shortened through its environment variables: D gives up
on a silent P after 1 s (heartbeat 0.5 s x 2), P on a silent D too, and on a D that never registers
after 5 s. The fault tests talk to P and D directly, as the gateway does (the same body to both).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from fleet import answer, call, fleet, status
from serve.default_model import SMALL_DIR, SMALL_NAME
from serve.engine import Engine, EngineConfig
from serve.fleet import healthy_workers

WORKER = ["--no-warmup", "--max-running", "4", "--context-length", "1024"]
ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
       "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "5", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}
PROMPTS = ["import os\nimport sys\n",   # under a page: D gets no pages, only the first token
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n" * 3,
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n" * 12]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    with fleet(logs, ["--prefill", "1", "--decode", "1"], WORKER, workers=2, env=ENV) as (router, ports):
        workers = {w["role"]: w for w in status(logs)["workers"]}
        yield router, logs, workers, ports["bootstrap"]


@pytest.fixture(scope="module")
def colocated():
    """The greedy tokens of a colocated engine with the workers' settings."""
    engine = Engine.from_model_dir(SMALL_DIR, EngineConfig(max_running=4, max_len=1024))
    sp = {"max_new_tokens": 12, "temperature": 0}
    return {p: r["output_ids"] for p, r in zip(PROMPTS, engine.generate(PROMPTS, sp, decode_text=False))}


def _info(worker: dict) -> dict:
    return answer(f"{worker['url']}/server_info")


def _idle(worker: dict) -> bool:
    load = answer(f"{worker['url']}/get_load")
    return load[0]["num_reqs"] == 0 and load[0]["num_tokens"] == 0


def _until(check, timeout: float, what: str, state=lambda: None):
    """Until ``check()`` holds; ``what`` (and ``state()``: what was seen) if it does not in time."""
    deadline = time.time() + timeout
    while not (got := check()):
        assert time.time() < deadline, f"{what} ({state()})"
        time.sleep(0.05)
    return got


def _served_like_colocated(router: str, colocated: dict) -> list[int]:
    """Each prompt's greedy tokens through the pair equal the colocated engine's; its cached tokens."""
    cached = []
    for prompt in PROMPTS:
        code, body = call(f"{router}/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 12,
                                                                                     "temperature": 0}})
        assert code == 200, body
        assert body["output_ids"] == colocated[prompt], prompt
        cached.append(body["meta_info"]["cached_tokens"])
    code, body = call(f"{router}/v1/chat/completions", {"model": SMALL_NAME, "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": PROMPTS[2]}]})
    assert code == 200 and body["usage"]["completion_tokens"] == 4, body
    return cached


def test_greedy_outputs_equal_the_colocated_engine(pd, colocated):
    # the pages D receives are not a cache hit: cached tokens are P's, none the first time, then its prefix hits
    assert _served_like_colocated(pd[0], colocated) == [0, 0, 0]
    again = _served_like_colocated(pd[0], colocated)
    assert again[0] == 0 and min(again[1:]) > 0, again
    workers = pd[2]
    assert _info(workers["prefill"])["disaggregation_mode"] == "prefill"
    assert _info(workers["decode"])["failed_rooms"] == 0 and _info(workers["prefill"])["failed_rooms"] == 0


def _pair(pd, room: int, prompt: str, to: tuple[str, ...]) -> dict:
    """Send one request the gateway's way (the same body, with the bootstrap fields) to ``to``, each in a
    thread; the answers land in the returned dict by role."""
    _, _, workers, bootstrap = pd
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "bootstrap_room": room,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap}
    out = {}

    def send(role):
        t0 = time.time()
        out[role] = (*call(f"{workers[role]['url']}/generate", body, timeout=120), time.time())
        out[role + "_s"] = time.time() - t0
    threads = [threading.Thread(target=send, args=(r,)) for r in to]
    for t in threads:
        t.start()
    out["join"] = lambda: [t.join(120) for t in threads]
    return out


def _restarted(pd, role: str, restarts: int) -> None:
    router, logs, workers, _ = pd
    _until(lambda: next(w for w in status(logs)["workers"] if w["role"] == role)["restarts"] == restarts,
           30, f"the fleet did not restart the {role} worker")
    _until(lambda: call(f"{workers[role]['url']}/health", timeout=2)[0] == 200 and healthy_workers(router) == 2,
           300, f"the {role} worker did not come back")
    workers[role] = next(w for w in status(logs)["workers"] if w["role"] == role)


def test_a_killed_prefill_server_fails_the_request_on_d_in_time_and_frees_its_pages(pd, colocated):
    _, _, workers, _ = pd
    # only D gets the request: it reserves pages, registers, then waits for a prefill that never comes
    got = _pair(pd, 101, PROMPTS[2], ("decode",))
    _until(lambda: _info(workers["decode"])["rooms"].get("WaitingForInput"), 30, "D did not reach WaitingForInput")
    assert not _idle(workers["decode"])   # the reserved pages count as its tokens
    killed = time.time()
    os.kill(workers["prefill"]["pid"], signal.SIGKILL)
    got["join"]()
    code, body, ended = got["decode"]
    assert code == 500 and "Losing connection with prefill instance" in body["error"]["message"], body
    assert ended - killed < 1.0 + 3.0, ended - killed   # the heartbeat timeout (1 s) and some slack
    assert _info(workers["decode"])["failed_rooms"] == 1
    _until(lambda: _idle(workers["decode"]), 10, "D kept the reserved pages")
    _restarted(pd, "prefill", 1)
    _served_like_colocated(pd[0], colocated)   # the pair works again


def test_a_killed_decode_server_frees_the_prefill_side(pd, colocated):
    _, _, workers, _ = pd
    failed = _info(workers["prefill"])["failed_rooms"]
    got = _pair(pd, 202, PROMPTS[2], ("prefill", "decode"))
    _until(lambda: _info(workers["decode"])["rooms"].get("WaitingForInput"), 30, "D did not register")
    os.kill(workers["decode"]["pid"], signal.SIGKILL)
    got["join"]()
    assert got["prefill"][0] == 200 and len(got["prefill"][1]["output_ids"]) == 1   # P's part: the first token
    assert got["decode"][0] == -1   # the connection died with D
    # P held the prefilled state for D: it drops it once D has been silent for the heartbeat timeout
    _until(lambda: _info(workers["prefill"])["failed_rooms"] == failed + 1, 60, "P did not give up on D",
           lambda: _info(workers["prefill"]))
    assert set(_info(workers["prefill"])["rooms"]) == {"Failed"}   # no room left waiting for D
    _until(lambda: _idle(workers["prefill"]), 10, "P's request did not end")
    _restarted(pd, "decode", 1)
    _served_like_colocated(pd[0], colocated)


def test_a_prefill_without_its_decode_server_ends_after_the_bootstrap_timeout(pd):
    _, _, workers, _ = pd
    got = _pair(pd, 404, PROMPTS[0], ("prefill",))
    got["join"]()
    code, body, _ = got["prefill"]
    assert code == 500 and "did not register within 5 s" in body["error"]["message"], body
    assert 5.0 <= got["prefill_s"] < 5.0 + 3.0
    _until(lambda: _idle(workers["prefill"]), 10, "P holds something for the request")


def test_bad_bootstrap_fields_are_4xx(pd):
    _, _, workers, _ = pd
    for bad, field in (({"bootstrap_room": "x", "bootstrap_host": "h"}, "bootstrap_room"),
                       ({"bootstrap_room": [1, 2], "bootstrap_host": "h"}, "bootstrap_room"),
                       ({"bootstrap_room": 5}, "bootstrap_host"),
                       ({"bootstrap_room": 5, "bootstrap_host": "h", "bootstrap_port": 70000}, "bootstrap_port")):
        for role in ("prefill", "decode"):
            code, body = call(f"{workers[role]['url']}/generate", {"text": "x", **bad})
            assert code == 400 and body["error"]["param"] == field, (role, bad, body)
    # a request either side refuses is refused by both at once, before P waits for D or D reserves
    too_long = {"text": "x", "sampling_params": {"max_new_tokens": 5000}, "bootstrap_room": 6,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": pd[3]}
    for role in ("prefill", "decode"):
        t0 = time.time()
        code, body = call(f"{workers[role]['url']}/generate", too_long)
        assert code == 400 and "context length" in body["error"]["message"] and time.time() - t0 < 2, (role, body)
