"""Step-time simulation of decode-step miss policies over routing traces.

:func:`simulate_time` replays a :class:`~edgemoe.bench.replay.Workload` through an eviction rule (a
:class:`~edgemoe.bench.replay.Policy`) and a miss policy (an :class:`~edgemoe.experts.policy.ExpertPolicy`,
the engine's own objects) and charges every decode access (one MoE layer of one step) the time of a
machine's cost model (:class:`~edgemoe.experts.policy.MissCosts`): for ``m`` misses the miss policy
picks ``q``, the rule fills up to ``q`` of them (most-routed first, victims among the slots this
access does not need), the rest run on the CPU, and the layer takes ``MissCosts.layer_seconds``.
Prefill accesses warm the cache as the engine's streamed prefill does (every miss filled) and are not
timed. Miss policies (:data:`MISS_POLICIES`):

- ``fill-all``, ``qstar``, ``adaptive``, ``auto``: the engine's policies over the eviction rule;
  ``qstar`` and ``adaptive`` get the bandwidth pair the engine would measure (B_P from 8-row copies,
  B_H from 4-expert CPU calls, concurrent, ``B_H := B_P + B_H``); ``adaptive`` sees every step's time;
  ``auto`` starts from the machine's cost model and sees what the engine measures online: each layer
  step's branch times (with ``noise``) and the fills' net reuse (:class:`~edgemoe.experts.policy.LayerObservation`);
- ``cpu-all``: no cache, every routed expert on the CPU;
- ``static``: whole MoE layers from the last one placed at load (llama.cpp ``--n-cpu-moe``), misses
  on the CPU.

A CPU branch is *armed* on every layer step of a policy that may send work to the CPU (all but
``fill-all``), as in the engine's device path: an armed layer step without CPU work pays
``MissCosts.idle_handoff_s``. ``auto`` runs as on the engine's CUDA device path: it is told that cost
(``AutoPolicy.price_armed_branch``), its steps run without the branch while its table fills every
miss, and every ``read_window_steps`` decode steps (``REUSE_READ_STEPS`` unless it asks for fewer, or after
``REUSE_READ_SECONDS`` of simulated time) it gets
the window's join lateness (a hand-off is *late* when its CPU branch outlasts the GPU's work between
hand-off and join: the fills and the resident experts) and the misses per layer step that found no
free slot.

``lateness="graded"`` (a design study; the engine's device path counts yes/no): a hand-off counts 1 when the GPU
waits at the join longer than one fill of the policy's current model (moving one expert from the CPU to the GPU
would shorten the layer step), 0 when the CPU branch finished earlier than that by more than one CPU expert's time
(moving one the other way would), and 1/2 otherwise (no single move pays); the balance controller reads the
weighted fraction with its band unchanged, so a split that no integer move improves stays put.

``contention`` changes the machine mid-run (another process taking PCIe or DRAM bandwidth): between
two simulated times the per-expert fill and CPU times are multiplied by the given factors; policies
only see it through what they measure.

Next-layer prefetch (``prefetch=True``, traces with ``predicted`` rows): before MoE layer ``l + 1``
routes, its predicted experts that are not resident are filled while layer ``l`` runs (victims
exclude layer ``l``'s experts); the copies use the link while layer ``l``'s own fills do not, and
the part that does not fit in layer ``l``'s time delays layer ``l + 1``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from edgemoe.bench.replay import Access, ResidentPolicy, Workload, make_policy
from edgemoe.config import JOIN_LATENESS
from edgemoe.experts.policy import (
    REUSE_READ_SECONDS,
    AdaptivePolicy,
    AutoPolicy,
    Bandwidths,
    ExpertPolicy,
    FillAllPolicy,
    LayerObservation,
    MissCosts,
    QStarPolicy,
)

__all__ = ["COST_PRESETS", "LATENESS", "MISS_POLICIES", "Contention", "TimeResult", "profiled_bandwidths",
           "simulate_time"]

MISS_POLICIES = ("fill-all", "cpu-all", "static", "qstar", "adaptive", "auto")
LATENESS = JOIN_LATENESS  # how a hand-off's join is counted for the balance controller (module docstring)
QWEN3_30B_EXPERT_BYTES = 3 * 2048 * 768 * 2  # bf16 expert of Qwen3-30B-A3B: 9.44 MB

COST_PRESETS: dict[str, MissCosts] = {
    # H200 host, PCIe 5.0, native executor on 12 threads, Qwen3-30B-A3B experts (9.44 MB), batch 1:
    # B_P 54.0 / 48.8 GB/s alone / concurrent; CPU executor 68.9 GB/s at 4 experts per call and 84 at 8
    # (in decode) give 200 us per call + 88 us per expert (107 GB/s asymptotic, 100 concurrent);
    # gather_fills at one row reaches ~92 % of B_P (~15 us fixed); an armed hand-off without work
    # (2 copies, ring, wait) cost ~32 us per layer when it always rang (qstar vs fill-all at 0.97 hit
    # rate, 16 layers); the resident step is 6.56 ms for 48 layers (137 us per layer).
    "h200-ring-always": MissCosts.from_bandwidths(QWEN3_30B_EXPERT_BYTES, 54.0, 107.0, 48.8, 100.0,
                                                  fill_fixed_s=15e-6, cpu_fixed_s=200e-6, idle_handoff_s=32e-6,
                                                  base_s=137e-6),
    # The same host as the device path is now built: a layer step without CPU work does not ring, so an
    # armed branch costs two small copies and three launches (~8 us, an estimate until measured).
    "h200": MissCosts.from_bandwidths(QWEN3_30B_EXPERT_BYTES, 54.0, 107.0, 48.8, 100.0, fill_fixed_s=15e-6,
                                      cpu_fixed_s=200e-6, idle_handoff_s=8e-6, base_s=137e-6),
    # The same host with the hand-off folded into the device control (no copies or polling when a
    # layer step has no CPU work): ~1 us per armed layer step without work.
    "h200-folded": MissCosts.from_bandwidths(QWEN3_30B_EXPERT_BYTES, 54.0, 107.0, 48.8, 100.0,
                                             fill_fixed_s=15e-6, cpu_fixed_s=190e-6, idle_handoff_s=1e-6,
                                             base_s=137e-6),
    # H100 host (2026-12-06 05:08 profile, 6 CPU threads; its CPU reads about twice as fast as PCIe): B_P 55.05 /
    # 55.04 GB/s alone / concurrent, B_H 100.4 / 96.0; fixed costs from copies of 1 and 8 rows (6.6 us) and CPU
    # calls of 1 and 4 experts (22.3 us); 185 tokens/s at a 0.99 hit rate (48 layers): ~112 us of other work per
    # layer; the armed branch without work as on the H200 host.
    "h100": MissCosts.from_bandwidths(QWEN3_30B_EXPERT_BYTES, 55.05, 100.4, 55.04, 96.0, fill_fixed_s=6.6e-6,
                                      cpu_fixed_s=22.3e-6, idle_handoff_s=8e-6, base_s=112e-6),
    # Another H100 host (2026-12-06 10:13, its step logs in the policy study): a CPU that reads slower than PCIe at
    # 6 threads, B_P 54.86 / 54.28 GB/s alone / concurrent, B_H 49.2 / 44.8; the fixed costs and other work as "h100".
    "h100-cpu49": MissCosts.from_bandwidths(QWEN3_30B_EXPERT_BYTES, 54.86, 49.2, 54.28, 44.83, fill_fixed_s=6.6e-6,
                                            cpu_fixed_s=22.3e-6, idle_handoff_s=8e-6, base_s=112e-6),
    # H100 host of 2026-12-07 08:26 at 15 CPU threads (its profile in the policy study), as the engine's prior prices
    # it: the concurrent pair B_P 44.6 GB/s, B_H,c 86.1 (a CPU expert ~110 us, a fill ~212 us: the CPU reads about
    # twice as fast as PCIe), 17.5 us per fill call and 17.3 us per CPU call; armed branch and other work as "h100".
    "h100-15": MissCosts.from_bandwidths(QWEN3_30B_EXPERT_BYTES, 44.6, 86.1, fill_fixed_s=17.5e-6,
                                         cpu_fixed_s=17.3e-6, idle_handoff_s=8e-6, base_s=112e-6),
    # Two H100 hosts of 2026-12-07 10:37-10:50 at 6 CPU threads whose CPU reads about as fast as PCIe (their profiles in
    # the policy study, "both tables on the final prefill tree"): host A B_P 49.9 / 47.7 GB/s alone / concurrent, B_H
    # 57.4 / 46.1; host B B_P 50.5 / 49.2, B_H 53.3 / 51.3; fixed costs 21 us per fill call and 17 us per CPU call
    # (host B's profile), armed branch and other work as "h100".
    "h100-a6": MissCosts.from_bandwidths(QWEN3_30B_EXPERT_BYTES, 49.9, 57.4, 47.7, 46.1, fill_fixed_s=21e-6,
                                         cpu_fixed_s=17e-6, idle_handoff_s=8e-6, base_s=112e-6),
    "h100-b6": MissCosts.from_bandwidths(QWEN3_30B_EXPERT_BYTES, 50.5, 53.3, 49.2, 51.3, fill_fixed_s=21e-6,
                                         cpu_fixed_s=17e-6, idle_handoff_s=8e-6, base_s=112e-6),
    # 2-core development VM (CPU only: the "device" cache is a second host buffer on the same cores, so
    # the branches do not overlap): native executor on 2 threads 20.0 / 23.8 GB/s at 1 / 4 experts per
    # call (372 us per expert + 100 us per call); a fill is a 9.44 MB memory copy (~12 GB/s); a cached
    # expert is computed by torch ops from the cache (~10 GB/s, ~940 us); 2 ms of other work per layer.
    "vm": MissCosts(fill_s=QWEN3_30B_EXPERT_BYTES / 12e9, fill_conc_s=QWEN3_30B_EXPERT_BYTES / 12e9,
                    cpu_s=372e-6, cpu_conc_s=372e-6, fill_fixed_s=20e-6, cpu_fixed_s=100e-6, idle_handoff_s=10e-6,
                    hit_s=940e-6, base_s=2e-3, overlap=False),
}


@dataclass(frozen=True)
class Contention:
    """From ``start_s`` to ``end_s`` of simulated decode time, per-expert fill times are multiplied by
    ``fill_factor`` and CPU times by ``cpu_factor`` (e.g. 2.0: half the bandwidth)."""

    start_s: float
    end_s: float
    fill_factor: float = 1.0
    cpu_factor: float = 1.0

    def apply(self, costs: MissCosts, t: float) -> MissCosts:
        if not self.start_s <= t < self.end_s:
            return costs
        f, c = self.fill_factor, self.cpu_factor
        return replace(costs, fill_s=costs.fill_s * f, fill_conc_s=costs.fill_conc_s * f, cpu_s=costs.cpu_s * c,
                       cpu_conc_s=costs.cpu_conc_s * c)


@dataclass
class TimeResult:
    """One (miss policy, eviction rule, slots) run.

    Attributes:
        policy, eviction, slots: what ran. tokens: decode tokens. seconds: simulated decode time.
        hits / misses / fills / cpu: decode counts (deduplicated experts per layer step).
        prefetched / prefetch_hits: prefetch fills and those routed by their layer.
        step_seconds: time of each decode step (in order).
        reuse_per_fill: the net reuse per displacing fill of each window the policy read (the engine's
            accounting, :class:`LayerObservation`), summed over layers; windows without such fills left out.
    """

    policy: str
    eviction: str
    slots: int
    tokens: int
    seconds: float
    hits: int = 0
    misses: int = 0
    fills: int = 0
    cpu: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    step_seconds: list[float] = field(default_factory=list, repr=False)
    reuse_per_fill: list[float] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else math.nan

    def as_dict(self) -> dict:
        return {"policy": self.policy, "eviction": self.eviction, "slots": self.slots, "tokens": self.tokens,
                "seconds": self.seconds, "tokens_per_s": self.tokens_per_s, "hit_rate": self.hit_rate,
                "fills_per_token": self.fills / max(1, self.tokens), "cpu_per_token": self.cpu / max(1, self.tokens),
                "prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits}


def profiled_bandwidths(costs: MissCosts, expert_bytes: float = QWEN3_30B_EXPERT_BYTES) -> Bandwidths:
    """The pair the engine's profile gives q* on a machine of ``costs``: concurrent B_P of 8-row copies
    and B_H of 4-expert calls, ``B_H := B_P + B_H`` (``edgemoe.experts.bandwidth``)."""
    gb = expert_bytes / 1e9
    bp = 8 * gb / (costs.fill_fixed_s + 8 * costs.fill_conc_s)
    bh = 4 * gb / (costs.cpu_fixed_s + 4 * costs.cpu_conc_s)
    return Bandwidths(bp, bp + bh, "simulated profile (concurrent pair)")


class _Noise:
    def __init__(self, sigma: float, seed: int):
        self.sigma, self.rng = float(sigma), random.Random(seed)

    def __call__(self, t: float) -> float:
        return t * math.exp(self.rng.gauss(0.0, self.sigma)) if self.sigma > 0 else t


def _miss_policy(name: str, wl: Workload, costs: MissCosts, fill_ratio: float | None = None,
                **auto_kw) -> ExpertPolicy | None:
    bw = profiled_bandwidths(costs)
    if name == "qstar":
        return QStarPolicy(bw if fill_ratio is None else Bandwidths(fill_ratio, 1.0, "fixed fill ratio"))
    if name == "adaptive":
        return AdaptivePolicy(bw)
    if name == "fill-all":
        return FillAllPolicy()
    if name == "auto":  # as the engine builds it: the profiled pair and the fixed costs of a copy and a CPU call
        bw = replace(bw, fill_fixed_s=costs.fill_fixed_s, cpu_fixed_s=costs.cpu_fixed_s)
        return AutoPolicy.from_bandwidths(bw, QWEN3_30B_EXPERT_BYTES, wl.num_layers,
                                          min(wl.num_experts, 4 * wl.top_k), **auto_kw)
    return None  # cpu-all / static: no fills


def simulate_time(wl: Workload, policy: str, slots: int, costs: MissCosts, eviction: str = "lru", *,
                  contention: Contention | None = None, noise: float = 0.0, seed: int = 0, prefetch: bool = False,
                  token_base_s: float = 0.0, auto_kw: dict | None = None,
                  measure_branches: bool = False, warmup: int = 0, fill_ratio: float | None = None,
                  lateness: str = "yes-no") -> TimeResult:
    """Replay ``wl`` under miss policy ``policy`` (one of :data:`MISS_POLICIES`) with ``slots`` cache
    slots under ``eviction`` (a :func:`~edgemoe.bench.replay.make_policy` name) on a machine of ``costs``
    (see the module docstring). ``token_base_s``: time per decode step outside the MoE layers (LM
    head, embeddings). ``noise``: log-normal sigma of the branch and step times the policies see.
    ``auto`` sees, as in the engine, the fills' net reuse every ``read_window_steps`` decode steps;
    ``measure_branches`` also gives it every layer step's branch times (which the engine does not time).
    ``warmup``: decode steps run but not timed (as the decode benchmark's ``--warmup``; the engine's
    prefill warms the cache before decode, a decode-only trace starts cold). ``fill_ratio``: ``qstar`` fills
    this share of each layer step's misses instead of the profiled ``B_P / B_H`` (a fixed split, to measure
    what more or fewer fills buy). ``lateness``: ``yes-no`` (the engine's join count) or ``graded`` (see the module
    docstring).

    Raises:
        ValueError: an unknown policy, eviction rule or lateness, or ``prefetch`` on a trace without predictions.
    """
    if lateness not in LATENESS:
        raise ValueError(f"unknown lateness {lateness!r}; choose from {', '.join(LATENESS)}")
    if policy not in MISS_POLICIES:
        raise ValueError(f"unknown miss policy {policy!r}; choose from {', '.join(MISS_POLICIES)}")
    if prefetch and not any(a.predicted for a in wl.accesses):
        raise ValueError("prefetch needs a trace with predicted experts (recorded with predictions)")
    rule: ResidentPolicy | None
    if policy == "cpu-all" or slots == 0:
        rule = None
    else:
        rule = make_policy("static-layers" if policy == "static" else eviction, wl, slots)
        if not isinstance(rule, ResidentPolicy):
            raise ValueError(f"eviction rule {eviction!r} has no step-time model (use a pure-Python rule)")
    pol = _miss_policy(policy, wl, costs, fill_ratio, **(auto_kw or {}))
    device_auto = isinstance(pol, AutoPolicy)
    if device_auto:
        pol.price_armed_branch(costs.idle_handoff_s)
    armed = policy != "fill-all"
    win = _Window(wl.num_layers)
    sense = _Noise(noise, seed)

    def probe_costs(t: float) -> MissCosts:
        return contention.apply(costs, t) if contention is not None else costs

    res = TimeResult(policy, "-" if policy in ("cpu-all", "static") else eviction, slots, wl.decode_tokens, 0.0)
    L = wl.num_layers
    clock = 0.0
    step_t, cur_step = 0.0, None
    obs = LayerObservation(fill_samples=[], cpu_samples=[])
    seen = ([0] * L, [0] * L)
    prev: Access | None = None
    carry = 0.0  # prefetch copies of this layer that did not fit in the previous layer's time
    prev_window = 0.0
    for i, a in enumerate(wl.accesses):
        if a.phase != "decode":
            if rule is not None and rule.admits:
                rule.access(a, i)
            prev = None
            continue
        if a.step != cur_step:
            if cur_step is not None:
                clock, read = _end_step(res, pol, rule, obs, seen, step_t + token_base_s, sense, clock, win,
                                        probe_costs)
                if read:
                    obs = LayerObservation(fill_samples=[], cpu_samples=[])
            cur_step, step_t, carry, prev = a.step, 0.0, 0.0, None
            if device_auto:
                armed = not pol.fills_every_miss()
        c = contention.apply(costs, clock + step_t) if contention is not None else costs
        if prefetch and rule is not None and rule.admits and a.predicted and prev is not None:
            n_pf, n_hit = _prefetch(rule, a, i)
            res.prefetched += n_pf
            res.prefetch_hits += n_hit
            t_pf = (c.fill_fixed_s + n_pf * c.fill_s) if n_pf else 0.0
            carry = max(0.0, t_pf - prev_window)
        if rule is None:
            h, m, f, free = 0, len(a.ids), 0, 0
        else:
            free = rule.free_slots(a.layer)
            h, m = rule.access(a, i, _fill_rule(pol, rule, a.layer))
            f = rule.fills
        cpu = m - f
        g, b = c.branches(f, cpu, armed)
        t = c.layer_seconds(h, f, cpu, armed) + carry
        win.layer_steps += 1
        free_fills = min(f, free)
        win.decided += m - free_fills
        win.free_fills += free_fills
        if cpu and armed:
            win.handoffs[a.layer] += 1
            gpu_s = g + h * c.hit_s  # the GPU's work between hand-off and join
            if lateness == "graded":  # limits from the policy's model, as the device path is given them
                up, down = (pol.join_limits() if pol is not None else None) or (c.fill_conc_s, c.cpu_conc_s)
                win.late[a.layer] += 1.0 if b - gpu_s > up else 0.0 if gpu_s - b > down else 0.5
            else:
                win.late[a.layer] += b > gpu_s
        step_t += t
        prev_window = t - g
        if f and measure_branches:
            obs.fill_samples.append((f, sense(g), cpu > 0))
        if cpu and measure_branches:
            obs.cpu_samples.append((cpu, sense(b), f > 0))
        res.hits += h
        res.misses += m
        res.fills += f
        res.cpu += cpu
        prev = a
    if cur_step is not None:
        _end_step(res, pol, rule, obs, seen, step_t + token_base_s, sense, clock, win, probe_costs)
    n = len(res.step_seconds)
    w = min(int(warmup), n)
    res.seconds = sum(res.step_seconds[w:])
    res.tokens = round(res.tokens * (n - w) / n) if n else 0
    return res


def _fill_rule(pol: ExpertPolicy | None, rule: ResidentPolicy, layer: int):
    """``q(m)`` of the miss policy for this layer step; a policy with ``fills_free_slots`` fills at least
    the misses that find a free slot."""
    if pol is None:
        return None
    if pol.fills_free_slots:
        free = rule.free_slots(layer)
        return lambda m: max(pol.num_fills(m, layer), min(m, free))
    return lambda m: pol.num_fills(m, layer)


@dataclass
class _Window:
    """What the engine's runtime counts between two reads (``ExpertRuntime._observe_reuse``)."""

    num_layers: int
    steps: int = 0
    start_s: float = 0.0
    layer_steps: int = 0
    decided: int = 0  # misses that found no free slot
    free_fills: int = 0  # misses that found one
    handoffs: list[int] = field(default_factory=list)
    late: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.reset(0.0)

    def reset(self, now: float) -> None:
        self.steps, self.start_s, self.layer_steps, self.decided, self.free_fills = 0, now, 0, 0, 0
        self.handoffs, self.late = [0] * self.num_layers, [0] * self.num_layers


def _end_step(res: TimeResult, pol: ExpertPolicy | None, rule: ResidentPolicy | None, obs: LayerObservation,
              seen: tuple[list[int], list[int]], seconds: float, sense: _Noise, clock: float,
              win: _Window, probe_costs: Callable[[float], MissCosts] | None = None) -> tuple[float, bool]:
    """Close a decode step; returns the new clock and whether the policy read its window (then a new one starts).
    ``probe_costs(clock)``: the costs at that time, for a CPU-speed probe the policy asks for (its time is
    added to the clock)."""
    res.step_seconds.append(seconds)
    clock += seconds
    win.steps += 1
    if pol is None:
        return clock, False
    pol.observe(sense(seconds), 1)
    if win.steps < pol.read_window_steps and clock - win.start_s < REUSE_READ_SECONDS:
        return clock, False
    if rule is not None and rule.reuse_net is not None:
        net, n = rule.reuse_net, rule.fills_by_layer
        obs.reuse_net = [x - y for x, y in zip(net, seen[0])]
        obs.fills = [x - y for x, y in zip(n, seen[1])]
        if sum(obs.fills):
            res.reuse_per_fill.append(sum(obs.reuse_net) / sum(obs.fills))
        seen[0][:], seen[1][:] = net, n
    if isinstance(pol, AutoPolicy):
        obs.handoffs, obs.late = win.handoffs, win.late
        obs.misses_per_layer_step = win.decided / win.layer_steps if win.layer_steps else None
        obs.free_slot_fills = win.free_fills
    obs.steps = win.steps
    if (n := pol.wants_cpu_probe) and probe_costs is not None:  # the runtime's CPU-speed probe, between steps
        c = probe_costs(clock)
        t = c.cpu_fixed_s + n * c.cpu_s
        obs.cpu_probe = (n, sense(t))
        clock += t
    pol.observe_layers(obs)
    win.reset(clock)
    return clock, True


def _prefetch(rule: ResidentPolicy, a: Access, i: int) -> tuple[int, int]:
    """Fill ``a.predicted`` ids that are not resident, not evicting the predicted ones that are (as the engine's
    prefetch, whose copies follow the previous layer's computation in stream order, so that layer's experts may
    be victims); returns (prefetch fills, those that ``a`` routes)."""
    before = set(rule.res)
    rule.prefetch(a, a.predicted, set(a.predicted), i)
    got = rule.res - before
    return len(got), len(got & set(a.ids))
