"""Shared pieces of the output parsers: the event type, the parser interface, chaining, collection.

A parser turns the model's output text, fed in arbitrary pieces, into an ordered list of
:class:`ParseEvent` (reasoning text, answer text, tool-call pieces). Every parser here makes its
decisions from the text prefix alone, so the events it produces (joined per kind) do not depend on
where the pieces were cut: streaming and non-streaming responses agree. Text that does not parse as a
tool call is returned as answer text, never dropped.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from edgemoe.server import json_prefix

__all__ = [
    "ChainParser",
    "JsonArgs",
    "OutputParser",
    "ParseEvent",
    "ParsedOutput",
    "ToolCall",
    "collect",
    "partial_suffix",
]

Kind = Literal["reasoning", "content", "tool_call"]


@dataclass(frozen=True)
class ParseEvent:
    """One piece of parsed output.

    Attributes:
        kind: ``"reasoning"`` (thinking text), ``"content"`` (answer text) or ``"tool_call"``.
        text: the text piece; for ``tool_call`` a fragment of the call's JSON arguments.
        index: for ``tool_call``: the call's position in this response (0, 1, ...).
        name: for ``tool_call``: the function name, set on the call's first event only.
        call_id: for ``tool_call``: the id the model wrote for the call (formats that have one, e.g.
            Kimi-K2's ``functions.NAME:IDX``), on the call's first event only; ``None`` otherwise.
    """

    kind: Kind
    text: str = ""
    index: int | None = None
    name: str | None = None
    call_id: str | None = None


def text_event(kind: Kind, text: str) -> list[ParseEvent]:
    """``[ParseEvent(kind, text)]`` or ``[]`` for empty text."""
    return [ParseEvent(kind, text)] if text else []


class OutputParser(ABC):
    """Incremental parser of one response: ``feed(delta)`` any number of times, then ``finish()``.

    ``saw_reasoning`` is True once a reasoning block was opened (even an empty one).
    """

    saw_reasoning: bool = False

    @abstractmethod
    def feed(self, text: str) -> list[ParseEvent]:
        """Add output text; return the events that are now certain (text that may still turn out to be
        markup, e.g. half of a tag, is held back)."""

    @abstractmethod
    def finish(self) -> list[ParseEvent]:
        """End of output: release what was held back (an unfinished tag is plain text)."""


class ChainParser(OutputParser):
    """A reasoning parser followed by a tool-call parser that sees only the answer text."""

    def __init__(self, reasoning: OutputParser, tools: OutputParser):
        self.reasoning, self.tools = reasoning, tools

    @property
    def saw_reasoning(self) -> bool:  # type: ignore[override]
        return self.reasoning.saw_reasoning

    def _route(self, events: list[ParseEvent]) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        for ev in events:
            out.extend(self.tools.feed(ev.text) if ev.kind == "content" else [ev])
        return out

    def feed(self, text: str) -> list[ParseEvent]:
        return self._route(self.reasoning.feed(text))

    def finish(self) -> list[ParseEvent]:
        return self._route(self.reasoning.finish()) + self.tools.finish()


class PassThrough(OutputParser):
    """No markup: all text is answer text."""

    def feed(self, text: str) -> list[ParseEvent]:
        return text_event("content", text)

    def finish(self) -> list[ParseEvent]:
        return []


@dataclass
class ToolCall:
    """A complete (or, when output was cut, partial) tool call of a whole response (``call_id``: the id
    the model wrote, see :class:`ParseEvent`)."""

    index: int
    name: str
    arguments: str
    call_id: str | None = None


@dataclass
class ParsedOutput:
    """A whole response: ``reasoning`` (None when there was none), ``content`` (None when empty and
    there is reasoning or a tool call), ``tool_calls``."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def collect(events: list[ParseEvent], saw_reasoning: bool = False) -> ParsedOutput:
    """Join events into a :class:`ParsedOutput`.

    Args:
        events: all events of a response, in order.
        saw_reasoning: report ``reasoning=""`` instead of ``None`` when no reasoning text came (the
            output opened a think block that stayed empty).
    """
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls: dict[int, ToolCall] = {}
    for e in events:
        if e.kind == "tool_call":
            call = calls.setdefault(e.index, ToolCall(e.index, e.name or "", "", e.call_id))
            call.arguments += e.text
    has_reasoning = bool(reasoning) or saw_reasoning
    return ParsedOutput(
        reasoning=reasoning if has_reasoning else None,
        content=content if content or not (has_reasoning or calls) else None,
        tool_calls=[calls[i] for i in sorted(calls)],
    )


def partial_suffix(text: str, tags: tuple[str, ...] | list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def find_first(text: str, tags: tuple[str, ...] | list[str], start: int = 0) -> tuple[int, str | None]:
    """Earliest occurrence of any tag at or after ``start``: ``(index, tag)``, or ``(-1, None)``."""
    best, which = -1, None
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, tag
    return best, which


class JsonArgs:
    """Streams one JSON object (a tool call's arguments) character by character.

    ``feed(text) -> (valid, rest)``: ``valid`` is the part that keeps the arguments a JSON prefix;
    ``rest`` is ``None`` while the object is open, else the text after the object's last character
    (or, on a character that breaks JSON, the text from that character: see :attr:`broken`).
    """

    def __init__(self):
        self.state = json_prefix.initial(top_object=True)
        self.broken = False

    @property
    def complete(self) -> bool:
        return json_prefix.is_complete(self.state)

    def feed(self, text: str) -> tuple[str, str | None]:
        for i, ch in enumerate(text):
            nxt = json_prefix.step(self.state, ch)
            if nxt is None:
                self.broken = True
                return text[:i], text[i:]
            self.state = nxt
            if json_prefix.is_complete(nxt):
                return text[: i + 1], text[i + 1 :]
        return text, None


def dumps_args(value) -> str:
    """Tool-call arguments as compact-but-readable JSON (``ensure_ascii=False``)."""
    return json.dumps(value, ensure_ascii=False)
