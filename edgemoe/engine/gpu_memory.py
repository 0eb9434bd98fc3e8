"""One device-memory budget for the expert cache and the KV cache, followed at run time.

:class:`GpuMemory` (``ModelRunner.memory``) owns the budget of one runner and applies it between two
steps (a safe point: no step in flight), so requests in flight continue:

- **Auto mode** (``--gpu-budget auto``, on CUDA): a :class:`MemoryProbe` samples the device's free
  memory as the driver sees it across every process (NVML through ``nvidia-ml-py``; ``torch.cuda.mem_get_info``
  where NVML is missing), at most once per ``tuning.period_s`` (host-side calls only: no device
  synchronization is added to a step). :class:`BudgetController` keeps ``--gpu-headroom-gb`` free:
  below it the expert cache shrinks at once (down to 0 slots if need be: another program's allocation
  failing is worse than slower decode), by whole slots, to the middle of a dead band
  ``[headroom, headroom + hysteresis]``; above the band for ``tuning.grow_hold_s`` it grows back to the
  middle of the band, up to the size asked for at start-up. Inside the band nothing changes, so a
  resize does not trigger the opposite one (no oscillation).
- **Fixed budget** (``--gpu-budget GB``): expert cache + KV cache = the budget.
- **KV / expert re-split** (every device, the CPU too): when a step needs more KV pages than are free
  (the scheduler would preempt), the KV pool grows (:meth:`PagedKVPool.resize`) by memory taken first
  from the free memory above the headroom (auto mode), then from the expert cache, whole slots at a
  time, never below ``--min-expert-cache-slots``. Once the pages in use fit in the start-up pool again
  for ``tuning.return_hold_s`` (sessions ended), the KV pool shrinks back (unreferenced cached prefixes
  in the returned pages are dropped) and the expert cache gets the memory again.

A resize rebuilds the expert cache (cold; ``ExpertRuntime.set_cache``) and drops captured CUDA graphs
(the runner's ``rebind``); the next decode step of each batch size captures anew, over the new tensors.
A resize that cannot be carried out restores the previous state and raises :class:`ResizeError`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from edgemoe.config import EngineConfig
from edgemoe.engine.expert_runtime import ExpertRuntime, NoGpuError, ResizeError
from edgemoe.kvcache.pool import PagedKVPool

__all__ = ["BudgetController", "GpuMemory", "MemoryProbe", "MemorySample", "NoGpuError", "NvmlProbe",
           "ResizeError", "TorchCudaProbe", "Tuning", "make_probe"]

log = logging.getLogger(__name__)

GB = 1e9


@dataclass(frozen=True)
class MemorySample:
    """Device memory at one instant, in bytes, across every process on the device."""

    free_bytes: int
    total_bytes: int


class MemoryProbe(Protocol):
    """Samples a device's memory. ``source`` names where the numbers come from."""

    source: str

    def sample(self) -> MemorySample: ...


class NvmlProbe:
    """Device memory from NVML (``nvidia-ml-py``): the driver's count, other processes included.

    Args:
        device: a CUDA device; its NVML handle is found by the UUID CUDA reports (so
            ``CUDA_VISIBLE_DEVICES`` renumbering does not matter).

    Raises:
        ImportError: ``nvidia-ml-py`` is not installed. ``pynvml.NVMLError``: NVML cannot be
            initialized or does not know the device.
    """

    source = "nvml"

    def __init__(self, device: torch.device):
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")

    def sample(self) -> MemorySample:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return MemorySample(int(info.free), int(info.total))


class TorchCudaProbe:
    """Device memory from ``torch.cuda.mem_get_info`` (``cudaMemGetInfo``: also device-wide)."""

    source = "torch.cuda.mem_get_info"

    def __init__(self, device: torch.device):
        self.device = device

    def sample(self) -> MemorySample:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySample(int(free), int(total))


def make_probe(device: torch.device) -> MemoryProbe | None:
    """NVML for a CUDA device, ``torch.cuda.mem_get_info`` when NVML is unavailable, ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    try:
        return NvmlProbe(device)
    except Exception as exc:  # ImportError or any NVMLError: the CUDA runtime's view serves
        log.info("NVML unavailable (%s); sampling free GPU memory with torch.cuda.mem_get_info", exc)
        return TorchCudaProbe(device)


@dataclass(frozen=True)
class Tuning:
    """Timing and dead band of the budget (seconds and bytes).

    Attributes:
        period_s: at most one memory sample per period (the reaction time to pressure is one period
            plus one step).
        hysteresis_bytes: width of the dead band above the headroom.
        grow_hold_s: free memory stays above the band this long before the expert cache grows.
        return_hold_s: borrowed KV pages stay unused this long before they go back to the expert cache.
    """

    period_s: float = 0.25
    hysteresis_bytes: int = 1 << 30
    grow_hold_s: float = 2.0
    return_hold_s: float = 5.0


class BudgetController:
    """The expert cache's target size, decided from one memory sample (no torch, no side effects
    beyond its timer; :class:`GpuMemory` applies the decisions).

    Args:
        tuning: dead band and hold time.
    """

    def __init__(self, tuning: Tuning):
        self.tuning = tuning
        self._above_since: float | None = None  # when free memory rose above the dead band

    def decide(self, now: float, free_bytes: int, headroom_bytes: int, slots: int, row_bytes: int, floor_slots: int,
               cap_slots: int) -> tuple[int, str] | None:
        """Auto mode: ``(new slots, reason)`` or ``None`` (keep ``slots``).

        Args:
            now: monotonic seconds. free_bytes: the device's free memory. headroom_bytes: memory to keep free.
            slots: current expert-cache slots of ``row_bytes`` each. floor_slots / cap_slots: the range
                the size may move in (a cache below the floor is not shrunk further, nor above the cap grown).

        Returns:
            ``reason`` ``"pressure"`` (shrink: free below the headroom) or ``"returned"`` (grow: free above
            the band for ``grow_hold_s``).
        """
        band = self.tuning.hysteresis_bytes
        middle = headroom_bytes + band // 2
        if free_bytes < headroom_bytes:
            self._above_since = None
            target = max(min(floor_slots, slots), slots - math.ceil((middle - free_bytes) / row_bytes))
            return (target, "pressure") if target < slots else None
        if free_bytes <= headroom_bytes + band or slots >= cap_slots:
            self._above_since = None
            return None
        if self._above_since is None:
            self._above_since = now
        if now - self._above_since < self.tuning.grow_hold_s:
            return None
        self._above_since = None
        target = min(cap_slots, slots + (free_bytes - middle) // row_bytes)
        return (target, "returned") if target > slots else None


class GpuMemory:
    """The budget of one runner's expert cache and KV pool (see the module doc).

    Args:
        experts: the expert runtime (its cache is resized).
        kv: the KV pool (resized when the KV cache borrows memory).
        config: engine options (``gpu_budget``, ``gpu_headroom_gb``, ``min_expert_cache_slots``,
            ``max_num_seqs``; the start-up cache size is the cap auto mode grows back to).
        max_kv_pages: the most pages the KV pool may grow to (every sequence at ``max_model_len``).
        rebind: called after a resize (the runner binds the new tensors and drops its CUDA graphs).
        probe: the memory probe (``make_probe``: ``None`` off CUDA); its device memory is what the
            budget follows, whatever ``experts.device`` is.
        tuning: timing and dead band.
        clock: monotonic seconds (tests drive it).

    Raises:
        NoGpuError: a fixed ``gpu_budget`` for a device that is not a GPU.
    """

    def __init__(self, experts: ExpertRuntime, kv: PagedKVPool, config: EngineConfig, *, max_kv_pages: int,
                 rebind: Callable[[], None], probe: MemoryProbe | None, tuning: Tuning = Tuning(),
                 clock: Callable[[], float] = time.monotonic):
        self.experts, self.kv, self.rebind, self.probe, self.clock = experts, kv, rebind, probe, clock
        self.device = experts.device
        self.gpu = self.device.type == "cuda" or probe is not None  # a device memory to budget
        budget = config.gpu_budget_bytes
        if budget is not None and not self.gpu:
            raise NoGpuError(f"gpu_budget {config.gpu_budget}: the device is {self.device}, not a GPU, so there is "
                             "no GPU memory to budget")
        self.budget_bytes = budget
        self.auto = self.gpu and budget is None and probe is not None
        self.headroom_bytes = int(config.gpu_headroom_gb * GB)
        self.controller = BudgetController(tuning)
        slots = experts.cache.num_slots
        explicit = experts.explicit_slots()
        self.cap_slots = explicit if explicit is not None or not self.auto else experts.pool.num_ids
        self.floor_slots = (min(slots, int(config.min_expert_cache_slots)) if config.min_expert_cache_slots is not None
                            else slots // 2)
        self.base_kv_pages = kv.num_pages
        self.max_kv_pages = max(max_kv_pages, kv.num_pages)
        self.last_sample: MemorySample | None = None
        self.resizes: Counter[str] = Counter()  # by reason
        self.history: deque[dict] = deque(maxlen=64)  # the split after each change
        self.last_error: str | None = None
        self._next_sample = 0.0
        self._unused_since: float | None = None  # when the borrowed KV pages were last all free
        self._credit_bytes = 0  # taken from the expert cache by a borrow, not yet given to the KV pool
        self.kv_limit_pages = kv.num_pages  # pages the KV pool holds or may borrow, as of the last change
        self._record("start")

    @property
    def tuning(self) -> Tuning:
        return self.controller.tuning

    @tuning.setter
    def tuning(self, value: Tuning) -> None:
        self.controller.tuning = value

    # ------------------------------------------------------------------ figures
    @property
    def row_bytes(self) -> int:
        return self.experts.pool.row_bytes

    @property
    def expert_bytes(self) -> int:
        return self.experts.cache.num_slots * self.row_bytes

    @property
    def borrowed_pages(self) -> int:
        """KV pages beyond the start-up pool (memory borrowed from the expert cache or the free memory)."""
        return max(0, self.kv.num_pages - self.base_kv_pages)

    def _spare_bytes(self) -> int:
        """Memory the budget has beyond what the caches hold: the free memory above the headroom (auto,
        as last sampled), what a fixed budget leaves, else the bytes of expert slots taken by earlier
        borrows beyond the whole pages they bought."""
        if self.budget_bytes is not None:
            return max(0, self.budget_bytes - self.expert_bytes - self.kv.nbytes)
        if self.auto and self.last_sample is not None:
            return max(0, self.last_sample.free_bytes - self.headroom_bytes - self.tuning.hysteresis_bytes // 2)
        return self._credit_bytes

    def _refresh(self) -> None:
        """Update :attr:`kv_limit_pages` (read by other threads; everything else here is the engine thread's)."""
        self.kv_limit_pages = self.kv.num_pages + self.lendable_kv_pages()

    def lendable_kv_pages(self) -> int:
        """Pages the KV pool could gain now (the scheduler counts them as free): the spare memory plus
        the expert cache above its floor, at most up to ``max_kv_pages``."""
        room = self.max_kv_pages - self.kv.num_pages
        if room <= 0:
            return 0
        lendable = self._spare_bytes() + max(0, self.experts.cache.num_slots - self.floor_slots) * self.row_bytes
        return min(room, lendable // self.kv.page_bytes)

    # ------------------------------------------------------------------ between steps
    def tick(self) -> None:
        """Between two steps: at most once per ``tuning.period_s``, sample the device memory and apply
        the controller's decision (auto mode), and give borrowed KV pages back once unused for
        ``tuning.return_hold_s``. A failed resize is logged and kept in ``last_error`` (the previous
        state stands)."""
        now = self.clock()
        if now < self._next_sample:
            return
        self._next_sample = now + self.tuning.period_s
        if self.probe is not None:
            self.last_sample = self.probe.sample()
            self._refresh()
        try:
            self._return_kv(now)
            if self.auto and self.last_sample is not None:
                decision = self.controller.decide(now, self.last_sample.free_bytes, self.headroom_bytes,
                                                  self.experts.cache.num_slots, self.row_bytes, 0, self.cap_slots)
                if decision is not None:
                    self._resize_experts(*decision)
        except (ResizeError, torch.OutOfMemoryError) as exc:
            self.last_error = str(exc)
            log.warning("memory budget: %s", exc)

    def relieve(self) -> bool:
        """A step ran out of device memory (another process took it faster than the sampling period):
        shrink the expert cache now, to the pressure target of a fresh sample, at least by the dead
        band's width. A safe point: the failed step left nothing in flight.

        Returns:
            whether the expert cache gave memory back (the caller retries the step once).
        """
        slots = self.experts.cache.num_slots
        if self.probe is None or not slots:
            return False
        self.last_sample = self.probe.sample()
        band = self.tuning.hysteresis_bytes
        need = max(self.headroom_bytes + band // 2 - self.last_sample.free_bytes, band)
        try:
            self._resize_experts(max(0, slots - math.ceil(need / self.row_bytes)), "out-of-memory")
        except (ResizeError, torch.OutOfMemoryError) as exc:
            self.last_error = str(exc)
            log.warning("memory budget: %s", exc)
        return self.experts.cache.num_slots < slots

    def _return_kv(self, now: float) -> None:
        """Shrink the KV pool back towards its start-up size once the pages in use (held by sequences or
        referenced prefixes) fit in the start-up pool again for ``return_hold_s`` (sessions ended);
        the expert cache grows by the memory returned, up to its cap."""
        if not self.borrowed_pages or self.kv.num_pages - self.kv.free_pages > self.base_kv_pages:
            self._unused_since = None  # none borrowed, or the sequences still need more than the start-up pool
            return
        target = max(self.base_kv_pages, self.kv.min_pages())
        if target >= self.kv.num_pages:
            self._unused_since = None
            return
        if self._unused_since is None:
            self._unused_since = now
        if now - self._unused_since < self.tuning.return_hold_s:
            return
        self._unused_since = None
        freed = (self.kv.num_pages - target) * self.kv.page_bytes
        self.kv.resize(target)
        if not self.auto and self.budget_bytes is None:
            freed += self._credit_bytes
        grow = max(0, min(self.cap_slots - self.experts.cache.num_slots, freed // self.row_bytes))
        self._credit_bytes = freed - grow * self.row_bytes if grow and not self.auto else 0
        if grow:
            self._resize_experts(self.experts.cache.num_slots + grow, "kv-returned")
        else:
            self.rebind()
            self.resizes["kv-returned"] += 1
            self._record("kv-returned")

    def lend_kv(self, short_pages: int) -> bool:
        """Grow the KV pool by at least ``short_pages`` pages (a step needs them; a safe point), from
        the spare memory, then from the expert cache (whole slots, down to the floor).

        Returns:
            ``True`` when the pages are there; ``False`` when they cannot be had (nothing changed: the
            caller preempts as without a budget).
        """
        if short_pages <= 0:
            return True
        if self.auto:
            self.last_sample = self.probe.sample()
        lendable = self.lendable_kv_pages()
        if short_pages > lendable:
            return False
        # borrow a quarter of the pool at least: each borrow rebuilds the expert cache cold and moves the KV
        pages = min(lendable, max(short_pages, self.kv.num_pages // 4))
        page, spare = self.kv.page_bytes, self._spare_bytes()
        take = max(0, math.ceil((pages * page - spare) / self.row_bytes))
        old_slots = self.experts.cache.num_slots
        pages = min(self.max_kv_pages - self.kv.num_pages, (spare + take * self.row_bytes) // page)
        new_pages = self.kv.num_pages + pages
        try:
            if take:
                self.experts.resize(slots=old_slots - take)
            stage = self.gpu and self.probe is not None and (  # the old and the new pages do not both fit
                self.probe.sample().free_bytes < new_pages * page + self.headroom_bytes // 2)
            self.kv.resize(new_pages, stage_on_host=stage)
        except (ResizeError, ValueError, torch.OutOfMemoryError) as exc:
            self.last_error = f"the KV cache could not borrow {short_pages} pages: {exc}"
            log.warning("memory budget: %s", self.last_error)
            if self.experts.cache.num_slots != old_slots:
                self._restore_experts(old_slots)
            self.rebind()
            return False
        self.rebind()
        if not self.auto and self.budget_bytes is None:
            self._credit_bytes = spare + take * self.row_bytes - pages * page
        self.resizes["kv-borrowed"] += 1
        self._record("kv-borrowed")
        log.info("KV cache short by %d pages: grew to %d pages, expert cache %d -> %d slots", short_pages,
                 new_pages, old_slots, self.experts.cache.num_slots)
        return True

    def _resize_experts(self, slots: int, reason: str) -> None:
        old = self.experts.cache.num_slots
        try:
            self.experts.resize(slots=slots)
        finally:
            self.rebind()
        self.resizes[reason] += 1
        self._record(reason)
        log.info("memory budget (%s): expert cache %d -> %d slots (%.2f GB)", reason, old, slots,
                 self.expert_bytes / GB)

    def _restore_experts(self, slots: int) -> None:
        try:
            self.experts.resize(slots=slots)
        except ResizeError as exc:
            log.warning("memory budget: could not restore %d expert-cache slots: %s", slots, exc)

    def summary_line(self) -> str:
        """The start-up summary's memory line."""
        floor = f"the KV cache may take the expert cache down to {self.floor_slots} slots"
        if not self.gpu:
            return f"  memory       no GPU budget ({self.device}); {floor}"
        how = ("auto: follows the free device memory" if self.auto else
               f"fixed {self.budget_bytes / GB:.2f} GB" if self.budget_bytes is not None else "fixed")
        free = "" if self.last_sample is None else f", {self.last_sample.free_bytes / GB:.1f} GB free"
        source = "" if self.probe is None else f" ({self.probe.source}{free})"
        return f"  memory       GPU budget {how}{source}, headroom {self.headroom_bytes / GB:.1f} GB; {floor}"

    # ------------------------------------------------------------------ the admin interface
    def configure(self, *, auto: bool | None = None, budget_gb: float | None = None, headroom_gb: float | None = None,
                  expert_gb: float | None = None, expert_slots: int | None = None, policy: str | None = None,
                  min_expert_slots: int | None = None) -> dict:
        """Change the budget at a safe point between steps and return :meth:`stats`.

        ``budget_gb`` sets a fixed budget (auto off); ``auto=True`` follows the device again;
        ``expert_gb`` / ``expert_slots`` / ``policy`` resize the expert cache (the new size becomes the
        cap auto mode grows back to). Everything is validated before anything changes.

        Raises:
            NoGpuError: ``auto``, ``budget_gb``, ``headroom_gb`` or ``expert_gb`` for a device that is not a GPU.
            ValueError: an inconsistent request (both sizes, a budget below the KV cache, ...).
            ResizeError: the resize could not be carried out (the previous state is kept).
        """
        if not self.gpu:
            given = [name for name, v in (("auto", auto), ("budget_gb", budget_gb), ("headroom_gb", headroom_gb),
                                          ("expert_gb", expert_gb)) if v is not None]
            if given:
                raise NoGpuError(f"{', '.join(given)}: the device is {self.device}, not a GPU, so there is no GPU "
                                 "memory to budget; size the expert cache on this device with expert_slots")
        if auto and budget_gb is not None:
            raise ValueError("give auto: true or budget_gb (a fixed budget), not both")
        if auto and self.probe is None:
            raise ValueError("auto mode needs a memory probe of the device")
        if expert_gb is not None and expert_slots is not None:
            raise ValueError("give expert_gb or expert_slots, not both")
        if min_expert_slots is not None and min_expert_slots < 0:
            raise ValueError("min_expert_slots must be >= 0")
        row, n = self.row_bytes, self.experts.pool.num_ids
        slots = (min(n, int(expert_gb * GB // row)) if expert_gb is not None else
                 min(n, int(expert_slots)) if expert_slots is not None else None)
        budget = None if budget_gb is None else int(budget_gb * GB)
        if budget is not None:
            if budget < self.kv.nbytes:
                raise ValueError(f"budget_gb {budget_gb}: less than the KV cache's {self.kv.nbytes / GB:.2f} GB")
            fit = (budget - self.kv.nbytes) // row
            if slots is not None and slots > fit:
                raise ValueError(f"{slots} expert-cache slots ({slots * row / GB:.2f} GB) and the KV cache "
                                 f"({self.kv.nbytes / GB:.2f} GB) exceed budget_gb {budget_gb}")
            slots = min(n, fit) if slots is None else slots
        if slots is not None or policy is not None:
            try:
                self.experts.resize(slots=slots, policy=policy)
            finally:
                self.rebind()
            self.resizes["admin"] += 1
        if slots is not None:
            self.cap_slots = slots
            self.floor_slots = min(self.floor_slots, slots)
        if min_expert_slots is not None:
            self.floor_slots = min(int(min_expert_slots), self.experts.cache.num_slots)
        if headroom_gb is not None:
            self.headroom_bytes = int(headroom_gb * GB)
        if budget is not None:
            self.budget_bytes, self.auto = budget, False
        elif auto is not None:
            self.auto = bool(auto)
            if auto:
                self.budget_bytes = None
                if slots is None:
                    self.cap_slots = n
        self.last_error = None
        self._next_sample = 0.0  # the next tick samples at once
        self._record("admin")
        return self.stats()

    def stats(self, history: bool = True) -> dict:
        """The budget and the split, in bytes: ``auto``, ``budget_bytes`` (a fixed budget, or in auto
        mode what the caches hold plus the free memory above the headroom), ``headroom_bytes``,
        ``free_bytes`` / ``total_bytes`` (last sample, ``None`` off the GPU), ``probe``,
        ``expert_cache_bytes`` / ``expert_cache_slots`` / ``min_expert_cache_slots`` /
        ``max_expert_cache_slots``, ``kv_cache_bytes`` / ``kv_pages`` / ``kv_borrowed_pages``,
        ``resizes`` by reason, ``last_error`` and, with ``history``, the split after each recent change."""
        sample = self.last_sample
        held = self.expert_bytes + self.kv.nbytes
        if self.budget_bytes is not None:
            budget = self.budget_bytes
        elif sample is not None:
            budget = held + max(0, sample.free_bytes - self.headroom_bytes)
        else:
            budget = None
        return {
            "device": str(self.device),
            "auto": self.auto,
            "budget_bytes": budget,
            "headroom_bytes": self.headroom_bytes if self.gpu else None,
            "free_bytes": None if sample is None else sample.free_bytes,
            "total_bytes": None if sample is None else sample.total_bytes,
            "probe": None if self.probe is None else self.probe.source,
            "expert_cache_bytes": self.expert_bytes,
            "expert_cache_slots": self.experts.cache.num_slots,
            "min_expert_cache_slots": self.floor_slots,
            "max_expert_cache_slots": self.cap_slots,
            "kv_cache_bytes": self.kv.nbytes,
            "kv_pages": self.kv.num_pages,
            "kv_borrowed_pages": self.borrowed_pages,
            "resizes": dict(self.resizes),
            "last_error": self.last_error,
            **({"history": list(self.history)} if history else {}),
        }

    def _record(self, reason: str) -> None:
        """After a change: sample again (the figures show the new split) and append it to the history."""
        if self.probe is not None:
            self.last_sample = self.probe.sample()
        self._refresh()
        sample = self.last_sample
        self.history.append({"time": time.time(), "reason": reason, "expert_cache_bytes": self.expert_bytes,
                             "kv_cache_bytes": self.kv.nbytes,
                             "free_bytes": None if sample is None else sample.free_bytes})
