"""HTTP server (FastAPI + uvicorn) over :class:`~edgemoe.engine.async_engine.AsyncLLM`: the OpenAI
and Anthropic APIs that coding agents speak.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (tools, tool calls, reasoning, JSON mode),
``POST /v1/completions``, ``POST /v1/responses`` (OpenAI Responses, ``responses_api.py``),
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic Messages,
``messages_api.py``), all streaming with SSE; ``GET /health`` (503 while the model loads, 200 when
ready) and ``GET /metrics`` (Prometheus). The chat APIs share one pipeline (``serving.py``) and the
output parsers of ``parsers/``.

Errors use the shape of the API that was called: OpenAI's ``{"error": {"message", "type", "param",
"code"}}``, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``.
Invalid JSON or fields are 400 (FastAPI's 422 is remapped) naming the field, a prompt that can never
fit is 400 at once, an unknown model 404, a failure inside one request 500 for that request only.
With an API key set, every ``/v1/`` route needs it (``Authorization: Bearer KEY`` or
``x-api-key: KEY``; 401 otherwise); ``/health`` and ``/metrics`` stay open. A client that disconnects
(streaming or not) aborts its request, freeing its KV pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgemoe import __version__
from edgemoe.config import EXPERT_POLICIES
from edgemoe.engine.async_engine import AsyncLLM, EngineNotReadyError, RequestFailedError
from edgemoe.engine.llm import render_chat
from edgemoe.engine.llm_engine import PromptTooLongError, RequestOutput
from edgemoe.engine.sampling import SamplingParams, SamplingParamsError
from edgemoe.server import messages_api, responses_api
from edgemoe.server.parsers import ParseEvent, check_parser_names
from edgemoe.server.protocol import (
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
from edgemoe.server.serving import APIError, ChatSpec, Prepared, Serving, new_tool_call_id

__all__ = ["APIError", "build_app", "serve"]

log = logging.getLogger(__name__)

SYSTEM_FINGERPRINT = f"edgemoe-{__version__}"
ADMIN_TIMEOUT_S = 300.0  # a resize may place a static policy's layers: GBs of copies


class ExpertCacheResize(BaseModel):
    """Body of ``POST /admin/expert-cache``: a new budget (``gb`` or ``slots``) and/or ``policy``."""

    model_config = {"extra": "forbid"}
    gb: float | None = Field(None, ge=0, allow_inf_nan=False, description="expert-cache budget in GB (1e9 bytes)")
    slots: int | None = Field(None, ge=0, description="expert-cache size in (layer, expert) slots")
    policy: Literal[EXPERT_POLICIES] | None = Field(None, description="expert policy (default: unchanged)")
# pydantic adds the tried union member to an error's loc (``prompt.list[int]``, ``tool_choice.ChatTool``);
# not a field name.
_UNION_TAG = re.compile(
    r"^(str|int|float|bool|none|(list|dict|tuple|set|union|literal)\[.*\]|function-.*|[A-Z][A-Za-z0-9]*)$"
)
# Anthropic error types by HTTP status.
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, exc: APIError) -> JSONResponse:
    """``exc`` as a JSON response in the error shape of the API at ``path``."""
    if _is_anthropic(path):
        kind = _ANTHROPIC_ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
        body: dict = {"type": "error", "error": {"type": kind, "message": exc.message}}
    else:
        body = ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.code)).model_dump()
    return JSONResponse(body, status_code=exc.status)


def _sse(obj: BaseModel | dict, include_usage: bool = True) -> str:
    """One SSE event. A null ``usage`` is sent only with ``stream_options.include_usage`` (as OpenAI does)."""
    if isinstance(obj, BaseModel):
        drop_usage = not include_usage and getattr(obj, "usage", 0) is None
        data = obj.model_dump_json(exclude={"usage"} if drop_usage else None)
    else:
        data = ErrorResponse.model_validate(obj).model_dump_json()
    return f"data: {data}\n\n"


def _finish_reason(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length") else "stop" if reason == "abort" else reason


def _usage(outs: list[RequestOutput]) -> UsageInfo:
    """Token usage of one or more requests (``prompt_tokens_details.cached_tokens``: prefix-cache hits)."""
    p = sum(o.num_prompt_tokens for o in outs)
    c = sum(o.num_generated_tokens for o in outs)
    cached = PromptTokensDetails(cached_tokens=sum(o.cached_tokens for o in outs))
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, prompt_tokens_details=cached)


def _loc_path(parts: list) -> str:
    """``["messages", 0, "content"]`` → ``messages[0].content``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming the first bad field (``messages[0].role: Field required``), and the top-level field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    # A union reports one error per member: the deepest one on the same field is the informative one.
    top = tuple(err.get("loc", ()))[:2]
    err = max((e for e in errors if tuple(e.get("loc", ()))[:2] == top), key=lambda e: len(e.get("loc", ())))
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"Malformed JSON body: {detail or err.get('msg', '')}".strip(), None
    loc = [p for p in err.get("loc", ()) if p != "body"]
    # Union members appear as extra loc parts (e.g. prompt.str); keep the request-field path.
    field = str(loc[0]) if loc else None
    path = _loc_path([p for p in loc if isinstance(p, int) or not _UNION_TAG.match(str(p))])
    msg = err.get("msg", "invalid value")
    if field is None:
        return f"Request body: {msg}", None
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 and err.get("type") != "missing" else ""
    return f"{path or field}: {msg}{more}", field


class _ApiKeyMiddleware:
    """Pure-ASGI check of the API key on ``/v1/`` routes (``Authorization: Bearer`` or ``x-api-key``).

    Pure ASGI (not ``BaseHTTPMiddleware``) so streaming and disconnect detection are untouched.
    """

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith(("/v1/", "/admin/")):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given is not None and secrets.compare_digest(given, self.api_key):
            return await self.app(scope, receive, send)
        message = "Invalid API key" if given is not None else "Missing API key (Authorization: Bearer KEY or x-api-key: KEY)"
        err = APIError(401, message, type="invalid_request_error", code="invalid_api_key")
        return await error_response(scope["path"], err)(scope, receive, send)


def chat_messages(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """OpenAI request messages → the dicts chat templates read.

    ``developer`` becomes ``system``; tool-call arguments become JSON strings; assistant reasoning
    (``reasoning_content`` or ``reasoning``) is passed as ``reasoning_content``; an assistant turn
    without text keeps ``content=None``.
    """
    out = []
    for m in messages:
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
        if "content" not in d:
            d["content"] = None if d["role"] == "assistant" else ""
        out.append(d)
    return out


def build_app(
    llm: AsyncLLM,
    served_model_name: str | None = None,
    *,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """Create the FastAPI app serving ``llm``.

    Args:
        llm: the async engine (it may still be loading; routes answer 503 until it is ready).
        served_model_name: the model id clients use (default: the model directory's name).
        tool_call_parser / reasoning_parser: parser names (``edgemoe.server.parsers``); ``None`` or
            ``"auto"`` detects them from the checkpoint.
        api_key: when set, every ``/v1/`` and ``/admin/`` route requires it (without one, keep the
            server on a loopback address: ``/admin/`` changes the expert cache).

    Raises:
        ValueError: an unknown parser name.
    """
    check_parser_names(tool_call_parser, reasoning_parser)
    name = served_model_name or (Path(llm.model_dir).name if llm.model_dir else "edgemoe")
    app = FastAPI(title="edgemoe", version=__version__)
    serving = Serving(
        llm,
        name,
        tool_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        render=lambda *a, **kw: render_chat(*a, **kw),  # looked up per call (tests patch it)
    )
    app.state.llm = llm
    app.state.served_model_name = name
    app.state.serving = serving
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    # ------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(EngineNotReadyError)
    async def _not_ready(request: Request, exc: EngineNotReadyError):
        return error_response(request.url.path, APIError(503, str(exc), type="service_unavailable_error", code="model_not_ready"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(request.url.path, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request.url.path, APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("request failed")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return error_response(request.url.path, err)

    # ------------------------------------------------------------ helpers

    def sampling_params(body, max_tokens: int | None) -> SamplingParams:
        if body.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {body.n}", param="n")
        if body.logprobs:
            raise APIError(400, "logprobs: not supported by this server", param="logprobs")
        try:
            return body.to_sampling_params(max_tokens, serving.generation_defaults)
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.field) from None

    def admit(prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        try:
            serving.ready().check_prompt(prompt_ids, params)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    # ------------------------------------------------------------ routes

    @app.get("/health")
    async def health():
        if llm.is_ready:
            return {"status": "ok"}
        if llm.load_error is not None:
            return JSONResponse({"status": "error", "message": str(llm.load_error)}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    def metrics():  # sync: runs in the thread pool, may wait for the engine thread's stats
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/expert-cache")
    def expert_cache_state():  # sync: waits for the engine thread
        """The expert cache's size, policy, bandwidths and counters (``ModelRunner.expert_stats``)."""
        return llm.call_in_engine_thread(lambda e: e.runner.expert_stats(), ADMIN_TIMEOUT_S)

    @app.post("/admin/expert-cache")
    def expert_cache_resize(body: ExpertCacheResize):
        """Change the expert cache's GPU budget (``gb`` or ``slots``) and/or its ``policy`` at run time.

        Runs on the engine thread between two steps (a safe point): requests in flight continue with
        the new cache. 400 when the size cannot be allocated (the previous cache is kept).
        """
        def resize(engine):
            try:
                return engine.runner.resize_expert_cache(body.gb, body.slots, body.policy)
            except ValueError as exc:
                raise APIError(400, str(exc)) from None

        return llm.call_in_engine_thread(resize, ADMIN_TIMEOUT_S)

    @app.get("/v1/models")
    async def models() -> ModelList:
        max_len = llm.max_model_len if llm.is_ready else None
        return ModelList(data=[ModelCard(id=name, root=llm.model_dir, max_model_len=max_len)])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        serving.check_model(body.model)
        serving.ready()
        if body.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {body.n}", param="n")
        if body.logprobs:
            raise APIError(400, "logprobs: not supported by this server", param="logprobs")
        choice = body.tool_choice or "auto"
        spec = ChatSpec(
            messages=chat_messages(body.messages),
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            tool_choice={"name": choice.function.name} if not isinstance(choice, str) else choice,
            json_mode=body.response_format is not None and body.response_format.type != "text",
            chat_template_kwargs=body.chat_template_kwargs,
            sampling=body.sampling_fields(body.effective_max_tokens),
        )
        prepared = await serving.prepare(spec, new_id("chatcmpl"))
        if body.stream:
            return StreamingResponse(
                _chat_stream(serving, prepared, name, body.include_usage), media_type="text/event-stream"
            )
        try:
            out, parsed = await serving.run_whole(prepared, raw)
        except RequestFailedError as exc:
            raise _request_failed(exc) from None
        calls = [
            ToolCallOut(id=new_tool_call_id(), function={"name": c.name, "arguments": c.arguments})
            for c in parsed.tool_calls
        ]
        message = ChatMessage(content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=calls or None)
        reason = _finish_reason(out.outputs[0].finish_reason)
        resp = ChatCompletionResponse(
            id=prepared.request_id,
            model=name,
            choices=[ChatCompletionChoice(message=message, finish_reason="tool_calls" if calls and reason == "stop" else reason)],
            usage=_usage([out]),
            system_fingerprint=SYSTEM_FINGERPRINT,
        )
        return JSONResponse(resp.model_dump(exclude_none=False))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        serving.check_model(body.model)
        engine = serving.ready()
        params = sampling_params(body, body.max_tokens)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt: at least one prompt is required", param="prompt")
        items: list[tuple[str, list[int]]] = []
        for p in prompts:
            if isinstance(p, str):
                items.append((p, engine.tokenizer.encode(p)))
            else:
                items.append((engine.tokenizer.decode(p) if body.echo else "", list(p)))
            admit(items[-1][1], params, "prompt")
        request_id = new_id("cmpl")
        gens = [engine.generate(ids, params, f"{request_id}-{i}") for i, (_, ids) in enumerate(items)]
        echoes = [text if body.echo else "" for text, _ in items]
        if body.stream:
            return StreamingResponse(
                _completion_stream(engine, gens, echoes, request_id, name, body.include_usage),
                media_type="text/event-stream",
            )
        try:
            if len(gens) > 1:
                outs = await serving.until_done(_gather(gens), raw)
            else:
                outs = [await serving.until_done(gens[0], raw)]
        except RequestFailedError as exc:
            raise _request_failed(exc) from None
        choices = [
            CompletionChoice(index=i, text=echoes[i] + o.outputs[0].text, finish_reason=_finish_reason(o.outputs[0].finish_reason))
            for i, o in enumerate(outs)
        ]
        resp = CompletionResponse(
            id=request_id, model=name, choices=choices, usage=_usage(outs), system_fingerprint=SYSTEM_FINGERPRINT
        )
        return JSONResponse(resp.model_dump())

    app.include_router(messages_api.router(serving))
    app.include_router(responses_api.router(serving))
    return app


def _request_failed(exc: RequestFailedError) -> APIError:
    return APIError(500, f"the request failed: {exc}", type="server_error", code="internal_error")


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as ``(index, output)``; closing it aborts them all."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await q.put((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
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


def _tool_call_deltas(events: list[ParseEvent], ids: dict[int, str]) -> list[dict[str, Any]]:
    """OpenAI ``delta.tool_calls`` entries for the tool-call events of one step (merged per call;
    a call's first entry carries its id, type and name)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e.kind != "tool_call":
            continue
        if e.index not in ids:
            ids[e.index] = new_tool_call_id()
            out.append({"index": e.index, "id": ids[e.index], "type": "function",
                        "function": {"name": e.name or "", "arguments": e.text}})
        elif out and out[-1]["index"] == e.index:
            out[-1]["function"]["arguments"] += e.text
        elif e.text:
            out.append({"index": e.index, "function": {"arguments": e.text}})
    return out


async def _chat_stream(serving: Serving, prepared: Prepared, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    request_id = prepared.request_id

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        return _sse(
            ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=model,
                choices=[ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)],
                system_fingerprint=SYSTEM_FINGERPRINT,
            ),
            include_usage,
        )

    ids: dict[int, str] = {}
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
                reason = _finish_reason(out.outputs[0].finish_reason)
                yield chunk({}, "tool_calls" if ids and reason == "stop" else reason)
        if include_usage and final is not None:
            yield _sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=_usage([final]),
                    system_fingerprint=SYSTEM_FINGERPRINT,
                )
            )
    except RequestFailedError as exc:
        yield _sse({"error": {"message": f"the request failed: {exc}", "type": "server_error", "code": "internal_error"}})
    finally:
        if final is None:
            serving.llm.abort(request_id)  # idempotent; covers a client that went away
    yield "data: [DONE]\n\n"


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
                id=request_id,
                created=created,
                model=model,
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
                yield chunk(i, "", _finish_reason(c.finish_reason))
        if include_usage:
            yield _sse(
                CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=_usage(list(finals.values())),
                    system_fingerprint=SYSTEM_FINGERPRINT,
                )
            )
    except RequestFailedError as exc:
        yield _sse({"error": {"message": f"the request failed: {exc}", "type": "server_error", "code": "internal_error"}})
    finally:
        if len(finals) < len(gens):
            for i in range(len(gens)):
                llm.abort(f"{request_id}-{i}")
    yield "data: [DONE]\n\n"


def serve(
    model_dir: str,
    config: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    on_ready=None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    api_key: str | None = None,
) -> None:
    """Load ``model_dir`` in the background and serve it until interrupted (blocking).

    ``/health`` answers 503 until the weights are loaded; ``on_ready(engine)`` runs once they are.
    If loading fails, the server stops at once and the error is raised.
    ``tool_call_parser`` / ``reasoning_parser`` / ``api_key``: see :func:`build_app`.

    Raises:
        EngineNotReadyError: the model failed to load (the message says why; the cause is chained).
    """
    import uvicorn

    from edgemoe.config import EngineConfig

    config = config or EngineConfig()
    server: uvicorn.Server | None = None

    def stop_serving(_exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    llm = AsyncLLM(model_dir, config, on_ready=on_ready, on_load_error=stop_serving, start=False)
    app = build_app(
        llm,
        config.served_model_name,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        api_key=api_key,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    llm.start()
    try:
        server.run()
    finally:
        llm.shutdown()
    if llm.load_error is not None:
        raise EngineNotReadyError(f"model failed to load: {llm.load_error}") from llm.load_error
