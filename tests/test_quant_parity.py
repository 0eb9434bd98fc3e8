"""Quantized checkpoints (FP8 block-128, MXFP4, NVFP4 ModelOpt and compressed-tensors) served from their
packed rows match their ``transformers`` reference (``tests/quant_reference.py``) in every execution mode on
the CPU: all resident, each expert policy with a cache smaller than one layer, CPU-only.

The engine computes in float32 here, with the native CPU kernels dequantizing the packed rows in registers
where the extension builds, so the comparison is exact up to float32 summation order: the
dequantized weights are the same numbers on both sides (compressed-tensors NVFP4 experts: up to a few
float32 ulp, the row storing ``1 / weight_global_scale`` as a multiplier). A bfloat16 run checks the
rounding rule (float32 dequantization, then one rounding to bf16): it is bit-identical to serving a bf16
copy of the dequantized weights.
"""

from __future__ import annotations

import pytest
import torch
from quant_reference import (
    QUANTS,
    float_copy,
    native_weights_are_torch_weights,
    quantized_checkpoint,
    reference_model,
)

from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.quant.weights import WeightFormat

from conftest import greedy_decode, reference_greedy


def _native_isas() -> list[str]:
    from edgemoe.experts import native

    try:
        return native.supported_isas(WeightFormat.FP8_BLOCK, torch.float32)
    except native.NativeUnavailable:
        return []


_NATIVE_ISAS = _native_isas()

MODES = [
    ("fill-all", None),  # every expert resident
    ("fill-all", 5),  # fewer slots than one layer's 16 experts: fills on demand
    ("fill-all", 32),  # two staging regions of E slots: streamed prefill
    ("qstar", 5),
    ("cpu-all", 5),
    ("static", 5),
    ("qstar", 0),  # CPU-only
]
PROMPT = [3, 17, 92, 5, 41, 8, 77, 23, 64, 11, 9, 30]
STEPS = 6
FORMATS = {"fp8": WeightFormat.FP8_BLOCK, "mxfp4": WeightFormat.MXFP4, "nvfp4-modelopt": WeightFormat.NVFP4,
           "nvfp4-ct": WeightFormat.NVFP4}


@pytest.fixture(scope="module", params=QUANTS)
def quantized(request, tmp_path_factory):
    if request.param == "fp8":
        pytest.importorskip("accelerate")  # transformers' FP8 loader requires it (test extra)
    d = quantized_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    ref = reference_model(d, request.param, tmp_path_factory.mktemp(f"{request.param}-ref") / "f32")
    return request.param, d, reference_greedy(ref, PROMPT, STEPS)


def _runner(path, policy: str, slots: int | None, dtype: str = "float32", **kw) -> ModelRunner:
    return ModelRunner(path, EngineConfig(device="cpu", dtype=dtype, expert_policy=policy,
                                          expert_cache_slots=10_000 if slots is None else slots,
                                          bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, **kw), progress=False)


@pytest.mark.parametrize("policy,slots", MODES, ids=[f"{p}-{s}" for p, s in MODES])
def test_quantized_experts_match_transformers(quantized, policy, slots):
    quant, path, (ref_logits, ref_toks) = quantized
    runner = _runner(path, policy, slots)
    pool = runner.pool
    assert pool.format is FORMATS[quant] and pool.compute_dtype == torch.float32
    # the native kernels read the packed rows where the extension builds (the torch executor otherwise)
    assert runner.experts.cpu_executor.name.startswith("native-") or not _NATIVE_ISAS
    logits, toks = greedy_decode(runner, PROMPT, STEPS, free=True)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    runner.experts.cache.check_invariants()
    st = runner.experts.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if policy == "qstar" and slots:
        assert st["fills"] > 0 and st["cpu"] > 0


def test_bf16_compute_is_bit_identical_to_a_bf16_copy_of_the_dequantized_weights(quantized, tmp_path):
    _, path, _ = quantized
    copy = float_copy(path, tmp_path / "bf16", torch.bfloat16, ct_expert_multiplier=True)
    for policy, slots in (("fill-all", None), ("qstar", 5), ("qstar", 0)):
        # the torch CPU executor on both sides (the native kernels' float32 summation order differs from
        # oneDNN's: within tolerance, not bit-identical; test_native_executor_matches_torch_executor)
        q = greedy_decode(_runner(path, policy, slots, "bfloat16", cpu_executor="torch"), PROMPT, STEPS, free=True)
        f = greedy_decode(_runner(copy, policy, slots, "bfloat16", cpu_executor="torch"), PROMPT, STEPS, free=True)
        assert q[1] == f[1] and torch.equal(q[0], f[0]), (policy, slots)


@pytest.mark.skipif(not _NATIVE_ISAS, reason="native CPU extension unavailable")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_executor_matches_torch_executor(quantized, dtype, monkeypatch):
    """The native kernels dequantize the packed rows in registers; the torch executor dequantizes them with
    ``dequant_rows`` and runs the float expert. Greedy tokens are equal, logits equal up to summation order
    (float32) or a few bf16 one-ulp flips (bfloat16), CPU-only and with a cache smaller than a layer. The
    expert kernels alone: both runners keep torch's norms and attention (the native executor's dense decode
    operations are checked against those in ``test_cpu_dense.py``)."""
    from edgemoe.experts import native

    monkeypatch.setattr(native.NativeCpuExecutor, "dense", None)
    quant, path, _ = quantized
    tol = {"float32": 1e-4, "bfloat16": 5e-2}[dtype]
    for policy, slots in (("qstar", 0), ("qstar", 5)):
        nat = _runner(path, policy, slots, dtype)
        assert nat.experts.cpu_executor.name.startswith("native-")
        n = greedy_decode(nat, PROMPT, STEPS, free=True)
        t = greedy_decode(_runner(path, policy, slots, dtype, cpu_executor="torch"), PROMPT, STEPS, free=True)
        assert n[1] == t[1], (policy, slots)
        # the FP4 integer kernels (avx2int, avx2vnni, avx512bf16) also round an activation's small elements
        same_numbers = native_weights_are_torch_weights(quant) and nat.experts.cpu_executor.name not in (
            "native-avx2int", "native-avx2vnni", "native-avx512bf16")
        if dtype == "bfloat16" and not same_numbers:
            # this kernel multiplies the format's exact weights (the codes times the float32 block or group
            # scale), the torch executor their bf16 roundings (and the FP4 integer kernels a 15-bit activation):
            # both are bf16 computations of the same model, and the native one is no farther from the float32
            # computation than the torch one
            f = greedy_decode(_runner(path, policy, slots, "float32", cpu_executor="torch"), PROMPT, STEPS, free=True)
            err_n, err_t = (n[0].float() - f[0]).abs(), (t[0].float() - f[0]).abs()
            assert float(err_n.mean()) <= 1.1 * float(err_t.mean()), (policy, slots)
            torch.testing.assert_close(n[0], t[0], rtol=3 * tol, atol=3 * tol)
        else:
            torch.testing.assert_close(n[0], t[0], rtol=tol, atol=tol)
        assert nat.experts.stats()["decode"]["cpu"] > 0


def test_packed_rows_are_the_checkpoint_bytes(quantized):
    """The pool holds the released codes and scales as they are: its rows are smaller than bf16 rows by the
    format's ratio, and the eager path's fills copy those bytes."""
    _, path, _ = quantized
    runner = _runner(path, "fill-all", 5)
    bf16 = runner.pool.layout.build(WeightFormat.BF16, runner.pool.hidden, runner.pool.intermediate)
    assert runner.pool.row_bytes < bf16.row_bytes
    greedy_decode(runner, PROMPT, 2, free=True)
    cache = runner.experts.cache
    for slot, fid in enumerate(cache.owner_of.tolist()):
        if fid >= 0:
            assert torch.equal(cache.bank[slot], runner.pool.bank[fid])
