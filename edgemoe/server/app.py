"""HTTP server (FastAPI + uvicorn) over :class:`~edgemoe.engine.async_engine.AsyncLLM`: the OpenAI
and Anthropic APIs that coding agents speak.

The app wires error handlers, the API-key check, ``GET /health`` (503 while the model loads, 200 when
ready), ``GET /metrics`` (Prometheus), ``/admin/memory`` (the GPU budget and the KV / expert split;
``/admin/expert-cache``, its expert side) and three routers: OpenAI chat
completions, completions and models (``openai_api.py``), Anthropic Messages (``messages_api.py``)
and OpenAI Responses (``responses_api.py``), all streaming with SSE. The chat APIs share one pipeline
(``serving.py``), the helpers of ``common.py`` and the output parsers of ``parsers/``.

Errors use the shape of the API that was called: OpenAI's ``{"error": {"message", "type", "param",
"code"}}``, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``.
Invalid JSON or fields are 400 (FastAPI's 422 is remapped) naming the field, a prompt that can never
fit is 400 at once, an unknown model 404, a failure inside one request 500 for that request only.
With an API key set, every ``/v1/`` and ``/admin/`` route needs it (``Authorization: Bearer KEY`` or
``x-api-key: KEY``; 401 otherwise); ``/health`` and ``/metrics`` stay open. A client that disconnects
(streaming or not) aborts its request, freeing its KV pages.
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgemoe import __version__
from edgemoe.config import EXPERT_POLICIES, EngineConfig
from edgemoe.engine.async_engine import AsyncLLM, EngineNotReadyError
from edgemoe.engine.gpu_memory import ResizeError
from edgemoe.server import messages_api, openai_api, responses_api
from edgemoe.server.common import APIError, ContextLengthError, is_anthropic
from edgemoe.server.config import ServerConfig
from edgemoe.server.metrics import gateway_registry
from edgemoe.server.protocol import ErrorInfo, ErrorResponse
from edgemoe.server.serving import Serving
from edgemoe.server.transport import RequestLimits, uvicorn_config

__all__ = ["build_app", "serve"]

log = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 300.0  # a resize may place a static policy's layers: GBs of copies


class ExpertCacheResize(BaseModel):
    """Body of ``POST /admin/expert-cache``: a new budget (``gb`` or ``slots``) and/or ``policy``; strict types
    (``true`` or ``"5"`` is no slot count)."""

    model_config = {"extra": "forbid", "strict": True}
    gb: float | None = Field(None, ge=0, allow_inf_nan=False,
                             description="expert-cache budget in GB (1e9 bytes; GPU only)")
    slots: int | None = Field(None, ge=0, description="expert-cache size in (layer, expert) slots")
    policy: Literal[EXPERT_POLICIES] | None = Field(None, description="expert policy (default: unchanged)")


class MemoryUpdate(BaseModel):
    """Body of ``POST /admin/memory``: any of the budget's settings (``GpuMemory.configure``); strict types."""

    model_config = {"extra": "forbid", "strict": True}
    auto: bool | None = Field(None, description="follow the device's free memory (true) or keep the budget fixed")
    budget_gb: float | None = Field(None, gt=0, allow_inf_nan=False,
                                    description="a fixed GPU budget in GB for the expert and KV caches (auto off)")
    headroom_gb: float | None = Field(None, ge=0, allow_inf_nan=False, description="device memory auto mode keeps free")
    expert_gb: float | None = Field(None, ge=0, allow_inf_nan=False, description="expert-cache size in GB")
    expert_slots: int | None = Field(None, ge=0, description="expert-cache size in (layer, expert) slots")
    min_expert_slots: int | None = Field(None, ge=0, description="floor the KV cache may take the expert cache down to")
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


def error_response(scope: dict, exc: APIError) -> JSONResponse:
    """``exc`` as a JSON response in the error shape of the API the request speaks (:func:`is_anthropic`)."""
    if is_anthropic(scope):
        kind = _ANTHROPIC_ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
        message = exc.anthropic_message if isinstance(exc, ContextLengthError) else exc.message
        body: dict = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        info = ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
        body = ErrorResponse(error=info).model_dump()
    return JSONResponse(body, status_code=exc.status)


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
        message = ("Invalid API key" if given is not None else
                   "Missing API key (Authorization: Bearer KEY or x-api-key: KEY)")
        err = APIError(401, message, type="invalid_request_error", code="invalid_api_key")
        return await error_response(scope, err)(scope, receive, send)


def build_app(llm: AsyncLLM, config: ServerConfig | None = None) -> FastAPI:
    """Create the FastAPI app serving ``llm``: error handlers, the API-key check, ``/health``,
    ``/metrics``, ``/admin/memory``, ``/admin/expert-cache`` and the routers of the three APIs.

    Args:
        llm: the async engine (it may still be loading; routes answer 503 until it is ready).
        config: the server's options (default ``ServerConfig()``). Without an API key, keep the server
            on a loopback address: ``/admin/`` changes the memory budget and the expert cache.
    """
    config = config or ServerConfig()
    app = FastAPI(title="edgemoe", version=__version__)
    serving = Serving(llm, config)
    app.state.serving = serving
    app.add_middleware(RequestLimits, max_bytes=config.max_request_bytes, body_timeout_s=config.body_timeout_s,
                       error_response=error_response)
    if config.api_key:  # outermost: a request without the key is refused before its body is read
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)

    # ------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.scope, exc)

    @app.exception_handler(EngineNotReadyError)
    async def _not_ready(request: Request, exc: EngineNotReadyError):
        err = APIError(503, str(exc), type="service_unavailable_error", code="model_not_ready")
        return error_response(request.scope, err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(request.scope, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request.scope, APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("request failed")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return error_response(request.scope, err)

    # ------------------------------------------------------------ routes

    @app.get("/health")
    async def health():
        if llm.is_ready:
            return {"status": "ok"}
        if llm.load_error is not None:
            return JSONResponse({"status": "error", "message": str(llm.load_error)}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    gateway = gateway_registry(llm, serving.name)

    @app.get("/metrics")
    def metrics():  # sync: runs in the thread pool, may wait for the engine thread's stats
        return Response(llm.metrics.render() + generate_latest(gateway), media_type=CONTENT_TYPE_LATEST)

    def in_engine(fn, given: dict | None = None):
        """Run ``fn(runner)`` on the engine thread between two steps (a safe point: requests in flight
        continue): a bad request is 400 (nothing changed), a resize that cannot be carried out 503
        (the previous state is kept), each with the reason; a 400's ``param`` is the request's field where it
        gave one only (``given``: the fields it set)."""
        def call(engine):
            try:
                return fn(engine.runner)
            except ResizeError as exc:
                raise APIError(503, str(exc), type="service_unavailable_error", code="resize_failed") from None
            except ValueError as exc:  # NoGpuError included
                param = next(iter(given)) if given and len(given) == 1 else None
                raise APIError(400, str(exc), param=param) from None

        return llm.call_in_engine_thread(call, ADMIN_TIMEOUT_S)

    @app.get("/admin/memory")
    def memory_state():  # sync: waits for the engine thread
        """The GPU budget, headroom, free memory, the KV / expert split and its recent history."""
        return in_engine(lambda runner: runner.memory.stats())

    @app.post("/admin/memory")
    def memory_update(body: MemoryUpdate):
        """Change the budget (``auto``, ``budget_gb``, ``headroom_gb``) and/or the expert cache
        (``expert_gb`` or ``expert_slots``, ``policy``, ``min_expert_slots``) at run time."""
        given = body.model_dump(exclude_none=True)
        if not given:
            raise APIError(400, f"give at least one of {', '.join(MemoryUpdate.model_fields)}")
        return in_engine(lambda runner: runner.memory.configure(**given), given)

    @app.get("/admin/expert-cache")
    def expert_cache_state():
        """The expert cache's size, policy, bandwidths and counters (``ModelRunner.expert_stats``)."""
        return in_engine(lambda runner: runner.expert_stats())

    @app.post("/admin/expert-cache")
    def expert_cache_resize(body: ExpertCacheResize):
        """Change the expert cache's GPU budget (``gb`` or ``slots``) and/or its ``policy`` at run time
        (the expert side of ``POST /admin/memory``)."""
        return in_engine(lambda runner: runner.resize_expert_cache(body.gb, body.slots, body.policy),
                         body.model_dump(exclude_none=True))

    app.include_router(openai_api.router(serving))
    app.include_router(messages_api.router(serving))
    app.include_router(responses_api.router(serving))
    return app


def serve(
    model_dir: str,
    engine_config: EngineConfig | None = None,
    server_config: ServerConfig | None = None,
    *,
    on_ready=None,
) -> None:
    """Load ``model_dir`` in the background and serve it until interrupted (blocking).

    ``/health`` answers 503 until the weights are loaded; ``on_ready(engine)`` runs once they are.
    If loading fails, the server stops at once and the error is raised.

    Raises:
        EngineNotReadyError: the model failed to load (the message says why; the cause is chained).
    """
    import uvicorn

    server_config = server_config or ServerConfig()
    server: uvicorn.Server | None = None

    def stop_serving(_exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    llm = AsyncLLM(model_dir, engine_config or EngineConfig(), on_ready=on_ready, on_load_error=stop_serving,
                   start=False)
    app = build_app(llm, server_config)
    server = uvicorn.Server(uvicorn_config(app, server_config))
    llm.start()
    try:
        server.run()
    finally:
        llm.shutdown()
    if llm.load_error is not None:
        raise EngineNotReadyError(f"model failed to load: {llm.load_error}") from llm.load_error
