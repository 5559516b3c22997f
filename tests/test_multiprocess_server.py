"""``python -m serve --nnodes 2``: one engine over the devices of two processes (``serve/multiprocess.py``).

Two local processes under ``jax.distributed``, one CPU device each, experts split over both
(``--ep-size 2``: every step's all-to-all crosses the processes). Process 0 serves; its greedy
tokens for concurrent requests equal a one-device engine's on the same checkpoint and flags;
what is not served across processes yet is refused in the error envelope or at start; stopping
process 0 stops both. (One device a process: with four CPU devices each, XLA's gloo collectives
deadlocked in four of five tries on this machine, both processes waiting in the same program.)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import GOLDEN, cpu_env, free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = GOLDEN / "v41_tiny"
# small buckets, compiled by the warm-up before serving (a compile on demand under CI's load can hold the
# engine past the 10 s a request waits to be taken)
ENGINE = ["--model", str(TINY), "--max-running", "4", "--context-length", "256", "--chunked-prefill-size", "64"]
FLAGS = [*ENGINE, "--ep-size", "2"]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def pair():
    port, addr = free_port(), f"127.0.0.1:{free_port()}"
    env = cpu_env(1)
    procs = [subprocess.Popen([sys.executable, "-m", "serve", *FLAGS, "--port", str(port), "--nnodes", "2",
                               "--node-rank", str(r), "--dist-init-addr", addr], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.stderr.read()[-3000:] for p in procs if p.poll() is not None]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            break
        except OSError:
            time.sleep(1)
    yield port, procs
    for p in procs:
        if p.poll() is None:
            p.kill()


def test_two_processes_serve_the_one_device_tokens(pair):
    from serve.cli_args import add_engine, add_model, engine_config
    from serve.engine import Engine

    port, _ = pair
    job = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:   # together: they share steps
        got = list(pool.map(lambda ids: _post(port, "/generate", {"input_ids": ids, "sampling_params": job}), PROMPTS))
    assert all(status == 200 for status, _ in got), got
    ap = argparse.ArgumentParser()
    add_model(ap, required=False)
    add_engine(ap)
    one = Engine.from_model_dir(TINY, engine_config(ap.parse_args(ENGINE)))
    want = [r["output_ids"] for r in one.generate(PROMPTS, job, decode_text=False)]
    assert [body["output_ids"] for _, body in got] == want

    status, body = _post(port, "/v1/score", {"query": [1, 2], "items": [[3]], "label_token_ids": [4]})
    assert status == 400 and "not served across processes" in body["error"]["message"]


def test_stopping_process_zero_stops_both(pair):
    _, procs = pair
    procs[0].terminate()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]   # the follower saw the channel end


@pytest.mark.parametrize("extra,why", [([], "--dp-size x --ep-size must count them all"),
                                       (["--ep-size", "2", "--enable-hierarchical-cache"],
                                        "--enable-hierarchical-cache: not served across processes")])
def test_what_is_not_served_across_processes_is_refused_at_start(extra, why):
    r = subprocess.run([sys.executable, "-m", "serve", "--model", str(TINY), "--nnodes", "2",
                        "--dist-init-addr", "127.0.0.1:1", *extra], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and why in r.stderr, r.stderr
