"""gpt_oss on CUDA (skipped without a GPU): the tiny checkpoints of ``tests/test_gpt_oss.py`` against
transformers in every execution mode, decode on the device path (route control, fills, the expert GEMVs
computing the clamped SwiGLU with biases, the paged decode kernel with sinks and sliding windows) replayed
from CUDA graphs wherever the step is capturable (no CPU branch, or a CPU branch on the native executor, which
computes these experts), and eagerly (``--enforce-eager``, or a CPU branch on the torch executor, which reads
its work list on the host); the Triton paged decode kernel with sinks and windows on the GPU against the torch
path; bf16 offloaded ``fill-all`` bit-identical to all-resident; the released MXFP4 layout (rows kept MXFP4 in
host memory and in the GPU cache, dequantized in registers by the quantized expert GEMV and grouped GEMM,
float32 and bfloat16 compute) decoded on the device path with CUDA graphs against transformers.
"""

from __future__ import annotations

import pytest
import torch
from test_gpt_oss import (
    DECODE_KERNEL_CASES,
    DECODE_STEPS,
    MODES,
    MXFP4_MODES,
    PROMPT,
    TOL,
    VARIANTS,
    _check_bf16,
    _make,
    _randomize_biases,
    _reference,
    check_decode_kernel,
)

from edgemoe.config import EngineConfig
from edgemoe.engine.expert_runtime import DecodePath
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.experts import native
from edgemoe.synth import make_model

from conftest import greedy_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _config(**kw) -> EngineConfig:
    base = dict(device="cuda", dtype="float32", expert_policy="qstar", expert_cache_slots=5,
                bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    preset, dtype = VARIANTS[request.param]
    out = _make(tmp_path_factory.mktemp(f"gptoss-cuda-{request.param}") / "m", preset, dtype)
    return out, dtype, _reference(out, getattr(torch, dtype))


CUDA_MODES = [(p, s, e, False) for p, s, e in MODES] + [("fill-all", 10_000, "torch", True)]  # + resident, eager


def _check_decode_path(runner, eager: bool) -> bool:
    """The device decode path is taken, captured in CUDA graphs unless ``eager`` or a CPU branch on the torch
    executor (the native one computes gpt-oss's experts inside the graph); returns whether it is captured."""
    rt = runner.experts
    assert rt.decode_path in (DecodePath.DEVICE, DecodePath.DEVICE_GRAPHS), rt.decode_path_reason
    dd = rt.device_decode
    native_branch = dd.cpu_branch and rt.cpu_executor.registers_steps
    if dd.cpu_branch and not native_branch:
        assert rt.decode_path_reason == "the CPU branch needs the native executor to be captured"
    captured = not eager and (not dd.cpu_branch or native_branch)
    if captured:
        assert rt.decode_path is DecodePath.DEVICE_GRAPHS and runner.graphs is not None, rt.decode_path_reason
    return captured


def _executor_kind(executor: str) -> str:
    return "torch" if executor == "torch" or not native.available() else "native"


@pytest.mark.parametrize("policy,slots,executor,eager", CUDA_MODES,
                         ids=[f"{p}-{s}-{e}{'-eager' if g else ''}" for p, s, e, g in CUDA_MODES])
def test_logits_and_greedy_tokens_match_transformers_on_cuda(checkpoint, policy, slots, executor, eager):
    path, dtype, (ref_logits, ref_toks) = checkpoint
    runner = ModelRunner(path, _config(dtype=dtype, expert_policy=policy, expert_cache_slots=slots,
                                       cpu_executor=executor, enforce_eager=eager), progress=False)
    rt = runner.experts
    assert rt.cpu_executor.name.split("-")[0] == _executor_kind(executor)
    captured = _check_decode_path(runner, eager) if slots else False
    if dtype == "float32":
        logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
        assert toks == ref_toks
        torch.testing.assert_close(logits, ref_logits, **TOL)
    else:
        _check_bf16(runner, ref_logits, ref_toks)
    rt.cache.check_invariants()
    st = rt.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if policy == "qstar" and slots:
        assert st["fills"] > 0 and st["cpu"] > 0
    if captured:
        assert runner.graphs.graphs and not runner.graphs.failed  # decode replayed from graphs


@pytest.mark.parametrize("dtype,window,part", DECODE_KERNEL_CASES)
@pytest.mark.parametrize("with_sinks", [True, False])
def test_decode_kernel_sinks_and_window_on_cuda(dtype, window, part, with_sinks):
    check_decode_kernel(dtype, window, part, with_sinks, "cuda")


def test_bf16_offloaded_fill_all_is_bit_identical_to_resident(tmp_path):
    path = _make(tmp_path / "bf16", dtype="bfloat16")
    runner = ModelRunner(path, _config(dtype="bfloat16", expert_policy="fill-all", expert_cache_slots=10**6),
                         progress=False)
    prompt = list(range(5, 45))  # 40 tokens: ten sliding windows of the tiny preset's 4
    resident, rt = greedy_decode(runner, prompt, 10, free=True)
    runner.set_expert_cache(6, "fill-all")  # < one layer (16 experts), >= a step's top-4
    offloaded, ot = greedy_decode(runner, prompt, 10, free=True)
    assert ot == rt and torch.equal(offloaded, resident)
    assert runner.experts.stats()["decode"]["fills"] > 0


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("gptoss-cuda-mxfp4") / "m"
    make_model(out, "gpt_oss", "tiny", seed=7, dtype="float32", quant="mxfp4")
    _randomize_biases(out)
    return out, _reference(out)


@pytest.mark.parametrize("policy,slots,executor", MXFP4_MODES, ids=[f"{p}-{s}-{e}" for p, s, e in MXFP4_MODES])
def test_mxfp4_matches_transformers_on_cuda(mxfp4_checkpoint, policy, slots, executor):
    """The MXFP4 rows decode on the device path (the quantized expert GEMV computing the clamped SwiGLU with the
    slots' biases), replayed from CUDA graphs where capturable; prefill on the grouped quantized GEMM."""
    path, (ref_logits, ref_toks) = mxfp4_checkpoint
    runner = ModelRunner(path, _config(expert_policy=policy, expert_cache_slots=slots, cpu_executor=executor),
                         progress=False)
    assert runner.pool.format.value == "mxfp4" and runner.experts.cache.layout.format.value == "mxfp4"
    assert runner.experts.cpu_executor.name.split("-")[0] == _executor_kind(executor)
    captured = _check_decode_path(runner, eager=False) if slots else False
    logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)
    st = runner.experts.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if captured:
        assert runner.graphs.graphs and not runner.graphs.failed  # decode replayed from graphs


@pytest.fixture(scope="module")
def mxfp4_bf16_checkpoint(tmp_path_factory):
    """gpt-oss's release case: MXFP4 experts computing in bfloat16."""
    out = tmp_path_factory.mktemp("gptoss-cuda-mxfp4-bf16") / "m"
    make_model(out, "gpt_oss", "tiny", seed=7, dtype="bfloat16", quant="mxfp4")
    _randomize_biases(out)
    return out, _reference(out, torch.bfloat16)


MXFP4_BF16_CUDA_MODES = [("fill-all", 10_000, "auto"), ("fill-all", 6, "auto"), ("qstar", 5, "auto"),
                         ("cpu-all", 5, "auto"), ("qstar", 5, "torch")]


@pytest.mark.parametrize("policy,slots,executor", MXFP4_BF16_CUDA_MODES,
                         ids=[f"{p}-{s}-{e}" for p, s, e in MXFP4_BF16_CUDA_MODES])
def test_mxfp4_bf16_decodes_on_the_device_path_with_cuda_graphs(mxfp4_bf16_checkpoint, policy, slots, executor):
    path, (ref_logits, ref_toks) = mxfp4_bf16_checkpoint
    runner = ModelRunner(path, _config(dtype="bfloat16", expert_policy=policy, expert_cache_slots=slots,
                                       cpu_executor=executor), progress=False)
    assert runner.pool.format.value == "mxfp4" and runner.pool.compute_dtype == torch.bfloat16
    captured = _check_decode_path(runner, eager=False)
    assert captured == ((executor != "torch" and native.available()) or not runner.experts.device_decode.cpu_branch)
    _check_bf16(runner, ref_logits, ref_toks)
    st = runner.experts.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if policy in ("qstar", "cpu-all"):
        assert st["cpu"] > 0
    if captured:
        assert runner.graphs.graphs and not runner.graphs.failed
