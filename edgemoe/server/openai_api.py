"""The OpenAI routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models``.

What is served (field names and event shapes follow the ``openai`` SDK's types):

- chat: ``messages`` (``system`` / ``developer`` / ``user`` / ``assistant`` / ``tool``; content as a
  string or parts: ``text``, images become an ``[image omitted]`` note), assistant ``tool_calls`` and
  reasoning (``reasoning_content`` or vLLM's ``reasoning``), ``tools`` and ``tool_choice``,
  ``response_format``, ``chat_template_kwargs``, the sampling fields of :mod:`edgemoe.server.protocol`;
  answers with ``reasoning_content``, ``content`` and ``tool_calls`` (finish reason ``tool_calls``),
  streamed as deltas (a call's first delta carries its id, type and name, then pieces of arguments);
- completions: one prompt or a batch (texts or token ids), ``echo``, streaming;
- models: ``GET /v1/models`` and ``GET /v1/models/{id}`` for every served name, in OpenAI's shape with
  Anthropic's fields beside, or in Anthropic's shape for a client sending ``anthropic-version``
  (every Anthropic SDK does); ``max_model_len`` added.

Usage counts the prompt tokens served from the prefix cache as ``prompt_tokens_details.cached_tokens``.
A stream ends with ``data: [DONE]``; a failure after its first event is an ``{"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from edgemoe import __version__
from edgemoe.engine.async_engine import AsyncLLM, RequestFailedError
from edgemoe.engine.llm_engine import RequestOutput
from edgemoe.engine.sampling import SamplingParams, SamplingParamsError
from edgemoe.server.common import (
    SSE_DONE,
    APIError,
    TokenCounts,
    content_text,
    event_stream,
    is_anthropic,
    json_body,
    openai_finish_reason,
    reject_unsupported,
    request_failed,
    sse_data,
    stream_failure,
)
from edgemoe.server.parsers import ParseEvent
from edgemoe.server.protocol import (
    UNSUPPORTED_CHAT_OPTIONS,
    UNSUPPORTED_COMPLETION_OPTIONS,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageParam,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ToolCallOut,
    UsageInfo,
    new_id,
)
from edgemoe.server.serving import CallIds, ChatSpec, Prepared, Serving, with_reasoning_effort

__all__ = ["SYSTEM_FINGERPRINT", "chat_messages", "router"]

SYSTEM_FINGERPRINT = f"edgemoe-{__version__}"


def chat_messages(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """OpenAI request messages → the dicts chat templates read.

    ``developer`` becomes ``system``; content parts are flattened to text (images become a note);
    tool-call arguments become JSON strings; assistant reasoning (``reasoning_content`` or
    ``reasoning``) is passed as ``reasoning_content``; an assistant turn without text keeps
    ``content=None``.

    Raises:
        APIError: 400 for a content part that is neither text nor an image (named ``messages[i].content[j]``).
    """
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        reasoning = d.pop("reasoning", None)
        if reasoning is not None and "reasoning_content" not in d:
            d["reasoning_content"] = reasoning
        for tc in d.get("tool_calls") or []:
            fn = tc["function"]
            if not isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
        if "content" in d:
            d["content"] = content_text(d["content"], f"messages[{i}].content", "messages")
        else:
            d["content"] = None if d["role"] == "assistant" else ""
        out.append(d)
    return out


def _usage(outs: list[RequestOutput]) -> UsageInfo:
    n = TokenCounts.of(outs)
    return UsageInfo(prompt_tokens=n.prompt, completion_tokens=n.completion, total_tokens=n.prompt + n.completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=n.cached))


def _sse(obj: BaseModel, include_usage: bool = True) -> str:
    """One chunk. A null ``usage`` is sent only with ``stream_options.include_usage`` (as OpenAI does)."""
    drop_usage = not include_usage and getattr(obj, "usage", 0) is None
    return sse_data(obj.model_dump_json(exclude={"usage"} if drop_usage else None))


def _error_event(exc: Exception) -> str:
    info = ErrorInfo(message=stream_failure(exc), type="server_error", code="internal_error")
    return sse_data(ErrorResponse(error=info).model_dump_json())


def router(serving: Serving) -> APIRouter:
    """The OpenAI routes over ``serving``."""
    api = APIRouter()
    # Bodies are parsed and validated off the event loop (json_body).
    chat_body = json_body(ChatCompletionRequest, serving.config.max_messages)
    completion_body = json_body(CompletionRequest, serving.config.max_messages, items_field=None)

    def sampling_params(body: CompletionRequest, max_tokens: int | None) -> SamplingParams:
        if body.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {body.n}", param="n")
        if body.logprobs:
            raise APIError(400, "logprobs: not supported by this server", param="logprobs")
        reject_unsupported(body, UNSUPPORTED_COMPLETION_OPTIONS)
        try:
            return body.to_sampling_params(max_tokens, serving.generation_defaults)
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.field) from None

    created = int(time.time())
    created_at = datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def card(name: str) -> ModelCard:
        llm = serving.llm
        return ModelCard(id=name, created=created, root=llm.model_dir, display_name=name, created_at=created_at,
                         max_model_len=llm.max_model_len if llm.is_ready else None)

    def anthropic_card(name: str) -> dict[str, Any]:
        return {"type": "model", "id": name, "display_name": name, "created_at": created_at}

    @api.get("/v1/models")
    async def models(raw: Request):
        """Every served name (the first is the one responses report), in the shape the client speaks."""
        names = serving.names
        if is_anthropic(raw.scope):
            return {"data": [anthropic_card(n) for n in names], "has_more": False, "first_id": names[0],
                    "last_id": names[-1]}
        return ModelList(data=[card(n) for n in names], first_id=names[0], last_id=names[-1])

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str, raw: Request):
        serving.check_model(model_id)
        name = model_id if model_id in serving.names else serving.name
        return anthropic_card(name) if is_anthropic(raw.scope) else card(name)

    @api.post("/v1/chat/completions")
    async def chat_completions(raw: Request, body: ChatCompletionRequest = Depends(chat_body)):
        serving.check_model(body.model)
        serving.ready()
        if body.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {body.n}", param="n")
        if body.logprobs:
            raise APIError(400, "logprobs: not supported by this server", param="logprobs")
        reject_unsupported(body, UNSUPPORTED_CHAT_OPTIONS)
        choice = body.tool_choice or "auto"
        spec = ChatSpec(
            messages=chat_messages(body.messages),
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            tool_choice={"name": choice.function.name} if not isinstance(choice, str) else choice,
            output_schema=body.response_format.schema() if body.response_format is not None else None,
            chat_template_kwargs=with_reasoning_effort(body.chat_template_kwargs, body.reasoning_effort,
                                                       "reasoning_effort"),
            sampling=body.sampling_fields(body.effective_max_tokens),
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )
        prepared = await serving.prepare(spec, new_id("chatcmpl"))
        if body.stream:
            return event_stream(_chat_stream(serving, prepared, body.include_usage))
        try:
            out, parsed = await serving.run_whole(prepared, raw)
        except RequestFailedError as exc:
            raise request_failed(exc) from None
        ids = prepared.call_ids()
        calls = [
            ToolCallOut(id=ids.get(c.index, c.name, c.call_id), function={"name": c.name, "arguments": c.arguments})
            for c in parsed.tool_calls
        ]
        message = ChatMessage(content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=calls or None)
        reason = openai_finish_reason(out.outputs[0].finish_reason)
        resp = ChatCompletionResponse(
            id=prepared.request_id,
            model=serving.name,
            choices=[ChatCompletionChoice(message=message,
                                          finish_reason="tool_calls" if calls and reason == "stop" else reason)],
            usage=_usage([out]),
            system_fingerprint=SYSTEM_FINGERPRINT,
        )
        return JSONResponse(resp.model_dump(exclude_none=False))

    @api.post("/v1/completions")
    async def completions(raw: Request, body: CompletionRequest = Depends(completion_body)):
        serving.check_model(body.model)
        engine = serving.ready()
        params = sampling_params(body, body.max_tokens)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt: at least one prompt is required", param="prompt")
        items: list[tuple[str, list[int]]] = []
        for p in prompts:
            if isinstance(p, str):
                items.append((p, await asyncio.to_thread(serving.encode_prompt, p, "prompt", True)))  # off the loop
            else:
                items.append((engine.tokenizer.decode(p) if body.echo else "", list(p)))
            serving.admit(items[-1][1], params, "prompt")
        request_id = new_id("cmpl")
        gens = [engine.generate(ids, params, f"{request_id}-{i}") for i, (_, ids) in enumerate(items)]
        echoes = [text if body.echo else "" for text, _ in items]
        if body.stream:
            return event_stream(_completion_stream(engine, gens, echoes, request_id, serving.name, body.include_usage))
        try:
            if len(gens) > 1:
                outs = await serving.until_done(_gather(gens), raw)
            else:
                outs = [await serving.until_done(gens[0], raw)]
        except RequestFailedError as exc:
            raise request_failed(exc) from None
        choices = [
            CompletionChoice(index=i, text=echoes[i] + o.outputs[0].text,
                             finish_reason=openai_finish_reason(o.outputs[0].finish_reason))
            for i, o in enumerate(outs)
        ]
        resp = CompletionResponse(id=request_id, model=serving.name, choices=choices, usage=_usage(outs),
                                  system_fingerprint=SYSTEM_FINGERPRINT)
        return JSONResponse(resp.model_dump())

    return api


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as ``(index, output)``; closing it aborts them all."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await q.put((i, out))
        except Exception as exc:
            await q.put((i, exc))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _gather(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[list[RequestOutput]]:
    """Yield once: the final output of every stream, in order."""
    finals: dict[int, RequestOutput] = {}
    async for i, out in _merge(gens):
        if out.finished:
            finals[i] = out
    yield [finals[i] for i in range(len(gens))]


def _tool_call_deltas(events: list[ParseEvent], ids: CallIds) -> list[dict[str, Any]]:
    """OpenAI ``delta.tool_calls`` entries for the tool-call events of one step (merged per call;
    a call's first entry carries its id, type and name)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e.kind != "tool_call":
            continue
        if e.index not in ids:
            out.append({"index": e.index, "id": ids.get(e.index, e.name or "", e.call_id), "type": "function",
                        "function": {"name": e.name or "", "arguments": e.text}})
        elif out and out[-1]["index"] == e.index:
            out[-1]["function"]["arguments"] += e.text
        elif e.text:
            out.append({"index": e.index, "function": {"arguments": e.text}})
    return out


async def _chat_stream(serving: Serving, prepared: Prepared, include_usage: bool) -> AsyncIterator[str]:
    created, request_id, model = int(time.time()), prepared.request_id, serving.name

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        return _sse(
            ChatCompletionStreamResponse(
                id=request_id, created=created, model=model,
                choices=[ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)],
                system_fingerprint=SYSTEM_FINGERPRINT,
            ),
            include_usage,
        )

    ids = prepared.call_ids()
    final = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for events, out in serving.events(serving.generate(prepared), prepared.new_parser()):
            delta: dict[str, Any] = {}
            reasoning = "".join(e.text for e in events if e.kind == "reasoning")
            content = "".join(e.text for e in events if e.kind == "content")
            calls = _tool_call_deltas(events, ids)
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            if delta:
                yield chunk(delta)
            if out.finished:
                final = out
                reason = openai_finish_reason(out.outputs[0].finish_reason)
                yield chunk({}, "tool_calls" if ids and reason == "stop" else reason)
        if include_usage and final is not None:
            yield _sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                    usage=_usage([final]), system_fingerprint=SYSTEM_FINGERPRINT))
    except Exception as exc:
        yield _error_event(exc)
    finally:
        if final is None:
            serving.llm.abort(request_id)  # idempotent; covers a client that went away
    yield SSE_DONE


async def _completion_stream(
    llm: AsyncLLM,
    gens: list[AsyncIterator[RequestOutput]],
    echoes: list[str],
    request_id: str,
    model: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(i: int, text: str, finish_reason: str | None = None) -> str:
        return _sse(
            CompletionStreamResponse(
                id=request_id, created=created, model=model,
                choices=[CompletionChoice(index=i, text=text, finish_reason=finish_reason)],
                system_fingerprint=SYSTEM_FINGERPRINT,
            ),
            include_usage,
        )

    finals: dict[int, RequestOutput] = {}
    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk(i, echo)
        async for i, out in _merge(gens):
            c = out.outputs[0]
            if c.delta_text:
                yield chunk(i, c.delta_text)
            if out.finished:
                finals[i] = out
                yield chunk(i, "", openai_finish_reason(c.finish_reason))
        if include_usage:
            yield _sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                usage=_usage(list(finals.values())),
                                                system_fingerprint=SYSTEM_FINGERPRINT))
    except Exception as exc:
        yield _error_event(exc)
    finally:
        if len(finals) < len(gens):
            for i in range(len(gens)):
                llm.abort(f"{request_id}-{i}")
    yield SSE_DONE
