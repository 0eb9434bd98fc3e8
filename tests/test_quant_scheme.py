"""Quantization scheme detection from released configs (edgemoe.quant.scheme)."""

from __future__ import annotations

import json

import pytest

from edgemoe.quant.scheme import (
    PatternSyntax,
    QuantConfigError,
    QuantMethod,
    detect_scheme,
    scheme_from_config,
)

# quantization_config objects as the releases ship them
QWEN3_30B_A3B_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                     "weight_block_size": [128, 128]}
DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
QWEN3_6_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
               "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens",
                                          "model.language_model.layers.0.linear_attn.in_proj_a", "mtp.fc"]}
GPT_OSS = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                      "lm_head"], "quant_method": "mxfp4"}
MODELOPT_HF_QUANT = {"producer": {"name": "modelopt", "version": "0.29.0"},
                     "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                      "exclude_modules": ["lm_head", "model.layers.0.self_attn*", "*.mlp.gate"]}}
MODELOPT_CONFIG = {"config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float",
                                                                       "group_size": 16},
                                                 "weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                             "group_size": 16}, "targets": ["Linear"]}},
                   "ignore": ["lm_head", "model.layers.*.mlp.gate"], "quant_algo": "NVFP4",
                   "producer": {"name": "modelopt", "version": "0.37.0"}, "quant_method": "modelopt"}
_NVFP4_W = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
            "dynamic": False, "observer": "minmax"}
CT_NVFP4 = {"config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized", "weights": _NVFP4_W,
                                          "input_activations": dict(_NVFP4_W, dynamic="local")}},
            "format": "nvfp4-pack-quantized", "ignore": ["lm_head", "re:.*mlp.gate$"],
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def test_fp8_releases():
    for cfg in (QWEN3_30B_A3B_FP8, DEEPSEEK_V3):
        s = scheme_from_config(cfg)
        assert s.method is QuantMethod.FP8_BLOCK and s.block_size == (128, 128) and s.ignore == ()
        assert not s.excludes("model.layers.0.mlp.experts.3.gate_proj")
    s = scheme_from_config(QWEN3_6_FP8)
    assert s.excludes("lm_head") and s.excludes("model.language_model.layers.0.linear_attn.in_proj_a")
    assert not s.excludes("model.language_model.layers.0.linear_attn.in_proj_qkv")
    assert not s.excludes("model.language_model.layers.10.linear_attn.in_proj_a")  # anchored at a module boundary
    assert scheme_from_config({**DEEPSEEK_V3, "ignored_layers": ["lm_head"]}).ignore == ("lm_head",)  # MiniMax alias
    assert scheme_from_config({**DEEPSEEK_V3, "scale_fmt": "ue8m0"}).scale_fmt == "ue8m0"


def test_gpt_oss_mxfp4():
    s = scheme_from_config(GPT_OSS)
    assert s.method is QuantMethod.MXFP4 and s.group_size == 32
    assert s.excludes("model.layers.11.self_attn.q_proj") and s.excludes("model.layers.3.mlp.router")
    assert s.excludes("lm_head") and not s.excludes("model.layers.3.mlp.experts")


def test_patterns_match_like_transformers():
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = list(GPT_OSS["modules_to_not_convert"]) + ["mlp.gate", "layers.1"]
    s = scheme_from_config({**GPT_OSS, "modules_to_not_convert": patterns})
    for name in ("model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts",
                 "model.layers.11.mlp.experts", "model.layers.2.self_attn.o_proj", "lm_head", "model.embed_tokens",
                 "model.layers.1", "layers.1.x", "layers.11.x"):
        assert s.excludes(name) == (not should_convert_module(name, patterns)), name


def test_modelopt_both_spellings(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(MODELOPT_HF_QUANT))
    s = detect_scheme(tmp_path)
    assert s.method is QuantMethod.NVFP4_MODELOPT and s.group_size == 16 and s.pattern_syntax is PatternSyntax.FNMATCH
    assert s.excludes("model.layers.0.self_attn.q_proj") and s.excludes("model.layers.7.mlp.gate")
    assert not s.excludes("model.layers.1.self_attn.q_proj") and not s.excludes("model.layers.7.mlp.gate_proj")
    s = scheme_from_config(MODELOPT_CONFIG)
    assert s.method is QuantMethod.NVFP4_MODELOPT and s.excludes("model.layers.3.mlp.gate")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": MODELOPT_CONFIG}))
    s = detect_scheme(tmp_path)  # both files: exclusions merged
    assert s.excludes("model.layers.0.self_attn.k_proj") and s.excludes("model.layers.5.mlp.gate")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": DEEPSEEK_V3}))
    with pytest.raises(QuantConfigError, match="declares a ModelOpt quantization"):
        detect_scheme(tmp_path)
    bad = {**MODELOPT_CONFIG, "quant_algo": "FP8"}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": bad}))
    with pytest.raises(QuantConfigError, match="disagrees with"):
        detect_scheme(tmp_path)


def test_compressed_tensors_nvfp4():
    s = scheme_from_config(CT_NVFP4)
    assert s.method is QuantMethod.NVFP4_CT and s.group_size == 16
    assert s.excludes("lm_head") and s.excludes("model.layers.2.mlp.gate")
    assert not s.excludes("model.layers.2.mlp.gate_proj") and not s.excludes("model.lm_head")
    ct = pytest.importorskip("compressed_tensors.utils.match")
    for name in ("lm_head", "model.layers.2.mlp.gate", "model.layers.2.mlp.gate_proj", "model.lm_head"):
        assert s.excludes(name) == any(ct.match_name(name, p) for p in CT_NVFP4["ignore"])


def test_unquantized_and_text_config(tmp_path):
    assert scheme_from_config(None).method is QuantMethod.NONE
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"quantization_config": QWEN3_30B_A3B_FP8}}))
    assert detect_scheme(tmp_path).method is QuantMethod.FP8_BLOCK


@pytest.mark.parametrize("cfg, match", [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method = 'gptq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "per-tensor FP8 is not supported"),
    ({**DEEPSEEK_V3, "weight_block_size": [128]}, "expected two positive integers"),
    ({**DEEPSEEK_V3, "fmt": "e5m2"}, "only float8 e4m3"),
    ({**DEEPSEEK_V3, "expert_dtype": "fp4"}, "FP4-packed experts"),
    ({**DEEPSEEK_V3, "modules_to_not_convert": "lm_head"}, "must be a list of strings"),
    ({**MODELOPT_CONFIG, "quant_algo": "W4A8_AWQ"}, "'W4A8_AWQ' is not supported"),
    ({**MODELOPT_CONFIG, "group_size": 32}, "NVFP4 uses groups of 16"),
    ({**CT_NVFP4, "quantization_status": "frozen"}, "only compressed checkpoints"),
    ({**CT_NVFP4, "ignore": ["re:(unclosed"]}, "is not a valid regular expression"),
    ({**CT_NVFP4, "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                                "weights": {"num_bits": 8, "type": "float"}}}}, "is not supported"),
])
def test_unsupported_configs_name_the_field(cfg, match):
    with pytest.raises(QuantConfigError, match=match) as e:
        scheme_from_config(cfg, source="/ckpt/config.json")
    assert str(e.value).startswith("/ckpt/config.json: ")


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(QuantConfigError, match=r"config\.json: cannot read JSON"):
        detect_scheme(tmp_path)
