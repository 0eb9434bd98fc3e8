"""gpt-oss "Harmony" output: messages on channels, read as reasoning, answer text and tool calls.

Format (OpenAI Harmony response format; the generation prompt ends with ``<|start|>assistant``)::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
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
from typing import ClassVar

from edgemoe.server.parsers.base import JsonArgs, ParseEvent, find_first, partial_suffix, text_event
from edgemoe.server.parsers.tagged import ToolParser

__all__ = ["HarmonyParser"]

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
        self._buf = ""
        self._kind = "content"
        self._args: JsonArgs | None = None
        self._index = 0
        self.saw_reasoning = False

    @classmethod
    def forced_call(cls, name: str) -> tuple[str, str]:
        return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}", ""

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while self._step(out):
            pass
        return out

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
            out.append(ParseEvent("tool_call", valid, self._index))
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
