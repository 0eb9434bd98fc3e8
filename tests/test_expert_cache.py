"""Expert cache, q* policy and hybrid executor properties (CPU; the "device" cache is a host buffer)."""

from __future__ import annotations

import random

import pytest
import torch

from edgemoe.core import Phase
from edgemoe.experts.cache import ExpertCache, _set_where
from edgemoe.experts.compute import swiglu_expert
from edgemoe.experts.cpu_executor import TorchCpuExecutor
from edgemoe.experts.hybrid import SMALL_GROUPING_ROUTES, HybridExperts, group_routes, plan_step
from edgemoe.experts.policy import Bandwidths, CpuAllPolicy, FillAllPolicy, QStarPolicy, StaticPolicy, make_policy
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

# every row format: float rows computed in place, quantized rows dequantized (float32 compute)
FORMATS = [WeightFormat.FP32, WeightFormat.FP8_BLOCK, WeightFormat.MXFP4, WeightFormat.NVFP4]
H = 32  # MXFP4 needs multiples of 32


def _cache(slots: int, ids: int = 40) -> ExpertCache:
    return ExpertCache(slots, ids, ExpertLayout.build(WeightFormat.FP32, 2, 2), torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------- residency tables and LRU
def test_residency_and_owner_tables_stay_inverse_under_random_traffic():
    rng = random.Random(0)
    c = _cache(7)
    for step in range(1, 400):
        ids = rng.sample(range(40), rng.randint(1, 6))
        hits, misses = c.lookup(ids)
        c.touch(list(hits.values()), step)
        victims = c.choose_victims(len(misses), exclude=list(hits.values()))
        assert not set(victims) & set(hits.values()), "a slot needed this step was chosen as a victim"
        for fid, slot in zip(misses, victims):
            c.admit(fid, slot, step)
        c.check_invariants()
        assert c.slots_used <= 7


@pytest.mark.parametrize("value", [-1, 7])
def test_masked_table_update_without_boolean_indexing(value):
    """``_set_where`` equals ``table[index[mask]] = value``, including masked-off entries (-1, clamped to index 0)
    beside a masked-on entry at index 0, and leaves every other entry alone."""
    g = torch.Generator().manual_seed(value + 2)
    for _ in range(50):
        table = torch.randint(-1, 20, (12,), generator=g)
        index = torch.randperm(12, generator=g)[:6]
        mask = torch.rand(6, generator=g) < 0.5
        index = torch.where(mask | (torch.rand(6, generator=g) < 0.5), index, -1)
        mask &= index >= 0
        if 0 in index[mask].tolist() or bool(torch.rand(1, generator=g) < 0.5):
            index[~mask] = -1  # masked-off entries at -1 land on index 0 too
        vals = torch.full((6,), value) if value == -1 else torch.randint(0, 30, (6,), generator=g)
        want = table.clone()
        want[index[mask]] = vals[mask]
        _set_where(table, index, mask, vals if value != -1 else -1)
        assert torch.equal(table, want)


def test_lru_evicts_least_recently_used_and_free_slots_first():
    c = _cache(3)
    assert c.choose_victims(3, exclude=[]) == [0, 1, 2]  # all free
    for step, fid in enumerate([10, 11, 12], start=1):
        c.admit(fid, c.choose_victims(1, exclude=[])[0], step)
    c.touch([int(c.slot_of[10])], 4)  # 10 becomes most recent: order now 11, 12, 10
    assert c.choose_victims(3, exclude=[]) == [int(c.slot_of[11]), int(c.slot_of[12]), int(c.slot_of[10])]
    assert c.choose_victims(1, exclude=[int(c.slot_of[11])]) == [int(c.slot_of[12])]
    c.pinned[int(c.slot_of[12])] = True
    assert c.choose_victims(3, exclude=[int(c.slot_of[11])]) == [int(c.slot_of[10])]
    assert c.evictable(exclude=[int(c.slot_of[11])]) == 1


def test_move_indexed_moves_rows_and_tables_where_valid_only():
    c = _cache(8)
    c.bank.copy_(torch.arange(c.bank.numel(), dtype=torch.uint8).view(c.bank.shape))
    for fid, slot in [(3, 0), (5, 1), (9, 2)]:
        c.admit(fid, slot, 1)
    c.admit(11, 3, 2)  # displaces nothing: a free slot; then 12 displaces 11 from slot 3 (a ghost pair on slot 3)
    c.admit(12, 3, 2)
    assert int(c.slot_ghost[3]) == 11
    rows = c.bank.clone()
    src, dst = torch.tensor([0, 1, 3]), torch.tensor([5, 6, 7])
    c.move_indexed(src, dst, torch.tensor([True, False, True]), step=4)
    c.check_invariants()
    assert c.slot_of[3] == 5 and c.slot_of[12] == 7 and c.slot_of[5] == 1  # 5 not moved
    assert c.owner_of.tolist() == [-1, 5, 9, -1, -1, 3, -1, 12]
    assert c.last_used.tolist() == [-1, 1, 1, -1, -1, 4, -1, 4]
    assert torch.equal(c.bank[5], rows[0]) and torch.equal(c.bank[7], rows[3]) and torch.equal(c.bank[6], rows[6])
    assert int(c.slot_ghost[3]) == -1 and int(c.ghost_slot[11]) == -1  # the moved expert displaced nobody


def test_admit_evicts_previous_owner():
    c = _cache(2)
    c.admit(5, 0, 1)
    c.admit(6, 0, 2)
    assert int(c.slot_of[5]) == -1 and int(c.slot_of[6]) == 0 and int(c.owner_of[0]) == 6
    with pytest.raises(RuntimeError):  # an expert is never resident twice
        c.admit(6, 1, 3)


def test_zero_slot_cache_has_no_victims():
    c = _cache(0)
    assert c.choose_victims(4, exclude=[]) == []
    assert c.lookup([1, 2]) == ({}, [1, 2])


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
@pytest.mark.parametrize("policy", [CpuAllPolicy(), FillAllPolicy(), QStarPolicy(Bandwidths(10.0, 15.0))])
def test_zero_slot_cache_plans_every_expert_on_the_cpu_most_routed_first(phase, policy):
    """The empty cache's shortcut: what the general rule gives with nothing resident and nothing to fill
    (most-routed first, ties in the step's order), counters included, tables untouched."""
    c = _cache(0)
    tables = [t.clone() for t in (c.slot_of, c.ghost_slot, c.reuse)]
    tpe = {7: 1, 3: 2, 11: 1, 5: 4, 2: 2}
    plan = plan_step(c, policy, tpe, phase, step=3)
    assert plan.hits == {} and plan.waves == [] and plan.cpu == [5, 3, 2, 7, 11]
    n = c.counters[phase.value]
    assert (n.hits, n.misses, n.fills, n.cpu) == (0, 5, 0, 5)
    assert all(torch.equal(a, b) for a, b in zip(tables, (c.slot_of, c.ghost_slot, c.reuse)))


# ---------------------------------------------------------------- q* policy
@pytest.mark.parametrize("m", [0, 1, 2, 5, 8, 64])
def test_qstar_edges(m):
    p = QStarPolicy(Bandwidths(10.0, 40.0))
    q = p.num_fills(m)
    assert 0 <= q <= m
    if m == 0:
        assert q == 0
    else:
        assert q >= 1  # at least one fill keeps the cache warming


def test_qstar_formula_and_rounding():
    p = QStarPolicy(Bandwidths(10.0, 40.0))  # q*/m = 0.25
    assert [p.num_fills(m) for m in (1, 2, 3, 4, 6, 8, 10)] == [1, 1, 1, 1, 2, 2, 3]  # 1.5 -> 2, 2.5 -> 3
    assert p.q_ratio() == pytest.approx(0.25)
    assert QStarPolicy(Bandwidths(30.0, 40.0)).num_fills(8) == 6


@pytest.mark.parametrize("bp,bh", [(50.0, 50.0), (55.0, 31.0)])
def test_qstar_fills_everything_when_cpu_is_not_faster(bp, bh):
    p = QStarPolicy(Bandwidths(bp, bh))
    assert [p.num_fills(m) for m in range(6)] == list(range(6))


def test_policies():
    bw = Bandwidths(10.0, 40.0)
    assert isinstance(make_policy("qstar", bw), QStarPolicy)
    assert FillAllPolicy().num_fills(7) == 7 and CpuAllPolicy().num_fills(7) == 0
    assert isinstance(make_policy("static", bw), StaticPolicy) and not StaticPolicy().admits
    with pytest.raises(ValueError):
        make_policy("lfu", bw)
    with pytest.raises(ValueError):
        QStarPolicy(Bandwidths(-1.0, 10.0))
    assert QStarPolicy(Bandwidths(None, None)).num_fills(5) == 0  # no cache to fill: CPU does it


# ---------------------------------------------------------------- hybrid executor vs dense reference
def _setup(slots: int, policy, layers: int = 3, E: int = 8, I: int = 32, seed: int = 0,
           fmt: WeightFormat = WeightFormat.FP32):
    pool = HostExpertPool(layers * E, ExpertLayout.build(fmt, H, I), torch.float32)
    pool.fill_random(seed, std=1.0)
    cache = ExpertCache(slots, layers * E, pool.layout, torch.float32, torch.device("cpu"))
    return pool, HybridExperts(pool, cache, policy, TorchCpuExecutor(pool), E, torch.device("cpu"))


def _dense(pool, layer, x, ids, w, E):
    """The reference: every route through the reference dequantization of its row (float rows: the row)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            fid = layer * E + int(ids[t, j])
            w13, w2 = pool.layout.dequant_rows(pool.bank, [fid])
            out[t] += w[t, j] * swiglu_expert(x[t:t + 1], w13[0], w2[0])[0]
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.value for f in FORMATS])
@pytest.mark.parametrize("policy", [QStarPolicy(Bandwidths(10.0, 30.0)), FillAllPolicy(), CpuAllPolicy(),
                                    StaticPolicy()])
@pytest.mark.parametrize("T,phase", [(1, Phase.DECODE), (3, Phase.DECODE), (20, Phase.DECODE), (9, Phase.PREFILL)])
def test_hybrid_output_is_exact_for_every_policy(policy, T, phase, fmt):
    E, k = 8, 3
    pool, hy = _setup(slots=5, policy=policy, fmt=fmt)  # smaller than one layer's experts
    g = torch.Generator().manual_seed(T)
    for step in range(1, 8):
        layer = step % 3
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        got = hy.forward(layer, x, ids, w, phase, step)
        torch.testing.assert_close(got, _dense(pool, layer, x, ids, w, E), rtol=1e-4, atol=1e-4)
        hy.cache.check_invariants()
        assert hy.cache.slots_used <= 5
    c = hy.cache.counters[phase.value]
    assert c.misses == c.fills + c.cpu
    if isinstance(policy, CpuAllPolicy):
        assert c.fills == 0


def test_cpu_only_step_hands_the_executor_every_expert_in_id_order_with_its_routes_in_order():
    """A step with every route on the CPU builds its work with one sort; the executor must get what one
    mask per expert gives (ascending ids, each expert's (token, k) routes ascending), so the float32
    sum over routes keeps its order and the output its bits."""
    E, k, T = 8, 3, 6
    pool, hy = _setup(slots=0, policy=CpuAllPolicy())
    seen = []

    class Recording(TorchCpuExecutor):
        def run(self, x, work, out):
            seen.append([(f, tok.tolist(), wt.tolist()) for f, tok, wt in work])
            super().run(x, work, out)

    hy.cpu = Recording(pool)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # experts shared across tokens
    w = torch.rand(T, k, generator=g)
    got = hy.forward(1, x, ids, w, Phase.DECODE, 1)
    flat = ids + E
    want = []
    for f in sorted(set(flat.flatten().tolist())):
        tok, kpos = (flat == f).nonzero(as_tuple=True)
        want.append((f, tok.tolist(), w[tok, kpos].tolist()))
    assert seen == [want]
    torch.testing.assert_close(got, _dense(pool, 1, x, ids, w, E), rtol=1e-4, atol=1e-4)


def test_decode_fills_follow_qstar_and_never_evict_hits():
    _, hy = _setup(slots=6, policy=QStarPolicy(Bandwidths(10.0, 20.0)))  # q*/m = 0.5
    x = torch.randn(1, H)
    hy.forward(0, x, torch.tensor([[0, 1, 2, 3]]), torch.ones(1, 4), Phase.DECODE, 1)
    c = hy.cache.counters["decode"]
    assert (c.misses, c.fills, c.cpu) == (4, 2, 2)
    resident = [f for f in range(4) if int(hy.cache.slot_of[f]) >= 0]
    # next step routes the two resident experts plus 4 new ones; the hits must survive the fills
    hy.forward(0, x, torch.tensor([[*resident, 4, 5, 6, 7]]), torch.ones(1, 6), Phase.DECODE, 2)
    assert all(int(hy.cache.slot_of[f]) >= 0 for f in resident)
    assert (c.hits, c.fills) == (2, 4)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.value for f in FORMATS])
def test_prefill_streams_every_expert_through_a_tiny_cache(fmt):
    pool, hy = _setup(slots=2, policy=FillAllPolicy(), fmt=fmt)
    x = torch.randn(6, H)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3], [4, 5, 6], [7, 0, 1]])
    w = torch.rand(6, 3)
    got = hy.forward(1, x, ids, w, Phase.PREFILL, 1)
    torch.testing.assert_close(got, _dense(pool, 1, x, ids, w, 8), rtol=1e-4, atol=1e-4)
    c = hy.cache.counters["prefill"]
    assert (c.misses, c.fills, c.cpu) == (8, 8, 0)
    assert hy.cache.slots_used == 2


def test_a_prefill_wave_reads_the_tables_a_fixed_number_of_times(monkeypatch):
    """The on-demand prefill path admits a wave's misses in one table update: on CUDA every host read of the tables
    waits for all the copies and kernels queued before it, so reads that grew with the misses serialized a layer's
    copies expert by expert."""
    reads = 0

    def counted(real):
        def read(self, *args):
            nonlocal reads
            reads += 1
            return real(self, *args)
        return read

    for name in ("tolist", "item", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))

    def plan_reads(misses: int) -> int:
        nonlocal reads
        cache = _cache(slots=24, ids=2 * misses)
        plan_step(cache, FillAllPolicy(), {f: 1 for f in range(misses)}, Phase.PREFILL, step=1)  # a full cache
        reads = 0
        plan = plan_step(cache, FillAllPolicy(), {f: 1 for f in range(misses, 2 * misses)}, Phase.PREFILL, step=2)
        n = reads
        owner, slot_of = cache.owner_of.tolist(), cache.slot_of.tolist()
        assert all(slot_of[f] == s for s, f in enumerate(owner) if f >= 0)  # the tables stay inverse
        assert sum(len(w) for w in plan.waves) == misses and not plan.cpu
        assert {f for f, _ in plan.waves[-1]} <= set(owner)  # the last wave stays resident
        return n

    assert plan_reads(50) == plan_reads(70)  # three waves through 24 slots either way


def test_static_placement_pins_last_layers():
    pool, hy = _setup(slots=10, policy=StaticPolicy())  # 3 layers x 8: layer 2 whole + 2 of layer 1
    resident = sorted(int(f) for f in hy.cache.owner_of.tolist())
    assert resident == [8, 9] + list(range(16, 24))
    assert bool(hy.cache.pinned.all())
    for slot, fid in enumerate(hy.cache.owner_of.tolist()):
        assert torch.equal(hy.cache.bank[slot], pool.bank[fid])


# ---------------------------------------------------------------- online (adaptive) policy
def test_adaptive_policy_probes_every_rule_then_keeps_the_fastest():
    from edgemoe.experts.policy import AdaptivePolicy

    pol = AdaptivePolicy(Bandwidths(50.0, 100.0, "test"), probe_steps=3, exploit_steps=5)
    cost = {"qstar": 0.030, "fill-all": 0.040, "cpu-all": 0.020}  # cpu-all fastest on this "machine"
    seen, switches = [], 0
    for _ in range(4 * 3 + 2):  # a probe of 3 rules (3 counted steps + 1 skipped after each switch)
        seen.append(pol.active_name)
        switches += pol.observe(cost[pol.active_name], batch_size=1)
    assert {"qstar", "fill-all", "cpu-all"} <= set(seen)
    assert pol.active_name == "cpu-all" and pol.fill_rule() == CpuAllPolicy().fill_rule()
    assert pol.num_fills(10) == 0 and pol.q_ratio() == pytest.approx(0.5)  # q*/m stays reported
    for _ in range(5):  # exploit, then the next probe starts again from q*
        pol.observe(cost[pol.active_name], batch_size=1)
    assert pol.active_name == "qstar" and switches == 2  # qstar -> fill-all -> cpu-all (kept: no switch)


def test_adaptive_policy_keeps_a_probe_per_batch_size():
    from edgemoe.experts.policy import AdaptivePolicy

    pol = AdaptivePolicy(Bandwidths(50.0, 100.0, "test"), probe_steps=2, exploit_steps=100)
    for _ in range(4):  # the first step at a new size is not counted, two are, then a switch (next skipped)
        pol.observe(0.01, batch_size=1)
    assert pol.active_name == "fill-all"  # batch size 1 is probing its second candidate
    pol.observe(0.01, batch_size=4)  # another size: its own probe, from q*
    assert pol.active_name == "qstar"
    for _ in range(3):
        pol.observe(0.01, batch_size=4)
    pol.observe(0.01, batch_size=1)  # back at size 1: its probe resumes where it was, not from scratch
    assert pol.active_name == "fill-all"
    with pytest.raises(ValueError):
        AdaptivePolicy(Bandwidths(50.0, 100.0, "test"), probe_steps=0)


def test_adaptive_engine_runs_match_resident_tokens(tiny_model_dir):
    """Switching rules between steps never changes results (the cache only changes speed)."""
    from edgemoe.config import EngineConfig
    from edgemoe.engine.model_runner import ModelRunner, StepInput

    def greedy(runner, steps=24):
        prompt = list(range(3, 20))
        tok = int(runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)[0].argmax())
        out = [tok]
        for i in range(steps):
            tok = int(runner.execute([StepInput(0, [tok], len(prompt) + i)], Phase.DECODE)[0].argmax())
            out.append(tok)
        runner.free(0)
        return out

    kw = dict(device="cpu", dtype="float32", cpu_executor="torch", bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0)
    resident = greedy(ModelRunner(tiny_model_dir,
                                  EngineConfig(expert_cache_slots=10**6, expert_policy="fill-all", **kw),
                                  progress=False))
    runner = ModelRunner(tiny_model_dir, EngineConfig(expert_cache_slots=6, expert_policy="adaptive", **kw),
                         progress=False)
    runner.experts.policy.probe_steps = 2
    seen = set()
    real = runner.experts.policy.observe

    def observe(seconds, batch_size):
        seen.add(runner.experts.policy.active_name)
        return real(seconds, batch_size)

    runner.experts.policy.observe = observe
    assert greedy(runner) == resident
    assert seen == {"qstar", "fill-all", "cpu-all"}
    st = runner.experts.stats()["decode"]
    assert st["fills"] > 0 and st["cpu"] > 0
    assert runner.expert_stats()["policy"] == "adaptive"


@pytest.mark.parametrize("T,k,E", [(1, 8, 128), (4, 8, 16), (3, 2, 4), (32, 8, 64), (40, 8, 64), (7, 1, 3)])
def test_group_routes_equals_unique_and_a_stable_argsort(T, k, E):
    """Python grouping of a decode step's few routes (up to ``SMALL_GROUPING_ROUTES``: 32 x 8) and the torch
    ops of larger steps (40 x 8) give the same ids, counts and route order."""
    assert 32 * 8 <= SMALL_GROUPING_ROUTES < 40 * 8
    flat = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(T * k + E))
    fids, counts, order = group_routes(flat)
    want_ids, want_counts = torch.unique(flat, return_counts=True)
    assert fids == want_ids.tolist() and counts == want_counts.tolist()
    assert order.dtype == torch.int64 and torch.equal(order, flat.reshape(-1).argsort(stable=True))
