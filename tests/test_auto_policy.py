"""The ``auto`` miss policy (per-layer cost model with the measured reuse of a fill) and the expert
cache's reuse accounting it reads: the cost model's choices, the cache's ghost counters against the
routing replay's, and the engine feeding the policy between steps with exact outputs."""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import replace

import pytest
import torch

from edgemoe.bench.replay import SlotLRU, build_workload, simulate, uniform_workload
from edgemoe.bench.trace import RouteRecord, TraceInfo
from edgemoe.core import Phase
from edgemoe.experts.bandwidth import fixed_costs
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.hybrid import plan_step
from edgemoe.experts.policy import (
    REUSE_READ_STEPS,
    AutoPolicy,
    Bandwidths,
    FillAllPolicy,
    LayerObservation,
    MissCosts,
    QStarPolicy,
    make_policy,
)

ROW = 9_437_184  # bytes of a Qwen3-30B-A3B bf16 expert


def test_without_fixed_costs_or_reuse_auto_is_the_qstar_balance():
    bw = Bandwidths(50.0, 150.0)
    auto = AutoPolicy.from_bandwidths(bw, ROW, num_layers=2, max_misses=64, reuse_prior=0.0)
    c = auto.costs
    for m in range(1, 65):
        q, qs = auto.num_fills(m, 1), QStarPolicy(bw).num_fills(m)
        assert c.split_seconds(m, q, armed=False) <= c.split_seconds(m, qs, armed=False) + 1e-12
        assert abs(q - m / 3) <= 1  # B_P / B_H = 1/3


def test_fixed_costs_decide_few_misses():
    # B_H measured at 4 experts per call that cost 400 us each: the call, not the experts, is the CPU's
    # cost, so of 2 misses both fill (q* fills 1), and many misses go to the CPU in one call
    bw = Bandwidths(50.0, 150.0, fill_fixed_s=1e-5, cpu_fixed_s=4e-4)
    handoff = AutoPolicy.from_bandwidths(bw, ROW, 1, 64)
    assert handoff.num_fills(2) == 2 and QStarPolicy(bw).num_fills(2) == 1
    assert handoff.num_fills(11) == 2 < QStarPolicy(bw).num_fills(11)
    for m in range(1, 65):
        q = handoff.num_fills(m)
        assert all(handoff.costs.split_seconds(m, q, False) <= handoff.costs.split_seconds(m, x, False) + 1e-12
                   for x in range(m + 1))
    assert handoff.num_fills(64) < 64
    # a copy that costs 1 ms to start: a single miss stays on the CPU
    copy = AutoPolicy.from_bandwidths(Bandwidths(50.0, 150.0, fill_fixed_s=1e-3), ROW, 1, 64)
    assert copy.num_fills(1) == 0


def test_join_lateness_moves_the_split_and_drifts_back_without_hand_offs():
    """Hand-offs whose join waited for the CPU raise its modeled cost (more fills), by moves that double
    while their direction holds (1, 2, 4, 4 levels); joins that never waited lower it; a window inside the
    band or a reversal starts again at one level; windows without enough hand-offs drift back to the
    model's costs."""
    bw = Bandwidths(53.0, 98.7)
    auto = AutoPolicy.from_bandwidths(bw, ROW, num_layers=2, max_misses=16, reuse_prior=0.0)
    base = [auto.num_fills(m) for m in range(1, 17)]
    late = LayerObservation(handoffs=[20, 20], late=[19, 18])
    levels = []
    for _ in range(4):
        auto.observe_layers(late)
        levels.append(auto.cpu_level)
    assert levels == [1, 3, 7, 11]  # 2x (8 levels) is passed in the fourth window
    assert auto.late_fraction == pytest.approx(37 / 40)  # the last judged window's, for the step log
    auto.observe_layers(LayerObservation(handoffs=[20, 20], late=[0, 0]))
    assert auto.cpu_level == 10 and auto.late_fraction == 0.0  # a reversal: one level
    auto.observe_layers(LayerObservation(handoffs=[20, 20], late=[10, 10]))
    assert auto.cpu_level == 10  # inside the band
    auto.observe_layers(LayerObservation(handoffs=[20, 20], late=[0, 0]))
    auto.observe_layers(LayerObservation(handoffs=[20, 20], late=[0, 0]))
    assert auto.cpu_level == 7  # the band reset the step: 1, then 2
    auto.observe_layers(LayerObservation(handoffs=[20, 20], late=[10, 10]))
    auto.observe_layers(late)
    assert auto.cpu_level == 8 and auto.cpu_scale == pytest.approx(2.0)
    more = [auto.num_fills(m) for m in range(1, 17)]
    assert all(a >= b for a, b in zip(more, base)) and sum(more) > sum(base)
    assert auto.effective_costs().cpu_s == pytest.approx(2 * auto.costs.cpu_s)
    for _ in range(100):
        auto.observe_layers(late)
    assert auto.cpu_level == auto.balance_levels[1]  # bounded
    early = LayerObservation(handoffs=[20, 20], late=[0, 1])
    for _ in range(60):
        auto.observe_layers(early)
    assert auto.cpu_level == auto.balance_levels[0]
    quiet = LayerObservation(handoffs=[2, 3], late=[2, 3])  # 5 < balance_min_handoffs: no verdict
    assert not auto.fills_every_miss()
    auto.observe_layers(quiet)
    assert auto.cpu_level == auto.balance_levels[0] + 1  # one level back per quiet window
    fewer = [auto.num_fills(m) for m in range(1, 17)]
    assert all(a <= b for a, b in zip(fewer, base)) and sum(fewer) < sum(base)
    balanced = LayerObservation(handoffs=[20, 20], late=[10, 10])
    level = auto.cpu_level
    auto.observe_layers(balanced)
    assert auto.cpu_level == level  # inside the band: stays
    for _ in range(40):
        auto.observe_layers(LayerObservation(handoffs=[0, 0], late=[0, 0]))
    assert auto.cpu_level == 0 and [auto.num_fills(m) for m in range(1, 17)] == base


def test_a_stalled_cpu_is_priced_out_at_once_and_probed_back_with_backoff():
    """Windows in which every hand-off was late while the steps slowed down (another process on the executor's
    cores) move the CPU cost ``balance_stall_step`` levels each; the same lateness at an unchanged step
    time is an ordinary late window. While the table then fills every miss (the device path runs
    disarmed, sending nothing) quiet windows say nothing about the CPU: after ``balance_retry_windows`` of
    them the level is halved (a probe, not a drift per window that would flip the step's graph every
    window); a probe answered by a late window doubles the wait before the next, an answered-early one
    resets it."""
    auto = AutoPolicy.from_bandwidths(Bandwidths(53.0, 98.7), ROW, num_layers=2, max_misses=16)
    all_late = LayerObservation(handoffs=[20, 20], late=[20, 20])

    def window(step_s: float, obs: LayerObservation) -> None:
        for _ in range(8):
            auto.observe(step_s, 1)
        auto.observe_layers(obs)

    window(0.01, LayerObservation(handoffs=[20, 20], late=[10, 10]))  # in the band: the reference step time
    window(0.01, all_late)
    assert auto.cpu_level == 1  # all late, steps as fast as before: one level
    window(0.01, LayerObservation(handoffs=[20, 20], late=[10, 10]))
    assert auto.cpu_level == 1
    window(0.1, all_late)  # ten times slower: a stall, priced by the slowdown at once (8 log2 10 levels)
    assert auto.cpu_level == 1 + math.ceil(8 * math.log2(10)) == 28
    window(0.03, all_late)  # still stalled, three times slower than before it: at least balance_stall_step
    assert auto.cpu_level == min(28 + max(auto.balance_stall_step, math.ceil(8 * math.log2(3))), 40) == 40
    auto.cpu_level = 28
    stalled = all_late
    auto.observe_layers(LayerObservation(reuse_net=[40, 40], fills=[40, 40], misses_per_layer_step=6.0))
    assert auto.fills_every_miss() and auto.wants_cpu_probe  # priced out: level 0 would split
    quiet = LayerObservation(handoffs=[0, 0], late=[0, 0])
    for _ in range(auto.balance_retry_windows - 1):
        auto.observe_layers(quiet)
    assert auto.cpu_level == 28 and not auto.read_window_steps == 1
    auto.observe_layers(quiet)
    assert auto.cpu_level == 14 and auto.read_window_steps == 1  # the probe, judged on the next step
    auto.observe(0.1, 1)
    auto.observe_layers(stalled)  # answered late: priced out again, and the next probe waits twice as long
    assert auto.cpu_level == 40 and not auto.read_window_steps == 1
    window(0.1, stalled)
    assert auto.fills_every_miss() and auto.cpu_level == auto.balance_levels[1] == 40
    assert auto._retry_windows == 2 * auto.balance_retry_windows
    for _ in range(2 * auto.balance_retry_windows - 1):
        auto.observe_layers(quiet)
    assert auto.cpu_level == 40
    auto.observe_layers(quiet)
    assert auto.cpu_level == 20
    auto.observe_layers(LayerObservation(handoffs=[20, 20], late=[10, 10]))  # answered in the band: reset
    assert auto.cpu_level == 20 and auto._retry_windows == auto.balance_retry_windows
    disarmed = auto.fills_every_miss()
    for _ in range(auto.balance_retry_windows):
        window(0.1, quiet)
    # halved by a probe if the table fills every miss, else one level a quiet window
    assert auto.cpu_level == (10 if disarmed else 20 - auto.balance_retry_windows)


def test_no_cpu_probe_where_every_miss_fills_at_level_0_too():
    """A table that fills every miss at level 0 as well (fills that are hit again, or few misses) does not
    depend on the CPU's speed: no probe is asked (it would read about a millisecond of experts a window, 8 % of a
    16-layer step) and quiet windows keep the level instead of halving it with probes that early-read every
    step (a pending one is dropped); once the misses show no reuse, level 0 would split and the probe is asked
    again."""
    auto = AutoPolicy.from_bandwidths(Bandwidths(53.0, 98.7), ROW, num_layers=2, max_misses=16)
    auto.observe_layers(LayerObservation(reuse_net=[10_000, 10_000], fills=[10, 10], misses_per_layer_step=6.0))
    auto.cpu_level = 20
    auto._rebuild()
    assert auto.fills_every_miss() and auto.wants_cpu_probe == 0
    auto._probing = True  # a halving not yet judged (or one a resize's inherit() carried over)
    quiet = LayerObservation(handoffs=[0, 0], late=[0, 0])
    for _ in range(3 * auto.balance_retry_windows):
        auto.observe_layers(quiet)
    assert auto.cpu_level == 20 and not auto.read_window_steps == 1
    for _ in range(40):  # the fills stop being hit: the reuse estimate decays to what they show
        auto.observe_layers(LayerObservation(reuse_net=[0, 0], fills=[400, 400]))
    assert not auto.fills_every_miss() and auto.wants_cpu_probe == 0  # level 20 splits: hand-offs judge it
    auto.cpu_level = auto.balance_levels[1]
    auto._rebuild()
    assert auto.fills_every_miss() and auto.wants_cpu_probe == auto.cpu_probe_experts


def test_a_cpu_probe_brings_a_priced_out_cpu_back_when_the_slowdown_ends():
    """While a stall keeps the table filling every miss, the policy asks the runtime for a CPU-speed probe
    each window (``wants_cpu_probe``) and lowers the level to its time over the level-0 model (a probe never
    raises it) when it is within ``cpu_probe_return`` of the model: a probe still 10x slower keeps the level,
    one at 1.5x gives the level of 1.5x, one at the model's time level 0 (the split) in one window; none is
    asked at level 0 or while the table splits."""
    auto = AutoPolicy.from_bandwidths(Bandwidths(53.0, 98.7), ROW, num_layers=2, max_misses=16)
    assert auto.wants_cpu_probe == 0  # level 0
    auto.observe_layers(LayerObservation(reuse_net=[0, 0], fills=[60, 60], misses_per_layer_step=6.0))
    base = [auto.num_fills(m) for m in range(1, 17)]
    auto.cpu_level = auto.balance_levels[1]  # priced out by a stall
    auto._rebuild()
    assert auto.fills_every_miss()
    n = auto.wants_cpu_probe
    assert n == auto.cpu_probe_experts
    c = auto.costs
    model = c.cpu_fixed_s + n * c.cpu_s
    quiet = LayerObservation(handoffs=[0, 0], late=[0, 0])
    auto.observe_layers(replace(quiet, cpu_probe=(n, 100 * model)))  # a probe never raises the level
    assert auto.cpu_level == auto.balance_levels[1]
    auto.observe_layers(replace(quiet, cpu_probe=(n, 10 * model)))  # still 10x slower: the level stays
    assert auto.cpu_level == auto.balance_levels[1]
    auto.observe_layers(replace(quiet, cpu_probe=(n, 1.5 * model)))  # nearly back: the level of 1.5x, at once
    assert auto.cpu_level == math.ceil(8 * math.log2(1.5)) == 5
    if auto.fills_every_miss():
        assert auto.wants_cpu_probe == n
    else:  # the table splits again: hand-offs judge the CPU from here, no probe is asked
        assert auto.wants_cpu_probe == 0
        auto.cpu_level = auto.balance_levels[1]
        auto._rebuild()
    auto.observe_layers(replace(quiet, cpu_probe=(n, 0.9 * model)))  # as fast as modeled: level 0 in one window
    assert auto.cpu_level == 0 and [auto.num_fills(m) for m in range(1, 17)] == base
    assert not auto.fills_every_miss() and auto.wants_cpu_probe == 0


def test_a_fill_is_worth_a_whole_miss_when_layers_miss_rarely():
    """t_save is the marginal time of a miss at the measured miss count: a layer missing about once a step
    saves a whole branch time per avoided miss, twice the balance value q* implies, so less reuse makes it
    fill every miss."""
    auto = AutoPolicy.from_bandwidths(Bandwidths(53.0, 98.7, fill_fixed_s=1.75e-5), ROW, num_layers=1, max_misses=16)
    c = auto.effective_costs()
    balance = auto.t_save(c)
    assert balance == pytest.approx(c.fill_s * c.cpu_s / (c.fill_s + c.cpu_s))
    auto.observe_layers(LayerObservation(misses_per_layer_step=0.6))
    one = auto.t_save(auto.effective_costs())
    assert one == pytest.approx(min(c.fill_fixed_s + c.fill_s, c.cpu_fixed_s + c.cpu_s))
    assert one > 1.8 * balance
    auto.observe_layers(LayerObservation(misses_per_layer_step=40.0))
    assert auto.miss_rate == pytest.approx(0.25 * 0.6 + 0.75 * 40.0)  # exponentially weighted
    many = auto.t_save(auto.effective_costs())
    assert balance * 0.8 < many < one
    for m in range(2, 33):  # near the balance value at every miss count, no jumps between neighbours
        auto.miss_rate = float(m)
        assert 0.85 * balance < auto.t_save(auto.effective_costs()) < 1.15 * balance, m


def test_measured_reuse_makes_a_layer_fill_every_miss():
    auto = AutoPolicy.from_bandwidths(Bandwidths(50.0, 150.0), ROW, num_layers=3, max_misses=16, reuse_prior=0.0)
    before = auto.fill_table().clone()
    assert auto.observe_layers(LayerObservation(reuse_net=[0, 400, -50], fills=[100, 100, 100]))
    t = auto.fill_table()
    assert t.shape == (3, 17) and t.dtype == torch.int32
    assert t[1].tolist() == list(range(17))  # reuse ~3.8 hits per fill: fill every miss
    assert torch.equal(t[0], before[0]) and torch.equal(t[2], before[2])  # no (or negative) reuse: the balance
    assert auto.num_fills(40, 1) == 40  # beyond the table: row M's ratio
    assert not auto.observe_layers(LayerObservation(reuse_net=[0, 0, 0], fills=[0, 0, 0]))  # nothing new


def test_optimistic_reuse_prior_keeps_filling_until_fills_show_no_reuse():
    """Costs measured on the GPU host at 15 threads (a CPU expert cheaper than a fill): after prefill,
    a window whose few fills were not requested again yet keeps filling every miss (a CPU-served expert
    would not be cached); a window of many fills with no net reuse (no locality) splits. The prior (4 hits a
    fill, worth 6 fills) outweighs a window of 3 fills a layer; 9 fills with 6 hits are evidence enough to split
    at these costs (on the GPU host a prior of 8, which kept that window filling, lost more in the first windows of
    the locality rows at 2-6 GB than it saved at 16 GB: ``docs/benchmarks/policy.md``)."""
    costs = MissCosts(fill_s=190e-6, fill_conc_s=190e-6, cpu_s=99e-6, cpu_conc_s=99e-6, fill_fixed_s=8e-6,
                      cpu_fixed_s=27e-6)
    layers = 48
    burst = LayerObservation(reuse_net=[2] * layers, fills=[3] * layers, misses_per_layer_step=4.6)
    auto = AutoPolicy(costs, num_layers=layers, max_misses=128, armed=False)
    auto.price_armed_branch(8e-6)
    auto.observe_layers(burst)
    assert auto.fills_every_miss()
    prior0 = AutoPolicy(costs, num_layers=layers, max_misses=128, armed=False, reuse_prior=0.0)
    prior0.price_armed_branch(8e-6)
    prior0.observe_layers(burst)
    assert not prior0.fills_every_miss()  # the self-confirming split the prior exists to avoid
    more = AutoPolicy(costs, num_layers=layers, max_misses=128, armed=False)
    more.price_armed_branch(8e-6)
    more.observe_layers(LayerObservation(reuse_net=[6] * layers, fills=[9] * layers, misses_per_layer_step=4.6))
    assert not more.fills_every_miss()
    auto.observe_layers(LayerObservation(reuse_net=[0] * layers, fills=[46] * layers, misses_per_layer_step=5.8))
    assert not auto.fills_every_miss()


def test_a_table_filling_on_the_priors_word_is_read_again_sooner(tiny_model_dir, monkeypatch):
    """Where the reuse prior alone makes the table fill more than the fills measured so far say (layer steps miss
    at least ``settle_min_misses`` times, the fills show no net reuse, fewer than ``settle_max_fills`` displacing
    fills a layer), the next window is read after ``settle_read_steps`` decode steps instead of
    ``REUSE_READ_STEPS``, so the split follows the evidence a few steps after it comes in. The balance controller
    still judges hand-offs over ``REUSE_READ_STEPS`` steps (or ``REUSE_READ_SECONDS``): the short windows' hand-offs
    add up. Not where the prior makes the table fill less; for at most ``settle_max_steps`` steps in a row. Rare
    misses, or the evidence in, keep the full window; the runtime reads at the policy's window."""
    from edgemoe import LLM, SamplingParams

    costs = MissCosts(fill_s=190e-6, fill_conc_s=190e-6, cpu_s=99e-6, cpu_conc_s=99e-6, fill_fixed_s=8e-6,
                      cpu_fixed_s=27e-6)
    layers, short = 4, AutoPolicy.settle_read_steps
    assert 1 < short < REUSE_READ_STEPS
    auto = AutoPolicy(costs, num_layers=layers, max_misses=128, armed=False)
    assert auto.read_window_steps == REUSE_READ_STEPS  # nothing measured yet
    # few fills (4 a layer): the prior's 6 fills of evidence outweigh them, the table fills more than they say
    auto.observe_layers(LayerObservation(reuse_net=[0] * layers, fills=[4] * layers, misses_per_layer_step=5.5))
    assert auto.read_window_steps == short
    on_prior, level = auto.num_fills(6), auto.cpu_level
    for _i in range(REUSE_READ_STEPS // short):  # every hand-off late at an unchanged step time: one level, once
        for _ in range(short):
            auto.observe(0.01, 1)
        assert auto.cpu_level == level
        auto.observe_layers(LayerObservation(handoffs=[4] * layers, late=[4] * layers, steps=short))
    assert auto.cpu_level == level + 1
    slow = AutoPolicy(costs, num_layers=layers, max_misses=128, armed=False)  # steps of 0.2 s: judged at once
    slow.observe_layers(LayerObservation(reuse_net=[0] * layers, fills=[12] * layers, misses_per_layer_step=5.5))
    for _ in range(short):
        slow.observe(0.2, 1)
    slow.observe_layers(LayerObservation(handoffs=[4] * layers, late=[4] * layers, steps=short))
    assert slow.read_window_steps == short and slow.cpu_level == 1
    auto.observe_layers(LayerObservation(reuse_net=[0] * layers, fills=[46] * layers, misses_per_layer_step=5.8))
    assert auto.read_window_steps == REUSE_READ_STEPS and auto.num_fills(6) < on_prior  # the evidence is in
    hot = AutoPolicy(costs, num_layers=layers, max_misses=128, armed=False)  # fills hit again more than the prior
    hot.observe_layers(LayerObservation(reuse_net=[200] * layers, fills=[12] * layers, misses_per_layer_step=5.5))
    assert hot.read_window_steps == REUSE_READ_STEPS  # says: the prior makes the table fill less, not more
    capped = AutoPolicy(costs, num_layers=layers, max_misses=128, armed=False)
    capped.settle_max_fills = 1e9  # fills too few to end it: the short windows stop after settle_max_steps
    capped.observe_layers(LayerObservation(reuse_net=[0] * layers, fills=[12] * layers, misses_per_layer_step=5.5))
    ran = 0
    while capped.read_window_steps == short and ran <= capped.settle_max_steps:
        capped.observe_layers(LayerObservation(reuse_net=[0] * layers, fills=[1] * layers, steps=short))
        ran += short
    assert ran == capped.settle_max_steps and capped.read_window_steps == REUSE_READ_STEPS
    rare = AutoPolicy(costs, num_layers=layers, max_misses=128, armed=False)
    rare.observe_layers(LayerObservation(reuse_net=[0] * layers, fills=[2] * layers, misses_per_layer_step=0.4))
    assert rare.read_window_steps == REUSE_READ_STEPS

    from edgemoe.engine import expert_runtime

    monkeypatch.setattr(expert_runtime, "REUSE_READ_SECONDS", 5.0)  # a slow step on a busy machine reads no sooner
    llm = LLM(str(tiny_model_dir), device="cpu", expert_policy="auto", expert_cache_slots=12,
              bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=1, progress=False)
    rt = llm.runner.experts
    pol, reads = rt.policy, []
    observe = pol.observe_layers
    pol.observe_layers = lambda obs: (changed := observe(obs), reads.append((rt._decode_steps, pol.read_window_steps)),
                                      changed)[0]
    pol.settle_read_steps = 3
    llm.generate(["Hi"], SamplingParams(max_tokens=6 * REUSE_READ_STEPS, temperature=0.0, ignore_eos=True))
    gaps = [(step - before, window) for (before, window), (step, _) in itertools.pairwise(reads)]
    assert (3, 3) in gaps  # the tiny model's first fills show no reuse
    assert all(gap == window for gap, window in gaps)  # at the policy's window


def test_misses_falling_fast_keep_filling_every_miss():
    """A cache taking in a new working set: windows whose fills show little reuse yet (it comes in later
    windows) but whose misses fall window over window fill every miss; once the misses level off the
    cost model's split applies again; level misses without reuse (no locality) split at once."""
    costs = MissCosts(fill_s=190e-6, fill_conc_s=190e-6, cpu_s=99e-6, cpu_conc_s=99e-6, fill_fixed_s=8e-6,
                      cpu_fixed_s=27e-6)
    layers = 48

    def window(misses: float) -> LayerObservation:
        return LayerObservation(reuse_net=[0] * layers, fills=[46] * layers, misses_per_layer_step=misses)

    auto = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)
    auto.observe_layers(window(5.8))
    assert not auto.fills_every_miss()  # the first window cannot tell a burst from no locality
    for m in (1.9, 0.5):  # the burst after a prefill (a cache that holds the working set): the misses halve and more
        auto.observe_layers(window(m))
        assert auto.misses_falling and auto.fills_every_miss()
    auto.observe_layers(window(0.35))  # falling slower now, and still no reuse measured: the split is back
    assert not auto.misses_falling and not auto.fills_every_miss()
    flat = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)
    for m in (5.8, 5.6, 6.0, 5.7):
        flat.observe_layers(window(m))
        assert not flat.misses_falling and not flat.fills_every_miss()
    small = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)  # a cache too small for the working set
    for m in (7.2, 4.3, 4.1, 3.8):  # the cold first decode step, then a level of about half the experts
        small.observe_layers(window(m))
        assert not small.misses_falling and not small.fills_every_miss()
    few = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)
    few.observe_layers(window(0.45))
    few.observe_layers(window(0.1))  # below falling_min_misses the fall says nothing
    assert not few.misses_falling


def test_misses_rising_from_a_held_working_set_fill_every_miss():
    """A cache that held the working set (few misses) meets a new one (the next request of a session): the window
    after the rise fills every miss, though the rise raised the miss rate and the CPU branch's expected gain; the
    falls that follow keep the hold, the level after them releases it. A rise from a level the cache was not
    holding (too small for the working set), from one whose misses found free slots (a cache filling up), or the
    first window of a cache, holds nothing."""
    costs = MissCosts(fill_s=190e-6, fill_conc_s=190e-6, cpu_s=99e-6, cpu_conc_s=99e-6, fill_fixed_s=8e-6,
                      cpu_fixed_s=27e-6)
    layers = 48

    def window(misses: float, free: int = 0) -> LayerObservation:
        return LayerObservation(reuse_net=[0] * layers, fills=[46] * layers, misses_per_layer_step=misses,
                                free_slot_fills=free)

    auto = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)
    for m in (5.8, 1.9, 0.5, 0.3, 0.3):  # the first request: its burst, then a cache holding its working set
        auto.observe_layers(window(m))
    assert not auto.misses_rose and not auto.fills_every_miss()
    auto.observe_layers(window(5.8))  # the next request's first decode steps
    assert auto.misses_rose and not auto.misses_falling and auto.fills_every_miss()
    for m in (1.9, 0.5):  # its misses halve as its working set comes in: the falling hold takes over
        auto.observe_layers(window(m))
        assert auto.misses_falling and not auto.misses_rose and auto.fills_every_miss()
    auto.observe_layers(window(0.35))
    assert not (auto.misses_falling or auto.misses_rose) and not auto.fills_every_miss()
    small = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)
    for m in (4.3, 4.1, 7.2, 4.2):  # a cache too small for the working set: the next request rises from a high level
        small.observe_layers(window(m))
        assert not small.misses_rose and not small.fills_every_miss()
    first = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)
    first.observe_layers(window(5.8))
    assert not first.misses_rose
    slight = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)
    for m in (0.3, 0.9):  # more misses, but below rising_min_misses: not a new working set
        slight.observe_layers(window(m))
    assert not slight.misses_rose
    filling = AutoPolicy(costs, num_layers=layers, max_misses=8, armed=False)  # a cold cache filling up
    filling.observe_layers(window(0.2, free=300))  # its misses found free slots: few were left to decide
    filling.observe_layers(window(5.9))  # full now: every miss is decided, no new working set
    assert not filling.misses_rose and not filling.fills_every_miss()


def test_runtime_reports_the_misses_that_found_a_free_slot(tiny_model_dir):
    """The runtime's observations split a window's decode misses: those that found a free slot (a cache filling
    up) in ``free_slot_fills``, the rest in ``misses_per_layer_step``. The slots the prefill took in are not decode
    fills: at every read the free-slot fills reported so far add up to the slots taken in since the prefill; once
    the cache is full a window reports none."""
    from edgemoe import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), device="cpu", expert_policy="auto", expert_cache_slots=30,
              bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=1, progress=False)
    rt = llm.runner.experts
    pol, seen = rt.policy, []
    observe = pol.observe_layers
    pol.observe_layers = lambda obs: (seen.append((obs, rt.cache.slots_used)), observe(obs))[1]
    llm.generate(["Hi"], SamplingParams(max_tokens=8 * REUSE_READ_STEPS, temperature=0.0, ignore_eos=True))
    prefill_fills = rt.hybrid.stats()["prefill"]["fills"]
    assert 0 < prefill_fills < rt.cache.num_slots  # the prefill left free slots for decode to fill
    assert len(seen) >= 4 and all(obs.free_slot_fills is not None for obs, _ in seen)
    total = 0
    for obs, used in seen:
        total += obs.free_slot_fills
        assert total == used - prefill_fills
    assert seen[0][0].free_slot_fills > 0
    assert seen[-1][1] == rt.cache.num_slots and seen[-1][0].free_slot_fills == 0


def test_free_slot_fills_before_a_prefill_count_in_the_window(tiny_model_dir):
    """Short requests back to back, so a window holds decode steps of two requests and the prefill between them: the
    free-slot fills of the decode steps before the prefill are reported with the window's (not taken for decided
    misses), and the prefill's own fills are not: at every read the free-slot fills reported so far add up to the
    slots taken in minus the prefills' fills (a cache with a slot for each of the tiny model's 48 (layer, expert)
    ids, so no fill evicts)."""
    from edgemoe import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), device="cpu", expert_policy="auto", expert_cache_slots=48,
              bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=1, progress=False)
    rt = llm.runner.experts
    assert rt.pool.num_ids == rt.cache.num_slots
    pol, seen = rt.policy, []
    observe = pol.observe_layers
    pol.observe_layers = lambda obs: (seen.append((obs.free_slot_fills, rt.cache.slots_used,
                                                   rt.hybrid.stats()["prefill"]["fills"])), observe(obs))[1]
    for prompt in ("Hi", "Tell me more", "And then?", "Why not", "What next", "Go on", "Once more", "Last one"):
        llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))  # 5 decode steps
    total = 0
    for free, used, prefill_fills in seen:
        total += free
        assert total == used - prefill_fills
    assert len(seen) >= 3 and total > 0


def test_runtime_reads_no_empty_window_and_pauses_the_window_clock_over_prefills(tiny_model_dir, monkeypatch):
    """A read covers decode steps that ran: after a prefill that took longer than ``REUSE_READ_SECONDS`` the first
    decode step is not preceded by a read of an empty window (no step, no miss: a miss rate of 0 that made the next
    window look like a rise and held every miss filling for a whole window). The window's clock pauses over a
    prefill: with decode steps of 2 s and ``REUSE_READ_SECONDS`` of 5 s a read comes every 3 decode steps, also
    where a window holds steps before and after a prefill of 10 s (counting the prefill would read after fewer
    steps; starting the clock again after it, after more). The clock is the runtime's own, advanced by the test."""
    from types import SimpleNamespace

    from edgemoe import LLM, SamplingParams
    from edgemoe.engine import expert_runtime

    offset = [0.0]
    monkeypatch.setattr(expert_runtime, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0]))
    monkeypatch.setattr(expert_runtime, "REUSE_READ_SECONDS", 5.0)
    llm = LLM(str(tiny_model_dir), device="cpu", expert_policy="auto", expert_cache_slots=12,
              bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=1, progress=False)
    rt = llm.runner.experts
    pol, begun, reads, prefills = rt.policy, [0], [], []
    pol.settle_max_steps = 0  # full windows only: the clock alone decides when to read
    observe, begin = pol.observe_layers, rt.begin_step
    pol.observe_layers = lambda obs: (reads.append(begun[0]), observe(obs))[1]

    def begin_step(step, phase, batch_size):
        offset[0] += 2.0  # the step before took 2 s
        begin(step, phase, batch_size)
        if phase is Phase.PREFILL:
            offset[0] += 10.0  # and this prefill takes 10 s more
            prefills.append(begun[0])
        begun[0] += phase is Phase.DECODE

    rt.begin_step = begin_step
    for prompt, n in (("Hi", 15), ("Tell me more", 16), ("And then?", 17)):
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    assert reads[0] == 3  # none before the first decode step ran
    assert all(b - a == 3 for a, b in itertools.pairwise(reads)), reads
    assert any(a < p < b for a, b in itertools.pairwise(reads) for p in prefills[1:])  # a window held a prefill


def test_fixed_costs_from_two_call_sizes():
    # t(n) = 20 us + n * 100 us for a copy, 150 us + n * 80 us for a CPU call
    row = 1_000_000

    def gbps(a, b, n):
        return n * row / (a + b * n) / 1e9

    fx = fixed_costs(row, (1, gbps(2e-5, 1e-4, 1)), (8, gbps(2e-5, 1e-4, 8)), (1, gbps(1.5e-4, 8e-5, 1)),
                     (4, gbps(1.5e-4, 8e-5, 4)))
    assert fx["fill_call_s"] == pytest.approx(2e-5) and fx["cpu_call_s"] == pytest.approx(1.5e-4)


def test_make_policy_auto_and_errors():
    pol = make_policy("auto", Bandwidths(10.0, 30.0), num_layers=4, max_misses=8, expert_bytes=ROW)
    assert pol.per_layer and pol.online and pol.fill_table().shape == (4, 9)
    with pytest.raises(NotImplementedError):
        pol.fill_rule()
    with pytest.raises(NotImplementedError):
        FillAllPolicy().fill_table()
    with pytest.raises(ValueError, match="expert_bytes"):
        AutoPolicy.from_bandwidths(Bandwidths(10.0, 30.0), 0, 1, 8)
    none = make_policy("auto", Bandwidths(None, None), num_layers=2, max_misses=8, expert_bytes=ROW)
    assert none.num_fills(5, 0) == 0  # no bandwidths (no cache to fill): everything on the CPU
    assert isinstance(pol.costs, MissCosts)


@pytest.mark.parametrize("rule", ["fill-all", "qstar"])
def test_cache_reuse_counters_equal_the_replay_accounting(rule):
    """The engine's ghost counters (ExpertCache.count_reuse through plan_step) equal the routing replay's
    net-reuse accounting of the same global LRU (SlotLRU), layer by layer."""
    L, E, k, S = 3, 10, 3, 9
    wl = uniform_workload(L, E, k, tokens=60, requests=2, seed=3)
    pol = FillAllPolicy() if rule == "fill-all" else QStarPolicy(Bandwidths(10.0, 25.0))
    cache = ExpertCache(S, L * E, None, torch.float32, torch.device("cpu"), num_experts=E)
    ref = SlotLRU(wl, S)
    resident_ghosts = 0  # steps after which a ghost was resident again (still charged to its displacer)
    for i, a in enumerate(wl.accesses):
        plan_step(cache, pol, dict(zip(a.ids, a.counts)), Phase.DECODE, a.step)
        ref.access(a, i, pol.num_fills)
        resident_ghosts += bool(((cache.ghost_slot >= 0) & (cache.slot_of >= 0)).any())
    assert resident_ghosts > 0
    assert cache.reuse[:, 0].tolist() == ref.reuse_net
    assert cache.reuse[:, 1].tolist() == ref.fills_by_layer
    assert sum(ref.fills_by_layer) > 0 and any(ref.reuse_net)
    cache.check_invariants()
    # ghosts point at slots whose owner displaced them (a ghost filled again keeps its displacer), never at their own
    for fid, slot in enumerate(cache.ghost_slot.tolist()):
        if slot >= 0:
            assert cache.slot_ghost[slot] == fid and cache.slot_of[fid] != slot


@pytest.mark.parametrize("prefetch, S, prompt", [(False, 9, 5), (True, 9, 5), (True, 6, 1)])
def test_reuse_counters_equal_the_replay_with_prefills_between_decodes(prefetch, S, prompt):
    """Requests of a prefill and 20 decode steps each: prefill fills form pairs (the cache's ``admit``) but the
    engine counts hits, ghost requests and displacing fills in decode steps only, and the replay does the same
    (it counted the prefill's fills and requests too, which made the simulator's ``auto`` read a higher reuse
    than the engine's). With next-layer prefetch (the engine's ``HybridExperts.prefetch_next`` before each
    decode step of a layer but the first, predictions partly wrong), the prefetched fills form pairs and are not
    counted either, on both sides; predicted experts that are resident are refreshed and not evicted, the
    experts of the layer before may be (its computation precedes the copies in stream order; 6 slots make them
    victims). (A prompt's prefill stays within one wave of fills: the replay fills a prefill one expert at a
    time where the engine takes a wave's victims at once.)"""
    L, E, k = 3, 10, 3
    rng = random.Random(7)
    recs, step = [], 0
    for r in range(3):
        step += 1
        for layer in range(L):
            recs.append(RouteRecord("t", 0, f"r{r}", "prefill", step, layer, list(range(prompt)),
                                    [rng.sample(range(E), k) for _ in range(prompt)], None))
        for t in range(20):
            step += 1
            for layer in range(L):
                ids = rng.sample(range(E), k)
                pred = [[*ids[:-1], rng.randrange(E)]] if prefetch else None  # the last one often wrong
                recs.append(RouteRecord("t", 0, f"r{r}", "decode", step, layer, [5 + t], [ids], None,
                                        predicted=pred))
    wl = build_workload(recs, TraceInfo([{"num_moe_layers": L, "num_experts": E, "top_k": k}]))
    assert {a.phase for a in wl.accesses} == {"prefill", "decode"}
    pol = FillAllPolicy()
    cache = ExpertCache(S, L * E, None, torch.float32, torch.device("cpu"), num_experts=E)
    ref = SlotLRU(wl, S)
    prefetched, prev = 0, None
    for i, a in enumerate(wl.accesses):
        if a.predicted and prev is not None and prev.step == a.step:  # after the layer before, in the same step
            hits, misses = cache.lookup(a.predicted)  # HybridExperts.prefetch_next on the cache
            cache.touch(list(hits.values()), a.step)
            victims = cache.choose_victims(len(misses), list(hits.values()), a.layer) if misses else []
            for fid, slot in zip(sorted(misses), victims):
                cache.admit(fid, slot, step=a.step)
            prefetched += len(victims)
            assert ref.prefetch(a, a.predicted, set(a.predicted), i) == len(victims)
        prev = a
        plan_step(cache, pol, dict(zip(a.ids, a.counts)), Phase.PREFILL if a.phase == "prefill" else Phase.DECODE,
                  a.step)
        ref.access(a, i, pol.num_fills)
        assert sorted(f for f, s in enumerate(cache.slot_of.tolist()) if s >= 0) == sorted(ref.res)
    assert (prefetched > 0) == prefetch
    sim = simulate(wl, "lru", S, prefetch=prefetch)  # the replay's own loop places the prefetches alike
    assert (sim.hits, sim.misses) == (cache.counters["decode"].hits, cache.counters["decode"].misses)
    assert cache.reuse[:, 0].tolist() == ref.reuse_net
    assert cache.reuse[:, 1].tolist() == ref.fills_by_layer and sum(ref.fills_by_layer) > 0


def test_reuse_is_positive_with_locality_and_near_zero_without():
    L, E, S = 2, 16, 8
    rng = random.Random(0)
    out = {}
    for name, draw in (("hot", lambda: rng.sample(range(4), 2) if rng.random() < 0.9 else rng.sample(range(E), 2)),
                       ("uniform", lambda: rng.sample(range(E), 2))):
        cache = ExpertCache(S, L * E, None, torch.float32, torch.device("cpu"), num_experts=E)
        for step in range(1, 1500):
            for layer in range(L):
                plan_step(cache, FillAllPolicy(), {layer * E + e: 1 for e in draw()}, Phase.DECODE, step)
        net, fills = cache.reuse.sum(0).tolist()
        out[name] = net / fills
    assert out["hot"] > 0.5
    assert abs(out["uniform"]) < 0.15


@pytest.mark.parametrize("partition", [False, True])
def test_fills_that_cycle_a_working_set_larger_than_the_cache_buy_no_reuse(partition):
    """Every step requests 6 of the same 8 experts per layer into 4 slots a layer, a quarter of the misses filled
    (the random model's own routing with a small cache): each fill displaces an expert as much in use as the one
    it brings, so one more fill buys no hit (per-layer LRU), or costs some (global LRU, whose victims are the
    experts the next layers route). The residents are hit several times per fill; counting those hits for the
    fills and letting a ghost filled again stop being charged (the accounting before) gave +0.96 (global) and
    +1.61 (per layer) a fill."""
    L, E, k = 3, 16, 8
    rng = random.Random(1)
    sets = [rng.sample(range(E), k) for _ in range(L)]
    cache = ExpertCache(4 * L, L * E, None, torch.float32, torch.device("cpu"), num_experts=E,
                        partition_layers=partition)
    pol = QStarPolicy(Bandwidths(10.0, 40.0))  # q = m / 4
    for step in range(1, 600):
        for layer in range(L):
            plan_step(cache, pol, {layer * E + e: 1 for e in rng.sample(sets[layer], 6)}, Phase.DECODE, step)
    net, fills = cache.reuse.sum(0).tolist()
    assert fills > 1000 and cache.counters["decode"].hits > 2.5 * fills
    assert net / fills < 0.1
    if partition:
        assert abs(net / fills) < 0.1


def test_engine_feeds_auto_between_steps_and_outputs_stay_exact(tiny_model_dir):
    """Greedy tokens under auto equal fill-all's (placement only); the runtime reads the cache's reuse
    counters every few decode steps and the policy's table follows them."""
    from edgemoe import LLM, SamplingParams

    params = SamplingParams(max_tokens=3 * REUSE_READ_STEPS, temperature=0.0, ignore_eos=True)
    prompt = "Tell me about the number 42 and why"
    toks = {}
    for policy in ("fill-all", "auto"):
        llm = LLM(str(tiny_model_dir), device="cpu", expert_policy=policy, expert_cache_slots=12,
                  bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=1, progress=False)
        toks[policy] = llm.generate([prompt], params)[0].outputs[0].token_ids
        rt = llm.runner.experts
        if policy == "auto":
            assert rt.policy.per_layer and any(r != 0 for r in rt.policy.reuse)  # the counters reached it
            st = rt.stats()["decode"]
            assert st["fills"] > 0 and st["misses"] == st["fills"] + st["cpu"]
    assert toks["auto"] == toks["fill-all"]


def test_runtime_times_the_cpu_probe_the_policy_asks_for(tiny_model_dir):
    """With the CPU priced out (the level at its bound, the table filling every miss where level 0 would split) the
    runtime times a
    CPU-speed probe at its next read (one executor call over ``cpu_probe_experts`` pool experts) and
    hands it to the policy, which sets the level from it; at level 0 no probe is asked or run."""
    from edgemoe import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), device="cpu", expert_policy="auto", expert_cache_slots=12,
              bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=1, progress=False)
    rt = llm.runner.experts
    pol, seen = rt.policy, []
    observe = pol.observe_layers

    def record(obs):
        before = pol.cpu_level
        changed = observe(obs)
        seen.append((before, obs.cpu_probe, pol.cpu_level))
        return changed

    pol.observe_layers = record
    # a measured miss rate without reuse: the table would split at level 0, so the CPU's price is what fills
    pol.observe_layers(LayerObservation(reuse_net=[0] * pol.L, fills=[60] * pol.L, misses_per_layer_step=3.0))
    seen.clear()
    pol.cpu_level = pol.balance_levels[1]
    pol._rebuild()
    assert pol.fills_every_miss() and pol.wants_cpu_probe == pol.cpu_probe_experts
    llm.generate(["Tell me about the number 42 and why"],
                 SamplingParams(max_tokens=2 * REUSE_READ_STEPS + 2, temperature=0.0, ignore_eos=True))
    probes = [(before, p, after) for before, p, after in seen if p is not None]
    assert probes and all(p[0] == pol.cpu_probe_experts and p[1] > 0 for _, p, _ in probes)
    before, (n, t), after = probes[0]
    model = pol.costs.cpu_fixed_s + n * pol.costs.cpu_s
    follows = t <= pol.cpu_probe_return * model
    assert before == pol.balance_levels[1]
    assert after == (min(before, max(0, math.ceil(8 * math.log2(t / model)))) if follows else before)
    assert all(p is None for before, p, _ in seen if before == 0)


def test_per_layer_lru_partitions_and_matches_the_replay():
    """The engine's per-layer LRU (ExpertCache.partition_layers through plan_step) keeps each layer's fills
    in its share of the slots and misses within 2 % of the replay's LayerLRU (they differ only in how
    equal recencies are ordered); with fewer slots than layers it stays global."""
    from edgemoe.bench.replay import simulate

    wl = uniform_workload(4, 16, 3, tokens=150, requests=2, seed=1)
    for slots in (8, 13, 30):
        a, b = simulate(wl, "layer-lru", slots), simulate(wl, "layer-lru-engine", slots)
        assert abs(a.misses - b.misses) <= 0.02 * a.misses
    c = ExpertCache(10, 4 * 16, None, torch.float32, torch.device("cpu"), num_experts=16, partition_layers=True)
    assert [c.victim_range(layer) for layer in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert c.victim_range(None) == (0, 10)
    assert c.evictable([], layer=1) == 3 and c.choose_victims(5, [], layer=2) == [6, 7]
    small = ExpertCache(3, 4 * 16, None, torch.float32, torch.device("cpu"), num_experts=16, partition_layers=True)
    assert not small.partition_layers and small.victim_range(2) == (0, 3)


def test_next_layer_prefetch_keeps_greedy_tokens(tiny_model_dir):
    """--prefetch next-layer only changes placement: greedy tokens equal those without it, on CPU."""
    from edgemoe import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["Tell me about the number 42 and why", "List three colours"]
    out, stats = {}, {}
    for prefetch in ("off", "next-layer"):
        llm = LLM(str(tiny_model_dir), device="cpu", expert_policy="qstar", expert_cache_slots=20, prefetch=prefetch,
                  bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=2, progress=False)
        out[prefetch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats[prefetch] = llm.runner.experts.stats()
    assert out["next-layer"] == out["off"]
    pf = stats["next-layer"]["prefetch"]
    assert pf["prefetched"] > 0 and 0 <= pf["prefetch_hits"] <= pf["prefetched"]
    assert stats["off"]["prefetch"]["prefetched"] == 0


def test_an_armed_branch_that_saves_less_than_it_costs_is_dropped():
    costs = MissCosts(fill_s=170e-6, fill_conc_s=190e-6, cpu_s=90e-6, cpu_conc_s=100e-6, fill_fixed_s=15e-6,
                      cpu_fixed_s=60e-6)
    auto = AutoPolicy(costs, num_layers=4, max_misses=8, armed=False, reuse_prior=0.0)
    auto.observe_layers(LayerObservation(misses_per_layer_step=4.0))
    assert not auto.fills_every_miss()  # four misses a layer: the CPU branch pays
    assert not auto.price_armed_branch(8e-6)  # and still does when it costs 8 µs a layer step
    assert not auto.fills_every_miss()
    for _ in range(8):  # nearly every expert hits: the branch would save less than its launches
        auto.observe_layers(LayerObservation(misses_per_layer_step=0.05))
    assert auto.fills_every_miss()
    assert auto.fill_table().tolist() == [list(range(9))] * 4
    auto.price_armed_branch(0.0)  # free when idle: the cost model's own split again
    assert not auto.fills_every_miss()
    fresh = AutoPolicy(costs, num_layers=4, max_misses=8, armed=False, reuse_prior=0.0)
    assert not fresh.fills_every_miss()
    fresh.price_armed_branch(8e-6)  # a new cache: every miss fills until a miss rate is measured
    assert fresh.fills_every_miss()


def test_a_resized_cache_keeps_what_auto_learned_of_the_machine():
    """``AutoPolicy.inherit``: the branch-cost fits' samples and the CPU cost level carry over to the policy of a
    resized cache; the reuse of a fill, the miss rate and the falling-window test start over; another policy
    inherits nothing. A probe carried into windows without hand-offs (no device path) is dropped at the first."""
    bw = Bandwidths(53.0, 98.7)
    old = AutoPolicy.from_bandwidths(bw, ROW, num_layers=2, max_misses=16)
    for _ in range(3):  # joins that never waited: the CPU side is cheaper than modeled
        old.observe_layers(LayerObservation(handoffs=[20, 20], late=[0, 0], reuse_net=[3, 3], fills=[60, 60],
                                            misses_per_layer_step=4.0, cpu_samples=[(4, 2e-4, False)] * 6))
    assert old.cpu_level == -7 and old.miss_rate is not None and old.costs != old.prior
    new = AutoPolicy.from_bandwidths(bw, ROW, num_layers=2, max_misses=16)
    fresh = [new.num_fills(m) for m in range(1, 17)]
    new.inherit(old)
    assert new.cpu_level == old.cpu_level and new.costs == old.costs
    assert [new.num_fills(m) for m in range(1, 17)] != fresh
    assert (new.miss_rate is None and new.reuse == [new.reuse_prior] * 2 and not new.misses_falling
            and not new.misses_rose)
    other = AutoPolicy.from_bandwidths(bw, ROW, num_layers=2, max_misses=16)
    assert not other.inherit(QStarPolicy(bw)) and other.cpu_level == 0
    remeasured = AutoPolicy.from_bandwidths(Bandwidths(40.0, 98.7), ROW, num_layers=2, max_misses=16)
    remeasured.inherit(old)  # another prior: the level measured against the old model is not carried
    assert remeasured.cpu_level == 0 and remeasured.cpu_fit.sw == old.cpu_fit.sw > 0
    old._probing = True  # a probe in flight, carried into a run whose windows count no hand-offs (no device path)
    eager = AutoPolicy.from_bandwidths(bw, ROW, num_layers=2, max_misses=16)
    eager.inherit(old)
    assert eager.read_window_steps == 1
    eager.observe_layers(LayerObservation(reuse_net=[0, 0], fills=[0, 0]))  # nothing judges it: full windows again
    assert eager.read_window_steps == REUSE_READ_STEPS


def test_resize_inherits_and_a_rebuilt_cache_starts_from_the_prior(tiny_model_dir):
    """The runtime hands the old policy to the new one on a resize of the same policy (the elastic budget, the
    admin endpoint), not when the cache is set anew (a benchmark's run, a change of thread count) or the
    policy changes."""
    from edgemoe import LLM

    llm = LLM(str(tiny_model_dir), device="cpu", expert_policy="auto", expert_cache_slots=12,
              bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=1, progress=False)
    rt = llm.runner.experts
    rt.policy.cpu_level = -5
    rt.resize(slots=16)
    assert rt.cache.num_slots == 16 and rt.policy.cpu_level == -5
    rt.set_cache(16, "auto")
    assert rt.policy.cpu_level == 0
    rt.policy.cpu_level = -5
    rt.resize(policy="qstar")
    rt.resize(policy="auto")
    assert rt.policy.cpu_level == 0


def test_a_cycle_over_an_edge_of_the_table_settles_on_the_faster_level():
    """Where one level's split makes nearly every hand-off late and the next level's makes few late (an integer
    split the band cannot hold), the sign feedback goes back and forth between them; once a level comes back
    within ``balance_cycle_windows`` windows the controller keeps the level whose window stepped fastest, for
    ``balance_hold_windows`` windows, then judges again; a change of the steps' pace ends the hold at once."""
    auto = AutoPolicy.from_bandwidths(Bandwidths(53.0, 98.7), ROW, num_layers=2, max_misses=16, reuse_prior=0.0)
    late, early = LayerObservation(handoffs=[20, 20], late=[20, 18]), LayerObservation(handoffs=[20, 20], late=[2, 2])
    speed = {0: 0.012, 1: 0.010}  # level 1 (more fills) steps faster, yet its hand-offs are seldom late

    def window(obs: LayerObservation, step_s: float | None = None) -> None:
        for _ in range(8):
            auto.observe(speed[auto.cpu_level] if step_s is None else step_s, 1)
        auto.observe_layers(obs)

    window(late)  # at 0: late, up to 1
    assert auto.cpu_level == 1
    window(early)  # at 1: early, back to 0, a level seen two windows ago: the faster one (1) is kept
    assert auto.cpu_level == 1
    for _ in range(auto.balance_hold_windows):
        window(early)  # held: early windows do not move it
        assert auto.cpu_level == 1
    window(early)  # the hold is over: judged again
    assert auto.cpu_level == 0
    window(late)
    assert auto.cpu_level == 1  # back at 1: a cycle again, level 1 still the faster
    window(early, step_s=0.02)  # held, but the steps run at another pace (another process): judged at once
    assert auto.cpu_level == 0


def test_a_monotone_walk_is_not_a_cycle():
    """Levels that only rise (a CPU slowing down) or only fall are followed window by window, and a level held
    at its bound is no cycle either."""
    auto = AutoPolicy.from_bandwidths(Bandwidths(53.0, 98.7), ROW, num_layers=2, max_misses=16, reuse_prior=0.0)
    late = LayerObservation(handoffs=[20, 20], late=[20, 18])
    levels = []
    for i in range(5):
        for _ in range(8):
            auto.observe(0.01 * (1 + 0.05 * i), 1)
        auto.observe_layers(late)
        levels.append(auto.cpu_level)
    assert levels == [1, 3, 7, 11, 15]
    for i in range(12):
        for _ in range(8):
            auto.observe(0.01 * (1.3 + 0.01 * i), 1)  # slower and slower: an arbitration would go back down
        auto.observe_layers(late)
    assert auto.cpu_level == auto.balance_levels[1]


def _reference_table(auto: AutoPolicy, level: int) -> tuple[list[list[int]], float | None]:
    """The table and the armed branch's expected gain as the cost model defines them, layer by layer and miss count
    by miss count (no memo): the reference for the memoized :class:`~edgemoe.experts.policy.HullRows`. The hulls are
    the policy's own for ``level`` (built at the costs of the time, kept while the estimates stay within
    ``rebuild_tolerance``); the fill values and the gain are those of the current costs."""
    c = auto.effective_costs(level)
    hulls = auto._hulls_by_level[level].hulls
    t_save = auto.t_save(c)
    values = [max(r, 0.0) * t_save for r in auto.reuse]
    table = [[next(h[i] for i in reversed(range(len(h))) if slopes[i] <= v) for h, slopes in hulls] for v in values]
    if auto.miss_rate is None:
        return table, None
    p = auto.miss_rate / auto.M
    pmf = [math.comb(auto.M, m) * p ** m * (1 - p) ** (auto.M - m) for m in range(auto.M + 1)]
    split = [[c.split_seconds(m, q, auto.armed) for q in range(m + 1)] for m in range(auto.M + 1)]
    gain = sum(w * ((split[m][m] - v * m) - (split[m][q] - v * q))
               for row, v in zip(table, values) for m, (q, w) in enumerate(zip(row, pmf)) if q < m)
    return table, gain


def test_memoized_table_rows_equal_the_cost_models_choice_per_layer_and_miss_count():
    """The table ``auto`` builds from memoized rows (one per interval between the hulls' slopes) is, for every layer
    and miss count, the vertex the cost model picks for that layer's fill value; ``fills_every_miss`` and the armed
    branch's pricing agree with the table spelled out (random costs, reuse counts, miss rates and levels, and cost
    estimates that drift by less than the rebuild tolerance between windows: the hulls stay, the pricing follows)."""
    fills_all_seen = split_seen = 0
    for seed in range(8):
        rnd = random.Random(seed)
        fill, cpu = rnd.uniform(50e-6, 400e-6), rnd.uniform(30e-6, 400e-6)
        costs = MissCosts(fill_s=fill, fill_conc_s=fill * rnd.uniform(1, 1.3), cpu_s=cpu,
                          cpu_conc_s=cpu * rnd.uniform(1, 1.3), fill_fixed_s=rnd.uniform(0, 20e-6),
                          cpu_fixed_s=rnd.uniform(0, 60e-6))
        layers, max_misses = rnd.choice([(4, 8), (16, 64), (48, 128)])
        auto = AutoPolicy(costs, num_layers=layers, max_misses=max_misses, armed=False)
        armed_cost = rnd.choice([0.0, 2e-6, 8e-6, 30e-6])
        auto.price_armed_branch(armed_cost)
        for _ in range(20):
            hi = rnd.choice([1, 4, 12])
            obs = LayerObservation(reuse_net=[rnd.randint(-4, hi) for _ in range(layers)],
                                   fills=[rnd.randint(0, 12) for _ in range(layers)],
                                   misses_per_layer_step=rnd.choice([0.05, 0.4, 1.5, 3.0, 6.0]), steps=8,
                                   free_slot_fills=0)
            auto.cpu_level = rnd.randint(-8, 16)
            if rnd.random() < 0.5:  # the estimates move a little (the fits of measured fills and CPU calls)
                auto.costs = replace(costs, fill_s=costs.fill_s * rnd.uniform(0.995, 1.005),
                                     cpu_s=costs.cpu_s * rnd.uniform(0.995, 1.005))
            auto.observe_layers(obs)
            want, gain = _reference_table(auto, auto.cpu_level)
            held = auto.misses_falling or auto.misses_rose
            if not held and armed_cost > 0 and gain is not None:
                if abs(gain - layers * armed_cost) < 1e-12:
                    continue  # a tie within rounding: either answer is the model's
                held = gain <= layers * armed_cost
            if held:
                want = [list(range(max_misses + 1))] * layers
            assert auto._table == want
            assert torch.equal(auto.fill_table(), torch.tensor(want, dtype=torch.int32))  # stacked from kept rows
            assert auto.fills_every_miss() == all(row == list(range(max_misses + 1)) for row in want)
            fills_all_seen += auto.fills_every_miss()
            split_seen += not auto.fills_every_miss()
    assert split_seen and fills_all_seen  # the random cases reach both kinds of table


def test_hull_rows_at_and_beside_every_slope_are_the_cost_models_choice():
    """:class:`~edgemoe.experts.policy.HullRows` looks a row up by the interval of the fill value between the hulls'
    slopes: at each slope itself (ties go to the larger fill count) and just below and above it, the memoized row is
    the last vertex whose slope is at most the value, for every miss count."""
    from edgemoe.experts.policy import HullRows

    rnd = random.Random(5)
    split = [[rnd.uniform(0, 1e-3) + 2e-4 * abs(q - rnd.randint(0, m)) for q in range(m + 1)] for m in range(33)]
    rows = HullRows(split)
    assert len(rows.breaks) > 10
    for x in rows.breaks:
        for v in (math.nextafter(x, -math.inf), x, math.nextafter(x, math.inf)):
            want = [next(h[i] for i in reversed(range(len(h))) if slopes[i] <= v) for h, slopes in rows.hulls]
            assert rows.row(v) == want
    assert rows.row(math.inf) is rows.full  # every hull ends at q = m


def test_an_arbitration_that_repeats_its_answer_holds_twice_as_long():
    """Each cycle arbitration that keeps the level the one before kept holds it twice as long (exponential backoff, up
    to ``balance_hold_max`` windows); a change of the steps' pace breaks the hold and the next one starts short."""
    auto = AutoPolicy.from_bandwidths(Bandwidths(53.0, 98.7), ROW, num_layers=2, max_misses=16, reuse_prior=0.0)
    late, early = LayerObservation(handoffs=[20, 20], late=[20, 18]), LayerObservation(handoffs=[20, 20], late=[2, 2])
    speed = {-1: 0.011, 0: 0.012, 1: 0.010}  # level 1 steps fastest, yet its hand-offs are seldom late: a cycle

    def window(obs: LayerObservation, step_s: float | None = None) -> None:
        for _ in range(8):
            auto.observe(speed[auto.cpu_level] if step_s is None else step_s, 1)
        auto.observe_layers(obs)

    def held_windows(obs: LayerObservation) -> int:
        """Windows of ``obs`` judged at the current level before the controller moves off it."""
        level, n = auto.cpu_level, 0
        while True:
            window(obs)
            if auto.cpu_level != level:
                return n
            n += 1

    window(late)
    window(early)  # the first cycle: level 1 kept
    assert auto.cpu_level == 1
    holds = []
    for _ in range(5):
        holds.append(held_windows(early))  # the hold, then the window that judges again and moves down
        window(late)  # back up to 1: a cycle again, the same answer
        assert auto.cpu_level == 1
    base, cap = auto.balance_hold_windows, auto.balance_hold_max
    assert holds == [min(base * 2 ** i, cap) for i in range(5)]
    window(early, step_s=0.02)  # another pace: the hold breaks and the level is judged at once
    assert auto.cpu_level == 0
    window(late)  # back to 1, seen in the slow window: a cycle whose arbitration keeps 0 (the faster window there)
    assert auto.cpu_level == 0
    assert held_windows(early) == base  # the hold after the break starts short again


def test_runtime_halves_a_graded_join_count_and_pushes_the_limits_between_tables(tiny_model_dir):
    """The runtime's read of the device path's join counts: a graded count (``late_unit`` 2, halves) reaches the
    policy as hand-offs and weights (halved), and the join limits are pushed after every read, with the table when it
    changed and alone when it did not (the balance level moves the CPU's price without a new table). The device path
    here is a recording stand-in on the CPU (the graded join runs only on CUDA: tests/gpu/test_join_lateness_gpu.py)."""
    from edgemoe import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), device="cpu", expert_policy="auto", expert_cache_slots=30,
              bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, max_num_seqs=1, progress=False)
    rt = llm.runner.experts
    llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    layers = rt.cache.num_layers

    class Recording:
        counts_joins, late_unit, prefetch_counters = True, 2, None

        def counter_dict(self):
            return {"hits": 0, "misses": 0, "fills": 0, "cpu": 0}

        def __init__(self):
            self.join_stats = torch.zeros(layers, 2, dtype=torch.int64)
            self.pushed: list[str] = []

        def push_policy(self):
            self.pushed.append("table")

        def push_join_limits(self):
            self.pushed.append("limits")

        def close(self):
            pass

    dd, seen = Recording(), []
    observe, changed = rt.policy.observe_layers, iter([True, False])
    rt.policy.observe_layers = lambda obs: (seen.append(obs), observe(obs), next(changed))[2]
    rt.hybrid.device_decode = dd
    try:
        rt._observe_reuse()
        dd.join_stats[:, 0] += 10
        dd.join_stats[:, 1] += torch.arange(layers) * 3  # halves: 0, 3, 6, ... of 10 hand-offs
        rt._observe_reuse()
    finally:
        rt.hybrid.device_decode = None
    assert seen[1].handoffs == [10] * layers
    assert seen[1].late == [1.5 * layer for layer in range(layers)]
    assert dd.pushed == ["table", "limits"]
