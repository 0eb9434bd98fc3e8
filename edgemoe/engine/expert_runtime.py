"""The routed-expert side of the model runner at run time.

:class:`ExpertRuntime` owns, for one loaded model: the CPU expert executor, the device expert cache
and its size (from the budget options, or free GPU memory), the bandwidths B_P / B_H the policy uses,
the expert policy, the hybrid executor the MoE blocks call (``HybridExperts``), and the device
decode path's lifecycle (``DeviceDecode``: created with the cache, closed before a resize). It feeds
online policies each decode step's wall time and checks a decode step's CPU branch afterwards.
The host expert pool is given (loaded by the runner) and never changes here.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import replace
from enum import Enum

import torch

from edgemoe.config import EXPERT_POLICIES, EngineConfig, ModelConfig
from edgemoe.core import Phase
from edgemoe.experts.bandwidth import BANDWIDTH_POLICIES, resolve_bandwidths
from edgemoe.experts.cache import CacheCounters, ExpertCache
from edgemoe.experts.compute import kernel_reason
from edgemoe.experts.cpu_executor import make_cpu_executor
from edgemoe.experts.device_decode import DeviceDecode, resolve_doorbell_wait
from edgemoe.experts.hybrid import HybridExperts
from edgemoe.experts.native import ALONGSIDE_CUDA
from edgemoe.experts.policy import (
    REUSE_READ_SECONDS,
    Bandwidths,
    ExpertPolicy,
    LayerObservation,
    make_policy,
)
from edgemoe.experts.pool import HostExpertPool
from edgemoe.kernels import unavailable_reason
from edgemoe.weights.bootstrap import FALLBACK_POLICY

log = logging.getLogger(__name__)


class NoGpuError(ValueError):
    """A GPU memory size was given for a runner whose device is not a GPU (nothing changes)."""


class ResizeError(RuntimeError):
    """A resize that passed validation could not be carried out (e.g. the device memory is not there);
    the previous state was restored and the message says why."""


def configure_torch_threads(cpu_threads: int | None) -> None:
    """Set torch's intra-op threads for the process once, at start-up: ``--cpu-threads`` when given
    (the torch CPU executor and the dense CPU layers follow it), else torch's default (one per
    physical core, as the native executor's pool).

    The two pools share the cores without oversubscribing them because they take turns (a layer's
    torch ops, then its CPU experts) and torch's idle workers sleep instead of spinning:
    ``edgemoe`` sets ``OMP_WAIT_POLICY=PASSIVE`` when it is imported before torch. When torch was
    imported first, its workers spin and a warning says so (with more than one thread).
    """
    if cpu_threads:
        torch.set_num_threads(int(cpu_threads))
    if "OMP_WAIT_POLICY" not in os.environ and torch.get_num_threads() > 1:
        log.warning("torch was imported before edgemoe, so its %d CPU threads spin-wait between operations, which "
                    "collapses decode when other processes load the CPU; set OMP_WAIT_POLICY=PASSIVE before "
                    "importing torch (or import edgemoe first)", torch.get_num_threads())


class DecodePath(str, Enum):
    """How decode steps run: the eager (host-controlled) path, or the device path with its control
    on the GPU, eagerly or replayed from CUDA graphs."""

    EAGER = "eager"
    DEVICE = "device"
    DEVICE_GRAPHS = "device + CUDA graphs"


class ExpertRuntime:
    """Expert cache, policy, bandwidths, CPU executor and decode path of one model.

    Args:
        pool: the host expert pool (filled, pinned when allowed).
        model_config: the model's geometry (``num_experts``, ``top_k``).
        config: engine options (cache budget, policy, bandwidth overrides, CPU executor, threads).
        device: the compute device.
        fallback: pinning was refused at start-up: no expert cache, every expert on the CPU.
        graphs_supported: the architecture's decode step can be captured (a class capability).
        kv_bytes: bytes of the KV cache on the device (a fixed ``--gpu-budget`` holds both).

    Attributes:
        cache, policy, bandwidths, hybrid, cpu_executor: the current objects (rebuilt by
            :meth:`set_cache`); ``hybrid.device_decode`` is the device decode path or ``None``.
        decode_path: :class:`DecodePath`; ``decode_path_reason``: why not the fastest one (or ``None``).
        doorbell_wait: the device path's doorbell wait for the summary (e.g. ``kernel (auto)``; ``None``
            without a device path).
    """

    def __init__(self, pool: HostExpertPool, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, *, fallback: bool, graphs_supported: bool, kv_bytes: int = 0):
        self.pool, self.model_config, self.config, self.device = pool, model_config, config, device
        self.kv_bytes = kv_bytes  # the KV cache's bytes on the device when the cache is sized
        self.fallback = fallback
        self.graphs_supported = graphs_supported
        self.cpu_executor = self._make_cpu_executor()
        self.cache: ExpertCache | None = None
        self.bandwidths: Bandwidths | None = None
        self.policy: ExpertPolicy | None = None
        self.hybrid: HybridExperts | None = None
        self.decode_path = DecodePath.EAGER
        self.decode_path_reason: str | None = None
        self.doorbell_wait: str | None = None  # the device path's doorbell wait, as the summary names it
        self._reset_counts()
        self._step_done: torch.cuda.Event | None = None  # blocking event the decode step's end is awaited on
        if fallback:
            self.set_cache(0, FALLBACK_POLICY)
        else:
            self.set_cache(self.default_slots(), config.expert_policy)

    def _reset_counts(self) -> None:
        """The counts and clocks of a fresh start: no decode step seen, no window read, totals at zero."""
        self._last_decode: tuple[float, int] | None = None  # (start time, batch size) of the previous decode step
        # (reuse, join stats, decode misses, decode steps, slots used) at the last read
        self._reuse_seen: tuple | None = None
        self._window_decode_s = 0.0  # seconds of decode steps since the last read (prefills and idle time not counted)
        self._window_free_fills = 0  # slots decode steps took in before a prefill, since the last read
        self._decode_steps = 0
        self._probe_next = 0  # first pool expert of the next CPU-speed probe (_cpu_probe)
        # counters of the caches replaced by a resize, so the reported totals never decrease
        self._retired: dict[str, dict[str, int]] = {ph.value: CacheCounters().as_dict() for ph in Phase}
        self._retired["prefetch"] = {"prefetched": 0, "prefetch_hits": 0}  # next-layer prefetch

    def restart(self) -> None:
        """Start over as a fresh engine would, after steps that must leave no trace (the start-up warm-up,
        :meth:`ModelRunner.warm_up`): the cache rebuilt cold at its size and policy, the policy from its prior
        (nothing learned carried over), every count and clock of :meth:`stats` and the policy's windows at zero.
        The measured bandwidths, the CPU executor and the kernels it and the device path compiled stay. The
        caller rebinds the model's MoE blocks to :attr:`hybrid` and drops captured decode graphs.

        Raises:
            RuntimeError: the cache could not be set up again (e.g. out of device memory).
        """
        slots, policy = self.cache.num_slots, self.policy.name
        self._retire_hybrid()
        self._reset_counts()
        self.set_cache(slots, policy)

    def _make_cpu_executor(self, **native_kw):
        return make_cpu_executor(self.pool, self.config.cpu_threads, self.config.cpu_executor,
                                 alongside=ALONGSIDE_CUDA if self.device.type == "cuda" else 0, **native_kw)

    def set_cpu_threads(self, threads: int | None, oversubscribe: bool = False) -> None:
        """Replace the CPU executor by one of ``threads`` threads (``None``: the default count) and
        rebuild the cache over it (cold, same size and policy), at a safe point between steps. The
        caller rebinds the model's MoE blocks to :attr:`hybrid` and drops captured decode graphs.

        Args:
            threads: the count (capped as at start-up: ``edgemoe.experts.native.plan_threads``).
            oversubscribe: take ``threads`` as given, beyond the cap (benchmarks measuring the cap).

        Raises:
            ValueError: ``threads < 1`` (nothing changes then).
        """
        if threads is not None and threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {threads}")
        self._retire_hybrid()  # before the executor goes: the device path's server thread is its worker 0
        self.config = replace(self.config, cpu_threads=threads)
        self.cpu_executor = self._make_cpu_executor(**({"oversubscribe": True} if oversubscribe else {}))
        self.set_cache(self.cache.num_slots, self.policy.name)

    def set_join_lateness(self, lateness: str) -> None:
        """Count the device decode path's joins ``lateness`` (``EngineConfig.join_lateness``; checked by the
        caller) and rebuild the cache (cold, same size and policy), at a safe point between steps. The caller
        rebinds the model's MoE blocks to :attr:`hybrid` and drops captured decode graphs. On an error (raised)
        the option is put back and the cache rebuilt cold under it."""
        previous, slots, policy = self.config, self.cache.num_slots, self.policy.name
        self.config = replace(self.config, join_lateness=lateness)
        try:
            self.set_cache(slots, policy)
        except Exception:  # e.g. the device path refuses the count, or the device is out of memory
            self.config = previous
            self.set_cache(slots, policy)
            raise

    # ------------------------------------------------------------------ sizing
    def explicit_slots(self) -> int | None:
        """Cache slots the options ask for (``expert_cache_slots``, else ``expert_cache_gb``), at most
        one slot per expert; ``None`` when neither is given."""
        cfg, row, n = self.config, self.pool.row_bytes, self.pool.num_ids
        if cfg.expert_cache_slots is not None:
            return min(int(cfg.expert_cache_slots), n)
        if cfg.expert_cache_gb is not None:
            return min(int(cfg.expert_cache_gb * 1e9 // row), n)
        return None

    def default_slots(self) -> int:
        """Cache slots at start-up: :meth:`explicit_slots`, else on CUDA what the GPU budget leaves
        (``--gpu-budget GB``: the budget minus the KV cache already allocated; ``auto``: the device's
        free memory minus ``--gpu-headroom-gb``), on CPU 0; at most one slot per expert."""
        cfg, row, n = self.config, self.pool.row_bytes, self.pool.num_ids
        explicit = self.explicit_slots()
        if explicit is not None:
            return explicit
        if self.device.type != "cuda":
            return 0
        budget = cfg.gpu_budget_bytes
        if budget is not None:
            return max(0, min(n, int((budget - self.kv_bytes) // row)))
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(0, min(n, int((free - cfg.gpu_headroom_gb * 1e9) // row)))

    @property
    def device_decode(self) -> DeviceDecode | None:
        return self.hybrid.device_decode

    # ------------------------------------------------------------------ (re)building
    def _retire_hybrid(self) -> None:
        """Retire the expert paths once: their counts (the device path's included) carry over into the
        totals of :meth:`stats`, and the device path's doorbell server stops now, not when the last
        reference goes."""
        if self.hybrid is None:
            return
        for ph, counts in self.hybrid.stats().items():
            for key, v in counts.items():
                self._retired[ph][key] += v
        if self.hybrid.device_decode is not None:
            self.hybrid.device_decode.close()
        self.hybrid = None

    def set_cache(self, slots: int, policy: str, inherit: bool = False) -> None:
        """(Re)build the device expert cache with ``slots`` slots under ``policy``, at a safe point
        between steps (no step in flight). The host pool is untouched; the new cache starts cold (a
        static policy re-places its layers); the hit/miss/fill/CPU totals of :meth:`stats` carry on
        (the old cache's counts are kept), so they never decrease. The caller rebinds the
        model's MoE blocks to :attr:`hybrid` and drops captured decode graphs. ``inherit``: a new policy
        of the old one's name takes over what the old one learned of the machine (``ExpertPolicy.inherit``;
        a resize), else it starts from its prior.

        Raises:
            ValueError: negative ``slots`` or an unknown policy (checked before anything changes).
        """
        if slots < 0:
            raise ValueError("expert cache slots must be >= 0")
        if policy not in EXPERT_POLICIES:
            raise ValueError(f"unknown expert policy {policy!r}; choose one of {', '.join(EXPERT_POLICIES)}")
        slots = min(int(slots), self.pool.num_ids)
        previous = self.policy if inherit and self.policy is not None and self.policy.name == policy else None
        self._retire_hybrid()
        if self.cache is not None:  # free the old bank before allocating the new one
            self.cache.release()
            self.cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        pool = self.pool
        self.cache = ExpertCache(slots, pool.num_ids, pool.layout, pool.compute_dtype, self.device,
                                 num_experts=self.model_config.num_experts,
                                 partition_layers=self.config.expert_eviction == "layer-lru"
                                 and slots >= self.model_config.num_moe_layers * self.model_config.top_k)
        if self.bandwidths is None or (policy in BANDWIDTH_POLICIES and slots > 0
                                       and None in (self.bandwidths.pcie, self.bandwidths.cpu)):
            self.bandwidths = resolve_bandwidths(replace(self.config, expert_policy=policy), pool, self.cache,
                                                 self.cpu_executor)
        cfg = self.model_config
        self.policy = make_policy(policy, self.bandwidths, num_layers=cfg.num_moe_layers,
                                  max_misses=min(cfg.num_experts, self.config.max_num_seqs * cfg.top_k),
                                  expert_bytes=pool.row_bytes)
        if previous is not None:
            self.policy.inherit(previous)
        # the first read counts from this cache's creation: its counters start at zero
        self._reuse_seen = ([[0, 0]] * self.cache.num_layers, None, 0, self._decode_steps, self.cache.slots_used)
        self._window_decode_s, self._window_free_fills = 0.0, 0
        self.hybrid = HybridExperts(pool, self.cache, self.policy, self.cpu_executor, self.model_config.num_experts,
                                    self.device)
        self._setup_device_decode()

    def resize(self, gb: float | None = None, slots: int | None = None, policy: str | None = None) -> None:
        """Change the expert cache's budget and/or policy at a safe point between steps (the elastic
        GPU budget). The policy, kept, also keeps what it learned of the machine (``ExpertPolicy.inherit``).
        If the new cache cannot be set up, the previous size and policy are restored (if even that fails, the
        CPU-only cache of 0 slots) and the error is raised.

        Args:
            gb: new budget in GB (1e9 bytes); or ``slots``: new size in (layer, expert) slots.
            policy: a new expert policy (default: keep the current one).

        Raises:
            NoGpuError: ``gb`` for a device that is not a GPU (size a cache there in ``slots``).
            ValueError: both or neither of ``gb``/``slots`` with no ``policy``, a negative or infinite
                size, an unknown policy, or a pool that could not be pinned (nothing changes then).
            ResizeError: the new cache could not be set up (the previous one is restored).
        """
        if gb is not None and self.device.type != "cuda":
            raise NoGpuError(f"gb {gb}: the device is {self.device}, not a GPU, so there is no GPU memory to budget; "
                             "size the expert cache on this device in slots")
        if gb is not None and slots is not None:
            raise ValueError("give gb or slots, not both")
        if (gb is not None and gb < 0) or (slots is not None and slots < 0):
            raise ValueError("the expert-cache size must be >= 0")
        if gb is None and slots is None and policy is None:
            raise ValueError("give gb, slots or policy")
        if policy is not None and policy not in EXPERT_POLICIES:
            raise ValueError(f"unknown expert policy {policy!r}; choose one of {', '.join(EXPERT_POLICIES)}")
        if gb is not None and not math.isfinite(gb):
            raise ValueError("gb must be a finite number")
        old_slots, old_policy = self.cache.num_slots, self.policy.name
        new_slots = old_slots if gb is None and slots is None else (
            min(int(slots), self.pool.num_ids) if slots is not None else
            int(min(gb * 1e9, self.pool.nbytes) // self.pool.row_bytes))
        if self.fallback and (new_slots > 0 or (policy or old_policy) != FALLBACK_POLICY):
            raise ValueError("the host expert pool could not be pinned at start-up, so experts run on the CPU "
                             f"only: the cache stays at 0 slots with policy {FALLBACK_POLICY}")
        try:
            self.set_cache(new_slots, policy or old_policy, inherit=True)
        except Exception as exc:
            log.warning("expert cache resize to %d slots failed (%s); restoring %d slots", new_slots, exc, old_slots)
            try:
                self.set_cache(old_slots, old_policy, inherit=True)
                kept = f"kept {old_slots} slots"
            except Exception:
                self.set_cache(0, FALLBACK_POLICY)
                kept = f"the previous size no longer fits either: now 0 slots, policy {FALLBACK_POLICY}"
            raise ResizeError(f"could not set up {new_slots} expert-cache slots "
                             f"({new_slots * self.pool.row_bytes / 1e9:.2f} GB): {exc}; {kept}") from None
        if self.cache.num_slots != old_slots:
            log.info("expert cache resized: %d -> %d slots (%.2f GB), policy %s", old_slots, self.cache.num_slots,
                     self.cache.nbytes / 1e9, self.policy.name)
        else:
            log.info("expert policy %s -> %s (the cache stays at %d slots, %.2f GB)", old_policy, self.policy.name,
                     old_slots, self.cache.nbytes / 1e9)

    def _setup_device_decode(self) -> None:
        """The device decode path (routing control on the device, Triton kernels) when the kernels run
        on this device, read the pool's rows (float, FP8 block, MXFP4, NVFP4: ``kernel_reason``) and the
        cache has slots; otherwise decode takes the eager path."""
        self.decode_path, self.doorbell_wait = DecodePath.EAGER, None
        reason = unavailable_reason(self.device)
        if reason is None and (why := kernel_reason(self.pool.layout)) is not None:
            reason = (f"the device decode kernels do not read these expert rows ({why}): decode dequantizes them "
                      "in torch")
        if reason is None and self.cache.num_slots == 0:
            reason = "no expert cache slots"
        if reason is not None:
            self.decode_path_reason = reason
            return
        cfg = self.model_config
        wait_mode, self.doorbell_wait = resolve_doorbell_wait(self.config.doorbell_wait, self.device)
        dd = DeviceDecode(self.pool, self.cache, self.policy, self.cpu_executor, cfg.num_experts, cfg.top_k,
                          self.config.max_num_seqs, wait_mode=wait_mode, lateness=self.config.join_lateness)
        self.hybrid.device_decode = dd
        graphs = not self.config.enforce_eager and dd.capturable and self.graphs_supported
        self.decode_path = DecodePath.DEVICE_GRAPHS if graphs else DecodePath.DEVICE
        self.decode_path_reason = None if graphs else (
            "--enforce-eager" if self.config.enforce_eager else
            "the CPU branch needs the native executor to be captured" if not dd.capturable else
            "this architecture is not captured yet")

    # ------------------------------------------------------------------ per step
    def begin_step(self, step: int, phase: Phase, batch_size: int) -> None:
        """Before a step: set the LRU clock and feed an online policy the wall time of the previous
        decode step (from its start to this step's start, counted only between two decode steps of
        one batch size; the engine samples, a sync, in between). A per-layer policy also gets the cache's
        counters every ``ExpertPolicy.read_window_steps`` decode steps (``REUSE_READ_STEPS`` unless it asks for
        fewer), or after ``REUSE_READ_SECONDS`` of decode steps when they are slow (:meth:`_observe_reuse`): a
        window holds at least one decode step run, and the time of prefills and of idle gaps between requests does
        not count toward it. A rule change goes to the device."""
        if self.cache.num_slots:
            self.cache.clock.fill_(step)
        now = time.perf_counter()
        if self._last_decode is not None:  # the previous step was a decode step: its time counts toward the window
            self._window_decode_s += now - self._last_decode[0]
            if phase is not Phase.DECODE and self.policy.per_layer:  # a prefill: keep the decode steps' free-slot
                self._window_free_fills += self.cache.slots_used - self._reuse_seen[4]  # fills (not the prefill's)
        if phase is Phase.DECODE and self.policy.per_layer:
            if self._last_decode is None:  # a prefill since the last decode step: its fills took free slots too
                self._reuse_seen = (*self._reuse_seen[:4], self.cache.slots_used)
            since = self._decode_steps - self._reuse_seen[3]  # decode steps run since the last read
            if since >= 1 and (since >= self.policy.read_window_steps or self._window_decode_s >= REUSE_READ_SECONDS):
                self._observe_reuse()
                self._window_decode_s = 0.0
            self._decode_steps += 1
        prev, self._last_decode = self._last_decode, (now, batch_size) if phase is Phase.DECODE else None
        if prev is None or phase is not Phase.DECODE or prev[1] != batch_size:
            return
        if self.policy.observe(now - prev[0], batch_size) and self.device_decode is not None:
            self.device_decode.push_policy()

    def _observe_reuse(self) -> None:
        """Feed a per-layer policy the cache's reuse counters since the last read (one small host read,
        between steps: the previous step's sampling already synchronized) and push a changed table.

        The miss count it reports per MoE layer step leaves out the misses that found a free slot (the
        growth of the used slots over the window's decode steps, also reported: the slots a prefill took in are
        not counted, :meth:`begin_step` keeps the growth before one and takes the baseline again after it): those
        fill whatever the policy says, so a cold cache's first misses do not stand for the misses the policy decides
        about."""
        dd = self.device_decode
        joins = dd.join_stats.tolist() if dd is not None and dd.counts_joins else None  # [L][hand-offs, late]
        now = (self.cache.reuse.tolist(), joins, self.hybrid.stats()["decode"]["misses"], self._decode_steps,
               self.cache.slots_used)
        seen, self._reuse_seen = self._reuse_seen, now
        (reuse, joins, misses, steps, used), (reuse0, joins0, misses0, steps0, used0) = now, seen
        free = max(used - used0, 0) + self._window_free_fills  # the decode steps' fills that found a free slot
        self._window_free_fills = 0
        if joins is not None and joins0 is None:
            joins0 = [[0, 0]] * len(joins)
        layer_steps = (steps - steps0) * self.cache.num_layers
        decided = max(misses - misses0 - free, 0)
        obs = LayerObservation(reuse_net=[a[0] - b[0] for a, b in zip(reuse, reuse0)],
                               fills=[a[1] - b[1] for a, b in zip(reuse, reuse0)],
                               handoffs=None if joins is None else [a[0] - b[0] for a, b in zip(joins, joins0)],
                               late=None if joins is None else [(a[1] - b[1]) / dd.late_unit
                                                                for a, b in zip(joins, joins0)],
                               misses_per_layer_step=decided / layer_steps if layer_steps > 0 else None,
                               cpu_probe=self._cpu_probe(self.policy.wants_cpu_probe),
                               free_slot_fills=free, steps=steps - steps0)
        if self.policy.observe_layers(obs) and self.device_decode is not None:
            self.device_decode.push_policy()
        elif self.device_decode is not None:  # the balance level may have moved without a new table
            self.device_decode.push_join_limits()

    def _cpu_probe(self, experts: int) -> tuple[int, float] | None:
        """Time one call of the CPU executor over ``experts`` pool experts with one zero token each (a CPU-speed
        probe the policy asked for, :attr:`ExpertPolicy.wants_cpu_probe`); ``(experts, seconds)``, or ``None``
        when none was asked. Between steps, while no CPU branch runs (the policy asks only while its table
        fills every miss); the experts rotate through the pool so the reads come from DRAM, not a warm cache."""
        n = min(int(experts), self.pool.num_ids)
        if n <= 0:
            return None
        start = self._probe_next % max(1, self.pool.num_ids - n + 1)
        self._probe_next = start + 997 * n  # a stride coprime with typical pool sizes
        tok, wt = torch.zeros(1, dtype=torch.int64), torch.ones(1)
        x, out = torch.zeros(1, self.pool.hidden), torch.zeros(1, self.pool.hidden)
        t0 = time.perf_counter()
        self.cpu_executor.run(x, [(start + i, tok, wt) for i in range(n)], out)
        return n, time.perf_counter() - t0

    def check_decode_step(self) -> None:
        """After a device-path decode step with a CPU branch: wait for it (the engine's sampling would
        anyway) and raise if that branch went wrong, so the engine fails those requests instead of
        sampling from logits that lack the CPU experts.

        The wait blocks (a ``blocking`` CUDA event: the thread sleeps in the driver until the GPU
        reaches it) instead of spinning as a stream synchronization does by default: for the whole
        step the CPU experts run on the native pool, and a spinning Python thread would take a core
        from it (``edgemoe.experts.native.plan_threads``).

        Raises:
            RuntimeError: see ``DeviceDecode.check``.
        """
        dd = self.device_decode
        if dd is not None and dd.step is not None and dd.armed:  # a step without the branch: sampling syncs
            if self._step_done is None:
                self._step_done = torch.cuda.Event(blocking=True)
            self._step_done.record(torch.cuda.current_stream(self.device))
            self._step_done.synchronize()
            dd.check()

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        """Expert-cache state and counters for metrics and the summary: per phase ``{hits, misses,
        fills, cpu}`` totals since start-up, across cache resizes (Prometheus counters never decrease)."""
        bw = self.bandwidths
        counts = {ph: {key: self._retired[ph][key] + v for key, v in c.items()}
                  for ph, c in self.hybrid.stats().items()}
        return {
            "policy": self.policy.name,
            "slots": self.cache.num_slots,
            "slots_used": self.cache.slots_used,
            "experts_total": self.pool.num_ids,
            "b_p_gbps": bw.pcie,
            "b_h_gbps": bw.cpu,
            "bandwidth_source": bw.source,
            "q_ratio": self.policy.q_ratio(),
            "policy_active": self.policy.active_name,
            **counts,
        }

    def summary_lines(self, pinned: bool) -> list[str]:
        """The start-up summary's expert lines (pool, cache, bandwidths, decode path)."""
        cfg, bw = self.model_config, self.bandwidths

        def gbps(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1f} GB/s"

        fallback = ": pinning refused, so policy cpu-all without expert cache" if self.fallback else ""
        path = self.decode_path.value + (f" ({self.decode_path_reason})" if self.decode_path_reason else "")
        dd = self.device_decode
        if dd is not None and dd.step is not None:
            path += f"; CPU branch through the doorbell, wait {self.doorbell_wait}"
            if dd.lateness != "yes-no":
                path += f", joins counted {dd.lateness}"
        return [
            f"  experts      {cfg.num_moe_layers} MoE layers x {cfg.num_experts} experts, top-{cfg.top_k}, "
            f"{self.pool.format.value} rows of {self.pool.row_bytes / 1e6:.2f} MB; "
            f"host pool {self.pool.nbytes / 1e9:.2f} GB ({'pinned' if pinned else 'pageable'}{fallback})",
            f"  expert cache {self.cache.num_slots} slots = {self.cache.nbytes / 1e9:.2f} GB "
            f"({100 * self.cache.num_slots / max(1, self.pool.num_ids):.1f}% of experts), policy {self.policy.name}",
            f"  bandwidth    B_P {gbps(bw.pcie)}, B_H {gbps(bw.cpu)} [{bw.source}]; q*/m = {self.policy.q_ratio():.3f}",
            f"  decode path  {path}",
        ]
