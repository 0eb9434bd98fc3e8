"""GLM-4.5 / 4.6 / 4.7 tool calls: a function name and XML-like key/value pairs in ``<tool_call>``.

Format (the GLM-4.5 chat template; GLM-4.7's drops the newlines)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The template writes a string argument as its raw text and any other value as JSON
(``v | tojson if v is not string else v``), so a value is read back as a string when its tool's JSON
schema declares it ``string``, and otherwise as JSON when it parses (else as the raw text), as the
reference parser in vLLM (``glm45``) does. The arguments object streams as it is read: a key once
its ``<arg_value>`` opens, a string value piece by piece, any other value when its ``</arg_value>``
arrives. A call without arguments (``<tool_call>NAME</tool_call>``) has ``{}``. Several calls may
follow one another (whitespace between them is dropped).

Malformed output is never lost: a ``<tool_call>`` not followed by a name and ``<arg_key>`` or
``</tool_call>`` is answer text; markup other than the next key or the end inside a call ends the
call there, and the rest is answer text; a missing ``</arg_value>`` before ``</tool_call>`` is
tolerated; output cut inside a call (``max_tokens``) keeps the arguments read so far.
"""

from __future__ import annotations

import json
from typing import Any

from edgemoe.server.parsers.base import ParseEvent, find_first, partial_suffix, text_event
from edgemoe.server.parsers.tagged import ToolParser, compile_pattern

__all__ = ["Glm45ToolParser"]

_HEADER = compile_pattern(r"<tool_call>\s*(?P<name>[^\s<>]+)\s*(?P<end><arg_key>|</tool_call>)")
_KEY = compile_pattern(r"\s*<arg_key>(?P<key>[^<]*)</arg_key>\s*<arg_value>")
_CALL_END = compile_pattern(r"\s*</tool_call>")
_VALUE_ENDS = ("</arg_value>", "</tool_call>")


class Glm45ToolParser(ToolParser):
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`` (GLM-4.5/4.6/4.7).

    Args:
        tools: the request's tools (OpenAI shape); their JSON schemas decide which values are strings.
    """

    name = "glm45"
    skip_special_tokens = False  # the markup reaches the parser whether or not the tokenizer marks it special
    open_tags = ("<tool_call>",)
    _CONTENT, _HEADER, _ARGS, _VALUE = range(4)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = self._CONTENT
        self._fn = ""
        self._nargs = 0
        self._string_value = False  # the open value streams as a JSON string

    def _is_string(self, key: str) -> bool:
        """Whether the schema of the current function declares ``key`` a string (only)."""
        for t in self.tools:
            fn = t.get("function", t) if isinstance(t, dict) else {}
            if isinstance(fn, dict) and fn.get("name") == self._fn:
                prop = ((fn.get("parameters") or {}).get("properties") or {}).get(key) or {}
                kind = prop.get("type") if isinstance(prop, dict) else None
                kinds = set(kind) if isinstance(kind, list) else {kind}
                return kinds - {"null"} == {"string"}
        return False

    @staticmethod
    def _value_json(raw: str) -> str:
        """A non-string value: its JSON when it parses, else the raw text as a JSON string."""
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        return json.dumps(value, ensure_ascii=False)

    def _step(self, out: list[ParseEvent]) -> bool:
        s, buf = self._state, self._buf
        if s == self._CONTENT:
            return self._content(out)
        if s == self._HEADER:
            m = _HEADER.match(buf, partial=True)
            if m is not None and m.partial:
                return False
            if m is None:  # not a call: the tag is text
                self._tag_is_text(out)
                return True
            self._fn, self._nargs = m["name"], 0
            out.append(ParseEvent("tool_call", "", self._index, self._fn))
            self._ws, self._buf, self._state = "", buf[m.start("end"):], self._ARGS
            return True
        if s == self._ARGS:
            end = _CALL_END.match(buf, partial=True)
            if end is not None and not end.partial:
                out.append(self._args_event("}" if self._nargs else "{}"))
                self._buf = buf[end.end():]
                self._end_call(after=True)
                return True
            key = _KEY.match(buf, partial=True)
            if key is not None and not key.partial:
                name = key["key"].strip()
                self._string_value = self._is_string(name)
                sep = ", " if self._nargs else "{"
                quote = '"' if self._string_value else ""
                out.append(self._args_event(f"{sep}{json.dumps(name, ensure_ascii=False)}: {quote}"))
                self._nargs += 1
                self._buf, self._state = buf[key.end():], self._VALUE
                return True
            if (end is not None and end.partial) or (key is not None and key.partial):
                return False
            # Neither another argument nor the end of the call: the call ends here, the rest is text.
            out.append(self._args_event("}" if self._nargs else "{}"))
            self._end_call(after=False)
            return True
        # _VALUE
        i, tag = find_first(buf, _VALUE_ENDS)
        if i < 0:
            if self._string_value:  # stream what cannot be the start of an end tag
                n = len(buf) - partial_suffix(buf, _VALUE_ENDS)
                if n:
                    out.append(self._args_event(json.dumps(buf[:n], ensure_ascii=False)[1:-1]))
                    self._buf = buf[n:]
            return False
        value = buf[:i]
        text = json.dumps(value, ensure_ascii=False)[1:] if self._string_value else self._value_json(value)
        out.append(self._args_event(text))
        self._buf = buf[i + len(tag):]
        if tag == "</tool_call>":  # </arg_value> missing: the value ends with the call
            out.append(self._args_event("}"))
            self._end_call(after=True)
        else:
            self._state = self._ARGS
        return True

    def _finish_call(self, out: list[ParseEvent]) -> None:
        s, buf = self._state, self._buf
        if s == self._HEADER:
            out += text_event("content", self._ws + buf)
        elif s == self._ARGS:  # cut between arguments: a partial tag is markup
            out.append(self._args_event("}" if self._nargs else "{}"))
        else:  # cut inside a value: keep it (as OpenAI keeps partial arguments)
            text = json.dumps(buf, ensure_ascii=False)[1:] if self._string_value else self._value_json(buf)
            out.append(self._args_event(text + "}"))
