"""Qwen3 / Hermes tool calls: one JSON object per call inside ``<tool_call> ... </tool_call>``.

Format (Qwen3 chat template, Qwen2.5, Hermes-2-Pro, QwQ)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls follow one another (parallel calls). Arguments stream as soon as the
``{"name": ..., "arguments": `` header is complete; a body whose keys come in another order, or whose
``arguments`` is a JSON-encoded string, is read whole at ``</tool_call>``.
"""

from __future__ import annotations

import json

from edgemoe.server.parsers.tagged import TaggedJsonToolParser, compile_pattern

__all__ = ["Qwen3ToolParser"]


class Qwen3ToolParser(TaggedJsonToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen3, Hermes)."""

    name = "qwen3"
    open_tags = ("<tool_call>",)
    call_trigger = "<tool_call>"
    header = compile_pattern(
        r'<tool_call>\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?P<args>\{)'
    )
    tail = compile_pattern(r"\s*\}\s*</tool_call>")
    close_tag = "</tool_call>"

    @staticmethod
    def decode_name(raw: str) -> str:
        try:
            return json.loads(f'"{raw}"')
        except ValueError:
            return raw

    @classmethod
    def forced_call(cls, name: str) -> tuple[str, str]:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ', "}\n</tool_call>"
