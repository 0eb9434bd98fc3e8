"""Pydantic models of the OpenAI-compatible HTTP API (chat and text completions; requests in,
responses out). The Anthropic Messages and OpenAI Responses models live in ``messages_api.py`` and
``responses_api.py``.

Requests accept and ignore unknown fields (``extra="allow"``) so SDKs sending newer parameters keep
working; lone surrogates in any string become U+FFFD (:class:`~edgemoe.server.common.RequestBody`).
Ranges are checked by :class:`~edgemoe.engine.sampling.SamplingParams` (one source of truth),
types by pydantic. ``presence_penalty`` / ``frequency_penalty`` (and vLLM's ``repetition_penalty``) are applied
by the engine (:func:`~edgemoe.engine.sampling.apply_penalties`). Options the server cannot honour
(``logit_bias``, ``top_logprobs``, legacy ``functions``, audio, ...: :data:`UNSUPPORTED_CHAT_OPTIONS`) are a
400 naming them unless they ask for nothing (``logit_bias: {}``); ``reasoning_effort`` becomes the chat
template's ``reasoning_effort`` (gpt-oss's Harmony template reads it).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgemoe.engine.sampling import SamplingParams
from edgemoe.server.common import MaxTokens, RequestBody, Seed, TopK

__all__ = [
    "UNSUPPORTED_CHAT_OPTIONS",
    "UNSUPPORTED_COMPLETION_OPTIONS",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "ChatMessageParam",
    "ChatTool",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "StreamOptions",
    "ToolCallOut",
    "UsageInfo",
    "sampling_kwargs",
]


UNSUPPORTED_CHAT_OPTIONS: dict[str, tuple] = {
    "logit_bias": ({},),
    "top_logprobs": (0,),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
}
"""Chat-completion options this server cannot honour → the values besides ``null`` that ask for nothing
(``reject_unsupported``): any other value is a 400 naming the option."""
UNSUPPORTED_COMPLETION_OPTIONS: dict[str, tuple] = {"logit_bias": ({},), "best_of": (1,), "suffix": ("",)}
"""The same for text completions."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


def sampling_kwargs(defaults: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    """:class:`SamplingParams` keyword arguments: ``fields`` whose value is ``None`` fall back to
    ``defaults`` (generation_config.json) and then to the OpenAI defaults (temperature 1, top_p 1,
    top_k off, no penalties)."""
    base = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, **(defaults or {})}
    out = dict(fields)
    for key, value in base.items():
        if out.get(key) is None:
            out[key] = value
    return out


class FunctionDef(_Request):
    """A function tool's definition (``parameters`` is its JSON schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    """``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDef


class _FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    """``{"type": "function", "function": {"name": ...}}``: the model must call this function."""

    type: Literal["function"] = "function"
    function: _FunctionName


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: ``name``, ``schema`` (enforced by structured output), ``strict``."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``: JSON mode (any JSON
    object) or one JSON value following the schema, both enforced by structured output."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow (``None`` for text)."""
        if self.type == "text":
            return None
        if self.type == "json_schema" and self.json_schema is not None and self.json_schema.schema_ is not None:
            return self.json_schema.schema_
        return {"type": "object"}


class ToolCallFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(_Request):
    """A tool call in an assistant message of the history."""

    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessageParam(_Request):
    """One message of ``messages``. ``content`` is a string or a list of text parts; assistant turns
    may carry ``tool_calls`` and their reasoning (``reasoning_content``, or vLLM's newer
    ``reasoning``); tool turns answer a ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _SamplingFields(RequestBody):
    """Fields shared by chat and text completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension

    def to_sampling_params(self, max_tokens: int | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Build engine sampling parameters (raises ``SamplingParamsError`` naming a bad field).

        ``defaults`` (the checkpoint's ``generation_config.json`` temperature/top_p/top_k) fill the
        fields the request omits."""
        return SamplingParams(**sampling_kwargs(defaults, **self.sampling_fields(max_tokens)))

    def sampling_fields(self, max_tokens: int | None) -> dict[str, Any]:
        """The request's sampling fields by :class:`SamplingParams` name (``None`` where omitted)."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body. ``max_completion_tokens`` wins over ``max_tokens``;
    neither = up to the context limit."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    reasoning_effort: str | None = None

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body: one prompt (text or token ids) or a batch of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: MaxTokens | None = 16
    echo: bool = False
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ToolCallOut(BaseModel):
    """``{"id", "type": "function", "function": {"name", "arguments"}}`` in a response message."""

    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = None


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    """An OpenAI-style id such as ``chatcmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """A model in OpenAI's shape (``id``, ``object``, ``created``, ``owned_by``) with Anthropic's fields
    beside (``type``, ``display_name``, ``created_at``), so either SDK reads it; ``max_model_len`` is
    the context length."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "edgemoe"
    root: str | None = None
    max_model_len: int | None = None
    type: Literal["model"] = "model"
    display_name: str = ""
    created_at: str = ""


class ModelList(BaseModel):
    """OpenAI's model list, with Anthropic's pagination fields (one page)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
