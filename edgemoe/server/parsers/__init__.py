"""Output parsers by model family, and the registry that picks them from the checkpoint.

Two choices are made per server (overridable with ``--reasoning-parser`` / ``--tool-call-parser``):

============== ===================================================================================
reasoning      ``think`` (``<think>...</think>``; aliases ``qwen3``, ``deepseek_r1``), ``harmony``,
               ``none``
tool-call      ``qwen3`` (JSON in ``<tool_call>``; alias ``hermes``), ``qwen3_coder`` (XML
               functions/parameters), ``glm45`` (GLM-4.5/4.6/4.7 ``<arg_key>``/``<arg_value>`` pairs;
               alias ``glm47``), ``deepseek_v3`` (DeepSeek tool-call tokens), ``kimi_k2`` (Kimi-K2 tool-call
               sections; alias ``kimi``), ``harmony``, ``none``
============== ===================================================================================

:func:`detect_parsers` (``auto``) decides from the checkpoint: ``model_type == "gpt_oss"`` or the
Harmony tokens ``<|channel|>`` + ``<|message|>`` in the vocabulary → ``harmony`` for both; else the
tool format from ``<|tool_calls_section_begin|>`` in the vocabulary or chat template (``kimi_k2``),
``<｜tool▁calls▁begin｜>`` in the vocabulary (``deepseek_v3``), ``<function=`` and ``<parameter=`` in
the chat template (``qwen3_coder``), ``<arg_key>`` in the chat template (``glm45``), ``<tool_call>`` in
the vocabulary or template (``qwen3``); reasoning ``think`` when ``<think>`` and ``</think>`` are
tokens of the vocabulary or both appear in the chat template (Kimi-K2-Thinking's writes them as text).

Every parser is incremental (:class:`~edgemoe.server.parsers.base.OutputParser`); module per family:
``think``, ``qwen3``, ``qwen3_coder``, ``glm45``, ``deepseek_v3``, ``kimi_k2``, ``harmony``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgemoe.server.parsers.base import (
    ChainParser,
    OutputParser,
    ParsedOutput,
    ParseEvent,
    PassThrough,
    ToolCall,
    collect,
)
from edgemoe.server.parsers.deepseek_v3 import DeepSeekV3ToolParser
from edgemoe.server.parsers.glm45 import Glm45ToolParser
from edgemoe.server.parsers.harmony import HarmonyParser
from edgemoe.server.parsers.kimi_k2 import KimiK2ToolParser
from edgemoe.server.parsers.qwen3 import Qwen3ToolParser
from edgemoe.server.parsers.qwen3_coder import Qwen3CoderToolParser
from edgemoe.server.parsers.tagged import ToolParser
from edgemoe.server.parsers.think import ThinkParser, prompt_ends_in_reasoning

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "OutputParser",
    "ParseEvent",
    "ParsedOutput",
    "ParserConfig",
    "ToolCall",
    "check_parser_names",
    "collect",
    "detect_parsers",
    "resolve_parsers",
]

TOOL_PARSERS: dict[str, type[ToolParser] | None] = {
    "qwen3": Qwen3ToolParser,
    "hermes": Qwen3ToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "kimi": KimiK2ToolParser,
    "harmony": HarmonyParser,
    "none": None,
}
REASONING_PARSERS: dict[str, type[OutputParser] | None] = {
    "think": ThinkParser,
    "qwen3": ThinkParser,
    "deepseek_r1": ThinkParser,
    "harmony": HarmonyParser,
    "none": None,
}


def _vocab_has(tokenizer: Any, *tokens: str) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in tokens)


def detect_parsers(model_type: str | None, tokenizer: Any) -> tuple[str, str, str]:
    """Pick ``(tool_parser, reasoning_parser, why)`` for a checkpoint (rules in the module doc)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(map(str, template))
    if model_type == "gpt_oss" or _vocab_has(tokenizer, "<|channel|>", "<|message|>"):
        return "harmony", "harmony", "Harmony format (gpt_oss model type or <|channel|>/<|message|> tokens)"
    if _vocab_has(tokenizer, "<|tool_calls_section_begin|>") or "<|tool_calls_section_begin|>" in template:
        tool, why = "kimi_k2", "<|tool_calls_section_begin|> token (Kimi-K2)"
    elif _vocab_has(tokenizer, "<｜tool▁calls▁begin｜>"):
        tool, why = "deepseek_v3", "<｜tool▁calls▁begin｜> token"
    elif "<function=" in template and "<parameter=" in template:
        tool, why = "qwen3_coder", "<function=/<parameter= in the chat template"
    elif "<arg_key>" in template:
        tool, why = "glm45", "<arg_key> in the chat template"
    elif _vocab_has(tokenizer, "<tool_call>") or "<tool_call>" in template:
        tool, why = "qwen3", "<tool_call> token"
    else:
        tool, why = "none", "no known tool-call markup"
    if _vocab_has(tokenizer, "<think>", "</think>"):
        return tool, "think", why + "; <think>/</think> tokens"
    if "<think>" in template and "</think>" in template:
        return tool, "think", why + "; <think>/</think> in the chat template"
    return tool, "none", why + "; no reasoning tokens"


@dataclass(frozen=True)
class ParserConfig:
    """The server's parser choice.

    Attributes:
        tool: a key of :data:`TOOL_PARSERS`.
        reasoning: a key of :data:`REASONING_PARSERS`.
        why: how the choice was made (logged at start-up).
    """

    tool: str
    reasoning: str
    why: str = ""

    @property
    def harmony(self) -> bool:
        return "harmony" in (self.tool, self.reasoning)

    @property
    def tool_parser(self) -> type[ToolParser] | None:
        """The tool-call parser class (``None`` for ``none``)."""
        return TOOL_PARSERS[self.tool]

    @property
    def skip_special_tokens(self) -> bool:
        """Whether outputs may be detokenized without special tokens (Harmony's markers are special, and
        so may a tool format's be: ``ToolParser.skip_special_tokens``)."""
        tool = self.tool_parser
        return not self.harmony and (tool is None or tool.skip_special_tokens)

    def build(self, generation_prompt: str, tools: list[dict] | None) -> OutputParser:
        """A fresh parser for one response.

        Args:
            generation_prompt: the text the chat template wrote after the last message to open the
                answer (a think block left open there starts the output in reasoning).
            tools: the tools offered to the model; ``None``/empty disables tool-call parsing
                (``tool_choice: "none"`` or no tools).
        """
        if self.harmony:
            return HarmonyParser(tools)
        reasoning: OutputParser = PassThrough()
        if REASONING_PARSERS[self.reasoning] is ThinkParser:
            reasoning = ThinkParser(prompt_ends_in_reasoning(generation_prompt))
        tool_cls = self.tool_parser
        return ChainParser(reasoning, tool_cls(tools) if tools and tool_cls is not None else PassThrough())


def check_parser_names(tool: str | None, reasoning: str | None) -> None:
    """Raise ``ValueError`` (naming the option and the choices) for an unknown parser name."""
    for value, table, flag in ((tool, TOOL_PARSERS, "--tool-call-parser"),
                               (reasoning, REASONING_PARSERS, "--reasoning-parser")):
        if value not in (None, "auto") and value not in table:
            raise ValueError(f"{flag}: unknown parser {value!r}; choices: auto, {', '.join(table)}")


def resolve_parsers(tool: str | None, reasoning: str | None, model_type: str | None, tokenizer: Any) -> ParserConfig:
    """Apply ``--tool-call-parser`` / ``--reasoning-parser`` (``None`` or ``"auto"`` = detect).

    Raises:
        ValueError: an unknown parser name (the message lists the choices).
    """
    check_parser_names(tool, reasoning)
    auto_tool, auto_reasoning, why = detect_parsers(model_type, tokenizer)
    tool_name = auto_tool if tool in (None, "auto") else tool
    reasoning_name = auto_reasoning if reasoning in (None, "auto") else reasoning
    if tool not in (None, "auto") or reasoning not in (None, "auto"):
        why = f"command line (auto would be {auto_tool}/{auto_reasoning}: {why})"
    return ParserConfig(tool_name, reasoning_name, why)
