"""Incremental detokenizing: each new token's text in constant work, whatever the output's length.

Decoding the whole output again on every token costs O(n) a token, O(n^2) a request. Here each
token decodes a short window instead (vLLM's and SGLang's scheme): ``ids[prefix:]`` against
``ids[prefix:read]``, where ``read`` is the end of the text already given out and ``prefix`` a
few tokens before it, so that a tokenizer whose pieces depend on their left neighbour (a leading
space, a byte-level merge) decodes the new piece in context. While the window's text ends in
U+FFFD (a multi-byte character split across tokens), nothing is given out and the window grows
by a token, for at most ``MAX_SPLIT`` tokens (invalid bytes stay U+FFFD, as a whole decode
leaves them); ``flush`` gives out what is left at the end.
"""
from __future__ import annotations

from typing import Callable

MAX_SPLIT = 4  # tokens a character may span (UTF-8 takes at most 4 bytes); past it U+FFFD is text


class Detokenizer:
    """The text of a growing token sequence, piece by piece (``decode``: ids -> text)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0   # window start: a few tokens of left context
        self.read = 0     # tokens whose text has been given out

    def push(self, token: int) -> str:
        """Add a token; the text it completes ("" while a character is still split)."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        split = text.endswith("\ufffd") and len(self.ids) - self.read < MAX_SPLIT
        if len(text) <= len(before) or split:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text of the tokens not given out yet (a split character as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]
