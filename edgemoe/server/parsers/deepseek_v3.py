"""DeepSeek-V3 tool calls, written with the model's dedicated tokens.

Format (the DeepSeek-V3 chat template)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1's shorter ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` is read too.
These tokens are not special tokens in the tokenizer, so they survive detokenization. The official
V3 template does not render ``tools``; :meth:`tools_system_prompt` supplies the instructions then.
Its branch for assistant tool-call turns needs ``content=None``, which transformers (>= 5) drops
before rendering, and it mis-closes calls after the first turn; so past calls are rendered as the
assistant's text in exactly the markup the model wrote (:meth:`history_markup`).
"""

from __future__ import annotations

import json

from edgemoe.server.parsers.tagged import TaggedJsonToolParser, compile_pattern

__all__ = ["DeepSeekV3ToolParser"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(TaggedJsonToolParser):
    """DeepSeek-V3 / V3.1 tool-call tokens."""

    name = "deepseek_v3"
    open_tags = (CALLS_BEGIN, CALL_BEGIN)
    call_trigger = CALLS_BEGIN
    header = compile_pattern(
        rf"(?:{CALLS_BEGIN})?\s*{CALL_BEGIN}"
        rf"(?:[^<\n]*{SEP}(?P<name>[^<\n]+)\n```(?:json)?\s*(?P<args>\{{)"  # V3: type<sep>name ```json
        rf"|(?P<name2>[^<\n]+){SEP}\s*(?=\{{)(?P<args>\{{))"  # V3.1: name<sep>{...}
    )
    tail = compile_pattern(rf"\s*(?:```\s*)?{CALL_END}")
    drop_after_call = (CALLS_END,)

    @classmethod
    def forced_call(cls, name: str) -> tuple[str, str]:
        return f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n```json\n", f"\n```{CALL_END}{CALLS_END}"

    @classmethod
    def history_markup(cls, tool_calls: list[dict]) -> str:
        calls = "\n".join(
            f"{CALL_BEGIN}{tc.get('type') or 'function'}{SEP}{tc['function']['name']}\n```json\n"
            f"{tc['function']['arguments']}\n```{CALL_END}"
            for tc in tool_calls
        )
        return f"{CALLS_BEGIN}{calls}{CALLS_END}"

    @classmethod
    def tools_system_prompt(cls, tools: list[dict]) -> str:
        specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        return (
            "## Tools\n\nYou can call the following functions. Their JSON schemas:\n"
            f"{specs}\n\n"
            "To call functions, answer with:\n"
            f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}FUNCTION_NAME\n```json\nARGUMENTS_JSON_OBJECT\n```{CALL_END}"
            f"{CALLS_END}\n(one {CALL_BEGIN}...{CALL_END} per call)."
        )
