"""The shared state machine of tool-call formats that wrap JSON arguments in tags (Qwen3, DeepSeek-V3).

A call is ``open tag + header (function name) + JSON object (arguments) + tail``. The header and tail
are regular expressions matched with the ``regex`` module's *partial* matching, so a header cut
anywhere is recognized as "maybe, wait" and a text that can no longer become a header is released as
plain text at once. The arguments stream character by character while they remain a JSON prefix
(:class:`~edgemoe.server.parsers.base.JsonArgs`).

Whitespace between the answer text and a call, and between calls, is dropped (chat templates put it
back when they render the history). Malformed output never disappears:

- a header that does not parse: the open tag and what follows are answer text (formats with a
  closing tag first try the whole ``open ... close`` body as one JSON object, see ``close_tag``);
- arguments that stop being JSON after the call was announced: the call keeps the valid prefix and
  the rest is answer text;
- a tail that does not match: the call is complete and the tail is answer text;
- output cut inside the arguments (``max_tokens``): the call keeps its partial arguments; cut inside
  a header that could still have become a call, the markup is dropped (it is not answer text).

:class:`ToolParser`, the base of every tool-call parser, holds what their state machines share: the
``feed`` loop, answer text between calls, the end of a call and the end of output.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Container
from typing import Any, ClassVar

import regex

from edgemoe.server.parsers.base import (
    JsonArgs,
    OutputParser,
    ParseEvent,
    dumps_args,
    find_first,
    partial_suffix,
    text_event,
)

__all__ = ["TaggedJsonToolParser", "ToolParser"]


class ToolParser(OutputParser):
    """Base of the tool-call parsers.

    Args:
        tools: the request's tools (OpenAI ``[{"type": "function", "function": {...}}]`` shape);
            some formats need their JSON schemas to type argument values.

    Class attributes:
        name: registry name (``--tool-call-parser``).
        skip_special_tokens: the format's markers survive detokenization with special tokens skipped.
        call_trigger: the text every call starts with, when answer text cannot contain it otherwise
            (``strict`` tools under ``tool_choice: auto`` are constrained from there on; ``None``: not
            constrained in that mode).
    """

    name: ClassVar[str] = ""
    skip_special_tokens: ClassVar[bool] = True
    call_trigger: ClassVar[str | None] = None

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self._buf = ""  # text fed and not yet parsed
        self._ws = ""  # whitespace held between answer text and a possible call
        self._after_call = False  # a call just ended: whitespace and ``drop_after_call`` markers go
        self._index = 0  # the position of the next call in this response

    @classmethod
    def forced_call(cls, name: str) -> tuple[str, str] | None:
        """``(prefix, suffix)`` around the JSON arguments of a call to ``name`` (structured output of
        ``tool_choice: required`` / a named function; the prefix starts with :attr:`call_trigger` when
        that is set), or ``None`` when the format's arguments are not one JSON object."""
        return None

    @classmethod
    def tools_system_prompt(cls, tools: list[dict]) -> str | None:
        """Tool instructions for chat templates that do not render ``tools`` themselves."""
        return None

    @classmethod
    def history_markup(cls, tool_calls: list[dict]) -> str | None:
        """The model's own text for past ``tool_calls`` (OpenAI shape), for families whose chat
        template cannot render them; ``None`` when the template does it."""
        return None

    @classmethod
    def api_call_id(cls, name: str, written: str | None, position: int, taken: Container[str]) -> str | None:
        """The id the APIs give a call, for formats whose chat template renders past calls by their id and
        whose model was trained on ids of its own form; ``None`` (the default): a random id.

        Args:
            name: the function name.
            written: the id the model wrote (:attr:`ParseEvent.call_id`), if any.
            position: the call's position in the conversation (calls of earlier turns first, 0-based).
            taken: ids already used in the conversation (and in this response); the result is not one.
        """
        return None

    @classmethod
    def template_call_ids(cls, messages: list[dict]) -> list[dict]:
        """The conversation with its past tool-call ids in the form the chat template expects, the tool
        results' ``tool_call_id`` following (default: as sent)."""
        return messages

    # -------------------------------------------------------------- the machine
    # Subclasses are state machines over ``_buf``: they set ``_state`` and define ``_step``.

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while self._step(out):
            pass
        return out

    @abstractmethod
    def _step(self, out: list[ParseEvent]) -> bool:
        """Advance as far as the buffer allows, appending events to ``out``; True to run again (the state
        changed)."""

    def _args_event(self, text: str) -> ParseEvent:
        """A piece ``text`` of the current call's JSON arguments."""
        return ParseEvent("tool_call", text, self._index)

    # -------------------------------------------------------------- answer text between calls
    # Subclasses that find calls in answer text (all but Harmony) define ``_CONTENT`` (the state of answer
    # text, where they start) and ``_HEADER`` (the state that reads a call's header), set the tags below
    # and implement ``_finish_call``; ``_ws`` and ``_after_call`` (set in ``__init__``) are this part's.
    open_tags: ClassVar[tuple[str, ...]] = ()
    drop_after_call: ClassVar[tuple[str, ...]] = ()

    def _content(self, out: list[ParseEvent]) -> bool:
        """Emit answer text up to the next open tag (held back while it may be a tag's prefix);
        returns whether a call starts (state moved to ``_HEADER``)."""
        buf = self._buf
        if self._after_call:
            stripped = buf.lstrip()
            for tag in self.drop_after_call:
                if stripped.startswith(tag):
                    self._buf = stripped[len(tag):]
                    return True
            if not stripped or partial_suffix(stripped, self.drop_after_call) == len(stripped):
                return False  # only whitespace or a possible marker so far
            buf = stripped
            self._after_call = False
        i, _ = find_first(buf, self.open_tags)
        if i >= 0:
            before = self._ws + buf[:i]
            text = before.rstrip()
            out += text_event("content", text)
            self._ws, self._buf, self._state = before[len(text):], buf[i:], self._HEADER
            return True
        hold = partial_suffix(buf, self.open_tags)
        body = self._ws + buf[: len(buf) - hold]
        text = body.rstrip()
        out += text_event("content", text)
        self._ws, self._buf = body[len(text):], buf[len(buf) - hold:]
        return False

    def _open_tag(self) -> str:
        """The open tag the buffer starts with (in the ``_HEADER`` state)."""
        return next(t for t in self.open_tags if self._buf.startswith(t))

    def _tag_is_text(self, out: list[ParseEvent]) -> None:
        """The header does not parse: emit the open tag (after the held-back whitespace) as answer text
        and read answer text again from the character after it."""
        tag = self._open_tag()
        out += text_event("content", self._ws + tag)
        self._ws, self._buf, self._state = "", self._buf[len(tag):], self._CONTENT

    def _end_call(self, after: bool) -> None:
        """The current call is complete; back to answer text. ``after``: the call's markup closed
        properly, so whitespace and ``drop_after_call`` markers right after it are dropped."""
        self._index += 1
        self._state = self._CONTENT
        self._after_call = after

    def finish(self) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        if self._state == self._CONTENT:
            buf = self._buf
            out += text_event("content", buf.strip() if self._after_call else self._ws + buf)
        else:
            self._finish_call(out)
        self._state, self._buf, self._ws = self._CONTENT, "", ""
        return out

    def _finish_call(self, out: list[ParseEvent]) -> None:
        """End of output in a state other than ``_CONTENT`` (inside a call's markup): append what the
        format keeps of it to ``out`` (default: nothing, the markup is dropped)."""


class TaggedJsonToolParser(ToolParser):
    """Generic parser for ``open tag + header + JSON arguments + tail`` formats.

    Subclasses set:
        open_tags: texts that start a call in answer text.
        header: compiled ``regex`` pattern matched from the open tag; group ``name`` (or ``name2``)
            is the function name, group ``args`` the arguments' opening ``{``.
        tail: compiled pattern matched right after the arguments' closing ``}``.
        drop_after_call: structural markers dropped when only whitespace separates them from a call.
        close_tag: when set, a header that does not parse falls back to reading the whole body up to
            this tag as one JSON object ``{"name": ..., "arguments": ...}``.
    """

    header: ClassVar[Any] = None
    tail: ClassVar[Any] = None
    close_tag: ClassVar[str | None] = None

    _CONTENT, _HEADER, _ARGS, _TAIL, _BODY = range(5)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = self._CONTENT
        self._args: JsonArgs | None = None

    @staticmethod
    def decode_name(raw: str) -> str:
        """The function name from the header's ``name`` group."""
        return raw.strip()

    def decode_header(self, m) -> tuple[str, str | None]:
        """``(function name, the id the model wrote or None)`` from a matched header (default: the name
        from the ``name`` / ``name2`` group through :meth:`decode_name`, no id)."""
        raw = m.groupdict().get("name") or m.groupdict().get("name2") or ""
        return self.decode_name(raw), None

    # ------------------------------------------------------------------ the machine

    def _step(self, out: list[ParseEvent]) -> bool:
        s, buf = self._state, self._buf
        if s == self._CONTENT:
            return self._content(out)
        if s == self._HEADER:
            m = self.header.match(buf, partial=True)
            if m is not None and m.partial:
                return False
            if m is None:
                if self.close_tag is not None:
                    self._state = self._BODY
                    return True
                self._tag_is_text(out)
                return True
            name, call_id = self.decode_header(m)
            out.append(ParseEvent("tool_call", "", self._index, name, call_id))
            self._ws, self._buf, self._state, self._args = "", buf[m.start("args"):], self._ARGS, JsonArgs()
            return True
        if s == self._ARGS:
            valid, rest = self._args.feed(buf)
            if valid:
                out.append(self._args_event(valid))
            if rest is None:
                self._buf = ""
                return False
            self._buf = rest
            if self._args.broken:
                self._end_call(after=False)
            else:
                self._state = self._TAIL
            return True
        if s == self._TAIL:
            m = self.tail.match(buf, partial=True)
            if m is not None and m.partial:
                return False
            if m is None:
                self._end_call(after=False)
            else:
                self._buf = buf[m.end():]
                self._end_call(after=True)
            return True
        # _BODY: a header that did not parse; try the whole body up to the close tag as JSON.
        j = buf.find(self.close_tag)
        if j < 0:
            return False
        tag = self._open_tag()
        call = _whole_call(buf[len(tag):j])
        end = j + len(self.close_tag)
        if call is None:
            out += text_event("content", self._ws + buf[:end])
            self._ws, self._buf, self._state = "", buf[end:], self._CONTENT
        else:
            out.append(ParseEvent("tool_call", call[1], self._index, call[0]))
            self._buf = buf[end:]
            self._ws = ""
            self._end_call(after=True)
        return True

    def _end_call(self, after: bool) -> None:
        super()._end_call(after)
        self._args = None

    def _finish_call(self, out: list[ParseEvent]) -> None:
        if self._state == self._BODY:
            out += text_event("content", self._ws + self._buf)
        # _HEADER: a call cut before its arguments (max_tokens) is dropped, not answer text; _ARGS: cut
        # inside the arguments, the call keeps what it has; _TAIL: a partial tail is markup.


def _whole_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` from a ``{"name": ..., "arguments": {...}}`` body, else ``None``."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], dumps_args(args)


def compile_pattern(pattern: str):
    """Compile a header/tail pattern (``regex`` module, DOTALL)."""
    return regex.compile(pattern, regex.DOTALL)
