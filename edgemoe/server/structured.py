"""Structured output: decoding constrained by a grammar, through llguidance (Microsoft's Rust grammar
engine, the one vLLM, SGLang and llama.cpp use for JSON schemas).

Grammars (:class:`Grammar`, built here from JSON schemas and the tool-call markup of the model's
family):

- ``response_format`` ``json_schema`` / ``json_object``, Responses ``text.format``, Anthropic
  ``output_config.format``: one JSON value following the schema (``{"type": "object"}`` for JSON mode);
- forced tool calls (``tool_choice`` ``required`` / a named function, Anthropic ``any`` / ``tool``):
  the family's call markup around arguments that follow the function's ``parameters``;
- ``strict`` tools under ``tool_choice: auto``: free text, but once the call markup starts (a *lazy*
  trigger such as ``<tool_call>``) the call must follow its function's ``parameters``.

JSON is written compactly (``", "`` and ``": "`` separators, no other whitespace, as ``json.dumps``
writes it), so a weak model cannot pad forever; unimplemented schema keywords are ignored (lenient).

:class:`GrammarLogitsProcessor` rides in ``SamplingParams.logits_processors``: per decode step it
advances an ``LLMatcher`` over the sampled tokens and masks the logits row to the tokens the grammar
allows (EOS only once the grammar is complete). Ending before ``max_tokens``: the processor measures
how many tokens its *closing policy* needs from the current state (a rollout on a copy of the matcher:
forced tokens first, then the shortest closing tokens such as ``"``, ``}``, ``]``, ``0`` when allowed,
else the allowed token of lowest id, until EOS) and, once that length comes within a margin of the
tokens left, follows the policy itself, so the output is complete (and ends with EOS) within the
budget. Rollouts are spaced by the slack they leave (a free token lengthens the closing text by a few
tokens at most), so they cost a few dozen mask computations per request. A budget too small for even
the shortest output is a 400 at admission (:func:`min_output_tokens`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Grammar", "GrammarError", "GrammarLogitsProcessor", "GrammarVocab", "min_output_tokens"]

log = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
# The closing policy's preferred tokens, in order: what closes strings, arrays and objects, then the
# shortest values. A candidate the tokenizer does not have as one token is skipped.
_CLOSERS = ('"', "}", "]", '"}', '"]', "}}", "]}", "}]", '"}}', ",", ":", "0", '""', "{}", "[]", "false", "true",
            "null")
# Start following the closing policy when the tokens it needs come within this many of the tokens left.
_CLOSE_MARGIN = 8
# A free token lengthens the closing policy's output by at most about this many tokens.
_GROWTH_PER_TOKEN = 4


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile (the message says why)."""


def _lark_str(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _schema(schema: dict[str, Any] | None) -> dict[str, Any]:
    """``schema`` (any object when ``None``) with the compact-JSON options."""
    out = dict(schema) if isinstance(schema, dict) else {"type": "object"}
    out["x-guidance"] = {**JSON_OPTIONS, **(out.get("x-guidance") or {})}
    return out


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar.

    Attributes:
        lark: the grammar in llguidance's Lark dialect (JSON schemas embedded with ``%json``).
        what: what it constrains, for messages (``"response_format"``, ``"tool call"``).
        lazy: free text is complete output; the grammar constrains only what follows a trigger.
    """

    lark: str
    what: str
    lazy: bool = False

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | None, what: str, lead: str = "") -> Grammar:
        """One JSON value following ``schema`` (``None``: any JSON object), after ``lead`` (a Lark
        expression, e.g. the literal that closes a think block the prompt opened)."""
        return cls(" ".join(p for p in ("start:", lead, _json_expr(schema)) if p), what)

    @classmethod
    def tool_calls(cls, calls: list[str], what: str = "tool call", *, trigger: str | None = None,
                   lead: str = "") -> Grammar:
        """One of ``calls`` (Lark expressions, one per allowed function, from :meth:`GrammarVocab.call`),
        after ``lead`` (as for :meth:`json_schema`).

        With ``trigger`` (the Lark expression of the markup every call starts with, left out of
        ``calls``), the output is free text in which each ``trigger`` starts one of ``calls`` (``strict``
        tools under ``tool_choice: auto``). A trigger made of a special token ends the free text by
        itself; a textual one is a lazy lexeme (matched as soon as it appears).
        """
        alternatives = " | ".join(f"c{i}" for i in range(len(calls)))
        rules = "".join(f"c{i}: {c}\n" for i, c in enumerate(calls))
        if trigger is None:
            return cls(" ".join(p for p in ("start:", lead, f"({alternatives})") if p) + f"\n{rules}", what)
        if trigger.startswith("<["):  # a special token
            head = f"call: TEXT {trigger} ({alternatives})\n"
        else:
            head = f"call: text_trigger ({alternatives})\ntext_trigger[lazy]: TEXT {trigger}\n"
        return cls(f"start: call* TEXT\n{head}TEXT: /(.|\\n)*/\n{rules}", what, lazy=True)


def _json_expr(schema: dict[str, Any] | None) -> str:
    return "%json " + json.dumps(_schema(schema), ensure_ascii=False)


class GrammarVocab:
    """The tokenizer as llguidance sees it, and the closing policy's candidate tokens.

    Args:
        tokenizer: a fast ``transformers`` tokenizer.
        vocab_size: logits width (``>= len(tokenizer)``; ids beyond the tokenizer are never allowed).
        eos_token_ids: the tokens that end generation (allowed once the grammar is complete).

    Building it reads the whole vocabulary (a few seconds for a 150k vocabulary on a small CPU): build
    it once per tokenizer, off the event loop.

    Raises:
        GrammarError: a tokenizer without a Rust (fast) backend.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids):
        import llguidance.hf
        import transformers

        if not isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
            raise GrammarError("structured output needs a fast (Rust) tokenizer")
        self.eos = sorted(int(t) for t in eos_token_ids if int(t) < vocab_size)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.closers = [i for i in (self._single_token(tokenizer, t) for t in _CLOSERS) if i is not None]
        # Added tokens (markup such as <tool_call>, <|channel|>): a grammar names them by id, since
        # llguidance never spells them out of ordinary bytes.
        self._added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()
                       if i < vocab_size and self.tokenizer.is_special_token(i)}
        pattern = "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
        self._added_re = re.compile(pattern) if pattern else None

    def literal(self, text: str) -> str:
        """The Lark expression matching exactly ``text``, its added tokens as those tokens."""
        parts, pos = [], 0
        for m in self._added_re.finditer(text) if self._added_re is not None else ():
            if m.start() > pos:
                parts.append(_lark_str(text[pos:m.start()]))
            parts.append(f"<[{self._added[m.group()]}]>")
            pos = m.end()
        if pos < len(text):
            parts.append(_lark_str(text[pos:]))
        return " ".join(parts)

    def call(self, prefix: str, parameters: dict[str, Any] | None, suffix: str) -> str:
        """The Lark expression of one tool call: ``prefix`` + arguments following ``parameters``
        (``None``: any object) + ``suffix``."""
        return " ".join(p for p in (self.literal(prefix), _json_expr(parameters), self.literal(suffix)) if p)

    @staticmethod
    def _single_token(tokenizer: Any, text: str) -> int | None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == text else None

    def matcher(self, grammar: Grammar):
        """A fresh ``LLMatcher`` for ``grammar``.

        Raises:
            GrammarError: the grammar (or a schema in it) does not compile.
        """
        import llguidance

        lark = llguidance.LLMatcher.grammar_from_lark(grammar.lark)
        m = llguidance.LLMatcher(self.tokenizer, lark, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return m


class _Closer:
    """The closing policy over one matcher state: forced tokens, then closing candidates, then the
    allowed token of lowest id; EOS as soon as it is allowed."""

    def __init__(self, vocab: GrammarVocab):
        self.vocab = vocab
        self.bits = np.empty(vocab.words, dtype=np.int32)  # the current state's mask
        self._scratch = np.empty(vocab.words, dtype=np.int32)  # the rollouts' masks

    def mask(self, matcher, out: np.ndarray | None = None) -> np.ndarray:
        """``[words]`` int32 bitmask of the tokens allowed next (bit ``t & 31`` of word ``t >> 5``),
        written into ``out`` (default: :attr:`bits`)."""
        out = self.bits if out is None else out
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    @staticmethod
    def allowed(bits: np.ndarray, token: int) -> bool:
        return bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def choose(self, matcher, bits: np.ndarray) -> int | None:
        """The policy's token for the state whose mask is ``bits`` (``None``: nothing is allowed)."""
        for t in self.vocab.eos:
            if self.allowed(bits, t):
                return t
        forced = matcher.compute_ff_tokens()
        if forced:
            return int(forced[0])
        for t in self.vocab.closers:
            if self.allowed(bits, t):
                return t
        words = np.flatnonzero(bits)
        if not words.size:
            return None
        w = int(words[0])
        word = int(bits[w]) & 0xFFFFFFFF
        return w * 32 + ((word & -word).bit_length() - 1)

    def length(self, matcher, bits: np.ndarray, cap: int) -> int | None:
        """Tokens the policy takes from the state of ``matcher`` (whose mask is ``bits``) to EOS
        included; ``None`` when more than ``cap``."""
        m = None
        for n in range(1, cap + 1):
            t = self.choose(m or matcher, bits)
            if t is None:
                return None
            if t in self.vocab.eos:
                return n
            m = m or matcher.deep_copy()
            if not m.consume_token(t):
                return None
            bits = self.mask(m, self._scratch)
        return None


def min_output_tokens(vocab: GrammarVocab, grammar: Grammar, cap: int = 4096) -> int | None:
    """Tokens of the shortest output the closing policy writes for ``grammar`` (EOS included), or
    ``None`` beyond ``cap``: a ``max_tokens`` below it cannot hold a complete output.

    Raises:
        GrammarError: the grammar does not compile.
    """
    matcher = vocab.matcher(grammar)
    closer = _Closer(vocab)
    return closer.length(matcher, closer.mask(matcher), cap)


class GrammarLogitsProcessor:
    """Per-request logits processor: ``(output_token_ids, logits [V] float32, max_tokens) -> logits [V]``.

    Args:
        grammar: what the output must be.
        vocab: the tokenizer's :class:`GrammarVocab`.

    Raises:
        GrammarError: the grammar does not compile.
    """

    def __init__(self, grammar: Grammar, vocab: GrammarVocab):
        self.grammar, self.vocab = grammar, vocab
        self.matcher = vocab.matcher(grammar)
        self.closer = _Closer(vocab)
        self.closing = False  # following the closing policy to the end
        self._consumed = 0
        self._next_check = 0  # output length at which the closing length is measured again
        self._broken = False

    def _advance(self, output_ids: list[int]) -> bool:
        """Consume the tokens sampled since the last call; False once the output left the grammar."""
        if self._broken:
            return False
        if len(output_ids) < self._consumed:  # never expected (outputs only grow): start over
            self.matcher.reset()
            self._consumed = 0
        for t in output_ids[self._consumed:]:
            if not self.matcher.consume_token(int(t)):
                log.warning("structured output: token %d left the %s grammar (%s); no longer constrained",
                            t, self.grammar.what, self.matcher.get_error())
                self._broken = True
                return False
        self._consumed = len(output_ids)
        return True

    def _should_close(self, bits: np.ndarray, left: int, produced: int) -> bool:
        if self.closing:
            return True
        if produced < self._next_check or self.matcher.is_accepting():
            return False
        n = self.closer.length(self.matcher, bits, left)
        if n is None or n + _CLOSE_MARGIN >= left:
            self.closing = True
            return True
        self._next_check = produced + max(1, (left - n - _CLOSE_MARGIN) // (_GROWTH_PER_TOKEN + 1))
        return False

    def __call__(self, output_ids: list[int], logits: torch.Tensor, max_tokens: int | None) -> torch.Tensor:
        if not self._advance(output_ids):
            return logits
        if self.matcher.is_stopped():  # complete, nothing can follow: only EOS
            out = torch.full_like(logits, float("-inf"))
            out[self.vocab.eos] = 0.0
            return out
        bits = self.closer.mask(self.matcher)
        left = None if max_tokens is None else max_tokens - len(output_ids)
        if left is not None and self._should_close(bits, left, len(output_ids)):
            token = self.closer.choose(self.matcher, bits)
            if token is not None:
                out = torch.full_like(logits, float("-inf"))
                out[token] = 0.0
                return out
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: logits.shape[-1]].view(bool)
        banned = torch.from_numpy(~allowed).to(logits.device)  # [V]
        masked = logits.masked_fill(banned, float("-inf"))
        if masked.max() == float("-inf"):  # every allowed token had -inf logits: choose among them
            masked = torch.zeros_like(logits).masked_fill(banned, float("-inf"))
        return masked
