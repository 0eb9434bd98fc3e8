"""Asyncio front of the engine: one background thread owns the runner and runs the step loop.

The model runner is not thread-safe, so exactly one thread (``edgemoe-engine``) loads it, steps the
:class:`~edgemoe.engine.llm_engine.LLMEngine` and answers queries about it. Other threads talk to it
through a command queue (add / abort / call); outputs travel back to each request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``. Loading happens in that thread too, so an
HTTP server can answer ``/health`` with 503 while the weights load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from edgemoe.config import EngineConfig, ModelConfig
from edgemoe.engine.host_malloc import keep_freed_memory
from edgemoe.engine.llm_engine import LLMEngine, RequestOutput
from edgemoe.engine.metrics import EngineMetrics
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.engine.sampling import SamplingParams

__all__ = ["AsyncLLM", "EngineNotReadyError", "RequestFailedError"]

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5
_STATS_TIMEOUT_S = 10.0


class EngineNotReadyError(RuntimeError):
    """The model is still loading, failed to load, or the engine was shut down."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (an exception while computing it); other requests go on."""


class _Stream:
    """Where the engine thread delivers one request's outputs (lives on the caller's event loop)."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


class AsyncLLM:
    """Serve requests concurrently from asyncio code.

    Args:
        model_dir: checkpoint directory (used by the default runner factory).
        config: engine options (``EngineConfig``); default options when ``None``.
        runner_factory: builds the runner in the engine thread; default
            ``ModelRunner(model_dir, config, progress)``.
        progress: show a loading progress bar.
        on_ready: called in the engine thread with the engine once the runner is loaded
            (e.g. to print ``runner.summary()``).
        on_load_error: called in the engine thread with the exception when loading fails (e.g. to
            stop an HTTP server that would otherwise answer 503 forever); also in :attr:`load_error`.
        start: start the engine thread (and loading) now.

    Call :meth:`shutdown` to stop the thread.
    """

    def __init__(
        self,
        model_dir: str | None = None,
        config: EngineConfig | None = None,
        *,
        runner_factory: Callable[[], Any] | None = None,
        progress: bool = True,
        on_ready: Callable[[LLMEngine], None] | None = None,
        on_load_error: Callable[[BaseException], None] | None = None,
        start: bool = True,
    ):
        if runner_factory is None:
            if model_dir is None:
                raise ValueError("AsyncLLM needs model_dir or runner_factory")

            cfg = config or EngineConfig()
            on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
            if cfg.keep_freed_host_memory and on_cpu:
                keep_freed_memory()  # before the engine thread exists, so that it allocates from the main heap

            def runner_factory():
                return ModelRunner(str(model_dir), cfg, progress=progress)

        self.model_dir = model_dir
        self._runner_factory = runner_factory
        self._on_ready = on_ready
        self._on_load_error = on_load_error
        self.metrics = EngineMetrics()
        self.metrics.add_expert_stats_source(self._expert_stats)
        self.engine: LLMEngine | None = None
        self.tokenizer: Any = None  # the front end's own copy (tokenizers are not shared across threads)
        self.load_error: BaseException | None = None
        self._ready = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopped = False
        self._last_stats: dict | None = None
        self._thread = threading.Thread(target=self._run, name="edgemoe-engine", daemon=True)
        if start:
            self.start()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the engine thread (it loads the runner, then serves)."""
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        """True once the runner is loaded and the engine serves."""
        return self._ready.is_set() and self.engine is not None and not self._stopped

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loading ends (successfully or not); returns :attr:`is_ready`.

        Raises:
            EngineNotReadyError: loading failed (the cause is chained).
        """
        self._ready.wait(timeout)
        if self.load_error is not None:
            raise EngineNotReadyError(f"model failed to load: {self.load_error}") from self.load_error
        return self.is_ready

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request, stop the engine thread and wait for it (up to ``timeout`` s)."""
        if self._stopped:
            return
        self._stopped = True
        self._commands.put(("stop",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---------------------------------------------------------------- queries

    def _require_engine(self) -> LLMEngine:
        if self.load_error is not None:
            raise EngineNotReadyError(f"model failed to load: {self.load_error}")
        if self._stopped:
            raise EngineNotReadyError("the engine is shut down")
        if self.engine is None:
            raise EngineNotReadyError("the model is still loading")
        return self.engine

    @property
    def max_model_len(self) -> int:
        return self._require_engine().max_model_len

    @property
    def model_config(self) -> ModelConfig:
        """The model's normalized configuration (read-only; raises ``EngineNotReadyError`` while loading)."""
        return self._require_engine().runner.model_config

    @property
    def generation_config(self) -> dict[str, Any]:
        """The checkpoint's ``generation_config.json`` as saved (``{}`` when absent; read-only; raises
        ``EngineNotReadyError`` while loading)."""
        return self._require_engine().runner.generation_config

    @property
    def kv_cache_pages(self) -> tuple[int, int] | None:
        """``(used, total)`` KV-cache pages: ``total`` those requests can hold, ``used`` those held by
        requests in flight (unreferenced prefix-cache pages count as free: they are evicted on
        demand); ``None`` while loading. Read-only counters, safe from any thread."""
        if not self.is_ready:
            return None
        runner = self.engine.runner
        total = runner.kv_capacity_tokens // runner.kv.page_size
        return total - runner.kv.free_pages, total

    @property
    def num_running(self) -> int:
        """Admitted requests (0 while loading)."""
        return self.engine.num_running if self.engine is not None else 0

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting if self.engine is not None else 0

    @property
    def num_unfinished(self) -> int:
        """Requests the engine still tracks (queued, prefilling or decoding)."""
        return self.num_running + self.num_waiting

    def call_in_engine_thread(self, fn: Callable[[LLMEngine], Any], timeout: float | None = None) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result.

        Raises:
            EngineNotReadyError: not loaded; ``TimeoutError`` after ``timeout`` s; whatever ``fn`` raises.
        """
        engine = self._require_engine()
        if threading.current_thread() is self._thread:
            return fn(engine)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        return fut.result(timeout)

    def _expert_stats(self) -> dict | None:
        """Scrape-time expert stats, read on the engine thread (the last snapshot when it is busy)."""
        if not self.is_ready:
            return None
        try:
            self._last_stats = self.call_in_engine_thread(lambda e: e.runner.expert_stats(), _STATS_TIMEOUT_S)
        except (TimeoutError, concurrent.futures.TimeoutError, EngineNotReadyError):
            pass
        except Exception:
            log.exception("expert_stats() failed")
        return self._last_stats

    # ---------------------------------------------------------------- requests

    @property
    def prompt_limit(self) -> int:
        """The most prompt tokens accepted now (see :attr:`LLMEngine.prompt_limit`; any thread)."""
        return self._require_engine().prompt_limit

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Validate now, on the caller's thread (see :meth:`LLMEngine.check_prompt`)."""
        return self._require_engine().check_prompt(prompt_token_ids, params)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has ``finished=True``.

        Leaving the iteration early (``break``, cancellation, a dropped HTTP client) aborts the
        request and frees its KV pages.

        Raises:
            EngineNotReadyError: the model is not loaded.
            PromptTooLongError / ValueError: the prompt is rejected (raised before anything is queued).
            RequestFailedError: the engine failed this request while computing it.
        """
        params = params or SamplingParams()
        self.check_prompt(list(prompt_token_ids), params)
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(("add", request_id, list(prompt_token_ids), params, prompt, time.perf_counter(), stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(item.error)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, asynchronous: takes effect before the engine's next step)."""
        self._commands.put(("abort", request_id))

    # ---------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            runner = self._runner_factory()
            engine = LLMEngine(runner, metrics=self.metrics)
            try:
                self.tokenizer = copy.deepcopy(engine.tokenizer)
            except Exception:
                self.tokenizer = engine.tokenizer
            if self._on_ready is not None and not self._stopped:  # not after a shutdown during the load
                self._on_ready(engine)
        except BaseException as exc:
            log.debug("model failed to load", exc_info=exc)  # the message says what; the traceback is for debugging
            self.load_error = exc
            self._ready.set()
            if self._on_load_error is not None:
                self._on_load_error(exc)
            return
        self.engine = engine
        self._ready.set()
        try:
            while self._serve_commands(engine, block=not engine.has_unfinished_requests()):
                if not engine.has_unfinished_requests():
                    self._idle_tick(engine)
                    continue
                try:
                    outputs = engine.step()
                except Exception as exc:
                    log.exception("engine step failed; failing the in-flight requests")
                    outputs = engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                self._dispatch(outputs)
        finally:
            self._stopped = True
            self._dispatch(engine.fail_all("the engine is shut down"))
            self._drain_after_stop()

    @staticmethod
    def _idle_tick(engine: LLMEngine) -> None:
        """While idle (at most every ``_IDLE_POLL_S``), the memory budget still follows the device."""
        try:
            engine.runner.memory.tick()
        except Exception:  # the budget must not stop the engine thread
            log.exception("memory budget tick failed")

    def _drain_after_stop(self) -> None:
        """Answer commands that arrived after ``stop`` so no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[-1].put(EngineNotReadyError("the engine is shut down"))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(EngineNotReadyError("the engine is shut down"))

    def _serve_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Apply queued commands; wait for one when ``block``. Returns False on ``stop``."""
        while True:
            try:
                cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, request_id, ids, params, prompt, arrival, stream = cmd
                try:
                    engine.add_request(request_id, ids, params, prompt=prompt, arrival_time=arrival)
                    self._streams[request_id] = stream
                except Exception as exc:
                    stream.put(exc)
            elif kind == "abort":
                out = engine.abort(cmd[1])
                if out is not None:
                    self._dispatch([out])
            elif kind == "call":
                _, fn, fut = cmd
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(engine))
                    except BaseException as exc:
                        fut.set_exception(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
