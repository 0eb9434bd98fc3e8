"""Sampling parameters (vLLM-like) and the batched sampler.

The sampler turns a ``[B, V]`` float32 logits tensor into ``[B]`` int64 token ids with per-row
parameters: greedy rows (``temperature == 0``) take the exact ``argmax``; the others are scaled by
their temperature, masked by top-k then top-p (nucleus, Holtzman et al. 2019; same order as
vLLM/HF ``generate``) and drawn from the softmax with their request's own ``torch.Generator`` when a
``seed`` was given, so a seeded request yields the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "SamplingParamsError", "apply_top_k_top_p", "make_generator", "sample"]

_GREEDY_EPS = 1e-5
# Most stop strings (and, apart, stop token ids) per request: each is checked after every generated token
# on the engine thread, so an unbounded list (a million strings fit in a request body) would slow every
# request in the batch.
MAX_STOPS = 256
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
"""The ``generation_config.json`` fields that are a request's sampling defaults (as transformers' ``generate``
and vLLM take them), checked at load as :class:`SamplingParams` checks them."""


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type.

    Attributes:
        field: the offending parameter's name (e.g. ``"top_p"``), also at the start of the message.
        reason: the message without the field name.
    """

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


@dataclass
class SamplingParams:
    """How to pick output tokens and when to stop (a subset of vLLM's ``SamplingParams``).

    Attributes:
        max_tokens: most output tokens to generate; ``None`` = up to the context limit. The engine
            clamps it to ``max_model_len - prompt_len``.
        temperature: softmax temperature; ``0`` means greedy (exact argmax).
        top_p: nucleus mass in ``(0, 1]``; ``1`` = off.
        top_k: keep the ``top_k`` most likely tokens; ``<= 0`` = off.
        seed: seeds a per-request ``torch.Generator`` (reproducible sampling); ``None`` = the global RNG.
        stop: string(s) that end generation; the output is truncated before the first one found
            (finish reason ``"stop"``). Normalized to a list.
        stop_token_ids: token ids that end generation (kept in ``token_ids``, not in the text).
        ignore_eos: keep generating past the model's EOS token(s).
        skip_special_tokens: drop special tokens from the output text.
        logits_processors: callables ``proc(output_token_ids: list[int], logits [V] float32,
            max_tokens: int | None) -> logits [V]`` applied in order to this request's logits before
            sampling (e.g. guided JSON decoding); they may mask tokens with ``-inf``.
        presence_penalty: subtracted from the logit of every token already in the output, in ``[-2, 2]``
            (OpenAI's definition); ``0`` = off.
        frequency_penalty: times the number of times a token is already in the output, subtracted from its
            logit, in ``[-2, 2]``; ``0`` = off.
        repetition_penalty: ``> 0``; the logit of every token in the prompt or the output is divided by it
            where positive and multiplied by it where negative (CTRL, Keskar et al. 2019, as transformers'
            ``RepetitionPenaltyLogitsProcessor``); ``1`` = off. All three as :func:`apply_penalties`.

    Raises:
        SamplingParamsError (a ``ValueError``): a value is out of range; the message starts with the
            field name.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logits_processors: list = field(default_factory=list, repr=False, compare=False)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamsError("max_tokens", f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k):
            raise SamplingParamsError("top_k", f"must be an integer (<= 0 disables it), got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            raise SamplingParamsError("seed", f"must be an integer or None, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        if len(stop) > MAX_STOPS:
            raise SamplingParamsError("stop", f"at most {MAX_STOPS} stop strings are accepted, got {len(stop)}")
        self.stop = list(stop)
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(is_int(t) and t >= 0 for t in ids):
            raise SamplingParamsError("stop_token_ids",
                                      f"must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if len(ids) > MAX_STOPS:
            raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOPS} stop token ids are accepted, "
                                                        f"got {len(ids)}")
        self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be a boolean, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                raise SamplingParamsError(name, f"must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not is_num(r) or not math.isfinite(r) or r <= 0:
            raise SamplingParamsError("repetition_penalty", f"must be a finite number > 0, got {r!r}")

    @property
    def penalized(self) -> bool:
        """True when a presence, frequency or repetition penalty is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """True when ``temperature`` is 0 (argmax decoding)."""
        return self.temperature < _GREEDY_EPS


def apply_penalties(logits: torch.Tensor, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                    params: SamplingParams) -> torch.Tensor:
    """One request's logits with its presence, frequency and repetition penalties applied (vLLM's order and
    definitions): the repetition penalty over the prompt's and the output's tokens, then
    ``logits - frequency_penalty * count - presence_penalty * (count > 0)`` with ``count`` each token's
    occurrences in the output so far. Masked entries (``-inf``) stay masked.

    Args:
        logits: ``[V]`` float logits, any device (not modified).
        prompt_token_ids: the prompt's ids (each in ``[0, V)``).
        output_token_ids: the ids generated so far (each in ``[0, V)``).
        params: the request's :class:`SamplingParams`.

    Returns:
        A new ``[V]`` tensor, same dtype and device.
    """
    V, dev = logits.shape[-1], logits.device
    out = logits.clone()
    if params.repetition_penalty != 1:
        seen = torch.zeros(V, dtype=torch.bool, device=dev)
        seen[torch.tensor([*prompt_token_ids, *output_token_ids], dtype=torch.int64, device=dev)] = True
        p = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / p, out * p), out)
    if output_token_ids and (params.frequency_penalty != 0 or params.presence_penalty != 0):
        counts = torch.bincount(torch.tensor(list(output_token_ids), dtype=torch.int64, device=dev), minlength=V)
        counts = counts.to(out.dtype)
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A ``torch.Generator`` on ``device`` seeded with ``params.seed`` (``None`` when unseeded or greedy)."""
    if params.seed is None or params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k set and then outside its top-p nucleus with ``-inf``.

    Args:
        logits: ``[B, V]`` float logits (already temperature-scaled).
        top_k: ``[B]`` int64; ``<= 0`` or ``>= V`` leaves the row unmasked. ``None`` = off for all.
        top_p: ``[B]`` float in ``(0, 1]``; ``1`` leaves the row unmasked. ``None`` = off for all.
            The nucleus is the smallest prefix of the sorted distribution whose mass reaches ``p``
            (the most likely token is always kept).

    Returns:
        A new ``[B, V]`` tensor, same dtype/device; masked entries are ``-inf``.
    """
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > V), V, top_k).to(logits.device)  # [B]
        pos = torch.arange(V, device=logits.device).expand(B, V)  # [B, V]
        sorted_logits = sorted_logits.masked_fill(pos >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        p = torch.where(top_p >= 1.0, 2.0, top_p.to(torch.float32)).to(logits.device)  # [B]; > 1 = off
        probs = sorted_logits.softmax(dim=-1)  # [B, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V]
        sorted_logits = sorted_logits.masked_fill(mass_before >= p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[B, V]`` float logits (float32 from the runner), any device.
        params: ``B`` sampling parameters, one per row.
        generators: ``B`` optional generators (same device as ``logits``) for seeded rows.

    Returns:
        ``[B]`` int64 token ids on ``logits.device``. Greedy rows are exactly ``logits.argmax(-1)``.
    """
    B = logits.shape[0]
    if len(params) != B:
        raise ValueError(f"params: {len(params)} entries for {B} logits rows")
    generators = list(generators) if generators is not None else [None] * B
    out = logits.argmax(dim=-1)  # [B]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=dev)
    x = logits.index_select(0, idx).float() / temps.unsqueeze(1)  # [b, V]
    top_k = [params[i].top_k for i in rows]
    top_p = [params[i].top_p for i in rows]
    use_k = any(0 < k < x.shape[1] for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if use_k or use_p:
        x = apply_top_k_top_p(
            x,
            torch.tensor(top_k, device=dev) if use_k else None,
            torch.tensor(top_p, device=dev) if use_p else None,
        )
    probs = x.softmax(dim=-1)  # [b, V]
    seeded = [j for j, i in enumerate(rows) if generators[i] is not None]
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    picked = torch.empty(len(rows), dtype=torch.int64, device=dev)
    for j in seeded:
        picked[j] = torch.multinomial(probs[j], 1, generator=generators[rows[j]])[0]
    if unseeded:
        u = torch.tensor(unseeded, device=dev)
        picked[u] = torch.multinomial(probs.index_select(0, u), 1).squeeze(1)
    out[idx] = picked
    return out
