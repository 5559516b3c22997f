"""Request validation and response shapes of the OpenAI-compatible and SGLang-native APIs.

Errors use OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status as ``code`` (like vLLM), and repeat ``object``/``message``/``type``/``code`` at
the top level so SGLang-style clients keep working (SERVING_CONVENTIONS §1.5).
"""
from __future__ import annotations

from typing import Any

from serve.sampling import InvalidSamplingParam, SamplingParams

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "BadRequestError",
          413: "BadRequestError",
          429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, status

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "BadRequestError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code},
                "object": "error", "message": self.message, "type": kind, "code": self.code}


# the engine's name for a refused field (serve.handle.RequestError) -> the OpenAI APIs'
OPENAI_FIELDS = {"prompt": "messages", "max_new_tokens": "max_tokens"}


def require(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise ApiError(400, message, param)


def typed(body: dict, name: str, kind: type, default=None):
    """``body[name]`` if it has type ``kind`` (a bool is not an int here), ``default`` if absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ApiError(400, f"'{name}' must be of type {kind.__name__}", name)
    return value


# OpenAI request field -> SGLang sampling-param name
_OPENAI_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                    "repetition_penalty": "repetition_penalty", "seed": "seed", "stop": "stop",
                    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "min_tokens": "min_new_tokens",
                    "n": "n", "regex": "regex", "ebnf": "ebnf"}


def openai_sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from an OpenAI completions/chat body (``max_completion_tokens`` wins over ``max_tokens``)."""
    params: dict[str, Any] = {v: body[k] for k, v in _OPENAI_SAMPLING.items() if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError(400, "max_tokens must be a positive integer", "max_tokens")
    params["max_new_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    logprobs = body.get("logprobs")
    if body.get("top_logprobs") is not None and logprobs is not True:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if isinstance(logprobs, bool):
        params["logprobs"] = logprobs
        params["top_logprobs"] = typed(body, "top_logprobs", int, 0)
    elif logprobs is not None:  # completions: logprobs is the number of alternatives
        if isinstance(logprobs, bool) or not isinstance(logprobs, int):
            raise ApiError(400, "'logprobs' has the wrong type", "logprobs")
        params["logprobs"], params["top_logprobs"] = True, logprobs
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            params["json_schema"] = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError(400, "response_format.json_schema must be an object with a 'schema'",
                               "response_format")
            params["json_schema"] = spec.get("schema", {})
        elif kind != "text":
            raise ApiError(400, "response_format.type must be text, json_object or json_schema", "response_format")
    return sampling_params(params)


def sampling_params(params: Any) -> SamplingParams:
    if not isinstance(params, dict):
        raise ApiError(400, "sampling_params must be an object", "sampling_params")
    params = dict(params)
    if "sampling_seed" in params:  # the native endpoint's name
        params["seed"] = params.pop("sampling_seed")
    try:
        return SamplingParams.from_dict(params)
    except InvalidSamplingParam as e:
        raise ApiError(400, str(e), e.param) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def finish_reason_native(reason: str | None, matched: Any, completion_tokens: int) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": reason}
