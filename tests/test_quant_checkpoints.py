"""Tiny checkpoints written in each released quantized layout, loaded by transformers (the reference) and by
edgemoe.quant's validation / packing / reference dequantization, which must agree bit for bit.

transformers 5 dequantizes FP8 block and gpt-oss MXFP4 on the CPU; for NVFP4 it has no pre-quantized loader
of its own, and its compressed-tensors path (``CompressedTensorsConfig(dequantize=True)``, which calls the
compressed-tensors library) is checked here for non-expert linears only: for routed experts it leaves out the
global scale (transformers 5.24).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.quantize import (
    hf_quant_config,
    quantization_config,
    quantize_state_dict,
    release_scheme,
)
from edgemoe.quant.scheme import QuantMethod, QuantScheme, detect_scheme
from edgemoe.quant.weights import (
    TensorMeta,
    WeightFormat,
    dequantize_linear,
    gpt_oss_gate_up,
    linear_weight,
    mxfp4_expert_weight,
    validate_linear,
    validate_mxfp4_experts,
)

H, I, E, LAYERS = 256, 128, 4, 2  # FP8 dims are multiples of 128 or below it: transformers derives blocks from shapes


@pytest.fixture(scope="module")
def qwen3_moe_bf16(tmp_path_factory) -> Path:
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, num_experts=E, num_experts_per_tok=2,
                                      moe_intermediate_size=I, intermediate_size=256, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("qwen3_moe_bf16")
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


def _write_quantized(src: Path, dst: Path, scheme: QuantScheme, linears=None, scale_dtype=torch.float32) -> dict:
    """Rewrite src's checkpoint in scheme's release layout into dst; return the written tensors."""
    dst.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    if linears is None:
        linears = [k.removesuffix(".weight") for k, v in sd.items()
                   if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k]
    q = quantize_state_dict(sd, scheme, linears, scale_dtype)
    save_file(q, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(scheme)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if scheme.method is QuantMethod.NVFP4_MODELOPT:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(scheme), indent=2))
    return q


def _by_module(names) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(n.rpartition(".")[0], []).append(n.rpartition(".")[2])
    return out


def _module_tensors(h, module: str, params) -> dict[str, torch.Tensor]:
    return {p: h.get_tensor(f"{module}.{p}") for p in params}


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=["qwen3-bf16-scales", "dsv3-f32-scales"])
def test_fp8_block_checkpoint_loads_in_transformers(qwen3_moe_bf16, tmp_path, scale_dtype):
    pytest.importorskip("accelerate")  # transformers' FP8 loader requires it (test extra)
    d = tmp_path / "fp8"
    _write_quantized(qwen3_moe_bf16, d, release_scheme(QuantMethod.FP8_BLOCK), scale_dtype=scale_dtype)
    scheme = detect_scheme(d)
    assert scheme.method is QuantMethod.FP8_BLOCK and scheme.block_size == (128, 128)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    params = dict(ref.named_parameters())
    f = d / "model.safetensors"
    layout = ExpertLayout.build(WeightFormat.FP8_BLOCK, H, I)
    bank = layout.new_bank(LAYERS * E)
    with safe_open(str(f), "pt") as h:
        modules = _by_module(h.keys())
        assert h.get_slice("model.layers.0.mlp.experts.1.up_proj.weight_scale_inv").get_dtype() == {
            torch.bfloat16: "BF16", torch.float32: "F32"}[scale_dtype]
        for layer in range(LAYERS):
            for e in range(E):
                ws = {}
                for role, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    m = f"model.layers.{layer}.mlp.experts.{e}.{role}"
                    ws[role] = linear_weight(scheme, m, _module_tensors(h, m, modules.pop(m)), shape, str(f))
                layout.pack_expert(ws["gate_proj"], ws["up_proj"], ws["down_proj"], out=bank[layer * E + e])
        w13, w2 = layout.dequant_rows(bank, range(LAYERS * E))
        for layer in range(LAYERS):
            experts = ref.model.layers[layer].mlp.experts
            assert torch.equal(w13[layer * E:(layer + 1) * E], experts.gate_up_proj.data)  # [E, 2I, H]
            assert torch.equal(w2[layer * E:(layer + 1) * E], experts.down_proj.data)  # [E, H, I]
        quantized = []
        for m, ps in modules.items():  # every other module: attention, router, lm_head, embeddings, norms
            if m.endswith(("norm", "embed_tokens")):
                continue
            t = _module_tensors(h, m, ps)
            shape = tuple(params[f"{m}.weight"].shape)
            w = dequantize_linear(scheme, m, t, shape, str(f), torch.float32)
            assert torch.equal(w, params[f"{m}.weight"].data), m
            if "weight_scale_inv" in t:
                quantized.append(m)
        assert "model.layers.1.self_attn.k_proj" in quantized and "lm_head" not in quantized
        assert not any(m.endswith("mlp.gate") for m in quantized)  # routers stay bf16, as in the releases


def test_gpt_oss_mxfp4_checkpoint_loads_in_transformers(tmp_path):
    h, i, e = 64, 96, 4
    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=h, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_local_experts=e, num_experts_per_tok=2,
                                    intermediate_size=i, max_position_embeddings=128, sliding_window=16,
                                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    src = tmp_path / "bf16"
    model.save_pretrained(src)
    q = _write_quantized(src, tmp_path / "mxfp4", release_scheme(QuantMethod.MXFP4), linears=())
    d = tmp_path / "mxfp4"
    scheme = detect_scheme(d)
    assert scheme.method is QuantMethod.MXFP4
    prefix = "model.layers.1.mlp.experts"
    assert q[f"{prefix}.gate_up_proj_blocks"].shape == (e, 2 * i, h // 32, 16)
    assert q[f"{prefix}.down_proj_scales"].shape == (e, h, i // 32)
    assert q[f"{prefix}.gate_up_proj_bias"].dtype == torch.bfloat16
    # dequantized at load: releases from 5.25 otherwise fetch MXFP4 kernels from the Hub when Triton and the
    # ``kernels`` package are installed, even on a CPU-only machine
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    f = str(d / "model.safetensors")
    layout = ExpertLayout.build(WeightFormat.MXFP4, h, i, has_bias=True)
    bank = layout.new_bank(2 * e)
    with safe_open(f, "pt") as hd:
        for layer in range(2):
            m = f"model.layers.{layer}.mlp.experts"
            t = {proj: {k: hd.get_tensor(f"{m}.{proj}_{k}") for k in ("blocks", "scales", "bias")}
                 for proj in ("gate_up_proj", "down_proj")}
            validate_mxfp4_experts(scheme, m, "gate_up_proj", t["gate_up_proj"], e, (2 * i, h), f)
            validate_mxfp4_experts(scheme, m, "down_proj", {k: TensorMeta.of(v) for k, v in t["down_proj"].items()},
                                   e, (h, i), f)
            for x in range(e):
                gate, up, b13 = gpt_oss_gate_up(t["gate_up_proj"]["blocks"][x], t["gate_up_proj"]["scales"][x],
                                                t["gate_up_proj"]["bias"][x])
                down = mxfp4_expert_weight(t["down_proj"]["blocks"][x], t["down_proj"]["scales"][x])
                layout.pack_expert(gate, up, down, b13, t["down_proj"]["bias"][x], out=bank[layer * e + x])
            attn = f"model.layers.{layer}.self_attn.q_proj"
            plain = {"weight": hd.get_tensor(f"{attn}.weight"), "bias": hd.get_tensor(f"{attn}.bias")}
            assert validate_linear(scheme, attn, plain, (64, h), f) is WeightFormat.BF16
    w13, w2 = layout.dequant_rows(bank, range(2 * e))
    b13, b2 = layout.bias_rows(bank, range(2 * e))
    for layer in range(2):
        experts = ref.model.layers[layer].mlp.experts
        gu = experts.gate_up_proj.data  # [E, H, 2I], gate = even columns, up = odd columns
        rows = slice(layer * e, (layer + 1) * e)
        assert torch.equal(w13[rows], torch.cat((gu[..., ::2], gu[..., 1::2]), dim=-1).transpose(1, 2))
        assert torch.equal(w2[rows], experts.down_proj.data.transpose(1, 2))  # down_proj is [E, I, H]
        gub = experts.gate_up_proj_bias.data
        assert torch.equal(b13[rows], torch.cat((gub[:, ::2], gub[:, 1::2]), dim=-1))
        assert torch.equal(b2[rows], experts.down_proj_bias.data)


def test_nvfp4_compressed_tensors_checkpoint(qwen3_moe_bf16, tmp_path):
    pytest.importorskip("compressed_tensors")
    d = tmp_path / "ct"
    _write_quantized(qwen3_moe_bf16, d, release_scheme(QuantMethod.NVFP4_CT))
    scheme = detect_scheme(d)
    assert scheme.method is QuantMethod.NVFP4_CT
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(json.loads((d / "config.json").read_text())["quantization_config"])
    assert parsed.format == "nvfp4-pack-quantized" and parsed.ignore == ["lm_head", "re:.*mlp.gate$"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    params = dict(ref.named_parameters())
    f = str(d / "model.safetensors")
    with safe_open(f, "pt") as h:
        modules = _by_module(h.keys())
        checked = 0
        for m, ps in modules.items():
            if ".self_attn." not in m or m.endswith("norm"):
                continue
            t = _module_tensors(h, m, ps)
            w = dequantize_linear(scheme, m, t, tuple(params[f"{m}.weight"].shape), f)  # bf16, as compressed-tensors
            assert "weight_packed" in t and torch.equal(w.float(), params[f"{m}.weight"].data), m
            checked += 1
        assert checked == 4 * LAYERS
        layout = ExpertLayout.build(WeightFormat.NVFP4, H, I)
        row = layout.new_bank(1)
        ws = []
        for role, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            m = f"model.layers.1.mlp.experts.2.{role}"
            t = _module_tensors(h, m, modules[m])
            ws.append(linear_weight(scheme, m, t, shape, f))
            ws[-1] = (ws[-1], dequantize_linear(scheme, m, t, shape, f, torch.float32))
        layout.pack_expert(*(w for w, _ in ws), out=row[0])
        w13, w2 = layout.dequant_rows(row, [0])
        # the row stores 1/weight_global_scale as a multiplier: equal to compressed-tensors' division up to rounding
        torch.testing.assert_close(w13[0], torch.cat((ws[0][1], ws[1][1])), rtol=4e-7, atol=0)
        torch.testing.assert_close(w2[0], ws[2][1], rtol=4e-7, atol=0)


def test_nvfp4_modelopt_checkpoint(qwen3_moe_bf16, tmp_path):
    d = tmp_path / "modelopt"
    q = _write_quantized(qwen3_moe_bf16, d, release_scheme(QuantMethod.NVFP4_MODELOPT))
    scheme = detect_scheme(d)
    assert scheme.method is QuantMethod.NVFP4_MODELOPT and "hf_quant_config.json" in scheme.source
    m = "model.layers.0.mlp.experts.3.down_proj"
    assert q[f"{m}.weight"].dtype == torch.uint8 and q[f"{m}.weight"].shape == (H, I // 2)
    assert q[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn and q[f"{m}.weight_scale"].shape == (H, I // 16)
    assert q[f"{m}.weight_scale_2"].shape == () and q[f"{m}.input_scale"].shape == ()
    assert "model.layers.0.mlp.gate.weight_scale" not in q  # routers excluded
    assert q["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    f = str(d / "model.safetensors")
    with safe_open(f, "pt") as h:
        names = h.keys()
        metas = {n: TensorMeta.from_safetensors(h, n, f) for n in names}
    src = load_file(str(qwen3_moe_bf16 / "model.safetensors"))
    quantized = 0
    for mod, ps in _by_module(metas).items():
        if "weight_scale" in ps:  # every quantized linear validates from its header alone
            shape = tuple(src[f"{mod}.weight"].shape)
            assert validate_linear(scheme, mod, {p: metas[f"{mod}.{p}"] for p in ps}, shape, f) is WeightFormat.NVFP4
            quantized += 1
    assert quantized == LAYERS * (4 + 3 * E)  # attention q/k/v/o and every expert projection
    ct = pytest.importorskip("compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4")
    conv = ct.ModelOptNvfp4Converter(ignore=list(scheme.ignore), targets=["Linear"]).process(
        {k: v.clone() for k, v in q.items() if k.startswith(m + ".")})
    # compressed-tensors' own ModelOpt -> compressed-tensors converter accepts the tensors and maps the scales
    assert set(conv) == {f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_global_scale",
                         f"{m}.input_global_scale"}
    torch.testing.assert_close(conv[f"{m}.weight_global_scale"], 1 / q[f"{m}.weight_scale_2"])
