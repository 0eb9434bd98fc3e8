"""CUDA-only checks of the device decode path (routing control on the device, Triton kernels, CUDA
graphs, the CPU branch handed to the native executor through the doorbell): graph replay equals the
eager device path bit for bit, offloaded fill-all equals resident bit for bit, qstar's CPU branch
inside the graph gives the resident tokens, padded batch sizes give each sequence its batch-1
result, and the device tables stay consistent."""

from __future__ import annotations

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts.policy import Bandwidths
from edgemoe.synth import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [list(range(5, 45)), list(range(100, 117)), list(range(300, 333))]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-bf16-dd")
    make_model(out, "qwen3_moe", "small", seed=5, dtype="bfloat16")
    return out


def _decode(runner: ModelRunner, prompts: list[list[int]], steps: int = 10) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill each prompt alone, then decode all sequences together ``steps`` times (greedy)."""
    toks = []
    for i, p in enumerate(prompts):
        toks.append([int(runner.execute([StepInput(i, p, 0)], Phase.PREFILL)[0].argmax())])
    out = []
    for s in range(steps):
        inputs = [StepInput(i, [toks[i][-1]], len(p) + s) for i, p in enumerate(prompts)]
        logits = runner.execute(inputs, Phase.DECODE)
        out.append(logits.float().cpu())
        for i in range(len(prompts)):
            toks[i].append(int(logits[i].argmax()))
    for i in range(len(prompts)):
        runner.free(i)
    return torch.stack(out), toks


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner(path, EngineConfig(device="cuda", **kw), progress=False)


def test_graph_replay_is_bit_identical_to_eager_device_path(small):
    graphs = _runner(small, expert_policy="fill-all", expert_cache_slots=24)
    assert graphs.experts.decode_path == "device + CUDA graphs", graphs.experts.decode_path_reason
    eager = _runner(small, expert_policy="fill-all", expert_cache_slots=24, enforce_eager=True)
    assert eager.experts.decode_path == "device"
    a, ta = _decode(graphs, PROMPTS[:1])
    b, tb = _decode(eager, PROMPTS[:1])
    assert 1 in graphs.graphs.captured_sizes()
    assert ta == tb and torch.equal(a, b)
    graphs.experts.cache.check_invariants()


def test_offloaded_fill_all_is_bit_identical_to_resident_on_device_path(small):
    # global LRU: 80 slots >= a padded batch's 64 routes, so no CPU branch at all (per-layer LRU would give
    # each of the 8 layers 10 victim slots, and a batch's misses beyond them would go to the CPU)
    runner = _runner(small, expert_policy="fill-all", expert_cache_slots=10**6, expert_eviction="global-lru")
    resident, rt = _decode(runner, PROMPTS[:1], steps=12)
    runner.set_expert_cache(80, "fill-all")
    assert not runner.experts.device_decode.cpu_branch
    offloaded, ot = _decode(runner, PROMPTS[:1], steps=12)
    assert ot == rt and torch.equal(offloaded, resident)
    st = runner.experts.stats()["decode"]
    assert st["fills"] > 0 and st["misses"] == st["fills"] + st["cpu"]
    runner.experts.cache.check_invariants()


def test_qstar_cpu_branch_in_graph_matches_resident_tokens(small):
    runner = _runner(small, dtype="float32", expert_policy="fill-all", expert_cache_slots=10**6)
    resident, rt = _decode(runner, PROMPTS[:1], steps=12)
    runner.experts.bandwidths = Bandwidths(10.0, 25.0, "test")
    runner.set_expert_cache(20, "qstar")
    dd = runner.experts.device_decode
    assert dd.cpu_branch and dd.capturable and runner.experts.decode_path == "device + CUDA graphs"
    hybrid, ht = _decode(runner, PROMPTS[:1], steps=12)
    st = runner.experts.stats()["decode"]
    assert st["fills"] > 0 and st["cpu"] > 0 and st["misses"] == st["fills"] + st["cpu"]
    assert ht == rt
    torch.testing.assert_close(hybrid, resident, rtol=1e-4, atol=1e-4)
    runner.experts.cache.check_invariants()


@pytest.mark.parametrize("policy", ["cpu-all", "static"])
def test_cpu_policies_on_device_path_match_resident(small, policy):
    runner = _runner(small, dtype="float32", expert_policy="fill-all", expert_cache_slots=10**6)
    resident, rt = _decode(runner, PROMPTS[:1], steps=8)
    runner.set_expert_cache(40, policy)
    out, t = _decode(runner, PROMPTS[:1], steps=8)
    assert t == rt
    torch.testing.assert_close(out, resident, rtol=1e-4, atol=1e-4)


def test_padded_batch_matches_single_sequences(small):
    runner = _runner(small, dtype="float32", expert_policy="qstar", expert_cache_slots=48,
                     bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0)
    together, tt = _decode(runner, PROMPTS, steps=6)  # 3 sequences: the batch-4 graph with one padding row
    assert 4 in runner.graphs.captured_sizes()
    for i, p in enumerate(PROMPTS):
        alone, ta = _decode(runner, [p], steps=6)
        assert ta[0] == tt[i]
        torch.testing.assert_close(alone[:, 0], together[:, i], rtol=1e-4, atol=1e-4)
    runner.experts.cache.check_invariants()


def test_long_context_decode_attention_matches_eager_path(small):
    """Triton paged decode attention at a context spanning many pages and partitions."""
    prompt = [(7 * i) % 1000 + 3 for i in range(3000)]
    dev = _runner(small, dtype="float32", expert_policy="fill-all", expert_cache_slots=10**6, max_model_len=4096)
    a, ta = _decode(dev, [prompt], steps=4)
    ref = _runner(small, dtype="float32", expert_policy="fill-all", expert_cache_slots=10**6, max_model_len=4096)
    ref.experts.hybrid.device_decode, ref.graphs = None, None  # the eager per-sequence path (SDPA over gathered pages)
    b, tb = _decode(ref, [prompt], steps=4)
    assert ta == tb
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("B", [32, 40, 64])
def test_batches_beyond_16_sequences_match_the_eager_path(small, B):
    """32 and 64 sequences of top-8 (256 and 512 routes per layer: route control over several tiles),
    40 padded to the batch-64 graph: captured, and equal to the eager host-controlled path."""
    g = torch.Generator().manual_seed(B)
    prompts = [torch.randint(3, 1000, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    kw = dict(dtype="float32", expert_policy="qstar", expert_cache_slots=96, bandwidth_pcie_gbps=10.0,
              bandwidth_cpu_gbps=25.0, max_num_seqs=64)
    runner = _runner(small, **kw)
    assert runner.experts.decode_path == "device + CUDA graphs", runner.experts.decode_path_reason
    dev, td = _decode(runner, prompts, steps=4)
    bs = 64 if B > 32 else 32
    assert bs in runner.graphs.captured_sizes() and not runner.graphs.failed
    st = runner.experts.stats()["decode"]
    assert st["fills"] > 0 and st["cpu"] > 0
    runner.experts.cache.check_invariants()
    ref = _runner(small, **kw)
    ref.experts.hybrid.device_decode, ref.graphs = None, None  # plan_step on the host, per-step syncs
    host, th = _decode(ref, prompts, steps=4)
    assert td == th
    torch.testing.assert_close(dev, host, rtol=1e-4, atol=1e-4)
    assert ref.experts.stats()["decode"] == st


def test_auto_toggles_the_cpu_branch_under_graphs_and_matches_resident(small):
    """``auto`` starts without the CPU branch (a new cache fills every miss until a miss rate is measured),
    arms it when its table splits and drops it again when the table fills every miss: both graphs (armed
    and not) are captured at the first decode step and replayed, and the tokens and logits stay those of
    the all-resident run."""
    from edgemoe.experts.policy import LayerObservation

    kw = dict(dtype="float32", max_num_seqs=1)
    runner = _runner(small, expert_policy="fill-all", expert_cache_slots=10**6, **kw)
    resident, rt = _decode(runner, PROMPTS[:1], steps=15)
    runner.experts.bandwidths = Bandwidths(10.0, 25.0, "test")
    L, E, k = runner.model_config.num_moe_layers, runner.model_config.num_experts, runner.model_config.top_k
    runner.set_expert_cache(L * max(E // 2, k), "auto")
    dd, policy = runner.experts.device_decode, runner.experts.policy
    assert dd.can_disarm and runner.experts.decode_path == "device + CUDA graphs"
    assert policy.fills_every_miss() and not dd.armed  # no miss rate measured yet
    # the windows the test pushes at steps 5 and 10 decide; a prior that outweighs the small model's first fills
    # keeps the runtime's own reads before step 5 (one after the slow capture step) from splitting first
    policy.reuse_prior = 16.0
    toks = [int(runner.execute([StepInput(0, PROMPTS[0], 0)], Phase.PREFILL)[0].argmax())]
    out, served = [], []
    for s in range(15):
        if s in (5, 10):  # no reuse and k misses a layer step: split (armed); then a high reuse: fill every miss
            net = -10**7 if s == 5 else 10**7
            policy.observe_layers(LayerObservation(reuse_net=[net] * L, fills=[10] * L, misses_per_layer_step=k))
            dd.push_policy()
            assert dd.armed == (s == 5)
        logits = runner.execute([StepInput(0, [toks[-1]], len(PROMPTS[0]) + s)], Phase.DECODE)
        out.append(logits.float().cpu())
        toks.append(int(logits[0].argmax()))
        served.append(dd.step.served)
        if s == 0:  # the first step captured the step with the branch and the one without it
            assert {(1, True), (1, False)} <= set(runner.graphs.graphs)
    runner.free(0)
    assert served[4] == 0 and served[9] > served[4] and served[14] == served[9]  # CPU work only while armed
    assert toks == rt[0]
    torch.testing.assert_close(torch.stack(out), resident, rtol=1e-4, atol=1e-4)
    runner.experts.cache.check_invariants()


def test_decode_totals_survive_a_thread_count_change(small):
    """The device path's hit/miss/fill/CPU counts carry over when the CPU executor is rebuilt with another
    thread count (Prometheus counters never decrease)."""
    runner = _runner(small, dtype="float32", expert_policy="qstar", expert_cache_slots=20)
    runner.experts.bandwidths = Bandwidths(10.0, 25.0, "test")
    runner.set_expert_cache(20, "qstar")
    assert runner.experts.device_decode is not None
    _decode(runner, PROMPTS[:1], steps=6)
    before = dict(runner.experts.stats()["decode"])
    assert before["misses"] > 0 and before["cpu"] > 0
    runner.set_cpu_threads(2)
    after = runner.experts.stats()["decode"]
    assert all(after[k] == before[k] for k in before), (before, after)
    _decode(runner, PROMPTS[:1], steps=2)
    assert runner.experts.stats()["decode"]["misses"] > before["misses"]
