"""Reasoning and DSML tool-call parsers: every transcript is fed whole, split at every character boundary into two
feeds, and one character at a time; all must agree, and no delta may ever carry markup."""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import pytest

from serve.parsers import (BLOCK_START, EOS, TOOL_CALLS_START, OutputParser, ReasoningParser, ToolCallParser,
                           parse_completion)

FORBIDDEN = ("<think>", "</think>", "｜", "DSML", "<｜")  # no test transcript has these in its plain text


def param(name: str, value: Any) -> str:
    """Encodes like encoding_dsv4.encode_arguments_to_dsml."""
    is_str = isinstance(value, str)
    text = value if is_str else json.dumps(value, ensure_ascii=False)
    return f'<｜DSML｜parameter name="{name}" string="{str(is_str).lower()}">{text}</｜DSML｜parameter>'


def invoke(name: str, args: dict[str, Any]) -> str:
    params = "\n".join(param(k, v) for k, v in args.items())
    return f'<｜DSML｜invoke name="{name}">\n{params}\n</｜DSML｜invoke>'


def block(*invokes: str) -> str:
    return BLOCK_START + "\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


@dataclass
class Outcome:
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]
    streamed: dict[int, list[str]]  # index -> [id, name, concatenated argument fragments]
    error: str | None


def stream(chunks: list[str], thinking: bool, tools: bool = True) -> Outcome:
    p = OutputParser(thinking, tools, rng=random.Random(0))
    deltas = [p.feed(c) for c in chunks] + [p.finish()]
    streamed: dict[int, list[str]] = {}
    for d in deltas:
        for text in (d.reasoning, d.content):
            assert not any(bad in text for bad in FORBIDDEN), (text, chunks)
        for c in d.calls:
            fn = c["function"]
            if c["index"] not in streamed:
                assert c["index"] == len(streamed) and c["type"] == "function" and fn["name"]
                assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"])
                streamed[c["index"]] = [c["id"], fn["name"], fn["arguments"]]
            else:
                assert set(c) == {"index", "function"} and set(fn) == {"arguments"}
                streamed[c["index"]][2] += fn["arguments"]
    errors = [d.error for d in deltas if d.error]
    assert errors == ([p.error] if p.error else [])
    return Outcome("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), p.tool_calls,
                   streamed, p.error)


def check_every_split(text: str, thinking: bool, tools: bool = True) -> Outcome:
    ref = stream([text], thinking, tools)
    for i in range(1, len(text)):
        assert stream([text[:i], text[i:]], thinking, tools) == ref, f"split at {i}: {text[:i]!r}"
    assert stream(list(text), thinking, tools) == ref
    whole = parse_completion(text, thinking, tools, rng=random.Random(0))
    assert whole == {"reasoning_content": ref.reasoning if thinking else None, "content": ref.content,
                     "tool_calls": ref.tool_calls, "tool_call_error": ref.error,
                     "finish_reason_override": "tool_calls" if ref.tool_calls else None}
    # Every kept call was streamed in full; a call dropped by an error can only be the last one announced.
    for i, c in enumerate(ref.tool_calls):
        assert ref.streamed[i] == [c["id"], c["function"]["name"], c["function"]["arguments"]]
    assert len(ref.streamed) - len(ref.tool_calls) <= (1 if ref.error else 0)
    return ref


def calls_of(outcome: Outcome) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in outcome.tool_calls]


TRICKY = {
    "city": "Zürich 東京 🌧️ ünïcødé",
    "quote": 'He said "hi" and \\ left',
    "multiline": "line 1\nline 2\n\n  indented\ttab",
    "html": "<b>bold</b> a<b c>",
    "numeric_string": "42",
    "empty": "",
    "n": 3,
    "x": -1.5e-3,
    "big": 12345678901234567890,
    "flag": True,
    "off": False,
    "nothing": None,
    "list": [1, "two", {"three": [3.0]}, []],
    "obj": {"k": "v \"q\"", "nested": {"deep": ["é", 1.25, None]}, "empty": {}},
}

VALID = {  # name: (text, thinking, reasoning, content, [(tool, args)])
    "thinking_then_content": (
        "Let me think.\nTwo plus two is four.</think>The answer is **4**.", True,
        "Let me think.\nTwo plus two is four.", "The answer is **4**.", []),
    "marker_lookalikes_are_text": (
        "Is a < b? Tags </thing>, <thin> and </th are text.\n\n\nok</think>x < y, </b>, <t and \n\n< stay.", True,
        "Is a < b? Tags </thing>, <thin> and </th are text.\n\n\nok", "x < y, </b>, <t and \n\n< stay.", []),
    "thinking_without_end": ("Still thinking\n\nabout it", True, "Still thinking\n\nabout it", "", []),
    "thinking_ends_at_dsml_block": (
        "I should look it up." + block(invoke("search", {"q": "weather in Paris"})), True,
        "I should look it up.", "", [("search", {"q": "weather in Paris"})]),
    "explicit_think_start_and_eos": ("<think>hmm</think>ok" + EOS, True, "hmm", "ok", []),
    "chat_plain": ("Hello! How can I help?\n", False, "", "Hello! How can I help?\n", []),
    "chat_stray_think_end": ("</think>Hello there.", False, "", "Hello there.", []),
    "one_call": (
        "Checking the calendar." + block(invoke("list_events", {"date": "2026-03-04", "limit": 5})) + EOS, False,
        "", "Checking the calendar.", [("list_events", {"date": "2026-03-04", "limit": 5})]),
    "two_invokes_after_reasoning": (
        "Need both.</think>" + block(invoke("get_weather", {"city": "Paris"}),
                                     invoke("get_time", {"tz": "Europe/Paris", "24h": True})) + EOS, True,
        "Need both.", "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "24h": True})]),
    "tricky_values": (
        "Plan.</think>Sending.\n" + block(invoke("write", TRICKY)), True, "Plan.", "Sending.\n",
        [("write", TRICKY)]),
    "content_before_block": (
        "First line.\nSecond line: ready\n\n\n" + block(invoke("ping", {})), False,
        "", "First line.\nSecond line: ready\n\n\n", [("ping", {})]),
    "no_newlines_before_block": (
        "Text" + TOOL_CALLS_START + "\n" + invoke("f", {"a": 1}) + "\n</｜DSML｜tool_calls>", False,
        "", "Text", [("f", {"a": 1})]),
    "v32_function_calls_wrapper": (
        "\n\n<｜DSML｜function_calls>\n" + invoke("f", {"a": [1]}) + "\n</｜DSML｜function_calls>", False,
        "", "", [("f", {"a": [1]})]),
    "raw_json_inside_invoke": (
        block('<｜DSML｜invoke name="f">\n{"a": [1, 2], "b": "x"}\n</｜DSML｜invoke>'), False,
        "", "", [("f", {"a": [1, 2], "b": "x"})]),
    "loose_whitespace_between_tags": (
        '<｜DSML｜tool_calls> \t<｜DSML｜invoke name="f"  >' + param("a", "x") + "  \n  " + param("b", 2)
        + "</｜DSML｜invoke>\n\n</｜DSML｜tool_calls>\n", False, "", "", [("f", {"a": "x", "b": 2})]),
    "empty_block": ("Nothing to call." + block(), False, "", "Nothing to call.", []),
}


@pytest.mark.parametrize("name", VALID)
def test_valid_transcripts(name: str) -> None:
    text, thinking, reasoning, content, calls = VALID[name]
    out = check_every_split(text, thinking)
    assert (out.reasoning, out.content, out.error) == (reasoning, content, None)
    assert calls_of(out) == calls
    for c, (_, args) in zip(out.tool_calls, calls):  # byte-for-byte what encoding_dsv4 decodes
        assert c["function"]["arguments"] == json.dumps(args, ensure_ascii=False)
    assert len({c["id"] for c in out.tool_calls}) == len(calls)


def test_reference_example_exact() -> None:
    text = ('…reasoning…</think>Checking the calendar.\n\n<｜DSML｜tool_calls>\n'
            '<｜DSML｜invoke name="list_events">\n'
            '<｜DSML｜parameter name="date" string="true">2026-03-04</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="limit" string="false">5</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>')
    r = parse_completion(text, thinking=True, tools_enabled=True, rng=random.Random(1))
    assert r["reasoning_content"] == "…reasoning…" and r["content"] == "Checking the calendar."
    assert r["tool_calls"] == [{"id": r["tool_calls"][0]["id"], "type": "function", "function": {
        "name": "list_events", "arguments": '{"date": "2026-03-04", "limit": 5}'}}]
    assert r["finish_reason_override"] == "tool_calls" and r["tool_call_error"] is None
    again = parse_completion(text, thinking=True, tools_enabled=True, rng=random.Random(1))
    assert again["tool_calls"][0]["id"] == r["tool_calls"][0]["id"]


def test_streamed_fragments_follow_parameters() -> None:
    p = ToolCallParser(rng=random.Random(0))
    d = p.feed(BLOCK_START + '\n<｜DSML｜invoke name="f">\n')
    assert d.content == "" and d.calls == [{"index": 0, "id": d.calls[0]["id"], "type": "function",
                                            "function": {"name": "f", "arguments": ""}}]
    assert p.feed(param("a", "x") + "\n" + param("b", [1])[:-3]).calls == [{"index": 0, "function": {
        "arguments": '{"a": "x"'}}]
    assert p.feed("er>\n").calls == [{"index": 0, "function": {"arguments": ', "b": [1]'}}]
    assert p.feed("</｜DSML｜invoke>").calls == [{"index": 0, "function": {"arguments": "}"}}]
    assert p.feed("\n</｜DSML｜tool_calls>").calls == [] and p.finish() == p.feed("")
    assert p.tool_calls[0]["function"]["arguments"] == '{"a": "x", "b": [1]}' and not p.malformed


def test_tools_disabled_drops_calls_but_not_into_content() -> None:
    text = VALID["one_call"][0]
    out = check_every_split(text, thinking=False, tools=False)
    assert out.content == "Checking the calendar." and out.tool_calls == [] and out.streamed == {}
    assert parse_completion(text, False, False)["finish_reason_override"] is None


def test_reasoning_parser_holds_back_marker_prefixes() -> None:
    p = ReasoningParser(thinking=True)
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("ink>x<") == ("", "x")
    assert p.feed("/b>") == ("", "</b>")
    p = ReasoningParser(thinking=True)
    assert p.feed("abc\n\n<｜DS") == ("abc", "")
    assert p.feed("ML｜tool_calls>") == ("", BLOCK_START)  # passed on for the tool parser


def test_eos_tails() -> None:
    """At EOS a held tail that began spelling ``｜…｜`` markup is dropped; any other held tail is text."""
    p = ReasoningParser(thinking=True)
    assert p.feed("abc</thi") == ("abc", "") and p.finish() == ("</thi", "")
    p = ReasoningParser(thinking=True)
    assert p.feed("abc\n\n<｜DS") == ("abc", "") and p.finish() == ("", "")
    t = ToolCallParser()
    assert t.feed("Hi\n\n").content == "Hi" and t.finish().content == "\n\n"
    t = ToolCallParser()
    assert t.feed("Hi\n\n<｜DS").content == "Hi" and t.finish().content == "" and not t.malformed
    for text, thinking, reasoning, content in [("think</thi", True, "think</thi", ""), ("a\n\n<", False, "", "a\n\n<"),
                                               ("plan\n\n<｜DSML", True, "plan", ""), ("Hi <｜DS", False, "", "Hi ")]:
        out = check_every_split(text, thinking)
        assert (out.reasoning, out.content, out.tool_calls, out.error) == (reasoning, content, [], None)


GOOD = invoke("a", {"x": "1"})
MALFORMED = {  # name: (text, thinking, reasoning, content, kept calls, error fragment)
    "truncated_mid_parameter": (
        "Let me check." + BLOCK_START + "\n" + GOOD + '\n<｜DSML｜invoke name="b">\n'
        '<｜DSML｜parameter name="y" string="true">hal', False, "", "Let me check.", [("a", {"x": "1"})],
        "truncated"),
    "truncated_in_tag": ("Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜inv", False, "", "Hi", [], "truncated"),
    "truncated_before_wrapper_close": (block(GOOD)[:-len("\n</｜DSML｜tool_calls>")], False, "", "",
                                       [("a", {"x": "1"})], "truncated"),
    "truncated_reasoning_block": ('plan\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a">', True, "plan", "", [],
                                  "truncated"),
    "duplicate_parameter": (
        "Ok." + block(GOOD, '<｜DSML｜invoke name="b">\n' + param("y", "1") + "\n" + param("y", 2)
                      + "\n</｜DSML｜invoke>"), False, "", "Ok.", [("a", {"x": "1"})], "duplicate"),
    "bad_json_literal": (block(invoke("a", {"n": 1})[:-len("\n</｜DSML｜invoke>")] + "\n"
                               '<｜DSML｜parameter name="m" string="false">yes please</｜DSML｜parameter>\n'
                               "</｜DSML｜invoke>"), False, "", "", [], "JSON literal"),
    "nan_literal": (block('<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="n" string="false">NaN'
                          '</｜DSML｜parameter>\n</｜DSML｜invoke>'), False, "", "", [], "JSON literal"),
    "empty_literal": (block('<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="n" string="false">'
                            '</｜DSML｜parameter>\n</｜DSML｜invoke>'), False, "", "", [], "JSON literal"),
    "unknown_tag_in_block": ("See:" + BLOCK_START + "\n<｜DSML｜result>x</｜DSML｜result>\n" + GOOD, False, "",
                             "See:", [], "unexpected tag"),
    "unknown_tag_in_invoke": (block('<｜DSML｜invoke name="a">\n<｜DSML｜argument name="x">1</｜DSML｜argument>\n'
                                    '</｜DSML｜invoke>'), True, "", "", [], "bad parameter tag"),
    "missing_name": (block("<｜DSML｜invoke>\n" + param("x", 1) + "\n</｜DSML｜invoke>"), False, "", "", [],
                     "without a tool name"),
    "empty_name": (block(GOOD, invoke("", {"x": 1})), False, "", "", [("a", {"x": "1"})], "without a tool name"),
    "missing_string_attribute": (block('<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="x">1'
                                       '</｜DSML｜parameter>\n</｜DSML｜invoke>'), False, "", "", [],
                                 "bad parameter tag"),
    "unclosed_parameter": (block('<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="x" string="true">abc\n'
                                 + param("y", 2) + "\n</｜DSML｜invoke>"), False, "", "", [], "unterminated"),
    "text_between_tags": (block('<｜DSML｜invoke name="a">\nsome words\n</｜DSML｜invoke>'), False, "", "", [],
                          "unexpected text"),
    "bad_raw_json": (block('<｜DSML｜invoke name="a">\n{"a": }\n</｜DSML｜invoke>'), False, "", "", [],
                     "JSON object"),
    "text_after_block": ("Calling." + block(GOOD) + "\nAnything else? <｜DSML｜invoke", False, "", "Calling.",
                         [("a", {"x": "1"})], "after the tool_calls block"),
    "invoke_without_wrapper": ("Sure. " + invoke("a", {"x": 1}), False, "", "Sure. ", [], "expected"),
    "close_tag_first": ("Hi\n\n</｜DSML｜tool_calls>then text", True, "Hi", "", [], "expected"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_dsml_never_leaks(name: str) -> None:
    text, thinking, reasoning, content, calls, error = MALFORMED[name]
    out = check_every_split(text, thinking)
    assert (out.reasoning, out.content) == (reasoning, content)
    assert calls_of(out) == calls
    assert out.error is not None and error in out.error, out.error


def test_round_trip_through_prompt_encoder() -> None:
    """What serve.chat_template renders for an assistant turn parses back to the same message."""
    chat_template = pytest.importorskip("serve.chat_template")
    calls = [("write", TRICKY), ("ping", {})]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "reasoning_content": "Why not.", "content": "Sure.",
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                                for n, a in calls]}]
    completion = chat_template.encode_messages(messages, "thinking").split("<｜Assistant｜><think>")[-1]
    out = check_every_split(completion, thinking=True)
    assert (out.reasoning, out.content, out.error) == ("Why not.", "Sure.", None)
    assert calls_of(out) == calls
