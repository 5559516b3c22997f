"""Incremental detokenizing: each new token's text in constant work, whatever the output's length.

Decoding the whole output again on every token costs O(n) a token, O(n^2) a request. Here each
token decodes a short window instead (vLLM's and SGLang's scheme): the window's tokens against
those of them already given out, which are the last piece's tokens, so that a tokenizer whose
pieces depend on their left neighbour (a leading space, a byte-level merge) decodes the new
piece in context. While the window's text ends in U+FFFD (a multi-byte character split across
tokens), nothing is given out and the window grows by a token, for at most ``MAX_SPLIT`` tokens
(invalid bytes stay U+FFFD, as a whole decode leaves them); ``flush`` gives out what is left.
"""
from __future__ import annotations

from typing import Callable

MAX_SPLIT = 4  # tokens a character may span (UTF-8 takes at most 4 bytes); past it U+FFFD is text


class Detokenizer:
    """The text of a growing token sequence, piece by piece (``decode``: ids -> text)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        # the window: the tokens of the piece given out last (left context), then those pending
        self.ids: list[int] = []
        self.read = 0   # the window's tokens whose text has been given out

    def push(self, token: int) -> str:
        """Add a token; the text it completes ("" while a character is still split)."""
        self.ids.append(token)
        split = len(self.ids) - self.read < MAX_SPLIT
        return self._advance(lambda text: split and text.endswith("\ufffd"))

    def flush(self) -> str:
        """The text of the tokens not given out yet (a split character as U+FFFD)."""
        return "" if self.read == len(self.ids) else self._advance(lambda text: False)

    def _advance(self, hold) -> str:
        before, text = self.decode(self.ids[:self.read]), self.decode(self.ids)
        if len(text) <= len(before) or hold(text):
            return ""
        del self.ids[:self.read]   # the next window starts at this piece
        self.read = len(self.ids)
        return text[len(before):]
