"""gpt-oss "Harmony" output: messages on channels, read as reasoning, answer text and tool calls.

Format (OpenAI Harmony response format; the generation prompt ends with ``<|start|>assistant``)::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>
    ... or ...
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

``analysis`` is reasoning, ``final`` (and ``commentary`` without a recipient, a preamble) is answer
text, and a message addressed ``to=functions.NAME`` (in the header's role or channel part) is a tool
call whose body is the JSON arguments. The markers are special tokens, so this parser needs the output
detokenized with ``skip_special_tokens=False`` (:attr:`HarmonyParser.skip_special_tokens`).
``<|call|>`` and ``<|return|>`` end generation and so never reach the text. Text outside any message
header is answer text.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from edgemoe.server.parsers.base import JsonArgs, ParseEvent, find_first, partial_suffix, text_event
from edgemoe.server.parsers.tagged import ToolParser

__all__ = ["HarmonyParser", "template_history"]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
_HEADER_STARTS = (START, CHANNEL)
_BODY_ENDS = (END, RETURN, CALL, START, CHANNEL)
_MAX_HEADER = 512  # characters; a longer "header" without <|message|> is plain text
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyParser(ToolParser):
    """Reasoning, answer text and tool calls of gpt-oss (both ``--reasoning-parser`` and
    ``--tool-call-parser`` ``harmony``)."""

    name = "harmony"
    skip_special_tokens: ClassVar[bool] = False
    _HEADER, _BODY, _RAW = range(3)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = self._HEADER
        self._kind = "content"
        self._args: JsonArgs | None = None
        self.saw_reasoning = False

    @classmethod
    def forced_call(cls, name: str) -> tuple[str, str]:
        return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}", ""

    def _step(self, out: list[ParseEvent]) -> bool:
        buf = self._buf
        if self._state == self._HEADER:
            i = buf.find(MESSAGE)
            if i < 0 or i > _MAX_HEADER:
                head = buf.lstrip()
                maybe = any(head.startswith(t) or t.startswith(head) for t in _HEADER_STARTS)
                if maybe and len(buf) <= _MAX_HEADER:
                    return False
                self._state = self._RAW
                return True
            self._open(buf[:i], out)
            self._buf, self._state = buf[i + len(MESSAGE):], self._BODY
            return True
        tags = _BODY_ENDS if self._state == self._BODY else _HEADER_STARTS
        j, tag = find_first(buf, tags)
        end = j if j >= 0 else len(buf) - partial_suffix(buf, tags)
        self._emit(buf[:end], out)
        if j < 0:
            self._buf = buf[end:]
            return False
        self._close(out)
        skip = len(tag) if tag in (END, RETURN, CALL) else 0
        self._buf, self._state = buf[j + skip:], self._HEADER
        return True

    def _open(self, header: str, out: list[ParseEvent]) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        channel = channel.group(1) if channel else ""
        if recipient:
            name = recipient.group(1)
            name = name.removeprefix("functions.")
            out.append(ParseEvent("tool_call", "", self._index, name))
            self._kind, self._args = "tool_call", JsonArgs()
        elif channel == "analysis":
            self._kind, self.saw_reasoning = "reasoning", True
        else:
            self._kind = "content"

    def _emit(self, text: str, out: list[ParseEvent]) -> None:
        if not text:
            return
        if self._state == self._RAW or self._kind != "tool_call":
            out += text_event("content" if self._state == self._RAW else self._kind, text)
            return
        if self._args.broken or self._args.complete:
            out += text_event("content", text if self._args.broken else text.strip())
            return
        valid, rest = self._args.feed(text)
        if valid:
            out.append(self._args_event(valid))
        if rest:
            out += text_event("content", rest if self._args.broken else rest.strip())

    def _close(self, out: list[ParseEvent]) -> None:
        if self._state == self._BODY and self._kind == "tool_call":
            self._index += 1
        self._kind, self._args = "content", None

    def finish(self) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        if self._state == self._HEADER:  # a header cut by max_tokens is markup, dropped; other text is answer text
            if not self._buf.lstrip().startswith(_HEADER_STARTS):
                out += text_event("content", self._buf)
        else:
            self._emit(self._buf, out)
        self._buf = ""
        self._close(out)
        return out


def template_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped chat history as gpt-oss's released chat template expects it.

    The template renders an assistant message's reasoning from ``thinking`` (here: ``reasoning_content``),
    one tool call per assistant message (``tool_calls[0]``), and names each ``tool`` result after the most
    recent call; it refuses a tool-call message with both ``content`` and ``thinking``. So:

    - ``reasoning_content`` becomes ``thinking``;
    - an assistant message with ``n > 1`` tool calls becomes ``n`` messages of one call each, each followed
      by its results (the ``tool`` messages whose ``tool_call_id`` is that call's ``id``; results without a
      matching id keep their order), as Harmony itself alternates calls and results; the reasoning stays
      with the first call;
    - a tool-call message with both text and reasoning keeps the reasoning (the model's analysis, which
      Harmony carries across tool calls) and drops the text (a commentary preamble the template cannot
      render).

    Messages are not modified in place.
    """
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.get("role") != "assistant":
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if k != "reasoning_content"}
        if messages[i - 1].get("reasoning_content") is not None:
            m["thinking"] = messages[i - 1]["reasoning_content"]
        calls = m.pop("tool_calls", None) or []
        if not calls:
            out.append(m)
            continue
        if m.get("thinking") and m.get("content"):
            m["content"] = None
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        ids = [c.get("id") for c in calls]
        by_id = {c_id: [r for r in results if r.get("tool_call_id") == c_id] for c_id in ids if c_id}
        matched = {id(r) for rs in by_id.values() for r in rs}
        unmatched = [r for r in results if id(r) not in matched]
        for j, call in enumerate(calls):
            turn = {**m, "tool_calls": [call]} if j == 0 else {"role": "assistant", "tool_calls": [call]}
            out.append(turn)
            mine = by_id.get(ids[j], []) if ids[j] else []
            if not mine and unmatched:
                mine = [unmatched.pop(0)]
            out.extend(mine)
        out.extend(unmatched)
    return out
