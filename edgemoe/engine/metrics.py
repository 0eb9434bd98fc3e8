"""Prometheus metrics of one engine (``/metrics``).

Every engine owns its own ``CollectorRegistry`` (several engines, e.g. in tests, never collide).
Request and token counters, latency histograms and queue gauges are updated by the engine; the
expert-cache figures are read at scrape time from ``ModelRunner.expert_stats()`` by
:class:`ExpertCacheCollector` (hits, misses, fills and CPU-executed expert uses per
phase, cache slots, q*/m, B_P, B_H).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

__all__ = ["EngineMetrics", "ExpertCacheCollector"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 45.0, 90.0, 180.0, 600.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ExpertCacheCollector:
    """Custom collector exposing ``expert_stats()`` (a dict as documented on ``ModelRunner``) at scrape time.

    Args:
        stats_fn: returns the stats dict, or ``None`` when no model is loaded yet. It is called on
            the scraping thread; :class:`edgemoe.engine.async_engine.AsyncLLM` passes a function that
            asks the engine thread, so only that thread touches the runner.
    """

    _COUNTERS = (
        ("hits", "edgemoe_expert_cache_hits", "Routed-expert uses served from the expert cache"),
        ("misses", "edgemoe_expert_cache_misses", "Routed-expert uses not resident in the expert cache"),
        ("fills", "edgemoe_expert_cache_fills",
         "Experts copied host->device into a cache slot (streamed prefill copies whole layers)"),
        ("cpu", "edgemoe_expert_cpu_executed", "Misses computed by the CPU executor from host memory"),
    )

    def __init__(self, stats_fn: Callable[[], dict | None]):
        self._stats_fn = stats_fn

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_fn()
        if not stats:
            return
        for key, name, doc in self._COUNTERS:
            fam = CounterMetricFamily(name, doc + " (token-deduplicated), by phase", labels=["phase"])
            for phase in ("prefill", "decode"):
                value = (stats.get(phase) or {}).get(key)
                if value is not None:
                    fam.add_metric([phase], float(value))
            yield fam
        gauges = (
            ("slots", "edgemoe_expert_cache_slots", "(layer, expert) slots in the expert cache"),
            ("slots_used", "edgemoe_expert_cache_slots_used", "Expert-cache slots holding an expert"),
            ("experts_total", "edgemoe_expert_pool_experts", "Routed (layer, expert) pairs in the host pool"),
            ("q_ratio", "edgemoe_expert_q_ratio", "Fill fraction q*/m of the decode miss policy"),
            ("b_p_gbps", "edgemoe_bandwidth_pcie_gbps", "B_P: host-to-device expert transfer bandwidth (GB/s)"),
            ("b_h_gbps", "edgemoe_bandwidth_cpu_gbps", "B_H: CPU expert-execution bandwidth (GB/s)"),
        )
        for key, name, doc in gauges:
            if stats.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        yield from self._memory(stats.get("memory"))
        yield InfoMetricFamily(
            "edgemoe_expert_policy",
            "Expert miss policy and where its bandwidths come from",
            value={"policy": str(stats.get("policy", "")), "active_rule": str(stats.get("policy_active", "")),
                   "bandwidth_source": str(stats.get("bandwidth_source", ""))},
        )


    _MEMORY_GAUGES = (
        ("budget_bytes", "edgemoe_gpu_budget_bytes",
         "GPU memory for the expert and KV caches: a fixed budget, or (auto) what they hold plus free memory above "
         "the headroom"),
        ("headroom_bytes", "edgemoe_gpu_headroom_bytes", "Device memory auto mode keeps free"),
        ("free_bytes", "edgemoe_gpu_free_bytes", "Free device memory, every process counted (last sample)"),
        ("total_bytes", "edgemoe_gpu_total_bytes", "Device memory in total"),
        ("expert_cache_bytes", "edgemoe_expert_cache_bytes", "Bytes of the device expert cache"),
        ("kv_cache_bytes", "edgemoe_kv_cache_bytes", "Bytes of the KV cache"),
        ("kv_borrowed_pages", "edgemoe_kv_cache_borrowed_pages",
         "KV pages beyond the start-up pool, borrowed from the expert cache or free memory"),
    )

    def _memory(self, mem: dict | None) -> Iterator[Metric]:
        """The memory budget's gauges (``GpuMemory.stats``) and resizes by reason."""
        if not mem:
            return
        for key, name, doc in self._MEMORY_GAUGES:
            if mem.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=float(mem[key]))
        yield GaugeMetricFamily("edgemoe_gpu_budget_auto", "1 when the GPU budget follows the device's free memory",
                                value=float(bool(mem.get("auto"))))
        fam = CounterMetricFamily("edgemoe_memory_resizes", "Expert-cache / KV-cache resizes by reason",
                                  labels=["reason"])
        for reason, n in (mem.get("resizes") or {}).items():
            fam.add_metric([reason], float(n))
        yield fam


class EngineMetrics:
    """The engine's Prometheus instruments, in a private ``CollectorRegistry``.

    Exposed names (Prometheus adds ``_total`` / ``_bucket`` suffixes):
    ``edgemoe_requests_total{finish_reason}``, ``edgemoe_prompt_tokens_total``,
    ``edgemoe_generation_tokens_total``, ``edgemoe_preemptions_total``,
    ``edgemoe_prefix_cache_hit_tokens_total`` (tokens whose KV came from the prefix cache),
    ``edgemoe_prompt_tokens_computed_total`` (tokens prefill computed, recomputation after preemption
    included; hit / (hit + computed) is the prefix-cache hit rate), ``edgemoe_prefix_cache_pages``,
    ``edgemoe_state_checkpoint_restores_total`` and ``edgemoe_state_checkpoint_reused_tokens_total``
    (hybrid models: admissions resumed from a recurrent-state checkpoint, and the prompt tokens they
    skipped, also counted as prefix-cache hits), ``edgemoe_state_checkpoints`` (checkpoints held),
    ``edgemoe_time_to_first_token_seconds``, ``edgemoe_time_per_output_token_seconds``,
    ``edgemoe_e2e_request_latency_seconds``, ``edgemoe_generation_tokens_per_second`` (over the last
    ``window_s`` seconds), ``edgemoe_num_requests_running``, ``edgemoe_num_requests_waiting`` and the
    expert-cache families of :class:`ExpertCacheCollector`.

    Thread-safety: updates come from the engine thread, reads from the scraper; the token window is
    guarded by a lock, the rest by ``prometheus_client``.
    """

    def __init__(self, window_s: float = 10.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("edgemoe_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("edgemoe_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("edgemoe_generation_tokens", "Generated tokens", registry=r)
        self.preemptions = Counter("edgemoe_preemptions", "Requests preempted for lack of KV cache", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "edgemoe_prefix_cache_hit_tokens", "Prompt tokens whose KV was reused from the prefix cache", registry=r
        )
        self.prompt_tokens_computed = Counter(
            "edgemoe_prompt_tokens_computed", "Tokens computed by prefill (recompute after preemption included)",
            registry=r,
        )
        self.prefix_cache_pages = Gauge("edgemoe_prefix_cache_pages", "KV pages held by the prefix cache", registry=r)
        self.state_checkpoint_restores = Counter(
            "edgemoe_state_checkpoint_restores", "Admissions that resumed from a recurrent-state checkpoint", registry=r
        )
        self.state_checkpoint_reused_tokens = Counter(
            "edgemoe_state_checkpoint_reused_tokens",
            "Prompt tokens skipped by resuming from a recurrent-state checkpoint",
            registry=r,
        )
        self.state_checkpoints = Gauge(
            "edgemoe_state_checkpoints", "Recurrent-state checkpoints held (hybrid models)", registry=r
        )
        self.ttft = Histogram(
            "edgemoe_time_to_first_token_seconds", "Time to first token (s)", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "edgemoe_time_per_output_token_seconds", "Decode time per output token (s)", buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "edgemoe_e2e_request_latency_seconds", "Arrival to finish (s)", buckets=_LATENCY_BUCKETS, registry=r
        )
        self._window_s = window_s
        self._window: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        Gauge(
            "edgemoe_generation_tokens_per_second", f"Generated tokens/s over the last {window_s:g} s", registry=r
        ).set_function(self.tokens_per_second)
        self.running = Gauge("edgemoe_num_requests_running", "Requests being prefilled or decoded", registry=r)
        self.waiting = Gauge("edgemoe_num_requests_waiting", "Requests queued for admission", registry=r)

    def bind_queues(self, num_running: Callable[[], int], num_waiting: Callable[[], int]) -> None:
        """Read the running/waiting gauges from the engine at scrape time."""
        self.running.set_function(num_running)
        self.waiting.set_function(num_waiting)

    def bind_prefix_cache(self, cached_pages: Callable[[], int]) -> None:
        """Read the prefix-cache page gauge from the KV pool at scrape time."""
        self.prefix_cache_pages.set_function(cached_pages)

    def bind_state_checkpoints(self, held: Callable[[], int]) -> None:
        """Read the state-checkpoint gauge from the runner's checkpoint store at scrape time."""
        self.state_checkpoints.set_function(held)

    def add_expert_stats_source(self, stats_fn: Callable[[], dict | None]) -> None:
        """Register the scrape-time expert-cache collector reading ``stats_fn()``."""
        self.registry.register(ExpertCacheCollector(stats_fn))

    def observe_step(self, new_tokens: int) -> None:
        """Record one engine step that sampled ``new_tokens`` tokens."""
        now = time.monotonic()
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        with self._lock:
            self._window.append((now, new_tokens))
            while self._window and self._window[0][0] < now - self._window_s:
                self._window.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last ``window_s`` seconds (0 when idle)."""
        now = time.monotonic()
        with self._lock:
            total = sum(n for t, n in self._window if t >= now - self._window_s)
        return total / self._window_s

    def observe_finished(
        self, finish_reason: str, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None
    ) -> None:
        """Record a finished request (times in seconds; ``None`` when not applicable)."""
        self.requests.labels(finish_reason=finish_reason).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
