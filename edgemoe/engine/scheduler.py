"""Request bookkeeping and batch selection for continuous batching.

The scheduler keeps a FIFO ``waiting`` queue (new and preempted requests) and a ``running`` list in
admission order (requests holding KV pages). Each :meth:`Scheduler.schedule` returns one batch of one
phase, because a runner step is either prefill or decode:

- **prefill** — continued prompt chunks of running requests first, then new admissions from the head
  of ``waiting`` (no skipping ahead), while ``len(running) < max_num_seqs``, the batch holds at most
  ``prefill_chunk_tokens`` tokens and the runner can allocate their KV pages while leaving one page
  per decoding request free (a watermark). A prompt longer than the budget is split into chunks over
  several steps. A request recomputed because a failed step dropped its recurrent state runs in a
  batch of its own until it is past that step (``Request.isolate_until``).
- **decode** — one token for every running request whose prompt is fully computed.

Prefill has priority (short TTFT), but never twice in a row while requests are decoding, so a long
chunked prompt does not stall running streams. Preemption is by recompute (vLLM's default): the
newest running request frees its pages and returns to the head of ``waiting`` keeping its generated
tokens; when readmitted, prompt + generated tokens are prefilled again.

Prefix caching: on admission a request takes the longest reusable cached prefix of its
tokens from the runner (``attach_prefix``) and its prefill starts there. A request that finishes,
is aborted or is preempted first caches its full KV pages (``cache_prefix``), so a preempted request
usually gets its own pages back when readmitted, unless allocation pressure evicted them meanwhile.
Reuse only saves work: when attaching a prefix fails part-way, the sequence's pages (and recurrent state)
are freed and the request computes its prompt from the start.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from edgemoe.core import Phase, StepInput
from edgemoe.engine.request import Request, RequestStatus

__all__ = ["ScheduledBatch", "Scheduler"]

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """One runner step: ``requests[i]`` computes ``inputs[i]`` (a ``StepInput``)."""

    phase: Phase
    requests: list[Request]
    inputs: list[Any]

    def without(self, req: Request) -> "ScheduledBatch":
        keep = [i for i, r in enumerate(self.requests) if r is not req]
        return ScheduledBatch(self.phase, [self.requests[i] for i in keep], [self.inputs[i] for i in keep])


class Scheduler:
    """Chooses the next batch and owns admission, preemption and KV release.

    Args:
        runner: provides ``page_size``, ``can_allocate(seq_id, total_len)``, ``kv_available_tokens()`` (both
            count the KV pages the runner may borrow from the expert cache; a step that needs them borrows
            them instead of failing, so preemption only happens once that memory is gone too),
            ``free(seq_id)``, ``attach_prefix(seq_id, token_ids)`` and ``cache_prefix(seq_id, token_ids)``.
        max_num_seqs: most requests admitted at once.
        prefill_chunk_tokens: most tokens in one prefill batch.
    """

    def __init__(self, runner: Any, *, max_num_seqs: int, prefill_chunk_tokens: int):
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._seq_ids = itertools.count(1)
        self._last_phase: Phase | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request, cache: bool = True) -> None:
        """Drop ``req`` from whichever queue holds it, freeing its KV pages (after caching its full
        pages for reuse when ``cache``)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req, cache)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)

    def preempt(self, req: Request) -> None:
        """Free a running request's pages (its full pages stay cached) and requeue it at the head of
        ``waiting`` for recompute."""
        self.running.remove(req)
        self._release(req, cache=True)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def preempt_newest(self) -> Request | None:
        """Preempt the most recently admitted running request (``None`` when none runs)."""
        if not self.running:
            return None
        victim = self.running[-1]
        self.preempt(victim)
        return victim

    def _release(self, req: Request, cache: bool) -> None:
        if req.seq_id is not None:
            if cache and req.num_computed:
                self.runner.cache_prefix(req.seq_id, req.token_slice(0, req.num_computed))
            self.runner.free(req.seq_id)
        req.seq_id = None
        req.num_computed = 0
        req.prefill_done = False

    def schedule(self) -> tuple[ScheduledBatch | None, list[Request]]:
        """Pick the next batch.

        Returns:
            ``(batch, stuck)``: ``batch`` is ``None`` when nothing can run this step; ``stuck`` lists
            requests that cannot make progress even alone in the engine (their tokens exceed the
            free KV cache); the caller must finish them.
        """
        decoding = [r for r in self.running if r.prefill_done]
        want_prefill = any(not r.prefill_done for r in self.running) or (
            bool(self.waiting) and len(self.running) < self.max_num_seqs
        )
        if want_prefill and not (self._last_phase is Phase.PREFILL and decoding):
            batch = self._schedule_prefill()
            if batch is not None:
                self._last_phase = Phase.PREFILL
                return batch, []
        if decoding:
            self._last_phase = Phase.DECODE
            return self._schedule_decode(decoding), []
        if want_prefill:
            batch = self._schedule_prefill()  # the alternation rule may have skipped a possible prefill
            if batch is not None:
                self._last_phase = Phase.PREFILL
                return batch, []
        # Nothing can run: every admitted request is blocked on KV pages, or the head does not fit.
        if len(self.running) > 1:
            self.preempt_newest()
            return None, []
        if self.running:
            return None, [self.running[0]]
        if self.waiting:
            return None, [self.waiting[0]]
        return None, []

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.prefill_chunk_tokens
        claimed = 0  # KV tokens the batch's earlier entries will allocate
        reqs: list[Request] = []
        inputs: list[Any] = []

        def free() -> int:  # read again after each admission: a cached prefix it locks stops being free
            return self.runner.kv_available_tokens() - claimed

        def fits(seq_id: int, start: int, n: int) -> bool:
            # The first chunk only needs the runner's word; later ones also share the free tokens.
            return self.runner.can_allocate(seq_id, start + n) and (not reqs or n <= free())

        for req in self.running:
            alone = req.num_computed < req.isolate_until  # recomputing past a failed step: in a batch of one
            if req.prefill_done or budget <= 0 or (alone and reqs):
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not fits(req.seq_id, req.num_computed, n):
                continue
            reqs.append(req)
            tokens = req.token_slice(req.num_computed, req.num_computed + n)
            inputs.append(StepInput(req.seq_id, tokens, req.num_computed))
            budget, claimed = budget - n, claimed + n
            if alone:
                return ScheduledBatch(Phase.PREFILL, reqs, inputs)
        # Admit only while the decoding requests keep room for their next page each (a watermark,
        # as in vLLM), so a fresh admission is not preempted again at the very next decode step.
        reserve = self.runner.page_size * sum(r.prefill_done for r in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            seq_id = next(self._seq_ids)
            try:
                start = self.runner.attach_prefix(seq_id, req.token_slice(0, req.num_tokens))
            except Exception:  # reuse only saves work: nothing of it may stay attached
                log.exception("request %s: reusing its cached prefix failed; computing its prompt from the start",
                              req.request_id)
                self.runner.free(seq_id)
                start = 0
            n = min(req.num_tokens - start, budget)
            alone = start < req.isolate_until
            if not fits(seq_id, start, n) or (reserve and n + reserve > free()) or (alone and reqs):
                self.runner.free(seq_id)
                break
            self.waiting.popleft()
            req.seq_id, req.status, req.num_computed = seq_id, RequestStatus.RUNNING, start
            req.num_cached_tokens = start
            if req.cached_tokens is None:
                req.cached_tokens = start
            self.running.append(req)
            reqs.append(req)
            inputs.append(StepInput(seq_id, req.token_slice(start, start + n), start))
            budget, claimed = budget - n, claimed + n
            if alone:
                break
        return ScheduledBatch(Phase.PREFILL, reqs, inputs) if reqs else None

    def _schedule_decode(self, decoding: list[Request]) -> ScheduledBatch:
        inputs = [StepInput(r.seq_id, [r.output_token_ids[-1]], r.num_computed) for r in decoding]
        return ScheduledBatch(Phase.DECODE, decoding, inputs)
