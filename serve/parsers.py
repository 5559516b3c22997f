"""Incremental parsers for DeepSeek-V4 output: reasoning vs content, and DSML tool calls (MODEL_SPEC §10).

Both parsers take decoded text deltas (detokenizer output, any split) and return structured deltas; feeding the
same text in any split yields the same final result. Why they look like this:

* The markers (``<think>``, ``</think>``, ``<｜DSML｜…``, BOS/EOS) are added tokens that ``skip_special_tokens``
  keeps, so they arrive as text. Each parser holds back any tail that could still grow into a marker (``</th``,
  ``\\n\\n<｜DS``) until it can decide, so markup never reaches a client (SERVING_CONVENTIONS §12, traps 3-4).
* :class:`ReasoningParser` follows the lenient vLLM ``DeepSeekV4ReasoningParser``: reasoning also ends at
  ``<｜DSML｜tool_calls>`` without ``</think>``, and a completion with neither is all reasoning (the strict
  reference would reject both). At EOS a held tail that began spelling ``｜…｜`` markup is dropped; any other
  (``</th``, ``\\n\\n``, ``<``) is flushed as text, as it may well be
  (``<think>``, ``</think>`` and ``｜DSML｜`` are single tokens, so cutting one leaves no partial text).
* :class:`ToolCallParser` matches ``encoding_dsv4.py``'s decoding byte for byte on well-formed blocks (arguments
  ``{"k": v, "k2": v2}``; ``string="true"`` values JSON-escaped, others verbatim) and is lenient where that costs
  nothing (any whitespace between tags, no ``\\n\\n`` before the block, V3.2's ``function_calls`` wrapper, raw JSON
  arguments directly inside ``invoke`` as SGLang accepts). It streams one argument fragment per completed
  parameter: a fragment is emitted only once its value is known to be valid, so the fragments of a call always
  concatenate to a prefix of valid JSON.
* Malformed DSML never leaks into content (like SGLang, unlike vLLM's fallback to raw text). The first error
  ends parsing: it is recorded in ``error``, and all later text is swallowed. Calls whose ``invoke`` closed
  cleanly before the error are kept, since a streaming client has already received them in full; the call in
  progress is dropped. A streaming client may then hold its id/name and some fragments, so a server should report
  ``error`` (SGLang sends an error event) rather than present that call as complete.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

DSML = "｜DSML｜"  # FULLWIDTH bars (U+FF5C)
THINK_START, THINK_END = "<think>", "</think>"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
BLOCK_START = "\n\n" + TOOL_CALLS_START  # how the model opens a tool block

_CONTROL = (THINK_START, THINK_END, BOS, EOS)  # dropped wherever they appear
# Anything that may become a DSML tag, with the "\n\n" the reference strips from the content before a block.
_DSML_STARTS = ("\n\n<" + DSML, "\n\n</" + DSML, "<" + DSML, "</" + DSML, DSML)
_REASONING_MARKERS = _CONTROL + _DSML_STARTS

_PARAM_CLOSE = f"</{DSML}parameter>"
_INVOKE_CLOSE = f"</{DSML}invoke>"
_WRAPPER_RE = re.compile(f"<{DSML}(tool_calls|function_calls)>")
_INVOKE_RE = re.compile(f'<{DSML}invoke\\s+name="([^"]*)"\\s*>')
_PARAM_RE = re.compile(f'<{DSML}parameter\\s+name="([^"]*)"\\s+string="(true|false)"\\s*>')


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker: it must wait for more text."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest marker occurrence (the longer one on a tie)."""
    hits = [(i, -len(m), m) for m in markers if (i := text.find(m)) >= 0]
    if not hits:
        return None
    i, _, m = min(hits)
    return i, m


def _eos_tail(held: str) -> str:
    """What a held tail becomes at EOS: one that began spelling ``｜…｜`` markup is dropped, any other is text."""
    return "" if "｜" in held else held


class ReasoningParser:
    """Splits output into (reasoning, content) deltas.

    ``thinking=True``: the prompt ended with ``<think>``, so output starts in reasoning; it ends at ``</think>``
    (dropped) or at DSML markup, normally ``\\n\\n<｜DSML｜tool_calls>``, which is passed on as content for
    :class:`ToolCallParser`; any other DSML tag ends reasoning too, so that the tool parser reports it as
    malformed instead of it leaking into reasoning. ``thinking=False``: everything is content. In both modes the
    control tokens ``<think>``, ``</think>``, BOS and EOS are dropped wherever they appear (a stray ``</think>`` at
    the start of a chat-mode answer is the common case), also inside tool arguments: they are single tokens, never
    plain text.
    """

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        out: dict[bool, list[str]] = {True: [], False: []}  # keyed by in_reasoning
        while (hit := _first(self._buf, self._markers())) is not None:
            i, marker = hit
            out[self.in_reasoning].append(self._buf[:i])
            self._buf = self._buf[i + len(marker):]
            if self.in_reasoning and marker not in (THINK_START, BOS, EOS):  # </think> or DSML markup
                self.in_reasoning = False
                if marker != THINK_END:
                    out[False].append(marker)  # the tool parser needs the markup
        keep = len(self._buf) - _held(self._buf, self._markers())
        out[self.in_reasoning].append(self._buf[:keep])
        self._buf = self._buf[keep:]
        return "".join(out[True]), "".join(out[False])

    def finish(self) -> tuple[str, str]:
        """Flushes the held tail at EOS (see :func:`_eos_tail`)."""
        tail, self._buf = _eos_tail(self._buf), ""
        return (tail, "") if self.in_reasoning else ("", tail)

    def _markers(self) -> tuple[str, ...]:
        return _REASONING_MARKERS if self.in_reasoning else _CONTROL


@dataclass
class ToolDelta:
    """One step of :class:`ToolCallParser` output.

    ``calls`` are OpenAI streaming tool-call deltas; the first for an index carries ``id``, ``type`` and
    ``function.name`` (and possibly arguments), later ones only ``function.arguments`` fragments. ``error`` is set
    on the delta where the block was found malformed.
    """
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


class _Malformed(ValueError):
    pass


@dataclass
class _Call:
    index: int
    id: str
    name: str
    arguments: str = ""
    keys: set[str] = field(default_factory=set)


def _no_constants(const: str) -> Any:
    raise ValueError(f"{const} is not JSON")  # NaN/Infinity: Python accepts them, JSON (and SGLang) do not


class ToolCallParser:
    """Extracts the DSML tool-call block from content (see the module docstring for the policies).

    ``feed`` returns the plain text before the block as ``content`` and the block as call deltas. A call is
    announced (index, id, name, ``arguments=""``) when its ``invoke`` tag is complete; then one fragment per
    completed parameter (``{"k": v`` for the first, ``, "k": v`` after) and ``}`` when it closes (``{}`` with no
    parameters); deltas of one call within one feed are merged. Only EOS may follow the block; other text there
    is swallowed and reported. Ids are ``id_prefix`` + 24 hex digits drawn from ``rng`` (pass a seeded
    ``random.Random`` for stable ids). Expects text that went through :class:`ReasoningParser` (EOS removed).
    """

    def __init__(self, id_prefix: str = "call_", rng: random.Random | None = None) -> None:
        self._id_prefix = id_prefix
        self._rng = rng if rng is not None else random.Random()
        self._state = "text"  # text -> block -> done
        self._sub = "open"  # inside the block: open, calls, args, value, json
        self._buf = ""
        self._scan = 0  # where to resume searching a value for its closing tag
        self._close_block = ""
        self._param: tuple[str, bool] = ("", True)
        self._cur: _Call | None = None
        self._calls: list[dict[str, Any]] = []
        self._announced = 0
        self.error: str | None = None

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [{"id": c["id"], "type": "function", "function": dict(c["function"])} for c in self._calls]

    @property
    def malformed(self) -> bool:
        return self.error is not None

    def feed(self, text: str) -> ToolDelta:
        delta = ToolDelta()
        self._buf += text
        if self._state == "text":
            self._scan_text(delta)
        if self._state == "block":
            try:
                self._parse_block(delta)
            except _Malformed as e:
                self._fail(str(e), delta)
        if self._state == "done":
            if self._buf.strip() and self.error is None:
                self._fail("text after the tool_calls block", delta)
            self._buf = ""
        return delta

    def finish(self) -> ToolDelta:
        delta = ToolDelta()
        if self._state == "text":
            delta.content = _eos_tail(self._buf)
        elif self._state == "block":
            self._fail("tool_calls block truncated at EOS", delta)
        self._state, self._buf = "done", ""
        return delta

    # -- plain text before the block

    def _scan_text(self, d: ToolDelta) -> None:
        i = self._buf.find(DSML)
        if i < 0:
            keep = len(self._buf) - _held(self._buf, _DSML_STARTS)
            d.content += self._buf[:keep]
            self._buf = self._buf[keep:]
            return
        start = i - 2 if self._buf.endswith("</", 0, i) else i - 1 if self._buf.endswith("<", 0, i) else i
        cut = start - 2 if self._buf.endswith("\n\n", 0, start) else start
        d.content += self._buf[:cut]
        self._buf = self._buf[start:]
        self._state = "block"

    # -- the block

    def _parse_block(self, d: ToolDelta) -> None:
        while self._state == "block":
            if self._sub in ("value", "json"):
                body = self._read_until(_PARAM_CLOSE if self._sub == "value" else _INVOKE_CLOSE)
                if body is None:
                    return
                if self._sub == "value":
                    self._add_param(body, d)
                else:
                    self._add_raw_json(body, d)
                continue
            if self._sub == "args" and self._cur is not None and not self._cur.arguments:
                stripped = self._buf.lstrip()
                if stripped.startswith("{"):
                    self._buf, self._sub, self._scan = stripped, "json", 0
                    continue
            tag = self._next_tag()
            if tag is None:
                return
            self._on_tag(tag, d)

    def _next_tag(self) -> str | None:
        """Pops the next complete ``<…>`` tag, skipping whitespace; None until one is complete."""
        self._buf = self._buf.lstrip()
        if not self._buf:
            return None
        if self._buf[0] != "<":
            raise _Malformed("unexpected text in tool_calls block")  # no excerpt: it would depend on the split
        end = self._buf.find(">")
        if end < 0:
            return None
        tag, self._buf = self._buf[:end + 1], self._buf[end + 1:]
        return tag

    def _on_tag(self, tag: str, d: ToolDelta) -> None:
        if self._sub == "open":
            if not (m := _WRAPPER_RE.fullmatch(tag)):
                raise _Malformed(f"expected {TOOL_CALLS_START}, got {tag!r}")
            self._close_block, self._sub = f"</{DSML}{m[1]}>", "calls"
        elif self._sub == "calls":
            if tag == self._close_block:
                self._state = "done"
                return
            m = _INVOKE_RE.fullmatch(tag)
            if not m or not m[1]:
                bad_invoke = tag.startswith(f"<{DSML}invoke")
                raise _Malformed("invoke without a tool name" if bad_invoke else f"unexpected tag {tag!r}")
            call_id = f"{self._id_prefix}{self._rng.getrandbits(96):024x}"
            self._cur = _Call(self._announced, call_id, m[1])
            self._announced += 1
            self._emit(d, {"index": self._cur.index, "id": call_id, "type": "function",
                           "function": {"name": m[1], "arguments": ""}})
            self._sub = "args"
        else:  # args
            assert self._cur is not None
            if tag == _INVOKE_CLOSE:
                self._close_call("}" if self._cur.arguments else "{}", d)
                return
            m = _PARAM_RE.fullmatch(tag)
            if not m or not m[1]:
                raise _Malformed(f"bad parameter tag {tag!r}")
            if m[1] in self._cur.keys:
                raise _Malformed(f"duplicate parameter {m[1]!r} in {self._cur.name!r}")
            self._param, self._sub, self._scan = (m[1], m[2] == "true"), "value", 0

    def _read_until(self, close: str) -> str | None:
        """Pops the text before ``close``; None until it arrives. Any other DSML markup first is malformed
        (a tag left unclosed), found as soon as it appears."""
        i = self._buf.find(DSML, self._scan)
        if i < 0:
            self._scan = max(0, len(self._buf) - len(DSML) + 1)
            return None
        start = i - 2  # close tags are "</" + DSML + ...
        if start >= 0 and self._buf.startswith(close, start):
            body, self._buf = self._buf[:start], self._buf[start + len(close):]
            return body
        if start >= 0 and close.startswith(self._buf[start:]):
            self._scan = i
            return None
        raise _Malformed(f"unterminated {'parameter' if close == _PARAM_CLOSE else 'invoke'} value")

    def _add_param(self, value: str, d: ToolDelta) -> None:
        assert self._cur is not None
        name, is_str = self._param
        if is_str:
            value = json.dumps(value, ensure_ascii=False)
        else:
            try:
                json.loads(value, parse_constant=_no_constants)
            except ValueError:
                raise _Malformed(f"parameter {name!r} is not a JSON literal: {value[:40]!r}") from None
        self._cur.keys.add(name)
        sep = ", " if self._cur.arguments else "{"
        self._add_args(f"{sep}{json.dumps(name, ensure_ascii=False)}: {value}", d)
        self._sub = "args"

    def _add_raw_json(self, body: str, d: ToolDelta) -> None:
        try:
            ok = isinstance(json.loads(body, parse_constant=_no_constants), dict)
        except ValueError:
            ok = False
        if not ok:
            raise _Malformed("invoke body is neither parameters nor a JSON object")
        self._close_call(body.strip(), d)

    def _close_call(self, fragment: str, d: ToolDelta) -> None:
        assert self._cur is not None
        self._add_args(fragment, d)
        c = self._cur
        self._calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
        self._cur, self._sub = None, "calls"

    def _add_args(self, fragment: str, d: ToolDelta) -> None:
        assert self._cur is not None
        self._cur.arguments += fragment
        self._emit(d, {"index": self._cur.index, "function": {"arguments": fragment}})

    @staticmethod
    def _emit(d: ToolDelta, entry: dict[str, Any]) -> None:
        """Appends a call delta, merging argument fragments into the previous delta of the same call."""
        if d.calls and d.calls[-1]["index"] == entry["index"]:
            d.calls[-1]["function"]["arguments"] += entry["function"]["arguments"]
        else:
            d.calls.append(entry)

    def _fail(self, message: str, d: ToolDelta) -> None:
        self.error = d.error = message
        self._cur, self._state, self._buf = None, "done", ""


@dataclass
class OutputDelta:
    """One step of :class:`OutputParser`: what a chat-completion chunk's delta carries."""
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


class OutputParser:
    """Reasoning then tool-call parsing, chained in the one right order, for streaming and whole completions.

    With ``tools_enabled=False`` (no tools, or ``tool_choice="none"``) a DSML block is still removed from the
    content, but its calls are not reported.
    """

    def __init__(self, thinking: bool, tools_enabled: bool, id_prefix: str = "call_",
                 rng: random.Random | None = None) -> None:
        self.thinking, self.tools_enabled = thinking, tools_enabled
        self._reasoning = ReasoningParser(thinking)
        self._tools = ToolCallParser(id_prefix, rng)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self._tools.tool_calls if self.tools_enabled else []

    @property
    def error(self) -> str | None:
        return self._tools.error

    def feed(self, text: str) -> OutputDelta:
        reasoning, content = self._reasoning.feed(text)
        return self._delta(reasoning, self._tools.feed(content))

    def finish(self) -> OutputDelta:
        reasoning, content = self._reasoning.finish()
        a, b = self._tools.feed(content), self._tools.finish()
        return self._delta(reasoning, ToolDelta(a.content + b.content, a.calls, a.error or b.error))  # b: no calls

    def _delta(self, reasoning: str, t: ToolDelta) -> OutputDelta:
        return OutputDelta(reasoning, t.content, t.calls if self.tools_enabled else [], t.error)


def parse_completion(text: str, thinking: bool, tools_enabled: bool, id_prefix: str = "call_",
                     rng: random.Random | None = None) -> dict[str, Any]:
    """Parses a whole completion with the streaming machinery (so both paths agree).

    ``reasoning_content`` is None in chat mode and a string (maybe empty) in thinking mode, since clients reject
    a missing one on multi-turn tool calls. ``finish_reason_override`` is ``"tool_calls"`` when calls were parsed;
    apply it when the engine stopped on EOS/stop (not on ``length``). ``tool_call_error`` is the malformed-DSML
    message, if any.
    """
    p = OutputParser(thinking, tools_enabled, id_prefix, rng)
    a, b = p.feed(text), p.finish()
    calls = p.tool_calls
    return {
        "reasoning_content": a.reasoning + b.reasoning if thinking else None,
        "content": a.content + b.content,
        "tool_calls": calls,
        "finish_reason_override": "tool_calls" if calls else None,
        "tool_call_error": p.error,
    }
