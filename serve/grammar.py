"""Structured output with llguidance: JSON schema, JSON object, regex and EBNF/Lark constraints.

A request's grammar becomes an ``LLMatcher`` over the DeepSeek-V4 tokenizer. Each step the
host asks it for the allowed-token bitmask (llguidance's numpy API) and the jitted sampling
step bans everything else (the same ``ban`` mask that serves ``min_new_tokens``); the sampled
token is then consumed. Because the mask of step N+1 needs step N's token, a constrained
request never has two steps in flight (the overlap scheduler waits for it). Under thinking,
the constraint starts after ``</think>`` (SERVING_CONVENTIONS §12, trap 5). Compilation can be
slow for hostile schemas, so servers run ``compile`` in a worker thread with a time limit.
"""
from __future__ import annotations

import json
from functools import lru_cache

import numpy as np

from serve.sampling import SamplingParams


class GrammarError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@lru_cache(maxsize=None)
def _tokenizer(vocab_size: int, eos_ids: tuple[int, ...]):
    import llguidance

    from model.engram_vocab import tokenizer_path

    return llguidance.LLTokenizer(str(tokenizer_path()), n_vocab=vocab_size, eos_token=list(eos_ids))


class Grammar:
    """One request's constraint: a matcher, and whether it is active yet."""

    def __init__(self, matcher, activate_after: int | None):
        self.matcher = matcher
        self.active = activate_after is None
        self.activate_after = activate_after

    def allowed(self, vocab_size: int) -> np.ndarray | None:
        """bool ``[vocab_size]`` of the tokens the grammar allows next, or None while inactive."""
        if not self.active:
            return None
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)

    def consume(self, token: int) -> None:
        if self.active:
            self.matcher.consume_token(token)
        elif token == self.activate_after:
            self.active = True

    def copy(self) -> "Grammar":
        g = Grammar(self.matcher.deep_copy(), self.activate_after)
        g.active = self.active
        return g


def has_grammar(params: SamplingParams) -> bool:
    return any(getattr(params, k) is not None for k in ("json_schema", "regex", "ebnf"))


def compile_grammar(params: SamplingParams, vocab_size: int, eos_ids: tuple[int, ...],
                    activate_after: int | None = None) -> Grammar | None:
    """The request's Grammar (None without a constraint); GrammarError naming the field when invalid."""
    if not has_grammar(params):
        return None
    import llguidance   # only constrained requests need it

    if params.json_schema is not None:
        field, schema = "json_schema", params.json_schema
        try:
            schema = json.loads(schema) if isinstance(schema, str) else schema
            # Compact JSON (no free whitespace), as SGLang and vLLM default to; a schema's x-guidance may override.
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise GrammarError(field, f"invalid JSON schema: {e}") from None
    elif params.regex is not None:
        field, text = "regex", llguidance.LLMatcher.grammar_from_regex(params.regex)
    else:
        field = "ebnf"
        try:
            text = llguidance.grammar_from("ebnf", params.ebnf)
        except ValueError as e:
            raise GrammarError(field, f"invalid grammar: {e}") from None
    matcher = llguidance.LLMatcher(_tokenizer(vocab_size, eos_ids), text, log_level=0)
    if matcher.is_error():
        raise GrammarError(field, f"invalid {field}: {matcher.get_error()}")
    return Grammar(matcher, activate_after)
