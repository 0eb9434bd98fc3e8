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
