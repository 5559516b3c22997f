"""The incremental detokenizer against whole decodes, with the real DeepSeek-V4 tokenizer."""
from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from model.engram_vocab import tokenizer_path
from serve.detokenizer import Detokenizer
from serve.request import Request
from serve.sampling import SamplingParams

TEXTS = ["Hello, world! 你好，世界。", "emoji 🤖🧠 and accents: naïve café, Ελληνικά",
         "<think>reasoning</think> final\n\n```python\nprint('x')\n```", "数学：∑ᵢ xᵢ² ≥ 0 😀😀😀"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(tokenizer_path()))


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_whole_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    d = Detokenizer(_decode(tok))
    pieces = [d.push(t) for t in ids]
    assert "".join(pieces) + d.flush() == tok.decode(ids, skip_special_tokens=False) == text
    assert not any(p.endswith("\ufffd") for p in pieces)   # no split character is ever given out


def test_random_tokens_match_the_whole_decode(tok):
    """Arbitrary ids (byte tokens that split characters, special tokens, invalid bytes)."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.integers(0, 129000, size=int(rng.integers(1, 60))).tolist()
        d = Detokenizer(_decode(tok))
        assert "".join(d.push(t) for t in ids) + d.flush() == tok.decode(ids, skip_special_tokens=False)


def test_a_split_character_is_held_then_given_whole(tok):
    ids = tok.encode("😀", add_special_tokens=False).ids
    assert len(ids) > 1   # byte-level BPE splits it
    d = Detokenizer(_decode(tok))
    pieces = [d.push(t) for t in ids]
    assert pieces[-1] == "😀" and all(p == "" for p in pieces[:-1]) and d.flush() == ""


def test_stop_string_across_token_boundaries(tok):
    text = "alpha beta STOP gamma"
    ids = tok.encode(text, add_special_tokens=False).ids
    req = Request("r", [1], SamplingParams(stop=("STOP",), max_new_tokens=100), 0)
    d = Detokenizer(_decode(tok))
    for t in ids:
        req.output.append(t)
        req.check_stop(t, (), d)
        if req.finished:
            break
    assert req.finish_reason == "stop" and req.matched_stop == "STOP" and req.text == "alpha beta "
