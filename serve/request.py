"""A request's life on the host: its tokens, progress, pages, and stop conditions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve.detokenizer import Detokenizer
from serve.sampling import SamplingParams


@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: int  # admission order tie-break (FIFO)
    group: str | None = None  # the id the caller gave: one request, or all of its n samples
    output: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: Any = None
    slot: int | None = None
    rank: int | None = None  # the DP rank holding its slot and pages (serve.scheduler)
    dp_rank: int | None = None  # the DP rank a router asked for (``data_parallel_rank``), or None
    pages: list[int] = field(default_factory=list)
    shared_pages: int = 0  # leading pages borrowed from the radix cache
    computed: int = 0  # tokens fed to the device (its seq_len once the in-flight steps land)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    radix_node: Any = None
    held_node: Any = None  # a radix node kept from eviction until admission (pages a disaggregated decode received)
    export: Any = None  # prefill side of a disaggregated pair: called with its Prefilled state when it ends
    page_keys: list[bytes] = field(default_factory=list)  # its first pages' keys (serve/hicache.py), grown as needed
    inflight: int = 0  # dispatched steps whose results the host has not processed
    admitted_at: int = -1
    text: str = ""  # detokenised output (stop strings trimmed)
    grammar: Any = None  # serve.grammar.Grammar: structured-output constraint
    recount_upto: int = 0  # outputs below this position are recomputed after a retraction: recount them
    admissions: int = 0
    stop_from: int | None = None  # stop strings count only from here (text produced after min_new_tokens)
    detok: Detokenizer | None = None  # set once its text is wanted (stop strings or a stream)
    notified: int = 0  # outputs handed to its stream so far
    notified_text: int = 0  # characters of stable text handed to its stream so far
    notified_end: bool = False  # its final delta went (a step in flight at its stop lands after)
    handle: Any = None  # serve.handle.Handle its deltas go to (a streamed request), or None
    index: int = 0  # which of its handle's samples it is
    spec: bool = False  # decodes speculatively (DSpark; serve/speculative.py)
    drafts: list[int] = field(default_factory=list)  # the tokens proposed to follow its last one
    verify_ct: int = 0  # verify steps it took

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.ids) - 1

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.output),
                "total_tokens": len(self.prompt) + len(self.output),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def stable_len(self) -> int:
        """How much of ``text`` cannot change any more: all of it once finished; before, a
        trailing prefix of a stop string is held back (the detokenizer holds split characters)."""
        text = self.text
        if self.finished:
            return len(text)
        hold = max((k for s in self.params.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return len(text) - hold

    def check_stop(self, token: int, eos_ids: tuple[int, ...], detok: Detokenizer | None) -> None:
        """Apply the stop conditions after ``token`` was appended (``detok``: this request's
        detokenizer, which has seen every output before ``token``, or None: no text wanted)."""
        p = self.params
        enough = len(self.output) >= p.min_new_tokens
        if enough and token in p.stop_token_ids:
            self.finish_reason, self.matched_stop = "stop", token
        elif enough and not p.ignore_eos and token in eos_ids:
            self.finish_reason, self.matched_stop = "stop", token
        if detok is not None:
            hidden = self.finish_reason == "stop"  # a stop token is not part of the text
            start = len(self.text)
            self.text += "" if hidden else detok.push(token)
            if len(self.output) >= p.max_new_tokens or self.finish_reason is not None:
                self.text += detok.flush()
            if p.stop and len(self.output) == p.min_new_tokens:   # stop strings count from here
                self.stop_from = max(0, len(self.text) - max(map(len, p.stop)) + 1)
            if enough and self.finish_reason is None and p.stop:
                since = max(self.stop_from or 0, start - max(map(len, p.stop)) + 1)
                for s in p.stop:
                    at = self.text.find(s, since)
                    if at >= 0:
                        self.text, self.finish_reason, self.matched_stop = self.text[:at], "stop", s
                        break
        if self.finish_reason is None and len(self.output) >= p.max_new_tokens:
            self.finish_reason = "length"
