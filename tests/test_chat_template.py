"""serve.chat_template against hand-built prompts following DeepSeek's encoding_dsv4.py rules."""
from __future__ import annotations

import pytest

from serve.chat_template import ChatTemplateError, encode_messages, render_chat

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, R = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
T0, T1 = "<think>", "</think>"

# Written out in full (not built from the module's constants) so a drift in either shows up.
TOOLS_BLOCK_HEAD = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_BLOCK_TAIL = ("\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
                    "tool calls.\n")
MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "天气 lookup",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_JSON = ('{"name": "get_weather", "description": "天气 lookup", "parameters": {"type": "object", '
                '"properties": {"city": {"type": "string"}}, "required": ["city"]}}')


def user(text):
    return {"role": "user", "content": text}


def call(cid, name, arguments):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- basic turns -------------------------------------------------------------------------------------------------

def test_single_user_chat_and_thinking():
    assert encode_messages([user("Hi")]) == f"{BOS}{U}Hi{A}{T1}"
    assert encode_messages([user("Hi")], "thinking") == f"{BOS}{U}Hi{A}{T0}"
    assert render_chat([user("Hi")]) == f"{BOS}{U}Hi{A}{T1}"
    assert render_chat([user("Hi")], thinking=True) == f"{BOS}{U}Hi{A}{T0}"


def test_system_user_and_text_parts():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "2+2"}, {"type": "text", "text": "=?"}]}]
    assert encode_messages(msgs, "thinking") == f"{BOS}Be brief.{U}2+2 =?{A}{T0}"


def test_consecutive_user_messages_merge():
    assert encode_messages([user("a"), user("b")]) == f"{BOS}{U}a\n\nb{A}{T1}"


MULTI = [user("q1"), {"role": "assistant", "reasoning_content": "r1", "content": "a1"}, user("q2")]


def test_multi_turn_drops_old_reasoning():
    assert encode_messages(MULTI, "thinking") == f"{BOS}{U}q1{A}{T1}a1{EOS}{U}q2{A}{T0}"
    assert encode_messages(MULTI, "chat") == f"{BOS}{U}q1{A}{T1}a1{EOS}{U}q2{A}{T1}"


def test_multi_turn_keeps_reasoning_without_drop_thinking():
    assert encode_messages(MULTI, "thinking", drop_thinking=False) == \
        f"{BOS}{U}q1{A}{T0}r1{T1}a1{EOS}{U}q2{A}{T0}"
    # chat mode never renders reasoning
    assert encode_messages(MULTI, "chat", drop_thinking=False) == f"{BOS}{U}q1{A}{T1}a1{EOS}{U}q2{A}{T1}"


def test_trailing_assistant_keeps_reasoning_and_gets_no_generation_prompt():
    msgs = [user("q"), {"role": "assistant", "reasoning_content": "r", "content": "a"}]
    assert encode_messages(msgs, "thinking") == f"{BOS}{U}q{A}{T0}r{T1}a{EOS}"


def test_reasoning_effort():
    assert encode_messages([user("x")], "thinking", reasoning_effort="max") == f"{BOS}{MAX_EFFORT}{U}x{A}{T0}"
    sys_first = [{"role": "system", "content": "S"}, user("x")]
    assert encode_messages(sys_first, "thinking", reasoning_effort="max") == f"{BOS}{MAX_EFFORT}S{U}x{A}{T0}"
    assert encode_messages([user("x")], "thinking", reasoning_effort="high") == f"{BOS}{U}x{A}{T0}"
    assert encode_messages([user("x")], "chat", reasoning_effort="max") == f"{BOS}{U}x{A}{T1}"
    assert render_chat([user("x")], thinking=True, reasoning_effort="medium") == f"{BOS}{U}x{A}{T0}"
    assert render_chat([user("x")], thinking=True, reasoning_effort="max") == f"{BOS}{MAX_EFFORT}{U}x{A}{T0}"


def test_latest_reminder():
    msgs = [{"role": "system", "content": "S"}, {"role": "latest_reminder", "content": "2026-02-21"}, user("q")]
    assert encode_messages(msgs, "thinking") == f"{BOS}S{R}2026-02-21{U}q{A}{T0}"
    # a user turn followed by a reminder still gets the assistant prefix first
    assert encode_messages([user("q"), {"role": "latest_reminder", "content": "r"}], "thinking") == \
        f"{BOS}{U}q{A}{T0}{R}r"


def test_developer_role():
    dev = {"role": "developer", "content": "D"}
    assert encode_messages([dev], "thinking") == f"{BOS}{U}D{A}{T0}"
    msgs = [dev, {"role": "assistant", "content": "a"}, user("q")]
    # before the last user turn a developer turn is dropped in thinking mode (with drop_thinking) ...
    assert encode_messages(msgs, "thinking") == f"{BOS}a{EOS}{U}q{A}{T0}"
    # ... and kept otherwise
    assert encode_messages(msgs, "chat") == f"{BOS}{U}D{A}{T1}a{EOS}{U}q{A}{T1}"
    assert encode_messages(msgs, "thinking", drop_thinking=False) == f"{BOS}{U}D{A}{T0}{T1}a{EOS}{U}q{A}{T0}"


# ---- tools, DSML history, tool results ---------------------------------------------------------------------------

def test_tools_block_in_system_prompt():
    msgs = [{"role": "system", "content": "S", "tools": [WEATHER]}, user("q")]
    expected = f"{BOS}S\n\n{TOOLS_BLOCK_HEAD}{WEATHER_JSON}{TOOLS_BLOCK_TAIL}{U}q{A}{T1}"
    assert encode_messages(msgs) == expected
    # request-level tools go onto the system message (SGLang's placement)
    assert render_chat([{"role": "system", "content": "S"}, user("q")], tools=[WEATHER]) == expected


def test_request_tools_without_system_message():
    assert render_chat([user("q")], tools=[WEATHER], thinking=True) == \
        f"{BOS}\n\n{TOOLS_BLOCK_HEAD}{WEATHER_JSON}{TOOLS_BLOCK_TAIL}{U}q{A}{T0}"


def test_tools_on_developer_message():
    msgs = [{"role": "developer", "content": "D", "tools": [WEATHER]}]
    assert encode_messages(msgs) == f"{BOS}{U}D\n\n{TOOLS_BLOCK_HEAD}{WEATHER_JSON}{TOOLS_BLOCK_TAIL}{A}{T1}"


def test_assistant_tool_calls_as_dsml():
    msgs = [user("q"), {"role": "assistant", "content": "Checking.", "tool_calls": [
        call("c1", "get_weather", '{"city": "北京", "days": 3, "units": ["C"], "opts": {"a": null}, "hourly": true}'),
        call("c2", "raw", "not json"),
        call("c3", "noargs", "{}"),
        call("c4", "parsed", {"x": 1.5})]}]
    expected = (
        f"{BOS}{U}q{A}{T1}Checking.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">北京</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="units" string="false">["C"]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"a": null}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="hourly" string="false">true</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="raw">\n'
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="noargs">\n\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="parsed">\n'
        '<｜DSML｜parameter name="x" string="false">1.5</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}")
    assert encode_messages(msgs) == expected


def test_non_object_json_arguments_become_one_string_parameter():
    msgs = [user("q"), {"role": "assistant", "tool_calls": [call("c", "f", "[1, 2]")]}]
    assert '<｜DSML｜parameter name="arguments" string="true">[1, 2]</｜DSML｜parameter>' in encode_messages(msgs)


TOOL_LOOP = [
    {"role": "system", "content": "S"},
    user("q"),
    {"role": "assistant", "reasoning_content": "plan", "content": "",
     "tool_calls": [call("a", "f", '{"k": "v"}'), call("b", "g", "{}")]},
    {"role": "tool", "tool_call_id": "b", "content": "B-result"},
    {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "A-result"}]},
    user("and?"),
]
TOOL_LOOP_CALLS = ("\n\n<｜DSML｜tool_calls>\n"
                   '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\n'
                   "</｜DSML｜invoke>\n"
                   '<｜DSML｜invoke name="g">\n\n</｜DSML｜invoke>\n'
                   "</｜DSML｜tool_calls>")
TOOL_RESULTS = "<tool_result>A-result</tool_result>\n\n<tool_result>B-result</tool_result>\n\nand?"


def test_tool_results_merged_and_reordered():
    # the merged tool-result turn is the last user turn, so the earlier reasoning is dropped
    assert encode_messages(TOOL_LOOP, "thinking") == \
        f"{BOS}S{U}q{A}{T1}{TOOL_LOOP_CALLS}{EOS}{U}{TOOL_RESULTS}{A}{T0}"


def test_any_tools_force_drop_thinking_off():
    with_tools = [dict(TOOL_LOOP[0], tools=[WEATHER])] + TOOL_LOOP[1:]
    system = f"S\n\n{TOOLS_BLOCK_HEAD}{WEATHER_JSON}{TOOLS_BLOCK_TAIL}"
    expected = f"{BOS}{system}{U}q{A}{T0}plan{T1}{TOOL_LOOP_CALLS}{EOS}{U}{TOOL_RESULTS}{A}{T0}"
    assert encode_messages(with_tools, "thinking") == expected
    assert render_chat(TOOL_LOOP, tools=[WEATHER], thinking=True) == expected


def test_tool_results_without_known_ids_keep_their_order():
    msgs = [user("q"), {"role": "assistant", "tool_calls": [call("x", "f", "{}")]},
            {"role": "tool", "tool_call_id": "p", "content": "1"}, {"role": "tool", "content": "2"}]
    assert encode_messages(msgs).endswith(f"{U}<tool_result>1</tool_result>\n\n<tool_result>2</tool_result>{A}{T1}")


# ---- response format ---------------------------------------------------------------------------------------------

def test_response_format_block():
    rf = {"type": "json_object"}
    head = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
    msgs = [{"role": "system", "content": "S", "response_format": rf}, user("q")]
    assert encode_messages(msgs) == f'{BOS}S{head}{{"type": "json_object"}}{U}q{A}{T1}'
    assert render_chat([user("q")], response_format=rf) == f'{BOS}{head}{{"type": "json_object"}}{U}q{A}{T1}'
    assert render_chat([user("q")], response_format={"type": "text"}) == f"{BOS}{U}q{A}{T1}"
    both = render_chat([user("q")], tools=[WEATHER], response_format=rf)
    tools_block = f"\n\n{TOOLS_BLOCK_HEAD}{WEATHER_JSON}{TOOLS_BLOCK_TAIL}"
    assert both == f'{BOS}{tools_block}{head}{{"type": "json_object"}}{U}q{A}{T1}'


# ---- the real tokenizer ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    from model import engram_vocab
    return Tokenizer.from_file(str(engram_vocab.tokenizer_path()))


def test_markers_are_single_tokens(tokenizer):
    ids = tokenizer.encode(encode_messages(MULTI, "thinking", drop_thinking=False), add_special_tokens=False).ids
    assert ids[0] == 0 and ids.count(0) == 1  # BOS once
    assert ids.count(128803) == 2 and ids.count(128804) == 2  # <｜User｜>, <｜Assistant｜>
    assert ids.count(128821) == 2 and ids.count(128822) == 1  # <think>, </think>
    assert ids.count(1) == 1 and ids[-1] == 128821  # EOS after the answer; ends with <think>
    text = encode_messages([{"role": "latest_reminder", "content": "r"}] + TOOL_LOOP[1:], "chat")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[:2] == [0, 128828]  # BOS, <｜latest_reminder｜>
    assert ids.count(128825) == 8  # ｜DSML｜: tool_calls, 2 invokes, 1 parameter, each opened and closed
    assert ids[-2:] == [128804, 128822]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


# ---- errors ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, match", [
    ([user("a"), {"role": "bot", "content": "x"}], r"messages\[1\]: unknown role 'bot'"),
    (["hello"], r"messages\[0\]: a message must be an object"),
    ([{"role": "user"}], r"messages\[0\] \(user\): content is required"),
    ([{"role": "developer", "content": ""}], r"messages\[0\] \(developer\): content must not be empty"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], r"part 0 \('image_url'\)"),
    ([{"role": "user", "content": 5}], r"content must be a string"),
    ([user("q"), {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     r"messages\[1\] \(assistant\): tool_calls\[0\] needs function.name"),
    ([user("q"), {"role": "assistant", "tool_calls": [call("c", "f", None)]}], r"arguments must be a JSON string"),
    ([user("q"), {"role": "assistant", "tool_calls": {"id": "c"}}], r"tool_calls must be a list"),
    ([{"role": "system", "content": "", "tools": [{"name": "f"}]}], r"messages\[0\] \(system\): tools\[0\]"),
    ([user("q"), {"role": "tool", "tool_call_id": 7, "content": "x"}], r"messages\[1\] \(tool\): tool_call_id"),
    ([], r"non-empty list"),
])
def test_malformed_messages(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        encode_messages(messages)


def test_bad_options():
    assert issubclass(ChatTemplateError, ValueError)
    with pytest.raises(ChatTemplateError, match="thinking_mode"):
        encode_messages([user("q")], thinking_mode="deep")
    with pytest.raises(ChatTemplateError, match="reasoning_effort"):
        encode_messages([user("q")], "thinking", reasoning_effort="medium")
    with pytest.raises(ChatTemplateError, match=r"tools: tools\[0\]"):
        render_chat([user("q")], tools=[{"name": "f"}])
    with pytest.raises(ChatTemplateError, match="response_format"):
        render_chat([user("q")], response_format="json")


def test_input_is_not_mutated():
    msgs = [dict(m) for m in TOOL_LOOP]
    snapshot = repr(msgs)
    render_chat(msgs, tools=[WEATHER], thinking=True, response_format={"type": "json_object"})
    assert repr(msgs) == snapshot
