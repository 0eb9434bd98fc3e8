"""The request pipeline shared by the three chat APIs (OpenAI chat completions, Anthropic Messages,
OpenAI Responses).

Each route converts its body into a :class:`ChatSpec` (OpenAI-style messages and function tools,
tool choice, JSON mode, sampling fields), then :meth:`Serving.prepare` renders the chat template,
builds the sampling parameters (the checkpoint's ``generation_config.json`` defaults filling omitted
fields; guided decoding for JSON mode and forced tool calls), checks the prompt against the context
and KV limits, and picks the output parser. :meth:`Serving.events` streams the parsed output
(:class:`~edgemoe.server.parsers.ParseEvent` lists) next to the engine's outputs; each API turns them
into its own wire format.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from fastapi import Request

from edgemoe.engine.async_engine import AsyncLLM, EngineNotReadyError
from edgemoe.engine.llm import render_chat
from edgemoe.engine.llm_engine import PromptTooLongError, RequestOutput
from edgemoe.engine.sampling import SamplingParams, SamplingParamsError
from edgemoe.server import guided
from edgemoe.server.common import APIError
from edgemoe.server.config import ServerConfig
from edgemoe.server.parsers import OutputParser, ParsedOutput, ParseEvent, ParserConfig, collect, resolve_parsers
from edgemoe.server.protocol import sampling_kwargs

__all__ = ["ChatSpec", "Prepared", "Serving", "new_tool_call_id"]

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k")


@dataclass
class ChatSpec:
    """An API-neutral chat request.

    Attributes:
        messages: OpenAI-style message dicts, as the chat template reads them.
        tools: OpenAI function tools (``{"type": "function", "function": {...}}``).
        tool_choice: ``"auto"``, ``"none"``, ``"required"`` or ``{"name": NAME}``.
        json_mode: the answer must be one JSON object (guided decoding).
        chat_template_kwargs: extra template variables (e.g. ``enable_thinking``).
        sampling: :class:`SamplingParams` keyword arguments; ``None`` values take the checkpoint's
            defaults, then OpenAI's (see :func:`~edgemoe.server.protocol.sampling_kwargs`).
        field_names: engine field → this API's field, for error messages (``max_tokens`` →
            ``max_output_tokens``).
        messages_field: the API's name of the conversation field (``messages`` / ``input``).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict = "auto"
    json_mode: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    field_names: dict[str, str] = field(default_factory=dict)
    messages_field: str = "messages"


@dataclass
class Prepared:
    """A request ready to run: prompt, parameters, and what parses its output."""

    request_id: str
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    tools: list[dict[str, Any]] | None
    parsers: ParserConfig

    def new_parser(self) -> OutputParser:
        """A fresh output parser for this request."""
        return self.parsers.build(self.prompt_text, self.tools)


def new_tool_call_id(prefix: str = "call") -> str:
    """A tool-call id such as ``call_<24 hex>`` (``toolu_...`` for Anthropic)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _tool_name(tool: dict) -> str | None:
    return (tool.get("function") or {}).get("name")


class Serving:
    """The shared pipeline over one :class:`AsyncLLM`.

    Args:
        llm: the engine (may still be loading).
        config: the server's options (served names, parsers).
    """

    def __init__(self, llm: AsyncLLM, config: ServerConfig):
        self.llm, self.config = llm, config
        default = Path(llm.model_dir).name if llm.model_dir else "edgemoe"
        self.names: tuple[str, ...] = config.served_model_name or (default,)
        self._parsers: ParserConfig | None = None
        self._defaults: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        """The model id reported in responses (the first served name)."""
        return self.names[0]

    # ------------------------------------------------------------------ checks and configuration

    def ready(self) -> AsyncLLM:
        """The engine, or ``EngineNotReadyError`` (a 503) while it loads or after it failed."""
        llm = self.llm
        if not llm.is_ready:
            msg = f"model failed to load: {llm.load_error}" if llm.load_error else "the model is still loading"
            raise EngineNotReadyError(msg)
        return llm

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is a served name (or the model directory); ``None`` passes."""
        if model is not None and model not in self.names and model != self.llm.model_dir:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    @property
    def parsers(self) -> ParserConfig:
        """The reasoning/tool-call parser choice (resolved once the tokenizer is loaded)."""
        if self._parsers is None:
            llm = self.ready()
            self._parsers = resolve_parsers(self.config.tool_call_parser, self.config.reasoning_parser,
                                            llm.model_config.model_type, llm.tokenizer)
            log.info("parsers: tool-call %s, reasoning %s (%s)", self._parsers.tool, self._parsers.reasoning, self._parsers.why)
        return self._parsers

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """temperature / top_p / top_k from the checkpoint's ``generation_config.json``."""
        if self._defaults is None:
            gen = self.ready().generation_config
            self._defaults = {k: gen[k] for k in GENERATION_DEFAULT_KEYS if gen.get(k) is not None}
        return self._defaults

    def admit(self, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        """Check a prompt against the context and KV limits (raises :class:`APIError` 400 naming ``param``)."""
        try:
            self.ready().check_prompt(prompt_ids, params)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    # ------------------------------------------------------------------ preparing a request

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Adapt messages to the model family: past tool calls as the model's own markup where the
        template cannot render them (DeepSeek-V3); reasoning also as ``thinking`` for Harmony's template."""
        cls = self.parsers.tool_parser
        out = []
        for m in messages:
            calls = m.get("tool_calls") if m.get("role") == "assistant" else None
            markup = cls.history_markup(calls) if calls and cls is not None else None
            if markup is not None:
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = (m.get("content") or "") + markup
            if self.parsers.harmony and m.get("reasoning_content") is not None:
                m = {**m, "thinking": m["reasoning_content"]}
            out.append(m)
        return out

    def render_prompt(self, spec: ChatSpec) -> tuple[str, list[int], list[dict] | None]:
        """Render the chat template: ``(prompt_text, prompt_ids, tools offered)`` (no tools with
        ``tool_choice: "none"``). Raises :class:`APIError` (400) when the template rejects the
        conversation."""
        llm = self.ready()
        tools = spec.tools if spec.tools and spec.tool_choice != "none" else None
        messages = self.template_messages(spec.messages)
        template = getattr(llm.tokenizer, "chat_template", None) or ""
        if tools and isinstance(template, str) and "tools" not in template:
            # The template ignores tools (DeepSeek-V3's): describe them in the system prompt.
            cls = self.parsers.tool_parser
            text = (cls.tools_system_prompt(tools) if cls else None) or (
                "# Tools\n\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            )
            if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
                messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": text}, *messages]
        try:
            text, ids = render_chat(llm.tokenizer, messages, tools=tools, chat_template_kwargs=spec.chat_template_kwargs)
            return text, ids, tools
        except ValueError as exc:
            raise APIError(400, str(exc).replace("messages", spec.messages_field, 1), param=spec.messages_field) from None
        except jinja2.TemplateError as exc:  # e.g. the template's raise_exception on a bad role order
            raise APIError(
                400, f"{spec.messages_field}: the chat template failed: {exc}", param=spec.messages_field
            ) from None

    def _grammar(self, spec: ChatSpec, tools: list[dict] | None) -> guided.Grammar | None:
        if spec.json_mode:
            return guided.Grammar.json_object()
        if not tools or spec.tool_choice in ("auto", "none"):
            return None
        names = [_tool_name(t) for t in tools]
        if isinstance(spec.tool_choice, dict):
            wanted = spec.tool_choice.get("name")
            if wanted not in names:
                raise APIError(400, f"tool_choice: no tool named {wanted!r} in tools", param="tool_choice")
            names = [wanted]
        cls = self.parsers.tool_parser
        calls = [cls.forced_call(n) for n in names] if cls is not None else []
        if not calls or None in calls:
            log.info("tool_choice %r: the %s format cannot be guided; relying on the prompt", spec.tool_choice, self.parsers.tool)
            return None
        try:
            return guided.Grammar.tool_call(calls)
        except ValueError:
            return None

    async def prepare(self, spec: ChatSpec, request_id: str) -> Prepared:
        """Render, parametrize and admit a request (raises :class:`APIError` with a 4xx)."""
        llm = self.ready()
        prompt_text, prompt_ids, tools = self.render_prompt(spec)
        kwargs = sampling_kwargs(self.generation_defaults, **spec.sampling)
        if not self.parsers.skip_special_tokens:
            kwargs["skip_special_tokens"] = False
        grammar = self._grammar(spec, tools)
        try:
            params = SamplingParams(**kwargs)
            if grammar is not None:
                params = await self._guided_params(llm, kwargs, grammar)
        except SamplingParamsError as exc:
            name = spec.field_names.get(exc.field, exc.field)
            raise APIError(400, f"{name}: {exc.reason}", param=name) from None
        self.admit(prompt_ids, params, spec.messages_field)
        return Prepared(request_id, prompt_text, prompt_ids, params, tools, self.parsers)

    async def _guided_params(self, llm: AsyncLLM, kwargs: dict, grammar: guided.Grammar) -> SamplingParams:
        engine = llm.engine
        vocab_size = int(engine.runner.model_config.vocab_size)
        include_special = kwargs.get("skip_special_tokens") is False
        vocab = await asyncio.to_thread(guided.TokenVocab.get, llm.tokenizer, vocab_size, include_special)
        proc = guided.GuidedLogitsProcessor(grammar, vocab, engine.eos_token_ids)
        return SamplingParams(**kwargs, logits_processors=[proc])

    # ------------------------------------------------------------------ running it

    def generate(self, prepared: Prepared) -> AsyncIterator[RequestOutput]:
        """Start the request on the engine."""
        return self.ready().generate(prepared.prompt_ids, prepared.params, prepared.request_id)

    @staticmethod
    async def events(
        gen: AsyncIterator[RequestOutput], parser: OutputParser
    ) -> AsyncIterator[tuple[list[ParseEvent], RequestOutput]]:
        """Each engine output with the parse events its new text produced (the last one flushes)."""
        async for out in gen:
            delta = out.outputs[0].delta_text
            events = parser.feed(delta) if delta else []
            if out.finished:
                events += parser.finish()
            yield events, out

    async def run_whole(self, prepared: Prepared, raw: Request) -> tuple[RequestOutput, ParsedOutput]:
        """Run a non-streamed request to the end: its final output and parsed text."""
        parser = prepared.new_parser()
        events: list[ParseEvent] = []

        async def outputs() -> AsyncIterator[RequestOutput]:
            async for evs, out in self.events(self.generate(prepared), parser):
                events.extend(evs)
                yield out

        out = await self.until_done(outputs(), raw)
        return out, collect(events, parser.saw_reasoning)

    async def until_done(self, gen: AsyncIterator[RequestOutput], raw: Request) -> RequestOutput:
        """Consume a non-streamed request; abort it (499) if the client goes away."""

        async def consume() -> RequestOutput:
            last = None
            async for out in gen:
                last = out
            return last

        task = asyncio.ensure_future(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    task.cancel()
                    raise APIError(499, "client disconnected", code="client_disconnected")
        finally:
            if not task.done():
                task.cancel()
