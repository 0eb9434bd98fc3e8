"""CUDA-only checks of the offload paths (skipped without a GPU): pinned pool, bit-identity of
offloaded ``fill-all`` with the all-resident run, and concurrent CPU + GPU branches under ``qstar``."""

from __future__ import annotations

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.experts.policy import Bandwidths
from edgemoe.synth import make_model

from conftest import greedy_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-bf16")
    make_model(out, "qwen3_moe", "small", seed=3, dtype="bfloat16")
    return out


def test_pool_is_pinned_and_fill_all_is_bit_identical_to_resident(small):
    runner = ModelRunner(small, EngineConfig(device="cuda", expert_policy="fill-all", expert_cache_slots=10**6),
                         progress=False)
    assert runner.pinned
    resident, rt = greedy_decode(runner, PROMPT, 12, free=True)
    runner.set_expert_cache(12, "fill-all")  # < one layer (32 experts), >= a step's top-8
    offloaded, ot = greedy_decode(runner, PROMPT, 12, free=True)
    assert ot == rt
    assert torch.equal(offloaded, resident)
    assert runner.experts.stats()["decode"]["fills"] > 0


def test_qstar_on_cuda_matches_resident_tokens(small):
    runner = ModelRunner(small, EngineConfig(device="cuda", dtype="float32", expert_policy="fill-all",
                                             expert_cache_slots=10**6), progress=False)
    resident, rt = greedy_decode(runner, PROMPT, 12, free=True)
    runner.experts.bandwidths = Bandwidths(10.0, 25.0, "test")
    runner.set_expert_cache(20, "qstar")
    hybrid, ht = greedy_decode(runner, PROMPT, 12, free=True)
    st = runner.experts.stats()["decode"]
    assert st["fills"] > 0 and st["cpu"] > 0
    assert ht == rt
    torch.testing.assert_close(hybrid, resident, rtol=1e-4, atol=1e-4)
