"""megajax workers behind the SGLang model gateway (``sglang-router``), started by ``python -m serve.fleet``.

One fleet for the module: two ``random-tiny`` workers and the gateway's ``cache_aware`` policy, its
health checks every second and its circuit breaker's open time 3 s (60 by default), so a killed
worker leaves and rejoins within the test.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fleet import ROOT, answer, call, fleet, status
from serve.default_model import RANDOM_NAME
from serve.fleet import healthy_workers


def _prompt_tokens(worker: str) -> float:
    """Prompt tokens the worker has served (its Prometheus counter)."""
    lines = [x for x in answer(f"{worker}/metrics").decode().splitlines()
             if x.startswith("sglang:prompt_tokens_total")]
    return sum(float(x.split()[-1]) for x in lines)


@pytest.fixture(scope="module")
def regular(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet")
    with fleet(logs, ["--workers", "2", "--policy", "cache_aware", "--router-arg=--cb-timeout-duration-secs=3"],
               ["--model", "random-tiny", "--no-warmup", "--max-running", "4", "--context-length", "1024",
                "--enable-metrics"], workers=2) as (router, _):
        yield router, logs


def _generate(router: str, text: str, n: int = 4) -> tuple[int, object]:
    return call(f"{router}/generate", {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}})


PREFIX = "The quick brown fox jumps over the lazy dog. " * 30


def test_repeats_of_a_long_prefix_land_on_the_worker_that_cached_it(regular):
    router, logs = regular
    urls = [w["url"] for w in status(logs)["workers"]]
    code, first = _generate(router, PREFIX + "first question")
    assert code == 200, first
    cached = []
    for i in range(4):
        code, body = _generate(router, PREFIX + f"question {i}")
        assert code == 200, body
        cached.append(body["meta_info"]["cached_tokens"])
    assert min(cached) > 0, cached   # each repeat reached the worker that holds the prefix
    served = [_prompt_tokens(u) for u in urls]
    assert sorted(x > 0 for x in served) == [False, True], served   # and only that worker
    # the gateway's load report sums each worker's /get_load (its DP ranks' num_tokens)
    code, loads = call(f"{router}/get_loads")
    assert code == 200 and sorted(w["worker"] for w in loads["workers"]) == sorted(urls), loads
    assert all(w["load"] >= 0 for w in loads["workers"]), loads   # -1: the gateway could not read it


def test_a_worker_killed_under_load_loses_no_request_and_rejoins(regular):
    router, logs = regular
    holder = max(status(logs)["workers"], key=lambda w: _prompt_tokens(w["url"]))   # the prefix's worker (test above)

    def one(i: int):
        return call(f"{router}/v1/completions", {"model": RANDOM_NAME, "prompt": f"request {i} " * (5 + i),
                                                  "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        deadline = time.time() + 120
        while answer(f"{holder['url']}/get_load")[0]["num_reqs"] == 0:   # it is serving some
            assert time.time() < deadline
            time.sleep(0.05)
        os.kill(holder["pid"], signal.SIGKILL)
        results = [f.result() for f in futures]
    # every client gets its whole answer: the gateway retried what the dead worker held elsewhere
    assert [code for code, _ in results] == [200] * 16, [r for r in results if r[0] != 200]
    assert all(body["usage"]["completion_tokens"] == 24 for _, body in results)
    # the fleet restarts it, the gateway's health checks take it back, and it serves again
    deadline = time.time() + 300
    while True:
        now = status(logs)
        w = next(x for x in now["workers"] if x["url"] == holder["url"])
        if w["restarts"] == 1 and call(f"{holder['url']}/health", timeout=2)[0] == 200 and healthy_workers(router) == 2:
            break
        assert time.time() < deadline, now
        time.sleep(0.5)
    # unrelated prompts at once: cache_aware sends a prompt it has no prefix for to the least loaded worker
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    time.sleep(3)   # the failures it had opened its circuit breaker: it is tried again after this timeout
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _generate(router, " ".join(words[i:] + words[:i]) * 6, 16), range(4)))
    assert [code for code, _ in results] == [200] * 4, results
    assert _prompt_tokens(holder["url"]) > 0   # the restarted worker serves again


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--", "--port", "1"], "leave them out after --"),
])
def test_fleet_refuses_bad_arguments(argv, message):
    r = subprocess.run([sys.executable, "-m", "serve.fleet", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_the_gateways_http2_probes_do_not_log_tracebacks():
    import logging

    from aiohttp.http_exceptions import BadHttpMessage

    from serve.server import QuietHttp2Probes

    def record(exc: Exception) -> logging.LogRecord:
        return logging.LogRecord("aiohttp.server", logging.ERROR, "", 0, "Error handling request", None,
                                 (type(exc), exc, None))
    keep = QuietHttp2Probes().filter
    assert not keep(record(BadHttpMessage("Pause on PRI/Upgrade:")))
    assert keep(record(BadHttpMessage("Invalid method encountered"))) and keep(record(ValueError("x")))
