"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

What is served (field names and event shapes follow the ``anthropic`` SDK's types):

- ``system`` as a string or text blocks, and ``system`` turns inside ``messages`` (Claude Code's
  mid-conversation system prompts: leading ones join ``system``, later ones stay in place);
  ``messages`` with ``text``, ``image``, ``document``, ``tool_use``, ``tool_result``, ``thinking`` and
  ``redacted_thinking`` blocks (images become an ``[image omitted]`` note, text documents their title
  and text, PDF documents a ``[document omitted]`` note: the models served are text-only; other block
  types are a 400 naming the block);
- ``tools`` (client tools with an ``input_schema``, ``strict`` enforced; Anthropic-hosted server tools
  are ignored), ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``; ``any`` / ``tool`` calls
  follow ``input_schema``; ``disable_parallel_tool_use``: only the first call is returned), ``thinking``
  (``enabled``/``adaptive`` → the template's ``enable_thinking``, ``disabled`` → off; omitted = the
  model's default; with ``output_config.effort``, also the template's ``reasoning_effort``, which
  gpt-oss's Harmony template reads), ``stop_sequences``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
  ``output_config.format`` (a JSON schema, enforced by structured output);
- responses with ``thinking`` (empty ``signature``), ``text`` and ``tool_use`` blocks, ``stop_reason``
  ``end_turn`` / ``max_tokens`` / ``stop_sequence`` / ``tool_use``, usage (prompt tokens served
  from the prefix cache as ``cache_read_input_tokens``, the rest as ``input_tokens``, as Anthropic
  counts them);
- streaming with the exact event sequence: ``message_start``, then per block ``content_block_start``,
  ``content_block_delta`` (``thinking_delta`` / ``text_delta`` / ``input_json_delta``),
  ``content_block_stop``, then ``message_delta`` (stop reason, final usage; ``message_start`` counts
  the whole prompt as ``input_tokens``, before admission) and ``message_stop``; a failure
  mid-stream is an ``error`` event.

Errors use Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``, see ``app.py``); a
prompt over the context is ``prompt is too long: N tokens > M maximum``, the wording clients parse.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from edgemoe.engine.async_engine import RequestFailedError
from edgemoe.engine.llm_engine import RequestOutput
from edgemoe.server.common import (
    APIError,
    MaxTokens,
    RequestBody,
    TokenCounts,
    TopK,
    content_text,
    event_stream,
    json_body,
    part_text,
    reject_unsupported,
    request_failed,
    sse_event,
    stream_failure,
)
from edgemoe.server.parsers import ParsedOutput
from edgemoe.server.serving import CallIds, ChatSpec, Prepared, Serving, new_tool_call_id, with_reasoning_effort

__all__ = ["CountTokensRequest", "MessageResponse", "MessagesRequest", "router", "to_chat_spec"]

TEXT_BLOCKS = ("text", "image", "document")  # read as text (an image or a PDF as a note) in any turn


class _In(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlockParam(_In):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(_In):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlockParam(_In):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class ThinkingBlockParam(_In):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(_In):
    type: Literal["redacted_thinking"]
    data: str | None = None


class OtherBlockParam(_In):
    """Any other block type (``image``, ``document``, server-tool blocks ...)."""

    type: str


# Block type → union tag (CamelCase, so validation errors do not show it as a field name).
_KNOWN_BLOCKS = {"text": "Text", "tool_use": "ToolUse", "tool_result": "ToolResult", "thinking": "Thinking",
                 "redacted_thinking": "RedactedThinking"}


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _KNOWN_BLOCKS.get(kind, "Other")


ContentBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("Text")]
    | Annotated[ToolUseBlockParam, Tag("ToolUse")]
    | Annotated[ToolResultBlockParam, Tag("ToolResult")]
    | Annotated[ThinkingBlockParam, Tag("Thinking")]
    | Annotated[RedactedThinkingBlockParam, Tag("RedactedThinking")]
    | Annotated[OtherBlockParam, Tag("Other")],
    Discriminator(_block_tag),
]


class MessageParam(_In):
    """A turn. ``system`` turns inside ``messages`` (Claude Code's mid-conversation system prompts) are
    accepted: leading ones join ``system``, later ones stay system turns in their place."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


class ToolParam(_In):
    """A tool. Client tools (no ``type``, or ``custom``) need ``input_schema``; typed Anthropic server tools
    (``web_search_...``) have none."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    strict: bool | None = None
    defer_loading: bool | None = None  # a tool the client loads later (Claude Code's placeholder): not offered


class ToolChoiceParam(_In):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(_In):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormatParam(_In):
    type: Literal["json_schema"]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class OutputConfigParam(_In):
    """``output_config``: ``format`` (a JSON schema the answer must follow, enforced); ``effort`` becomes the chat
    template's ``reasoning_effort`` (gpt-oss's Harmony template reads it)."""

    format: OutputFormatParam | None = None
    effort: str | None = None


class CountTokensRequest(RequestBody):
    """``POST /v1/messages/count_tokens`` body."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfigParam | None = None


UNSUPPORTED_OPTIONS: dict[str, tuple] = {"mcp_servers": ([],)}
"""Messages options this server cannot honour (connecting to remote MCP servers) → the values besides ``null``
that ask for nothing; any other is a 400 naming the option."""


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` body (unknown fields such as ``metadata`` are accepted and ignored)."""

    max_tokens: Annotated[MaxTokens, Field(ge=1)]  # required here: no "or None" as the OpenAI routes allow
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None


class Usage(BaseModel):
    """Anthropic token usage: the prompt is ``input_tokens + cache_read_input_tokens`` (the part
    computed and the part whose KV came from the prefix cache); nothing is ever written to a cache on
    request, so ``cache_creation_input_tokens`` stays 0."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, out: RequestOutput) -> Usage:
        """The usage of a request's (final) output."""
        n = TokenCounts.of([out])
        return cls(input_tokens=n.prompt - n.cached, output_tokens=n.completion, cache_read_input_tokens=n.cached)


class MessageResponse(BaseModel):
    """A ``Message`` object (``type: "message"``)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


# ---------------------------------------------------------------------------- request conversion


def _result_text(block: ToolResultBlockParam, where: str) -> str:
    text = content_text(block.content, f"{where}.content", "messages", sep="\n")
    return f"Error: {text}" if block.is_error else text


def _reasoning_effort(body: CountTokensRequest) -> tuple[str | None, str]:
    """The reasoning effort a Messages request asks for, and its field: ``output_config.effort`` as given, else
    from ``thinking``: ``disabled`` -> low (Harmony always reasons; low is the least), a ``budget_tokens``
    below 4096 -> low, below 16384 -> medium, larger -> high; ``adaptive`` or no budget -> none (the
    template's default)."""
    if body.output_config is not None and body.output_config.effort is not None:
        return body.output_config.effort, "output_config.effort"
    t = body.thinking
    if t is None or t.type == "adaptive":
        return None, "thinking"
    if t.type == "disabled":
        return "low", "thinking"
    if t.budget_tokens is None:
        return None, "thinking"
    return ("low" if t.budget_tokens < 4096 else "medium" if t.budget_tokens < 16384 else "high"), "thinking"


def to_chat_spec(body: CountTokensRequest) -> ChatSpec:
    """Convert an Anthropic request into the shared :class:`ChatSpec` (OpenAI-style messages).

    Raises:
        APIError: 400 for an unsupported content block (named ``messages[i].content[j]``), an empty content list
            (``messages[i].content``) but in a final assistant message, or a client tool without ``input_schema``.
    """
    system = [body.system] if isinstance(body.system, str) else [b.text for b in body.system or []]
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        final_assistant = m.role == "assistant" and i == len(body.messages) - 1
        if isinstance(m.content, list) and not m.content and not final_assistant:
            raise APIError(400, f"messages[{i}].content: at least one content block is required (only a final "
                           "assistant message may be empty)", param="messages")
        blocks = [TextBlockParam(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        texts, reasoning, calls = [], [], []
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            if isinstance(b, (TextBlockParam, OtherBlockParam)) and b.type in TEXT_BLOCKS:
                texts.append(part_text(b.model_dump(), where, "messages"))
            elif m.role == "user" and isinstance(b, ToolResultBlockParam):
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b, where)})
            elif m.role == "assistant" and isinstance(b, ThinkingBlockParam):
                reasoning.append(b.thinking)
            elif m.role == "assistant" and isinstance(b, RedactedThinkingBlockParam):
                continue  # opaque, nothing a local model can read
            elif m.role == "assistant" and isinstance(b, ToolUseBlockParam):
                args = json.dumps(b.input, ensure_ascii=False)
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}})
            else:
                raise APIError(400, f"{where}: {b.type!r} blocks are not supported in {m.role} messages",
                               param="messages")
        text = "\n\n".join(texts)
        if m.role == "system":
            if messages:
                messages.append({"role": "system", "content": text})
            else:
                system.append(text)
        elif m.role == "user":
            if texts or isinstance(m.content, str):
                messages.append({"role": "user", "content": text})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "\n\n".join(reasoning)
            messages.append(msg)
    system_text = "\n\n".join(t for t in system if t)
    if system_text:
        messages.insert(0, {"role": "system", "content": system_text})
    for k, t in enumerate(body.tools or []):
        if t.input_schema is None and t.type in (None, "custom"):
            raise APIError(400, f"tools[{k}].input_schema: Field required (a client tool needs its JSON schema)",
                           param="tools")
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                          "parameters": t.input_schema, **({"strict": True} if t.strict else {})}}
        for t in body.tools or []
        if t.input_schema is not None and not t.defer_loading
    ]
    choice: str | dict = "auto"
    if body.tool_choice is not None:
        choice = ({"auto": "auto", "any": "required", "none": "none"}.get(body.tool_choice.type)
                  or {"name": body.tool_choice.name})
        if isinstance(choice, dict) and not choice["name"]:
            raise APIError(400, "tool_choice.name: required when tool_choice.type is 'tool'", param="tool_choice")
    kwargs = None
    if body.thinking is not None:
        kwargs = {"enable_thinking": body.thinking.type != "disabled"}
    effort, param = _reasoning_effort(body)
    kwargs = with_reasoning_effort(kwargs, effort, param)
    sampling: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        sampling = {
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences or None,
        }
    return ChatSpec(
        messages=messages,
        tools=tools or None,
        tool_choice=choice,
        output_schema=(body.output_config.format.schema_ or {"type": "object"})
        if body.output_config is not None and body.output_config.format is not None else None,
        output_field="output_config.format",
        chat_template_kwargs=kwargs,
        sampling=sampling,
        field_names={"stop": "stop_sequences"},
        parallel_tool_calls=not (body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use),
    )


# ---------------------------------------------------------------------------- responses


def _stop(out: RequestOutput, has_tool_use: bool) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished output."""
    c = out.outputs[0]
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return ("tool_use" if has_tool_use else "end_turn"), None


def _tool_input(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def message_content(parsed: ParsedOutput, ids: CallIds | None = None) -> list[dict[str, Any]]:
    """Content blocks of a whole response: thinking, text, then tool_use blocks (ids from ``ids``, else
    random; a call whose arguments are not a JSON object is returned as text, so nothing is lost)."""
    ids = ids if ids is not None else CallIds(None, "toolu")
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    text = parsed.content or ""
    uses = []
    for call in parsed.tool_calls:
        value = _tool_input(call.arguments)
        if value is None:
            text += f"{call.name}({call.arguments})"
        else:
            uses.append({"type": "tool_use", "id": ids.get(call.index, call.name, call.call_id), "name": call.name,
                         "input": value})
    if text:
        blocks.append({"type": "text", "text": text})
    return blocks + uses


def _sse(event: dict[str, Any]) -> str:
    return sse_event(event["type"], json.dumps(event, ensure_ascii=False))


async def _stream(serving: Serving, prepared: Prepared, model: str) -> AsyncIterator[str]:
    """The Anthropic event stream of one request."""
    msg_id = prepared.request_id
    n_prompt = len(prepared.prompt_ids)
    index = -1
    block: tuple | None = None  # ("thinking" | "text", None) or ("tool_use", call index)
    has_tool_use = False
    finished = False
    ids = prepared.call_ids("toolu")

    def start(content_block: dict) -> str:
        nonlocal index
        index += 1
        return _sse({"type": "content_block_start", "index": index, "content_block": content_block})

    def stop() -> str:
        return _sse({"type": "content_block_stop", "index": index})

    try:
        yield _sse(
            {
                "type": "message_start",
                "message": MessageResponse(
                    id=msg_id, model=model, content=[], usage=Usage(input_tokens=n_prompt, output_tokens=0)
                ).model_dump(),
            }
        )
        async for events, out in serving.events(serving.generate(prepared), prepared.new_parser()):
            for e in events:
                key = (("tool_use", e.index) if e.kind == "tool_call"
                       else ("thinking" if e.kind == "reasoning" else "text", None))
                if key != block:
                    if block is not None:
                        yield stop()
                    block = key
                    if e.kind == "reasoning":
                        yield start({"type": "thinking", "thinking": "", "signature": ""})
                    elif e.kind == "content":
                        yield start({"type": "text", "text": ""})
                    else:
                        has_tool_use = True
                        yield start({"type": "tool_use", "id": ids.get(e.index, e.name or "", e.call_id),
                                     "name": e.name or "", "input": {}})
                if not e.text:
                    continue
                if e.kind == "reasoning":
                    delta = {"type": "thinking_delta", "thinking": e.text}
                elif e.kind == "content":
                    delta = {"type": "text_delta", "text": e.text}
                else:
                    delta = {"type": "input_json_delta", "partial_json": e.text}
                yield _sse({"type": "content_block_delta", "index": index, "delta": delta})
            if out.finished:
                finished = True
                if block is not None:
                    yield stop()
                reason, sequence = _stop(out, has_tool_use)
                yield _sse(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": Usage.of(out).model_dump(),
                    }
                )
                yield _sse({"type": "message_stop"})
    except Exception as exc:
        yield _sse({"type": "error", "error": {"type": "api_error", "message": stream_failure(exc)}})
    finally:
        if not finished:
            serving.llm.abort(prepared.request_id)


def router(serving: Serving) -> APIRouter:
    """The Anthropic routes over ``serving``."""
    api = APIRouter()
    # Bodies are parsed and validated off the event loop (json_body).
    messages_body = json_body(MessagesRequest, serving.config.max_messages)
    count_body = json_body(CountTokensRequest, serving.config.max_messages)

    @api.post("/v1/messages")
    async def messages(raw: Request, body: MessagesRequest = Depends(messages_body)):
        serving.check_model(body.model)
        serving.ready()
        reject_unsupported(body, UNSUPPORTED_OPTIONS)
        prepared = await serving.prepare(to_chat_spec(body), new_tool_call_id("msg"))
        if body.stream:
            return event_stream(_stream(serving, prepared, serving.name))
        try:
            out, parsed = await serving.run_whole(prepared, raw)
        except RequestFailedError as exc:
            raise request_failed(exc) from None
        content = message_content(parsed, prepared.call_ids("toolu"))
        reason, sequence = _stop(out, any(b["type"] == "tool_use" for b in content))
        resp = MessageResponse(
            id=prepared.request_id,
            model=serving.name,
            content=content,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=Usage.of(out),
        )
        return JSONResponse(resp.model_dump())

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest = Depends(count_body)):
        serving.check_model(body.model)
        serving.ready()
        rendered = await serving.render(to_chat_spec(body), bounded=False)  # a count has no context limit
        return {"input_tokens": len(rendered.prompt_ids)}

    return api
