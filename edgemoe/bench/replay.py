"""Replay routing traces through expert-cache policies without running the model.

``edgemoe replay-routing TRACE...`` (:func:`main_replay`) turns traces (:mod:`edgemoe.bench.trace`)
into a sequence of *accesses* and simulates a cache of ``S`` (layer, expert) slots under each policy.

Access model (the engine's rule, ``edgemoe.experts.hybrid.HybridExperts``): one access is one MoE layer
of one model step; its ids are the distinct flat ids ``layer * E + e`` routed by the step's tokens (all
sequences of the step together). They are needed at once: hits are touched, misses are filled (*fill
on miss*, the ``fill-all`` semantic the miss-rate curves of FreeToken measure) into victims chosen
among the slots **not needed by this access**; misses beyond those slots are not admitted (computed on
the CPU). Misses are filled most-routed first. In prefill, when a step needs more ids than the cache
holds, later misses may evict this step's earlier ones (the engine's streaming waves). Prefill accesses
warm the cache; miss rates are reported for decode accesses only, as ``misses / (hits + misses)``.

Policies (``S`` slots over all ``N = L * E`` ids):

- ``lru``: global LRU across layers, FreeToken (arXiv 2608.16157) §4 — this is the
  engine's own :class:`~edgemoe.experts.cache.ExpertCache` (``lookup``, ``touch``, ``choose_victims``,
  ``admit``) driven with the engine's step clock, so its counts equal the engine's counters.
- ``layer-lru``: one LRU per MoE layer, ``S // L`` slots each (the first ``S % L`` layers get one more).
- ``lfu``: global LFU; frequencies count accesses over the whole history (they survive eviction),
  ties evict the least recently used.
- ``static-oracle``: the ``S`` ids routed most (token counts, decode accesses) in the replayed trace
  itself, placed before the first access and never changed; misses are never admitted. An oracle.
- ``static-calib``: the same placement computed from ``--calibration`` traces (an honest static split).
- ``static-layers``: whole MoE layers from the last one backwards (the engine's ``static`` policy,
  llama.cpp ``--n-cpu-moe`` style).
- ``prefill-updated``: KTransformers-style; after each prefill access the placement becomes the ``S``
  ids most routed by the prefill tokens of the requests in that step (their prompt so far); slots the
  prompt does not need keep their previous ids. Never admits on a miss. Requests without prefill
  records (e.g. the Mixtral decode traces, unless ``--prefill-tokens``) leave it cold.
- ``belady``: Belady's MIN (Belady 1966, "A study of replacement algorithms for a virtual-storage
  computer"), global: evict the resident id whose next use is farthest in the future. Under this
  access model (fill on miss, a step's own ids are not victims) it is the offline optimum of every
  fill-on-miss policy (checked against exhaustive search in the tests): the lower bound of the curves.
  It does not bound the static policies, whose placement is loaded for free before the first access.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edgemoe.bench.trace import RouteRecord, TraceInfo, read_traces
from edgemoe.core import Phase
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.hybrid import plan_step
from edgemoe.experts.policy import FillAllPolicy

if TYPE_CHECKING:
    from argparse import Namespace

__all__ = [
    "ALL_POLICIES",
    "DEFAULT_CAPACITIES",
    "DEFAULT_POLICIES",
    "Access",
    "Policy",
    "ReplayResult",
    "ResidentPolicy",
    "Workload",
    "build_workload",
    "expert_bytes_from_config",
    "load_workload",
    "main_replay",
    "remap_workload",
    "replay",
    "simulate",
    "uniform_workload",
]

DEFAULT_CAPACITIES = (0.05, 0.1, 0.2, 0.37, 0.5)
ALL_POLICIES = ("lru", "layer-lru", "layer-quota", "ucp", "lfu", "lru-2", "lrfu", "arc", "2q", "static-oracle",
                "static-calib",
                "static-layers", "prefill-updated", "belady", "lru-engine", "layer-lru-engine")
DEFAULT_POLICIES = ALL_POLICIES[:-2]  # the engine's own code paths (slow), equal to lru and layer-lru
NEVER = math.inf
NO_FILL = {"static-oracle", "static-calib", "static-layers", "prefill-updated"}  # policies that never admit a miss


# ---------------------------------------------------------------------- workload


@dataclass
class Access:
    """One MoE layer of one model step.

    Attributes:
        phase: ``"prefill"`` or ``"decode"``.
        step: global clock (increasing over the whole replay; the LRU clock of the engine's cache).
        layer: MoE-layer ordinal.
        ids: distinct flat ids ``layer * E + e``, ascending (the engine's ``torch.unique`` order).
        counts: tokens routed to each id (aligned with ``ids``).
        req_counts: prefill only: ``{request: {flat id: tokens}}``.
        predicted: distinct flat ids predicted for this access before it ran (the trace's
            ``predicted`` rows, top ``k`` of each token), or ``None`` when the trace has none.
    """

    phase: str
    step: int
    layer: int
    ids: list[int]
    counts: list[int]
    req_counts: dict[str, Counter] | None = None
    predicted: list[int] | None = None


@dataclass
class Workload:
    """A trace turned into accesses, in replay order.

    Attributes:
        accesses: in time order.
        num_layers, num_experts, top_k: ``L``, ``E``, ``k`` (from a header, else inferred).
        decode_tokens / prefill_tokens: distinct (request, position) pairs per phase.
        requests: distinct requests.
        expert_bytes: bytes of one expert from a trace header, else ``None``.
        sources: trace files.
    """

    accesses: list[Access]
    num_layers: int
    num_experts: int
    top_k: int
    decode_tokens: int
    prefill_tokens: int
    requests: int
    expert_bytes: int | None = None
    sources: list[str] = field(default_factory=list)
    _next_use: list[list[float]] | None = field(default=None, repr=False)

    @property
    def num_ids(self) -> int:
        return self.num_layers * self.num_experts

    def next_use(self) -> list[list[float]]:
        """``[access][j]``: index of the next access of ``accesses[a].ids[j]`` after ``a`` (``inf``: none)."""
        if self._next_use is None:
            last: dict[int, float] = {}
            out: list[list[float]] = [[]] * len(self.accesses)
            for a in range(len(self.accesses) - 1, -1, -1):
                ids = self.accesses[a].ids
                out[a] = [last.get(f, NEVER) for f in ids]
                for f in ids:
                    last[f] = a
            self._next_use = out
        return self._next_use

    def frequencies(self, phase: str | None = "decode") -> Counter:
        """Tokens routed to each flat id in accesses of ``phase`` (all phases if ``None`` or if none)."""
        acc = [a for a in self.accesses if phase is None or a.phase == phase] or self.accesses
        c: Counter = Counter()
        for a in acc:
            for f, n in zip(a.ids, a.counts):
                c[f] += n
        return c


def _make_access(phase: str, step: int, layer: int, recs: list[RouteRecord], E: int, k: int) -> Access:
    cnt: Counter = Counter()
    per_req: dict[str, Counter] | None = {} if phase == "prefill" else None
    pred = None
    for r in recs:
        if r.predicted is not None:
            pred = pred if pred is not None else set()
            pred.update(layer * E + e for row in r.predicted for e in row[:k])
        rc = per_req.setdefault(r.request, Counter()) if per_req is not None else None
        for row in r.experts:
            for e in row:
                f = layer * E + e
                cnt[f] += 1
                if rc is not None:
                    rc[f] += 1
    ids = sorted(cnt)
    return Access(phase, step, layer, ids, [cnt[f] for f in ids], per_req, None if pred is None else sorted(pred))


def build_workload(records: list[RouteRecord], info: TraceInfo | None = None, prefill_tokens: int = 0) -> Workload:
    """Order ``records`` into accesses (see the module docstring).

    Records with a ``step`` (edgemoe traces) are grouped by (segment, step, layer) in that order;
    records without one (Mixtral-style) by request (first appearance), then token position, then layer,
    each token one decode step. ``prefill_tokens > 0`` turns the first ``prefill_tokens`` positions of
    every request *of a trace without prefill records* into one prefill step (a pseudo prompt).

    Raises:
        ValueError: no records, or an expert/layer index outside the header's geometry.
    """
    if not records:
        raise ValueError("no routing records in the trace(s)")
    info = info or TraceInfo()
    E = info.get("num_experts") or 1 + max(e for r in records for row in r.experts for e in row)
    L = info.get("num_moe_layers") or 1 + max(r.layer for r in records)
    k = info.get("top_k") or max(len(row) for r in records for row in r.experts)
    for r in records:
        if r.layer >= L or any(e >= E or e < 0 for row in r.experts for e in row):
            raise ValueError(f"{r.source}: layer {r.layer} / experts {r.experts[:2]} outside {L} layers x {E} experts")

    segments: dict[tuple[str, int], list[RouteRecord]] = {}
    for r in records:
        segments.setdefault((r.source, r.segment), []).append(r)
    accesses: list[Access] = []
    clock = 0
    tokens = {"prefill": set(), "decode": set()}
    for recs in segments.values():
        stepped = [r for r in recs if r.step is not None]
        plain = [r for r in recs if r.step is None]
        if stepped:
            steps: dict[int, dict[int, list[RouteRecord]]] = {}
            phase_of: dict[int, str] = {}
            for r in stepped:
                steps.setdefault(r.step, {}).setdefault(r.layer, []).append(r)
                phase_of.setdefault(r.step, r.phase)
                tokens[r.phase].update((r.request, p) for p in r.positions)
            for s in sorted(steps):
                clock += 1
                for layer in sorted(steps[s]):
                    accesses.append(_make_access(phase_of[s], clock, layer, steps[s][layer], E, k))
        if plain:
            by_req: dict[str, dict[int, dict[int, RouteRecord]]] = {}
            for r in plain:
                by_pos = by_req.setdefault(r.request, {})
                for i, p in enumerate(r.positions):
                    one = RouteRecord(r.source, r.segment, r.request, r.phase, None, r.layer, [p], [r.experts[i]], None)
                    by_pos.setdefault(p, {})[r.layer] = one
            for req, by_pos in by_req.items():
                order = sorted(by_pos)
                pre, dec = order[:prefill_tokens], order[prefill_tokens:]
                if pre:
                    clock += 1
                    layers: dict[int, list[RouteRecord]] = {}
                    for p in pre:
                        for layer, r in by_pos[p].items():
                            layers.setdefault(layer, []).append(r)
                        tokens["prefill"].add((req, p))
                    for layer in sorted(layers):
                        accesses.append(_make_access("prefill", clock, layer, layers[layer], E, k))
                for p in dec:
                    clock += 1
                    tokens["decode"].add((req, p))
                    for layer in sorted(by_pos[p]):
                        accesses.append(_make_access("decode", clock, layer, [by_pos[p][layer]], E, k))
    requests = len({r.request for r in records})
    return Workload(accesses, int(L), int(E), int(k), len(tokens["decode"]), len(tokens["prefill"]), requests,
                    info.get("expert_bytes"), list(dict.fromkeys(r.source for r in records)))


def load_workload(paths: list[str | Path], prefill_tokens: int = 0) -> Workload:
    """:func:`read_traces` + :func:`build_workload`."""
    records, info = read_traces(paths)
    return build_workload(records, info, prefill_tokens)


def uniform_workload(num_layers: int, num_experts: int, top_k: int, tokens: int, requests: int = 1,
                     seed: int = 0) -> Workload:
    """A decode-only workload without locality: every token draws ``top_k`` distinct experts uniformly
    in every layer (the decode benchmark's ``--routing uniform``), ``tokens`` per request.

    Raises:
        ValueError: ``top_k`` outside ``1 .. num_experts`` or a non-positive size.
    """
    if not 1 <= top_k <= num_experts or min(num_layers, tokens, requests) < 1:
        raise ValueError(f"bad geometry {num_layers} x {num_experts}, top-{top_k}, {tokens} tokens x {requests}")
    rng = random.Random(seed)
    recs = [RouteRecord("uniform", 0, f"u{r}", "decode", r * tokens + t + 1, layer, [t],
                        [rng.sample(range(num_experts), top_k)], None)
            for r in range(requests) for t in range(tokens) for layer in range(num_layers)]
    info = TraceInfo([{"num_moe_layers": num_layers, "num_experts": num_experts, "top_k": top_k}])
    return build_workload(recs, info)


def remap_workload(wl: Workload, num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> Workload:
    """``wl``'s routing on another geometry, keeping its temporal structure: target layer ``j`` replays
    source layer ``j mod L_src``; each source expert ``e`` stands for ``top_k / k_src`` experts of block
    ``e`` (``num_experts / E_src`` experts wide), a fixed random choice per (target layer, source
    expert). E.g. Mixtral (32 x 8, top-2) on Qwen3-30B-A3B (48 x 128, top-8): each routed Mixtral expert
    becomes 4 of a block of 16, so a layer uses 32 of its 128 experts. Token counts per expert are
    kept; ``predicted`` rows are dropped.

    Raises:
        ValueError: ``num_experts`` not a multiple of the source's, or ``top_k`` not of its ``k``.
    """
    Es, ks, Ls = wl.num_experts, wl.top_k, wl.num_layers
    if num_experts % Es or top_k % ks or top_k // ks > num_experts // Es:
        raise ValueError(f"cannot map {Ls} x {Es} top-{ks} onto {num_layers} x {num_experts} top-{top_k}")
    B, r = num_experts // Es, top_k // ks
    rng = random.Random(seed)
    pick = [[rng.sample(range(B), r) for _ in range(Es)] for _ in range(num_layers)]
    by_step: dict[int, dict[int, Access]] = {}
    for a in wl.accesses:
        by_step.setdefault(a.step, {})[a.layer] = a
    out: list[Access] = []
    for step in sorted(by_step):
        src = by_step[step]
        for j in range(num_layers):
            a = src.get(j % Ls)
            if a is None:
                continue
            cnt: Counter = Counter()
            for f, n in zip(a.ids, a.counts):
                e = f - a.layer * Es
                for o in pick[j][e]:
                    cnt[j * num_experts + e * B + o] += n
            ids = sorted(cnt)
            out.append(Access(a.phase, step, j, ids, [cnt[f] for f in ids]))
    return Workload(out, num_layers, num_experts, top_k, wl.decode_tokens, wl.prefill_tokens, wl.requests,
                    None, list(wl.sources))


# ---------------------------------------------------------------------- policies


class Policy:
    """A cache of ``slots`` (layer, expert) slots; ``access(a, i, q) -> (hits, misses)`` for access ``i``.

    ``q``: the miss policy, ``q(m)`` = how many of the access's ``m`` misses may fill (``None``: every
    one that finds a victim, the ``fill-all`` semantic of the miss-rate curves); the step-time
    simulation (:mod:`edgemoe.bench.steptime`) passes the engine's ``ExpertPolicy.num_fills``. After an
    access, ``fills`` holds how many misses it filled. ``tenure_net``/``tenures``: the net-reuse
    accounting of fills (:class:`ResidentPolicy`), ``None`` for a policy without it.
    """

    name = "base"
    admits = True

    def __init__(self, wl: Workload, slots: int):
        self.wl, self.slots = wl, int(slots)
        self.fills = 0
        self.reuse_net: list[int] | None = None
        self.fills_by_layer: list[int] | None = None

    def access(self, a: Access, i: int, q: Callable[[int], int] | None = None) -> tuple[int, int]:
        raise NotImplementedError

    def free_slots(self, layer: int) -> int:
        """Slots a miss of MoE layer ``layer`` can fill without evicting anything."""
        raise NotImplementedError


class GlobalLRU(Policy):
    """The engine's LRU: :func:`edgemoe.experts.hybrid.plan_step` (the very control the engine runs each
    MoE layer step) over the engine's :class:`ExpertCache`, without data; global (``lru-engine``) or
    per layer (``layer-lru-engine``, the cache's ``partition_layers``). Slow (torch ops per access);
    :class:`SlotLRU` is the global one's pure-Python twin (equal counts, tested), :class:`LayerLRU`
    the per-layer one's (equal counts on decode-only traces, tested)."""

    def __init__(self, wl: Workload, slots: int, partition_layers: bool = False):
        super().__init__(wl, slots)
        self.name = "layer-lru-engine" if partition_layers else "lru-engine"
        self.cache = ExpertCache(self.slots, wl.num_ids, None, torch.float32, torch.device("cpu"),
                                 num_experts=wl.num_experts, partition_layers=partition_layers)

    def access(self, a: Access, i: int, q: Callable[[int], int] | None = None) -> tuple[int, int]:
        phase = Phase.PREFILL if a.phase == "prefill" else Phase.DECODE
        counters = self.cache.counters[phase.value]
        before = counters.fills
        plan = plan_step(self.cache, FillAllPolicy() if q is None else _Fills(q), dict(zip(a.ids, a.counts)), phase,
                         a.step)
        self.fills = counters.fills - before
        return len(plan.hits), len(a.ids) - len(plan.hits)


class _Fills(FillAllPolicy):
    """An ``ExpertPolicy`` whose ``num_fills`` is a given ``q(m)`` (drives :class:`GlobalLRU`)."""

    def __init__(self, q: Callable[[int], int]):
        self.q = q

    def num_fills(self, m: int, layer: int = 0) -> int:
        return self.q(m)


class ResidentPolicy(Policy):
    """Shared miss loop for the pure-Python policies (see the module docstring for the rule), with the
    net-reuse accounting of fills (:class:`edgemoe.experts.policy.LayerObservation`).

    Reuse accounting, as the engine's cache counts it (:class:`edgemoe.experts.cache.ExpertCache`, whose module
    docstring gives the reasons): a fill that displaces a resident remembers the id it displaced (its *ghost*);
    the pair is live while the filled id stays resident and no other fill displaces the ghost (it may be filled
    again itself). Each access of a resident id with a live ghost adds 1 to ``reuse_net[layer of the id]``; each
    access of a live ghost (resident again or not) subtracts 1 from ``reuse_net`` of the layer whose fill
    displaced it; ``fills_by_layer`` counts the fills that displaced a resident. Pairs form at every fill
    (prefill and prefetch ones too, as the engine's :meth:`~edgemoe.experts.cache.ExpertCache.admit` does), but
    only decode accesses and their own fills are counted, as the engine counts in ``plan_step``'s decode steps
    only. Over a window, ``reuse_net / fills`` is the hits such a fill buys net of the requests the displaced
    expert would have met (zero in expectation when routing has no locality).
    """

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.res: set[int] = set()
        self.ghost_of: dict[int, int] = {}  # displaced id -> the resident id whose fill displaced it
        self.ghost_by: dict[int, int] = {}  # resident id -> the id its fill displaced
        self.reuse_net = [0] * wl.num_layers
        self.fills_by_layer = [0] * wl.num_layers

    def access(self, a: Access, i: int, q: Callable[[int], int] | None = None) -> tuple[int, int]:
        res = self.res
        hits = [f for f in a.ids if f in res]
        n_miss = len(a.ids) - len(hits)
        E, net = self.wl.num_experts, self.reuse_net
        if self.ghost_of and a.phase == "decode":
            for f in hits:
                g = self.ghost_by.get(f)
                if g is not None and self.ghost_of.get(g) == f:
                    net[f // E] += 1
            for f in a.ids:
                g = self.ghost_of.get(f)
                if g is not None:
                    net[g // E] -= 1
        self.on_access(a, i, hits)
        self.fills = 0
        if n_miss and self.admits:
            misses = sorted((self.miss_key(f, n, a, i, j), f) for j, (f, n) in enumerate(zip(a.ids, a.counts))
                            if f not in res)
            self.fills = self._fill([f for _, f in misses], set(a.ids), a, i, None if q is None else q(n_miss))
        self.end_access(a, i)
        return len(hits), n_miss

    def prefetch(self, a: Access, ids: list[int], protected: set[int], i: int) -> int:
        """Fill ``ids`` (not resident; in this order) ahead of access ``a`` without evicting ``protected``
        (a next-layer prefetch; not counted as requests); the resident ones are refreshed first
        (:meth:`refresh`), as the engine's prefetch refreshes the recency of predicted experts it finds.
        Returns the number filled."""
        self.refresh(a, i, [f for f in ids if f in self.res])
        return self._fill([f for f in ids if f not in self.res], protected, a, i, None, prefill=False, count=False)

    def refresh(self, a: Access, i: int, ids: list[int]) -> None:
        """Resident ``ids`` were predicted (not requested) at access ``a``: a recency rule refreshes them, as
        the engine's cache does; nothing by default (a prediction is no request to count)."""

    def _fill(self, misses: list[int], group: set[int], a: Access, i: int, limit: int | None,
              prefill: bool | None = None, count: bool = True) -> int:
        count = count and a.phase == "decode"  # the fills the engine's reuse accounting counts
        prefill = a.phase == "prefill" if prefill is None else prefill
        filled = 0
        for f in misses:
            if limit is not None and filled >= limit:
                break
            self.prepare(f, a, i)
            v = -1
            if not self.has_room(f):
                v = self.victim(f, group, a, i)
                if v is None and prefill:
                    v = self.victim(f, None, a, i)
                if v is None:
                    continue
                g = self.ghost_by.pop(v, None)
                if g is not None and self.ghost_of.get(g) == v:
                    del self.ghost_of[g]
                self.evict(v)
            self.admit(f, a, i)
            if v >= 0:
                self.ghost_of[v], self.ghost_by[f] = f, v
                if count:
                    self.fills_by_layer[f // self.wl.num_experts] += 1
            filled += 1
        return filled

    def miss_key(self, f: int, n: int, a: Access, i: int, j: int):
        """Order in which an access's misses are filled: most-routed first, then the smaller id (the
        engine's order)."""
        return -n

    def prepare(self, f: int, a: Access, i: int) -> None:
        """Called before miss ``f`` looks for room (ARC adapts its target here)."""

    def has_room(self, f: int) -> bool:
        return len(self.res) < self.slots

    def free_slots(self, layer: int) -> int:
        return self.slots - len(self.res)

    def on_access(self, a: Access, i: int, hits: list[int]) -> None:
        pass

    def victim(self, f: int, protected: set[int] | None, a: Access, i: int) -> int | None:
        raise NotImplementedError

    def evict(self, v: int) -> None:
        self.res.discard(v)

    def admit(self, f: int, a: Access, i: int) -> None:
        self.res.add(f)

    def end_access(self, a: Access, i: int) -> None:
        pass


class _KeyHeap:
    """Residents keyed for eviction (smallest key first), a heap with lazy invalidation: an entry is
    live while ``key[f]`` still equals it and ``f`` is resident."""

    def __init__(self):
        self.heap: list = []
        self.key: dict[int, tuple] = {}

    def push(self, f: int, key: tuple) -> None:
        self.key[f] = key
        heapq.heappush(self.heap, (key, f))

    def drop(self, f: int) -> None:
        self.key.pop(f, None)

    def pop_min(self, res: set[int], protected: set[int] | None) -> int | None:
        stash, found = [], None
        while self.heap:
            key, f = heapq.heappop(self.heap)
            if f not in res or self.key.get(f) != key:
                continue  # stale
            if protected is not None and f in protected:
                stash.append((key, f))
                continue
            found = f
            del self.key[f]
            break
        for e in stash:
            heapq.heappush(self.heap, e)
        return found


class SlotLRU(ResidentPolicy):
    """Global LRU exactly as the engine's :class:`ExpertCache` keeps it: slots indexed ``0 .. S-1``, the
    model step as the clock (every layer of a step has the same age), victims in ``(last_used, slot)``
    order with free slots first. Pure Python; counts equal :class:`GlobalLRU`'s (tested)."""

    name = "lru"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.slot_of: dict[int, int] = {}
        self.free = list(range(self.slots))  # a heap: the smallest free slot first
        self.lru: list[tuple[int, int]] = []  # heap of (last_used, slot), lazily invalidated
        self.last = [-1] * self.slots
        self.owner = [-1] * self.slots
        self._slot = -1

    def has_room(self, f: int) -> bool:
        return bool(self.free)

    def on_access(self, a, i, hits):
        for f in hits:
            s = self.slot_of[f]
            self.last[s] = a.step
            heapq.heappush(self.lru, (a.step, s))

    refresh = on_access

    def victim(self, f, protected, a, i):
        stash, found = [], None
        while self.lru:
            t, s = heapq.heappop(self.lru)
            if self.owner[s] < 0 or self.last[s] != t:
                continue
            if protected is not None and self.owner[s] in protected:
                stash.append((t, s))
                continue
            found = s
            break
        for e in stash:
            heapq.heappush(self.lru, e)
        if found is None:
            return None
        self._slot = found
        return self.owner[found]

    def evict(self, v):
        super().evict(v)
        self.owner[self.slot_of.pop(v)] = -1

    def admit(self, f, a, i):
        super().admit(f, a, i)
        s = self._slot if self._slot >= 0 else heapq.heappop(self.free)
        self._slot = -1
        self.slot_of[f], self.owner[s], self.last[s] = s, f, a.step
        heapq.heappush(self.lru, (a.step, s))


class LayerLRU(ResidentPolicy):
    """One LRU per MoE layer over an equal share of the slots."""

    name = "layer-lru"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        L = wl.num_layers
        self.cap = [slots // L + (1 if l < slots % L else 0) for l in range(L)]
        self.lru: list[OrderedDict] = [OrderedDict() for _ in range(L)]
        self.E = wl.num_experts

    def has_room(self, f: int) -> bool:
        l = f // self.E
        return len(self.lru[l]) < self.cap[l]

    def free_slots(self, layer: int) -> int:
        return self.cap[layer] - len(self.lru[layer])

    def on_access(self, a, i, hits):
        od = self.lru[a.layer]
        for f in hits:
            od.move_to_end(f)

    refresh = on_access

    def victim(self, f, protected, a, i):
        for v in self.lru[f // self.E]:
            if protected is None or v not in protected:
                return v
        return None

    def evict(self, v):
        super().evict(v)
        del self.lru[v // self.E][v]

    def admit(self, f, a, i):
        super().admit(f, a, i)
        self.lru[f // self.E][f] = True


class LFU(ResidentPolicy):
    """Global LFU with history (counts survive eviction); ties evict the least recently used."""

    name = "lfu"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.freq: Counter = Counter()
        self.last: dict[int, int] = {}
        self.keys = _KeyHeap()

    def on_access(self, a, i, hits):
        for f in a.ids:
            self.freq[f] += 1
            self.last[f] = i
        for f in hits:
            self.keys.push(f, (self.freq[f], self.last[f]))

    def victim(self, f, protected, a, i):
        return self.keys.pop_min(self.res, protected)

    def admit(self, f, a, i):
        super().admit(f, a, i)
        self.keys.push(f, (self.freq[f], self.last[f]))


class LRU2(ResidentPolicy):
    """LRU-K with K = 2 (O'Neil, O'Neil and Weikum, SIGMOD 1993): evict the resident whose second most
    recent access is oldest (ids accessed once first), ties to the older last access. Access history
    is kept for every id (evicted ones too); the clock is the model step, as the engine's."""

    name = "lru-2"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.hist: dict[int, tuple[int, int]] = {}  # id -> (second most recent, most recent) step
        self.keys = _KeyHeap()

    def on_access(self, a, i, hits):
        for f in a.ids:
            self.hist[f] = (self.hist.get(f, (-1, -1))[1], a.step)
        for f in hits:
            self.keys.push(f, (*self.hist[f], f))

    def victim(self, f, protected, a, i):
        return self.keys.pop_min(self.res, protected)

    def admit(self, f, a, i):
        super().admit(f, a, i)
        self.keys.push(f, (*self.hist[f], f))


class LRFU(ResidentPolicy):
    """LRFU (Lee et al., IEEE Trans. Computers 50(12), 2001): each id's combined recency and frequency
    ``CRF(t) = Σ_i 2^(−λ(t − t_i))`` over its past accesses ``t_i`` (model steps); evict the smallest.
    ``λ → 0`` is LFU, ``λ = 1`` close to LRU. ``CRF`` decays by the same factor for every id, so the
    order is kept by the time-invariant key ``log2 CRF(t_last) + λ·t_last``. History is kept for every id."""

    name = "lrfu"

    def __init__(self, wl: Workload, slots: int, lam: float = 0.1):
        super().__init__(wl, slots)
        self.lam = float(lam)
        self.crf: dict[int, tuple[float, int]] = {}  # id -> (CRF at its last access, last access step)
        self.keys = _KeyHeap()

    def _key(self, f: int) -> tuple:
        c, t = self.crf[f]
        return (math.log2(c) + self.lam * t, f)

    def on_access(self, a, i, hits):
        for f in a.ids:
            c, t = self.crf.get(f, (0.0, a.step))
            self.crf[f] = (1.0 + c * 2.0 ** (-self.lam * (a.step - t)), a.step)
        for f in hits:
            self.keys.push(f, self._key(f))

    def victim(self, f, protected, a, i):
        return self.keys.pop_min(self.res, protected)

    def admit(self, f, a, i):
        super().admit(f, a, i)
        self.keys.push(f, self._key(f))


class ARC(ResidentPolicy):
    """ARC (Megiddo and Modha, FAST 2003): LRU lists T1 (seen once recently) and T2 (seen at least twice)
    of residents, ghost lists B1/B2 of their recent evictions, and a target size ``p`` of T1 that a
    ghost hit in B1 raises and one in B2 lowers. Victims skip the ids the access needs (from the other
    list when the chosen one has none)."""

    name = "arc"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()
        self.p = 0.0
        self._ghost = True

    def on_access(self, a, i, hits):
        for f in hits:
            self.t1.pop(f, None)
            self.t2.pop(f, None)
            self.t2[f] = True

    def prepare(self, f, a, i):
        c = self.slots
        self._ghost = True
        if f in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
        elif f in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
        elif len(self.t1) + len(self.b1) >= c:
            if len(self.t1) < c and self.b1:
                self.b1.popitem(last=False)
            else:
                self._ghost = False  # T1 alone fills the cache: its LRU is dropped without a ghost
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
            self.b2.popitem(last=False)

    def victim(self, f, protected, a, i):
        t1_first = bool(self.t1) and (len(self.t1) > self.p or (f in self.b2 and len(self.t1) == self.p))
        for od in ((self.t1, self.t2) if t1_first else (self.t2, self.t1)):
            for v in od:
                if protected is None or v not in protected:
                    return v
        return None

    def evict(self, v):
        super().evict(v)
        if v in self.t1:
            del self.t1[v]
            if self._ghost:
                self.b1[v] = True
        else:
            del self.t2[v]
            self.b2[v] = True
        c = self.slots
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def admit(self, f, a, i):
        super().admit(f, a, i)
        if f in self.b1 or f in self.b2:
            self.b1.pop(f, None)
            self.b2.pop(f, None)
            self.t2[f] = True
        else:
            self.t1[f] = True


class TwoQ(ResidentPolicy):
    """2Q (Johnson and Shasha, VLDB 1994), full version: first-time ids enter a FIFO ``A1in`` (25 % of
    the slots); ids evicted from it are remembered in a ghost FIFO ``A1out`` (50 %); a miss found in
    ``A1out`` goes to the LRU ``Am``. Victims: the oldest of ``A1in`` while it exceeds its share,
    else the LRU of ``Am``."""

    name = "2q"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.kin, self.kout = max(1, slots // 4), max(1, slots // 2)
        self.a1in, self.a1out, self.am = OrderedDict(), OrderedDict(), OrderedDict()

    def on_access(self, a, i, hits):
        for f in hits:
            if f in self.am:
                self.am.move_to_end(f)

    def victim(self, f, protected, a, i):
        order = (self.a1in, self.am) if len(self.a1in) > self.kin or not self.am else (self.am, self.a1in)
        for od in order:
            for v in od:
                if protected is None or v not in protected:
                    return v
        return None

    def evict(self, v):
        super().evict(v)
        if v in self.a1in:
            del self.a1in[v]
            self.a1out[v] = True
            if len(self.a1out) > self.kout:
                self.a1out.popitem(last=False)
        else:
            del self.am[v]

    def admit(self, f, a, i):
        super().admit(f, a, i)
        if f in self.a1out:
            del self.a1out[f]
            self.am[f] = True
        else:
            self.a1in[f] = True


class QuotaLRU(ResidentPolicy):
    """LRU within each MoE layer under per-layer slot quotas (soft): a miss takes a free slot if there
    is one (any layer's); else a layer under its quota evicts the least recently used id among the
    layers over theirs (oldest first across them, the model step as the clock), and a layer at its
    quota evicts its own least recently used id. Quotas are equal (``layer-quota``) or chosen by
    utility (``ucp``: utility-based cache partitioning, Qureshi and Patt, MICRO 2006): each layer keeps
    a shadow LRU stack of its experts and counts hits at every stack depth (the hits an LRU of that
    many slots would get); every ``epoch`` decode steps the slots are re-divided by the lookahead
    algorithm (repeatedly give the layer with the best hits per slot its best run of slots) and the
    depth counts halve. Until the first epoch the quotas are equal."""

    def __init__(self, wl: Workload, slots: int, utility: bool = False, epoch: int = 32):
        super().__init__(wl, slots)
        L, E = wl.num_layers, wl.num_experts
        self.name = "ucp" if utility else "layer-quota"
        self.E, self.epoch, self.utility = E, int(epoch), utility
        self.quota = [slots // L + (1 if l < slots % L else 0) for l in range(L)]
        self.lru: list[OrderedDict] = [OrderedDict() for _ in range(L)]  # id -> last use step, oldest first
        self.stack: list[list[int]] = [[] for _ in range(L)]  # shadow LRU stack, most recent first
        self.depth_hits = [[0.0] * E for _ in range(L)]
        self._steps, self._last_step = 0, None

    def on_access(self, a, i, hits):
        od = self.lru[a.layer]
        for f in hits:
            od.move_to_end(f)
            od[f] = a.step
        if not self.utility:
            return
        st, dh = self.stack[a.layer], self.depth_hits[a.layer]
        pos = {f: st.index(f) for f in a.ids if f in st}  # depths before this access (its ids are needed at once)
        for d in pos.values():
            dh[d] += 1
        self.stack[a.layer] = list(a.ids) + [f for f in st if f not in pos]
        if a.phase == "decode" and a.step != self._last_step:
            self._last_step = a.step
            self._steps += 1
            if self._steps % self.epoch == 0:
                self._repartition()

    def _repartition(self) -> None:
        L, E = len(self.quota), self.E
        util = [[0.0] + list(itertools.accumulate(dh)) for dh in self.depth_hits]  # [L][E + 1]
        alloc, left = [0] * L, min(self.slots, L * E)
        while left > 0:
            best = None
            for l in range(L):
                a, u = alloc[l], util[l]
                for n in range(1, min(left, E - a) + 1):
                    mu = (u[a + n] - u[a]) / n
                    if best is None or mu > best[0]:
                        best = (mu, l, n)
            if best is None:
                break
            _, l, n = best
            alloc[l] += n
            left -= n
        self.quota = alloc
        self.depth_hits = [[h / 2 for h in dh] for dh in self.depth_hits]

    def free_slots(self, layer: int) -> int:
        return self.slots - len(self.res)

    def victim(self, f, protected, a, i):
        l = f // self.E
        if len(self.lru[l]) >= self.quota[l]:
            layers = [l]
        else:
            layers = [j for j, (od, q) in enumerate(zip(self.lru, self.quota)) if len(od) > q] or [l]
        best = None
        for j in layers:
            for v, t in self.lru[j].items():
                if protected is None or v not in protected:
                    if best is None or t < best[0]:
                        best = (t, v)
                    break
        return None if best is None else best[1]

    def evict(self, v):
        super().evict(v)
        del self.lru[v // self.E][v]

    def admit(self, f, a, i):
        super().admit(f, a, i)
        self.lru[f // self.E][f] = a.step


class StaticPlacement(ResidentPolicy):
    """A fixed placement (pre-loaded for free, never changed); misses run on the CPU."""

    admits = False

    def __init__(self, wl: Workload, slots: int, ids: list[int], name: str):
        super().__init__(wl, slots)
        self.res = set(ids[:slots])
        self.name = name


def top_ids(freq: Counter, n: int) -> list[int]:
    """The ``n`` most frequent ids (ties: smaller id first)."""
    return [f for f, _ in sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


class PrefillUpdated(ResidentPolicy):
    """KTransformers-style: the placement is recomputed from each prompt's prefill routing."""

    name = "prefill-updated"
    admits = False

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.prompt: dict[str, Counter] = {}
        self.order: list[int] = []  # current placement, hottest first

    def end_access(self, a, i):
        if a.phase != "prefill" or not a.req_counts or self.slots == 0:
            return
        tot: Counter = Counter()
        for req, c in a.req_counts.items():
            self.prompt.setdefault(req, Counter()).update(c)
            tot.update(self.prompt[req])
        hot = top_ids(tot, self.slots)
        keep = set(hot)
        self.order = hot + [f for f in self.order if f not in keep][: self.slots - len(hot)]
        self.res = set(self.order)


class Belady(ResidentPolicy):
    """Belady's MIN, global over all layers: the victim is the resident id (not needed by this access)
    whose next use is farthest. A prefill access needing more ids than the cache holds leaves the
    cache holding the ``S`` ids of (residents ∪ the access's ids) with the nearest next use."""

    name = "belady"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.nxt = wl.next_use()
        self.cur: dict[int, float] = {}  # resident id -> its next use (== i while needed by access i)
        self.heap: list[tuple[float, int]] = []  # (-next use, id), lazily invalidated

    def access(self, a: Access, i: int, q: Callable[[int], int] | None = None) -> tuple[int, int]:
        res = self.res
        n_hits = sum(1 for f in a.ids if f in res)
        if a.phase == "prefill" and q is None and len(res | set(a.ids)) > self.slots:
            pool = {f: nu for f, nu in self.cur.items() if f in res}
            pool.update(zip(a.ids, self.nxt[i]))
            keep = sorted(pool, key=lambda f: (pool[f], f))[: self.slots]
            self.res = set(keep)
            self.cur = {f: pool[f] for f in keep}
            self.heap = [(-pool[f], f) for f in keep]
            heapq.heapify(self.heap)
            self.fills = sum(1 for f in a.ids if f in self.res) - n_hits
            return n_hits, len(a.ids) - n_hits
        return super().access(a, i, q)

    def miss_key(self, f, n, a, i, j):
        return self.nxt[i][j]  # nearest next use first

    def victim(self, f, protected, a, i):
        while self.heap:
            nn, v = self.heap[0]
            if v not in self.res or self.cur.get(v) != -nn:
                heapq.heappop(self.heap)
                continue
            if -nn <= i:  # the farthest resident is needed now: nothing evictable
                return None
            heapq.heappop(self.heap)
            return v
        return None

    def evict(self, v):
        super().evict(v)
        self.cur.pop(v, None)

    def admit(self, f, a, i):
        super().admit(f, a, i)
        self.cur[f] = i

    def end_access(self, a, i):
        for f, nu in zip(a.ids, self.nxt[i]):
            if f in self.res:
                self.cur[f] = nu
                heapq.heappush(self.heap, (-nu, f))


def make_policy(name: str, wl: Workload, slots: int, calibration: Workload | None = None) -> Policy:
    """Build policy ``name`` (one of :data:`ALL_POLICIES`) for ``slots`` slots over ``wl``.

    Raises:
        ValueError: unknown name, or ``static-calib`` without a calibration workload of the same geometry.
    """
    simple = {"lru": SlotLRU, "lru-engine": GlobalLRU, "layer-lru": LayerLRU, "lfu": LFU, "lru-2": LRU2,
              "lrfu": LRFU, "arc": ARC, "2q": TwoQ}
    if name in simple:
        return simple[name](wl, slots)
    if name == "layer-lru-engine":
        return GlobalLRU(wl, slots, partition_layers=True)
    if name in ("layer-quota", "ucp"):
        return QuotaLRU(wl, slots, utility=name == "ucp")
    if name == "static-oracle":
        return StaticPlacement(wl, slots, top_ids(wl.frequencies("decode"), slots), name)
    if name == "static-calib":
        if calibration is None:
            raise ValueError("policy static-calib needs --calibration TRACE")
        if calibration.num_ids != wl.num_ids:
            raise ValueError(f"calibration trace has {calibration.num_layers}x{calibration.num_experts} ids, "
                             f"replayed trace {wl.num_layers}x{wl.num_experts}")
        return StaticPlacement(wl, slots, top_ids(calibration.frequencies("decode"), slots), name)
    if name == "static-layers":
        E = wl.num_experts
        ids = [l * E + e for l in range(wl.num_layers - 1, -1, -1) for e in range(E)]
        return StaticPlacement(wl, slots, ids, name)
    if name == "prefill-updated":
        return PrefillUpdated(wl, slots)
    if name == "belady":
        return Belady(wl, slots)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(ALL_POLICIES)}")


# ---------------------------------------------------------------------- simulation


@dataclass
class ReplayResult:
    """Counts of one (policy, slots) replay.

    Attributes:
        policy, slots: what ran; ``capacity``: ``slots / N``.
        decode_hits / decode_misses: ``[L]`` per MoE layer (decode accesses only).
        prefill_hits / prefill_misses: totals over prefill accesses.
        decode_tokens: decode tokens of the workload (for per-token figures).
    """

    policy: str
    slots: int
    capacity: float
    decode_hits: list[int]
    decode_misses: list[int]
    prefill_hits: int
    prefill_misses: int
    decode_tokens: int

    @property
    def hits(self) -> int:
        return sum(self.decode_hits)

    @property
    def misses(self) -> int:
        return sum(self.decode_misses)

    @property
    def miss_rate(self) -> float:
        """Decode misses / decode accesses (``nan`` without decode accesses)."""
        n = self.hits + self.misses
        return self.misses / n if n else math.nan

    def layer_hit_rates(self) -> list[float]:
        return [h / (h + m) if h + m else math.nan for h, m in zip(self.decode_hits, self.decode_misses)]

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.decode_tokens if self.decode_tokens else math.nan

    def bytes_per_token(self, expert_bytes: int | None) -> float | None:
        """Bytes crossing PCIe per decode token (``misses × expert_bytes / tokens``); ``None`` if unknown."""
        return None if not expert_bytes else self.misses_per_token * expert_bytes

    def as_dict(self, expert_bytes: int | None = None) -> dict:
        return {"policy": self.policy, "slots": self.slots, "capacity": self.capacity, "miss_rate": self.miss_rate,
                "decode_hits": self.hits, "decode_misses": self.misses, "prefill_hits": self.prefill_hits,
                "prefill_misses": self.prefill_misses, "misses_per_token": self.misses_per_token,
                "bytes_per_token": self.bytes_per_token(expert_bytes), "layer_hit_rate": self.layer_hit_rates()}


def simulate(wl: Workload, policy: str | Policy, slots: int | None = None, calibration: Workload | None = None,
             progress=None, prefetch: bool = False) -> ReplayResult:
    """Replay ``wl`` through one policy (a name plus ``slots``, or a built :class:`Policy`).

    ``progress``: optional tqdm bar, advanced by the number of accesses. ``prefetch``: next-layer
    prefetch (the engine's ``--prefetch next-layer``): before each decode access with ``predicted`` ids (but the
    first layer of a step), those not resident are filled without evicting the predicted ones that are, which are
    refreshed, as the engine's prefetch does (a policy that admits; the result is named ``<policy>+prefetch``).
    """
    pol = policy if isinstance(policy, Policy) else make_policy(policy, wl, int(slots), calibration)
    L = wl.num_layers
    dh, dm = [0] * L, [0] * L
    ph = pm = 0
    prev: Access | None = None
    for i, a in enumerate(wl.accesses):
        if (prefetch and a.phase == "decode" and a.predicted and isinstance(pol, ResidentPolicy) and pol.admits
                and prev is not None and prev.step == a.step):
            pol.prefetch(a, a.predicted, set(a.predicted), i)
        prev = a
        h, m = pol.access(a, i)
        if a.phase == "decode":
            dh[a.layer] += h
            dm[a.layer] += m
        else:
            ph += h
            pm += m
        if progress is not None and (i & 1023) == 1023:
            progress.update(1024)
    if progress is not None:
        progress.update(len(wl.accesses) & 1023)
    name = pol.name + ("+prefetch" if prefetch else "")
    return ReplayResult(name, pol.slots, pol.slots / wl.num_ids, dh, dm, ph, pm, wl.decode_tokens)


def slots_for(capacities: list[float], num_ids: int) -> list[int]:
    """Slots for capacity fractions: ``round(f * N)``, clamped to ``[0, N]``.

    Raises:
        ValueError: a fraction outside ``[0, 1]``.
    """
    out = []
    for f in capacities:
        if not 0 <= f <= 1:
            raise ValueError(f"capacity {f} is not a fraction in [0, 1] (use --capacity-slots for slot counts)")
        out.append(min(num_ids, round(f * num_ids)))
    return out


def replay(wl: Workload, policies: list[str], slots: list[int], calibration: Workload | None = None,
           progress: bool | None = None) -> list[ReplayResult]:
    """Every (policy, slots) pair, with one tqdm bar over all of them (``progress=None``: only on a TTY)."""
    from tqdm import tqdm

    with tqdm(total=len(wl.accesses) * len(policies) * len(slots), unit="access", desc="replay",
              disable=None if progress is None else not progress, leave=False) as bar:
        return [simulate(wl, p, s, calibration, bar) for p in policies for s in slots]


# ---------------------------------------------------------------------- report


def expert_bytes_from_config(model_dir: str | Path) -> int:
    """``3·H·I·dtype bytes`` of one routed expert from a model directory's ``config.json``.

    ``I`` is ``moe_intermediate_size`` (Qwen/DeepSeek) or ``intermediate_size`` (Mixtral); dtype from
    ``dtype``/``torch_dtype`` (default bfloat16).

    Raises:
        FileNotFoundError: no config.json. ValueError: missing sizes or an unknown dtype.
    """
    p = Path(model_dir)
    p = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise FileNotFoundError(f"{p}: no config.json")
    cfg = json.loads(p.read_text())
    cfg = {**cfg.get("text_config", {}), **cfg}
    H, I = cfg.get("hidden_size"), cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    if not H or not I:
        raise ValueError(f"{p}: needs hidden_size and moe_intermediate_size/intermediate_size")
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "bf16": 2, "fp16": 2, "fp32": 4}
    if name not in sizes:
        raise ValueError(f"{p}: unknown dtype {name!r}")
    return 3 * int(H) * int(I) * sizes[name]


def _fmt_bytes(b: float | None) -> str:
    if b is None or math.isnan(b):
        return "n/a"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def format_report(wl: Workload, results: list[ReplayResult], expert_bytes: int | None,
                  layer_slots: int | None = None) -> str:
    """Text tables: decode miss rate, misses and PCIe bytes per decode token, per-layer hit rate."""
    policies = list(dict.fromkeys(r.policy for r in results))
    slots = list(dict.fromkeys(r.slots for r in results))
    by = {(r.policy, r.slots): r for r in results}
    N = wl.num_ids
    head = (f"{', '.join(Path(s).name for s in wl.sources)}: {wl.requests} requests, {wl.decode_tokens} decode + "
            f"{wl.prefill_tokens} prefill tokens, {wl.num_layers} MoE layers x {wl.num_experts} experts "
            f"({N} ids), top-{wl.top_k}; expert = {_fmt_bytes(expert_bytes)}")
    cols = [f"{100 * s / N:.0f}% ({s})" for s in slots]
    pw = max(len(p) for p in policies + ["policy"])

    def table(title: str, cell) -> list[str]:
        cells = {p: [cell(by[p, s]) for s in slots] for p in policies}
        w = max(len(c) for c in cols + [c for row in cells.values() for c in row])
        lines = [title, f"{'policy':<{pw}}  " + "  ".join(f"{c:>{w}}" for c in cols)]
        for p in policies:
            lines.append(f"{p:<{pw}}  " + "  ".join(f"{c:>{w}}" for c in cells[p]))
        return lines + [""]

    out = [head, ""]
    out += table("decode miss rate (% of decode (layer, expert) accesses), by cache capacity (% of ids, slots)",
                 lambda r: "n/a" if math.isnan(r.miss_rate) else f"{100 * r.miss_rate:.1f}")
    out += table("expert misses per decode token", lambda r: f"{r.misses_per_token:.2f}")
    if expert_bytes:
        out += table(f"bytes over PCIe per decode token (misses x {_fmt_bytes(expert_bytes)})",
                     lambda r: _fmt_bytes(r.bytes_per_token(expert_bytes)) + ("*" if r.policy in NO_FILL else ""))
        if NO_FILL & set(policies):
            out[-1:-1] = ["* never fills: its misses run on the CPU, which reads these bytes from host DRAM instead"]
    else:
        out += ["bytes over PCIe per decode token: n/a (give --expert-bytes or --model DIR)", ""]
    ls = layer_slots if layer_slots in slots else slots[len(slots) // 2]
    out.append(f"decode hit rate per MoE layer (%) at {100 * ls / N:.0f}% ({ls} slots)")
    out.append(f"{'layer':>5}  " + "  ".join(f"{p:>{max(6, len(p))}}" for p in policies))
    rates = {p: by[p, ls].layer_hit_rates() for p in policies}
    for l in range(wl.num_layers):
        cells = ["  n/a" if math.isnan(rates[p][l]) else f"{100 * rates[p][l]:.1f}" for p in policies]
        out.append(f"{l:>5}  " + "  ".join(f"{c:>{max(6, len(p))}}" for c, p in zip(cells, policies)))
    return "\n".join(out)


def format_step_time(wl: Workload, slots: list[int], preset: str, eviction: str, prefetch: bool = False) -> str:
    """Text table of simulated decode tokens/s per miss policy and cache size on the machine model
    ``preset`` (:mod:`edgemoe.bench.steptime`), with ``auto``'s ratio to the best fixed policy (fill-all,
    cpu-all, static, qstar); ``prefetch`` adds rows with next-layer prefetch.

    Raises:
        ValueError: an unknown preset or eviction rule without a step-time model.
    """
    from edgemoe.bench.steptime import COST_PRESETS, MISS_POLICIES, simulate_time

    if preset not in COST_PRESETS:
        raise ValueError(f"unknown machine model {preset!r}; choose from {', '.join(COST_PRESETS)}")
    costs = COST_PRESETS[preset]
    runs = [(p, False) for p in MISS_POLICIES]
    if prefetch:
        runs += [(p, True) for p in ("fill-all", "qstar", "auto")]
    tps = {(p, f, s): simulate_time(wl, p, s, costs, eviction, prefetch=f).tokens_per_s for p, f in runs for s in slots}
    N = wl.num_ids
    cols = [f"{100 * s / N:.0f}% ({s})" for s in slots]
    w = max(10, *(len(c) for c in cols))
    lines = [f"simulated decode tokens/s on the {preset!r} machine model, eviction {eviction}",
             f"{'policy':<18}" + "".join(f"{c:>{w + 2}}" for c in cols)]
    for p, f in runs:
        lines.append(f"{p + ('+prefetch' if f else ''):<18}" + "".join(f"{tps[p, f, s]:>{w + 2}.1f}" for s in slots))
    best = [max(tps[p, False, s] for p in ("fill-all", "cpu-all", "static", "qstar")) for s in slots]
    lines.append(f"{'auto / best fixed':<18}" + "".join(f"{tps['auto', False, s] / b:>{w + 2}.3f}"
                                                        for s, b in zip(slots, best)))
    return "\n".join(lines)


STYLE = {"lru": dict(color="tab:red", linewidth=2.2), "layer-lru": dict(color="tab:orange"),
         "lfu": dict(color="tab:olive"), "static-oracle": dict(color="tab:green"),
         "static-calib": dict(color="tab:cyan"), "static-layers": dict(color="tab:brown"),
         "prefill-updated": dict(color="tab:purple"), "belady": dict(color="black", linestyle="--")}


def plot(wl: Workload, results: list[ReplayResult], path: str | Path, title: str | None = None,
         absolute: bool = False) -> Path:
    """PNG of decode miss rate (%) vs capacity (% of ids, or slots when ``absolute``), one line per policy.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    for p in dict.fromkeys(r.policy for r in results):
        rs = sorted((r for r in results if r.policy == p), key=lambda r: r.slots)
        xs = [r.slots if absolute else 100 * r.capacity for r in rs]
        ax.plot(xs, [100 * r.miss_rate for r in rs], marker="o", markersize=3.5, label=p, **STYLE.get(p, {}))
    ax.set_xlabel("expert cache (slots)" if absolute else "expert cache (% of all (layer, expert) ids)")
    ax.set_ylabel("decode miss rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(title or ", ".join(Path(s).stem for s in wl.sources), fontsize=9)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- replay-routing


def main_replay(args: Namespace) -> int:
    """Run ``replay-routing`` with the options ``edgemoe.cli`` parsed: print the tables, write the PNG
    (and JSON); returns the exit status.

    Raises:
        FileNotFoundError / ValueError (incl. ``TraceFormatError``): bad traces or options (the counts and
            ``--eviction`` without ``--step-time`` before any trace is read).
    """
    for flag, v, least in (("--prefill-tokens", args.prefill_tokens, 0), ("--expert-bytes", args.expert_bytes, 1),
                           ("--layer-table-slots", args.layer_table_slots, 0)):
        if v is not None and v < least:
            raise ValueError(f"{flag} must be >= {least}, got {v}")
    if args.eviction is not None and not args.step_time:
        raise ValueError("--eviction is the rule of the --step-time simulation: give --step-time too")
    wl = load_workload(args.traces, args.prefill_tokens)
    calib = load_workload(args.calibration) if args.calibration else None
    policies = args.policy or [p for p in DEFAULT_POLICIES if p != "static-calib" or calib is not None]
    if not args.policy and not wl.prefill_tokens:
        policies.remove("prefill-updated")
        print("note: prefill-updated skipped: the trace has no prefill records (see --prefill-tokens)", file=sys.stderr)
    for p in policies:
        if p not in ALL_POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose from {', '.join(ALL_POLICIES)}")
    if args.capacity_slots:
        if any(s < 0 for s in args.capacity_slots):
            raise ValueError("--capacity-slots must be >= 0")
        slots = [min(s, wl.num_ids) for s in args.capacity_slots]
    else:
        slots = slots_for(args.capacity, wl.num_ids)
    expert_bytes = args.expert_bytes or (expert_bytes_from_config(args.model) if args.model else wl.expert_bytes)
    results = replay(wl, policies, slots, calib)
    if args.prefetch:
        if not any(a.predicted for a in wl.accesses):
            raise ValueError("--prefetch needs traces recorded with predicted experts (benchmarks/policy_traces.py)")
        results += [simulate(wl, p, s, calib, prefetch=True) for p in policies if p not in NO_FILL
                    and p not in ("belady", "lru-engine", "layer-lru-engine") for s in slots]
    print(format_report(wl, results, expert_bytes, args.layer_table_slots))
    if args.step_time:
        print()
        print(format_step_time(wl, slots, args.step_time, args.eviction or "layer-lru", args.prefetch))
    if not args.no_plot:
        path = plot(wl, results, args.plot, args.title, absolute=bool(args.capacity_slots))
        print(f"\nplot: {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "traces": wl.sources, "num_layers": wl.num_layers, "num_experts": wl.num_experts, "top_k": wl.top_k,
            "decode_tokens": wl.decode_tokens, "prefill_tokens": wl.prefill_tokens, "requests": wl.requests,
            "expert_bytes": expert_bytes, "results": [r.as_dict(expert_bytes) for r in results]}, indent=1))
    return 0

