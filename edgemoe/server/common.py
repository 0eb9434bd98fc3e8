"""Pieces the three APIs (OpenAI chat/completions, Anthropic Messages, OpenAI Responses) share: the
error type, SSE framing, message-content flattening, token counts, finish reasons.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from edgemoe.engine.async_engine import RequestFailedError
from edgemoe.engine.llm_engine import RequestOutput

__all__ = [
    "IMAGE_NOTE",
    "SSE_DONE",
    "APIError",
    "TokenCounts",
    "content_text",
    "event_stream",
    "openai_finish_reason",
    "part_text",
    "request_failed",
    "sse_data",
    "sse_event",
    "stream_failure",
]

IMAGE_NOTE = "[image omitted: this model reads text only]"
SSE_DONE = "data: [DONE]\n\n"

# Content-part types whose text is read as is (OpenAI chat ``text``, Responses ``input_text`` /
# ``output_text`` / ``reasoning_text`` / ``summary_text`` / ``refusal``, Anthropic ``text``).
_TEXT_PARTS = ("text", "input_text", "output_text", "reasoning_text", "summary_text", "refusal")
# Image parts of the three APIs (OpenAI chat ``image_url``, Responses ``input_image``, Anthropic ``image``).
_IMAGE_PARTS = ("image_url", "input_image", "image")


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
    raise APIError(400, f"{where}: content parts of type {kind!r} are not supported", param=param)


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


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason in OpenAI's terms (an aborted request reports ``stop``)."""
    return "stop" if reason == "abort" else reason


def request_failed(exc: RequestFailedError) -> APIError:
    """The 500 of a request the engine failed (other requests go on)."""
    return APIError(500, f"the request failed: {exc}", type="server_error", code="internal_error")


def stream_failure(exc: Exception) -> str:
    """The message of an error that ended a stream after its first event."""
    return f"the request failed: {exc}"


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
