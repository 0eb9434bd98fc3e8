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
import json
import math
import sys
from collections import Counter, OrderedDict
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
    "ALL_POLICIES", "DEFAULT_CAPACITIES", "DEFAULT_POLICIES", "Access", "ReplayResult", "Workload",
    "build_workload", "expert_bytes_from_config", "load_workload", "main_replay", "replay", "simulate",
]

DEFAULT_CAPACITIES = (0.05, 0.1, 0.2, 0.37, 0.5)
ALL_POLICIES = ("lru", "layer-lru", "lfu", "static-oracle", "static-calib", "static-layers", "prefill-updated",
                "belady")
DEFAULT_POLICIES = ALL_POLICIES
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
    """

    phase: str
    step: int
    layer: int
    ids: list[int]
    counts: list[int]
    req_counts: dict[str, Counter] | None = None


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


def _make_access(phase: str, step: int, layer: int, recs: list[RouteRecord], E: int) -> Access:
    cnt: Counter = Counter()
    per_req: dict[str, Counter] | None = {} if phase == "prefill" else None
    for r in recs:
        rc = per_req.setdefault(r.request, Counter()) if per_req is not None else None
        for row in r.experts:
            for e in row:
                f = layer * E + e
                cnt[f] += 1
                if rc is not None:
                    rc[f] += 1
    ids = sorted(cnt)
    return Access(phase, step, layer, ids, [cnt[f] for f in ids], per_req)


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
                    accesses.append(_make_access(phase_of[s], clock, layer, steps[s][layer], E))
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
                        accesses.append(_make_access("prefill", clock, layer, layers[layer], E))
                for p in dec:
                    clock += 1
                    tokens["decode"].add((req, p))
                    for layer in sorted(by_pos[p]):
                        accesses.append(_make_access("decode", clock, layer, [by_pos[p][layer]], E))
    requests = len({r.request for r in records})
    return Workload(accesses, int(L), int(E), int(k), len(tokens["decode"]), len(tokens["prefill"]), requests,
                    info.get("expert_bytes"), list(dict.fromkeys(r.source for r in records)))


def load_workload(paths: list[str | Path], prefill_tokens: int = 0) -> Workload:
    """:func:`read_traces` + :func:`build_workload`."""
    records, info = read_traces(paths)
    return build_workload(records, info, prefill_tokens)


# ---------------------------------------------------------------------- policies


class Policy:
    """A cache of ``slots`` (layer, expert) slots; ``access(a, i) -> (hits, misses)`` for access ``i``."""

    name = "base"

    def __init__(self, wl: Workload, slots: int):
        self.wl, self.slots = wl, int(slots)

    def access(self, a: Access, i: int) -> tuple[int, int]:
        raise NotImplementedError


class GlobalLRU(Policy):
    """The engine's global LRU under ``fill-all``: :func:`edgemoe.experts.hybrid.plan_step` (the very
    control the engine runs each MoE layer step) over the engine's :class:`ExpertCache`, without data."""

    name = "lru"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.cache = ExpertCache(self.slots, wl.num_ids, None, torch.float32, torch.device("cpu"))
        self.policy = FillAllPolicy()

    def access(self, a: Access, i: int) -> tuple[int, int]:
        phase = Phase.PREFILL if a.phase == "prefill" else Phase.DECODE
        plan = plan_step(self.cache, self.policy, dict(zip(a.ids, a.counts)), phase, a.step)
        return len(plan.hits), len(a.ids) - len(plan.hits)


class _Resident(Policy):
    """Shared miss loop for the pure-Python policies (see the module docstring for the rule)."""

    admits = True

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.res: set[int] = set()

    def access(self, a: Access, i: int) -> tuple[int, int]:
        res = self.res
        hits = [f for f in a.ids if f in res]
        n_miss = len(a.ids) - len(hits)
        self.on_access(a, i, hits)
        if n_miss and self.admits:
            group = set(a.ids)
            misses = sorted((self.miss_key(f, n, a, i, j), f) for j, (f, n) in enumerate(zip(a.ids, a.counts))
                            if f not in res)
            for _, f in misses:
                if not self.has_room(f):
                    v = self.victim(f, group, a, i)
                    if v is None and a.phase == "prefill":
                        v = self.victim(f, None, a, i)
                    if v is None:
                        continue
                    self.evict(v)
                self.admit(f, a, i)
        self.end_access(a, i)
        return len(hits), n_miss

    def miss_key(self, f: int, n: int, a: Access, i: int, j: int):
        """Order in which an access's misses are filled: most-routed first (the engine's order)."""
        return -n

    def has_room(self, f: int) -> bool:
        return len(self.res) < self.slots

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


class LayerLRU(_Resident):
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

    def on_access(self, a, i, hits):
        od = self.lru[a.layer]
        for f in hits:
            od.move_to_end(f)

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


class LFU(_Resident):
    """Global LFU with history (counts survive eviction); ties evict the least recently used."""

    name = "lfu"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.freq: Counter = Counter()
        self.last: dict[int, int] = {}
        self.heap: list[tuple[int, int, int]] = []

    def _push(self, f: int) -> None:
        heapq.heappush(self.heap, (self.freq[f], self.last[f], f))

    def on_access(self, a, i, hits):
        for f in a.ids:
            self.freq[f] += 1
            self.last[f] = i
        for f in hits:
            self._push(f)

    def victim(self, f, protected, a, i):
        stash, found = [], None
        while self.heap:
            n, t, v = heapq.heappop(self.heap)
            if v not in self.res or (n, t) != (self.freq[v], self.last[v]):
                continue  # stale
            if protected is not None and v in protected:
                stash.append((n, t, v))
                continue
            found = v
            break
        for e in stash:
            heapq.heappush(self.heap, e)
        return found

    def admit(self, f, a, i):
        super().admit(f, a, i)
        self._push(f)


class StaticPlacement(_Resident):
    """A fixed placement (pre-loaded for free, never changed); misses run on the CPU."""

    admits = False

    def __init__(self, wl: Workload, slots: int, ids: list[int], name: str):
        super().__init__(wl, slots)
        self.res = set(ids[:slots])
        self.name = name


def top_ids(freq: Counter, n: int) -> list[int]:
    """The ``n`` most frequent ids (ties: smaller id first)."""
    return [f for f, _ in sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


class PrefillUpdated(_Resident):
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


class Belady(_Resident):
    """Belady's MIN, global over all layers: the victim is the resident id (not needed by this access)
    whose next use is farthest. A prefill access needing more ids than the cache holds leaves the
    cache holding the ``S`` ids of (residents ∪ the access's ids) with the nearest next use."""

    name = "belady"

    def __init__(self, wl: Workload, slots: int):
        super().__init__(wl, slots)
        self.nxt = wl.next_use()
        self.cur: dict[int, float] = {}  # resident id -> its next use (== i while needed by access i)
        self.heap: list[tuple[float, int]] = []  # (-next use, id), lazily invalidated

    def access(self, a: Access, i: int) -> tuple[int, int]:
        res = self.res
        n_hits = sum(1 for f in a.ids if f in res)
        if a.phase == "prefill" and len(res | set(a.ids)) > self.slots:
            pool = {f: nu for f, nu in self.cur.items() if f in res}
            pool.update(zip(a.ids, self.nxt[i]))
            keep = sorted(pool, key=lambda f: (pool[f], f))[: self.slots]
            self.res = set(keep)
            self.cur = {f: pool[f] for f in keep}
            self.heap = [(-pool[f], f) for f in keep]
            heapq.heapify(self.heap)
            return n_hits, len(a.ids) - n_hits
        return super().access(a, i)

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
    if name == "lru":
        return GlobalLRU(wl, slots)
    if name == "layer-lru":
        return LayerLRU(wl, slots)
    if name == "lfu":
        return LFU(wl, slots)
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
             progress=None) -> ReplayResult:
    """Replay ``wl`` through one policy (a name plus ``slots``, or a built :class:`Policy`).

    ``progress``: optional tqdm bar, advanced by the number of accesses.
    """
    pol = policy if isinstance(policy, Policy) else make_policy(policy, wl, int(slots), calibration)
    L = wl.num_layers
    dh, dm = [0] * L, [0] * L
    ph = pm = 0
    for i, a in enumerate(wl.accesses):
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
    return ReplayResult(pol.name, pol.slots, pol.slots / wl.num_ids, dh, dm, ph, pm, wl.decode_tokens)


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
        FileNotFoundError / ValueError (incl. ``TraceFormatError``): bad traces or options.
    """
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
    print(format_report(wl, results, expert_bytes, args.layer_table_slots))
    if not args.no_plot:
        path = plot(wl, results, args.plot, args.title, absolute=bool(args.capacity_slots))
        print(f"\nplot: {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "traces": wl.sources, "num_layers": wl.num_layers, "num_experts": wl.num_experts, "top_k": wl.top_k,
            "decode_tokens": wl.decode_tokens, "prefill_tokens": wl.prefill_tokens, "requests": wl.requests,
            "expert_bytes": expert_bytes, "results": [r.as_dict(expert_bytes) for r in results]}, indent=1))
    return 0

