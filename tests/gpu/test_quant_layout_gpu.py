"""The packed expert row on a CUDA bank: typed section views and the reference dequantization match the CPU."""

from __future__ import annotations

import pytest
import torch

from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.quantize import (
    quantize_gpt_oss_experts,
    quantize_linear,
    release_scheme,
)
from edgemoe.quant.scheme import QuantMethod
from edgemoe.quant.weights import (
    WeightFormat,
    gpt_oss_gate_up,
    linear_weight,
    mxfp4_expert_weight,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

H, I, N = 2048, 768, 3  # Qwen3-30B-A3B expert geometry


def _bank(fmt: WeightFormat) -> tuple[ExpertLayout, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lay = ExpertLayout.build(fmt, H, I)
    bank = lay.new_bank(N)
    for r in range(N):
        ws = [torch.randn(o, i, generator=g) * 0.02 for o, i in ((I, H), (I, H), (H, I))]
        if fmt is WeightFormat.MXFP4:
            gate_up = torch.stack((ws[0], ws[1]), dim=1).reshape(1, 2 * I, H)  # gpt-oss interleaving
            t = quantize_gpt_oss_experts("m", gate_up, ws[2][None])
            gate, up, _ = gpt_oss_gate_up(t["m.gate_up_proj_blocks"][0], t["m.gate_up_proj_scales"][0])
            qs = [gate, up, mxfp4_expert_weight(t["m.down_proj_blocks"][0], t["m.down_proj_scales"][0])]
        else:
            scheme = release_scheme({WeightFormat.FP8_BLOCK: QuantMethod.FP8_BLOCK,
                                     WeightFormat.NVFP4: QuantMethod.NVFP4_MODELOPT}[fmt])
            qs = []
            for w in ws:
                t = {k.removeprefix("m."): v for k, v in quantize_linear(scheme, "m", w).items()}
                qs.append(linear_weight(scheme, "m", t, tuple(w.shape), "f"))
        lay.pack_expert(*qs, out=bank[r])
    return lay, bank


@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.MXFP4, WeightFormat.NVFP4])
def test_cuda_bank_views_and_dequant(fmt):
    lay, bank = _bank(fmt)
    dev = bank.cuda()
    for s in lay.sections:
        v = lay.view(dev, s.name)
        assert v.is_cuda and v.dtype == s.dtype and v.shape == (N, *s.shape)
        assert torch.equal(v.cpu().view(torch.uint8), lay.view(bank, s.name).view(torch.uint8))
    w13, w2 = lay.dequant_rows(dev, [2, 0])
    c13, c2 = lay.dequant_rows(bank, [2, 0])
    assert torch.equal(w13.cpu(), c13) and torch.equal(w2.cpu(), c2)
