"""What passes between the engines of a disaggregated pair: D's reservation, P's prefilled state, and
the error that ends a pair's request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reservation:
    """Device pages D set aside for a request's prompt before P prefills it (on DP rank ``rank``)."""
    rank: int
    pages: list[int]
    adopted: bool = False  # its request took the pages (they are no longer the reservation's to give back)


@dataclass
class Prefilled:
    """A prompt's state after P's prefill: its whole pages (``kv_pages`` format: ``[n, page_bytes]`` uint8,
    rows past ``n_pages`` are padding; None when the prompt has no whole page) and the first token P
    sampled, with its logprobs when the request asked for them."""
    n_pages: int
    pages: Any
    first: int
    cached_tokens: int = 0  # of the prompt, served from P's prefix cache (the request's usage reports them)
    logprob: float | None = None
    top_logprobs: list = field(default_factory=list)


class TransferFailed(RuntimeError):
    """A bootstrap room failed; the message says why (it reaches the client)."""
