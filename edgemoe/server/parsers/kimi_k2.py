"""Kimi-K2 tool calls: a section of calls, each an id and its JSON arguments between dedicated tokens.

Format (Kimi-K2's chat template and its tool-call guide)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>
    {"timezone": "Europe/Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call's id is ``functions.NAME:IDX``; the function name is read from it (an id without the
``functions.`` prefix or the ``:IDX`` suffix is read too). The singular section tokens
``<|tool_call_section_begin|>`` / ``<|tool_call_section_end|>`` some outputs carry are accepted as well.
Whitespace around the tokens is allowed; malformed markup follows the rules shared by the tagged
formats (:mod:`edgemoe.server.parsers.tagged`).

Ids round-trip: Kimi's template writes a past call as ``<|tool_call_begin|>{{ tool_call.id }}...`` and a
tool result as ``## Return of {{ tool_call_id }}``, so the id a client sends back is what the model reads.
The APIs therefore give a call the id ``functions.NAME:IDX`` (:meth:`KimiK2ToolParser.api_call_id`:
the index the model wrote, unless the conversation already used that id, else the call's position in
the conversation), and ids of another form in a conversation (a client's own, or a history from
another server) are renamed to that form on the way into the template, the tool results following
(:meth:`KimiK2ToolParser.template_call_ids`). The template renders the tools itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Container

import regex

from edgemoe.server.parsers.tagged import TaggedJsonToolParser, compile_pattern

__all__ = ["KimiK2ToolParser"]

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
SECTION_BEGIN_1 = "<|tool_call_section_begin|>"  # the singular variants
SECTION_END_1 = "<|tool_call_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

_ID = regex.compile(r"(?:functions\.)?(?P<name>.+?)(?::(?P<idx>\d+))?")
_OWN = regex.compile(r"functions\.(?P<name>.+):(?P<idx>\d+)")


def _e(tag: str) -> str:
    return regex.escape(tag)


def split_id(call_id: str) -> tuple[str, int | None]:
    """``(function name, index or None)`` of a Kimi call id (``functions.NAME:IDX``, or without the
    prefix or the index)."""
    m = _ID.fullmatch(call_id.strip())
    return (m["name"], int(m["idx"]) if m["idx"] is not None else None) if m else (call_id.strip(), None)


def format_id(name: str, index: int) -> str:
    """``functions.NAME:IDX``."""
    return f"functions.{name}:{index}"


class KimiK2ToolParser(TaggedJsonToolParser):
    """Kimi-K2 (Instruct, Thinking) tool-call sections."""

    name = "kimi_k2"
    # The markers reach the parser whether or not a tokenizer marks them special (the released one does not).
    skip_special_tokens = False
    open_tags = (SECTION_BEGIN, SECTION_BEGIN_1, CALL_BEGIN)
    call_trigger = SECTION_BEGIN
    header = compile_pattern(
        rf"(?:(?:{_e(SECTION_BEGIN)}|{_e(SECTION_BEGIN_1)})\s*)?{_e(CALL_BEGIN)}\s*(?P<call_id>[^<\s]+)\s*"
        rf"{_e(ARGS_BEGIN)}\s*(?P<args>\{{)"
    )
    tail = compile_pattern(rf"\s*{_e(CALL_END)}")
    drop_after_call = (SECTION_END, SECTION_END_1)

    def decode_header(self, m) -> tuple[str, str | None]:
        written = m["call_id"]
        return split_id(written)[0], written

    @classmethod
    def forced_call(cls, name: str) -> tuple[str, str]:
        return f"{SECTION_BEGIN}{CALL_BEGIN}{format_id(name, 0)}{ARGS_BEGIN}", f"{CALL_END}{SECTION_END}"

    @classmethod
    def api_call_id(cls, name: str, written: str | None, position: int, taken: Container[str]) -> str:
        """``functions.NAME:IDX`` with the index the model wrote when that id is still free, else the first
        free index from the call's position in the conversation."""
        idx = split_id(written)[1] if written else None
        for i in itertools.chain([idx] if idx is not None else [], itertools.count(position)):
            if format_id(name, i) not in taken:
                return format_id(name, i)
        raise AssertionError("unreachable")

    @classmethod
    def template_call_ids(cls, messages: list[dict]) -> list[dict]:
        """Rename tool-call ids that are not ``functions.NAME:IDX`` (of the call's own function) to that form,
        numbered by the call's position in the conversation (an index another call holds is skipped), and
        point the tool results that answered them at the new ids."""

        def own_form(call_id, fn_name: str) -> bool:
            m = _OWN.fullmatch(call_id) if isinstance(call_id, str) else None
            return m is not None and m["name"] == fn_name

        calls_of = [m["tool_calls"] for m in messages
                    if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list)]
        taken = {tc.get("id") for calls in calls_of for tc in calls if isinstance(tc, dict)}
        out, renamed, position = [], {}, 0
        for m in messages:
            if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
                calls = []
                for tc in m["tool_calls"]:
                    fn = tc.get("function") if isinstance(tc, dict) else None
                    fn_name = fn.get("name") if isinstance(fn, dict) else None
                    if isinstance(fn_name, str) and not own_form(tc.get("id"), fn_name):
                        new = next(format_id(fn_name, i) for i in itertools.count(position)
                                   if format_id(fn_name, i) not in taken)
                        taken.add(new)
                        if isinstance(tc.get("id"), str):
                            renamed[tc["id"]] = new
                        tc = {**tc, "id": new}
                    calls.append(tc)
                    position += 1
                m = {**m, "tool_calls": calls}
            elif m.get("role") == "tool" and m.get("tool_call_id") in renamed:
                m = {**m, "tool_call_id": renamed[m["tool_call_id"]]}
            out.append(m)
        return out
