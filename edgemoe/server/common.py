"""Pieces the three APIs (OpenAI chat/completions, Anthropic Messages, OpenAI Responses) share: the
error type, SSE framing, message-content flattening, token counts, finish reasons.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from edgemoe.engine.async_engine import RequestFailedError
from edgemoe.engine.llm_engine import RequestOutput

__all__ = [
    "IMAGE_NOTE",
    "SSE_DONE",
    "APIError",
    "TokenCounts",
    "content_text",
    "event_stream",
    "is_anthropic",
    "json_body",
    "openai_finish_reason",
    "part_text",
    "reject_unsupported",
    "request_failed",
    "sse_data",
    "sse_event",
    "stream_failure",
    "valid_unicode",
]

log = logging.getLogger(__name__)

IMAGE_NOTE = "[image omitted: this model reads text only]"
DOCUMENT_NOTE = "[document omitted: this model reads text only]"
SSE_DONE = "data: [DONE]\n\n"

# Content-part types whose text is read as is (OpenAI chat ``text``, Responses ``input_text`` /
# ``output_text`` / ``reasoning_text`` / ``summary_text`` / ``refusal``, Anthropic ``text``).
_TEXT_PARTS = ("text", "input_text", "output_text", "reasoning_text", "summary_text", "refusal")
# Image parts of the three APIs (OpenAI chat ``image_url``, Responses ``input_image``, Anthropic ``image``).
_IMAGE_PARTS = ("image_url", "input_image", "image")
_SURROGATE = re.compile("[\ud800-\udfff]")

# Integer request fields, bounded so that no value can overflow the sampler's 64-bit tensors.
# what a 64-bit generator takes, signed or unsigned; strict: a boolean, a float or a numeric string is not a seed
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**64 - 1)]
TopK = Annotated[int, Field(ge=-(2**31), lt=2**31)]
MaxTokens = Annotated[int, Field(lt=2**63)]


class APIError(Exception):
    """An error returned to the client (in the shape of the API that was called).

    Args:
        status: HTTP status code.
        message: human-readable message.
        type: OpenAI error type (``invalid_request_error``, ``server_error``, ...); the Anthropic
            type is derived from ``status``.
        param: the offending request field, if any.
        code: a machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


class ContextLengthError(APIError):
    """400: a prompt that can never fit (``context_length_exceeded``).

    Attributes:
        prompt_tokens: tokens in the prompt.
        limit: the largest prompt accepted.
        anthropic_message: the wording Anthropic clients parse (``prompt is too long: N tokens > M maximum``).
    """

    def __init__(self, message: str, param: str, prompt_tokens: int, limit: int):
        super().__init__(400, message, param=param, code="context_length_exceeded")
        self.prompt_tokens, self.limit = prompt_tokens, limit
        self.anthropic_message = f"prompt is too long: {prompt_tokens} tokens > {limit} maximum"


def valid_unicode(value: Any) -> Any:
    """Replace lone UTF-16 surrogates (``"\\ud800"`` in JSON, which Python decodes but no UTF-8 text can
    hold) by U+FFFD in every string and key of a parsed JSON value, in place (dicts and lists).

    JavaScript clients produce them by cutting a string between the two halves of a surrogate pair.
    """
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(isinstance(k, str) and _SURROGATE.search(k) for k in node):
                items = [(valid_unicode(k) if isinstance(k, str) else k, v) for k, v in node.items()]
                node.clear()
                node.update(items)
            for k, v in node.items():
                if isinstance(v, str):
                    if _SURROGATE.search(v):
                        node[k] = _SURROGATE.sub("\ufffd", v)
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    if _SURROGATE.search(v):
                        node[i] = _SURROGATE.sub("\ufffd", v)
                elif isinstance(v, (dict, list)):
                    stack.append(v)
    return value


class RequestBody(BaseModel):
    """Base of the top-level request bodies of the three APIs: unknown fields are accepted (SDKs send
    newer parameters) and text is made valid Unicode before validation (:func:`valid_unicode`), so no
    field, ``model`` included, can carry a lone surrogate into the tokenizer or a response."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return valid_unicode(data)


Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], raw: bytes, items_field: str | None, max_items: int) -> Body:
    """``raw`` parsed as JSON and validated as ``model``, with the number of conversation items
    (``items_field``: ``messages``, or Responses' ``input``; ``None``: none) checked first, so an oversized list is
    refused before pydantic validates every item of it (seconds for 100k messages).

    Raises:
        RequestValidationError: no body, malformed JSON or a bad field (a 400 naming it, as FastAPI's own).
        APIError: 400 for more than ``max_items`` items or JSON nested too deeply.
    """
    if not raw.strip():
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from None
    except UnicodeDecodeError as exc:
        raise APIError(400, f"Malformed JSON body: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise APIError(400, "Malformed JSON body: nested too deeply") from None
    items = data.get(items_field) if isinstance(data, dict) and items_field else None
    if isinstance(items, list) and len(items) > max_items:
        raise APIError(400, f"{items_field}: {len(items)} messages; at most {max_items} are accepted "
                            "(--max-messages)", param=items_field)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                      for e in exc.errors(include_url=False)]) from None
    except RecursionError:
        raise APIError(400, "Request body: nested too deeply") from None


def json_body(model: type[Body], max_items: int, items_field: str | None = "messages",
              ) -> Callable[[Request], Coroutine[Any, Any, Body]]:
    """A FastAPI dependency giving the request body as ``model``, parsed and validated on a worker
    thread (:func:`parse_body`) instead of the event loop, where FastAPI does it: the loop serves other
    clients meanwhile, except while one C call of the parse holds the GIL (``json.loads``, pydantic-core's
    validation: up to ~1 s for 8 MiB of small objects, against the whole parse, 2-3 s, on the loop).
    Use as ``body: Model = Depends(json_body(Model, limit))``."""

    async def dependency(request: Request) -> Body:
        raw = await request.body()
        return await asyncio.to_thread(parse_body, model, raw, items_field, max_items)

    return dependency


def reject_unsupported(body: BaseModel, options: dict[str, tuple]) -> None:
    """Refuse an option the server cannot honour rather than ignore it.

    Args:
        body: the request (its declared fields and, as unknown fields are accepted, the extra ones).
        options: option name → the values besides ``null`` that ask for nothing (what SDKs send by
            default, e.g. ``0`` for a penalty).

    Raises:
        APIError: 400 naming the first option set to another value.
    """
    given = {**(body.model_extra or {}), **{k: getattr(body, k) for k in type(body).model_fields}}
    for name, neutral in options.items():
        value = given.get(name)
        if value is not None and not any(value == v for v in neutral):
            accepted = "".join(f" or {json.dumps(v)}" for v in neutral)
            raise APIError(400, f"{name}: not supported by this server; omit it (or send null{accepted})",
                           param=name)


def part_text(part: Any, where: str, param: str) -> str:
    """The text of one content part or block: its text, or :data:`IMAGE_NOTE` for an image (the
    models served read text only).

    Raises:
        APIError: 400 naming ``where`` for a part of another type or a text that is not a string.
    """
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS:
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise APIError(400, f"{where}.{key}: must be a string", param=param)
        return part[key]
    if kind in _IMAGE_PARTS:
        return IMAGE_NOTE
    if kind == "document":
        return _document_text(part, where, param)
    raise APIError(400, f"{where}: content parts of type {kind!r} are not supported", param=param)


def _document_text(block: dict, where: str, param: str) -> str:
    """An Anthropic ``document`` block: its title, context and text (``source.type`` ``text``, or
    ``content`` blocks); a PDF or a URL becomes :data:`DOCUMENT_NOTE`."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text":
        if not isinstance(source.get("data"), str):
            raise APIError(400, f"{where}.source.data: must be a string", param=param)
        body = source["data"]
    elif kind == "content":
        body = content_text(source.get("content"), f"{where}.source.content", param, sep="\n\n")
    elif kind in ("base64", "url", "file"):
        body = DOCUMENT_NOTE
    else:
        raise APIError(400, f"{where}.source.type: documents of type {kind!r} are not supported", param=param)
    head = [block[k] for k in ("title", "context") if isinstance(block.get(k), str) and block[k]]
    return "\n\n".join([*head, body])


def content_text(content: str | list[Any] | None, where: str, param: str, sep: str = "") -> str:
    """Flatten a message's content (a string or a list of parts/blocks, see :func:`part_text`) into the
    text a chat template reads.

    Args:
        content: the content (``None`` reads as empty).
        where: its path in the request, for errors (``messages[2].content``).
        param: the top-level field reported as the error's ``param``.
        sep: what joins parts (``""`` for OpenAI, which concatenates; ``"\\n\\n"`` for Anthropic blocks).

    Raises:
        APIError: 400 naming ``where[k]`` for a part :func:`part_text` rejects.
    """
    if content is None or isinstance(content, str):
        return content or ""
    return sep.join(part_text(part, f"{where}[{k}]", param) for k, part in enumerate(content))


@dataclass(frozen=True)
class TokenCounts:
    """Token usage of one or more finished requests.

    Attributes:
        prompt: prompt tokens.
        completion: generated tokens.
        cached: prompt tokens whose KV came from the prefix cache (part of ``prompt``).
    """

    prompt: int
    completion: int
    cached: int

    @classmethod
    def of(cls, outs: Iterable[RequestOutput]) -> TokenCounts:
        outs = list(outs)
        return cls(sum(o.num_prompt_tokens for o in outs), sum(o.num_generated_tokens for o in outs),
                   sum(o.cached_tokens for o in outs))


def is_anthropic(scope: dict) -> bool:
    """Whether a request speaks Anthropic's API: ``/v1/messages...``, or ``/v1/models...`` with the
    ``anthropic-version`` header every Anthropic SDK sends (the OpenAI SDK sends none)."""
    path = scope.get("path", "")
    if path.startswith("/v1/messages"):
        return True
    return path.startswith("/v1/models") and any(k == b"anthropic-version" for k, _ in scope.get("headers") or ())


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason in OpenAI's terms (an aborted request reports ``stop``)."""
    return "stop" if reason == "abort" else reason


def request_failed(exc: RequestFailedError) -> APIError:
    """The 500 of a request the engine failed (other requests go on)."""
    return APIError(500, f"the request failed: {exc}", type="server_error", code="internal_error")


def stream_failure(exc: Exception) -> str:
    """The message of an error that ended a stream after its first event (logged unless the engine
    reported it as a failure of this request)."""
    if isinstance(exc, RequestFailedError):
        return f"the request failed: {exc}"
    log.exception("stream failed", exc_info=exc)
    return f"internal error: {type(exc).__name__}: {exc}"


def sse_data(data: str) -> str:
    """One SSE event without a name (OpenAI chat/completions: ``data: {...}``)."""
    return f"data: {data}\n\n"


def sse_event(name: str, data: str) -> str:
    """One named SSE event (Anthropic and Responses: ``event: NAME`` then ``data: {...}``)."""
    return f"event: {name}\ndata: {data}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """An SSE response over ``events`` (``text/event-stream``, not cached, not buffered by proxies)."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
