"""The synchronous engine: request queue, continuous batching, sampling, stop handling.

:class:`LLMEngine` owns a :class:`~edgemoe.engine.model_runner.ModelRunner` and advances every
request by one model step per :meth:`LLMEngine.step`, like vLLM's ``LLMEngine`` / nano-vllm's loop:

1. ``add_request`` validates and queues (``PromptTooLongError`` for a prompt that can never fit).
2. ``step`` asks the :class:`~edgemoe.engine.scheduler.Scheduler` for one batch: either a prefill
   batch (new requests and continued prompt chunks, at most ``prefill_chunk_tokens`` tokens) or a
   decode batch (one token for every running request).
3. The runner computes the batch; a ``KVCacheFullError`` preempts the newest running request
   (recomputed later); running out of device memory shrinks the expert cache and retries the step
   once (``GpuMemory.relieve``); any other exception is isolated to the request(s) that cause it.
4. Rows whose prompt is complete are sampled; stop conditions (EOS, stop token ids, stop strings,
   ``max_tokens``) are checked, the text is detokenized incrementally, and one
   :class:`RequestOutput` per advanced request is returned.

Only one thread may call the engine (the runner is not thread-safe); see ``async_engine.py``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace

import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.metrics import EngineMetrics
from edgemoe.engine.model_runner import KVCacheFullError, ModelRunner
from edgemoe.engine.request import (
    CompletionOutput,
    IncrementalDetokenizer,
    PromptTooLongError,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from edgemoe.engine.sampling import SamplingParams, SamplingParamsError, apply_penalties, make_generator, sample
from edgemoe.engine.scheduler import ScheduledBatch, Scheduler

__all__ = [
    "CompletionOutput",
    "IncrementalDetokenizer",
    "LLMEngine",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestOutput",
]

log = logging.getLogger(__name__)

class LLMEngine:
    """Continuous-batching engine over one model runner.

    Args:
        runner: a ``ModelRunner``; its ``engine_config`` gives ``max_num_seqs`` (requests in flight)
            and ``prefill_chunk_tokens`` (most prompt tokens per prefill step, the whole batch).
        metrics: Prometheus instruments (a fresh :class:`EngineMetrics` by default).

    Not thread-safe: call it from one thread.
    """

    def __init__(self, runner: ModelRunner, *, metrics: EngineMetrics | None = None):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.max_model_len = int(runner.max_model_len)
        self.eos_token_ids = frozenset(int(t) for t in runner.eos_token_ids)
        cfg = runner.engine_config
        self.scheduler = Scheduler(runner, max_num_seqs=cfg.max_num_seqs, prefill_chunk_tokens=cfg.prefill_chunk_tokens)
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.routing_recorder = None
        self.metrics.bind_queues(lambda: self.num_running, lambda: self.num_waiting)
        self.metrics.bind_prefix_cache(lambda: runner.kv.cached_pages)
        self.metrics.bind_state_checkpoints(
            lambda: 0 if runner.prefix.checkpoints is None else runner.prefix.checkpoints.slots_used)
        self._requests: dict[str, Request] = {}

    @classmethod
    def from_model_dir(cls, model_dir: str, config: EngineConfig | None = None, *, progress: bool = True) -> LLMEngine:
        """Load a ``ModelRunner`` for ``model_dir`` (slow for big models) and wrap it."""
        runner = ModelRunner(str(model_dir), config or EngineConfig(), progress=progress)
        engine = cls(runner)
        engine.metrics.add_expert_stats_source(runner.expert_stats)
        return engine

    # ---------------------------------------------------------------- requests

    @property
    def kv_capacity_tokens(self) -> int:
        return int(self.runner.kv_capacity_tokens)

    @property
    def prompt_limit(self) -> int:
        """The most prompt tokens :meth:`check_prompt` accepts now: ``max_model_len - 1`` or what the KV
        cache can hold, whichever is less."""
        return min(self.max_model_len - 1, int(self.runner.kv_limit_tokens))

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Validate a prompt against the context and KV limits; return params with ``max_tokens`` clamped.

        Reads limits that are plain numbers (the KV limit as of the last resize), so any thread may call it.

        Raises:
            PromptTooLongError: ``len(prompt) > max_model_len - 1`` or more than the KV cache can hold, the
                pages it may borrow included (``ModelRunner.kv_limit_tokens``).
            ValueError: an empty prompt or a token id outside the vocabulary.
            SamplingParamsError: a ``stop_token_ids`` entry outside the vocabulary (it could never stop anything).
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.runner.model_config.vocab_size
        if not all(0 <= int(t) < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids or []):
            raise SamplingParamsError("stop_token_ids", f"token ids must be in [0, {vocab}), got "
                                      f"{max(params.stop_token_ids)}")
        kv_limit = int(self.runner.kv_limit_tokens)
        limit = min(self.max_model_len - 1, kv_limit)  # prompt_limit, from the one reading of kv_limit
        if n > limit:
            which = (
                f"this model's maximum context length is {self.max_model_len} tokens and at least one "
                "output token is needed"
                if limit == self.max_model_len - 1
                else f"the KV cache holds {kv_limit} tokens"
            )
            raise PromptTooLongError(
                f"The prompt has {n} tokens but at most {limit} are accepted: {which}. "
                "Shorten the prompt (or raise --max-model-len / --kv-cache-tokens).",
                prompt_len=n,
                limit=limit,
            )
        room = self.max_model_len - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return params if max_tokens == params.max_tokens else replace(params, max_tokens=max_tokens)

    def add_request(
        self,
        request_id: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id (a fresh uuid when ``request_id`` is None).

        Raises:
            PromptTooLongError: see :meth:`check_prompt` (the request is not queued).
            ValueError: duplicate ``request_id`` or an invalid prompt.
        """
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = self.check_prompt(list(prompt_token_ids), params or SamplingParams())
        req = Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=[int(t) for t in prompt_token_ids],
            params=params,
            generator=make_generator(params, self.runner.device),
            detokenizer=IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), params.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.perf_counter()),
        )
        self._requests[request_id] = req
        self.scheduler.add(req)
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV pages; returns its final output (``finish_reason="abort"``),
        or ``None`` when the id is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, "abort")

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Fail every unfinished request with ``message`` (used when the step loop itself breaks)."""
        return [self._finish(req, "error", error=message) for req in list(self._requests.values())]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        """Requests admitted (holding KV pages), prefilling or decoding."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued (new or preempted)."""
        return len(self.scheduler.waiting)

    def attach_routing_recorder(self, recorder) -> None:
        """Record every step's routing (``--record-routing``): ``recorder`` is an
        ``edgemoe.bench.trace.RoutingRecorder``; the engine names each admitted sequence after its request."""
        recorder.attach(self.runner)
        self.routing_recorder = recorder

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Run one model step; return an output for every request that advanced or finished. Before it
        (a safe point), the memory budget follows the device (``GpuMemory.tick``, rate-limited)."""
        self.runner.memory.tick()
        outputs: list[RequestOutput] = []
        batch = self._next_batch(outputs)
        new_tokens = 0
        if batch is not None:
            now = time.perf_counter()
            for req in batch.requests:
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
            if self.routing_recorder is not None:
                for req, inp in zip(batch.requests, batch.inputs):
                    if batch.phase is Phase.PREFILL and inp.start_pos == req.num_cached_tokens:
                        # a new admission (or a recompute after preemption)
                        self.routing_recorder.name_sequence(inp.seq_id, req.request_id)
            rows = self._execute(batch, outputs)
            if self.routing_recorder is not None:
                self.routing_recorder.flush()  # a served trace survives the process being stopped
            reqs, processed = [], []
            for req, row in rows:
                try:
                    processed.append(self._process(req, row))
                except Exception as exc:  # a request's own logits processor: it fails alone
                    log.exception("request %s failed", req.request_id, exc_info=exc)
                    outputs.append(self._finish(req, "error", error=_describe(exc)))
                    continue
                reqs.append(req)
            if reqs:
                logits = torch.stack(processed)  # [b, V]
                tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
                for req, tok in zip(reqs, tokens):
                    outputs.append(self._append_token(req, int(tok)))
                new_tokens = len(reqs)
        self.metrics.observe_step(new_tokens)
        return outputs

    @staticmethod
    def _process(req: Request, logits: torch.Tensor) -> torch.Tensor:
        """Apply the request's penalties (:func:`apply_penalties`), then its logits processors, to its ``[V]``
        logits row."""
        if req.params.penalized:
            logits = apply_penalties(logits, req.prompt_token_ids, req.output_token_ids, req.params)
        for proc in req.params.logits_processors:
            logits = proc(req.output_token_ids, logits, req.params.max_tokens)
        return logits

    def _next_batch(self, outputs: list[RequestOutput]) -> ScheduledBatch | None:
        batch, stuck = self.scheduler.schedule()
        for req in stuck:
            # Alone in the engine and still unable to get KV pages for its tokens.
            if req.output_token_ids:
                outputs.append(self._finish(req, "length"))
            else:
                outputs.append(self._finish(req, "error", error="the prompt does not fit in the free KV cache"))
        return batch

    def _execute(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> list[tuple[Request, torch.Tensor]]:
        """Run ``batch`` with preemption on KV exhaustion and per-request fault isolation.

        Returns ``(request, logits row [V])`` for every request whose prompt is now fully computed.
        """
        relieved = False
        while True:
            if not batch.requests:
                return []
            try:
                logits = self.runner.execute(batch.inputs, batch.phase)  # [B, V] float32
                done = list(zip(batch.requests, batch.inputs, logits))
                break
            except KVCacheFullError:
                victim = self.scheduler.preempt_newest()
                if victim is None:
                    return []
                self.metrics.preemptions.inc()
                log.info("KV cache full: preempted request %s (recomputed later)", victim.request_id)
                batch = batch.without(victim)
            except torch.OutOfMemoryError as exc:
                # another process took the device memory between two samples: the expert cache gives some
                # back and the step runs once more (when every sequence can resume), else fault isolation
                resumable = all(inp.start_pos == 0 or self.runner.can_resume(inp.seq_id) for inp in batch.inputs)
                if relieved or not resumable or not self.runner.memory.relieve():
                    done = self._isolate(batch, exc, outputs)
                    break
                relieved = True
                log.warning("step ran out of device memory; shrank the expert cache and retrying it")
            except Exception as exc:
                done = self._isolate(batch, exc, outputs)
                break
        rows = []
        for req, inp, row in done:
            if batch.phase is Phase.PREFILL:
                self.metrics.prompt_tokens_computed.inc(len(inp.token_ids))
                if inp.start_pos == req.num_cached_tokens:  # the first chunk since admission
                    self.metrics.prefix_cache_hit_tokens.inc(req.num_cached_tokens)
                    if req.num_cached_tokens and self.runner.prefix.checkpoints is not None:
                        self.metrics.state_checkpoint_restores.inc()
                        self.metrics.state_checkpoint_reused_tokens.inc(req.num_cached_tokens)
            req.num_computed = inp.start_pos + len(inp.token_ids)
            if req.num_computed == len(req.prompt_token_ids) + len(req.output_token_ids):
                if batch.phase is Phase.PREFILL:  # the prompt's full pages become reusable at once
                    self.runner.cache_prefix(req.seq_id, req.token_slice(0, req.num_computed))
                req.prefill_done = True
                rows.append((req, row))
        return rows

    def _isolate(self, batch: ScheduledBatch, exc: Exception, outputs: list[RequestOutput]):
        """Re-run each sequence of a failed batch alone; fail only those that raise again."""
        if len(batch.requests) == 1:
            log.exception("request %s failed", batch.requests[0].request_id, exc_info=exc)
            outputs.append(self._finish(batch.requests[0], "error", error=_describe(exc)))
            return []
        log.warning("batch of %d failed (%s); re-running each sequence alone", len(batch.requests), exc)
        done = []
        for req, inp in zip(batch.requests, batch.inputs):
            if inp.start_pos > 0 and not self.runner.can_resume(inp.seq_id):
                # a recurrent state the failed step half-advanced was dropped: recompute (or restore a
                # checkpoint) from the start, alone up to the end of this step, so a request that fails
                # again fails alone
                req.isolate_until = inp.start_pos + len(inp.token_ids)
                self.scheduler.preempt(req)
                self.metrics.preemptions.inc()
                continue
            try:
                done.append((req, inp, self.runner.execute([inp], batch.phase)[0]))
            except KVCacheFullError:
                self.scheduler.preempt(req)
                self.metrics.preemptions.inc()
            except Exception as e:
                log.exception("request %s failed", req.request_id, exc_info=e)
                outputs.append(self._finish(req, "error", error=_describe(e)))
        return done

    # ---------------------------------------------------------------- outputs

    def _append_token(self, req: Request, tok: int) -> RequestOutput:
        params = req.params
        req.output_token_ids.append(tok)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.perf_counter()
        reason = stop_reason = None
        if tok in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif tok in params.stop_token_ids:
            reason, stop_reason = "stop", tok
        else:
            req.text += req.detokenizer.step(tok)
            if params.stop:
                hit = _find_stop(req.text, params.stop, req.emitted_chars)
                if hit is not None:
                    idx, stop_reason = hit
                    req.text = req.text[:idx]
                    reason = "stop"
        if reason is None and len(req.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            return self._finish(req, reason, stop_reason=stop_reason)
        hold = max((len(s) for s in params.stop), default=1) - 1
        return self._make_output(req, emit_upto=max(req.emitted_chars, len(req.text) - hold))

    def _make_output(self, req: Request, emit_upto: int, error: str | None = None) -> RequestOutput:
        delta_text = req.text[req.emitted_chars : emit_upto]
        delta_ids = req.output_token_ids[req.emitted_tokens :]
        req.emitted_chars = emit_upto
        req.emitted_tokens = len(req.output_token_ids)
        finished = req.status is RequestStatus.FINISHED
        out = CompletionOutput(
            index=0,
            text=req.text[:emit_upto],
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[out],
            finished=finished,
            metrics=req.metrics,
            error=error,
            cached_tokens=req.cached_tokens or 0,
        )

    def _finish(
        self, req: Request, reason: str, *, stop_reason: str | int | None = None, error: str | None = None
    ) -> RequestOutput:
        self.scheduler.remove(req, cache=reason != "error")  # a failed step may leave bad KV behind
        self._requests.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        m = req.metrics
        m.finish_time = time.perf_counter()
        n = len(req.output_token_ids)
        tpot = (m.finish_time - m.first_token_time) / (n - 1) if n > 1 and m.first_token_time is not None else None
        self.metrics.observe_finished(reason, m.ttft, tpot, m.e2e)
        return self._make_output(req, emit_upto=len(req.text), error=error)


def _find_stop(text: str, stops: Iterable[str], start: int) -> tuple[int, str] | None:
    """Earliest occurrence at or after ``start`` of any stop string: ``(index, stop)`` or ``None``."""
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
