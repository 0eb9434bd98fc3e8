"""The device decode path (``DeviceDecode``: route control + fused gather + grouped GEMV + CPU branch)
against the eager hybrid path, on the CPU with the Triton kernels in the interpreter: equal outputs,
identical residency tables and counters, step after step, for every policy."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from edgemoe.config import SILU_SWIGLU, ExpertActivation
from edgemoe.core import Phase
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.cpu_executor import TorchCpuExecutor
from edgemoe.experts.device_decode import DeviceDecode
from edgemoe.experts.hybrid import HybridExperts
from edgemoe.experts.policy import AutoPolicy, Bandwidths, make_policy
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (interpreter) variant; tests/gpu covers CUDA")

E, K, H, I, LAYERS = 12, 4, 32, 16, 3


# gpt-oss's experts: clamped SwiGLU (a limit that bites at these activations) with biases
GPT_OSS = ExpertActivation("swiglu_oai", alpha=1.702, limit=0.5, bias=True)


def _pool(dtype: torch.dtype = torch.float32, activation: ExpertActivation = SILU_SWIGLU) -> HostExpertPool:
    pool = HostExpertPool.dense(LAYERS * E, H, I, dtype, activation)
    pool.fill_random(0, std=0.2)
    return pool


def _pair(pool, slots, policy_name, partition=False):
    policy = make_policy(policy_name, Bandwidths(10.0, 25.0, "test", fill_fixed_s=2e-6, cpu_fixed_s=5e-5),
                         num_layers=LAYERS, max_misses=4 * K, expert_bytes=pool.row_bytes)
    out = []
    for _ in range(2):
        cache = ExpertCache(slots, pool.num_ids, pool.layout, pool.compute_dtype, torch.device("cpu"), num_experts=E,
                            partition_layers=partition)
        out.append(HybridExperts(pool, cache, policy, TorchCpuExecutor(pool), E, torch.device("cpu")))
    eager, dev = out
    dev.device_decode = DeviceDecode(pool, dev.cache, policy, dev.cpu, E, K, max_tokens=4)
    return eager, dev


@pytest.mark.parametrize("policy,slots,experts,partition", [
    ("qstar", 6, "silu", False), ("fill-all", 5, "silu", False), ("fill-all", 30, "silu", False),
    ("cpu-all", 7, "silu", False), ("static", 13, "silu", False), ("qstar", 6, "gpt-oss", False),
    ("fill-all", 30, "gpt-oss", False), ("qstar", 6, "gpt-oss-bf16", False), ("static", 13, "gpt-oss-bf16", False),
    ("auto", 6, "silu", False),
    ("qstar", 8, "silu", True), ("fill-all", 16, "silu", True), ("auto", 10, "silu", True)])  # 8 = 3 + 3 + 2 slots
def test_device_path_equals_eager_path(policy, slots, experts, partition):
    """SiLU SwiGLU experts, and gpt-oss's (clamped SwiGLU with biases) in float32 and bfloat16 (the kernels round
    where the torch path does; their dot products sum in another order, so bf16 outputs differ by a few ulps);
    global and per-layer LRU (``partition``), the auto policy's per-layer table and reuse accounting."""
    dtype = torch.bfloat16 if experts.endswith("bf16") else torch.float32
    pool = _pool(dtype, GPT_OSS if experts.startswith("gpt-oss") else SILU_SWIGLU)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    eager, dev = _pair(pool, slots, policy, partition)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        T = 1 + step % 3
        for c in (eager.cache, dev.cache):
            c.clock.fill_(step)
        for layer in range(LAYERS):
            x = torch.randn(T, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, k]
            if T > 1:
                ids[1, :2] = ids[0, :2]  # shared experts between tokens
            w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
            a = eager.forward(layer, x, ids, w, Phase.DECODE, step)
            b = dev.forward(layer, x, ids, w, Phase.DECODE, step)
            torch.testing.assert_close(b, a, **tol)
            for name in ("slot_of", "owner_of", "last_used", "ghost_slot", "slot_ghost", "reuse"):
                assert torch.equal(getattr(dev.cache, name), getattr(eager.cache, name)), (name, step, layer)
        dev.cache.check_invariants()
    assert dev.stats()["decode"] == eager.stats()["decode"]
    if partition:  # decode fills stay in their layer's share of the slots
        owners = dev.cache.owner_of.tolist()
        for layer in range(LAYERS):
            lo, hi = dev.cache.victim_range(layer)
            assert all(o < 0 or o // E == layer for o in owners[lo:hi])


@pytest.mark.parametrize("policy,slots,experts", [("qstar", 6, "silu"), ("cpu-all", 7, "silu"), ("auto", 6, "silu"),
                                                   ("qstar", 6, "gpt-oss"), ("cpu-all", 7, "gpt-oss")])
def test_cpu_branch_through_the_doorbell(policy, slots, experts):
    """With the native executor the CPU branch goes through the doorbell: the ring kernel writes the request
    word, the executor's server thread runs the registered step, the wait kernel polls the done word (in the
    interpreter here, a real thread on the other side). Outputs equal the eager path's; a layer call rings
    only when it has CPU work (the skipped wait returns at once and its stale partial is not added), so the
    server served exactly one request per call with CPU work. gpt-oss's experts (clamped SwiGLU, biases) run
    natively too."""
    from edgemoe.experts import native

    try:
        native.load_extension()
    except native.NativeUnavailable as e:  # no compiler: the torch executor serves instead
        pytest.skip(f"native executor unavailable: {e}")
    pool = _pool(activation=GPT_OSS if experts == "gpt-oss" else SILU_SWIGLU)
    eager, dev = _pair(pool, slots, policy)
    dev.cpu = native.NativeCpuExecutor(pool, threads=2, pin=False)
    dev.device_decode = dd = DeviceDecode(pool, dev.cache, dev.policy, dev.cpu, E, K, max_tokens=4)
    assert dd.bell is not None
    g = torch.Generator().manual_seed(2)
    calls = 0
    for step in range(1, 4):
        for c in (eager.cache, dev.cache):
            c.clock.fill_(step)
        for layer in range(LAYERS):
            x = torch.randn(2, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(2)])  # [2, k]
            w = torch.softmax(torch.randn(2, K, generator=g), dim=-1)
            a = eager.forward(layer, x, ids, w, Phase.DECODE, step)
            b = dev.forward(layer, x, ids, w, Phase.DECODE, step)
            calls += int(dd.out.meta[3]) > 0
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert 0 < calls and dd.step.served == calls and int(dd.seq[0]) == calls and int(dd.bell[8]) == calls
    assert int(dd.join_stats[:, 0].sum()) == calls  # every hand-off counted at its join
    assert dev.stats()["decode"] == eager.stats()["decode"]
    assert dev.stats()["decode"]["cpu"] > 0
    dd.check()  # no wait gave up, no step failed
    assert dd.step.failed == 0
    dd.step.pack.zero_()  # a corrupt hand-off: expert id outside the pool, ringing by hand
    dd.step.dims[0], dd.step.dims[1], dd.step.offsets[1], dd.step.fids[0] = 1, 1, 1, pool.num_ids
    from edgemoe.kernels import doorbell
    doorbell.ring(dd.seq, dd.bell)
    doorbell.wait(dd.seq, dd.bell)
    assert dd.step.failed == 1 and dd.step.status != 0
    assert not dd.step.out.any()  # a failed step leaves no stale partial
    with pytest.raises(RuntimeError, match="failed in the native executor"):
        dd.check()
    dd.check()  # reported once
    step = dd.step
    dd.close()
    assert step.served == 0 and dd.step is None  # stopped; later calls take the synchronous branch


def test_doorbell_wait_gives_up_without_a_server():
    """A wait nobody answers returns after max_polls and counts it in bell[1]; later waits then return at
    once (and count), so a dead server fails steps instead of hanging them."""
    from edgemoe.kernels import doorbell

    seq, bell = torch.zeros(1, dtype=torch.int64), torch.zeros(24, dtype=torch.int64)
    doorbell.ring(seq, bell)
    assert int(seq[0]) == 1 and int(bell[0]) == 1
    bell[8] = 1  # answered
    doorbell.wait(seq, bell, max_polls=3)
    assert int(bell[1]) == 0
    doorbell.ring(seq, bell)
    doorbell.wait(seq, bell, max_polls=3)  # nobody answers
    assert int(bell[1]) == 1
    doorbell.wait(seq, bell, max_polls=10**9)  # returns at once: an earlier wait gave up
    assert int(bell[1]) == 2
    with pytest.raises(ValueError, match="int64"):
        doorbell.ring(seq.int(), bell)


class _Batch:
    """The fields of ``ForwardBatch`` that ``HybridExperts.prefetch_next`` reads (a decode step)."""

    def __init__(self, step: int):
        self.phase, self.step, self.decode = Phase.DECODE, step, None


@pytest.mark.parametrize("partition", [False, True])
def test_next_layer_prefetch_device_equals_eager(partition):
    """Next-layer prefetch on the device path (route_control under fill-all into its own buffers, then
    gather_fills) fills the same experts into the same slots as the eager path, outputs unchanged, and leaves the
    same reuse tables (its fills pair with the residents they displace, nothing counted)."""
    pool = _pool()
    eager, dev = _pair(pool, 9, "qstar", partition)
    g = torch.Generator().manual_seed(3)
    routers = [torch.nn.Linear(H, E, bias=False) for _ in range(LAYERS)]

    def router(lin):
        return lambda x, valid=None: (lin(x).topk(K, dim=-1).indices, None)

    for hx in (eager, dev):
        hx.set_prefetch([router(r) for r in routers])
    for step in range(1, 6):
        for c in (eager.cache, dev.cache):
            c.clock.fill_(step)
        for layer in range(LAYERS):
            x = torch.randn(2, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(2)])  # [2, k]
            w = torch.softmax(torch.randn(2, K, generator=g), dim=-1)
            with torch.no_grad():
                a = eager.forward(layer, x, ids, w, Phase.DECODE, step)
                b = dev.forward(layer, x, ids, w, Phase.DECODE, step)
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
                eager.prefetch_next(layer, x, _Batch(step))
                dev.prefetch_next(layer, x, _Batch(step))
            for name in ("slot_of", "owner_of", "last_used", "ghost_slot", "slot_ghost", "reuse"):
                assert torch.equal(getattr(dev.cache, name), getattr(eager.cache, name)), (name, step, layer)
            used = dev.cache.owner_of >= 0  # the prefetched rows were copied
            assert torch.equal(dev.cache.bank[used], eager.cache.bank[used])
    assert dev.stats()["prefetch"]["prefetched"] == eager.stats()["prefetch"]["prefetched"] > 0


QUANT = {WeightFormat.FP8_BLOCK: (16, 16), WeightFormat.MXFP4: (128, 128), WeightFormat.NVFP4: (128, 128)}


def _quant_pool(fmt: WeightFormat, activation: ExpertActivation = SILU_SWIGLU,
                compute: torch.dtype = torch.float32) -> HostExpertPool:
    """A quantized pool at H = I = 32 (FP8 blocks of 16: several scale blocks per matrix)."""
    lay = ExpertLayout.build(fmt, 32, 32, has_bias=activation.bias, block_size=QUANT[fmt])
    pool = HostExpertPool(LAYERS * E, lay, compute, activation)
    pool.fill_random(0, std=0.2)
    return pool


@pytest.mark.parametrize("fmt", list(QUANT))
@pytest.mark.parametrize("policy,slots,experts", [("qstar", 6, "silu"), ("fill-all", 30, "silu"),
                                                   ("qstar", 6, "gpt-oss"), ("qstar", 6, "gpt-oss-bf16")])
def test_quantized_device_path_equals_eager_path(fmt, policy, slots, experts):
    """Quantized rows on the device path: fills move packed rows, ``expert_gemv_quant`` dequantizes them in
    the kernel; outputs equal the eager path's (rows dequantized in torch), tables and counters identical; for
    gpt-oss's experts (clamped SwiGLU with the slots' biases) too, computing in float32 and in bfloat16."""
    bf16 = experts.endswith("bf16")
    pool = _quant_pool(fmt, GPT_OSS if experts.startswith("gpt-oss") else SILU_SWIGLU,
                       torch.bfloat16 if bf16 else torch.float32)
    tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
    eager, dev = _pair(pool, slots, policy)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 3):
        T = 3 - step
        for c in (eager.cache, dev.cache):
            c.clock.fill_(step)
        for layer in range(LAYERS):
            x = torch.randn(T, 32, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, k]
            w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
            a = eager.forward(layer, x, ids, w, Phase.DECODE, step)
            b = dev.forward(layer, x, ids, w, Phase.DECODE, step)
            torch.testing.assert_close(b, a, **tol)
            for name in ("slot_of", "owner_of", "last_used"):
                assert torch.equal(getattr(dev.cache, name), getattr(eager.cache, name)), (name, step, layer)
    for slot, fid in enumerate(dev.cache.owner_of.tolist()):  # the fills copied the packed rows
        if fid >= 0:
            assert torch.equal(dev.cache.bank[slot], pool.bank[fid])
    assert dev.stats()["decode"] == eager.stats()["decode"]


@pytest.mark.parametrize("fmt", list(QUANT))
def test_quantized_rows_take_the_device_path(monkeypatch, fmt):
    """A quantized cache decodes on the device path like a float one (the kernels dequantize in registers);
    an FP8 block the kernels do not tile keeps the eager path and says why."""
    import edgemoe.engine.expert_runtime as er
    from edgemoe.config import EngineConfig
    from edgemoe.models import load_config
    from edgemoe.synth import config_for

    monkeypatch.setattr(er, "unavailable_reason", lambda device: None)  # as if the Triton kernels ran here
    cfg = load_config(config_for("qwen3_moe", "tiny", {"num_experts": E, "num_experts_per_tok": K, "hidden_size": 32,
                                                       "moe_intermediate_size": 32}).to_dict())
    assert cfg.num_moe_layers == LAYERS
    engine = EngineConfig(device="cpu", expert_cache_slots=8, expert_policy="fill-all", cpu_executor="torch")
    quant = er.ExpertRuntime(_quant_pool(fmt), cfg, engine, torch.device("cpu"), fallback=False, graphs_supported=True)
    assert quant.device_decode is not None and quant.decode_path is not er.DecodePath.EAGER
    if fmt is WeightFormat.FP8_BLOCK:
        pool = HostExpertPool(LAYERS * E, ExpertLayout.build(fmt, 32, 32, block_size=(16, 24)), torch.float32)
        odd = er.ExpertRuntime(pool, cfg, engine, torch.device("cpu"), fallback=False, graphs_supported=True)
        assert odd.decode_path is er.DecodePath.EAGER and odd.device_decode is None
        assert "power of two" in odd.decode_path_reason
        with pytest.raises(ValueError, match="do not read"):
            DeviceDecode(pool, odd.cache, odd.policy, odd.cpu_executor, E, K, max_tokens=2)


def test_cpu_handoff_and_collect_store_ring_wait_and_add_only_with_cpu_work():
    """handoff stores x (converted to the step's dtype) and the work list into the host buffers and rings,
    only when the layer has CPU work; collect then waits for the done word and adds the partial (a layer
    without CPU work gets y cast, nothing rung, nothing waited for); a wait nobody answers gives up after
    max_polls and counts it in bell[1]."""
    from edgemoe.kernels.cpu_handoff import COLLECT_BLOCK, collect, handoff
    from edgemoe.kernels.doorbell import BELL_WORDS

    T, Hd = 3, COLLECT_BLOCK + 5  # two collect programs, the second partly masked
    x = torch.randn(T, Hd, dtype=torch.bfloat16)
    x_host, pack_host = torch.zeros(4 * Hd, dtype=torch.float32), torch.zeros(40, dtype=torch.int64)
    pack = torch.arange(33, dtype=torch.int64) + 7
    seq, bell = torch.zeros(1, dtype=torch.int64), torch.zeros(BELL_WORDS, dtype=torch.int64)
    y = torch.randn(T, Hd)
    cpu_out = torch.randn(4 * Hd)
    no_work, work = torch.zeros(1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32)

    handoff(x, x_host, pack, pack_host, no_work, seq, bell)
    assert int(seq[0]) == 0 and int(bell[0]) == 0 and not x_host.any() and not pack_host.any()
    out = collect(y, cpu_out, no_work, seq, bell, torch.bfloat16, max_polls=3)
    assert torch.equal(out, y.to(torch.bfloat16)) and int(bell[1]) == 0

    handoff(x, x_host, pack, pack_host, work, seq, bell)
    assert int(seq[0]) == 1 and int(bell[0]) == 1
    assert torch.equal(x_host[:T * Hd], x.float().flatten()) and not x_host[T * Hd:].any()
    assert torch.equal(pack_host[:33], pack) and not pack_host[33:].any()
    bell[8] = 1  # the executor answered
    stats = torch.zeros(3, 2, dtype=torch.int64)
    out = collect(y, cpu_out, work, seq, bell, torch.float32, max_polls=3, stats=stats, layer=1)
    assert torch.equal(out, y + cpu_out[:T * Hd].view(T, Hd)) and int(bell[1]) == 0
    assert stats.tolist() == [[0, 0], [1, 0], [0, 0]]  # one hand-off, the CPU was done: not late
    collect(y, cpu_out, no_work, seq, bell, torch.float32, stats=stats, layer=1)
    assert stats.tolist() == [[0, 0], [1, 0], [0, 0]]  # no hand-off, nothing counted

    handoff(x, x_host, pack, pack_host, work, seq, bell)
    out = collect(y, cpu_out, work, seq, bell, torch.float32, max_polls=3, stats=stats, layer=2)  # nobody answers
    assert int(seq[0]) == 2 and int(bell[1]) == 1
    assert stats.tolist() == [[0, 0], [1, 0], [1, 1]]  # late
    collect(y, cpu_out, work, seq, bell, torch.float32, max_polls=3, count_give_up=False)  # a stream-op join
    assert int(bell[1]) == 1  # its give-up is the watchdog's to count
    with pytest.raises(ValueError, match="layer 3"):
        collect(y, cpu_out, work, seq, bell, torch.float32, stats=stats, layer=3)
    with pytest.raises(ValueError, match="int32"):
        handoff(x, x_host, pack, pack_host, work.long(), seq, bell)
    with pytest.raises(ValueError, match="fit"):
        handoff(x, x_host[:10], pack, pack_host, work, seq, bell)
    with pytest.raises(ValueError, match="float32"):
        collect(y.bfloat16(), cpu_out, work, seq, bell, torch.float32)
    ring_ns = torch.zeros(1, dtype=torch.int64)  # graded lateness reads the GPU's clock: CUDA only
    with pytest.raises(ValueError, match="ring_ns"):
        handoff(x, x_host, pack, pack_host, work, seq, bell, ring_ns=ring_ns)
    with pytest.raises(ValueError, match="ring_ns"):
        collect(y, cpu_out, work, seq, bell, torch.float32, stats=stats, ring_ns=ring_ns, limits=stats.clone())
    with pytest.raises(ValueError, match="needs ring_ns"):
        collect(y, cpu_out, work, seq, bell, torch.float32, stats=stats, limits=stats.clone())


def test_cpu_branch_disarms_while_auto_fills_every_miss():
    """While the auto policy's table fills every miss (a high measured reuse) and the cache's victim ranges
    hold a step's misses, the step is enqueued without the CPU branch (no hand-off, nothing served), outputs
    equal to the eager path; when the table splits again the branch is re-armed and used."""
    from edgemoe.experts import native
    from edgemoe.experts.policy import LayerObservation

    try:
        native.load_extension()
    except native.NativeUnavailable as e:
        pytest.skip(f"native executor unavailable: {e}")
    pool = _pool()
    # no fixed costs and a reuse prior of 0: the q* split until reuse is measured
    policy = AutoPolicy.from_bandwidths(Bandwidths(10.0, 25.0, "test"), pool.row_bytes, LAYERS, 4 * K,
                                        reuse_prior=0.0)
    eager, dev = (HybridExperts(pool, ExpertCache(20, pool.num_ids, pool.layout, pool.compute_dtype,
                                                  torch.device("cpu"), num_experts=E),
                                policy, TorchCpuExecutor(pool), E, torch.device("cpu")) for _ in range(2))
    dev.cpu = native.NativeCpuExecutor(pool, threads=2, pin=False)  # 20 slots >= min(P = 16, E = 12)
    dev.device_decode = dd = DeviceDecode(pool, dev.cache, policy, dev.cpu, E, K, max_tokens=4)
    assert dd.cpu_branch and dd.armed and not policy.fills_every_miss()
    g = torch.Generator().manual_seed(4)

    def steps(first: int, n: int) -> None:
        for step in range(first, first + n):
            for c in (eager.cache, dev.cache):
                c.clock.fill_(step)
            for layer in range(LAYERS):
                x = torch.randn(3, H, generator=g)
                ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3)])  # [3, k]
                w = torch.softmax(torch.randn(3, K, generator=g), dim=-1)
                a = eager.forward(layer, x, ids, w, Phase.DECODE, step)
                b = dev.forward(layer, x, ids, w, Phase.DECODE, step)
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)

    policy.observe_layers(LayerObservation(reuse_net=[10_000] * LAYERS, fills=[10] * LAYERS))
    assert policy.fills_every_miss()
    dd.push_policy()
    assert not dd.armed
    steps(1, 3)
    assert dd.step.served == 0 and int(dd.seq[0]) == 0 and dev.stats()["decode"]["cpu"] == 0
    policy.observe_layers(LayerObservation(reuse_net=[-10**7] * LAYERS, fills=[10] * LAYERS))
    assert not policy.fills_every_miss()
    dd.push_policy()
    assert dd.armed
    steps(4, 3)
    assert dd.step.served > 0 and dev.stats()["decode"]["cpu"] > 0
    assert dev.stats()["decode"] == eager.stats()["decode"]
