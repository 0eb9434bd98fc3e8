"""Streamed (double-buffered) prefill on CPU: bit-identity with all-resident execution and with the
wave path, residency tables, counters, the fallback, and decode after a streamed prefill."""

from __future__ import annotations

import contextlib
import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.experts import compute as compute_mod
from edgemoe.experts import prefill as prefill_mod
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.compute import run_sorted_experts, swiglu_expert
from edgemoe.experts.cpu_executor import TorchCpuExecutor
from edgemoe.experts.hybrid import HybridExperts
from edgemoe.experts.policy import Bandwidths, FillAllPolicy
from edgemoe.experts.pool import HostExpertPool
from edgemoe.experts.prefill import copy_runs
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

from conftest import greedy_decode

L, E, K, H, I = 3, 8, 2, 16, 8  # MoE layers, experts per layer, top-k, hidden, expert intermediate
N = L * E
FORMATS = [WeightFormat.FP32, WeightFormat.FP8_BLOCK, WeightFormat.MXFP4, WeightFormat.NVFP4]
QUANT_H = QUANT_I = 32  # quantized rows: MXFP4 groups of 32 along both H and I


def _pool(seed: int = 0, fmt: WeightFormat = WeightFormat.FP32) -> HostExpertPool:
    h, i = (H, I) if fmt.dense else (QUANT_H, QUANT_I)
    pool = HostExpertPool(N, ExpertLayout.build(fmt, h, i), torch.float32)
    pool.fill_random(seed, std=1.0)
    return pool


def _hybrid(pool: HostExpertPool, slots: int, policy=None) -> HybridExperts:
    cache = ExpertCache(slots, N, pool.layout, torch.float32, torch.device("cpu"))
    return HybridExperts(pool, cache, policy or FillAllPolicy(), TorchCpuExecutor(pool), E, torch.device("cpu"))


def _routing(T: int, seed: int, h: int = H) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per MoE layer ``(x [T, h], topk_ids [T, K], topk_weights [T, K])``; layer 0 leaves expert 7 unrouted."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(L):
        x = torch.randn(T, h, generator=g)
        ids = torch.stack([torch.randperm(E - (layer == 0), generator=g)[:K] for _ in range(T)])
        out.append((x, ids, torch.rand(T, K, generator=g)))
    return out


def _step(hy: HybridExperts, layers, phase: Phase, step: int) -> list[torch.Tensor]:
    return [hy.forward(layer, x, ids, w, phase, step) for layer, (x, ids, w) in enumerate(layers)]


def _dense(pool: HostExpertPool, layer: int, x, ids, w) -> torch.Tensor:
    """float64 reference: ``Σ_k w · expert(x)``, token by token, each expert's row dequantized by the reference
    (float rows: the row itself)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            f = layer * E + int(ids[t, j])
            w13, w2 = pool.layout.dequant_rows(pool.bank, [f])
            out[t] += float(w[t, j]) * swiglu_expert(x[t:t + 1].double(), w13[0].double(), w2[0].double())[0]
    return out


def _distinct(layers) -> int:
    return sum(len(torch.unique(ids)) for _, ids, _ in layers)


# (slots, streams): every expert; two regions + 4 spare; exactly two regions; too small -> waves
CACHE_SIZES = [(N, True), (2 * E + 4, True), (2 * E, True), (2 * E - 1, False), (5, False)]


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.value for f in FORMATS])
@pytest.mark.parametrize("slots,streams", CACHE_SIZES)
def test_streamed_prefill_is_bit_identical_to_all_resident(slots, streams, fmt):
    pool = _pool(fmt=fmt)
    resident = _hybrid(pool, N)
    resident.prefill.mode = "off"  # the wave path, every expert resident after the first step
    hy = _hybrid(pool, slots)
    assert hy.prefill.can_stream(10 * K) is streams
    routed = 0
    for step, seed in enumerate((1, 2, 3), start=1):  # three chunks: cold cache, then warm ones
        layers = _routing(10, seed, pool.hidden)
        routed += _distinct(layers)
        ref = _step(resident, layers, Phase.PREFILL, step)
        got = _step(hy, layers, Phase.PREFILL, step)
        for layer, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(a, b), f"step {step} layer {layer}"
            x, ids, w = layers[layer]
            torch.testing.assert_close(a.double(), _dense(pool, layer, x, ids, w), rtol=1e-4, atol=1e-4)
        hy.cache.check_invariants()
        assert hy.cache.slots_used <= slots
        c = hy.cache.counters["prefill"]
        assert c.cpu == 0 and c.hits + c.misses == routed
        if not streams:
            assert c.misses == c.fills  # the wave path fills exactly the misses
    # the cache holds exactly the rows the tables say
    for slot, fid in enumerate(hy.cache.owner_of.tolist()):
        if fid >= 0:
            assert torch.equal(hy.cache.bank[slot], pool.bank[fid])


@pytest.mark.parametrize("slots,fmt", [(N, WeightFormat.FP32), (2 * E + 4, WeightFormat.FP32), (5, WeightFormat.FP32),
                                      (5, WeightFormat.FP8_BLOCK), (2 * E + 4, WeightFormat.MXFP4)],
                         ids=["resident", "streamed", "waves", "fp8-waves", "mxfp4-streamed"])
def test_grouped_kernel_path_keeps_streamed_wave_and_resident_bit_identical(monkeypatch, slots, fmt):
    """The CUDA compute path (one grouped Triton kernel pair per call, over the bank's section views or, for
    quantized rows, over each group of dequantized slots; here in Triton's interpreter on CPU tensors):
    streamed prefill, the wave path (hits, then fill waves: one call each) and a decode batch above the
    pair-path size all give the all-resident bits (decode: unless the CPU executor took routes)."""
    pytest.importorskip("triton")
    from edgemoe.kernels import grouped_gemm

    monkeypatch.setattr(compute_mod, "kernel_module", lambda name, device: grouped_gemm)
    pool = _pool(3, fmt)
    resident = _hybrid(pool, N)
    resident.prefill.mode = "off"
    hy = _hybrid(pool, slots)
    for step, (phase, T) in enumerate([(Phase.PREFILL, 10), (Phase.PREFILL, 12), (Phase.DECODE, 40)], start=1):
        layers = _routing(T, 20 + step, pool.hidden)
        ref = _step(resident, layers, phase, step)
        got = _step(hy, layers, phase, step)
        exact = hy.cache.counters[phase.value].cpu == 0
        for layer, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(a, b) or not exact, f"step {step} layer {layer}"
            torch.testing.assert_close(a.double(), _dense(pool, layer, *layers[layer]), rtol=1e-4, atol=1e-4)
        hy.cache.check_invariants()
    assert hy.cache.counters["prefill"].cpu == 0 and (hy.cache.counters["decode"].cpu > 0) == (slots < E)


@pytest.mark.parametrize("mode", ["serial", "off"])
def test_modes_agree_bit_for_bit(mode):
    pool = _pool(1)
    a, b = _hybrid(pool, 2 * E + 3), _hybrid(pool, 2 * E + 3)
    b.prefill.mode = mode
    for step in (1, 2):
        layers = _routing(9, 10 + step)
        for x, y in zip(_step(a, layers, Phase.PREFILL, step), _step(b, layers, Phase.PREFILL, step)):
            assert torch.equal(x, y)
    with pytest.raises(ValueError):
        b.prefill.mode = "double"
    if mode == "serial":  # the same staging decisions, only the stream order differs
        assert torch.equal(a.cache.owner_of, b.cache.owner_of)
        assert a.cache.counters["prefill"].as_dict() == b.cache.counters["prefill"].as_dict()


def test_exactly_two_regions_leave_the_last_two_layers_resident_with_counters():
    pool = _pool()
    hy = _hybrid(pool, 2 * E)
    layers = _routing(10, 5)
    _step(hy, layers, Phase.PREFILL, 4)
    c = hy.cache.counters["prefill"]
    # cold cache: every expert of every layer is copied (layer 0's unrouted expert 7 too), none hit
    assert (c.hits, c.misses, c.fills, c.cpu) == (0, _distinct(layers), N, 0)
    assert sorted(hy.cache.owner_of.tolist()) == list(range(E, N))  # layers 1 and 2
    assert hy.cache.last_used.tolist() == [4] * (2 * E)
    hy.cache.check_invariants()
    # the next streamed step chooses its regions anew: all 2E slots, so nothing survives to hit
    _step(hy, _routing(10, 6), Phase.PREFILL, 5)
    assert (c.hits, c.fills) == (0, 2 * N)


def test_residents_outside_the_regions_are_hits_and_not_copied():
    pool = _pool()
    hy = _hybrid(pool, N - 2)  # all but two experts fit: regions take 2E, N - 2 - 2E stay resident
    _step(hy, _routing(10, 1), Phase.PREFILL, 1)  # cold: free slots absorb the first layers
    assert hy.cache.slots_used == N - 2
    c = hy.cache.counters["prefill"]
    fills_before = c.fills
    assert fills_before == N  # every expert copied once
    layers = _routing(10, 2)
    kept = set(hy.cache.owner_of.tolist())
    _step(hy, layers, Phase.PREFILL, 2)
    # 2E slots were carved (their residents evicted), the other N - 2 - 2E residents were used in place
    assert c.fills - fills_before == N - (N - 2 - 2 * E)
    survivors = kept & set(hy.cache.owner_of.tolist())
    assert len(survivors) >= N - 2 - 2 * E
    hy.cache.check_invariants()


def test_staged_experts_no_token_routed_are_evicted_first():
    """A streamed layer copies every expert, but only the routed ones were used: the others get the oldest
    recency, so the next fill evicts them before any expert a token used (a decode after a short prompt
    keeps the prompt's experts)."""
    pool = _pool()
    hy = _hybrid(pool, N)  # cold, room for every expert: no regions, every staged expert stays resident
    layers = _routing(10, 1)  # layer 0 never routes expert 7
    _step(hy, layers, Phase.PREFILL, 3)
    cache = hy.cache
    routed = {layer * E + int(e) for layer, (_, ids, _) in enumerate(layers) for e in ids.unique()}
    owners, recency = cache.owner_of.tolist(), cache.last_used.tolist()
    assert 7 in owners  # layer 0's unrouted expert was staged and stays resident
    for slot, f in enumerate(owners):
        if f >= 0:
            assert recency[slot] == (3 if f in routed else prefill_mod.UNROUTED_STAGED_STEP), (slot, f)
    unrouted = [s for s, f in enumerate(owners) if f >= 0 and f not in routed]
    assert sorted(cache.choose_victims(len(unrouted), exclude=[])) == sorted(unrouted)
    cache.check_invariants()


@pytest.mark.parametrize("partition", [False, True], ids=["global-lru", "layer-lru"])
def test_streamed_step_keeps_each_layers_most_routed_experts(partition):
    """Where the step carves its staging regions and free slots are left, each layer but the last two moves its most
    routed staged experts into free slots kept for it (under per-layer LRU, slots of its own share) once its routing
    is known; the last two layers' experts stay in their regions. Rows, tables and the decode after it stay exact."""
    pool = _pool()
    S = 2 * E + 6
    cache = ExpertCache(S, N, pool.layout, torch.float32, torch.device("cpu"), num_experts=E,
                        partition_layers=partition)
    hy = HybridExperts(pool, cache, FillAllPolicy(), TorchCpuExecutor(pool), E, torch.device("cpu"))
    layers = _routing(12, 4)
    ids0 = torch.tensor([[e, 6] for e in range(6) for _ in range(6 - e)][:12])  # 0 x 6, 1 x 5, 2 x 1; 6 x 12
    layers[0] = (layers[0][0], ids0, layers[0][2])
    outs = _step(hy, layers, Phase.PREFILL, 1)
    for layer, (x, ids, w) in enumerate(layers):
        torch.testing.assert_close(outs[layer].double(), _dense(pool, layer, x, ids, w), rtol=1e-5, atol=1e-5)
    cache.check_invariants()
    owners = cache.owner_of.tolist()
    for slot, f in enumerate(owners):
        if f >= 0:
            assert torch.equal(cache.bank[slot], pool.bank[f])
    # 22 slots, 24 experts: two regions of 8 are carved and 6 slots stay free, all kept for layer 0 (per layer,
    # shares of 8, 7, 7 slots: the regions take the last two layers' shares first, which keep nothing)
    kept = sorted(f for f in owners if 0 <= f < E)
    assert kept == sorted([6, 0, 1, 2])  # layer 0's routed experts, the most routed first (12, 6, 5, 1 routes)
    if partition:
        lo, hi = cache.victim_range(0)
        assert all(lo <= cache.slot_of[f] < hi for f in kept)  # in layer 0's own share
    assert sorted(f for f in owners if f >= E) == list(range(E, N))  # layers 1 and 2 in their regions
    # decode after it hits the kept experts and computes them from their new slots
    x, ids, w = torch.randn(1, H), torch.tensor([kept[:K]]), torch.rand(1, K)
    hits = cache.counters["decode"].hits
    out = hy.forward(0, x, ids, w, Phase.DECODE, 2)
    assert cache.counters["decode"].hits - hits == K
    torch.testing.assert_close(out.double(), _dense(pool, 0, x, ids, w), rtol=1e-5, atol=1e-5)


def test_streamed_layers_read_nothing_back_to_the_host(monkeypatch):
    """Between a streamed step's first and last MoE layer the streamer reads nothing to the host (on CUDA each read
    would drain the compute queue): the tables' host copy is read at the step's start, the counts at its end, and
    the counters come out as the per-layer reads gave them. (The experts' compute is left out: on CUDA it is the
    grouped kernels, which read nothing back; the CPU loop this test runs reads its routing by design.)"""
    pool = _pool()
    hy = _hybrid(pool, 2 * E)  # two regions: every layer stages, evicting the layer two before
    layers = _routing(10, 5)
    reads: list[str] = []
    computing = [False]
    orig = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__", "__int__", "nonzero")}

    def counting(name):
        def read(t, *args, **kw):
            if not computing[0]:
                reads.append(name)
            return orig[name](t, *args, **kw)
        return read

    def compute(*args, **kw):
        computing[0] = True
        try:
            return run_sorted_experts(*args, **kw)
        finally:
            computing[0] = False

    monkeypatch.setattr(prefill_mod, "run_sorted_experts", compute)
    hy.forward(0, *layers[0], Phase.PREFILL, 4)  # the step's start (regions, the tables' host copy)
    for name in orig:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    for layer in range(1, L - 1):
        hy.forward(layer, *layers[layer], Phase.PREFILL, 4)
    assert reads == []
    hy.forward(L - 1, *layers[L - 1], Phase.PREFILL, 4)  # the step's end: its counts, once
    assert reads == ["tolist"]
    monkeypatch.undo()
    c = hy.cache.counters["prefill"]
    assert (c.hits, c.misses, c.fills) == (0, _distinct(layers), N)
    hy.cache.check_invariants()


def test_kept_routed_experts_use_no_op_that_reads_back_on_cuda(monkeypatch):
    """Moving a layer's routed staged experts into the slots kept for it (free slots beside the regions) uses no
    torch op whose CUDA kernel reads back to the host (``torch.bincount`` reads its input's min and max), in the
    streamer and the cache (the CPU compute loop, which reads its routing by design, is left out)."""
    from edgemoe.experts import cache as cache_mod

    class NoReadBack:
        def __getattr__(self, name):
            if name in ("bincount", "unique", "nonzero", "masked_select", "histc"):
                raise AssertionError(f"torch.{name} reads back to the host on CUDA")
            return getattr(torch, name)

    pool = _pool()
    hy = _hybrid(pool, 2 * E + 4)  # two regions and 4 slots kept for layer 0 (L = 3)
    layers = _routing(10, 5)
    moved = []
    move = hy.cache.move_indexed
    monkeypatch.setattr(hy.cache, "move_indexed", lambda *a, **kw: (moved.append(1), move(*a, **kw))[1])
    assert hy.prefill.claims(0, Phase.PREFILL, 10, K, 4)  # the step's start reads the tables (nonzero) by design
    monkeypatch.setattr(prefill_mod, "torch", NoReadBack())
    monkeypatch.setattr(cache_mod, "torch", NoReadBack())
    for layer in range(L - 1):
        hy.forward(layer, *layers[layer], Phase.PREFILL, 4)
    monkeypatch.undo()
    hy.forward(L - 1, *layers[L - 1], Phase.PREFILL, 4)
    assert moved
    hy.cache.check_invariants()


def test_short_chunks_take_the_wave_path():
    pool = _pool()
    hy = _hybrid(pool, 2 * E + 4)
    layers = _routing(7, 7)  # T·k = 14 < 2E routes per layer
    assert not hy.prefill.can_stream(7 * K) and hy.prefill.can_stream(8 * K)
    out = _step(hy, layers, Phase.PREFILL, 1)
    c = hy.cache.counters["prefill"]
    assert c.fills == c.misses == _distinct(layers)  # only routed experts were copied
    for layer, (x, ids, w) in enumerate(layers):
        torch.testing.assert_close(out[layer].double(), _dense(pool, layer, x, ids, w), rtol=1e-5, atol=1e-5)


def test_unfinished_streamed_step_is_closed_by_the_next_call():
    pool = _pool()
    hy = _hybrid(pool, 2 * E)
    x, ids, w = _routing(10, 3)[0]
    hy.forward(0, x, ids, w, Phase.PREFILL, 1)  # the step stops after its first MoE layer
    hy.cache.check_invariants()
    c = hy.cache.counters["prefill"]
    assert c.misses == 0  # counted at the step's end ...
    # a decode step follows: not claimed by the streamer, its result is exact
    xd, idd = torch.randn(1, H), torch.tensor([[1, 2]])
    got = hy.forward(1, xd, idd, torch.ones(1, 2), Phase.DECODE, 2)
    assert c.misses == len(ids.unique())  # ... which the next call makes: the first layer's routed experts
    torch.testing.assert_close(got.double(), _dense(pool, 1, xd, idd, torch.ones(1, 2)), rtol=1e-5, atol=1e-5)
    layers = _routing(10, 4)  # and a new streamed prefill step runs from layer 0
    for layer, out in enumerate(_step(hy, layers, Phase.PREFILL, 3)):
        torch.testing.assert_close(out.double(), _dense(pool, layer, *layers[layer]), rtol=1e-5, atol=1e-5)
    hy.cache.check_invariants()


@pytest.fixture
def cuda_protocol(monkeypatch):
    """Recording stand-ins for CUDA streams and events, so that the streamer's CUDA branches run on CPU:
    ``(log, current, copy_stream, bind)``, where ``log`` gets ``("wait", stream, event)``, ``("wait_stream", a, b)``,
    ``("record", stream, event)`` and ``("compute", stream)`` entries, ``current`` is the stack of current streams,
    and ``bind(hy)`` switches ``hy``'s streamer to the CUDA branches (its copies logged as ``("copy", stream,
    layer)``)."""
    log: list[tuple] = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.id))

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

    class Event:
        count = 0

        def __init__(self):
            Event.count += 1
            self.id = Event.count

        def record(self, stream):
            log.append(("record", stream.name, self.id))

    compute_stream, copy_stream = Stream("compute"), Stream("copy")
    current = [compute_stream]

    @contextlib.contextmanager
    def use(stream):
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: copy_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", use)
    run = prefill_mod.run_sorted_experts
    monkeypatch.setattr(prefill_mod, "run_sorted_experts",
                        lambda *a, **kw: (log.append(("compute", current[-1].name)), run(*a, **kw))[1])

    def bind(hy):
        hy.prefill._cuda = True  # the CUDA branches, with the stand-ins above
        hy.prefill._copy_stream = copy_stream
        copy = hy.prefill._copy
        hy.prefill._copy = lambda runs: (log.append(("copy", current[-1].name, runs[0][0] // E)), copy(runs))[1]

    return log, current, copy_stream, bind


def test_overlap_orders_copies_and_compute_with_events(cuda_protocol):
    """The CUDA protocol, run on CPU with recording stand-ins for streams and events: layer l+1's copy
    is issued on the copy stream before layer l computes, after the event of layer l-1's compute (the
    region's previous reader); layer l's compute waits for the event after layer l's copy."""
    log, _, _, bind = cuda_protocol
    pool = _pool()
    hy = _hybrid(pool, 2 * E + 2)
    bind(hy)
    for step in (1, 2):
        log.clear()
        layers = _routing(10, step)
        for layer, out in enumerate(_step(hy, layers, Phase.PREFILL, step)):
            torch.testing.assert_close(out.double(), _dense(pool, layer, *layers[layer]), rtol=1e-5, atol=1e-5)
        assert log[0] == ("wait_stream", "copy", "compute")  # earlier steps' readers of the slots
        copies = [i for i, e in enumerate(log) if e[0] == "copy"]
        computes = [i for i, e in enumerate(log) if e[0] == "compute"]
        assert [log[i][1:] for i in copies] == [("copy", layer) for layer in range(L)]
        assert len(computes) == L and all(log[i][1] == "compute" for i in computes)
        copy_done = [log[i + 1][2] for i in copies]  # the event recorded right after each layer's copy
        compute_done = [log[i + 1][2] for i in computes]  # (the sum over k is not logged)
        assert all(log[i + 1][:2] == ("record", "copy") for i in copies)
        assert all(log[i + 1][:2] == ("record", "compute") for i in computes)
        for layer in range(L):
            if layer + 1 < L:
                assert copies[layer + 1] < computes[layer]  # prefetch issued before this layer computes
            prev = computes[layer - 1] if layer else 0
            assert ("wait", "compute", copy_done[layer]) in log[prev:computes[layer]]
            if layer >= 2:  # region reuse waits for the compute that last read it
                assert log[copies[layer] - 1] == ("wait", "copy", compute_done[layer - 2])


def test_streamed_layers_allocate_no_page_locked_memory(monkeypatch, cuda_protocol):
    """On CUDA a page-locked host allocation issued between two commands of different streams keeps them from
    running concurrently (the CUDA programming guide's implicit synchronization), so none may come between a
    layer's copies and its compute: every index vector a streamed layer sends to the device (the staged ids, their
    slots, the layer's residency) goes through the step's one staging buffer, allocated at the step's start, and
    never through ``device_int64`` (a page-locked tensor per call). Run through the CUDA branches on CPU."""
    from edgemoe.experts import cache as cache_mod

    _, _, _, bind = cuda_protocol
    pool = _pool()
    hy = _hybrid(pool, 2 * E)  # two regions: every layer stages, evicting the layer two before
    bind(hy)
    layers = _routing(10, 6)
    calls: list[int] = []
    orig = cache_mod.device_int64
    monkeypatch.setattr(cache_mod, "device_int64", lambda values, device: (calls.append(len(values)),
                                                                           orig(values, device))[1])
    for step in (1, 2):
        out = [hy.forward(0, *layers[0], Phase.PREFILL, step)]  # the step's start: regions, staging buffer
        calls.clear()
        out += [hy.forward(layer, *layers[layer], Phase.PREFILL, step) for layer in range(1, L)]
        assert calls == [], f"step {step}: device_int64 of {calls} values in the streamed layers"
        for layer, got in enumerate(out):
            torch.testing.assert_close(got.double(), _dense(pool, layer, *layers[layer]), rtol=1e-5, atol=1e-5)
        hy.cache.check_invariants()
    c = hy.cache.counters["prefill"]
    assert c.misses > 0 and c.fills >= c.misses


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.value for f in FORMATS])
@pytest.mark.parametrize("zero_missing", [True, False])
def test_run_sorted_experts_matches_float64_reference(zero_missing, fmt):
    pool = _pool(2, fmt)
    g = torch.Generator().manual_seed(0)
    T = 11
    x, w = torch.randn(T, pool.hidden, generator=g), torch.rand(T, K, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % E  # distinct per token
    slots = torch.arange(E, 2 * E)  # layer 1's rows of the pool used as "slots"
    slots[3] = -1  # expert 3 is not on the device
    routed = torch.full((T, K, pool.hidden), float("nan"))
    run_sorted_experts(x, ids, w, slots, pool.layout, pool.bank, routed, zero_missing=zero_missing)
    missing = ids == 3  # [T, K]
    assert missing.any()
    if zero_missing:
        assert not routed[missing].any()
    else:
        assert routed[missing].isnan().all()
    routed[missing] = 0
    ref = _dense(pool, 1, x, ids, w * ~missing)
    torch.testing.assert_close(routed.sum(1).double(), ref, rtol=1e-4, atol=1e-4)


def test_copy_runs_coalesce_consecutive_ids_and_slots():
    assert copy_runs([3, 4, 5, 9, 10], [0, 1, 2, 3, 4]) == [(3, 0, 3), (9, 3, 2)]
    assert copy_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert copy_runs([], []) == []


# ---------------------------------------------------------------- through the model runner (tiny model)
def test_runner_streamed_prefill_then_decode_matches_resident(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, EngineConfig(device="cpu", expert_policy="fill-all", expert_cache_slots=10**6,
                                                      cpu_executor="torch"),
                         progress=False)
    E_, L_ = runner.model_config.num_experts, runner.model_config.num_moe_layers
    prompt = [(7 * i + 3) % 1000 for i in range(40)]
    runner.experts.hybrid.prefill.mode = "off"
    ref, rt = greedy_decode(runner, prompt, 4, chunk_ends=list(range(20, len(prompt), 20)), free=True)
    for slots, policy in [(2 * E_, "fill-all"), (2 * E_ + 7, "fill-all"), (2 * E_ + 7, "qstar")]:
        if policy == "qstar":
            runner.experts.bandwidths = Bandwidths(10.0, 25.0, "test")
        runner.set_expert_cache(slots, policy)
        streamer, calls = runner.experts.hybrid.prefill, []
        forward = streamer.forward
        streamer.forward = lambda layer, *a, calls=calls, forward=forward: (calls.append(layer)
                                                                            or forward(layer, *a))
        got, gt = greedy_decode(runner, prompt, 4, chunk_ends=list(range(20, len(prompt), 20)), free=True)
        assert calls == list(range(L_)) * 2  # both 20-token chunks streamed (T·k = 80 >= 2E = 32)
        pf = runner.experts.stats()["prefill"]
        assert pf["fills"] >= pf["misses"] > 0 and pf["cpu"] == 0
        runner.experts.cache.check_invariants()
        assert gt == rt
        assert torch.equal(got[0], ref[0])  # prefill logits: bit-identical
        if policy == "fill-all":
            assert torch.equal(got, ref)
        else:  # qstar decode runs some misses on the CPU executor
            assert runner.experts.stats()["decode"]["cpu"] > 0
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the benchmark's CPU smoke mode
def test_prefill_benchmark_cpu_smoke(tmp_path, load_benchmark):
    bench = load_benchmark("prefill")
    rc = bench.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--slots", "32,40",
                     "--chunk", "32", "--chunks", "2", "--bp-seconds", "0.05", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "prefill.json").read_text())
    rows = res["results"]
    assert {(r["slots"], r["mode"], r["chunk_index"]) for r in rows} == {
        (s, m, c) for s in (32, 40) for m in ("overlap", "serial") for c in (0, 1)}
    for r in rows:
        assert r["streamed"] and r["seconds"] > 0 and r["transferred_bytes"] > 0
        assert r["transferred_bytes"] == r["fills"] * res["meta"]["expert_bytes"]
        assert r["ratio_to_routed_bound"] == pytest.approx(
            r["seconds"] / (r["routed_bytes"] / (res["meta"]["b_p_gbps"] * 1e9)))
    assert {(t["slots"], t["mode"], t["tokens"]) for t in res["prompts"]} == {
        (s, m, 64) for s in (32, 40) for m in ("overlap", "serial")}
    assert "| 32 |" in (tmp_path / "prefill.md").read_text()


def test_prefill_benchmark_profile_writes_the_trace_and_tables(tmp_path, load_benchmark):
    bench = load_benchmark("prefill")
    rc = bench.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--slots", "32", "--chunk", "32",
                     "--chunks", "1", "--bp-seconds", "0.05", "--no-warmup", "--profile", "--out", str(tmp_path)])
    assert rc == 0
    text = (tmp_path / "prefill-profile.txt").read_text()
    assert "== by host self time" in text and "aten::" in text
    with gzip.open(tmp_path / "prefill-trace.json.gz", "rt") as f:
        assert json.load(f)["traceEvents"]


def test_device_timeline_finds_copies_waiting_for_compute(load_benchmark):
    """Two expert copies with a 3 ms gap that one kernel fills; a small copy inside the gap is not an expert
    copy; busy, overlap and idle time add up over the span."""
    bench = load_benchmark("prefill")
    cuda = SimpleNamespace(name="CUDA")

    def ev(name, a, b, stream):
        return SimpleNamespace(name=name, device_type=cuda, time_range=SimpleNamespace(start=a * 1e3, end=b * 1e3),
                               device_resource_id=stream)

    h2d = "Memcpy HtoD (Pinned -> Device)"
    text = bench.device_timeline([ev(h2d, 0, 10, 9), ev("gate_up", 5, 12, 7), ev(h2d, 10.5, 10.51, 7),
                                  ev(h2d, 13, 20, 9), ev("down", 20, 25, 7)])
    assert ("span 25.0, expert copies busy 17.0, kernels busy 12.0, both 5.0, neither 1.0; before the first copy "
            "0.0, after the last 5.0; gaps between copies >= 0.5 ms: 1 totalling 3.0") in text
    assert "gap 3.00 at 10.0: 1 kernels, 2.00 busy (gate_up)" in text
    assert "9: 17.0" in text and "7: 12.0" in text
    assert bench.device_timeline([ev("k", 0, 1, 7)]).endswith("no expert copies or kernels recorded")


def test_admit_many_and_evict_keep_tables_inverse():
    c = ExpertCache(4, N, None, torch.float32, torch.device("cpu"))
    c.admit(5, 0, 1)
    c.admit_many([6, 7], [0, 2], 3)  # slot 0's resident (5) is evicted
    assert c.owner_of.tolist() == [6, -1, 7, -1] and int(c.slot_of[5]) == -1 and c.last_used.tolist() == [3, -1, 3, -1]
    with pytest.raises(RuntimeError):
        c.admit_many([8, 7], [1, 3], 4)
    c.evict([2, 3])
    assert (c.owner_of.tolist() == [6, -1, -1, -1] and int(c.slot_of[7]) == -1
            and c.last_used.tolist() == [3, -1, -1, -1])
    c.check_invariants()
