"""The quantized expert kernels (``expert_gemv_quant``, ``grouped_swiglu_quant``: FP8 block, MXFP4, NVFP4 slots
dequantized in registers) against the reference dequantizer (``ExpertLayout.dequant_rows``) followed by the torch
expert math, at small shapes. Without CUDA they run in Triton's interpreter; the CUDA variants at real geometry
are ``tests/gpu/test_quant_kernels_gpu.py``."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from edgemoe.config import SILU_SWIGLU, ExpertActivation  # noqa: E402
from edgemoe.experts.compute import expert_biases, quant_slots, swiglu_expert, swiglu_oai_args  # noqa: E402
from edgemoe.kernels.expert_gemv import e2m1_to_f32, e8m0_to_f32, expert_gemv_quant  # noqa: E402
from edgemoe.kernels.grouped_gemm import (  # noqa: E402
    DEQUANT_MAX_CHUNKS,
    DEQUANT_MIN_ROUTES,
    choose_quant_config,
    dequantize_slots,
    grouped_swiglu,
    grouped_swiglu_quant,
)
from edgemoe.kernels.quant_slots import QuantSlots  # noqa: E402
from edgemoe.quant.dequant import E2M1_VALUES, e8m0_to_float  # noqa: E402
from edgemoe.quant.layout import ExpertLayout  # noqa: E402
from edgemoe.quant.quantize import pack_float_expert  # noqa: E402
from edgemoe.quant.weights import WeightFormat  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (format, H, I, FP8 block): FP8 with partial blocks in both dimensions, FP4 with several scale groups per tile
CASES = [(WeightFormat.FP8_BLOCK, 80, 40, (32, 16)), (WeightFormat.FP8_BLOCK, 64, 64, (128, 128)),
         (WeightFormat.MXFP4, 96, 64, None), (WeightFormat.NVFP4, 80, 48, None)]
IDS = [f"{f.value}-{h}x{i}" for f, h, i, _ in CASES]


# gpt-oss's experts: clamped SwiGLU with a limit that bites at these shapes (projections of std ~2), biases
GPT_OSS = ExpertActivation("swiglu_oai", alpha=1.702, limit=0.5, bias=True)
EXPERTS = {"silu": SILU_SWIGLU, "gpt-oss": GPT_OSS}


def _bank(fmt: WeightFormat, H: int, I: int, block, S: int, seed: int = 0,
          act: ExpertActivation = SILU_SWIGLU) -> tuple[ExpertLayout, torch.Tensor]:
    lay = ExpertLayout.build(fmt, H, I, has_bias=act.bias, block_size=block or (128, 128))
    g = torch.Generator().manual_seed(seed)
    bank = lay.new_bank(S)
    for r in range(S):
        b13, b2 = (torch.randn(2 * I, generator=g) * 0.5, torch.randn(H, generator=g) * 0.5) if act.bias \
            else (None, None)
        pack_float_expert(lay, torch.randn(2 * I, H, generator=g) * 0.2, torch.randn(H, I, generator=g) * 0.2,
                          out=bank[r], b13=b13, b2=b2)
    return lay, bank


def _reference(lay, bank, x, slot_of_route, w, dtype, act: ExpertActivation = SILU_SWIGLU):
    """Every route through the torch reference: rows dequantized (float32) and rounded to ``dtype``, then
    ``swiglu_expert`` with the rows' biases."""
    w13, w2 = lay.dequant_rows(bank, range(bank.shape[0]))  # [S, 2I, H], [S, H, I] float32
    w13, w2 = w13.to(dtype), w2.to(dtype)
    b13, b2 = lay.bias_rows(bank, range(bank.shape[0])) if lay.has_bias else (None, None)
    T, k = w.shape
    out = torch.zeros(T, k, x.shape[1], dtype=dtype)
    for p, s in enumerate(slot_of_route):
        if s < 0:
            continue
        t, j = divmod(p, k)
        y = swiglu_expert(x[t:t + 1].to(dtype), w13[s], w2[s], act, None if b13 is None else b13[s],
                          None if b2 is None else b2[s])
        out[t, j] = (y * w[t, j].to(dtype))[0]
    return out


def _kernel_args(act: ExpertActivation, lay: ExpertLayout, bank: torch.Tensor) -> dict:
    """The kernels' ``swiglu_oai`` / ``biases`` arguments for ``act`` over ``bank`` (on the device)."""
    return dict(swiglu_oai=swiglu_oai_args(act), biases=expert_biases(lay, bank))


def _close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


@triton.jit
def _decode_codes(c_ptr, s_ptr, v_ptr, e_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(v_ptr + i, e2m1_to_f32(tl.load(c_ptr + i)))
    tl.store(e_ptr + i, e8m0_to_f32(tl.load(s_ptr + i)))


def test_fp4_and_e8m0_decoders_are_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    vals = torch.empty(256, device=DEV)
    scales = torch.empty(256, device=DEV)
    _decode_codes[(1,)](codes & 15, codes, vals, scales, N=256)
    want = torch.tensor(E2M1_VALUES * 16)
    assert torch.equal(vals.cpu(), want) and torch.equal(torch.signbit(vals.cpu()), torch.signbit(want))
    torch.testing.assert_close(scales.cpu(), e8m0_to_float(codes.cpu()), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("extreme", ["gate_up", "down"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_gemv_skips_only_a_rounding_that_is_exact(dtype, extreme, monkeypatch):
    """MXFP4 into bf16 / float32 skips rounding each dequantized weight (``rounds_weights``): every code, under
    scales from the subnormal 2^-127 to overflow and NaN (one per row, so that a row's extremes stay in its own
    outputs), gives the bits of the rounding kernel. ``extreme`` is the projection given those scales; the other
    gets ordinary ones (2^-7 .. 2^0)."""
    import edgemoe.kernels.expert_gemv as eg

    assert not eg.rounds_weights(eg.MXFP4, dtype) and eg.rounds_weights(eg.MXFP4, torch.float16)
    assert eg.rounds_weights(eg.NVFP4, dtype) and eg.rounds_weights(eg.FP8, dtype)
    H, I = 64, 64
    lay, bank = _bank(WeightFormat.MXFP4, H, I, None, S=2)
    qs = quant_slots(lay, bank)
    g = torch.Generator().manual_seed(3)
    extremes = [0, 1, 2, 90, 127, 200, 253, 254, 255]
    if DEV.type == "cpu" and dtype == torch.bfloat16:  # Triton's interpreter flushes bf16 subnormals to zero
        extremes = extremes[2:]  # (torch and the GPU's conversion keep them): weights of 2^-127 and below
    extremes = torch.tensor(extremes, dtype=torch.uint8)
    for name, (codes, sc) in {"gate_up": (qs.w13, qs.w13_scale), "down": (qs.w2, qs.w2_scale)}.items():
        codes.copy_(torch.randint(0, 256, codes.shape, generator=g, dtype=torch.uint8))
        if name == extreme:
            sc.copy_(extremes[torch.arange(sc.shape[1]) % len(extremes)][None, :, None].expand(sc.shape))
        else:
            sc.copy_(torch.randint(120, 128, sc.shape, generator=g, dtype=torch.uint8))
    x = torch.randn(2, H, generator=g).to(DEV)
    slot_tk = torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=DEV)
    w = torch.rand(2, 2, generator=g).to(DEV)
    dslots = quant_slots(lay, bank.to(DEV))
    got = []
    for rounding in (False, True):
        monkeypatch.setattr(eg, "rounds_weights", lambda fmt, cdt, r=rounding: r)
        out = torch.empty(2, 2, H, dtype=dtype, device=DEV)
        a = torch.empty(4, I, dtype=dtype, device=DEV)
        expert_gemv_quant(x, slot_tk, w, dslots, out, a)
        got.append((a if extreme == "gate_up" else out).float().cpu())
    assert got[0].isnan().any() and (got[0].isfinite() & (got[0] != 0)).any()  # overflowed rows sum to NaN
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("experts", list(EXPERTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,H,I,block", CASES, ids=IDS)
def test_expert_gemv_quant_matches_the_reference_dequantizer(fmt, H, I, block, dtype, experts):
    act = EXPERTS[experts]
    lay, bank = _bank(fmt, H, I, block, S=3, act=act)
    g = torch.Generator().manual_seed(1)
    T, k = 2, 2
    x = torch.randn(T, H, generator=g)
    slot_tk = [2, -1, 1, 0]
    w = torch.rand(T, k, generator=g)
    out = torch.full((T, k, H), 9.0, dtype=dtype, device=DEV)
    a = torch.empty(T * k, I, dtype=dtype, device=DEV)
    dbank = bank.to(DEV)
    expert_gemv_quant(x.to(DEV), torch.tensor(slot_tk, dtype=torch.int32, device=DEV), w.to(DEV),
                      quant_slots(lay, dbank), out, a, **_kernel_args(act, lay, dbank))
    _close(out, _reference(lay, bank, x, slot_tk, w, dtype, act), dtype)
    assert not out[0, 1].any()  # the CPU route's row is zeroed


@pytest.mark.parametrize("experts", list(EXPERTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,H,I,block", CASES, ids=IDS)
def test_grouped_swiglu_quant_matches_the_reference_dequantizer(fmt, H, I, block, dtype, experts):
    act = EXPERTS[experts]
    S, E, T, k = 4, 6, 9, 2
    lay, bank = _bank(fmt, H, I, block, S, act=act)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
    slots = [3, -1, 0, 2, -1, 1]  # experts 1 and 4 are not on the device
    w = torch.rand(T, k, generator=g)
    dbank = bank.to(DEV)
    qs, kw = quant_slots(lay, dbank), _kernel_args(act, lay, dbank)
    dev = [t.to(DEV) for t in (x, ids, w, torch.tensor(slots))]
    out = torch.full((T, k, H), 9.0, dtype=dtype, device=DEV)
    grouped_swiglu_quant(*dev, qs, out, **kw)
    want = _reference(lay, bank, x, [slots[e] for e in ids.view(-1).tolist()], w, dtype, act)
    _close(out, want, dtype)
    kept = torch.full((T, k, H), 9.0, dtype=dtype, device=DEV)
    grouped_swiglu_quant(*dev, qs, kept, zero_missing=False, **kw)  # rows of missing experts left as they were
    missing = torch.tensor([slots[e] < 0 for e in ids.view(-1).tolist()]).view(T, k)
    assert bool((kept.cpu()[missing] == 9.0).all()) and torch.equal(kept.cpu()[~missing], out.cpu()[~missing])


FP4_CASES = [c for c in CASES if c[0] is not WeightFormat.FP8_BLOCK]
FP4_IDS = [i for c, i in zip(CASES, IDS, strict=True) if c[0] is not WeightFormat.FP8_BLOCK]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,H,I,block", FP4_CASES, ids=FP4_IDS)
def test_dequantize_slots_equals_the_reference_dequantizer_bit_for_bit(fmt, H, I, block, dtype):
    lay, bank = _bank(fmt, H, I, block, S=3, seed=4)
    qs = quant_slots(lay, bank.to(DEV))
    ids = torch.tensor([2, -1, 0, 1], device=DEV)
    w13 = torch.full((4, 2 * I, H), 7.0, dtype=dtype, device=DEV)
    w2 = torch.full((4, H, I), 7.0, dtype=dtype, device=DEV)
    dequantize_slots(qs, ids, w13, w2)
    r13, r2 = lay.dequant_rows(bank, [2, 0, 1])
    assert torch.equal(w13.cpu()[[0, 2, 3]], r13.to(dtype)) and torch.equal(w2.cpu()[[0, 2, 3]], r2.to(dtype))
    assert bool((w13[1] == 7.0).all()) and bool((w2[1] == 7.0).all())  # slot -1: left as it was
    with pytest.raises(ValueError, match="w2 must be"):
        dequantize_slots(qs, ids, w13, w2[:, :, :8])


@pytest.mark.parametrize("chunk", [1, 4, 6])
@pytest.mark.parametrize("experts", list(EXPERTS))
@pytest.mark.parametrize("fmt,H,I,block", FP4_CASES, ids=FP4_IDS)
def test_grouped_swiglu_quant_in_dequantized_chunks_equals_the_float_pair_bit_for_bit(fmt, H, I, block, experts,
                                                                                       chunk):
    """The dequantize-then-float-pair path, in chunks of 1, 4 (the last one partial) or all 6 experts, writes
    exactly what the float kernel pair writes over the reference-dequantized bank with the same tiles."""
    act, dtype = EXPERTS[experts], torch.bfloat16
    S, E, T, k = 4, 6, 9, 2
    lay, bank = _bank(fmt, H, I, block, S, act=act)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(T, H, generator=g).to(DEV), torch.rand(T, k, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)  # [T, k]
    slots = torch.tensor([3, -1, 0, 2, -1, 1], device=DEV)
    dbank = bank.to(DEV)
    qs, kw = quant_slots(lay, dbank), _kernel_args(act, lay, dbank)
    cfg = replace(choose_quant_config(T * k, E, qs, dtype), dequant_experts=chunk)
    r13, r2 = (t.to(dtype).to(DEV) for t in lay.dequant_rows(bank, range(S)))
    for zero_missing in (True, False):
        out = torch.full((T, k, H), 9.0, dtype=dtype, device=DEV)
        want = out.clone()
        grouped_swiglu_quant(x, ids, w, slots, qs, out, zero_missing=zero_missing, config=cfg, **kw)
        grouped_swiglu(x, ids, w, slots, r13, r2, want, zero_missing=zero_missing, config=cfg, **kw)
        assert torch.equal(out, want)


def test_choose_quant_config_dequantizes_fp4_from_sixteen_routes_per_expert():
    fp4 = quant_slots(*(lambda lay, b: (lay, b.to(DEV)))(*_bank(WeightFormat.NVFP4, 64, 32, None, S=1)))
    fp8 = quant_slots(*(lambda lay, b: (lay, b.to(DEV)))(*_bank(WeightFormat.FP8_BLOCK, 64, 64, (128, 128), S=1)))
    assert choose_quant_config(DEQUANT_MIN_ROUTES * 8 - 1, 8, fp4, torch.bfloat16).dequant_experts == 0
    few = choose_quant_config(DEQUANT_MIN_ROUTES * 8, 8, fp4, torch.bfloat16)  # 4·P·I = 2.7 experts of 3·H·I
    assert few.dequant_experts == 2 and few.block_k1 >= 32
    assert choose_quant_config(1 << 12, 8, fp4, torch.bfloat16).dequant_experts == 8  # at most every expert
    assert choose_quant_config(32, 2, fp4, torch.bfloat16).dequant_experts == 1  # at least one
    assert choose_quant_config(1 << 16, 8, fp8, torch.bfloat16).dequant_experts == 0  # FP8 stays fused
    # a wide layer (H 1536, I 32) of 64 experts: 4·P·I / (3·H·I) = P / 1152 experts a chunk, at most 8 chunks
    wide = quant_slots(*(lambda lay, b: (lay, b.to(DEV)))(*_bank(WeightFormat.MXFP4, 1536, 32, None, S=1)))
    assert choose_quant_config(64 * DEQUANT_MIN_ROUTES, 64, wide, torch.bfloat16).dequant_experts == 0  # 64 chunks
    assert choose_quant_config(1152 * 8 - 1, 64, wide, torch.bfloat16).dequant_experts == 0  # 7 a chunk: 10 chunks
    assert choose_quant_config(1152 * 8, 64, wide, torch.bfloat16).dequant_experts == 64 // DEQUANT_MAX_CHUNKS
    with pytest.raises(ValueError, match="FP4 slots only"):
        grouped_swiglu_quant(torch.zeros(1, 64, device=DEV), torch.zeros(1, 2, dtype=torch.long, device=DEV),
                             torch.ones(1, 2, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV), fp8,
                             torch.zeros(1, 2, 64, device=DEV),
                             config=replace(choose_quant_config(2, 1, fp8, torch.float32), dequant_experts=1))


def test_quant_kernels_reject_bad_slots_and_buffers():
    lay, bank = _bank(WeightFormat.NVFP4, 32, 32, None, S=2)
    qs = quant_slots(lay, bank.to(DEV))
    x, w = torch.zeros(1, 32, device=DEV), torch.ones(1, 2, device=DEV)
    slot = torch.zeros(2, dtype=torch.int32, device=DEV)
    out, a = torch.zeros(1, 2, 32, device=DEV), torch.zeros(2, 32, device=DEV)
    with pytest.raises(ValueError, match="w13_scale2"):
        expert_gemv_quant(x, slot, w, QuantSlots("nvfp4", qs.w13, qs.w13_scale, qs.w2, qs.w2_scale), out, a)
    with pytest.raises(ValueError, match="w13_scale must be"):
        expert_gemv_quant(x, slot, w, QuantSlots("mxfp4", qs.w13, qs.w13_scale, qs.w2, qs.w2_scale), out, a)
    with pytest.raises(ValueError, match="power of two"):
        QuantSlots("fp8_block", qs.w13, qs.w13_scale, qs.w2, qs.w2_scale, block=(128, 96)).check()
    with pytest.raises(ValueError, match="int32"):
        expert_gemv_quant(x, slot.long(), w, qs, out, a)
    with pytest.raises(ValueError, match="scratch"):
        expert_gemv_quant(x, slot, w, qs, out, a[:, :16])
    with pytest.raises(ValueError, match="routed"):
        grouped_swiglu_quant(x, torch.zeros(1, 2, dtype=torch.long, device=DEV), w,
                             torch.zeros(2, dtype=torch.long, device=DEV), qs, out[:, :1])
    with pytest.raises(ValueError, match="not quantized"):
        quant_slots(ExpertLayout.build(WeightFormat.BF16, 32, 32), bank)
