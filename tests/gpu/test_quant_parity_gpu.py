"""Quantized checkpoints on CUDA (FP8 block-128, MXFP4, NVFP4 ModelOpt and compressed-tensors): packed rows in the
pinned host pool and the device cache, fills of packed bytes, the Triton kernels dequantizing slot rows in registers
(the decode GEMV on the device decode path, CUDA graphs where the step has no CPU branch; the grouped GEMM of
prefill), the CPU branch on the torch executor; greedy tokens and logits against the transformers reference
(``tests/quant_reference.py``) in every execution mode, offloaded ``fill-all`` bit-identical to all resident, and
graph replay bit-identical to the eager device path."""

from __future__ import annotations

import pytest
import torch
from quant_reference import QUANTS, quantized_checkpoint, reference_model

from edgemoe.config import EngineConfig
from edgemoe.engine.expert_runtime import DecodePath
from edgemoe.engine.model_runner import ModelRunner

from conftest import greedy_decode, reference_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODES = [("fill-all", None), ("fill-all", 5), ("fill-all", 32), ("qstar", 5), ("cpu-all", 5), ("static", 5),
         ("qstar", 0)]
PROMPT = [3, 17, 92, 5, 41, 8, 77, 23, 64, 11, 9, 30]
STEPS = 6


@pytest.fixture(scope="module", params=QUANTS)
def quantized(request, tmp_path_factory):
    if request.param == "fp8":
        pytest.importorskip("accelerate")
    d = quantized_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    ref = reference_model(d, request.param, tmp_path_factory.mktemp(f"{request.param}-ref") / "f32")
    return request.param, d, reference_greedy(ref, PROMPT, STEPS)


def _runner(path, policy, slots, dtype="float32"):
    return ModelRunner(path, EngineConfig(device="cuda", dtype=dtype, expert_policy=policy,
                                          expert_cache_slots=10_000 if slots is None else slots,
                                          bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0), progress=False)


@pytest.mark.parametrize("policy,slots", MODES, ids=[f"{p}-{s}" for p, s in MODES])
def test_quantized_experts_on_cuda_match_transformers(quantized, policy, slots):
    _, path, (ref_logits, ref_toks) = quantized
    runner = _runner(path, policy, slots)
    assert runner.pinned
    if slots == 0:
        assert runner.experts.decode_path is DecodePath.EAGER
    elif slots is None or (policy == "fill-all" and slots >= 32):  # no CPU branch: captured
        assert runner.experts.decode_path is DecodePath.DEVICE_GRAPHS, runner.experts.decode_path_reason
    elif runner.experts.cpu_executor.registers_steps:  # the native quantized kernels: the CPU branch is captured
        assert runner.experts.decode_path is DecodePath.DEVICE_GRAPHS, runner.experts.decode_path_reason
    else:  # a CPU branch on the torch executor (a host sync): the device path, eagerly
        assert runner.experts.decode_path is DecodePath.DEVICE, runner.experts.decode_path_reason
    logits, toks = greedy_decode(runner, PROMPT, STEPS, free=True)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    cache = runner.experts.cache
    cache.check_invariants()
    torch.cuda.synchronize()
    for slot, fid in enumerate(cache.owner_of.tolist()):  # the slots hold the pool's packed rows
        if fid >= 0:
            assert torch.equal(cache.bank[slot].cpu(), runner.pool.bank[fid])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offloaded_fill_all_is_bit_identical_to_resident_on_cuda(quantized, dtype):
    _, path, _ = quantized
    resident = greedy_decode(_runner(path, "fill-all", None, dtype), PROMPT, STEPS, free=True)
    for slots in (5, 32):  # on-demand fills, and streamed prefill through two staging regions
        offloaded = greedy_decode(_runner(path, "fill-all", slots, dtype), PROMPT, STEPS, free=True)
        assert offloaded[1] == resident[1] and torch.equal(offloaded[0], resident[0]), slots


def test_graph_replay_is_bit_identical_to_the_eager_device_path(quantized):
    _, path, _ = quantized
    graphs = _runner(path, "fill-all", None, "bfloat16")
    eager = ModelRunner(path, EngineConfig(device="cuda", dtype="bfloat16", expert_policy="fill-all",
                                           expert_cache_slots=10_000, enforce_eager=True), progress=False)
    assert graphs.experts.decode_path is DecodePath.DEVICE_GRAPHS and eager.experts.decode_path is DecodePath.DEVICE
    a = greedy_decode(graphs, PROMPT, STEPS, free=True)
    b = greedy_decode(eager, PROMPT, STEPS, free=True)
    assert graphs.graphs.graphs  # decode steps were replayed from a captured graph
    assert a[1] == b[1] and torch.equal(a[0], b[0])
