"""How many of a decode step's cache misses are filled (host→device) versus run on the CPU.

``qstar`` implements the closed form of FreeToken (arXiv 2608.16157): with ``m``
misses, transferring ``q`` of them costs ``q·s/B_P`` while the CPU, sharing DRAM with the transfer,
computes the other ``m − q`` at the residual bandwidth ``B_R = B_H − B_P``; equating the two gives
``q* = m·B_P/B_H``. When ``B_H ≤ B_P`` (``B_R = 0``) every miss is filled. ``q`` is rounded to the
nearest integer (halves up) and clamped to ``[min(1, m), m]``: at least one fill per step keeps the
cache warming. The formula decides *how many* misses fill; the cache's LRU decides *which* slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bandwidths:
    """Measured bandwidths in GB/s (1e9 bytes/s) and where they came from.

    ``pcie``: B_P, host→device copy of expert rows. ``cpu``: B_H, CPU expert execution reading weights
    from DRAM. ``source``: e.g. ``"profile:/path (concurrent)"``, ``"measured at start-up (isolated)"``,
    ``"command line"``.
    """

    pcie: float | None
    cpu: float | None
    source: str = "unset"


class ExpertPolicy:
    """The policy protocol: ``num_fills(m) -> q`` for a decode step with ``m`` misses (before
    capacity clamping), and its device encoding :meth:`fill_rule`.

    Capabilities (class attributes, read instead of type tests):

    - ``streams_prefill``: prefill misses are brought into the cache (whole layers streamed)
      rather than computed on the CPU;
    - ``admits``: the policy ever fills the cache at run time;
    - ``places_static``: whole MoE layers are placed in the cache at load and pinned there;
    - ``online``: the rule may change between steps (:meth:`observe` returns ``True`` then), so the
      device path must keep its CPU branch even when the current rule fills every miss.
    """

    name = "base"
    streams_prefill = True
    admits = True
    places_static = False
    online = False

    @property
    def active_name(self) -> str:
        """The rule the next step runs (an online policy switches between rules)."""
        return self.name

    def num_fills(self, m: int) -> int:
        raise NotImplementedError

    def observe(self, seconds: float, batch_size: int) -> bool:
        """Record the wall time (s) of the decode step just run at ``batch_size``; returns whether the
        rule changed (the caller then pushes :meth:`fill_rule` to the device). Fixed rules ignore it."""
        return False

    def q_ratio(self) -> float:
        """q/m for a large m (reported as q*/m)."""
        return self.num_fills(1000) / 1000

    def fill_rule(self) -> tuple[float, float, float]:
        """``(num, den, q_min)`` with ``num_fills(m) == clamp(floor(m·num/den + 0.5), min(q_min, m), m)``
        for every ``m >= 0``, evaluated in float64 in that order (``(m·num)/den``): the encoding the
        device-side control reads (``edgemoe.kernels.route_control``, a ``[3]`` float64 tensor)."""
        raise NotImplementedError


class QStarPolicy(ExpertPolicy):
    """``q = clamp(round(m·B_P/B_H), min(1, m), m)``; ``q = m`` when ``B_H ≤ B_P``.

    Without bandwidths (only when there is no expert cache to fill) every miss runs on the CPU.

    Raises:
        ValueError: a bandwidth that is given but not positive.
    """

    name = "qstar"

    def __init__(self, bw: Bandwidths):
        for v in (bw.pcie, bw.cpu):
            if v is not None and v <= 0:
                raise ValueError(f"qstar needs positive B_P and B_H, got B_P={bw.pcie} B_H={bw.cpu}")
        self.bw = bw

    def num_fills(self, m: int) -> int:
        if m <= 0 or self.bw.pcie is None or self.bw.cpu is None:
            return 0
        if self.bw.cpu <= self.bw.pcie:
            return m
        q = math.floor(m * self.bw.pcie / self.bw.cpu + 0.5)
        return max(1, min(m, q))

    def fill_rule(self) -> tuple[float, float, float]:
        if self.bw.pcie is None or self.bw.cpu is None:
            return (0.0, 1.0, 0.0)
        if self.bw.cpu <= self.bw.pcie:
            return (1.0, 1.0, 0.0)
        return (float(self.bw.pcie), float(self.bw.cpu), 1.0)


class FillAllPolicy(ExpertPolicy):
    """Every miss is transferred to the device (no CPU execution)."""

    name = "fill-all"

    def num_fills(self, m: int) -> int:
        return max(m, 0)

    def fill_rule(self) -> tuple[float, float, float]:
        return (1.0, 1.0, 0.0)


class CpuAllPolicy(ExpertPolicy):
    """Every miss runs on the CPU; nothing is ever transferred (prefill included)."""

    name = "cpu-all"
    streams_prefill = False
    admits = False

    def num_fills(self, m: int) -> int:
        return 0

    def fill_rule(self) -> tuple[float, float, float]:
        return (0.0, 1.0, 0.0)


class StaticPolicy(CpuAllPolicy):
    """llama.cpp-style placement fixed at load (whole MoE layers from the last one backwards, like
    ``--n-cpu-moe``); residents are pinned, misses run on the CPU, the cache never changes."""

    name = "static"
    places_static = True


class AdaptivePolicy(ExpertPolicy):
    """q* corrected online by measured decode step times (beyond the paper's closed form).

    The closed form assumes the two branches overlap and share DRAM as profiled; when a machine does
    not behave so (another application takes PCIe or DRAM, or the branches serialize), the measured
    step time is what counts. For each decode batch size separately (step times of different sizes
    do not compare; continuous batching changes the size often) the policy cycles: *probe* — run
    ``probe_steps`` decode steps under each candidate rule (q*, fill-all, cpu-all; the first step
    after a switch is not counted), then *exploit* the one with the lowest median step time for
    ``exploit_steps`` steps of that size, then probe again. Steady state is never slower than the
    better of fill-all and cpu-all as measured; a probe costs at most ``2 · probe_steps`` steps
    under a worse rule.

    Args:
        bw: bandwidths of the q* candidate.
        probe_steps: counted steps per candidate in a probe (>= 1).
        exploit_steps: steps under the chosen rule before the next probe (>= 1).

    Raises:
        ValueError: a bandwidth that is given but not positive, or non-positive step counts.
    """

    name = "adaptive"
    online = True

    def __init__(self, bw: Bandwidths, probe_steps: int = 8, exploit_steps: int = 512):
        if probe_steps < 1 or exploit_steps < 1:
            raise ValueError("probe_steps and exploit_steps must be >= 1")
        self.candidates: list[ExpertPolicy] = [QStarPolicy(bw), FillAllPolicy(), CpuAllPolicy()]
        self.probe_steps, self.exploit_steps = int(probe_steps), int(exploit_steps)
        self.active = 0  # index into candidates: the rule the next step runs
        self._by_batch: dict[int, dict] = {}  # per decode batch size: its probe/exploit state

    @property
    def active_name(self) -> str:
        return self.candidates[self.active].name

    def num_fills(self, m: int) -> int:
        return self.candidates[self.active].num_fills(m)

    def fill_rule(self) -> tuple[float, float, float]:
        return self.candidates[self.active].fill_rule()

    def q_ratio(self) -> float:
        return self.candidates[0].q_ratio()  # q*/m as reported; ``active_name`` says which rule runs

    def _fresh(self) -> dict:
        return {"probing": True, "probe": 0, "times": [[] for _ in self.candidates], "exploited": 0, "choice": 0,
                "rule": None, "skip": False}

    def observe(self, seconds: float, batch_size: int) -> bool:
        """Record the wall time (seconds) of the decode step just run at ``batch_size`` under the
        active rule and choose the next step's rule (for that batch size). Returns whether the active
        rule changed (the caller then pushes :meth:`fill_rule` to the device). A step is counted only
        when it ran under the rule its batch size expects and is not the first after a switch."""
        before = self.active
        st = self._by_batch.setdefault(batch_size, self._fresh())
        if st["rule"] == before and not st["skip"]:
            self._record(st, seconds)
        rule = st["probe"] if st["probing"] else st["choice"]
        st["skip"] = rule != before  # the next step carries the switch's transients
        st["rule"] = self.active = rule
        return rule != before

    def _record(self, st: dict, seconds: float) -> None:
        if st["probing"]:
            st["times"][st["probe"]].append(seconds)
            if len(st["times"][st["probe"]]) >= self.probe_steps:
                st["probe"] += 1
                if st["probe"] == len(self.candidates):  # probe done: exploit the fastest median
                    medians = [sorted(t)[len(t) // 2] for t in st["times"]]
                    st.update(probing=False, exploited=0, choice=min(range(len(medians)), key=medians.__getitem__))
        else:
            st["exploited"] += 1
            if st["exploited"] >= self.exploit_steps:
                st.update(probing=True, probe=0, times=[[] for _ in self.candidates], exploited=0)


def make_policy(name: str, bw: Bandwidths) -> ExpertPolicy:
    """Build the policy named ``qstar | adaptive | fill-all | cpu-all | static``.

    Raises:
        ValueError: unknown name, or ``qstar``/``adaptive`` with a non-positive bandwidth.
    """
    if name == "qstar":
        return QStarPolicy(bw)
    if name == "adaptive":
        return AdaptivePolicy(bw)
    table = {"fill-all": FillAllPolicy, "cpu-all": CpuAllPolicy, "static": StaticPolicy}
    if name not in table:
        raise ValueError(f"unknown expert policy {name!r}; choose qstar, adaptive, fill-all, cpu-all or static")
    return table[name]()
