"""The HTTP server, live on localhost, driven by the official ``openai`` client and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from aiohttp import web

from serve.default_model import RANDOM_NAME, random_config, random_params
from serve.engine import Engine, EngineConfig
from serve.server import Server


class LiveServer:
    def __init__(self, server: Server):
        self.server = server
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def boot():
            self.runner = web.AppRunner(server.app())
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            started.set()

        threading.Thread(target=lambda: (self.loop.run_until_complete(boot()), self.loop.run_forever()),
                         daemon=True).start()
        started.wait(60)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def request(self, path, body=None, method=None, headers=None, raw=None):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), dict(e.headers)


@pytest.fixture(scope="module")
def engine():
    cfg = random_config()
    engine = Engine(random_params(cfg), cfg, EngineConfig(max_running=4, max_len=512, page_size=16,
                                                           prefill_budget=32, decoder_replay="off"))
    engine.warmup()  # compile every bucket now, so request latencies below are serving, not compiling
    return engine


@pytest.fixture(scope="module")
def live(engine):
    srv = LiveServer(Server(engine, RANDOM_NAME, default_max_tokens=8, enable_metrics=True))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _idle(engine, timeout=30.0):
    end = time.time() + timeout
    while time.time() < end:
        load = engine.load()
        if not load["num_running_reqs"] and not load["num_queue_reqs"] and not engine.open_streams():
            return True
        time.sleep(0.05)
    return False


def test_models_and_health(client, live):
    models = client.models.list()
    assert models.data[0].id == RANDOM_NAME
    assert live.request("/health")[0] == 200
    assert live.request("/health_generate")[0] == 200


def test_completion_plain_and_seeded(client):
    a = client.completions.create(model=RANDOM_NAME, prompt="The capital of France is", max_tokens=6, temperature=0.8,
                                  seed=7)
    b = client.completions.create(model=RANDOM_NAME, prompt="The capital of France is", max_tokens=6, temperature=0.8,
                                  seed=7)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 6 and a.usage.prompt_tokens > 0


def test_completion_stream_with_usage(client):
    stream = client.completions.create(model=RANDOM_NAME, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    text = "".join(c.choices[0].text for c in chunks[:-1])
    whole = client.completions.create(model=RANDOM_NAME, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0)
    assert text == whole.choices[0].text


def test_n_and_logprobs(client):
    r = client.completions.create(model=RANDOM_NAME, prompt="Hi", max_tokens=4, n=2, temperature=1.0, logprobs=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert r.usage.completion_tokens == 8


def test_native_generate_streams_cumulative_text(live):
    status, body, _ = live.request("/generate", {"input_ids": [9, 10, 11], "stream": True,
                                                 "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    frames = [json.loads(x[6:]) for x in body.split("\n\n") if x.startswith("data: {")]
    assert status == 200 and body.rstrip().endswith("data: [DONE]")
    texts = [f["text"] for f in frames]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    final = frames[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 4} and final["completion_tokens"] == 4


@pytest.mark.parametrize("body, status, param", [
    ({"model": RANDOM_NAME, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": RANDOM_NAME, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": RANDOM_NAME, "prompt": "x", "top_p": 7}, 400, "top_p"),
    ({"model": RANDOM_NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": RANDOM_NAME, "prompt": ""}, 400, "prompt"),
    ({"model": RANDOM_NAME, "prompt": [1, -5]}, 400, "prompt"),
    ({"model": RANDOM_NAME}, 400, "prompt"),
    ({"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ({"model": RANDOM_NAME, "prompt": list(range(3, 600))}, 400, "messages"),
    ({"model": RANDOM_NAME, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": RANDOM_NAME, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": RANDOM_NAME, "prompt": "x", "data_parallel_rank": 1}, 400, "data_parallel_rank"),   # --dp-size 1
    ({"model": RANDOM_NAME, "prompt": "x", "data_parallel_rank": "0"}, 400, "data_parallel_rank"),
])
def test_bad_requests_get_openai_envelopes(live, engine, body, status, param):
    code, text, _ = live.request("/v1/completions", body)
    err = json.loads(text)["error"]
    assert code == status and err["code"] == status and err["param"] == param and err["message"]
    assert _idle(engine)


def test_streaming_requests_are_validated_before_streaming(live, engine):
    for body in ({"prompt": list(range(3, 600)), "stream": True}, {"prompt": "x", "stream": True, "regex": "(("}):
        code, text, _ = live.request("/v1/completions", body)
        assert code == 400 and json.loads(text)["error"]["code"] == 400
    assert _idle(engine)


def test_malformed_bodies(live):
    code, text, _ = live.request("/v1/completions", raw=b"{not json")
    assert code == 400 and "malformed JSON" in json.loads(text)["error"]["message"]
    code, text, _ = live.request("/v1/completions", raw=b"[1, 2]")
    assert code == 400
    code, _, _ = live.request("/v1/completions", raw=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert code == 400
    code, text, _ = live.request("/no/such/route")
    assert code == 404 and "error" in json.loads(text)


def test_disconnect_mid_stream_frees_memory(live, engine):
    import socket

    body = json.dumps({"prompt": [3, 4, 5], "max_tokens": 100, "stream": True, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", live.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert b"data:" in s.recv(4096) or b"data:" in s.recv(4096)
    s.close()
    assert _idle(engine), "the disconnected request was not aborted"
    assert engine.scheduler.used_pages == 0 and engine.scheduler.free_slots == 4


def test_abort_request_by_exact_rid(live, engine):
    """SGLang's /abort_request ends exactly the named request; a rid in use is refused with a 400."""
    from concurrent.futures import ThreadPoolExecutor

    def long(rid):
        return live.request("/generate", {"input_ids": [3, 4, 5], "rid": rid, "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True}})

    with ThreadPoolExecutor(2) as pool:
        a, a1 = pool.submit(long, "job"), pool.submit(long, "job-1")
        while engine.load()["num_running_reqs"] < 2:
            time.sleep(0.02)
        code, text, _ = long("job")
        assert code == 400 and json.loads(text)["error"]["param"] == "rid", text
        assert live.request("/abort_request", {"rid": "job"})[0] == 200
        got = json.loads(a.result()[1])["meta_info"]
        assert got["id"] == "job" and got["finish_reason"] == {"type": "abort"} and got["completion_tokens"] < 200
        other = json.loads(a1.result()[1])["meta_info"]   # "job-1" is not a sample of "job"
        assert other["finish_reason"] == {"type": "length", "length": 200}
    assert live.request("/abort_request", {})[0] == 400
    assert _idle(engine)


def test_a_named_dp_rank_and_the_load_report(live):
    code, text, _ = live.request("/v1/completions", {"model": RANDOM_NAME, "prompt": "x", "max_tokens": 2,
                                                      "data_parallel_rank": 0})
    assert code == 200, text
    assert json.loads(live.request("/get_server_info")[1])["dp_size"] == 1
    info = json.loads(live.request("/server_info")[1])   # the gateway's name first; /get_server_info too
    assert info["dp_size"] == 1 and info["served_model_name"] == RANDOM_NAME and info["tp_size"] == 1
    assert json.loads(live.request("/model_info")[1])["model_path"] == RANDOM_NAME
    load = json.loads(live.request("/get_load")[1])   # SGLang's shape: a list, an entry a DP rank
    assert [sorted(x) for x in load] == [["dp_rank", "num_reqs", "num_tokens", "num_waiting_reqs", "ts_tic"]]
    assert load[0]["dp_rank"] == 0 and isinstance(load[0]["num_tokens"], int)


def test_metrics_and_flush(live, engine):
    code, text, _ = live.request("/metrics")
    assert code == 200
    for name in ("sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:time_to_first_token_seconds",
                 "sglang:inter_token_latency_seconds", "sglang:e2e_request_latency_seconds", "sglang:num_running_reqs",
                 "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"):
        assert name in text, name
    assert _idle(engine)
    assert live.request("/flush_cache", method="POST", raw=b"")[0] == 200
    routes = {r.resource.canonical for r in Server(engine, RANDOM_NAME).app().router.routes()}
    assert "/metrics" not in routes and "/health" in routes   # off unless --enable-metrics, as in SGLang


def test_score_endpoint(live):
    code, text, _ = live.request("/v1/score", {"query": [5, 6, 7], "items": [[8], [9, 10]],
                                               "label_token_ids": [11, 12], "apply_softmax": True})
    scores = json.loads(text)["scores"]
    assert code == 200 and len(scores) == 2 and all(abs(sum(s) - 1) < 1e-5 for s in scores)


def test_queue_limit_and_auth(live):
    srv = live.server
    srv.api_key, srv.max_queue = "sekret", 0
    try:
        code, _, _ = live.request("/v1/completions", {"prompt": "x"})
        assert code == 401
        code, text, headers = live.request("/v1/completions", {"prompt": "x"},
                                           headers={"Authorization": "Bearer sekret"})
        assert code == 429 and headers.get("Retry-After") and json.loads(text)["error"]["code"] == 429
    finally:
        srv.api_key, srv.max_queue = None, 256


def test_soak_with_disconnects(live, engine):
    """A burst of mixed requests, a third of them dropped mid-stream; nothing may leak."""
    import random

    rng = random.Random(0)

    async def one(i):
        import aiohttp

        body = {"prompt": [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))],
                "max_tokens": rng.randrange(1, 6), "temperature": rng.choice([0, 0.7]), "stream": i % 2 == 0}
        async with aiohttp.ClientSession() as session:
            async with session.post(live.url + "/v1/completions", json=body) as resp:
                if i % 3 == 0:
                    await resp.content.readany()
                    return None  # leave mid-stream
                return resp.status

    async def burst():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 30)

    t0 = time.time()
    statuses = asyncio.run(burst())
    assert all(s in (None, 200) for s in statuses)
    assert _idle(engine) and engine.scheduler.used_pages == 0 and engine.scheduler.free_slots == 4
    assert time.time() - t0 < 30


def test_chat_plain_and_streaming(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model=RANDOM_NAME, messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.chat.completions.create(model=RANDOM_NAME, messages=msgs, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (r.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert "<｜" not in text and "</think>" not in text


def test_chat_thinking_and_tools_are_accepted(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    r = client.chat.completions.create(model=RANDOM_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=tools, max_tokens=5, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is not None or msg.content is None or isinstance(msg.content, str)
    assert r.usage.prompt_tokens > 100  # the tools block is in the prompt


def test_chat_errors(live):
    for body, param in (({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]},
                                                          "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                          "tools": []}, "tool_choice")):
        code, text, _ = live.request("/v1/chat/completions", body)
        assert code == 400 and json.loads(text)["error"]["param"] == param, text


def test_structured_outputs(client, live):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["color", "n"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=RANDOM_NAME, messages=[{"role": "user", "content": "JSON please"}], max_tokens=40, temperature=0.9, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert obj["color"] in ("red", "green") and 0 <= obj["n"] <= 9 and set(obj) == {"color", "n"}
    r = client.completions.create(model=RANDOM_NAME, prompt="Code:", max_tokens=20, temperature=1.0, seed=5,
                                  extra_body={"regex": "[0-9]{3}-[a-z]{2}"})
    import re
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text), r.choices[0].text
    code, text, _ = live.request("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 30, "json_schema":
                                                                                 '{"type": "object"'}})
    assert code == 400 and json.loads(text)["error"]["param"] == "json_schema"
    code, text, _ = live.request("/v1/completions", {"prompt": "x", "regex": "[unclosed"})
    assert code == 400 and json.loads(text)["error"]["param"] == "regex"
    code, text, _ = live.request("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "response_format": {"type": "yaml"}})
    assert code == 400 and json.loads(text)["error"]["param"] == "response_format"



DSML_CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream):
    """A regex constraint makes the (random) model emit a DSML tool call; the API returns it as tool_calls."""
    import re

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    kw = dict(model=RANDOM_NAME, messages=[{"role": "user", "content": "Weather?"}], tools=tools, max_tokens=80,
              temperature=0, extra_body={"regex": re.escape(DSML_CALL)})
    if not stream:
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        call = choice.message.tool_calls[0]
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
        return
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris", "days": 3}
    assert all("DSML" not in (d.content or "") for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(model=RANDOM_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0.9, seed=11, n=2, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 8
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
