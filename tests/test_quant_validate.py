"""Validation of released tensors against the declared scheme: every mismatch names the file and the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edgemoe.quant.quantize import quantize_linear, quantize_mxfp4, release_scheme
from edgemoe.quant.scheme import QuantMethod, QuantScheme, scheme_from_config
from edgemoe.quant.weights import (
    QuantTensorError,
    TensorMeta,
    WeightFormat,
    dequantize_linear,
    linear_weight,
    validate_linear,
    validate_mxfp4_experts,
)

F = "/ckpt/model-00001-of-00002.safetensors"
MOD = "model.layers.3.mlp.experts.7.gate_proj"
FP8 = scheme_from_config({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                          "modules_to_not_convert": ["lm_head", "mlp.gate"]})
MODELOPT = release_scheme(QuantMethod.NVFP4_MODELOPT)
CT = release_scheme(QuantMethod.NVFP4_CT)


def _tensors(scheme: QuantScheme, o: int = 200, i: int = 320) -> dict[str, torch.Tensor]:
    w = torch.randn(o, i, generator=torch.Generator().manual_seed(0))
    return {k.removeprefix(MOD + "."): v for k, v in quantize_linear(scheme, MOD, w).items()}


def _raises(match: str, scheme, tensors, shape=(200, 320), module=MOD):
    with pytest.raises(QuantTensorError, match=match) as e:
        validate_linear(scheme, module, tensors, shape, F)
    assert str(e.value).startswith(F + ": ")
    return str(e.value)


@pytest.mark.parametrize("scheme, fmt", [(FP8, WeightFormat.FP8_BLOCK), (MODELOPT, WeightFormat.NVFP4),
                                         (CT, WeightFormat.NVFP4)])
def test_released_tensors_validate(scheme, fmt):
    t = _tensors(scheme)
    assert validate_linear(scheme, MOD, t, (200, 320), F) is fmt
    assert validate_linear(scheme, MOD, {k: TensorMeta.of(v) for k, v in t.items()}, (200, 320), F) is fmt
    no_act = {k: v for k, v in t.items() if not k.startswith("input_")}  # activation scales are optional
    assert validate_linear(scheme, MOD, no_act, (200, 320), F) is fmt


def test_fp8_scale_grid_is_ceil_out_by_ceil_in():
    t = _tensors(FP8)
    assert tuple(t["weight_scale_inv"].shape) == (2, 3)  # ceil(200/128), ceil(320/128)
    msg = _raises(r"weight_scale_inv has shape \[2, 2\], expected \[2, 3\]", FP8,
                  {**t, "weight_scale_inv": torch.ones(2, 2)})
    assert f"tensor {MOD}.weight_scale_inv" in msg
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu):
        validate_linear(FP8, MOD, {**t, "weight_scale_inv": t["weight_scale_inv"].to(dt)}, (200, 320), F)
    _raises("weight_scale_inv has dtype uint8", FP8, {**t, "weight_scale_inv": torch.ones(2, 3, dtype=torch.uint8)})
    _raises(r"weight has dtype float8_e5m2, expected float8_e4m3fn", FP8,
            {**t, "weight": t["weight"].to(torch.float8_e5m2)})
    _raises(r"weight has shape \[200, 320\], expected \[200, 256\]", FP8, t, shape=(200, 256))
    _raises(rf"lacks tensor {MOD}.weight_scale_inv", FP8, {"weight": t["weight"]})
    _raises(r"unexpected tensor .*weight_zero_point", FP8, {**t, "weight_zero_point": torch.zeros(1)})
    _raises(r"input_scale has shape \[2\]", FP8, {**t, "input_scale": torch.ones(2)})


@pytest.mark.parametrize("scheme", [MODELOPT, CT])
def test_nvfp4_shapes_and_dtypes(scheme):
    t = _tensors(scheme)
    packed = "weight" if scheme.method is QuantMethod.NVFP4_MODELOPT else "weight_packed"
    glob = "weight_scale_2" if scheme.method is QuantMethod.NVFP4_MODELOPT else "weight_global_scale"
    _raises(rf"{packed} has shape \[200, 320\], expected \[200, 160\]", scheme,
            {**t, packed: torch.zeros(200, 320, dtype=torch.uint8)})
    _raises(r"weight_scale has dtype float32, expected float8_e4m3fn", scheme,
            {**t, "weight_scale": torch.ones(200, 20)})
    _raises(r"weight_scale has shape \[200, 10\], expected \[200, 20\]", scheme,
            {**t, "weight_scale": torch.ones(200, 10).to(torch.float8_e4m3fn)})
    _raises(rf"{glob} has shape \[2\]", scheme, {**t, glob: torch.ones(2)})
    _raises(rf"lacks tensor {MOD}.{glob}", scheme, {k: v for k, v in t.items() if k != glob})
    _raises("not a multiple of 16", scheme, t, shape=(200, 328))


def test_plain_and_excluded_modules():
    w = torch.randn(4, 256, dtype=torch.bfloat16)
    assert validate_linear(FP8, "model.layers.0.mlp.gate", {"weight": w}, (4, 256), F) is WeightFormat.BF16
    t = _tensors(FP8, 4, 256)
    msg = _raises("excludes it from quantization", FP8, t, shape=(4, 256), module="model.layers.0.mlp.gate")
    assert "pattern 'mlp.gate'" in msg
    none = scheme_from_config(None)
    _raises(r"weight_scale_inv looks quantized .* no quantization_config", none, t, shape=(4, 256))
    _raises(r"lacks tensor .*\.weight_scale_inv", FP8, {"weight": t["weight"]}, shape=(4, 256))
    _raises(r"bias has shape \[3\], expected \[4\]", FP8, {"weight": w, "bias": torch.zeros(3)}, shape=(4, 256))


def test_header_metadata_from_safetensors(tmp_path):
    t = {f"{MOD}.{k}": v for k, v in _tensors(FP8).items()}
    path = tmp_path / "model.safetensors"
    save_file(t, str(path))
    with safe_open(str(path), "pt") as h:
        names = h.keys()  # a safe_open handle is not a mapping
        metas = {k.removeprefix(MOD + "."): TensorMeta.from_safetensors(h, k, str(path)) for k in names}
    assert metas["weight"] == TensorMeta(torch.float8_e4m3fn, (200, 320))
    assert validate_linear(FP8, MOD, metas, (200, 320), str(path)) is WeightFormat.FP8_BLOCK


def test_linear_weight_normalizes_scales():
    t = _tensors(CT)
    qw = linear_weight(CT, MOD, t, (200, 320), F)
    assert qw.format is WeightFormat.NVFP4 and qw.scale2.shape == ()
    assert qw.scale2 == 1 / t["weight_global_scale"][0]
    torch.testing.assert_close(qw.dequant(), dequantize_linear(CT, MOD, t, (200, 320), F, torch.float32),
                               rtol=4e-7, atol=0)
    t8 = _tensors(FP8)
    t8["weight_scale_inv"] = t8["weight_scale_inv"].to(torch.bfloat16)  # as the Qwen3 FP8 releases ship them
    qw = linear_weight(FP8, MOD, t8, (200, 320), F)
    assert qw.scale.dtype == torch.float32 and torch.equal(qw.scale, t8["weight_scale_inv"].float())
    out = dequantize_linear(FP8, MOD, t8, (200, 320), F)
    assert out.dtype == torch.bfloat16 and torch.equal(out, qw.dequant().to(torch.bfloat16))


def test_mxfp4_experts():
    gpt_oss = release_scheme(QuantMethod.MXFP4)
    blocks, scales = quantize_mxfp4(torch.randn(4, 192, 64))
    ok = {"blocks": blocks, "scales": scales, "bias": torch.zeros(4, 192, dtype=torch.bfloat16)}
    module = "model.layers.3.mlp.experts"
    validate_mxfp4_experts(gpt_oss, module, "gate_up_proj", ok, 4, (192, 64), F)
    with pytest.raises(QuantTensorError, match=rf"{F}: tensor {module}.gate_up_proj_scales has shape \[4, 192, 1\]"):
        validate_mxfp4_experts(gpt_oss, module, "gate_up_proj", {**ok, "scales": scales[..., :1]}, 4, (192, 64), F)
    with pytest.raises(QuantTensorError, match=r"gate_up_proj_blocks has shape \[4, 192, 2, 16\], expected "
                                               r"\[8, 192, 2, 16\]"):
        validate_mxfp4_experts(gpt_oss, module, "gate_up_proj", ok, 8, (192, 64), F)
    with pytest.raises(QuantTensorError, match=r"missing tensor .*gate_up_proj_scales"):
        validate_mxfp4_experts(gpt_oss, module, "gate_up_proj", {"blocks": blocks}, 4, (192, 64), F)
    with pytest.raises(QuantTensorError, match="declares fp8_block"):
        validate_mxfp4_experts(FP8, module, "gate_up_proj", ok, 4, (192, 64), F)
    with pytest.raises(QuantTensorError, match="not part of the mxfp4 scheme"):
        validate_linear(gpt_oss, MOD, _tensors(FP8), (200, 320), F)
