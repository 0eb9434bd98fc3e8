"""How many of a decode step's cache misses are filled (host→device) versus run on the CPU.

``qstar`` implements the closed form of FreeToken (arXiv 2608.16157, DESIGN.md §2): with ``m``
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
    """Base: ``num_fills(m) -> q`` for a decode step with ``m`` misses (before capacity clamping).

    ``streams_prefill``: whether prefill misses are brought into the cache (whole layers streamed)
    rather than computed on the CPU. ``admits``: whether the policy ever fills the cache at run time.
    """

    name = "base"
    streams_prefill = True
    admits = True

    def num_fills(self, m: int) -> int:
        raise NotImplementedError

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


def make_policy(name: str, bw: Bandwidths) -> ExpertPolicy:
    """Build the policy named ``qstar | fill-all | cpu-all | static``.

    Raises:
        ValueError: unknown name, or ``qstar`` without usable bandwidths.
    """
    if name == "qstar":
        return QStarPolicy(bw)
    table = {"fill-all": FillAllPolicy, "cpu-all": CpuAllPolicy, "static": StaticPolicy}
    if name not in table:
        raise ValueError(f"unknown expert policy {name!r}; choose qstar, fill-all, cpu-all or static")
    return table[name]()
