"""glm4_moe on CUDA (skipped without a GPU): the tiny checkpoints of ``tests/test_glm4_moe.py`` against
transformers in every execution mode, with decode on the device path (route control, fills, expert
GEMVs and the CPU branch as Triton kernels behind the GLM router) replayed from CUDA graphs, and
eagerly; bf16 offloaded ``fill-all`` bit-identical to all-resident."""

from __future__ import annotations

import pytest
import torch
from test_glm4_moe import DECODE_STEPS, MODES, PROMPT, TOL, VARIANTS, _make, _reference

from edgemoe.config import EngineConfig
from edgemoe.engine.expert_runtime import DecodePath
from edgemoe.engine.model_runner import ModelRunner

from conftest import greedy_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _config(**kw) -> EngineConfig:
    base = dict(device="cuda", dtype="float32", expert_policy="qstar", expert_cache_slots=5,
                bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    out = _make(tmp_path_factory.mktemp(f"glm-cuda-{request.param}") / "m", VARIANTS[request.param])
    return out, _reference(out)


CUDA_MODES = [(p, s, False) for p, s, _ in MODES] + [("qstar", 5, True)]  # + the device path without graphs


@pytest.mark.parametrize("policy,slots,eager", CUDA_MODES,
                         ids=[f"{p}-{s}{'-eager' if e else ''}" for p, s, e in CUDA_MODES])
def test_logits_and_greedy_tokens_match_transformers_on_cuda(checkpoint, policy, slots, eager):
    path, (ref_logits, ref_toks) = checkpoint
    runner = ModelRunner(path, _config(expert_policy=policy, expert_cache_slots=slots, enforce_eager=eager),
                         progress=False)
    if slots:
        assert runner.experts.decode_path in (DecodePath.DEVICE, DecodePath.DEVICE_GRAPHS)
        if not eager:
            assert runner.experts.decode_path is DecodePath.DEVICE_GRAPHS, runner.experts.decode_path_reason
    logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)
    runner.experts.cache.check_invariants()
    st = runner.experts.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if policy == "qstar" and slots:
        assert st["fills"] > 0 and st["cpu"] > 0


def test_bf16_offloaded_fill_all_is_bit_identical_to_resident(tmp_path):
    path = _make(tmp_path / "bf16", dtype="bfloat16")
    runner = ModelRunner(path, _config(dtype="bfloat16", expert_policy="fill-all", expert_cache_slots=10**6),
                         progress=False)
    gate = runner.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    prompt = list(range(5, 45))
    resident, rt = greedy_decode(runner, prompt, 10, free=True)
    runner.set_expert_cache(6, "fill-all")  # < one layer (16 experts), >= a step's top-4
    offloaded, ot = greedy_decode(runner, prompt, 10, free=True)
    assert ot == rt and torch.equal(offloaded, resident)
    assert runner.experts.stats()["decode"]["fills"] > 0
