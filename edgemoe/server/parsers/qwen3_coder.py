"""Qwen3-Coder tool calls: XML-like functions and parameters.

Format (the Qwen3-Coder chat template)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; they become JSON values by the type their tool's JSON schema declares
(``integer``/``number``/``boolean``/``null``/``object``/``array``; anything else, or a value that
does not convert, stays a string), as the reference parser in vLLM does. The arguments object streams
one parameter at a time. A missing ``</parameter>`` is tolerated when the next ``<parameter=`` or
``</function>`` follows. Output cut inside a call's header (``max_tokens``) drops that markup.
"""

from __future__ import annotations

import json
from typing import Any

from edgemoe.server.parsers.base import ParseEvent, find_first
from edgemoe.server.parsers.tagged import ToolParser, compile_pattern

__all__ = ["Qwen3CoderToolParser"]

_HEADER = compile_pattern(r"(?:<tool_call>\s*)?<function=(?P<name>[^>\n]+)>")
_PARAM = compile_pattern(r"\s*<parameter=(?P<name>[^>\n]+)>")
_FUNC_END = compile_pattern(r"\s*</function>")
_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>")


class Qwen3CoderToolParser(ToolParser):
    """``<function=NAME><parameter=KEY>value</parameter></function>`` (Qwen3-Coder)."""

    name = "qwen3_coder"
    open_tags = ("<tool_call>", "<function=")
    drop_after_call = ("</tool_call>",)
    _CONTENT, _HEADER, _PARAMS, _VALUE = range(4)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = self._CONTENT
        self._fn = ""
        self._param = ""
        self._nparams = 0

    def _schema_type(self, param: str) -> Any:
        for t in self.tools:
            fn = t.get("function", t) if isinstance(t, dict) else {}
            if fn.get("name") == self._fn:
                prop = ((fn.get("parameters") or {}).get("properties") or {}).get(param) or {}
                return prop.get("type")
        return None

    def _convert(self, param: str, raw: str) -> Any:
        value = raw.removeprefix("\n")
        value = value.removesuffix("\n")
        kinds = self._schema_type(param)
        kinds = kinds if isinstance(kinds, list) else [kinds]
        v = value.strip()
        for kind in kinds:
            try:
                if kind == "integer":
                    return int(v)
                if kind == "number":
                    f = float(v)
                    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
                if kind == "boolean" and v.lower() in ("true", "false"):
                    return v.lower() == "true"
                if kind == "null" and v.lower() in ("null", "none"):
                    return None
                if kind in ("object", "array"):
                    return json.loads(v)
            except ValueError:
                continue
        return value

    def _step(self, out: list[ParseEvent]) -> bool:
        s, buf = self._state, self._buf
        if s == self._CONTENT:
            return self._content(out)
        if s == self._HEADER:
            m = _HEADER.match(buf, partial=True)
            if m is not None and m.partial:
                return False
            if m is None:
                self._tag_is_text(out)
                return True
            self._fn, self._nparams = m["name"].strip(), 0
            out.append(ParseEvent("tool_call", "", self._index, self._fn))
            self._ws, self._buf, self._state = "", buf[m.end():], self._PARAMS
            return True
        if s == self._PARAMS:
            m = _FUNC_END.match(buf, partial=True)
            if m is not None and not m.partial:
                out.append(self._args_event("}" if self._nparams else "{}"))
                self._buf = buf[m.end():]
                self._end_call(after=True)
                return True
            p = _PARAM.match(buf, partial=True)
            if p is not None and not p.partial:
                self._param, self._buf, self._state = p["name"].strip(), buf[p.end():], self._VALUE
                return True
            if (m is not None and m.partial) or (p is not None and p.partial):
                return False
            # Neither a parameter nor the end of the function: close the call, the rest is text.
            out.append(self._args_event("}" if self._nparams else "{}"))
            self._end_call(after=False)
            return True
        # _VALUE
        i, tag = find_first(buf, _VALUE_ENDS)
        if i < 0:
            return False
        value = self._convert(self._param, buf[:i])
        key = json.dumps(self._param, ensure_ascii=False)
        sep = ", " if self._nparams else "{"
        out.append(self._args_event(f"{sep}{key}: {json.dumps(value, ensure_ascii=False)}"))
        self._nparams += 1
        self._buf = buf[i + len(tag):] if tag == "</parameter>" else buf[i:]
        self._state = self._PARAMS
        return True

    def _finish_call(self, out: list[ParseEvent]) -> None:
        s, buf = self._state, self._buf
        if s == self._VALUE:  # cut inside a value: keep it (as OpenAI keeps partial arguments)
            value = self._convert(self._param, buf)
            key = json.dumps(self._param, ensure_ascii=False)
            sep = ", " if self._nparams else "{"
            out.append(self._args_event(f"{sep}{key}: {json.dumps(value, ensure_ascii=False)}}}"))
        elif s == self._PARAMS:
            out.append(self._args_event("}" if self._nparams else "{}"))
        # _HEADER: a call cut inside its header (max_tokens) is dropped, not answer text.
