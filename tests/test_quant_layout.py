"""The packed expert row (edgemoe.quant.layout): sizes, alignment, pack / view / dequant round trips."""

from __future__ import annotations

import pytest
import torch

from edgemoe.quant.layout import ROW_ALIGN, SECTION_ALIGN, ExpertLayout, LayoutError
from edgemoe.quant.quantize import (
    quantize_gpt_oss_experts,
    quantize_linear,
    release_scheme,
)
from edgemoe.quant.scheme import QuantMethod
from edgemoe.quant.weights import (
    QuantizedWeight,
    WeightFormat,
    gpt_oss_gate_up,
    linear_weight,
    mxfp4_expert_weight,
)

F = WeightFormat


def test_bytes_per_expert_table():
    # the table in edgemoe/quant/layout.py's docstring
    qwen3 = {F.BF16: 9_437_184, F.FP8_BLOCK: 4_722_688, F.MXFP4: 2_506_752, F.NVFP4: 2_658_304}
    gpt_oss_120b = {F.BF16: 49_803_264, F.FP8_BLOCK: 24_928_256, F.MXFP4: 13_254_656, F.NVFP4: 14_032_896}
    for fmt, n in qwen3.items():
        assert ExpertLayout.build(fmt, 2048, 768).row_bytes == n
    for fmt, n in gpt_oss_120b.items():
        assert ExpertLayout.build(fmt, 2880, 2880, has_bias=True).row_bytes == n
    bf16 = ExpertLayout.build(F.BF16, 2048, 768)
    assert bf16.row_bytes == (2 * 768 * 2048 + 2048 * 768) * 2  # no padding: same bytes as today's two banks


@pytest.mark.parametrize("fmt", list(F))
@pytest.mark.parametrize("geometry", [(2048, 768, False), (2880, 2880, True), (96, 32, True)])
def test_alignment_and_order(fmt, geometry):
    h, i, has_bias = geometry
    lay = ExpertLayout.build(fmt, h, i, has_bias)
    assert lay.row_bytes % ROW_ALIGN == 0
    end = 0
    for s in lay.sections:
        assert s.offset % SECTION_ALIGN == 0 and s.offset >= end
        end = s.end
    assert end <= lay.row_bytes < end + ROW_ALIGN + SECTION_ALIGN
    names = [s.name for s in lay.sections]
    assert names[0] == "w13" and "w2" in names and (("b13" in names) == has_bias)
    assert ExpertLayout.from_json(lay.to_json()) == lay


def test_geometry_errors():
    with pytest.raises(LayoutError, match="multiples of 32"):
        ExpertLayout.build(F.MXFP4, 2048, 784)
    with pytest.raises(LayoutError, match="multiples of 16"):
        ExpertLayout.build(F.NVFP4, 2056, 768)
    d = ExpertLayout.build(F.NVFP4, 256, 192).to_json()
    d["sections"][1]["offset"] += 64
    with pytest.raises(LayoutError, match="does not match"):
        ExpertLayout.from_json(d)


H, I, N = 256, 192, 5  # I = 1.5 FP8 blocks: the stacked gate/up scale rows are exercised with a partial block


def _expert(fmt: F, seed: int) -> tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight]:
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(o, i, generator=g) * 0.05 for o, i in ((I, H), (I, H), (H, I))]
    if fmt.dense:
        return tuple(QuantizedWeight(fmt, tuple(w.shape), w.to(fmt.dtype)) for w in ws)
    method = {F.FP8_BLOCK: QuantMethod.FP8_BLOCK, F.NVFP4: QuantMethod.NVFP4_MODELOPT}[fmt]
    scheme = release_scheme(method)
    out = []
    for w in ws:
        t = {k.removeprefix("m."): v for k, v in quantize_linear(scheme, "m", w, torch.bfloat16).items()}
        out.append(linear_weight(scheme, "m", t, tuple(w.shape), "f"))
    return tuple(out)


@pytest.mark.parametrize("fmt", [F.BF16, F.FP16, F.FP32, F.FP8_BLOCK, F.NVFP4])
def test_pack_view_dequant(fmt):
    lay = ExpertLayout.build(fmt, H, I, has_bias=True)
    bank = lay.new_bank(N)
    experts = [_expert(fmt, seed) for seed in range(N)]
    biases = [(torch.randn(2 * I), torch.randn(H)) for _ in range(N)]
    for r, ((gate, up, down), (b13, b2)) in enumerate(zip(experts, biases)):
        assert lay.pack_expert(gate, up, down, b13, b2, out=bank[r]) is not None
    w13 = lay.view(bank, "w13")
    assert w13.shape == (N, 2 * I, H if fmt.dense or fmt is F.FP8_BLOCK else H // 2)
    assert w13.dtype == fmt.dtype and w13.data_ptr() == bank.data_ptr()
    gate, up, down = experts[3]
    assert torch.equal(w13[3, :I].view(torch.uint8), gate.data.view(torch.uint8))
    assert torch.equal(w13[3, I:].view(torch.uint8), up.data.view(torch.uint8))
    ids = [3, 0, 3]
    d13, d2 = lay.dequant_rows(bank, ids)
    assert d13.shape == (3, 2 * I, H) and d2.shape == (3, H, I) and d13.dtype == torch.float32
    for k, r in enumerate(ids):
        gate, up, down = experts[r]
        assert torch.equal(d13[k], torch.cat((gate.dequant(), up.dequant())))
        assert torch.equal(d2[k], down.dequant())
    b13, b2 = lay.bias_rows(bank, ids)
    assert torch.equal(b13[0], biases[3][0]) and torch.equal(b2[1], biases[0][1])
    sub = bank[1:4]  # a slice of rows views the same way
    assert torch.equal(lay.view(sub, "w2")[0].view(torch.uint8), lay.view(bank, "w2")[1].view(torch.uint8))
    if fmt is F.FP8_BLOCK:
        s13 = lay.view(bank, "w13_scale")
        assert s13.shape == (N, 4, 2) and torch.equal(s13[3, :2], experts[3][0].scale)
    if fmt is F.NVFP4:
        assert torch.equal(lay.view(bank, "w13_scale2")[3], torch.stack((experts[3][0].scale2, experts[3][1].scale2)))


def test_view_writes_through():
    lay = ExpertLayout.build(F.BF16, H, I)
    bank = lay.new_bank(2)
    lay.view(bank, "w2")[1].fill_(1.5)
    assert lay.dequant_rows(bank, [1])[1].eq(1.5).all() and lay.dequant_rows(bank, [0])[1].eq(0).all()


def test_gpt_oss_rows_match_transformers_dequant():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    e, h, i = 3, 64, 96
    g = torch.Generator().manual_seed(7)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    gu_bias, d_bias = torch.randn(e, 2 * i, generator=g).bfloat16(), torch.randn(e, h, generator=g).bfloat16()
    t = quantize_gpt_oss_experts("model.layers.0.mlp.experts", gate_up, down, gu_bias, d_bias)
    gub, gus = t["model.layers.0.mlp.experts.gate_up_proj_blocks"], t["model.layers.0.mlp.experts.gate_up_proj_scales"]
    db, ds = t["model.layers.0.mlp.experts.down_proj_blocks"], t["model.layers.0.mlp.experts.down_proj_scales"]
    lay = ExpertLayout.build(F.MXFP4, h, i, has_bias=True)
    bank = lay.new_bank(e)
    for x in range(e):
        gate, up, b13 = gpt_oss_gate_up(gub[x], gus[x], gu_bias[x])
        lay.pack_expert(gate, up, mxfp4_expert_weight(db[x], ds[x]), b13, d_bias[x], out=bank[x])
    w13, w2 = lay.dequant_rows(bank, range(e))
    ref13 = convert_moe_packed_tensors(gub, gus, dtype=torch.float32)  # [E, H, 2I], GptOssExperts.gate_up_proj
    ref2 = convert_moe_packed_tensors(db, ds, dtype=torch.float32)  # [E, I, H], GptOssExperts.down_proj
    assert torch.equal(w13[:, :i], ref13[..., ::2].transpose(1, 2))  # gate: the even columns
    assert torch.equal(w13[:, i:], ref13[..., 1::2].transpose(1, 2))  # up: the odd columns
    assert torch.equal(w2, ref2.transpose(1, 2))
    b13, b2 = lay.bias_rows(bank, range(e))
    assert torch.equal(b13[:, :i], gu_bias[:, ::2].float()) and torch.equal(b13[:, i:], gu_bias[:, 1::2].float())
    assert torch.equal(b2, d_bias.float())


def test_pack_errors():
    lay = ExpertLayout.build(F.NVFP4, H, I)
    gate, up, down = _expert(F.NVFP4, 0)
    bf = _expert(F.BF16, 0)
    with pytest.raises(LayoutError, match="gate: weight format bf16 does not match the nvfp4 layout"):
        lay.pack_expert(bf[0], up, down)
    with pytest.raises(LayoutError, match=r"down: weight shape \(192, 256\), expected \(256, 192\)"):
        lay.pack_expert(gate, up, gate)
    with pytest.raises(LayoutError, match="has_bias=False but b13 / b2 given"):
        lay.pack_expert(gate, up, down, torch.zeros(2 * I), torch.zeros(H))
    with pytest.raises(LayoutError, match="out must be contiguous uint8"):
        lay.pack_expert(gate, up, down, out=torch.empty(lay.row_bytes - 1, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="expert bank must be uint8"):
        lay.view(torch.zeros(2, lay.row_bytes, dtype=torch.int8), "w13")
    with pytest.raises(LayoutError, match="no bias sections"):
        lay.bias_rows(lay.new_bank(1), [0])
    with pytest.raises(KeyError, match="no section 'b13'"):
        lay.section("b13")
    fp8 = ExpertLayout.build(F.FP8_BLOCK, H, I, block_size=(64, 64))
    with pytest.raises(LayoutError, match=r"FP8 block size \(128, 128\) does not match"):
        fp8.pack_expert(*_expert(F.FP8_BLOCK, 0))
