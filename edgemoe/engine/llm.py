"""Offline, vLLM-style front: ``LLM(model_dir).generate(prompts)`` / ``.chat(messages)``."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

from edgemoe.engine.llm_engine import LLMEngine, RequestOutput
from edgemoe.engine.sampling import SamplingParams

__all__ = ["LLM", "arguments_as_objects", "normalize_messages", "render_chat", "render_chat_text"]

Message = dict[str, Any]


def normalize_messages(messages: Sequence[Message]) -> list[Message]:
    """Copy chat messages, flattening OpenAI content-part lists (``[{"type": "text", "text": ...}]``)
    into plain strings, which every chat template understands.

    Raises:
        ValueError: a message is not a dict with a ``role``, or has a non-text content part; the
            message names the offending ``messages[i]`` field.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: each message must be an object with a string 'role'")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    raise ValueError(f"messages[{i}].content[{j}]: only text content parts are supported")
            m["content"] = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: must be a string, a list of text parts or null")
        out.append(m)
    return out


def render_chat_text(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation with the tokenizer's chat template, as text (see :func:`render_chat`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use a plain completion prompt")
    msgs = normalize_messages(messages)

    def apply(msgs: list[Message]) -> str:
        return tokenizer.apply_chat_template(
            msgs,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )

    # Assistant tool-call turns come with content=None and arguments as JSON strings (OpenAI's shape,
    # which e.g. DeepSeek-V3's template requires and Qwen3's prints verbatim); templates that apply
    # string operations to the content (Qwen3's) get "", then templates that iterate the arguments
    # as a mapping (GLM-4.5's ``arguments.items()``) get them decoded.
    attempts = [msgs]
    if any(m.get("content") is None for m in msgs):
        attempts.append([{**m, "content": ""} if m.get("content") is None else m for m in msgs])
    decoded = arguments_as_objects(attempts[-1])
    if decoded is not None:
        attempts.append(decoded)
    for i, attempt in enumerate(attempts):
        try:
            return apply(attempt)
        except Exception:
            if i == len(attempts) - 1:
                raise
    raise AssertionError("unreachable")


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> tuple[str, list[int]]:
    """Render a conversation with the tokenizer's chat template.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        messages: OpenAI-style messages (``role``, ``content``, optional ``tool_calls`` ...).
        tools: JSON-schema tool definitions handed to the template.
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}``.
        add_generation_prompt: end with the assistant turn's opening.

    An assistant message may carry ``content=None`` next to its ``tool_calls`` (kept for templates
    that test for it; rendered again with ``""`` when the template cannot take ``None``).

    Returns:
        ``(prompt_text, prompt_token_ids)``; the ids encode the text without adding special tokens
        again (the template wrote them).

    Raises:
        ValueError: no chat template, or malformed messages.
    """
    text = render_chat_text(tokenizer, messages, tools=tools, chat_template_kwargs=chat_template_kwargs,
                            add_generation_prompt=add_generation_prompt)
    return text, tokenizer.encode(text, add_special_tokens=False)


def arguments_as_objects(messages: list[Message]) -> list[Message] | None:
    """``messages`` with every tool call's JSON-string arguments decoded (those that decode to an
    object); ``None`` when there are none to decode."""
    out, changed = [], False
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            new_calls = []
            for tc in calls:
                fn = tc.get("function") if isinstance(tc, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str):
                    try:
                        value = json.loads(args) if args.strip() else {}
                    except ValueError:
                        value = None
                    if isinstance(value, dict):
                        tc, changed = {**tc, "function": {**fn, "arguments": value}}, True
                new_calls.append(tc)
            m = {**m, "tool_calls": new_calls}
        out.append(m)
    return out if changed else None


class LLM:
    """Generate from a model directory in-process (no server), batching all prompts together.

    Args:
        model_dir: Hugging Face checkpoint directory (or FTW).
        progress: show the weight-loading progress bar.
        **engine_options: fields of :class:`edgemoe.config.EngineConfig` (``device``,
            ``expert_cache_slots``, ``max_num_seqs``, ``max_model_len``, ...).

    Raises:
        TypeError: an unknown engine option (the message lists them and the valid names).
        ValueError: an invalid engine option value.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        progress: bool = True,
        **engine_options: Any,
    ):
        from edgemoe.config import EngineConfig

        config = EngineConfig.from_kwargs(**engine_options)
        self.engine = LLMEngine.from_model_dir(model_dir, config, progress=progress)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        """The model's ``transformers`` tokenizer (chat template inside)."""
        return self.engine.tokenizer

    @property
    def runner(self) -> Any:
        return self.engine.runner

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt concurrently; outputs come back in prompt order.

        Args:
            prompts: a text, a list of texts, one token-id list, or a list of token-id lists.
            sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
            use_tqdm: show a progress bar over finished requests.

        Returns:
            One finished :class:`RequestOutput` per prompt (``error`` set on the ones that failed).

        Raises:
            PromptTooLongError: a prompt can never fit (checked before any request starts).
            ValueError: mismatched ``sampling_params`` length, or a malformed prompt.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        elif prompts and all(isinstance(t, int) for t in prompts):
            prompts = [list(prompts)]  # one tokenized prompt
        items = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                items.append((p, self.tokenizer.encode(p)))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                items.append((None, list(p)))
            else:
                raise ValueError(f"prompts[{i}]: expected a string or a list of token ids")
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (rendered by
        :func:`render_chat` with the model's chat template). Same returns and errors as
        :meth:`generate`."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = [
            render_chat(
                self.tokenizer,
                conv,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
            )
            for conv in convs
        ]
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        for (_, ids), p in zip(items, params):
            self.engine.check_prompt(ids, p)
        ids = [
            self.engine.add_request(f"llm-{next(self._ids)}", tok_ids, p, prompt=text)
            for (text, tok_ids), p in zip(items, params)
        ]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # on KeyboardInterrupt etc.: free what is still running
                if rid not in done:
                    self.engine.abort(rid)
        return [done[rid] for rid in ids]
