"""DeepSeek-V4 chat rendering: OpenAI-style messages -> the prompt text the model was trained on.

Mirrors ``encode_messages`` of DeepSeek's ``encoding/encoding_dsv4.py`` (shipped with the model; copies in SGLang
``python/sglang/srt/entrypoints/openai/encoding_dsv4.py`` and ``supermy/ds4rs`` ``encoding/encoding_dsv4.py``),
byte for byte for the inputs it accepts:

* BOS once, then each turn. ``tool`` messages become ``<tool_result>`` blocks of a user turn; consecutive
  tool and user messages merge into one turn (joined by ``\\n\\n``), and the results are put in the id order of the
  latest assistant ``tool_calls``.
* A user or developer turn that is last, or is followed by an assistant or ``latest_reminder`` turn, is followed
  by ``<｜Assistant｜>`` and ``<think>`` (thinking mode, and the last user turn or ``drop_thinking`` off) or
  ``</think>``.
* In thinking mode with ``drop_thinking`` (forced off when any message carries ``tools``), turns before the last
  user/developer turn lose their reasoning, and developer turns there are dropped.

Request-level ``tools`` / ``response_format`` are placed the way SGLang's ``serving_chat.py`` (dsv4 branch) does:
an empty system message is put first if the first message is not a system message, and the tools (and format)
are set on that first message (request tools replace tools already on it).

Deliberate deviations (all for inputs the reference crashes on or does not see from an OpenAI client):

* Malformed input raises :class:`ChatTemplateError` (naming the message index) instead of asserting or crashing.
  ``reasoning_effort`` other than None/"high"/"max" is an error here; :func:`render_chat` maps it to None as
  SGLang does.
* ``content`` may be a list of text parts; they are joined with a single space (as SGLang flattens them before
  calling the encoder). Non-text parts are rejected (this module is text-only). ``None`` content is ``""``.
* Tool-call ``arguments`` may be a JSON string (the reference input) or an already-parsed object (SGLang passes
  dicts since sglang#28035). A string that is not JSON becomes one string parameter named ``arguments``, as in the
  reference; valid JSON that is not an object does the same (the reference crashes; deepseek-recipe does this).
* Not supported: the reference's ``context`` / ``add_default_bos_token`` arguments and the internal
  ``task`` / ``wo_eos`` message fields (quick-instruction tasks are not exposed; MODEL_SPEC §10).
* Tool schemas are rendered as the client sent them (key order kept). SGLang instead re-serialises them through
  pydantic, which puts ``description`` first and adds ``"strict": false``.
* A request-level ``response_format`` of type ``"text"`` renders nothing; other formats render the whole object.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

# ---------------------------------------------------------------------------------------------------------------
# Fixed strings of the model's training format. They must stay byte-identical to encoding_dsv4.py; do not edit.
# ---------------------------------------------------------------------------------------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

# The tools block is TOOLS_PROMPT_HEAD + one JSON schema per line + TOOLS_PROMPT_TAIL.
TOOLS_PROMPT_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f"\"<{DSML}tool_calls>\" block like the following:\n\n"
    f"<{DSML}tool_calls>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_PROMPT_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
# ---------------------------------------------------------------------------------------------------------------

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")


class ChatTemplateError(ValueError):
    """The messages (or rendering options) cannot be rendered; the message says what and where."""


@dataclass
class _ToolCall:
    id: str
    name: str
    params: list[tuple[str, Any]]  # (name, value) in argument order


@dataclass
class _Turn:
    role: str
    content: str = ""
    tools: list[dict] | None = None  # function definitions (the "function" objects)
    response_format: Any = None
    reasoning: str = ""
    tool_calls: list[_ToolCall] = field(default_factory=list)
    call_id: str = ""  # tool messages
    blocks: list[tuple[str, str, str]] = field(default_factory=list)  # user: (kind "text"|"tool", call id, text)


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(where: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(
                    part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"{where}: content part {j} ({kind!r}) is not a text part; "
                                        "only text content is supported")
        return " ".join(parts)
    raise ChatTemplateError(f"{where}: content must be a string, a list of text parts or null, "
                            f"not {type(content).__name__}")


def _functions(where: str, tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ChatTemplateError(f"{where}: tools must be a list")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise ChatTemplateError(f"{where}: tools[{j}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        out.append(fn)
    return out


def _arguments(raw: Any) -> list[tuple[str, Any]]:
    if isinstance(raw, dict):
        args = raw
    else:
        try:
            args = json.loads(raw)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            args = {"arguments": raw}
    return list(args.items())


def _tool_calls(where: str, calls: Any) -> list[_ToolCall]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}: tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"{where}: tool_calls[{j}] needs function.name")
        raw = fn.get("arguments")
        if not isinstance(raw, (str, dict)):
            raise ChatTemplateError(f"{where}: tool_calls[{j}].function.arguments must be a JSON string")
        call_id = call.get("id") or fn.get("id") or ""
        out.append(_ToolCall(id=call_id if isinstance(call_id, str) else "", name=fn["name"],
                             params=_arguments(raw)))
    return out


def _parse(index: int, msg: Any) -> _Turn:
    where = f"messages[{index}]"
    if not isinstance(msg, dict):
        raise ChatTemplateError(f"{where}: a message must be an object")
    role = msg.get("role")
    if role not in ROLES:
        raise ChatTemplateError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    where = f"{where} ({role})"
    if role == "user" and msg.get("content") is None:
        raise ChatTemplateError(f"{where}: content is required")
    content = _text(where, msg.get("content"))
    if role == "developer" and not content:
        raise ChatTemplateError(f"{where}: content must not be empty")
    turn = _Turn(role=role, content=content)
    if msg.get("tools"):
        turn.tools = _functions(where, msg["tools"])
    turn.response_format = msg.get("response_format")
    if role == "assistant":
        reasoning = msg.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatTemplateError(f"{where}: reasoning_content must be a string")
        turn.reasoning = reasoning or ""
        turn.tool_calls = _tool_calls(where, msg.get("tool_calls"))
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise ChatTemplateError(f"{where}: tool_call_id must be a string")
        turn.call_id = call_id or ""
    return turn


def _merge_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """tool and user messages -> user turns of blocks; tool results in the latest tool_calls' id order."""
    merged: list[_Turn] = []
    for t in turns:
        if t.role in ("tool", "user"):
            block = ("tool", t.call_id, t.content) if t.role == "tool" else ("text", "", t.content)
            if merged and merged[-1].role == "user":
                merged[-1].blocks.append(block)
            else:
                merged.append(_Turn(role="user", blocks=[block]))
        else:
            merged.append(t)
    order: dict[str, int] = {}
    for t in merged:
        if t.role == "assistant" and t.tool_calls:
            order = {c.id: j for j, c in enumerate(t.tool_calls) if c.id}
        elif t.role == "user" and order:
            slots = [j for j, b in enumerate(t.blocks) if b[0] == "tool"]
            if len(slots) > 1:  # stable sort; unknown ids rank as the first call
                results = sorted((t.blocks[j] for j in slots), key=lambda b: order.get(b[1], 0))
                for j, b in zip(slots, results):
                    t.blocks[j] = b
    return merged


def _last_user(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _drop_old_thinking(turns: list[_Turn]) -> list[_Turn]:
    """Before the last user/developer turn: reasoning is removed and developer turns are dropped."""
    last = _last_user(turns)
    out = []
    for i, t in enumerate(turns):
        if i >= last or t.role in ("system", "user", "latest_reminder"):
            out.append(t)
        elif t.role == "assistant":
            out.append(replace(t, reasoning=""))
    return out


def _extras(t: _Turn) -> str:
    """The tools block and response-format block of a system or developer turn."""
    s = ""
    if t.tools:
        s += "\n\n" + TOOLS_PROMPT_HEAD + "\n".join(_to_json(fn) for fn in t.tools) + TOOLS_PROMPT_TAIL
    if t.response_format:
        s += "\n\n" + RESPONSE_FORMAT_HEAD + _to_json(t.response_format)
    return s


def _dsml_calls(calls: list[_ToolCall]) -> str:
    invokes = []
    for c in calls:
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else _to_json(v)}</{DSML}parameter>' for k, v in c.params)
        invokes.append(f'<{DSML}invoke name="{c.name}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def encode_messages(messages: list[dict], thinking_mode: str = "chat", drop_thinking: bool = True,
                    reasoning_effort: str | None = None, tools: list[dict] | None = None,
                    response_format: dict | None = None) -> str:
    """Render OpenAI-style ``messages`` as a DeepSeek-V4 prompt (ends with the generation prompt if the last
    turn is a user/developer turn). ``tools`` / ``response_format`` are the request-level parameters."""
    if thinking_mode not in THINKING_MODES:
        raise ChatTemplateError(f"thinking_mode must be 'chat' or 'thinking', not {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatTemplateError(f"reasoning_effort must be None, 'high' or 'max', not {reasoning_effort!r}")
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    turns = [_parse(i, m) for i, m in enumerate(messages)]
    request_tools = _functions("tools", tools) if tools else None
    if response_format is not None and not isinstance(response_format, dict):
        raise ChatTemplateError("response_format must be an object")
    if response_format and response_format.get("type") == "text":
        response_format = None
    if request_tools or response_format:
        if turns[0].role != "system":
            turns.insert(0, _Turn(role="system"))
        if request_tools:
            turns[0].tools = request_tools
        if response_format:
            turns[0].response_format = response_format

    turns = _merge_tool_results(turns)
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(t.tools for t in turns)
    if thinking and drop:
        turns = _drop_old_thinking(turns)
    last_user = _last_user(turns)

    out = [BOS]
    for i, t in enumerate(turns):
        if i == 0 and thinking and reasoning_effort == "max":
            out.append(REASONING_EFFORT_MAX)
        if t.role == "system":
            out.append(t.content + _extras(t))
        elif t.role == "developer":
            out.append(USER + t.content + _extras(t))
        elif t.role == "user":
            out.append(USER + "\n\n".join(text if kind == "text" else f"<tool_result>{text}</tool_result>"
                                          for kind, _, text in t.blocks))
        elif t.role == "latest_reminder":
            out.append(LATEST_REMINDER + t.content)
        else:  # assistant
            keep_reasoning = thinking and (not drop or i > last_user)
            out.append((t.reasoning + THINK_END if keep_reasoning else "") + t.content
                       + (_dsml_calls(t.tool_calls) if t.tool_calls else "") + EOS)
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if t.role in ("user", "developer") and following in (None, "assistant", "latest_reminder"):
            out.append(ASSISTANT + (THINK_START if thinking and (not drop or i >= last_user) else THINK_END))
    return "".join(out)


def render_chat(messages: list[dict], tools: list[dict] | None = None, thinking: bool = False,
                reasoning_effort: str | None = None, response_format: dict | None = None) -> str:
    """The server's entry point: like SGLang, ``thinking`` picks the mode and any ``reasoning_effort`` other
    than "high"/"max" (e.g. OpenAI's "low"/"medium") renders as None."""
    effort = reasoning_effort if reasoning_effort in ("high", "max") else None
    return encode_messages(messages, thinking_mode="thinking" if thinking else "chat", reasoning_effort=effort,
                           tools=tools, response_format=response_format)
