"""Reference dequantizers against the format definitions and the libraries that define them in practice
(transformers for FP8 block and MXFP4, compressed-tensors for NVFP4), and the quantizers' round trips."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from edgemoe.quant.dequant import (
    E2M1_VALUES,
    dequant_fp8_block,
    dequant_mxfp4,
    dequant_nvfp4_ct,
    dequant_nvfp4_modelopt,
    e8m0_to_float,
    unpack_fp4,
)
from edgemoe.quant.quantize import (
    pack_fp4,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
    round_to_e2m1,
)
from edgemoe.quant.scheme import QuantMethod


def _fp8(shape, g):
    """Random finite float8_e4m3fn values (all bit patterns but NaN)."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C  # e4m3fn NaN codes -> 1.5
    return b.view(torch.float8_e4m3fn)


def test_fp4_nibble_order_and_values():
    assert torch.equal(unpack_fp4(torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)),
                       torch.tensor([[0.5, 1.0, 6.0, -6.0]]))
    codes = torch.arange(16, dtype=torch.uint8)
    assert unpack_fp4(pack_fp4(codes)).tolist() == list(E2M1_VALUES)


def test_e8m0():
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_to_float(e)
    assert got[:6].tolist() == [2.0 ** (int(b) - 127) for b in e[:6]]
    assert math.isnan(got[6])


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_block_matches_transformers(scale_dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(0)
    w = _fp8((256, 384), g)
    s = (torch.rand(2, 3, generator=g) * 1e-2).to(scale_dtype)
    ref = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.float32)
    assert torch.equal(dequant_fp8_block(w, s), ref)


def test_fp8_block_partial_blocks_by_definition():
    g = torch.Generator().manual_seed(1)
    w = _fp8((5, 7), g)
    s = torch.rand(3, 3, generator=g)  # ceil(5/2), ceil(7/3)
    got = dequant_fp8_block(w, s, (2, 3))
    for r, c in itertools.product(range(5), range(7)):
        assert got[r, c] == w[r, c].float() * s[r // 2, c // 3]  # float32 arithmetic


def test_mxfp4_matches_transformers_every_byte():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(2)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(2 * 3 * 8 * 2 // 16)[: 2 * 3 * 8 * 16].view(2, 3, 8, 16)
    blocks = blocks[:, :, torch.randperm(8, generator=g)]
    scales = torch.randint(0, 255, (2, 3, 8), generator=g, dtype=torch.uint8)  # every E8M0 value but NaN
    scales[0, 0, :2] = torch.tensor([0, 254], dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequant_mxfp4(blocks, scales), ref.transpose(1, 2))
    nan = dequant_mxfp4(blocks[:1, :1, :1], torch.full((1, 1, 1), 255, dtype=torch.uint8))
    assert torch.isnan(nan).all()


def test_nvfp4_ct_matches_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.compressors.nvfp4.base")
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (64, 48), generator=g, dtype=torch.uint8)
    scale = (torch.rand(64, 6, generator=g) * 400).to(torch.float8_e4m3fn)
    gs = torch.tensor([1234.5678])
    out = ct.NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale,
                                               "weight_global_scale": gs},
                                              QuantizationScheme(targets=["Linear"], **NVFP4))["weight"]
    assert out.dtype == torch.bfloat16  # compressed-tensors computes in float32 and rounds once to bf16
    assert torch.equal(dequant_nvfp4_ct(packed, scale, gs).to(torch.bfloat16), out)


def test_nvfp4_modelopt_by_definition_and_against_ct_convention():
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (8, 16), generator=g, dtype=torch.uint8)
    scale = (torch.rand(8, 2, generator=g) * 400).to(torch.float8_e4m3fn)
    s2 = torch.tensor(3.7e-5)
    got = dequant_nvfp4_modelopt(packed, scale, s2)
    lut = list(E2M1_VALUES)
    for r, c in itertools.product(range(8), range(32)):
        byte = int(packed[r, c // 2])
        code = byte & 0xF if c % 2 == 0 else byte >> 4
        assert got[r, c] == lut[code] * (scale[r, c // 16].float() * s2)  # float32 arithmetic
    # the compressed-tensors convention with the reciprocal global scale agrees to float32 rounding
    torch.testing.assert_close(dequant_nvfp4_ct(packed, scale, (1 / s2).reshape(1)), got, rtol=4e-7, atol=0)


def test_round_to_e2m1_ties_to_even_and_saturates():
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.75, -100.0, -0.0, 2.4])
    assert unpack_fp4(pack_fp4(round_to_e2m1(x))).tolist() == [
        0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -6.0, -0.0, 2.0]


def test_quantizers_round_trip():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 256, generator=g) * 0.02
    w[:128, :128] = 0  # an all-zero FP8 block
    for sdt in (torch.float32, torch.bfloat16):
        q, s = quantize_fp8_block(w, (128, 128), sdt)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == sdt and s.shape == (3, 2) and s[0, 0] == 1
        err = (dequant_fp8_block(q, s) - w).abs()
        assert (err <= w.abs() * 2 ** -4 + s.float().max() * 2 ** -9).all()  # e4m3: 3 mantissa bits
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (300, 8, 16) and scales.shape == (300, 8)
    d = dequant_mxfp4(blocks, scales)
    amax = w.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    # the scale S = 2^ceil(log2(amax/6)) < amax/3 keeps |w|/S <= 6 (no saturation); the grid step there is 2S
    assert ((d - w).unflatten(-1, (-1, 32)).abs() <= amax / 3).all()
    assert (d.norm() - w.norm()).abs() / w.norm() < 0.1
    p, s, s2 = quantize_nvfp4(w, QuantMethod.NVFP4_MODELOPT)
    d_mo = dequant_nvfp4_modelopt(p, s, s2)
    p2, s_ct, gs = quantize_nvfp4(w, QuantMethod.NVFP4_CT)
    d_ct = dequant_nvfp4_ct(p2, s_ct, gs.reshape(1))
    for d in (d_mo, d_ct):
        assert ((d - w).norm() / w.norm()) < 0.12
    torch.testing.assert_close(gs, 1 / s2, rtol=1e-6, atol=0)
