"""Structured-output constraints: compilation errors, masks, and activation after </think>."""
from __future__ import annotations

import pytest

from serve.engine import THINK_END_ID
from serve.grammar import GrammarError, compile_grammar
from serve.sampling import SamplingParams

V, EOS = 129280, (1,)


def _tok():
    from tokenizers import Tokenizer

    from model.engram_vocab import tokenizer_path

    return Tokenizer.from_file(str(tokenizer_path()))


def test_regex_mask_and_thinking_activation():
    tok = _tok()
    digit, letter = tok.token_to_id("7"), tok.token_to_id("a")
    g = compile_grammar(SamplingParams(regex="[0-9]+"), V, EOS, activate_after=THINK_END_ID)
    assert g.allowed(V) is None  # reasoning is free
    g.consume(letter)
    assert g.allowed(V) is None
    g.consume(THINK_END_ID)
    allowed = g.allowed(V)
    assert allowed[digit] and not allowed[letter] and not allowed[EOS[0]]  # at least one digit first
    g.consume(digit)
    allowed = g.allowed(V)
    assert allowed[digit] and allowed[EOS[0]] and not allowed[letter]


def test_copies_are_independent():
    tok = _tok()
    g = compile_grammar(SamplingParams(regex="[0-9]+"), V, EOS)
    h = g.copy()
    g.consume(tok.token_to_id("7"))
    assert g.allowed(V)[EOS[0]] and not h.allowed(V)[EOS[0]]


@pytest.mark.parametrize("params, field", [
    (SamplingParams(json_schema='{"type": "object"'), "json_schema"),
    (SamplingParams(json_schema={"type": "no-such-type"}), "json_schema"),
    (SamplingParams(regex="(unclosed"), "regex"),
    (SamplingParams(ebnf="root ::= (((("), "ebnf"),
])
def test_bad_constraints_name_their_field(params, field):
    with pytest.raises(GrammarError) as e:
        compile_grammar(params, V, EOS)
    assert e.value.param == field


def test_one_constraint_at_most():
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf="root ::= \"a\"")
