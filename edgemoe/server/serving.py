"""The request pipeline shared by the three chat APIs (OpenAI chat completions, Anthropic Messages,
OpenAI Responses).

Each route converts its body into a :class:`ChatSpec` (OpenAI-style messages and function tools,
tool choice, output schema, sampling fields), then :meth:`Serving.prepare` renders the chat template
and tokenizes (on a worker thread), builds the sampling parameters (the checkpoint's
``generation_config.json`` defaults filling omitted fields, the server's default output cap), checks
the prompt against the context and KV limits, attaches the grammar of structured output (an output
schema, a forced tool call, ``strict`` tools; ``structured.py``) and picks the output parser, whose
start state comes from the generation prompt. :meth:`Serving.events` streams the parsed output
(:class:`~edgemoe.server.parsers.ParseEvent` lists) next to the engine's outputs; each API turns them
into its own wire format.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jinja2
from fastapi import Request

from edgemoe.engine.async_engine import AsyncLLM, EngineNotReadyError
from edgemoe.engine.llm import arguments_as_objects, render_chat_text
from edgemoe.engine.llm_engine import PromptTooLongError, RequestOutput
from edgemoe.engine.sampling import GENERATION_CONFIG_KEYS, SamplingParams, SamplingParamsError
from edgemoe.server.common import APIError, ContextLengthError
from edgemoe.server.config import ServerConfig
from edgemoe.server.parsers import (
    REASONING_PARSERS,
    OutputParser,
    ParsedOutput,
    ParseEvent,
    ParserConfig,
    collect,
    resolve_parsers,
)
from edgemoe.server.parsers.harmony import template_history
from edgemoe.server.parsers.think import THINK_END, ThinkParser, prompt_ends_in_reasoning
from edgemoe.server.protocol import sampling_kwargs
from edgemoe.server.structured import Grammar, GrammarError, GrammarLogitsProcessor, GrammarVocab, min_output_tokens

__all__ = ["CallIds", "ChatSpec", "FirstCallOnly", "Prepared", "Serving", "new_tool_call_id", "with_reasoning_effort"]

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5


@dataclass
class ChatSpec:
    """An API-neutral chat request.

    Attributes:
        messages: OpenAI-style message dicts, as the chat template reads them.
        tools: OpenAI function tools (``{"type": "function", "function": {...}}``).
        tool_choice: ``"auto"``, ``"none"``, ``"required"`` or ``{"name": NAME}``.
        output_schema: the answer must be one JSON value following this JSON schema (structured
            output; ``{"type": "object"}`` for JSON mode).
        output_field: the API's name of the field ``output_schema`` came from, for errors.
        chat_template_kwargs: extra template variables (e.g. ``enable_thinking``).
        sampling: :class:`SamplingParams` keyword arguments; ``None`` values take the checkpoint's
            defaults, then OpenAI's (see :func:`~edgemoe.server.protocol.sampling_kwargs`).
        field_names: engine field → this API's field, for error messages (``max_tokens`` →
            ``max_output_tokens``).
        messages_field: the API's name of the conversation field (``messages`` / ``input``).
        parallel_tool_calls: ``False``: at most one tool call is returned (the model's first).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict = "auto"
    output_schema: dict[str, Any] | None = None
    output_field: str = "response_format"
    chat_template_kwargs: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    field_names: dict[str, str] = field(default_factory=dict)
    messages_field: str = "messages"
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation.

    Attributes:
        prompt_ids: the prompt's token ids.
        generation_prompt: the text the template wrote after the last message to open the answer
            (e.g. ``<|im_start|>assistant\n<think>\n``): where the output starts.
        tools: the tools offered to the model (``None`` with ``tool_choice: "none"`` or no tools).
        past_call_ids: the ids of the conversation's tool calls and results as the template saw them.
        past_calls: how many tool calls the conversation's assistant turns made.
    """

    prompt_ids: list[int]
    generation_prompt: str
    tools: list[dict[str, Any]] | None
    past_call_ids: frozenset[str] = frozenset()
    past_calls: int = 0


def new_tool_call_id(prefix: str = "call") -> str:
    """A tool-call id such as ``call_<24 hex>`` (``toolu_...`` for Anthropic)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class CallIds:
    """The API ids of one response's tool calls: one per call index, fixed when first asked for.

    Random (``PREFIX_<24 hex>``) unless the tool-call format gives its own
    (:meth:`~edgemoe.server.parsers.tagged.ToolParser.api_call_id`: Kimi-K2's ``functions.NAME:IDX``,
    numbered on from the conversation's earlier calls and never one of their ids), so that a client
    sending the conversation back gives the chat template ids in the form the model was trained on.

    Args:
        tool_parser: the tool-call parser class (``None``: random ids).
        prefix: the random ids' prefix (``call``; ``toolu`` for Anthropic).
        taken: ids the conversation already uses.
        past_calls: how many tool calls the conversation made before this response.
    """

    def __init__(self, tool_parser: type | None, prefix: str = "call", taken: frozenset[str] = frozenset(),
                 past_calls: int = 0):
        self._cls, self._prefix, self._taken, self._past = tool_parser, prefix, set(taken), past_calls
        self._ids: dict[int, str] = {}

    def get(self, index: int, name: str, written: str | None = None) -> str:
        """The id of call ``index`` (its function ``name``, the id the model ``written`` for it)."""
        if index not in self._ids:
            own = (self._cls.api_call_id(name, written, self._past + index, self._taken)
                   if self._cls is not None else None)
            self._ids[index] = own or new_tool_call_id(self._prefix)
            self._taken.add(self._ids[index])
        return self._ids[index]

    def __contains__(self, index: object) -> bool:
        return index in self._ids

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class Prepared:
    """A request ready to run: prompt, parameters, and what parses its output (``past_call_ids`` /
    ``past_calls``: see :class:`Rendered`; ``parallel_tool_calls``: see :class:`ChatSpec`)."""

    request_id: str
    prompt_ids: list[int]
    generation_prompt: str
    params: SamplingParams
    tools: list[dict[str, Any]] | None
    parsers: ParserConfig
    past_call_ids: frozenset[str] = frozenset()
    past_calls: int = 0
    parallel_tool_calls: bool = True

    def new_parser(self) -> OutputParser:
        """A fresh output parser for this request."""
        parser = self.parsers.build(self.generation_prompt, self.tools)
        return parser if self.parallel_tool_calls else FirstCallOnly(parser)

    def call_ids(self, prefix: str = "call") -> CallIds:
        """A fresh :class:`CallIds` for this request's response."""
        return CallIds(self.parsers.tool_parser, prefix, self.past_call_ids, self.past_calls)


class FirstCallOnly(OutputParser):
    """An output parser's events without the tool calls after the first (``parallel_tool_calls: false``,
    Anthropic's ``disable_parallel_tool_use``: the client handles one call per turn)."""

    def __init__(self, parser: OutputParser):
        self.parser = parser

    @property
    def saw_reasoning(self) -> bool:  # type: ignore[override]
        return self.parser.saw_reasoning

    @staticmethod
    def _first(events: list[ParseEvent]) -> list[ParseEvent]:
        return [e for e in events if e.kind != "tool_call" or e.index == 0]

    def feed(self, text: str) -> list[ParseEvent]:
        return self._first(self.parser.feed(text))

    def finish(self) -> list[ParseEvent]:
        return self._first(self.parser.finish())


def _tool_name(tool: dict) -> str | None:
    return (tool.get("function") or {}).get("name")


def _call_ids_of(messages: list[dict[str, Any]]) -> tuple[frozenset[str], int]:
    """``(ids, count)``: the tool-call ids a conversation uses (its assistant turns' calls and its tool
    results'), and how many tool calls its assistant turns made."""
    ids: set[str] = set()
    count = 0
    for m in messages:
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            for tc in m["tool_calls"]:
                count += 1
                if isinstance(tc, dict) and isinstance(tc.get("id"), str):
                    ids.add(tc["id"])
        elif m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            ids.add(m["tool_call_id"])
    return frozenset(ids), count


REASONING_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                     "xhigh": "high", "max": "high"}
"""An API's reasoning effort -> the chat template's ``reasoning_effort`` (gpt-oss's Harmony system message
knows low, medium and high; the APIs' lower and higher settings map to the nearest)."""


def with_reasoning_effort(kwargs: dict[str, Any] | None, effort: str | None, param: str) -> dict[str, Any] | None:
    """``chat_template_kwargs`` plus ``reasoning_effort`` from an API's effort setting (OpenAI
    ``reasoning_effort``, Responses ``reasoning.effort``, Anthropic ``output_config.effort`` or the thinking
    budget), mapped by :data:`REASONING_EFFORTS`; a ``reasoning_effort`` the request put in
    ``chat_template_kwargs`` wins. Templates without the variable ignore it.

    Raises:
        APIError: 400 naming ``param`` for an effort outside :data:`REASONING_EFFORTS`.
    """
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"{param}: unknown effort {effort!r}; choose one of {', '.join(REASONING_EFFORTS)}",
                       param=param)
    return {"reasoning_effort": REASONING_EFFORTS[effort], **(kwargs or {})}


# The globals of the template's environment: Jinja's own and the two transformers adds. A template
# variable of the same name hides the function (``namespace`` given as 1: the template's
# ``namespace(...)`` fails; ``raise_exception``: the template's checks of the conversation do nothing).
TEMPLATE_GLOBALS = frozenset({"range", "dict", "lipsum", "cycler", "joiner", "namespace", "raise_exception",
                              "strftime_now"})


def reserved_template_kwargs(tokenizer: Any) -> frozenset[str]:
    """Names ``chat_template_kwargs`` may not use: the arguments of the tokenizer's
    ``apply_chat_template`` (``tokenize``, ``tools``, ``add_generation_prompt``, ...), the names the
    template itself receives them under (``messages``, ``conversations``) and the functions of its
    environment (:data:`TEMPLATE_GLOBALS`)."""
    sig = inspect.signature(type(tokenizer).apply_chat_template)
    named = {p.name for p in sig.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset((named - {"self"}) | {"messages", "conversations"} | TEMPLATE_GLOBALS)


DEFAULT_OUTPUT_CAP = 8192  # tokens, for requests that set no output cap (see Serving.default_max_tokens)

# Prompt texts longer than this many characters per token of the limit are counted piece by piece before
# they are tokenized whole (Serving.encode_prompt): natural text and code run 3-5 characters per token.
COUNT_FIRST_CHARS_PER_TOKEN = 8
COUNT_PIECE_CHARS = 1 << 16
COUNT_SLACK_TOKENS = 8  # per piece: what a cut may add to the count (pieces end at a line break)
_LINE_START = re.compile(r"\n(?=\S)")


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
        self._vocab: asyncio.Future | None = None  # GrammarVocab, built on first use

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
            log.info("parsers: tool-call %s, reasoning %s (%s)", self._parsers.tool, self._parsers.reasoning,
                     self._parsers.why)
        return self._parsers

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The sampling defaults from the checkpoint's ``generation_config.json`` (temperature, top_p, top_k,
        repetition_penalty: :data:`~edgemoe.engine.sampling.GENERATION_CONFIG_KEYS`)."""
        if self._defaults is None:
            gen = self.ready().generation_config
            self._defaults = {k: gen[k] for k in GENERATION_CONFIG_KEYS if gen.get(k) is not None}
        return self._defaults

    @property
    def default_max_tokens(self) -> int:
        """The output cap of a request that sets none: ``--default-max-tokens``, else the checkpoint's
        ``generation_config.json`` ``max_new_tokens``, else ``DEFAULT_OUTPUT_CAP`` tokens (clients such
        as Codex and aider send no cap; without one a reply could run to the end of the context)."""
        if self.config.default_max_tokens is not None:
            return self.config.default_max_tokens
        cap = self.ready().generation_config.get("max_new_tokens")
        return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1 else DEFAULT_OUTPUT_CAP

    def admit(self, prompt_ids: list[int], params: SamplingParams, param: str) -> SamplingParams:
        """Check a prompt against the context and KV limits; ``params`` with ``max_tokens`` set (the
        server's default output cap when the request set none) and clamped to the room left.

        Raises:
            ContextLengthError: the prompt can never fit.
            APIError: 400 naming ``param`` for another bad prompt (empty, a token id out of range), or naming the
                sampling field that the model's vocabulary rules out (a stop token id past it).
        """
        try:
            return self.ready().check_prompt(prompt_ids, params)
        except PromptTooLongError as exc:
            raise ContextLengthError(str(exc), param, exc.prompt_len, exc.limit) from None
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.field) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    def encode_prompt(self, text: str, param: str, add_special_tokens: bool = False, bounded: bool = True,
                      ) -> list[int]:
        """``text`` tokenized (CPU-bound: call it off the event loop); ``add_special_tokens`` as the
        tokenizer takes it (a chat template writes them itself).

        A text far longer than the largest prompt accepted could take seconds and gigabytes to tokenize
        only to be refused (8 MiB of tool schemas: 2.5M tokens, 10 s); such a text (over
        ``COUNT_FIRST_CHARS_PER_TOKEN`` characters per token of the limit) is first counted in pieces cut
        at line starts, and refused as soon as the count, less the slack a cut may add, passes the limit
        (unless not ``bounded``: counting tokens is not limited by the context).

        Raises:
            ContextLengthError: the count passed the limit (its ``prompt_tokens``: the count so far).
        """
        tokenizer = self.ready().tokenizer
        limit = self.llm.prompt_limit
        if bounded and len(text) > COUNT_FIRST_CHARS_PER_TOKEN * limit:
            count = start = pieces = 0
            while start < len(text):
                cut = _LINE_START.search(text, start + COUNT_PIECE_CHARS, start + 2 * COUNT_PIECE_CHARS)
                end = cut.end() if cut else start + COUNT_PIECE_CHARS
                count += len(tokenizer.encode(text[start:end], add_special_tokens=False))
                start, pieces = end, pieces + 1
                if count - COUNT_SLACK_TOKENS * pieces > limit:
                    counted = (f"in its first {start} of {len(text)} characters" if start < len(text)
                               else f"in pieces, all {len(text)} characters")
                    raise ContextLengthError(
                        f"The prompt has at least {count - COUNT_SLACK_TOKENS * pieces} tokens (counted {counted}) "
                        f"but at most {limit} are accepted. Shorten the prompt (or raise --max-model-len / "
                        "--kv-cache-tokens).", param, count - COUNT_SLACK_TOKENS * pieces, limit)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ------------------------------------------------------------------ preparing a request

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Adapt messages to the model family: past tool-call ids in the form the template expects
        (Kimi-K2's ``functions.NAME:IDX``, see ``ToolParser.template_call_ids``); past tool calls as the
        model's own markup where the template cannot render them (DeepSeek-V3); for Harmony's template
        (gpt-oss) tool-call arguments as objects (it writes them with ``tojson``) and the history reshaped
        by :func:`~edgemoe.server.parsers.harmony.template_history`."""
        cls = self.parsers.tool_parser
        if cls is not None:
            messages = cls.template_call_ids(messages)
        out = []
        for m in messages:
            calls = m.get("tool_calls") if m.get("role") == "assistant" else None
            markup = cls.history_markup(calls) if calls and cls is not None else None
            if markup is not None:
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = (m.get("content") or "") + markup
            out.append(m)
        if self.parsers.harmony:
            out = template_history(arguments_as_objects(out) or out)
        return out

    def render_prompt(self, spec: ChatSpec, bounded: bool = True) -> Rendered:
        """Render the chat template (no tools with ``tool_choice: "none"``) and tokenize (CPU-bound:
        call it off the event loop, see :meth:`render`); ``bounded``: see :meth:`encode_prompt`.

        Raises:
            APIError: 400 for too many messages, a reserved ``chat_template_kwargs`` key, or a
                conversation the template rejects; ContextLengthError for a text far over the limit.
        """
        llm = self.ready()
        field_ = spec.messages_field
        if len(spec.messages) > self.config.max_messages:
            raise APIError(400, f"{field_}: {len(spec.messages)} messages; at most {self.config.max_messages} are "
                                "accepted (--max-messages)", param=field_)
        kwargs = spec.chat_template_kwargs or {}
        reserved = sorted(set(kwargs) & reserved_template_kwargs(llm.tokenizer))
        if reserved:
            raise APIError(400, f"chat_template_kwargs.{reserved[0]}: reserved (the server sets it); template "
                                "variables such as enable_thinking are allowed", param="chat_template_kwargs")
        tools = spec.tools if spec.tools and spec.tool_choice != "none" else None
        messages = self.template_messages(spec.messages)
        past_ids, past_calls = _call_ids_of(messages)
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
            text = render_chat_text(llm.tokenizer, messages, tools=tools, chat_template_kwargs=kwargs)
            ids = self.encode_prompt(text, field_, bounded=bounded)  # a hopeless prompt stops here, before
            # the second rendering
            history = render_chat_text(llm.tokenizer, messages, tools=tools, chat_template_kwargs=kwargs,
                                       add_generation_prompt=False)
        except APIError:
            raise
        except ValueError as exc:
            raise APIError(400, str(exc).replace("messages", field_, 1), param=field_) from None
        except jinja2.TemplateError as exc:  # e.g. the template's raise_exception on a bad role order
            raise APIError(400, f"{field_}: the chat template failed: {exc}", param=field_) from None
        except (TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as exc:
            # The template is a program run on the request's values: such an error there (e.g. arithmetic on
            # a string that chat_template_kwargs gave) is the request's; anything else stays a 500.
            log.info("the chat template failed on a request", exc_info=True)
            raise APIError(400, f"{field_}: the chat template failed: {type(exc).__name__}: {exc}",
                           param=field_) from None
        return Rendered(ids, text[len(os.path.commonprefix([text, history])):], tools,  # noqa: RUF071 (texts, not paths)
                        past_ids, past_calls)

    async def render(self, spec: ChatSpec, bounded: bool = True) -> Rendered:
        """:meth:`render_prompt` on a worker thread, so a long prompt does not stall other clients."""
        return await asyncio.to_thread(self.render_prompt, spec, bounded)

    async def grammar_vocab(self) -> GrammarVocab:
        """The tokenizer as the grammar engine sees it (built once, on a worker thread: seconds)."""
        if self._vocab is None:
            llm = self.ready()
            self._vocab = asyncio.ensure_future(asyncio.to_thread(
                GrammarVocab, llm.tokenizer, int(llm.model_config.vocab_size), llm.engine.eos_token_ids))
        try:
            return await asyncio.shield(self._vocab)
        except GrammarError as exc:
            raise APIError(400, f"structured output is not available for this model: {exc}") from None

    def _grammar(self, spec: ChatSpec, rendered: Rendered) -> Callable[[GrammarVocab], Grammar] | None:
        """What builds the grammar the answer must follow, from the grammar vocabulary (``None``:
        unconstrained, and the vocabulary is not needed): the output schema, a forced tool call, or
        ``strict`` tools' calls.

        Raises:
            APIError: 400 for a ``tool_choice`` naming no offered tool, or forcing a call with no tools offered.
        """
        parsers = self.parsers
        # The prompt opened a think block: a constrained answer closes it at once.
        opened = (REASONING_PARSERS[parsers.reasoning] is ThinkParser
                  and prompt_ends_in_reasoning(rendered.generation_prompt))

        def lead(vocab: GrammarVocab) -> str:
            return vocab.literal(THINK_END + "\n\n") if opened else ""

        if spec.output_schema is not None:
            return lambda vocab: Grammar.json_schema(spec.output_schema, spec.output_field, lead(vocab))
        tools = rendered.tools
        if not tools:
            if spec.tool_choice not in ("auto", "none"):  # a call is forced, and there is nothing to call
                raise APIError(400, "tool_choice: forces a tool call, but the request offers no function tools",
                               param="tool_choice")
            return None
        cls = parsers.tool_parser
        by_name = {_tool_name(t): t.get("function") or {} for t in tools}
        if spec.tool_choice == "auto":
            trigger = cls.call_trigger if cls is not None else None
            if trigger is None or not any(fn.get("strict") for fn in by_name.values()):
                return None

            def strict_calls(vocab: GrammarVocab) -> Grammar:
                calls = []
                for name, fn in by_name.items():
                    prefix, suffix = cls.forced_call(name)
                    calls.append(vocab.call(prefix[len(trigger):], fn.get("parameters") if fn.get("strict") else None,
                                            suffix))
                return Grammar.tool_calls(calls, "strict tool call", trigger=vocab.literal(trigger))

            return strict_calls
        names = list(by_name)
        if isinstance(spec.tool_choice, dict):
            wanted = spec.tool_choice.get("name")
            if wanted not in by_name:
                raise APIError(400, f"tool_choice: no tool named {wanted!r} in tools", param="tool_choice")
            names = [wanted]
        forced = [cls.forced_call(n) for n in names] if cls is not None else []
        if not forced or None in forced:
            log.info("tool_choice %r: the %s format is not constrained; relying on the prompt", spec.tool_choice,
                     parsers.tool)
            return None
        return lambda vocab: Grammar.tool_calls(
            [vocab.call(prefix, by_name[n].get("parameters"), suffix) for n, (prefix, suffix) in zip(names, forced)],
            "forced tool call", lead=lead(vocab))

    async def prepare(self, spec: ChatSpec, request_id: str) -> Prepared:
        """Render, parametrize and admit a request (raises :class:`APIError` with a 4xx)."""
        rendered = await self.render(spec)
        kwargs = sampling_kwargs(self.generation_defaults, **spec.sampling)
        if kwargs.get("max_tokens") is None:
            kwargs["max_tokens"] = self.default_max_tokens
        if not self.parsers.skip_special_tokens:
            kwargs["skip_special_tokens"] = False
        try:
            params = SamplingParams(**kwargs)
        except SamplingParamsError as exc:
            name = spec.field_names.get(exc.field, exc.field)
            raise APIError(400, f"{name}: {exc.reason}", param=name) from None
        params = self.admit(rendered.prompt_ids, params, spec.messages_field)
        build = self._grammar(spec, rendered)
        if build is not None:
            vocab = await self.grammar_vocab()
            proc = await asyncio.to_thread(self._constrain, vocab, build(vocab), params.max_tokens, spec)
            params = replace(params, logits_processors=[proc])
        return Prepared(request_id, rendered.prompt_ids, rendered.generation_prompt, params, rendered.tools,
                        self.parsers, rendered.past_call_ids, rendered.past_calls, spec.parallel_tool_calls)

    @staticmethod
    def _constrain(vocab: GrammarVocab, grammar: Grammar, max_tokens: int, spec: ChatSpec) -> GrammarLogitsProcessor:
        """The grammar's logits processor, after checking that ``max_tokens`` can hold a complete output
        (CPU-bound: compiles the grammar)."""
        field_ = spec.output_field if spec.output_schema is not None else "tools"
        try:
            proc = GrammarLogitsProcessor(grammar, vocab)
            need = 1 if grammar.lazy else min_output_tokens(vocab, grammar, max_tokens)
        except GrammarError as exc:
            raise APIError(400, f"{field_}: the schema cannot be enforced: {exc}", param=field_) from None
        if need is None:
            name = spec.field_names.get("max_tokens", "max_tokens")
            shortest = min_output_tokens(vocab, grammar)
            at_least = f"at least {shortest}" if shortest is not None else "more than 4096"
            raise APIError(400, f"{name}: {max_tokens} tokens cannot hold a complete {grammar.what} ({at_least} "
                                "tokens are needed)", param=name)
        return proc

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
