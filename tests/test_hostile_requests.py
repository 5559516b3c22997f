"""A corpus of hostile requests against the live server: every one a 4xx in OpenAI's envelope,
and neither ``/health`` nor a normal request held up, during or after: normal requests keep
completing while a request at the fan-out limit is in flight, each in a small part of its time
(relative, so a loaded CI machine slows both sides alike), and the event loop never held by
code running on it (its thread's CPU time between ticks, which a starved machine leaves small).

The corpus: each endpoint's fields with wrong types and extreme values, bodies that are not JSON,
not objects, not UTF-8, of an unknown charset, nested 10,000 deep, over the size limit, shorter
than their Content-Length, and requests too large for the context or for the fan-out limits.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

import serve.server
from serve.default_model import RANDOM_NAME, random_config, random_params
from serve.engine import Engine, EngineConfig
from serve.sampling import MAX_N
from serve.server import Server
from test_server import LiveServer

COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
SCORE = {"query": [5, 6], "items": [[7], [8]], "label_token_ids": [9, 10]}
HUGE = 10 ** 30
BAD_VALUES = {  # field -> values that must be refused, on the endpoint whose body carries it
    "prompt": [None, 5, [], [-1], [HUGE], [True], {"a": 1}, "", [1.5], [[1, 2], [3]], "x" * 700_000,
               "hello " * 10_000],   # (the last is tokenised, in the worker process, then too long)
    "max_tokens": [0, -1, "5", 1.5, True, HUGE, 10 ** 6],
    "temperature": ["hot", -1, [1]],
    "top_p": [0, 2, "x"],
    "top_k": [0, -5, "x", 1.5],
    "min_p": [-0.1, 2],
    "n": [0, -1, 1000, "2", 2.5],
    "stop": [5, [1], [""], ["x"] * 100, "y" * 10_000],
    "stop_token_ids": ["x", [-1], list(range(1000))],
    "logprobs": ["yes", -1, 1000],
    "seed": ["x", 1.5],
    "stream": ["true", 1],
    "stream_options": ["x", 5, {"include_usage": "yes"}],
    "response_format": ["x", {"type": "bogus"}, {"type": "json_schema", "json_schema": 5}],
    "presence_penalty": [5, "x"],
    "frequency_penalty": [-3],
    "repetition_penalty": [0, "x"],
    "model": ["other-model"],
}
CHAT_BAD = {
    "messages": [None, [], "hi", [5], [{"role": "alien", "content": "x"}], [{"role": "user"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": "x" * 700_000}]],
    "tools": ["x", 5],
    "tool_choice": ["required", 5],
    "chat_template_kwargs": ["x", 5],
    "top_logprobs": [1000, "x"],
}
GENERATE_BAD = {
    "sampling_params": ["x", {"max_new_tokens": 0}, {"bogus": 1}, {"max_new_tokens": -1}, {"n": 1000},
                       {"top_logprobs": 1000}, {"stop": 7}, {"temperature": "x"}],
    "input_ids": [[], [-1], "", [HUGE]],
    "stream": ["x"],
}
SCORE_BAD = {"label_token_ids": [None, [], [-1], "x"], "items": [5, [], [[-1]], [[1]] * 1000],
             "query": [None, 5, ""], "apply_softmax": ["x"], "item_first": ["x"]}


def _json_cases():
    cases = []
    for field, values in BAD_VALUES.items():
        cases += [("/v1/completions", {**COMPLETION, field: v}) for v in values]
    for field in ("max_tokens", "temperature", "n", "stop", "stream_options", "response_format", "model"):
        cases += [("/v1/chat/completions", {**CHAT, field: v}) for v in BAD_VALUES[field]]
    for field, values in CHAT_BAD.items():
        cases += [("/v1/chat/completions", {**CHAT, field: v}) for v in values]
    for field, values in GENERATE_BAD.items():
        cases += [("/generate", {**GENERATE, field: v}) for v in values]
    cases += [("/generate", {"sampling_params": {}}), ("/generate", {**GENERATE, "text": "both"})]
    for field, values in SCORE_BAD.items():
        cases += [("/v1/score", {**SCORE, field: v}) for v in values]
    cases += [("/v1/score", {}), ("/v1/completions", {}), ("/v1/chat/completions", {})]
    return [(path, json.dumps(body).encode(), "application/json") for path, body in cases]


def _raw_cases():
    return [
        ("/v1/completions", b"{", "application/json"),
        ("/v1/completions", b"[]", "application/json"),
        ("/v1/completions", b"null", "application/json"),
        ("/v1/completions", b'"just a string"', "application/json"),
        ("/v1/completions", json.dumps(COMPLETION).encode(), "text/plain"),
        ("/v1/completions", json.dumps(COMPLETION).encode(), "application/json; charset=bogus-8"),
        ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', "application/json"),
        ("/v1/completions", b"[" * 10_000 + b"]" * 10_000, "application/json"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 100 + b"1" + b"]" * 100 + b"}", "application/json"),
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "application/json"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "application/json"),
        ("/generate", b'{"text": "a\\ud83d", "sampling_params": {"max_new_tokens": 1}}', "application/json"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e999}', "application/json"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "application/json"),
        ("/v1/completions", b'{"prompt": "hi", "prompt": 5}', "application/json"),
        ("/v1/nonexistent", json.dumps(COMPLETION).encode(), "application/json"),
        ("/health", json.dumps(COMPLETION).encode(), "application/json"),   # POST where only GET is
    ]


CORPUS = _json_cases() + _raw_cases()


@pytest.fixture(scope="module")
def live():
    cfg = random_config()
    engine = Engine(random_params(cfg), cfg, EngineConfig(max_running=4, max_len=512, page_size=16,
                                                           prefill_budget=32, decoder_replay="off"))
    engine.warmup()   # normal requests below time serving, not compiling
    srv = LiveServer(Server(engine, RANDOM_NAME, default_max_tokens=8, max_request_bytes=1 << 20))
    yield srv
    srv.close()


def _send(live, path, data, ctype, timeout=60):
    req = urllib.request.Request(live.url + path, data=data, method="POST", headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _raw_http(live, head: bytes, body: bytes, timeout=30) -> int:
    """Send bytes as they are (a lying Content-Length, say); the status the server answers."""
    with socket.create_connection(("127.0.0.1", live.port), timeout=timeout) as s:
        s.sendall(head + body)
        return int(s.recv(65536).split(b" ", 2)[1])


class LoopProbe:
    """Ticks on the server's event loop; the most CPU time the loop's thread spent between two
    ticks. That is time the loop was held by code running on it, which a starved machine (CI's
    other worker on the same two cores) does not inflate, unlike a wall-clock lag."""

    def __init__(self, live, tick_s: float = 0.01):
        self.held, self.ticks, self._stop = 0.0, 0, threading.Event()
        self._done = asyncio.run_coroutine_threadsafe(self._run(tick_s), live.loop)

    async def _run(self, tick_s):
        last = time.thread_time()
        while not self._stop.is_set():
            await asyncio.sleep(tick_s)
            now = time.thread_time()
            self.held, self.ticks, last = max(self.held, now - last), self.ticks + 1, now

    def stop(self):
        self._stop.set()
        self._done.result(30)


class Watch(threading.Thread):
    """Polls /health and sends a normal request in turn; the worst latency of each, and when each
    normal request finished."""

    def __init__(self, live):
        super().__init__(daemon=True)
        self.live, self.done, self.health, self.normal, self.failures = live, threading.Event(), 0.0, 0.0, []
        self.finished: list[float] = []
        self.start()

    def run(self):
        while not self.done.is_set():
            t0 = time.perf_counter()
            status = self.live.request("/health")[0]
            self.health = max(self.health, time.perf_counter() - t0)
            t0 = time.perf_counter()
            code, body = _send(self.live, "/v1/completions", json.dumps({"prompt": [5, 6], "max_tokens": 1}).encode(),
                               "application/json")
            self.normal = max(self.normal, time.perf_counter() - t0)
            self.finished.append(time.perf_counter())
            if status != 200 or code != 200:
                self.failures.append((status, code, body[:200]))
            time.sleep(0.05)

    def stop(self):
        self.done.set()
        self.join(30)


def test_every_hostile_request_is_a_4xx_envelope_and_nobody_waits(live, monkeypatch):
    monkeypatch.setattr(serve.server, "BODY_TIMEOUT_S", 1.0)
    assert len(CORPUS) >= 100
    probe, watch = LoopProbe(live), Watch(live)
    fan_body_in = json.dumps({"prompt": [5, 6, 7], "max_tokens": 8, "n": MAX_N, "temperature": 1.0,
                              "seed": 1}).encode()

    def timed_fan():
        t0 = time.perf_counter()
        return t0, _send(live, "/v1/completions", fan_body_in, "application/json", 300), time.perf_counter()

    with ThreadPoolExecutor(5) as pool:
        # a legitimate request at the fan-out limit, in flight throughout: it must not starve the others
        fan = pool.submit(timed_fan)
        results = list(pool.map(lambda c: (c, _send(live, *c)), CORPUS))
        # framing: a body over the limit is refused before it is read, a short body times out
        over = pool.submit(_raw_http, live, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           b"application/json\r\nContent-Length: 20000000\r\n\r\n", b"{")
        short = pool.submit(_raw_http, live, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            b"application/json\r\nContent-Length: 1000\r\n\r\n", b'{"prompt": "hi"')
        framing = [over.result(), short.result()]
        fan_start, (fan_status, fan_body), fan_end = fan.result()
    time.sleep(1.0)   # and after
    watch.stop()
    probe.stop()
    bad = []
    for (path, data, ctype), (status, body) in results:
        try:
            err = json.loads(body)["error"]
            ok = 400 <= status < 500 and err["code"] == status and {"message", "type", "param"} <= set(err)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            bad.append((path, data[:120], ctype, status, body[:200]))
    statuses = [status for _, (status, _) in results] + framing
    during = sum(fan_start < t < fan_end for t in watch.finished)
    fan_s = fan_end - fan_start
    print(f"\nhostile corpus: {len(statuses)} requests, {sum(400 <= c < 500 for c in statuses)} 4xx, "
          f"{sum(c >= 500 for c in statuses)} 5xx; worst /health {watch.health * 1e3:.0f} ms, "
          f"worst normal request {watch.normal * 1e3:.0f} ms; {during} normal requests served during "
          f"the n={MAX_N} request's {fan_s:.1f} s; the loop held at most {probe.held * 1e3:.0f} ms of CPU "
          f"between {probe.ticks} ticks")
    assert not bad, bad
    assert framing == [413, 408]
    assert fan_status == 200 and len(json.loads(fan_body)["choices"]) == MAX_N
    assert not watch.failures, watch.failures
    assert probe.ticks > 100 and probe.held < 0.1, (probe.ticks, probe.held)   # the loop itself: never held
    assert during >= 3 and max(watch.health, watch.normal) < fan_s / 3, (during, watch.health, watch.normal, fan_s)
