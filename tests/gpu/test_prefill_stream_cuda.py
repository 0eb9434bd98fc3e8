"""CUDA-only checks of streamed prefill (skipped without a GPU): copies on the copy stream overlapping
compute, event-ordered, must give logits bit-identical to the all-resident run, in both modes, and
leave the staged experts' rows in their slots."""

from __future__ import annotations

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.synth import make_model

from conftest import greedy_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = [(11 * i + 5) % 1000 for i in range(96)]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-bf16-prefill")
    make_model(out, "qwen3_moe", "small", seed=5, dtype="bfloat16")
    return out


@pytest.fixture(scope="module", params=[None, "fp8", "mxfp4", "nvfp4-modelopt"])
def small_any_format(request, tmp_path_factory):
    """The small Qwen3-MoE checkpoint with bf16 experts, then in each released quantized layout."""
    out = tmp_path_factory.mktemp(f"small-{request.param or 'bf16'}-prefill")
    make_model(out, "qwen3_moe", "small", seed=5, dtype="bfloat16", quant=request.param)
    return out


@pytest.mark.parametrize("mode", ["overlap", "serial"])
def test_streamed_prefill_on_cuda_is_bit_identical_to_resident(small, mode):
    runner = ModelRunner(small, EngineConfig(device="cuda", expert_policy="fill-all", expert_cache_slots=10**6),
                         progress=False)
    assert runner.pinned
    runner.experts.hybrid.prefill.mode = "off"
    ref, rt = greedy_decode(runner, PROMPT, 6, chunk_ends=list(range(48, len(PROMPT), 48)), free=True)
    E, L = runner.model_config.num_experts, runner.model_config.num_moe_layers
    for slots in (2 * E, 2 * E + 9, 3 * E + 1):
        runner.set_expert_cache(slots, "fill-all")
        streamer, calls = runner.experts.hybrid.prefill, []
        streamer.mode = mode
        forward = streamer.forward
        streamer.forward = lambda layer, *a, calls=calls, forward=forward: (calls.append(layer)
                                                                            or forward(layer, *a))
        got, gt = greedy_decode(runner, PROMPT, 6, chunk_ends=list(range(48, len(PROMPT), 48)), free=True)
        assert calls == list(range(L)) * 2  # both chunks streamed
        assert gt == rt
        assert torch.equal(got, ref), f"slots {slots}"
        cache = runner.experts.cache
        cache.check_invariants()
        torch.cuda.synchronize()
        for slot, fid in enumerate(cache.owner_of.tolist()):
            if fid >= 0:
                assert torch.equal(cache.bank[slot].cpu(), runner.pool.bank[fid])


def test_streamed_middle_layers_never_wait_for_the_gpu(small_any_format):
    """Between a streamed step's first and last MoE layer the streamer makes no synchronizing call (a host read
    there drains the compute queue and idles the GPU while the host issues the next layer): torch's sync debug
    mode raises on any such call in those layers (copies staged, tables updated, counts and recency on the
    device, the grouped kernels). The step's first layer reads the tables, its last layer the counts. Nor does
    it allocate page-locked host memory there (a page-locked allocation between a layer's copies and its compute
    keeps them from running concurrently): the pinned allocator's count of blocks it made stays put."""
    runner = ModelRunner(small_any_format, EngineConfig(device="cuda", expert_policy="fill-all",
                                                        expert_cache_slots=10**6), progress=False)
    E, L = runner.model_config.num_experts, runner.model_config.num_moe_layers
    runner.set_expert_cache(2 * E, "fill-all")  # two regions: every layer stages, evicting the layer two before
    streamer, checked, host_allocs = runner.experts.hybrid.prefill, [], []
    forward = streamer.forward

    def no_sync(layer, *args):
        if not 0 < layer < L - 1:
            return forward(layer, *args)
        checked.append(layer)
        before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(layer, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            host_allocs.append(torch.cuda.host_memory_stats().get("num_host_alloc", 0) - before)

    streamer.forward = no_sync
    greedy_decode(runner, PROMPT, 2, chunk_ends=[48], free=True)
    assert checked == list(range(1, L - 1)) * 2  # both chunks streamed
    assert host_allocs == [0] * len(checked), f"page-locked blocks made in the middle layers: {host_allocs}"
    c = runner.experts.cache.counters["prefill"]
    assert c.misses > 0 and c.fills >= c.misses
    runner.experts.cache.check_invariants()
