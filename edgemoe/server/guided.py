"""Guided decoding: a logits processor that only lets the model write text a small grammar accepts.

Used for ``response_format: {"type": "json_object" | "json_schema"}`` (any JSON object) and for
``tool_choice: "required"`` / a named function (the family's tool-call markup around one JSON
object of arguments). A :class:`Grammar` is a sequence of segments, each a literal (one of several
texts) or one JSON object; its state after a prefix is a small hashable tuple. At each decode step
the processor advances the state over the tokens sampled so far and masks every token whose text
would leave the accepted language (:class:`TokenVocab` walks the sorted vocabulary, skipping every
token under a dead prefix with one bisection; masks are memoized per state). EOS is allowed only once
the grammar is complete. When the remaining token budget (``max_tokens``) gets within a small margin of the
text needed to close what is open, the output is closed with the longest tokens spelling the shortest
closing text, so it is complete JSON even when the model would ramble.

Limits (documented in docs/agents.md): the JSON *schema* of ``json_schema`` is not enforced (any
object is accepted); token texts are each token decoded alone, which is exact for byte-level BPE
(Qwen, DeepSeek, gpt-oss, Llama-3) — tokens that are only part of a UTF-8 character are never chosen.

A :class:`GuidedLogitsProcessor` rides in ``SamplingParams.logits_processors``; the engine applies it
to the request's logits row before sampling.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from edgemoe.server import json_prefix

__all__ = ["GuidedLogitsProcessor", "Grammar", "TokenVocab"]

log = logging.getLogger(__name__)

_MAX_CHAR = "\U0010ffff"
_WS = " \t\n\r"
_MASK_CACHE = 512
# Start closing this many tokens early: one free token can lengthen the closing text by up to this
# many characters (e.g. ``"},{"``) and the budget must still hold it.
_CLOSE_MARGIN = 8


@dataclass(frozen=True)
class Grammar:
    """A sequence of segments: ``("lit", (text, ...))`` (one of the texts; none a prefix of another)
    or ``("json", None)`` (one JSON object, written compactly: whitespace outside strings only as one space
    after ``:`` and ``,``, so a weak model cannot pad forever). State ``(segment index, sub-state)``; complete at
    ``(len(segments), None)``."""

    segments: tuple

    @classmethod
    def json_object(cls) -> "Grammar":
        """Exactly one JSON object (OpenAI JSON mode)."""
        return cls((("json", None),))

    @classmethod
    def tool_call(cls, calls: list[tuple[str, str]]) -> "Grammar":
        """One of ``calls`` (``(prefix, suffix)`` around the arguments, one per allowed function).

        Raises:
            ValueError: the prefixes cannot be told apart (one is a prefix of another) or the
                suffixes differ.
        """
        prefixes = tuple(p for p, _ in calls)
        suffixes = {s for _, s in calls}
        if len(suffixes) != 1 or any(a != b and b.startswith(a) for a in prefixes for b in prefixes):
            raise ValueError("tool-call prefixes must be prefix-free and share one suffix")
        segs = [("lit", prefixes), ("json", None)]
        if suffixes != {""}:
            segs.append(("lit", (suffixes.pop(),)))
        return cls(tuple(segs))

    def initial(self) -> tuple:
        return self._enter(0)

    def _enter(self, i: int) -> tuple:
        if i == len(self.segments):
            return (i, None)
        kind, _ = self.segments[i]
        return (i, "" if kind == "lit" else (json_prefix.initial(top_object=True), False))

    def is_complete(self, state: tuple | None) -> bool:
        return state is not None and state[0] == len(self.segments)

    def step(self, state: tuple, ch: str) -> tuple | None:
        """The state after one more character, or ``None`` when the grammar rejects it."""
        return _grammar_step(self, state, ch)

    def advance(self, state: tuple | None, text: str) -> tuple | None:
        for ch in text:
            if state is None:
                return None
            state = _grammar_step(self, state, ch)
        return state

    def min_completion(self, state: tuple) -> str:
        """A shortest text completing the grammar from ``state``."""
        i, sub = state
        if i == len(self.segments):
            return ""
        kind, arg = self.segments[i]
        if kind == "lit":
            head = min((c for c in arg if c.startswith(sub)), key=len)[len(sub):]
        else:
            head = json_prefix.min_completion(sub[0])
        rest = "".join(min(a, key=len) if k == "lit" else "{}" for k, a in self.segments[i + 1 :])
        return head + rest


@lru_cache(maxsize=1 << 16)
def _grammar_step(grammar: Grammar, state: tuple, ch: str) -> tuple | None:
    i, sub = state
    if i == len(grammar.segments):
        return None
    kind, arg = grammar.segments[i]
    if kind == "lit":
        p = sub + ch
        if p in arg:
            return grammar._enter(i + 1)
        return (i, p) if any(c.startswith(p) for c in arg) else None
    js, space_ok = sub
    if ch in _WS and not json_prefix.in_string(js):  # compact JSON: one space after ":" and ","
        return (i, (js, False)) if ch == " " and space_ok else None
    nxt = json_prefix.step(js, ch)
    if nxt is None:
        return None
    return grammar._enter(i + 1) if json_prefix.is_complete(nxt) else (i, (nxt, ch in ":,"))


class TokenVocab:
    """The decoded text of every token, sorted for prefix walks, with memoized per-state masks.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        vocab_size: logits width (``>= len(tokenizer)``; extra ids are never allowed).
        include_special: also offer special tokens (for formats such as Harmony whose markup is made
            of special tokens; the output must then be detokenized with them).
    """

    _lock = threading.Lock()
    _cache: dict[tuple, "TokenVocab"] = {}

    def __init__(self, tokenizer: Any, vocab_size: int, include_special: bool):
        n = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.vocab_size = vocab_size
        self.text_of: dict[int, str] = {}
        by_text: dict[str, list[int]] = {}
        for i, t in enumerate(texts):
            if not t or "\ufffd" in t or (i in special and not include_special):
                continue
            self.text_of[i] = t
            by_text.setdefault(t, []).append(i)
        self.by_text = by_text
        self.strs = sorted(by_text)
        self.ids = [by_text[s] for s in self.strs]
        # Tokens that can sit anywhere inside a JSON string: no quote, backslash or control char.
        plain = [s for s in self.strs if '"' not in s and "\\" not in s and min(s) >= " "]
        self.plain_mask = self._to_mask(i for s in plain for i in by_text[s])
        other = [s for s in self.strs if not ('"' not in s and "\\" not in s and min(s) >= " ")]
        self.other_strs, self.other_ids = other, [by_text[s] for s in other]
        self._masks: OrderedDict = OrderedDict()

    @classmethod
    def get(cls, tokenizer: Any, vocab_size: int, include_special: bool) -> "TokenVocab":
        """The shared instance for this tokenizer (built once, ~1 s for a 150k vocabulary)."""
        key = (id(tokenizer), vocab_size, include_special)
        with cls._lock:
            vocab = cls._cache.get(key)
            if vocab is None:
                vocab = cls._cache[key] = cls(tokenizer, vocab_size, include_special)
            return vocab

    def _to_mask(self, ids) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        idx = torch.tensor(list(ids), dtype=torch.int64)
        if idx.numel():
            mask[idx] = True
        return mask

    def mask(self, grammar: Grammar, state: tuple) -> torch.Tensor:
        """``[vocab_size]`` bool: the tokens whose whole text the grammar accepts from ``state``."""
        key = (grammar, state)
        m = self._masks.get(key)
        if m is not None:
            self._masks.move_to_end(key)
            return m
        i, sub = state
        in_string = (
            i < len(grammar.segments) and grammar.segments[i][0] == "json" and json_prefix.in_string(sub[0])
        )
        if in_string:
            m = self.plain_mask | self._to_mask(self._walk(self.other_strs, self.other_ids, grammar, state))
        else:
            m = self._to_mask(self._walk(self.strs, self.ids, grammar, state))
        self._masks[key] = m
        if len(self._masks) > _MASK_CACHE:
            self._masks.popitem(last=False)
        return m

    @staticmethod
    def _walk(strs: list[str], ids: list[list[int]], grammar: Grammar, state: tuple) -> list[int]:
        """Ids of the tokens in sorted ``strs`` accepted from ``state`` (dead prefixes skipped)."""
        out: list[int] = []
        path, states = "", [state]  # states[k] = state after path[:k]
        i, n = 0, len(strs)
        while i < n:
            s = strs[i]
            k, m = 0, min(len(s), len(path))
            while k < m and s[k] == path[k]:
                k += 1
            del states[k + 1 :]
            dead = False
            for c in s[k:]:
                nxt = _grammar_step(grammar, states[-1], c)
                if nxt is None:
                    dead = True
                    break
                states.append(nxt)
            path = s[: len(states) - 1]
            if dead:
                i = bisect.bisect_left(strs, s[: len(states)] + _MAX_CHAR, i + 1)
            else:
                out.extend(ids[i])
                i += 1
        return out


class GuidedLogitsProcessor:
    """Per-request processor: ``(output_token_ids, logits [V], max_tokens) -> logits [V]``.

    Args:
        grammar: what the output must be.
        vocab: the tokenizer's :class:`TokenVocab`.
        eos_token_ids: allowed (only) once the grammar is complete.
    """

    def __init__(self, grammar: Grammar, vocab: TokenVocab, eos_token_ids):
        self.grammar, self.vocab = grammar, vocab
        self.eos = [int(t) for t in eos_token_ids if int(t) < vocab.vocab_size]
        self._ids: list[int] = []
        self._state: tuple | None = grammar.initial()

    def _advance(self, output_ids: list[int]) -> tuple | None:
        if output_ids[: len(self._ids)] != self._ids:  # not an extension (never expected): replay
            self._ids, self._state = [], self.grammar.initial()
        for t in output_ids[len(self._ids) :]:
            text = self.vocab.text_of.get(int(t))
            self._state = None if text is None or self._state is None else self.grammar.advance(self._state, text)
        self._ids = list(output_ids)
        return self._state

    def allowed(self, output_ids: list[int], max_tokens: int | None) -> torch.Tensor | None:
        """The ``[V]`` bool mask for the next token (``None``: the output already left the grammar)."""
        state = self._advance(output_ids)
        if state is None:
            return None
        v = self.vocab
        if self.grammar.is_complete(state):
            return v._to_mask(self.eos)
        need = self.grammar.min_completion(state)
        left = None if max_tokens is None else max_tokens - len(output_ids)
        if left is not None and left <= len(need) + 1 + _CLOSE_MARGIN:
            for k in range(len(need), 0, -1):  # the longest token spelling the start of the closing text
                forced = v.by_text.get(need[:k])
                if forced:
                    return v._to_mask(forced)
        return v.mask(self.grammar, state)

    def __call__(self, output_ids: list[int], logits: torch.Tensor, max_tokens: int | None) -> torch.Tensor:
        mask = self.allowed(output_ids, max_tokens)
        if mask is None or not bool(mask.any()):
            log.warning("guided decoding: no token is allowed; leaving this step unconstrained")
            return logits
        return logits.masked_fill(~mask.to(logits.device), float("-inf"))
