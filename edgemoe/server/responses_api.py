"""The OpenAI Responses API: ``POST /v1/responses`` (stateless).

What is served (field names and event shapes follow the ``openai`` SDK's ``types.responses``):

- ``input`` as a string or a list of items: messages (``user`` / ``assistant`` / ``system`` /
  ``developer``; ``input_text`` / ``output_text`` parts, images become an ``[image omitted]`` note),
  ``function_call``, ``function_call_output`` and ``reasoning`` items (their ``reasoning_text``
  content or summary goes back to the template as the assistant's reasoning); ``instructions``;
- ``tools`` of type ``function`` and ``namespace`` (flattened into its functions; a call to one of
  them carries its ``namespace``); other types (``custom``, ``web_search``, ...) are a 400 naming the tool;
  ``tool_choice`` (``auto``, ``none``, ``required``, ``{"type": "function", "name"}``),
  ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (``json_object`` /
  ``json_schema``, enforced by structured output), ``reasoning`` (``effort`` becomes the chat template's
  ``reasoning_effort``, read by gpt-oss's Harmony template);
- output items ``reasoning`` (``reasoning_text`` content), ``message`` (``output_text``) and
  ``function_call``; ``status`` ``completed`` or ``incomplete`` (``max_output_tokens``); usage;
- streaming: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``,
  ``response.content_part.added``, ``response.reasoning_text.delta`` / ``response.output_text.delta``
  / ``response.function_call_arguments.delta``, the matching ``.done`` events,
  ``response.output_item.done``, and finally ``response.completed`` (or ``response.incomplete``); a
  failure mid-stream is an ``error`` event then ``response.failed``.

Responses are not stored: ``previous_response_id`` is a 400 (send the whole conversation, as Codex
does with ``store: false``).
"""

from __future__ import annotations

import json
import time
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
    Seed,
    TokenCounts,
    TopK,
    content_text,
    event_stream,
    json_body,
    reject_unsupported,
    request_failed,
    sse_event,
    stream_failure,
)
from edgemoe.server.parsers import ParsedOutput
from edgemoe.server.serving import CallIds, ChatSpec, Prepared, Serving, new_tool_call_id, with_reasoning_effort

__all__ = ["ResponsesRequest", "function_tools", "router", "to_chat_spec"]


class _In(BaseModel):
    model_config = ConfigDict(extra="allow")


class MessageItem(_In):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_In):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(_In):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningItem(_In):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None


class OtherItem(_In):
    type: str


# Item type → union tag (CamelCase, so validation errors do not show it as a field name).
_ITEMS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
          "reasoning": "Reasoning"}


def _item_tag(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type") or ("message" if "role" in value else None)
    else:
        kind = getattr(value, "type", None)
    return _ITEMS.get(kind, "Other")


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[ReasoningItem, Tag("Reasoning")]
    | Annotated[OtherItem, Tag("Other")],
    Discriminator(_item_tag),
]


class TextFormat(_In):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict``),
    enforced by structured output."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow (``None`` for text)."""
        if self.type == "text":
            return None
        return self.schema_ if self.type == "json_schema" and self.schema_ is not None else {"type": "object"}


class TextConfig(_In):
    format: TextFormat | None = None


class FunctionToolChoice(_In):
    type: Literal["function"]
    name: str


UNSUPPORTED_OPTIONS: dict[str, tuple] = {"top_logprobs": (0,), "conversation": (), "prompt": (), "background": (False,)}
"""Responses options this server cannot honour (stored conversations and prompts, background runs, logprobs) →
the values besides ``null`` that ask for nothing; any other is a 400 naming the option."""


class ResponsesRequest(RequestBody):
    """``POST /v1/responses`` body (unknown fields such as ``store``, ``include``, ``metadata`` are
    accepted and ignored)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(BaseModel):
    """A ``Response`` object (``object: "response"``)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------------------- request conversion


def function_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The request's tools as chat-template function tools, and the namespace of each function that came
    from a ``namespace`` tool (Codex groups e.g. its sub-agent functions so); a namespace is flattened
    into its functions.

    Raises:
        APIError: 400 naming the tool for a type this server cannot serve (``custom``, ``web_search``,
            ``file_search``, ...: OpenAI-hosted or free-form tools), a function without a name, or two
            functions of one name.
    """
    out: list[dict[str, Any]] = []
    namespace_of: dict[str, str] = {}

    def add(t: dict[str, Any], where: str, namespace: str | None) -> None:
        if t.get("type") != "function":
            inner = "in a namespace " if namespace is not None else ""
            raise APIError(400, f"{where}: tools of type {t.get('type')!r} {inner}are not supported by this server "
                                "(function tools and namespaces of them are)", param="tools")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.name: a function tool needs a string name", param="tools")
        if any(o["function"]["name"] == name for o in out):
            raise APIError(400, f"{where}.name: a second function named {name!r}", param="tools")
        out.append({"type": "function",
                    "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                 if t.get(k) is not None}})
        if namespace is not None:
            namespace_of[name] = namespace

    for i, t in enumerate(tools or []):
        if t.get("type") == "namespace":
            if not isinstance(t.get("name"), str) or not isinstance(t.get("tools"), list):
                raise APIError(400, f"tools[{i}]: a namespace needs a string name and a list of tools", param="tools")
            for j, sub in enumerate(t["tools"]):
                add(sub if isinstance(sub, dict) else {}, f"tools[{i}].tools[{j}]", t["name"])
        else:
            add(t, f"tools[{i}]", None)
    return out, namespace_of


def to_chat_spec(body: ResponsesRequest) -> ChatSpec:
    """Convert a Responses request into the shared :class:`ChatSpec`.

    Raises:
        APIError: 400 for an unsupported item or content part (named ``input[i]...``).
    """
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id: this server does not store responses; send the whole conversation in input",
            param="previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    assistant: dict[str, Any] | None = None  # the assistant turn being assembled
    reasoning: list[str] = []

    def open_assistant() -> dict[str, Any]:
        nonlocal assistant, reasoning
        assistant = {"role": "assistant", "content": None}
        if reasoning:
            assistant["reasoning_content"] = "\n\n".join(reasoning)
            reasoning = []
        messages.append(assistant)
        return assistant

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            parts = item.content or item.summary
            reasoning.append(content_text(parts, f"{where}.content", "input"))
        elif isinstance(item, FunctionCallItem):
            turn = assistant if assistant is not None else open_assistant()
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            turn.setdefault("tool_calls", []).append(call)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            turn = assistant if assistant is not None and not assistant.get("tool_calls") else open_assistant()
            turn["content"] = (turn["content"] or "") + content_text(item.content, f"{where}.content", "input")
        elif isinstance(item, MessageItem):
            assistant = None
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": content_text(item.content, f"{where}.content", "input")})
        elif isinstance(item, FunctionCallOutputItem):
            assistant = None
            output = content_text(item.output, f"{where}.output", "input")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            raise APIError(400, f"{where}: input items of type {item.type!r} are not supported", param="input")
    choice = body.tool_choice or "auto"
    fmt = body.text.format if body.text is not None else None
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise APIError(400, f"reasoning.effort: must be a string, got {effort!r}", param="reasoning.effort")
    return ChatSpec(
        messages=messages,
        tools=function_tools(body.tools)[0] or None,
        tool_choice=choice if isinstance(choice, str) else {"name": choice.name},
        output_schema=fmt.schema() if fmt is not None else None,
        output_field="text.format",
        chat_template_kwargs=with_reasoning_effort(None, effort, "reasoning.effort"),
        sampling={
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "seed": body.seed,
        },
        field_names={"max_tokens": "max_output_tokens"},
        messages_field="input",
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )


# ---------------------------------------------------------------------------- output


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, namespaces: dict[str, str],
               status: str = "completed") -> dict[str, Any]:
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    if name in namespaces:
        item["namespace"] = namespaces[name]
    return item


def output_items(parsed: ParsedOutput, namespaces: dict[str, str], ids: CallIds | None = None) -> list[dict[str, Any]]:
    """Output items of a whole response: reasoning, message, function calls (with the ``namespace`` of
    a function that came from one; their ``call_id`` from ``ids``, else random)."""
    ids = ids if ids is not None else CallIds(None)
    items = []
    if parsed.reasoning:
        items.append(_reasoning_item(new_tool_call_id("rs"), parsed.reasoning))
    if parsed.content:
        items.append(_message_item(new_tool_call_id("msg"), parsed.content))
    for call in parsed.tool_calls:
        items.append(_call_item(new_tool_call_id("fc"), ids.get(call.index, call.name, call.call_id), call.name,
                                call.arguments, namespaces))
    return items


class _Shell:
    """The request-dependent fields every Response object of one request repeats."""

    def __init__(self, body: ResponsesRequest, prepared: Prepared, model: str):
        self.body, self.prepared, self.model = body, prepared, model
        self.created = int(time.time())
        self.namespaces = function_tools(body.tools)[1]

    def response(self, status: str, output: list[dict[str, Any]], out: RequestOutput | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:
        b = self.body
        usage = None
        if out is not None:
            n = TokenCounts.of([out])
            usage = ResponseUsage(input_tokens=n.prompt, input_tokens_details={"cached_tokens": n.cached},
                                  output_tokens=n.completion, total_tokens=n.prompt + n.completion)
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        choice = b.tool_choice or "auto"
        return ResponseObject(
            id=self.prepared.request_id,
            created_at=self.created,
            status=status,
            error=error,
            incomplete_details=incomplete,
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            model=self.model,
            output=output,
            parallel_tool_calls=b.parallel_tool_calls if b.parallel_tool_calls is not None else True,
            reasoning=b.reasoning,
            temperature=b.temperature,
            text={"format": {"type": b.text.format.type if b.text and b.text.format else "text"}},
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            tools=list(b.tools or []),
            top_p=b.top_p,
            usage=usage,
        ).model_dump()


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


async def _stream(serving: Serving, prepared: Prepared, shell: _Shell) -> AsyncIterator[str]:
    """The Responses event stream of one request."""
    seq = 0
    output: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None  # {"kind", "key", "id", "text", "call_id", "name"}
    finished = False

    def ev(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        data = {"type": kind, "sequence_number": seq - 1, **fields}
        return sse_event(kind, json.dumps(data, ensure_ascii=False))

    ids = prepared.call_ids()

    def open_item(kind: str, key: tuple, name: str | None, written: str | None) -> list[str]:
        nonlocal cur
        idx = len(output)
        if kind == "reasoning":
            cur = {"kind": kind, "key": key, "id": new_tool_call_id("rs"), "text": ""}
            item = _reasoning_item(cur["id"], "", "in_progress")
            item["content"] = []
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "content":
            cur = {"kind": kind, "key": key, "id": new_tool_call_id("msg"), "text": ""}
            item = _message_item(cur["id"], "", "in_progress")
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            cur = {"kind": kind, "key": key, "id": new_tool_call_id("fc"), "text": "",
                   "call_id": ids.get(key[1], name or "", written), "name": name or ""}
            item, part = _call_item(cur["id"], cur["call_id"], cur["name"], "", shell.namespaces, "in_progress"), None
        output.append(item)
        events = [ev("response.output_item.added", output_index=idx, item=item)]
        if part is not None:
            events.append(ev("response.content_part.added", item_id=cur["id"], output_index=idx, content_index=0,
                             part=part))
        return events

    def close_item() -> list[str]:
        nonlocal cur
        if cur is None:
            return []
        idx, text, item_id = len(output) - 1, cur["text"], cur["id"]
        if cur["kind"] == "reasoning":
            item, part = _reasoning_item(item_id, text), {"type": "reasoning_text", "text": text}
            events = [ev("response.reasoning_text.done", item_id=item_id, output_index=idx, content_index=0, text=text)]
        elif cur["kind"] == "content":
            item, part = _message_item(item_id, text), {"type": "output_text", "text": text, "annotations": []}
            events = [ev("response.output_text.done", item_id=item_id, output_index=idx, content_index=0, text=text,
                         logprobs=[])]
        else:
            item, part = _call_item(item_id, cur["call_id"], cur["name"], text, shell.namespaces), None
            events = [ev("response.function_call_arguments.done", item_id=item_id, output_index=idx, name=cur["name"],
                         arguments=text)]
        if part is not None:
            events.append(ev("response.content_part.done", item_id=item_id, output_index=idx, content_index=0,
                             part=part))
        output[idx] = item
        events.append(ev("response.output_item.done", output_index=idx, item=item))
        cur = None
        return events

    try:
        start = shell.response("in_progress", [])
        yield ev("response.created", response=start)
        yield ev("response.in_progress", response=start)
        async for events, out in serving.events(serving.generate(prepared), prepared.new_parser()):
            for e in events:
                key = (e.kind, e.index)
                if cur is None or cur["key"] != key:
                    for s in close_item():
                        yield s
                    for s in open_item(e.kind, key, e.name, e.call_id):
                        yield s
                if not e.text:
                    continue
                cur["text"] += e.text
                idx, item_id = len(output) - 1, cur["id"]
                if e.kind == "reasoning":
                    yield ev("response.reasoning_text.delta", item_id=item_id, output_index=idx, content_index=0,
                             delta=e.text)
                elif e.kind == "content":
                    yield ev("response.output_text.delta", item_id=item_id, output_index=idx, content_index=0,
                             delta=e.text, logprobs=[])
                else:
                    yield ev("response.function_call_arguments.delta", item_id=item_id, output_index=idx, delta=e.text)
            if out.finished:
                finished = True
                for s in close_item():
                    yield s
                status = _status(out)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield ev(kind, response=shell.response(status, output, out))
    except Exception as exc:
        message = stream_failure(exc)
        yield ev("error", code="server_error", message=message, param=None)
        failed = shell.response("failed", output, error={"code": "server_error", "message": message})
        yield ev("response.failed", response=failed)
    finally:
        if not finished:
            serving.llm.abort(prepared.request_id)


def router(serving: Serving) -> APIRouter:
    """The Responses route over ``serving``."""
    api = APIRouter()
    # The body is parsed and validated off the event loop (json_body).
    responses_body = json_body(ResponsesRequest, serving.config.max_messages, items_field="input")

    @api.post("/v1/responses")
    async def responses(raw: Request, body: ResponsesRequest = Depends(responses_body)):
        serving.check_model(body.model)
        serving.ready()
        reject_unsupported(body, UNSUPPORTED_OPTIONS)
        prepared = await serving.prepare(to_chat_spec(body), new_tool_call_id("resp"))
        shell = _Shell(body, prepared, serving.name)
        if body.stream:
            return event_stream(_stream(serving, prepared, shell))
        try:
            out, parsed = await serving.run_whole(prepared, raw)
        except RequestFailedError as exc:
            raise request_failed(exc) from None
        return JSONResponse(shell.response(_status(out), output_items(parsed, shell.namespaces, prepared.call_ids()),
                                           out))

    return api
