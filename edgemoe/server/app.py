"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`~edgemoe.engine.async_engine.AsyncLLM`.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE
streaming), ``GET /health`` (503 while the model loads, 200 when ready) and ``GET /metrics``
(Prometheus). Every error uses OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:
invalid JSON or fields are 400 (FastAPI's 422 is remapped) naming the field, a prompt that can never
fit is 400 at once, an unknown model 404, a failure inside one request 500 for that request only.
A client that disconnects (streaming or not) aborts its request, freeing its KV pages.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgemoe import __version__
from edgemoe.engine.async_engine import AsyncLLM, EngineNotReadyError, RequestFailedError
from edgemoe.engine.llm import render_chat
from edgemoe.engine.llm_engine import PromptTooLongError, RequestOutput
from edgemoe.engine.sampling import SamplingParams, SamplingParamsError
from edgemoe.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    new_id,
)
from edgemoe.server.reasoning import ReasoningSplitter, prompt_ends_in_reasoning, split_reasoning

__all__ = ["APIError", "build_app", "serve"]

log = logging.getLogger(__name__)

SYSTEM_FINGERPRINT = f"edgemoe-{__version__}"
_DISCONNECT_POLL_S = 0.5
# pydantic adds the tried union member to an error's loc (``prompt.list[int]``); not a field name.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple|set|union|literal)\[.*\]|function-.*)$")


class APIError(Exception):
    """An error returned to the client in OpenAI's shape.

    Args:
        status: HTTP status code.
        message: human-readable message.
        type: OpenAI error type (``invalid_request_error``, ``server_error``, ...).
        param: the offending request field, if any.
        code: a machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


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


def _usage(out: RequestOutput) -> UsageInfo:
    return UsageInfo(**out.usage)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming the first bad field, and that field's dotted path."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"Malformed JSON body: {detail or err.get('msg', '')}".strip(), None
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Union members appear as extra loc parts (e.g. prompt.str); keep the request-field path.
    field = loc[0] if loc else None
    path = ".".join(p for p in loc if not _UNION_TAG.match(p))
    msg = err.get("msg", "invalid value")
    if field is None:
        return f"Request body: {msg}", None
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 and err.get("type") != "missing" else ""
    return f"{path or field}: {msg}{more}", field


def build_app(llm: AsyncLLM, served_model_name: str | None = None) -> FastAPI:
    """Create the FastAPI app serving ``llm``.

    Args:
        llm: the async engine (it may still be loading; routes answer 503 until it is ready).
        served_model_name: the model id clients use (default: the model directory's name).
    """
    name = served_model_name or (Path(llm.model_dir).name if llm.model_dir else "edgemoe")
    app = FastAPI(title="edgemoe", version=__version__)
    app.state.llm = llm
    app.state.served_model_name = name

    # ------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(EngineNotReadyError)
    async def _not_ready(_: Request, exc: EngineNotReadyError):
        return APIError(503, str(exc), type="service_unavailable_error", code="model_not_ready").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        log.exception("request failed")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    # ------------------------------------------------------------ helpers

    def ready_llm() -> AsyncLLM:
        if not llm.is_ready:
            msg = f"model failed to load: {llm.load_error}" if llm.load_error else "the model is still loading"
            raise EngineNotReadyError(msg)
        return llm

    def check_model(model: str | None) -> None:
        if model is not None and model not in (name, llm.model_dir):
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def sampling_params(body, max_tokens: int | None) -> SamplingParams:
        if body.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {body.n}", param="n")
        if body.logprobs:
            raise APIError(400, "logprobs: not supported by this server", param="logprobs")
        try:
            return body.to_sampling_params(max_tokens)
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.field) from None

    def admit(prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        try:
            ready_llm().check_prompt(prompt_ids, params)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    async def until_done(gen: AsyncIterator[RequestOutput], raw: Request) -> RequestOutput:
        """Consume a non-streamed request; abort it if the client goes away."""

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

    def request_failed(exc: RequestFailedError) -> APIError:
        return APIError(500, f"the request failed: {exc}", type="server_error", code="internal_error")

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

    @app.get("/v1/models")
    async def models() -> ModelList:
        max_len = llm.max_model_len if llm.is_ready else None
        return ModelList(data=[ModelCard(id=name, root=llm.model_dir, max_model_len=max_len)])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        engine = ready_llm()
        params = sampling_params(body, body.effective_max_tokens)
        try:
            prompt_text, prompt_ids = render_chat(
                engine.tokenizer, body.messages, tools=body.tools, chat_template_kwargs=body.chat_template_kwargs
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except jinja2.TemplateError as exc:  # e.g. the template's raise_exception on a bad role order
            raise APIError(400, f"messages: the chat template failed: {exc}", param="messages") from None
        admit(prompt_ids, params, "messages")
        request_id = new_id("chatcmpl")
        in_think = prompt_ends_in_reasoning(prompt_text)
        gen = engine.generate(prompt_ids, params, request_id)
        if body.stream:
            return StreamingResponse(
                _chat_stream(engine, gen, request_id, name, in_think, body.include_usage),
                media_type="text/event-stream",
            )
        try:
            out = await until_done(gen, raw)
        except RequestFailedError as exc:
            raise request_failed(exc) from None
        reasoning, content = split_reasoning(out.outputs[0].text, in_think)
        message = ChatMessage(content=content, reasoning_content=reasoning)
        resp = ChatCompletionResponse(
            id=request_id,
            model=name,
            choices=[ChatCompletionChoice(message=message, finish_reason=_finish_reason(out.outputs[0].finish_reason))],
            usage=_usage(out),
            system_fingerprint=SYSTEM_FINGERPRINT,
        )
        return JSONResponse(resp.model_dump(exclude_none=False))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        engine = ready_llm()
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
            outs = await until_done(_gather(gens), raw) if len(gens) > 1 else [await until_done(gens[0], raw)]
        except RequestFailedError as exc:
            raise request_failed(exc) from None
        choices = [
            CompletionChoice(index=i, text=echoes[i] + o.outputs[0].text, finish_reason=_finish_reason(o.outputs[0].finish_reason))
            for i, o in enumerate(outs)
        ]
        usage = UsageInfo(
            prompt_tokens=sum(o.num_prompt_tokens for o in outs),
            completion_tokens=sum(o.num_generated_tokens for o in outs),
        )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        resp = CompletionResponse(
            id=request_id, model=name, choices=choices, usage=usage, system_fingerprint=SYSTEM_FINGERPRINT
        )
        return JSONResponse(resp.model_dump())

    return app


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


async def _chat_stream(
    llm: AsyncLLM,
    gen: AsyncIterator[RequestOutput],
    request_id: str,
    model: str,
    in_think: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())

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

    splitter = ReasoningSplitter(in_think)
    final = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for out in gen:
            c = out.outputs[0]
            reasoning, content = splitter.feed(c.delta_text)
            if out.finished:
                r2, c2 = splitter.flush()
                reasoning, content = reasoning + r2, content + c2
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            if delta:
                yield chunk(delta)
            if out.finished:
                final = out
                yield chunk({}, _finish_reason(c.finish_reason))
        if include_usage and final is not None:
            yield _sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=_usage(final),
                    system_fingerprint=SYSTEM_FINGERPRINT,
                )
            )
    except RequestFailedError as exc:
        yield _sse({"error": {"message": f"the request failed: {exc}", "type": "server_error", "code": "internal_error"}})
    finally:
        if final is None:
            llm.abort(request_id)  # idempotent; covers a client that went away
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
            p = sum(o.num_prompt_tokens for o in finals.values())
            g = sum(o.num_generated_tokens for o in finals.values())
            yield _sse(
                CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=UsageInfo(prompt_tokens=p, completion_tokens=g, total_tokens=p + g),
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
    prefill_chunk_tokens: int | None = None,
    log_level: str = "info",
    on_ready=None,
) -> None:
    """Load ``model_dir`` in the background and serve it until interrupted (blocking).

    ``/health`` answers 503 until the weights are loaded; ``on_ready(engine)`` runs once they are.
    """
    import uvicorn

    from edgemoe.config import EngineConfig
    from edgemoe.engine.llm_engine import DEFAULT_PREFILL_CHUNK_TOKENS

    config = config or EngineConfig()
    llm = AsyncLLM(
        model_dir,
        config,
        prefill_chunk_tokens=prefill_chunk_tokens or DEFAULT_PREFILL_CHUNK_TOKENS,
        on_ready=on_ready,
    )
    app = build_app(llm, config.served_model_name)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        llm.shutdown()
