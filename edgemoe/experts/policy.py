"""How many of a decode step's cache misses are filled (host→device) versus run on the CPU.

``qstar`` implements the closed form of FreeToken (arXiv 2608.16157): with ``m``
misses, transferring ``q`` of them costs ``q·s/B_P`` while the CPU, sharing DRAM with the transfer,
computes the other ``m − q`` at the residual bandwidth ``B_R = B_H − B_P``; equating the two gives
``q* = m·B_P/B_H``. When ``B_H ≤ B_P`` (``B_R = 0``) every miss is filled. ``q`` is rounded to the
nearest integer (halves up) and clamped to ``[min(1, m), m]``: at least one fill per step keeps the
cache warming. The formula decides *how many* misses fill; the cache's LRU decides *which* slots.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from dataclasses import dataclass, field, replace

import torch

REUSE_READ_STEPS = 8
"""Decode steps between the runtime's reads of the cache's reuse counters for a ``per_layer`` policy."""

REUSE_READ_SECONDS = 0.25
"""...or fewer steps, at least one, when this many seconds have passed since the last read: slow steps
(a CPU branch stalled by another process on its cores) still give the policy a window every half second."""

@dataclass(frozen=True)
class Bandwidths:
    """Measured bandwidths in GB/s (1e9 bytes/s) and where they came from.

    ``pcie``: B_P, host→device copy of expert rows. ``cpu``: B_H, CPU expert execution reading weights
    from DRAM. ``source``: e.g. ``"profile:/path (concurrent)"``, ``"measured at start-up (isolated)"``,
    ``"command line"``. ``fill_fixed_s`` / ``cpu_fixed_s``: the fixed cost (seconds) of one copy call
    and of one CPU-executor call, the intercepts of the measured time against experts per call (0 when
    not measured); ``copy_rows`` / ``cpu_experts``: experts per call of the B_P / B_H measurement (so the
    per-expert times are ``bytes/B − fixed/n``). The ``auto`` policy's cost model uses them, q* does not.
    """

    pcie: float | None
    cpu: float | None
    source: str = "unset"
    fill_fixed_s: float = 0.0
    cpu_fixed_s: float = 0.0
    copy_rows: int = 8
    cpu_experts: int = 4


class ExpertPolicy:
    """The policy protocol: ``num_fills(m) -> q`` for a decode step with ``m`` misses (before
    capacity clamping), and its device encoding :meth:`fill_rule`.

    Capabilities (class attributes, read instead of type tests):

    - ``streams_prefill``: prefill misses are brought into the cache (whole layers streamed)
      rather than computed on the CPU;
    - ``admits``: the policy ever fills the cache at run time;
    - ``places_static``: whole MoE layers are placed in the cache at load and pinned there;
    - ``online``: the rule may change between steps (:meth:`observe` returns ``True`` then), so the
      device path keeps a CPU branch it can arm again (it disarms it while :meth:`fills_every_miss`);
    - ``fills_free_slots``: a decode step fills at least ``min(m, free slots)`` misses whatever
      :meth:`num_fills` says (a fill into a free slot displaces nothing; the device reads it for a
      ``per_layer`` policy);
    - ``per_layer``: ``q`` depends on the MoE layer: the device reads :meth:`fill_table` (``[L, M + 1]``)
      instead of :meth:`fill_rule`, and the runtime feeds :meth:`observe_layers` the cache's reuse
      counters between steps.
    """

    name = "base"
    streams_prefill = True
    admits = True
    places_static = False
    online = False
    fills_free_slots = False
    per_layer = False

    @property
    def active_name(self) -> str:
        """The rule the next step runs (an online policy switches between rules)."""
        return self.name

    def num_fills(self, m: int, layer: int = 0) -> int:
        """Misses to fill among ``m`` misses of MoE layer ``layer`` (the rest run on the CPU)."""
        raise NotImplementedError

    def fills_every_miss(self) -> bool:
        """Whether the current rule fills every miss of every layer (a step then needs no CPU branch when
        the cache's victim ranges hold a step's misses)."""
        return False

    def observe(self, seconds: float, batch_size: int) -> bool:
        """Record the wall time (s) of the decode step just run at ``batch_size``; returns whether the
        rule changed (the caller then pushes :meth:`fill_rule` to the device). Fixed rules ignore it."""
        return False

    def observe_layers(self, obs: "LayerObservation") -> bool:
        """Record per-layer measurements (reuse of fills, branch times); returns whether the rule
        changed. Fixed rules ignore them."""
        return False

    @property
    def read_window_steps(self) -> int:
        """Decode steps after which the runtime passes the window's counters (:meth:`observe_layers`):
        :data:`REUSE_READ_STEPS`, or fewer where the policy wants to judge sooner."""
        return REUSE_READ_STEPS

    @property
    def wants_cpu_probe(self) -> int:
        """Experts (one token each) the runtime should time in one call of the CPU executor before the next
        :meth:`observe_layers`, passed as ``LayerObservation.cpu_probe``; 0: none."""
        return 0

    def price_armed_branch(self, seconds: float) -> bool:
        """Told by a decode path that drops the CPU branch from steps whose rule fills every miss, and
        for which keeping it armed costs ``seconds`` per MoE layer step even without CPU work (the
        hand-off and join launches); returns whether the rule changed. Fixed rules ignore it."""
        return False

    def inherit(self, previous: "ExpertPolicy") -> bool:
        """Take over what ``previous``, the same policy on the expert cache this one's replaces (a resize),
        learned about the machine rather than about that cache; returns whether the rule changed. Fixed rules
        learn nothing."""
        return False

    def q_ratio(self) -> float:
        """q/m for a large m (reported as q*/m)."""
        return self.num_fills(1000) / 1000

    def join_limits(self) -> tuple[float, float] | None:
        """Seconds of one expert on each side of a hand-off's join, as the policy's model prices them now: ``(a
        fill, a CPU expert)``, while both branches run. A join counted by how late it is (graded lateness,
        :func:`edgemoe.kernels.cpu_handoff.collect`) counts a wait longer than the first, or a CPU branch done
        earlier than the GPU by more than the second; ``None``: the policy does not read lateness."""
        return None

    def fill_table(self) -> torch.Tensor:
        """``[L, M + 1]`` int32 ``q_l(m)`` of a ``per_layer`` policy (the device encoding).

        Raises:
            NotImplementedError: the policy is not per layer (use :meth:`fill_rule`).
        """
        raise NotImplementedError(f"{self.name} has one rule for every layer: use fill_rule()")

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

    def num_fills(self, m: int, layer: int = 0) -> int:
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

    def num_fills(self, m: int, layer: int = 0) -> int:
        return max(m, 0)

    def fills_every_miss(self) -> bool:
        return True

    def fill_rule(self) -> tuple[float, float, float]:
        return (1.0, 1.0, 0.0)


class CpuAllPolicy(ExpertPolicy):
    """Every miss runs on the CPU; nothing is ever transferred (prefill included)."""

    name = "cpu-all"
    streams_prefill = False
    admits = False

    def num_fills(self, m: int, layer: int = 0) -> int:
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

    def num_fills(self, m: int, layer: int = 0) -> int:
        return self.candidates[self.active].num_fills(m, layer)

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


@dataclass(frozen=True)
class MissCosts:
    """Time model of one MoE layer's decode step, in seconds, for a split of its misses into ``fills``
    (copied host→device, then computed on the device) and ``cpu`` (computed by the CPU executor):

    - fill branch ``[f > 0]·fill_fixed_s + f·fill_s`` (``fill_conc_s`` while the CPU branch runs);
    - CPU branch ``[c > 0]·cpu_fixed_s + c·cpu_s`` (``cpu_conc_s`` while fills run); a step whose CPU
      branch is armed but empty pays ``idle_handoff_s`` instead (a hand-off without work);
    - the two overlap (``max``) when ``overlap``, else they add (a CPU-only machine, where the "device"
      is the same cores); plus ``hits·hit_s + base_s`` (the layer's other work).

    Per-expert seconds are ``expert_bytes / bandwidth``: ``fill_s`` from B_P, ``cpu_s`` from the CPU
    executor's bandwidth at many experts per call (its fixed cost per call is ``cpu_fixed_s``). The
    two fixed costs are what the bandwidth-only q* rule leaves out: with one or two misses per layer
    a CPU hand-off can cost more than filling the expert.
    """

    fill_s: float
    fill_conc_s: float
    cpu_s: float
    cpu_conc_s: float
    fill_fixed_s: float = 0.0
    cpu_fixed_s: float = 0.0
    idle_handoff_s: float = 0.0
    hit_s: float = 0.0
    base_s: float = 0.0
    overlap: bool = True

    @classmethod
    def from_bandwidths(cls, expert_bytes: float, b_p: float, b_h: float, b_p_conc: float | None = None,
                        b_h_conc: float | None = None, **fixed) -> "MissCosts":
        """From GB/s (1e9 bytes/s): ``b_p``/``b_h`` alone, ``*_conc`` while both branches run (default: alone).

        Raises:
            ValueError: a bandwidth that is not positive.
        """
        bws = (b_p, b_h, b_p_conc or b_p, b_h_conc or b_h)
        if min(bws) <= 0:
            raise ValueError(f"bandwidths must be positive, got {bws}")
        s = float(expert_bytes) / 1e9
        return cls(s / b_p, s / (b_p_conc or b_p), s / b_h, s / (b_h_conc or b_h), **fixed)

    def branches(self, fills: int, cpu: int, armed: bool = True) -> tuple[float, float]:
        """(fill branch, CPU branch) seconds of a layer step (see the class docstring)."""
        both = fills > 0 and cpu > 0
        g = (self.fill_fixed_s + fills * (self.fill_conc_s if both else self.fill_s)) if fills > 0 else 0.0
        if cpu > 0:
            c = self.cpu_fixed_s + cpu * (self.cpu_conc_s if both else self.cpu_s)
        else:
            c = self.idle_handoff_s if armed else 0.0
        return g, c

    def layer_seconds(self, hits: int, fills: int, cpu: int, armed: bool = True) -> float:
        """Seconds of one MoE layer's decode step with ``hits`` resident experts."""
        g, c = self.branches(fills, cpu, armed)
        return self.base_s + hits * self.hit_s + (max(g, c) if self.overlap else g + c)

    def split_seconds(self, m: int, q: int, armed: bool = True) -> float:
        """The layer time without hits and base of filling ``q`` of ``m`` misses and running ``m − q``
        on the CPU (what a miss policy's choice changes)."""
        g, c = self.branches(q, m - q, armed)
        return max(g, c) if self.overlap else g + c


def lower_hull(ys: list[float]) -> tuple[list[int], list[float]]:
    """The lower convex hull of the points ``(q, ys[q])``: its vertices ``q`` (ascending; collinear
    points dropped) and the slope of the edge ending at each vertex (``-inf`` for the first).

    ``argmin_q ys[q] − V·q`` (ties to the larger ``q``) is then the last vertex whose slope is ``<= V``.
    """
    hull: list[int] = []
    for q, y in enumerate(ys):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (ys[b] - ys[a]) * (q - a) >= (y - ys[a]) * (b - a):  # b is on or above the chord a-q
                hull.pop()
            else:
                break
        hull.append(q)
    slopes = [-math.inf] + [(ys[b] - ys[a]) / (b - a) for a, b in itertools.pairwise(hull)]
    return hull, slopes


class HullRows:
    """The table rows ``q(m)``, ``m = 0 .. M``, that one cost model's split hulls give, memoized by the value of a
    fill they depend on.

    Row ``m`` of a layer whose fill is worth ``v`` is the last vertex of hull ``m`` whose edge slope is ``<= v``
    (:func:`lower_hull`). That choice changes only where ``v`` crosses one of the hulls' slopes, so between two
    consecutive slopes of all the hulls together every row is the same: :meth:`row` finds that interval with one
    bisection and builds its row once (``M + 1`` bisections), instead of ``M + 1`` bisections per layer and table.
    Rows are shared between layers and tables and never modified.

    Args:
        split: per ``m = 0 .. M``, the layer step's seconds of each split ``q = 0 .. m`` (``MissCosts.split_seconds``).
    """

    def __init__(self, split: list[list[float]]):
        self.hulls = [lower_hull(ys) for ys in split]
        self.breaks = sorted({x for _, slopes in self.hulls for x in slopes[1:]})  # every finite slope, once
        self._rows: dict[int, list[int]] = {}
        self.full = list(range(len(split)))  # the row that fills every miss (q(m) = m)

    def row(self, v: float) -> list[int]:
        """``q(m)`` for ``m = 0 .. M`` at a fill value of ``v`` seconds."""
        seg = bisect.bisect_right(self.breaks, v)
        r = self._rows.get(seg)
        if r is None:
            r = [hull[bisect.bisect_right(slopes, v) - 1] for hull, slopes in self.hulls]
            r = self._rows[seg] = self.full if r == self.full else r
        return r


def _close(a: MissCosts, b: MissCosts | None, tol: float) -> bool:
    """Every field of ``a`` within relative ``tol`` of ``b``'s."""
    if b is None:
        return False
    for x, y in ((a.fill_s, b.fill_s), (a.fill_conc_s, b.fill_conc_s), (a.cpu_s, b.cpu_s), (a.cpu_conc_s, b.cpu_conc_s),
                 (a.fill_fixed_s, b.fill_fixed_s), (a.cpu_fixed_s, b.cpu_fixed_s),
                 (a.idle_handoff_s, b.idle_handoff_s)):
        if abs(x - y) > tol * max(abs(x), abs(y), 1e-9):
            return False
    return a.overlap == b.overlap


class EwLinearFit:
    """Exponentially weighted least squares of ``t = a + b·n`` (a branch's fixed cost and per-expert time)
    over samples ``(n, t)``, anchored by the prior model ``(a0, b0)`` as pseudo-samples at ``n = 1`` and
    ``n = 4`` of weight ``prior_weight`` each (so a run of equal ``n`` cannot make the split of ``a`` and
    ``b`` arbitrary). ``halflife``: samples after which a sample's weight halves.
    """

    def __init__(self, a0: float, b0: float, halflife: float = 256.0, prior_weight: float = 2.0):
        self.prior = (float(a0), float(b0), float(prior_weight))
        self.decay = 0.5 ** (1.0 / float(halflife))
        self.sw = self.sn = self.snn = self.st = self.snt = 0.0

    def add(self, n: float, t: float, weight: float = 1.0) -> None:
        d = self.decay
        self.sw = self.sw * d + weight
        self.sn = self.sn * d + weight * n
        self.snn = self.snn * d + weight * n * n
        self.st = self.st * d + weight * t
        self.snt = self.snt * d + weight * n * t

    def take_samples(self, other: "EwLinearFit") -> None:
        """Replace this fit's samples by ``other``'s (its prior stays this fit's own)."""
        self.sw, self.sn, self.snn, self.st, self.snt = other.sw, other.sn, other.snn, other.st, other.snt

    @property
    def params(self) -> tuple[float, float]:
        """``(a, b)``, both clamped to >= 0 (the prior's ``b`` when the fit would give ``b <= 0``)."""
        a0, b0, w = self.prior
        sw, sn, snn = self.sw + 2 * w, self.sn + 5 * w, self.snn + 17 * w
        st, snt = self.st + w * (2 * a0 + 5 * b0), self.snt + w * (5 * a0 + 17 * b0)
        det = sw * snn - sn * sn
        b = (sw * snt - sn * st) / det
        if b <= 0:
            return max(0.0, (st - b0 * sn) / sw), b0
        a = (st - b * sn) / sw
        if a < 0:
            return 0.0, max(snt / snn, 1e-12)
        return a, b


@dataclass
class LayerObservation:
    """What the engine measured over one or more decode steps, for :meth:`ExpertPolicy.observe_layers`.

    Attributes:
        reuse_net: ``[L]`` int, per MoE layer: hits on experts the layer filled in place of a resident minus
            requests of the experts those fills displaced (while the filled expert is still resident and
            the displaced one not displaced again; :class:`~edgemoe.experts.cache.ExpertCache` counts it),
            since the previous observation. ``fills``: ``[L]`` int, the layer's fills that displaced a
            resident in the same window. Their ratio is the net reuse of such a fill, what one more fill
            buys against the cache without it (zero in expectation without routing locality).
        fill_samples: ``(fills, seconds, concurrent)`` of fill branches measured (any layers).
        cpu_samples: ``(experts, seconds, concurrent)`` of CPU branches measured.
        handoffs: ``[L]`` int, per MoE layer: decode layer steps that handed CPU work to the executor on
            the device path; ``late``: ``[L]``, those whose join found the CPU branch still running
            (the GPU had to wait for it). Their ratio says which branch finishes last. With graded lateness (the
            CUDA option ``join_lateness``, and the step-time simulator's) ``late`` sums weights instead: 1, 1/2 or 0
            a hand-off (:func:`edgemoe.kernels.cpu_handoff.collect`, :meth:`AutoPolicy.join_limits`).
        misses_per_layer_step: mean misses (deduplicated experts) of one MoE layer's decode step over the
            window that found no free slot (the ones a policy decides about), or ``None``.
        cpu_probe: ``(experts, seconds)`` of one call of the CPU executor, one token per expert, timed by
            the runtime between steps when the policy asked (:attr:`ExpertPolicy.wants_cpu_probe`), or ``None``.
        free_slot_fills: misses of the window that found a free slot (the cache was not yet full), or ``None``.
        steps: decode steps the window covers (the estimates decay by steps, and the balance controller judges
            :data:`REUSE_READ_STEPS` of them at a time), or ``None``: a window of :data:`REUSE_READ_STEPS` steps.
    """

    reuse_net: list[int] | None = None
    fills: list[int] | None = None
    fill_samples: list[tuple[int, float, bool]] = field(default_factory=list)
    cpu_samples: list[tuple[int, float, bool]] = field(default_factory=list)
    handoffs: list[int] | None = None
    late: list[float] | None = None
    misses_per_layer_step: float | None = None
    cpu_probe: tuple[int, float] | None = None
    free_slot_fills: int | None = None
    steps: int | None = None


class AutoPolicy(ExpertPolicy):
    """A per-layer split from a cost model, with the reuse value of a fill measured online.

    For MoE layer ``l`` and ``m`` misses it fills the ``q`` that minimizes

        J_l(q) = T(q, m − q) − V_l · q,      V_l = max(r_l, 0) · t_save

    where ``T`` is :class:`MissCosts`'s layer time (both branches, their fixed costs, the bandwidths
    alone or concurrent), ``r_l`` the measured net reuse of a fill of layer ``l`` (hits its slot got
    during its tenure minus the requests of the expert it displaced, also where that expert was filled again,
    over the fills that displaced a resident: :class:`LayerObservation`), and
    ``t_save = fill_s·cpu_s / (fill_s + cpu_s)`` the time a miss costs at the balance of the two
    branches. Ties go to the larger ``q``. With ``r = 0`` and no fixed costs this is the q* balance of
    FreeToken (arXiv 2608.16157); fixed costs make few misses fill (a hand-off costs more than a copy)
    or stay on the CPU; reuse makes a layer whose fills are hit again fill every miss.

    Online: :meth:`observe_layers` updates ``r_l`` (exponentially weighted over ``reuse_halflife``
    tenures, prior ``reuse_prior`` with weight ``reuse_prior_weight`` fills) and the branch costs (per branch an
    :class:`EwLinearFit` of fixed cost and per-expert time over measured branch times, concurrent
    samples scaled to the isolated ones by the model's ratio), then recomputes the table ``q_l(m)``
    (``[L, M + 1]``, :meth:`fill_table`) when any entry changes. No probe steps: every decision uses
    the current estimates. The reuse prior is optimistic (``reuse_prior`` hits per fill, worth
    ``reuse_prior_weight`` fills of evidence): a miss served on the CPU is not cached, so a split chosen
    in the first windows after the working set moved, whose fills have not been requested again yet,
    keeps those experts out and makes its own later misses (on the GPU host, realistic routing at 16 GB
    with prior 0 split for ~24 decode steps after prefill and ran at 0.80-0.93x ``fill-all``). Without
    locality one window's fills (several per layer step) outweigh the prior.

    The prior's word lasts until the fills outweigh it, and the windows after a cold start or a prefill are where it
    speaks: where the table it gives fills more than the fills measured so far say (more than the table built from
    their net reuse alone, at a miss count up to twice the mean), while layer steps miss at least
    :attr:`settle_min_misses` times and a layer's displacing fills average fewer than :attr:`settle_max_fills`, the
    next window is read after :attr:`settle_read_steps` decode steps instead of :data:`REUSE_READ_STEPS`
    (:attr:`read_window_steps`; for at most :attr:`settle_max_steps` steps in a row, until the condition ends), so
    the split follows the evidence a few steps after it comes in instead of a window later (without locality a
    layer's ~6 fills a step outweigh the prior within a few steps; in the step-time simulator at 16 layers, 6.04 GB,
    that first window of 8 steps cost 12 % of a 40-step run). The reuse estimate decays by decode steps, not by
    windows (:attr:`LayerObservation.steps`; the miss rate follows each window read), and the balance controller
    still judges hand-offs over :data:`REUSE_READ_STEPS` steps (or :data:`REUSE_READ_SECONDS`): those of the short
    windows add up.

    ``t_save`` is the marginal time of one more miss at the measured mean miss count ``m̄`` of a layer
    step (``k = max(1, round(m̄))``, ``T*`` the best split's time): ``T*(1) − T*(0)``, a whole expert's
    branch time, when a layer misses about once; for ``k ≥ 2`` the secant ``(T*(k + w) − T*(k − w)) / 2w``,
    ``w = ⌊k/2⌋`` (single differences of the integer splits jump between 0.1x and 2x the balance value),
    which stays within 10 % of the balance value above for many misses.

    Balance on the device path, where branch times are not measured per step: the join of each hand-off
    records whether the CPU branch was still running when the GPU reached it (``late``; with graded lateness, a
    CUDA option, 1, 1/2 or 0 by whether either side finished first by more than one expert's time,
    :meth:`join_limits`). Over each
    window with at least :attr:`balance_min_handoffs` hand-offs, a late fraction above
    :attr:`balance_band`'s upper edge raises the CPU side's cost (levels of ``2^(1/8)``, both its
    fixed and per-expert time), below the lower edge lowers it. A move in the same direction as the
    window before's doubles in size, up to :attr:`balance_max_step` levels (1, 2, 4, 4, ...: a halved
    bandwidth, 8 levels, is met in 4 windows instead of 8), and a reversal or a window inside the band
    starts again at one level, as in sign-based step adaptation (Riedmiller & Braun's Rprop, 1993); a
    window in which nearly every hand-off was late (:attr:`balance_stall`: the GPU always waited) and
    the decode steps took :attr:`balance_stall_slowdown` times as long as before (the mean step time of
    the earlier windows, from :meth:`observe`) moves the level by the slowdown itself, ``8·log2(step time
    / earlier step time)`` levels and at least :attr:`balance_stall_step`: the CPU side became far slower
    than it was, e.g. another process took the executor's cores, and when it is the step's critical path
    the step slowed by about as much as the CPU did, so one window prices it. The levels are
    bounded (:attr:`balance_levels`); windows
    with too few hand-offs to judge move it one level back toward 1x. While the table fills every miss
    (the CPU branch disarmed, sending nothing) hand-offs say nothing about the CPU. Where the runtime
    times a CPU-speed probe (:attr:`wants_cpu_probe`: :attr:`cpu_probe_experts` experts of one token in
    one executor call between steps, about a millisecond at full speed, off the GPU's path; asked only where
    the table would split at level 0, so that the CPU's price is what makes it fill every miss: where it fills
    every miss at level 0 too, few misses or fills hit again, the CPU's speed changes nothing, no probe is
    timed and quiet windows keep the level), a window's
    probe within :attr:`cpu_probe_return` times the level-0 model's time sets the level to
    ``8·log2(measured / modeled)`` (never raising it): a slowdown that ended is seen in the next window.
    A slower probe keeps the level: under a process sharing the executor's cores a lone small call
    understates how slow a step's CPU branch runs (on the GPU host a probe read 8x while the steps ran
    over 15x slower, and following it re-armed the split into a stall every half second). Without probe
    times the level is instead halved toward 1x after :attr:`balance_retry_windows` quiet windows: a probe
    of the CPU side on the decode steps themselves, so one priced out by a passing slowdown comes back in
    a few probes, without flipping the step's graph every window. Such a probe is
    judged on the next decode step (:attr:`read_window_steps`), so one into a persisting slowdown costs
    one slow step; one answered by a late window doubles the quiet windows before the next (up to
    :attr:`balance_retry_max`), one that is not resets them. The split then settles where the CPU
    finishes about when the GPU does, whatever the model missed (hand-off latency, an executor slower
    than profiled, DRAM or PCIe taken by another process), and follows a change within a few windows.

    Sign feedback cannot settle where the split is an integer: at a layer step's ~8 misses, one level's table may
    fill 2 (nearly every hand-off late) and the next level's 3 (few late), so the late fraction jumps across the
    band and the level goes back and forth, half the windows at the slower split (in the step-time simulator
    without locality at 2 GB, 0.94-0.95 of ``qstar``). So the controller remembers the level and mean step time of
    its last :attr:`balance_cycle_windows` judged windows; when a move brings the level back to one of them (a
    cycle, not a walk: a CPU slowing down or recovering moves it one way), it sets the level whose window stepped
    fastest and holds it for :attr:`balance_hold_windows` judged windows, then judges again. Each arbitration that
    chooses the level the one before it chose holds twice as long as that one did (up to :attr:`balance_hold_max`
    windows), as exponential backoff: a cycle that keeps coming back to the same answer is asked less often, since
    every time it is asked it runs a window or two at the slower split (in the simulator, a CPU that reads about as
    fast as PCIe at 6 threads, no locality, 2 GB, 300 decode steps: 0.972 -> 0.983 of ``qstar``). A stall, or a
    window whose steps run at another pace (more than :attr:`balance_hold_change` from the held window's, another
    process coming or going), ends the hold at once and the next arbitration's hold starts short again.

    The armed CPU branch's own cost (:meth:`price_armed_branch`, ``a`` seconds per MoE layer step): a decode path
    that drops the branch from steps whose table fills every miss charges every layer step ``a`` while it is armed.
    After building the table the policy compares, summed over layers, the expected objective of the table with that
    of filling every miss, each averaged over a layer step's miss count ``m ~ Binomial(M, m̄ / M)``; when the
    table's expected gain is below ``L·a`` it fills every miss instead (the step then runs without the branch, as
    ``fill-all`` does). Where nearly every expert hits this is what keeps ``auto`` level with ``fill-all``: the CPU
    would save less than the launches that keep it ready cost. Until the first miss rate is measured (a new cache:
    its misses find free slots and fill anyway) it fills every miss; ``m̄`` counts only the misses that found no
    free slot, so the choice is made on the misses of a full cache under fill-every-miss, not on those that sending
    experts to the CPU would add (a CPU-served expert is not cached and misses again).

    It also fills every miss while the misses fall fast: a window's mean misses per layer step below
    :attr:`falling_ratio` of the window before's (from at least :attr:`falling_min_misses`). The cache is then
    taking in a new working set (after a prefill, or when the conversation moves on) and its fills are what makes
    the misses fall, while the reuse counters lag them (a fill's hits come in the windows after it); on the GPU host
    a split in those windows (realistic routing, 16 GB: 5.8, 1.9, 0.5, 0.3 misses per layer step in the first
    four windows after a prefill) left out experts that were requested again and ran at 0.80-0.95x ``fill-all``.
    The threshold is a halving, not a smaller fall: the first decode step after a prefill can miss most of its
    experts (the prompt's are not all the decode's; and until a streamed prefill kept each layer's routed experts,
    those measurements' prefills left most layers none), so the window after it falls also where the cache is too
    small for the working set and the misses level off at once (realistic routing, 6 GB: 7.2 then 4.3 and 4.1, a
    fall to 0.6 of the window before that, at a threshold of 0.7, held ``fill-all`` for six steps). Without
    locality the misses stay level and the split comes at the first window, as before.

    The window after a rise is held too: a window with at least :attr:`rising_min_misses` misses per layer step
    after one below :attr:`falling_min_misses` in which no miss found a free slot (a full cache was holding the
    working set; a cache still filling up counts only the misses that found none), and a new one is coming in
    (the next request of an agent session after its prefill, or a change of topic). The rise itself raised the
    measured miss rate, and with it the expected gain of the CPU branch, so the next window would otherwise split
    the new working set's misses and keep the experts served on the CPU out of the cache (on the GPU host,
    realistic routing at 16 GB with four requests per run, before this rule: 0.5-0.8 experts a token on the CPU,
    2.5-5 % behind ``fill-all`` in every request, 0.966-0.970x over the run; which windows sent them was not
    logged). Where the cache is too small for the working set the misses never drop below
    :attr:`falling_min_misses`, so no rise is held.

    Args:
        costs: the prior cost model (from the measured bandwidths and fixed costs).
        num_layers: ``L``, MoE layers.
        max_misses: ``M``, the largest miss count the table covers (larger ``m`` use row ``M``'s ratio).
        armed: whether the CPU branch is armed on every layer step (costs ``idle_handoff_s`` without work).

    Raises:
        ValueError: ``num_layers`` or ``max_misses`` below 1.
    """

    name = "auto"
    online = True
    per_layer = True
    fills_free_slots = True
    rebuild_tolerance = 0.01  # cost estimates closer than this (relative) to the last ones keep the split hulls
    balance_band = (0.35, 0.65)  # late fraction of hand-offs inside which the CPU cost level stays
    balance_min_handoffs = 8  # hand-offs a window needs before its late fraction moves the level
    balance_levels = (-16, 40)  # CPU cost scale 2^(level/8): 0.25x .. 32x of the model's
    balance_max_step = 4  # levels one window's move may take (moves double while their direction holds)
    balance_stall = 0.95  # late fraction above which a window moves balance_stall_step levels at once
    balance_stall_step = 8  # levels of a stalled window's move (2x the CPU cost)
    balance_stall_slowdown = 2.0  # a stalled window's mean step time over the earlier windows' (at least)
    balance_retry_windows = 4  # quiet windows before a probe while the table fills every miss (disarmed)
    balance_cycle_windows = 6  # judged windows in which a level seen again is a cycle of the controller
    balance_hold_windows = 4  # judged windows a cycle's arbitration holds the fastest level (a stall ends it)
    balance_hold_max = 32  # most judged windows of a hold (it doubles while the arbitrations keep choosing one level)
    balance_hold_change = 0.15  # a held window's mean step time this far (relative) from the held one's ends the hold
    balance_retry_max = 8  # most quiet windows between probes (after probes answered by late windows)
    cpu_probe_experts = 8  # experts of one CPU-speed probe (one token each) while the CPU is priced out
    cpu_probe_return = 2.0  # probe time over the model's below which the level follows the probe
    miss_rate_decay = 0.25  # weight of the previous mean miss count per window read (a short one too)
    falling_ratio = 0.5  # a window's miss count below this share of the window before's: the working set is settling
    falling_min_misses = 0.5  # ... counted only from a window before with at least this many misses per layer step
    rising_min_misses = 1.0  # a window with at least this many misses per layer step after one below falling_min_misses
    settle_read_steps = 2  # decode steps of a window while the table fills more than the fills measured so far say
    settle_min_misses = 1.0  # ... counted only where layer steps miss at least this often (a read costs ~0.3 ms)
    settle_max_fills = 48.0  # ... and only while a layer's displacing fills (weighted) average fewer than this
    settle_max_steps = 2 * REUSE_READ_STEPS  # ... and for at most this many decode steps in a row

    def __init__(self, costs: MissCosts, num_layers: int, max_misses: int, *, armed: bool = True,
                 reuse_halflife: float = 32.0, reuse_prior: float = 4.0, reuse_prior_weight: float = 6.0,
                 fit_halflife: float = 256.0):
        if num_layers < 1 or max_misses < 1:
            raise ValueError(f"num_layers and max_misses must be >= 1, got {num_layers}, {max_misses}")
        self.prior, self.costs, self.armed = costs, costs, armed
        self.L, self.M = int(num_layers), int(max_misses)
        self.reuse_decay = 0.5 ** (1.0 / float(reuse_halflife))
        self.reuse_prior, self.reuse_prior_weight = float(reuse_prior), float(reuse_prior_weight)
        self._net = [0.0] * self.L
        self._n = [0.0] * self.L
        self.fill_fit = EwLinearFit(costs.fill_fixed_s, costs.fill_s, fit_halflife)
        self.cpu_fit = EwLinearFit(costs.cpu_fixed_s, costs.cpu_s, fit_halflife)
        self._table: list[list[int]] = []
        self._tensor: torch.Tensor | None = None
        self._hull_costs: MissCosts | None = None
        self._hulls_by_level: dict[int, HullRows] = {}
        self._fills_all = False  # every row of the table is its HullRows.full (kept by _rebuild)
        self._per_row: dict[int, list] = {}  # data derived from a table row, by row object (see _row_entry)
        self.cpu_level = 0
        self.late_fraction: float | None = None  # late hand-offs over all, in the last window judged (None: none yet)
        self._level0_fills_all: bool | None = None  # wants_cpu_probe's look at the level-0 table, until a rebuild
        self._quiet_windows = 0  # consecutive windows with too few hand-offs to judge
        self._balance_move = 0  # the last window's move in levels (signed; 0: none)
        self._retry_windows = self.balance_retry_windows  # quiet windows before the next probe
        self._probing = False  # the level was halved by a probe and no window has judged it yet
        self._settling = False  # the reuse prior alone makes the table fill more: read again sooner
        self._pending_joins: tuple[list[int] | None, list[int] | None] = (None, None)  # since the last judgment
        self._pending_steps = 0  # decode steps of the windows read since the last judgment
        self._settled_steps = 0  # decode steps read in a row with short windows
        self._window_s, self._window_steps = 0.0, 0  # decode step times seen since the last observation
        self._step_ref_s: float | None = None  # mean decode step time of the earlier windows (EW)
        self._visits: list[tuple[int, float]] = []  # (level, mean step time) of the last judged windows
        self._hold = 0  # judged windows left in which the level stays where a cycle's arbitration put it
        self._hold_s = 0.0  # the mean step time of the held level's window
        self._hold_level: int | None = None  # the level the last arbitration chose (None: none, or its hold broke)
        self._hold_windows = self.balance_hold_windows  # judged windows of the next arbitration's hold
        self.miss_rate: float | None = None
        self._window_misses: float | None = None  # the last window's mean misses per layer step (unsmoothed)
        self._window_full = False  # no miss of the last window found a free slot (the cache was full)
        self.misses_falling = False  # the last window missed far less than the one before (see the class docstring)
        self.misses_rose = False  # the last window's misses rose from a level the cache was holding (likewise)
        self.armed_cost_s = 0.0
        self._rebuild()

    @classmethod
    def from_bandwidths(cls, bw: Bandwidths, expert_bytes: int, num_layers: int, max_misses: int,
                        **kw) -> "AutoPolicy":
        """The engine's prior: the measured fixed costs of a copy and of a CPU call (``bw.fill_fixed_s``,
        ``bw.cpu_fixed_s``) and per-expert times from the bandwidths net of them: a fill ``expert_bytes /
        B_P − fill_fixed_s / copy_rows``, a CPU expert ``expert_bytes / (B_H − B_P) − cpu_fixed_s /
        cpu_experts`` (the pair is the concurrent one, ``B_H = B_P,c + B_H,c``: the CPU's share while fills
        run); the two branches overlapped; an armed CPU branch free when it has no work (the device path
        rings the CPU executor only for work). Without bandwidths (no cache to fill) every miss runs on
        the CPU.

        Raises:
            ValueError: a non-positive ``expert_bytes``, ``num_layers`` or ``max_misses``.
        """
        if expert_bytes <= 0:
            raise ValueError(f"expert_bytes must be positive, got {expert_bytes}")
        if bw.pcie is None or bw.cpu is None:
            costs = MissCosts(fill_s=1.0, fill_conc_s=1.0, cpu_s=1e-9, cpu_conc_s=1e-9)
        else:
            residual = max(bw.cpu - bw.pcie, 1e-3 * bw.pcie)  # B_H <= B_P: the CPU adds (almost) nothing
            b = expert_bytes / 1e9
            fill = max(b / bw.pcie - bw.fill_fixed_s / bw.copy_rows, 1e-3 * b / bw.pcie)
            cpu = max(b / residual - bw.cpu_fixed_s / bw.cpu_experts, 1e-3 * b / residual)
            costs = MissCosts(fill_s=fill, fill_conc_s=fill, cpu_s=cpu, cpu_conc_s=cpu, fill_fixed_s=bw.fill_fixed_s,
                              cpu_fixed_s=bw.cpu_fixed_s)
        return cls(costs, num_layers, max_misses, armed=False, **kw)

    @property
    def reuse(self) -> list[float]:
        """``r_l``: estimated net reuse (hits) of one fill, per MoE layer."""
        w, r0 = self.reuse_prior_weight, self.reuse_prior
        return [(net + w * r0) / (n + w) for net, n in zip(self._net, self._n)]

    def num_fills(self, m: int, layer: int = 0) -> int:
        if m <= 0:
            return 0
        row = self._table[layer]
        if m <= self.M:
            return row[m]
        return min(m, math.floor(m * row[self.M] / self.M + 0.5))

    def q_ratio(self) -> float:
        return sum(row[self.M] for row in self._table) / (self.L * self.M)

    def fill_rule(self) -> tuple[float, float, float]:
        raise NotImplementedError("the auto policy is encoded per layer: use fill_table()")

    def fills_every_miss(self) -> bool:
        return self._fills_all

    def fill_table(self) -> torch.Tensor:
        """``[L, M + 1]`` int32: ``q_l(m)`` for ``m = 0 .. M`` (the device encoding), stacked from one kept
        tensor per distinct row (a ``torch.tensor`` of the nested lists took ~0.3 ms at 48 x 129)."""
        if self._tensor is None:
            self._tensor = torch.stack([self._row_tensor(row) for row in self._table])
        return self._tensor

    def _row_entry(self, row: list[int]) -> list:
        """``[row, its int32 tensor or None, (costs, gaps, fills) of :meth:`_row_gaps` or None]`` kept for a table
        row object (the memoized rows of :class:`HullRows` are shared); the entry holds its row, so an id is not
        reused while it is kept. Dropped with the hulls when the cost estimates move."""
        e = self._per_row.get(id(row))
        if e is None or e[0] is not row:
            e = self._per_row[id(row)] = [row, None, None]
        return e

    def _row_tensor(self, row: list[int]) -> torch.Tensor:
        e = self._row_entry(row)
        if e[1] is None:
            e[1] = torch.tensor(row, dtype=torch.int32)
        return e[1]

    @property
    def cpu_scale(self) -> float:
        """The balance controller's factor on the CPU branch's modeled time (1.0 until it moves)."""
        return 2.0 ** (self.cpu_level / 8)

    def effective_costs(self, level: int | None = None) -> MissCosts:
        """The cost model the table is built from: the estimates with the CPU side scaled by :attr:`cpu_scale`
        (by ``2^(level/8)`` for another ``level`` of the balance controller)."""
        c, k = self.costs, self.cpu_scale if level is None else 2.0 ** (level / 8)
        return replace(c, cpu_s=c.cpu_s * k, cpu_conc_s=c.cpu_conc_s * k, cpu_fixed_s=c.cpu_fixed_s * k)

    def join_limits(self) -> tuple[float, float]:
        """``(fill_conc_s, cpu_conc_s)`` of :meth:`effective_costs`: the CPU's at the balance controller's current
        level. One pair for every layer (the cost model is not per layer)."""
        c = self.effective_costs()
        return c.fill_conc_s, c.cpu_conc_s

    def t_save(self, c: MissCosts) -> float:
        """Seconds one fewer miss saves a layer step (see the class docstring)."""
        if self.miss_rate is None:
            return c.fill_s * c.cpu_s / (c.fill_s + c.cpu_s)
        k = max(1, min(self.M, math.floor(self.miss_rate + 0.5)))

        def best(m: int) -> float:
            return min(c.split_seconds(m, q, self.armed) for q in range(m + 1))

        if k == 1:
            return max(best(1) - best(0), 0.0)
        w = max(1, k // 2)  # a secant: the integer splits make single differences jump (0.1x-2x the balance)
        return max((best(k + w) - best(k - w)) / (2 * w), 0.0)

    def _table_at(self, level: int, reuse: list[float] | None = None) -> list[list[int]]:
        """The table ``q_l(m)`` the current estimates give at the balance controller's ``level`` (with ``reuse``
        in place of :attr:`reuse`, the estimates with the prior, where given)."""
        if not _close(self.costs, self._hull_costs, self.rebuild_tolerance):
            self._hulls_by_level, self._hull_costs = {}, self.costs  # new estimates: every level's hulls are stale
            self._per_row = {}  # (the table in use keeps its rows; their data is derived again if asked)
        c = self.effective_costs(level)
        rows = self._hulls_by_level.get(level)
        if rows is None:  # M + 1 hulls of at most M + 1 points, kept per level (the controller revisits levels)
            rows = HullRows([[c.split_seconds(m, q, self.armed) for q in range(m + 1)] for m in range(self.M + 1)])
            self._hulls_by_level[level] = rows
        t_save = self.t_save(c)
        values = [max(r, 0.0) * t_save for r in (self.reuse if reuse is None else reuse)]
        table = [rows.row(v) for v in values]
        if self.misses_falling or self.misses_rose or self._armed_branch_pays(c, table, values) is False:
            table = [rows.full] * self.L
        return table

    def _rebuild(self) -> bool:
        self._level0_fills_all = None  # the estimates may have moved: wants_cpu_probe looks again
        table = self._table_at(self.cpu_level)
        changed = table != self._table
        if changed:
            self._table, self._tensor = table, None
            full = self._hulls_by_level[self.cpu_level].full
            self._fills_all = all(row is full for row in table)
        return changed

    def _prior_fills_more(self) -> bool:
        """Whether the table fills more than the fills measured so far say, on the reuse prior's word: layer steps
        miss at least :attr:`settle_min_misses` times, no falling or rising window holds the table, the layers'
        displacing fills average fewer than :attr:`settle_max_fills`, and the table fills more than the one built
        from the measured net reuse alone (0 for a layer without fills) at a miss count seen (up to twice the
        mean)."""
        if (self.miss_rate is None or self.miss_rate < self.settle_min_misses or self.misses_falling
                or self.misses_rose or sum(self._n) >= self.settle_max_fills * self.L):
            return False
        measured = [net / n if n > 0 else 0.0 for net, n in zip(self._net, self._n)]
        seen = min(self.M, math.ceil(2 * self.miss_rate)) + 1
        return any(q > q_measured for row, row_measured in zip(self._table, self._table_at(self.cpu_level, measured))
                   for q, q_measured in zip(row[:seen], row_measured[:seen]))

    def _armed_branch_pays(self, c: MissCosts, table: list[list[int]], values: list[float]) -> bool | None:
        """Whether ``table``'s expected gain over filling every miss exceeds the armed branch's cost
        (``None``: not priced; ``False`` before a miss rate is measured; see the class docstring), at costs ``c``.

        A layer of fill value ``v`` gains ``Σ_m P(m)·[(split(m, m) − v·m) − (split(m, q(m)) − v·q(m))]``, summed as
        ``Σ_m P(m)·gap_m − v·Σ_m P(m)·(m − q(m))`` once per distinct row (:meth:`_row_gaps`)."""
        if self.armed_cost_s <= 0:
            return None
        if self.miss_rate is None:
            return False
        p = min(max(self.miss_rate / self.M, 0.0), 1.0)
        pmf = [math.comb(self.M, m) * p ** m * (1 - p) ** (self.M - m) for m in range(self.M + 1)]
        sums: dict[int, tuple[float, float]] = {}
        gain = 0.0
        for row, v in zip(table, values):
            ab = sums.get(id(row))
            if ab is None:
                secs, fills = self._row_gaps(c, row)
                ab = sums[id(row)] = (sum(map(operator.mul, pmf, secs)), sum(map(operator.mul, pmf, fills)))
            gain += ab[0] - v * ab[1]
        return gain > self.L * self.armed_cost_s

    def _row_gaps(self, c: MissCosts, row: list[int]) -> tuple[list[float], list[int]]:
        """Per ``m``, for a table row: the seconds its split saves against filling every miss at costs ``c``
        (``split(m, m) − split(m, q(m))``) and the fills it leaves out (``m − q(m)``); kept with the row
        (:meth:`_row_entry`) while they are asked at the same costs."""
        e = self._row_entry(row)
        if e[2] is None or e[2][0] != c:
            secs = [c.split_seconds(m, m, self.armed) - c.split_seconds(m, q, self.armed) if q < m else 0.0
                    for m, q in enumerate(row)]
            e[2] = (c, secs, [m - q for m, q in enumerate(row)])
        return e[2][1], e[2][2]

    @property
    def read_window_steps(self) -> int:
        """1 while a probe waits for its answer; :attr:`settle_read_steps` while the table fills more than the
        fills measured so far say (see the class docstring); else :data:`REUSE_READ_STEPS`."""
        return 1 if self._probing else self.settle_read_steps if self._settling else REUSE_READ_STEPS

    def _judges(self, pending_steps: int) -> bool:
        """Whether the balance controller judges the windows read since its last judgment, ``pending_steps``
        decode steps: not the short windows of a settling table, whose hand-offs add up until
        :data:`REUSE_READ_STEPS` steps or :data:`REUSE_READ_SECONDS` of them (slow steps: a stall is priced as
        soon as in a full window)."""
        return (not self._settling or self._probing or pending_steps >= REUSE_READ_STEPS
                or self._window_s >= REUSE_READ_SECONDS)

    @property
    def wants_cpu_probe(self) -> int:
        """The probe's experts while the CPU is priced out: the table fills every miss at a raised level but
        would split at level 0. Where it fills every miss at level 0 too (few misses, or fills that are hit
        again), the CPU's speed changes nothing and no probe is timed (a probe reads ~1 ms of experts a
        window, 8 % of a 16-layer step's time); nor in a window the balance controller does not judge."""
        return self._cpu_probe_experts() if self._judges(self._pending_steps + self.read_window_steps) else 0

    def _cpu_probe_experts(self) -> int:
        if self.cpu_level <= 0 or not self.fills_every_miss():
            return 0
        if self._level0_fills_all is None:  # kept until the next rebuild (the table at level 0 costs ~0.3 ms)
            full = list(range(self.M + 1))
            self._level0_fills_all = all(row == full for row in self._table_at(0))
        return 0 if self._level0_fills_all else self.cpu_probe_experts

    def observe(self, seconds: float, batch_size: int) -> bool:
        """Record a decode step's wall time (for the balance controller's stall test); the table is
        rebuilt by :meth:`observe_layers` only."""
        self._window_s += float(seconds)
        self._window_steps += 1
        return False

    def price_armed_branch(self, seconds: float) -> bool:
        self.armed_cost_s = max(float(seconds), 0.0)
        return self._rebuild()

    def observe_layers(self, obs: LayerObservation) -> bool:
        """Update the reuse and cost estimates from ``obs`` and rebuild the table; returns whether it
        changed (the caller then pushes :meth:`fill_table` to the device)."""
        self._level0_fills_all = None  # new estimates below
        steps = REUSE_READ_STEPS if obs.steps is None else max(int(obs.steps), 1)
        if obs.fills is not None:  # the reuse estimate decays by steps (halflife in windows of REUSE_READ_STEPS)
            d = self.reuse_decay ** (steps / REUSE_READ_STEPS)
            for layer, (net, n) in enumerate(zip(obs.reuse_net, obs.fills)):
                self._net[layer] = self._net[layer] * d + net
                self._n[layer] = self._n[layer] * d + n
        if obs.misses_per_layer_step is not None:
            prev, w, m = self.miss_rate, self.miss_rate_decay, obs.misses_per_layer_step
            self.miss_rate = m if prev is None else w * prev + (1 - w) * m
            before, self._window_misses = self._window_misses, m
            self.misses_falling = (before is not None and before >= self.falling_min_misses
                                   and m < self.falling_ratio * before)
            self.misses_rose = (self._window_full and before < self.falling_min_misses  # full implies a window before
                                and m >= self.rising_min_misses)
            self._window_full = obs.free_slot_fills == 0
        if obs.handoffs is not None:  # hand-offs add up over the short windows of a settling table
            h, lt = self._pending_joins
            self._pending_joins = ((list(obs.handoffs), list(obs.late)) if h is None else
                                   ([a + b for a, b in zip(h, obs.handoffs)], [a + b for a, b in zip(lt, obs.late)]))
        self._pending_steps += steps
        if self._judges(self._pending_steps):
            (handoffs, late), self._pending_joins, self._pending_steps = self._pending_joins, (None, None), 0
            self._judge_balance(handoffs, late, obs.cpu_probe)
        p = self.prior
        if obs.fill_samples or obs.cpu_samples:
            for n, t, conc in obs.fill_samples:
                self.fill_fit.add(n, t * (p.fill_s / p.fill_conc_s if conc else 1.0))
            for n, t, conc in obs.cpu_samples:
                self.cpu_fit.add(n, t * (p.cpu_s / p.cpu_conc_s if conc else 1.0))
            self._costs_from_fits()
        changed = self._rebuild()
        settling = self._prior_fills_more()
        if not settling:
            self._settled_steps = 0
        elif self._settling:  # one more short window (a capped run stays capped until the condition ends)
            self._settled_steps += steps
        self._settling = settling and self._settled_steps < self.settle_max_steps
        return changed

    def _judge_balance(self, handoffs: list[int] | None, late: list[float] | None,
                       cpu_probe: tuple[int, float] | None) -> None:
        """The balance controller's move over the decode steps since its last judgment (see the class docstring):
        ``handoffs`` / ``late`` per layer over those steps (``None``: not counted), ``cpu_probe`` a CPU-speed
        probe's ``(experts, seconds)``."""
        mean_s = self._window_s / self._window_steps if self._window_steps else None
        ref = self._step_ref_s
        slowed = mean_s is not None and ref is not None and mean_s >= self.balance_stall_slowdown * ref
        if mean_s is not None:  # the reference follows the step time, but not into a stall
            self._step_ref_s = mean_s if ref is None else ref if slowed else 0.5 * (ref + mean_s)
            self._window_s, self._window_steps = 0.0, 0
        probed = cpu_probe is not None and self.cpu_level > 0 and self.fills_every_miss()
        if probed:  # the CPU's own speed, measured off the decode steps: lower the level to what it says
            n, t = cpu_probe
            model = self.costs.cpu_fixed_s + n * self.costs.cpu_s  # the level-0 (unscaled) time of that call
            if model > 0 and 0 < t <= self.cpu_probe_return * model:  # the slowdown is over (or nearly)
                self.cpu_level = min(self.cpu_level, max(0, math.ceil(8 * math.log2(t / model))))
            self._probing, self._quiet_windows, self._balance_move = False, 0, 0
        if handoffs is None:  # no hand-offs counted (no device path): nothing can judge a probe, read no sooner
            self._probing = False
        else:
            lo, hi = self.balance_levels
            if (n := sum(handoffs)) >= self.balance_min_handoffs:
                self._quiet_windows = 0
                frac = self.late_fraction = sum(late) / n
                sign = 1 if frac > self.balance_band[1] else -1 if frac < self.balance_band[0] else 0
                prev = self._balance_move
                stall = frac >= self.balance_stall and slowed  # every hand-off late and the steps slowed down
                if stall:
                    size = max(self.balance_stall_step, math.ceil(8 * math.log2(mean_s / ref)))
                else:
                    size = min(2 * abs(prev), self.balance_max_step) if sign and prev * sign > 0 else 1
                if self._hold and (stall or mean_s is None
                                   or abs(mean_s / self._hold_s - 1) > self.balance_hold_change):
                    self._hold = 0  # a stall, or the steps changed pace (another process came or went): judge again
                    self._hold_level, self._hold_windows = None, self.balance_hold_windows
                if self._hold:  # holding the level a cycle's arbitration chose
                    self._hold -= 1
                    self._balance_move = 0
                else:
                    ran = self.cpu_level  # the level this window ran at
                    self._balance_move = sign * size
                    self.cpu_level = min(max(self.cpu_level + self._balance_move, lo), hi)
                    if mean_s is not None and not stall:
                        self._visits = [*self._visits, (ran, mean_s)][-self.balance_cycle_windows:]
                        if self.cpu_level != ran and any(lv == self.cpu_level for lv, _ in self._visits):
                            # the level comes back to one of the last windows': the sign feedback cycles over an
                            # edge of the table (an integer split it cannot settle); keep the fastest level seen
                            self.cpu_level, self._hold_s = min(self._visits, key=lambda v: v[1])
                            # the same level won again: hold it twice as long (the cycle's excursions get rarer)
                            self._hold_windows = (min(2 * self._hold_windows, self.balance_hold_max)
                                                  if self.cpu_level == self._hold_level else self.balance_hold_windows)
                            self._hold_level = self.cpu_level
                            self._hold, self._balance_move, self._visits = self._hold_windows, 0, []
                if self._probing:  # the first judged window after a probe: did the slowdown persist?
                    late = sign > 0
                    self._retry_windows = (min(2 * self._retry_windows, self.balance_retry_max) if late
                                           else self.balance_retry_windows)
                    self._probing = False
            else:  # too few hand-offs to judge: back toward 1x, by probes when the table itself sent none
                self._quiet_windows += 1
                self._balance_move = 0
                disarmed = self.fills_every_miss()
                if probed:  # the probe judged this window
                    self._quiet_windows = 0
                elif disarmed and self.cpu_level > 0 and not self._cpu_probe_experts():
                    # every miss fills at level 0 too: the CPU's price changes nothing now, nothing to probe
                    self._quiet_windows, self._probing = 0, False
                elif self.cpu_level and self._quiet_windows >= (self._retry_windows if disarmed else 1):
                    if disarmed and self.cpu_level > 0:
                        self.cpu_level //= 2
                        self._probing = True
                    else:
                        self.cpu_level -= 1 if self.cpu_level > 0 else -1
                    self._quiet_windows = 0

    def _costs_from_fits(self) -> None:
        p = self.prior
        (fa, fb), (ca, cb) = self.fill_fit.params, self.cpu_fit.params
        self.costs = replace(p, fill_fixed_s=fa, fill_s=fb, fill_conc_s=fb * p.fill_conc_s / p.fill_s,
                             cpu_fixed_s=ca, cpu_s=cb, cpu_conc_s=cb * p.cpu_conc_s / p.cpu_s)

    def inherit(self, previous: ExpertPolicy) -> bool:
        """Keep, across a resize of the expert cache, what ``previous`` measured of the machine: the samples of
        the two branch-cost fits (fixed cost and per-expert time of a fill and of a CPU call; this policy's own
        prior anchors them) and the balance controller's CPU cost level with its probe spacing (how far the
        CPU side runs from the model: another process on its cores, or a model that misjudges it), which a
        fresh policy would climb back to over several windows, each a few decode steps slower than need be.
        The level (with a probe in flight) is kept only where both policies start from the same prior: it
        measures the CPU against that model, and new bandwidths make another one. What belongs to the cache
        starts over: the reuse of a fill, the miss rate and its falling and rising window tests, the step-time reference
        (a different cache size steps at another pace)."""
        if not isinstance(previous, AutoPolicy):
            return False
        self.fill_fit.take_samples(previous.fill_fit)
        self.cpu_fit.take_samples(previous.cpu_fit)
        self._costs_from_fits()
        if previous.prior == self.prior:
            self.cpu_level, self._retry_windows = previous.cpu_level, previous._retry_windows
            self._probing = previous._probing
        return self._rebuild()


def make_policy(name: str, bw: Bandwidths, *, num_layers: int = 1, max_misses: int = 128,
                expert_bytes: int = 1) -> ExpertPolicy:
    """Build the policy named ``auto | qstar | adaptive | fill-all | cpu-all | static``.

    ``num_layers``, ``max_misses`` (the most misses one MoE layer's decode step can have: ``min(E, T·k)``)
    and ``expert_bytes`` size the ``auto`` policy (:meth:`AutoPolicy.from_bandwidths`).

    Raises:
        ValueError: unknown name, or ``qstar``/``adaptive`` with a non-positive bandwidth.
    """
    if name == "qstar":
        return QStarPolicy(bw)
    if name == "adaptive":
        return AdaptivePolicy(bw)
    if name == "auto":
        return AutoPolicy.from_bandwidths(bw, expert_bytes, num_layers, max_misses)
    table = {"fill-all": FillAllPolicy, "cpu-all": CpuAllPolicy, "static": StaticPolicy}
    if name not in table:
        raise ValueError(f"unknown expert policy {name!r}; choose auto, qstar, adaptive, fill-all, cpu-all or static")
    return table[name]()
