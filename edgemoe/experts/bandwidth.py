"""Measuring B_P and B_H on this machine with this model's expert shape (``edgemoe profile``).

- **B_P**: host→device copy bandwidth of whole packed expert rows (the deployed layout's ``row_bytes``:
  FP8 / MXFP4 / NVFP4 rows move at their packed size) from the pool's memory (pinned when CUDA is
  present) into device slots, moved the way a decode step's fills move: a page-locked pool on CUDA through
  the device decode path's gather kernel (:func:`measure_fill`; its rate and the copy engine's differ by host),
  else with the copy engine (:func:`measure_copy`). On a CPU-only machine the "device cache" is a
  second host buffer, so B_P is a memory copy and is reported as not applying to PCIe.
- **B_H**: bytes of expert rows (the same ``row_bytes``) the CPU executor *in use* (native kernels where
  they build and read the format, else torch ops) consumes per second computing one token per expert
  (batch-1 decode) through its ``run`` call, weights rotating over far more than the last-level cache so they
  come from DRAM (``edgemoe profile``: >= 2 GB, > 6x the H200 host's 300 MiB L3).
- **Concurrent**: both at once (they contend for DRAM: on the H200 host a CPU read ran at 55 GB/s
  while host→device copies ran at 48 GB/s, against 57 and 55 GB/s alone). The policy then uses
  ``B_P := B_P,conc`` and ``B_H := B_P,conc + B_H,conc`` (the DRAM throughput both branches reach
  together), for which the q* closed form ``m·B_P/B_H`` is exactly the split that equalizes the two
  branches' times. Without a concurrent measurement it uses the isolated pair, as the paper does.

All bandwidths are GB/s (1e9 bytes per second).

**Plausibility** (:func:`implausible`). A measurement taken while other processes load the CPU
describes that moment, not the machine, and a saved profile is reused by every later start. So
each isolated bandwidth is measured in ``ROUNDS`` rounds (the median is kept), and a measurement is
rejected when

- a bandwidth is below ``MIN_PLAUSIBLE_GBPS`` (0.1 GB/s): two orders of magnitude under any memory
  system or PCIe link the engine runs on (one PCIe 1.0 lane moves 0.25 GB/s, one DDR3 channel
  6 GB/s, the 2-core dev VM copies expert rows at ~10 GB/s), so it measured a starved process;
- its rounds disagree by more than ``MAX_ROUND_SPREAD`` (2x): steady hardware repeats itself within
  a few percent, a contended machine does not;
- (Linux) other processes kept more than ``MAX_OTHER_LOAD`` (half) of the cores busy during the
  measurement (``/proc/stat`` minus this process's own CPU time).

``edgemoe profile`` then saves nothing and fails with the reason; a saved profile that fails the
check is not used; the quick start-up measurement is retried once and otherwise used with a warning.

All bandwidths are GB/s (1e9 bytes per second). A saved profile is keyed by the expert format and shape
(its file name and its match key): the engine looks up the one for its pool's layout.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import statistics
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from edgemoe.config import ExpertActivation
from edgemoe.experts.compute import kernel_reason
from edgemoe.experts.cpu_executor import CpuExecutor
from edgemoe.experts.policy import Bandwidths, QStarPolicy
from edgemoe.experts.pool import HostExpertPool, default_compute_dtype
from edgemoe.kernels import kernel_module
from edgemoe.quant.layout import ExpertLayout
from edgemoe.startup import startup_step

log = logging.getLogger(__name__)

PROFILE_VERSION = 5  # 2: B_H with DECODE_CPU_EXPERTS experts per call; 3: rounds, other processes' load; 4: by format;
# 5: B_P of a page-locked pool on CUDA through the decode step's fill kernel
ROTATE_BYTES_PROFILE = 2_000_000_000  # > 6x a 300 MiB L3
ROTATE_BYTES_QUICK = 512_000_000
QUICK_SECONDS = 0.15  # per bandwidth at start-up (`edgemoe profile`: 1 s)
ROUNDS = 3
MIN_PLAUSIBLE_GBPS = 0.1
MAX_ROUND_SPREAD = 2.0
MAX_OTHER_LOAD = 0.5  # fraction of the cores other processes may keep busy while measuring
DECODE_CPU_EXPERTS = 4
BANDWIDTH_POLICIES = ("qstar", "auto", "adaptive")  # the policies that need B_P and B_H
"""Experts per CPU-executor call when B_H is measured: a batch-1 decode step of a top-8 model sends a few
experts of each layer to the CPU in one call (about 3.7 per layer under q* on the H200 host), so the
per-call cost is shared by that many experts, not charged to each."""


def default_profile_path(layout: ExpertLayout, device: torch.device) -> Path:
    """``~/.cache/edgemoe/profile-{H}x{I}-{format}-{device}.json`` (``EDGEMOE_CACHE`` overrides the folder),
    e.g. ``profile-2048x768-nvfp4-cuda.json``."""
    root = Path(os.environ.get("EDGEMOE_CACHE", Path.home() / ".cache" / "edgemoe"))
    shape = f"{layout.hidden}x{layout.intermediate}"
    return root / f"profile-{shape}-{layout.format.value}-{torch.device(device).type}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rotation_pool(pool: HostExpertPool | None, layout: ExpertLayout, compute_dtype: torch.dtype,
                   rotate_bytes: int, pin: bool, activation: ExpertActivation) -> HostExpertPool:
    """The pool itself when it is large enough to defeat the CPU caches, else a synthetic one of ``layout``."""
    if pool is not None and pool.nbytes >= rotate_bytes:
        return pool
    rows = max(8, -(-rotate_bytes // layout.row_bytes))
    synth = HostExpertPool(rows, layout, compute_dtype, activation)
    synth.fill_random(seed=1234)
    if pin:
        synth.pin()
    return synth


def measure_copy(pool: HostExpertPool, device: torch.device, seconds: float, stop: threading.Event | None = None,
                 rows_per_copy: int = 8) -> float:
    """B_P in GB/s: copy rotating runs of ``rows_per_copy`` packed expert rows from ``pool`` into ``device``.

    One copy call per run keeps the Python side idle (it mostly waits in synchronize with the GIL
    released), so a concurrent CPU measurement is not starved by this thread.
    """
    device = torch.device(device)
    n = min(rows_per_copy, pool.num_ids)
    dst = torch.empty((n, pool.row_bytes), dtype=torch.uint8, device=device)
    nb = pool.pinned and device.type == "cuda"
    starts = torch.randperm(max(1, pool.num_ids - n + 1)).tolist()

    def copy(i: int) -> None:
        s = starts[i % len(starts)]
        dst.copy_(pool.bank[s:s + n], non_blocking=nb)

    return _copy_rate(copy, pool.row_bytes * n, device, seconds, stop)


def _copy_rate(copy, nbytes: int, device: torch.device, seconds: float, stop: threading.Event | None) -> float:
    """GB/s of ``copy(i)`` calls of ``nbytes`` each, four between synchronizations, for at least ``seconds`` (or
    until ``stop`` is set)."""
    moved, i = 0, 0
    _sync(device)
    t0 = time.perf_counter()
    while True:
        for _ in range(4):
            copy(i)
            moved += nbytes
            i += 1
        _sync(device)
        dt = time.perf_counter() - t0
        if dt >= seconds or (stop is not None and stop.is_set()):
            return moved / dt / 1e9


def measure_fill(pool: HostExpertPool, device: torch.device, seconds: float, stop: threading.Event | None = None,
                 rows_per_copy: int = 8) -> float:
    """B_P in GB/s as a decode step's fills reach it: :func:`~edgemoe.kernels.gather.gather_fills` launches of
    ``rows_per_copy`` rows drawn at random from ``pool`` (page-locked) into ``device`` slots.

    The device decode path copies its fills with that kernel (SM loads through the pool's mapped address), not
    with the copy engine :func:`measure_copy` drives; the two can differ by host (the kernel reached 0.94 of the
    copy engine on an H200 host of the GPU lab, while on one H100 host a decode step's fills, GPU work included,
    moved 31 GB/s against a copy-engine 54.7). Each launch waits for the one before it (the pool's rows are read
    once per call, as a layer's fills are).

    Raises:
        ValueError: ``pool`` not page-locked, ``device`` not CUDA, or the Triton kernels unavailable there (use
            :func:`measure_copy`).
    """
    device = torch.device(device)
    gather = kernel_module("gather", device) if device.type == "cuda" and pool.pinned else None
    if gather is None:
        raise ValueError("measure_fill needs a page-locked pool and a CUDA device with the Triton kernels")
    n = min(rows_per_copy, pool.num_ids)
    dst = torch.empty((n, pool.row_bytes), dtype=torch.uint8, device=device)
    meta = torch.tensor([0, 0, n, 0], dtype=torch.int32, device=device)
    slots = torch.arange(n, device=device)
    g = torch.Generator().manual_seed(0)
    fids = torch.stack([torch.randperm(pool.num_ids, generator=g)[:n] for _ in range(64)]).to(device)  # [64, n]
    return _copy_rate(lambda i: gather.gather_fills(meta, fids[i % len(fids)], slots, pool.bank, dst),
                      pool.row_bytes * n, device, seconds, stop)


def fill_meter(pool: HostExpertPool, device: torch.device):
    """The B_P measurement of the decode path's fills: :func:`measure_fill` where a decode step fills through the
    device decode path's gather kernel (a page-locked pool on CUDA, the Triton kernels available and reading the
    pool's format), else :func:`measure_copy` (the eager path's copy engine, or a host memory copy)."""
    device = torch.device(device)
    fast = (device.type == "cuda" and pool.pinned and kernel_reason(pool.layout) is None
            and kernel_module("gather", device) is not None)
    return measure_fill if fast else measure_copy


def _executor_for(pool: HostExpertPool, executor: CpuExecutor) -> CpuExecutor:
    """``executor`` bound to ``pool`` (sharing its threads)."""
    return executor if executor.pool is pool else executor.with_pool(pool)


def measure_cpu(pool: HostExpertPool, executor, seconds: float, tokens: int = 1, experts_per_call: int = 1) -> float:
    """B_H in GB/s: weight bytes per second the CPU executor reads computing rotating experts.

    Args:
        pool: experts to rotate over (in random order; make it far larger than the L3).
        executor: the CPU executor (one bound to another pool is rebound, sharing its threads).
        seconds: measuring time (at least; a call in flight finishes).
        tokens: tokens routed to every expert (1 = batch-1 decode).
        experts_per_call: experts per ``run`` call (1: the per-call overhead is charged to each expert).

    The native executor is driven through a registered step in a C++ loop, as the decode path's
    doorbell server drives it (no Python per call); the torch executor through ``run``.

    Returns:
        GB/s (1e9 bytes of packed expert rows per second).
    """
    executor = _executor_for(pool, executor)
    order = torch.randperm(pool.num_ids)
    if executor.registers_steps:
        step = executor.make_step(tokens, experts_per_call, tokens * experts_per_call)
        try:
            step.x.copy_(torch.randn(tokens, pool.hidden))
            calls, dt = step.bench(order, tokens, experts_per_call, seconds)
        finally:
            step.close()
        return calls * experts_per_call * pool.row_bytes / dt / 1e9
    x = torch.randn(tokens, pool.hidden)  # [T, H] float32, as the hybrid path hands it over
    out = torch.zeros(tokens, pool.hidden)  # [T, H]
    tok = torch.arange(tokens)
    wt = torch.full((tokens,), 1.0 / 8)
    order = order.tolist()
    moved, i = 0, 0
    t0 = time.perf_counter()
    while True:
        for _ in range(8):
            work = [(order[(i + j) % len(order)], tok, wt) for j in range(experts_per_call)]
            executor.run(x, work, out)
            moved += pool.row_bytes * experts_per_call
            i += experts_per_call
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return moved / dt / 1e9


def measure_concurrent(pool: HostExpertPool, device: torch.device, executor, seconds: float,
                       experts_per_call: int = DECODE_CPU_EXPERTS) -> tuple[float, float]:
    """(B_P, B_H) in GB/s measured while both run at once (copy in a thread, CPU compute here)."""
    res: dict[str, float] = {}
    copy = fill_meter(pool, device)
    t = threading.Thread(target=lambda: res.__setitem__("p", copy(pool, device, seconds)))
    t.start()
    res["h"] = measure_cpu(pool, executor, seconds, experts_per_call=experts_per_call)
    t.join()
    return res["p"], res["h"]


class ImplausibleMeasurement(ValueError):
    """A bandwidth measurement failed the plausibility check (module doc); ``str()`` says why."""


class _MachineLoad:
    """CPU-seconds other processes used between :meth:`start` and :meth:`cores` (Linux ``/proc/stat``;
    ``None`` elsewhere): the machine's busy time minus this process's own."""

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        except (OSError, ValueError):
            return None
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy, ru.ru_utime + ru.ru_stime

    def start(self) -> "_MachineLoad":
        self._t0 = self._sample()
        return self

    def cores(self) -> float | None:
        """Cores' worth of CPU time other processes used since :meth:`start` (``None``: unknown)."""
        t1 = self._sample()
        if self._t0 is None or t1 is None or t1[0] <= self._t0[0]:
            return None
        return max(0.0, (t1[1] - self._t0[1]) - (t1[2] - self._t0[2])) / (t1[0] - self._t0[0])


def _rounds(fn, seconds: float) -> list[float]:
    """``fn(seconds / ROUNDS)`` ``ROUNDS`` times."""
    return [fn(seconds / ROUNDS) for _ in range(ROUNDS)]


def measure(pool: HostExpertPool | None, layout: ExpertLayout, device: torch.device, executor: CpuExecutor,
            seconds: float, rotate_bytes: int, compute_dtype: torch.dtype | None = None,
            activation: ExpertActivation | None = None) -> dict:
    """Isolated (median of ``ROUNDS`` rounds) and concurrent B_P/B_H for experts of ``layout`` (the deployed
    format and shape), and the other processes' load meanwhile. Returns the profile dict (see module doc);
    check it with :func:`implausible` before trusting or saving it.

    Args:
        pool: the engine's pool, rotated over when it holds at least ``rotate_bytes``; else (or ``None``) a
            synthetic pool of ``layout`` with random valid rows is measured.
        executor: the CPU executor whose B_H is measured (rebound to the rotation pool, sharing its
            threads). The profile records its ``name`` and ``threads``.
        compute_dtype: the experts' compute dtype (default: the pool's, else the layout's default).
        activation: the experts' activation (default: the pool's, else SiLU SwiGLU, with biases when the
            layout has them).
    """
    device = torch.device(device)
    if compute_dtype is None:
        compute_dtype = pool.compute_dtype if pool is not None else default_compute_dtype(layout)
    if activation is None:
        activation = pool.activation if pool is not None else ExpertActivation(bias=layout.has_bias)
    rot = _rotation_pool(pool, layout, compute_dtype, rotate_bytes, device.type == "cuda", activation)
    executor = _executor_for(rot, executor)
    copy = fill_meter(rot, device)
    copy(rot, device, 0.05)  # warm-up: allocator, first-touch, CUDA context, the fill kernel's compilation
    measure_cpu(rot, executor, 0.05, experts_per_call=DECODE_CPU_EXPERTS)
    load = _MachineLoad().start()
    bps = _rounds(lambda t: copy(rot, device, t), seconds)
    bhs = _rounds(lambda t: measure_cpu(rot, executor, t, experts_per_call=DECODE_CPU_EXPERTS), seconds)
    cp, ch = measure_concurrent(rot, device, executor, seconds)
    bp1 = statistics.median(_rounds(lambda t: copy(rot, device, t, rows_per_copy=1), seconds / 2))
    bh1 = statistics.median(_rounds(lambda t: measure_cpu(rot, executor, t, experts_per_call=1), seconds / 2))
    other = load.cores()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "version": PROFILE_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_threads": executor.threads, "gpu": gpu, "cores": cores,
                    "other_processes_cores": None if other is None else round(other, 3)},
        "cpu_executor": executor.name,
        "device": device.type,
        "expert": {"hidden": layout.hidden, "intermediate": layout.intermediate, "format": layout.format.value,
                   "compute_dtype": str(compute_dtype).replace("torch.", ""), "row_bytes": layout.row_bytes,
                   "rotated_bytes": rot.nbytes},
        "pcie_applies": device.type == "cuda",
        "fill_path": "gather kernel" if copy is measure_fill else "copy engine" if device.type == "cuda" else "memcpy",
        "isolated": {"b_p_gbps": statistics.median(bps), "b_h_gbps": statistics.median(bhs)},
        "rounds": {"b_p_gbps": bps, "b_h_gbps": bhs},
        "concurrent": {"b_p_gbps": cp, "b_h_gbps": ch},
        "seconds_each": seconds,
        "cpu_experts_per_call": DECODE_CPU_EXPERTS,
        "fixed_costs": fixed_costs(rot.row_bytes, (1, bp1), (8, statistics.median(bps)), (1, bh1),
                                   (DECODE_CPU_EXPERTS, statistics.median(bhs))),
    }


def fixed_costs(row_bytes: int, copy1: tuple[int, float], copy2: tuple[int, float], cpu1: tuple[int, float],
                cpu2: tuple[int, float]) -> dict:
    """Fixed cost per call (seconds) of a copy and of a CPU-executor call: the intercept of the time per
    call ``n·row_bytes / B(n)`` through two measurements ``(n, GB/s)`` each, clamped to >= 0."""
    def intercept(a: tuple[int, float], b: tuple[int, float]) -> float:
        (na, ga), (nb, gb) = a, b
        ta, tb = na * row_bytes / (ga * 1e9), nb * row_bytes / (gb * 1e9)
        return max(0.0, (nb * ta - na * tb) / (nb - na))

    return {"fill_call_s": intercept(copy1, copy2), "cpu_call_s": intercept(cpu1, cpu2)}


def implausible(prof: dict) -> str | None:
    """Why the measurement ``prof`` (a profile dict) cannot describe this machine, or ``None`` when it
    is plausible (criteria in the module doc)."""
    named = {"isolated B_P": prof["isolated"]["b_p_gbps"], "isolated B_H": prof["isolated"]["b_h_gbps"],
             "concurrent B_P": prof["concurrent"]["b_p_gbps"], "concurrent B_H": prof["concurrent"]["b_h_gbps"]}
    low = [f"{k} {v:.3g} GB/s" for k, v in named.items() if not v >= MIN_PLAUSIBLE_GBPS]
    if low:
        return f"{', '.join(low)} below the {MIN_PLAUSIBLE_GBPS} GB/s any memory system or PCIe link reaches"
    for key, rounds in (prof.get("rounds") or {}).items():
        if rounds and max(rounds) > MAX_ROUND_SPREAD * min(rounds):
            name = {"b_p_gbps": "B_P", "b_h_gbps": "B_H"}.get(key, key)
            return (f"{name} rounds disagree ({', '.join(f'{r:.3g}' for r in rounds)} GB/s, more than "
                    f"{MAX_ROUND_SPREAD:g}x apart)")
    machine = prof.get("machine") or {}
    other, cores = machine.get("other_processes_cores"), machine.get("cores")
    if other is not None and cores and other > MAX_OTHER_LOAD * cores:
        return f"other processes kept {other:.1f} of {cores} cores busy while measuring"
    return None


def profile_matches(prof: dict, layout: ExpertLayout, device: torch.device) -> bool:
    """Whether a saved profile was measured for ``layout``'s format and shape on ``device``'s kind (the match
    key: profile version, format, ``H``, ``I``, ``row_bytes`` and device type)."""
    exp = prof.get("expert") or {}
    return (prof.get("version") == PROFILE_VERSION and exp.get("format") == layout.format.value
            and exp.get("hidden") == layout.hidden and exp.get("intermediate") == layout.intermediate
            and exp.get("row_bytes") == layout.row_bytes and prof.get("device") == torch.device(device).type)


def bandwidths_from_profile(prof: dict, source: str) -> Bandwidths:
    """The pair the q* policy uses: the concurrent one when present (``B_H := B_P,c + B_H,c``), else isolated;
    with the fixed costs per call when the profile has them (``fixed_costs``; profiles written before
    they were measured give 0)."""
    conc = prof.get("concurrent") or {}
    fixed = prof.get("fixed_costs") or {}
    fx = {"fill_fixed_s": float(fixed.get("fill_call_s", 0.0)), "cpu_fixed_s": float(fixed.get("cpu_call_s", 0.0))}
    if conc.get("b_p_gbps") and conc.get("b_h_gbps"):
        return Bandwidths(conc["b_p_gbps"], conc["b_p_gbps"] + conc["b_h_gbps"], f"{source} (concurrent pair)", **fx)
    iso = prof["isolated"]
    return Bandwidths(iso["b_p_gbps"], iso["b_h_gbps"], f"{source} (isolated pair)", **fx)


def read_profile(path: Path) -> dict:
    """A saved profile.

    Raises:
        ValueError: not valid JSON or not a profile (the file named).
    """
    try:
        prof = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a bandwidth profile ({exc})") from None
    if not isinstance(prof, dict) or not isinstance(prof.get("isolated"), dict):
        raise ValueError(f"{path}: not a bandwidth profile written by `edgemoe profile`")
    return prof


def _profile_bandwidths(config, pool: HostExpertPool, cache, executor) -> Bandwidths | None:
    """The bandwidths of ``--profile``, else of the saved profile for this expert shape when it matches
    (``None``: no usable saved profile).

    Raises:
        ValueError: ``--profile`` names a file that is not a profile, is for another expert shape or
            device, or fails the plausibility check.
    """
    explicit = bool(config.profile_path)
    path = Path(config.profile_path) if explicit else default_profile_path(pool.layout, cache.device)
    if not explicit and not path.exists():
        return None
    prof = read_profile(path)  # an explicit path that vanished raises FileNotFoundError here
    exp = prof.get("expert", {})
    if not profile_matches(prof, pool.layout, cache.device):
        if not explicit and prof.get("version") != PROFILE_VERSION:
            log.warning("%s: measured by an older edgemoe (profile version %s, now %s), not used: measuring again; "
                        "`edgemoe profile` saves a current one", path, prof.get("version"), PROFILE_VERSION)
        if explicit:
            raise ValueError(f"{path}: profile is for another expert format, shape or device (version "
                             f"{prof.get('version')}, {exp}, {prof.get('device')}); this engine deploys "
                             f"{pool.layout.format.value} experts H={pool.hidden} I={pool.intermediate} of "
                             f"{pool.row_bytes} bytes on {cache.device.type} (profile version {PROFILE_VERSION}): "
                             f"re-run `edgemoe profile`")
        return None
    reason = implausible(prof)
    if reason is not None:
        if explicit:
            raise ValueError(f"{path}: implausible measurement ({reason}); re-run `edgemoe profile` on an idle machine")
        log.warning("%s: not used, implausible measurement (%s)", path, reason)
        return None
    # profiles written before the native executor existed were measured with torch ops
    measured_with = (prof.get("cpu_executor", "torch"), prof.get("machine", {}).get("cpu_threads"))
    if measured_with == (executor.name, executor.threads):
        return bandwidths_from_profile(prof, f"profile {path}")
    if explicit:
        log.warning("%s: B_H was measured with the %s CPU executor on %s threads, the engine runs %s on %s; "
                    "re-run `edgemoe profile` for a matching B_H", path, *measured_with, executor.name,
                    executor.threads)
        return bandwidths_from_profile(prof, f"profile {path} ({measured_with[0]}, {measured_with[1]} threads)")
    return None


def quick_measurement(pool: HostExpertPool, cache, executor) -> Bandwidths:
    """The start-up measurement (``QUICK_SECONDS`` per bandwidth over ``ROTATE_BYTES_QUICK``), retried
    once when implausible; a second implausible one is used with a warning (nothing better is known)."""
    for attempt in (1, 2):
        with startup_step("measuring B_P and B_H for the q* split", f"about {4 * QUICK_SECONDS:.0f} s; "
                          "`edgemoe profile` saves a longer measurement instead"):
            prof = measure(pool, pool.layout, cache.device, executor, QUICK_SECONDS, ROTATE_BYTES_QUICK)
        reason = implausible(prof)
        if reason is None:
            return bandwidths_from_profile(prof, "quick start-up measurement")
        log.warning("bandwidth measurement %d of 2 implausible: %s", attempt, reason)
    return bandwidths_from_profile(prof, f"quick start-up measurement, implausible: {reason}")


def resolve_bandwidths(config, pool: HostExpertPool, cache, executor) -> Bandwidths:
    """B_P/B_H for the engine, each from the command line when given, else from ``--profile``, else
    from a matching saved profile, else from a quick measurement (:func:`quick_measurement`);
    ``source`` says where each came from.

    A saved profile matches when its version, expert format and shape and device match
    (:func:`profile_matches`), it passes
    :func:`implausible`, and it was measured with the CPU executor in use, on as many threads
    (``executor.name``/``threads``; B_H of the torch executor says little about the native one). An
    explicit ``profile_path`` measured with another executor is still used, with a warning. Nothing
    is measured when no policy needs it (no expert cache, or a policy other than ``qstar`` /
    ``auto`` / ``adaptive``). With one bandwidth given, the other is the profile's or the measurement's policy
    value (for a concurrent pair, ``B_H = B_P,c + B_H,c``).

    Raises:
        ValueError / FileNotFoundError: see :func:`_profile_bandwidths`.
    """
    bp, bh = config.bandwidth_pcie_gbps, config.bandwidth_cpu_gbps
    if bp is not None and bh is not None:
        return Bandwidths(bp, bh, "command line")
    base = _profile_bandwidths(config, pool, cache, executor)
    if base is None:
        if config.expert_policy not in BANDWIDTH_POLICIES or cache.num_slots == 0:
            base = Bandwidths(None, None, "not measured (not needed by this policy/cache)")
        else:
            base = quick_measurement(pool, cache, executor)
    if bp is None and bh is None:
        return base
    if bp is not None:
        return Bandwidths(bp, base.cpu, f"B_P command line, B_H {base.source}")
    return Bandwidths(base.pcie, bh, f"B_P {base.source}, B_H command line")


def format_profile(prof: dict) -> str:
    """Human-readable profile: B_P and B_H alone and concurrent, with q*/m for each pair."""
    iso, conc = prof["isolated"], prof["concurrent"]
    e = prof["expert"]
    note = "" if prof.get("pcie_applies") else "  (CPU-only machine: B_P is a host memory copy; PCIe does not apply)"
    lines = [
        f"expert shape H={e['hidden']} I={e['intermediate']} {e['format']} (computing in {e['compute_dtype']}): "
        f"{e['row_bytes'] / 1e6:.2f} MB per expert row, "
        f"rotating over {e['rotated_bytes'] / 1e9:.2f} GB; device {prof['device']}; "
        f"CPU executor {prof.get('cpu_executor', 'torch')}, {prof['machine']['cpu_threads']} threads",
        f"isolated    B_P {iso['b_p_gbps']:7.2f} GB/s   B_H {iso['b_h_gbps']:7.2f} GB/s{note}",
        f"concurrent  B_P {conc['b_p_gbps']:7.2f} GB/s   B_H {conc['b_h_gbps']:7.2f} GB/s",
    ]
    if prof.get("fill_path"):
        lines.append(f"B_P moved by {prof['fill_path']} (as a decode step's fills on this device)")
    if prof.get("fixed_costs"):
        fx = prof["fixed_costs"]
        lines.append(f"fixed cost per call: copy {1e6 * fx['fill_call_s']:.1f} us, CPU executor "
                     f"{1e6 * fx['cpu_call_s']:.1f} us (auto policy)")
    rounds, machine = prof.get("rounds") or {}, prof.get("machine") or {}
    if rounds:
        lines.append("rounds      " + "   ".join(f"{name} {', '.join(f'{v:.2f}' for v in rounds[key])}"
                                               for name, key in (("B_P", "b_p_gbps"), ("B_H", "b_h_gbps"))))
    if machine.get("other_processes_cores") is not None:
        lines.append(f"other processes kept {machine['other_processes_cores']:.2f} of {machine.get('cores')} cores "
                     "busy while measuring")
    for label, bw in (("isolated", bandwidths_from_profile({"isolated": iso}, "")),
                      ("concurrent", bandwidths_from_profile(prof, ""))):
        lines.append(f"q*/m ({label} pair) = {QStarPolicy(bw).q_ratio():.3f}")
    lines.append("policy uses: concurrent pair (B_P = B_P,c; B_H = B_P,c + B_H,c)")
    if "path" in prof:
        lines.append(f"saved to {prof['path']}")
    return "\n".join(lines)
