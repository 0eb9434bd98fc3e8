"""Engine-side request state and the outputs returned to callers (vLLM's shapes).

Below both the scheduler and the engine, so neither imports the other for these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from edgemoe.engine.sampling import SamplingParams

__all__ = [
    "CompletionOutput",
    "IncrementalDetokenizer",
    "PromptTooLongError",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
]


class PromptTooLongError(ValueError):
    """The prompt can never be served: longer than ``max_model_len - 1`` tokens or than the KV cache.

    Attributes:
        prompt_len: tokens in the prompt.
        limit: the largest prompt accepted.
    """

    def __init__(self, message: str, prompt_len: int, limit: int):
        super().__init__(message)
        self.prompt_len = prompt_len
        self.limit = limit


@dataclass
class RequestMetrics:
    """Per-request timestamps in seconds of ``time.perf_counter()`` (``None`` until reached).

    Attributes:
        arrival_time: when ``add_request`` accepted it.
        first_scheduled_time: first time it entered a batch.
        first_token_time: when its first output token was sampled.
        finish_time: when it finished (any reason).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token (s)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Arrival to finish (s)."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's ``CompletionOutput``).

    Attributes:
        index: choice index (always 0: one sequence per request).
        text: output text so far (stop string excluded; held back while it may be a stop prefix).
        token_ids: all output token ids so far (a final EOS/stop token included).
        finish_reason: ``None`` while running, else ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
        stop_reason: the stop string or stop token id that ended it (``None`` for EOS/length).
        delta_text: text added since the previous output of this request (for streaming).
        delta_token_ids: token ids added since the previous output.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (vLLM's ``RequestOutput``).

    Attributes:
        request_id: the caller's id.
        prompt: prompt text when the request was given as text, else ``None``.
        prompt_token_ids: the prompt's token ids.
        outputs: ``[CompletionOutput]`` (one sequence).
        finished: True once the request is done (then ``outputs[0].finish_reason`` is set).
        metrics: timestamps (``RequestMetrics``).
        error: message of the exception that failed this request (finish reason ``"error"``).
        cached_tokens: prompt tokens whose KV came from the prefix cache (not computed) when the
            request was first admitted; 0 before admission or without prefix caching.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    cached_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.outputs[0].token_ids)

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI-style token usage: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``."""
        p, c = self.num_prompt_tokens, self.num_generated_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class IncrementalDetokenizer:
    """Turns output token ids into text one token at a time, never emitting a broken UTF-8 character.

    Uses ``tokenizers.decoders.DecodeStream`` (the Rust streaming decoder) seeded with the prompt's
    last tokens (so e.g. a SentencePiece leading space decodes as in the full text); falls back to
    re-decoding all output ids and holding back a trailing U+FFFD for tokenizers without a Rust core.
    """

    _CONTEXT = 6

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._rust = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if self._rust is not None:
            from tokenizers.decoders import DecodeStream

            try:
                self._stream = DecodeStream(
                    ids=list(prompt_token_ids[-self._CONTEXT :]), skip_special_tokens=skip_special_tokens
                )
            except TypeError:  # tokenizers without the ``ids`` argument
                self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._text = ""

    def step(self, token_id: int) -> str:
        """Add one token; return the newly complete text (``""`` while a character is incomplete)."""
        if self._stream is not None:
            return self._stream.step(self._rust, token_id) or ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return ""
        new, self._text = text[len(self._text) :], text
        return new


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one request.

    Attributes:
        seq_id: runner sequence id while admitted (``None`` while waiting); a fresh id per admission.
        num_computed: tokens of ``prompt + output`` whose KV the runner holds.
        num_cached_tokens: tokens taken from the prefix cache at the latest admission (prefill
            started there).
        cached_tokens: prompt tokens taken from the prefix cache at the first admission (reported in
            usage); ``None`` before it.
        prefill_done: all tokens but the last sampled one are in the KV cache (decode phase).
        isolate_until: a failed batch dropped its recurrent state: its prefill steps run alone until this
            many tokens are computed again (past the failed step), so a request that fails again fails alone.
        text: detokenized output (after stop-string truncation); ``emitted_chars`` of it were returned.
        emitted_tokens: output token ids already returned.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: "SamplingParams"
    generator: "torch.Generator | None"
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    seq_id: int | None = None
    num_computed: int = 0
    num_cached_tokens: int = 0
    cached_tokens: int | None = None
    prefill_done: bool = False
    isolate_until: int = 0
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + output."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]
