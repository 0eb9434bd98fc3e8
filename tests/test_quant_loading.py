"""Quantized checkpoints through the checkpoint index, the loader, FTW and ``make-model --quant``: experts land in
the host pool as the released bytes (packed), non-expert quantized linears are dequantized at load, and a tensor
that does not fit the declared scheme is one error naming the file and the tensor."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from quant_reference import quantized_checkpoint
from safetensors.torch import load_file, save_file

from edgemoe.cli import main
from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.models import load_config, model_class
from edgemoe.quant.scheme import QuantConfigError, detect_scheme
from edgemoe.quant.weights import WeightFormat, dequantize_linear
from edgemoe.weights.ftw import convert, read_manifest
from edgemoe.weights.index import CheckpointError
from edgemoe.weights.loader import load_checkpoint

from conftest import greedy_decode, reference_greedy

CFG = EngineConfig(device="cpu", dtype="float32", expert_policy="cpu-all")
PROMPT = [5, 17, 230, 41, 99, 7, 12]
QUANTS = ["fp8", "mxfp4", "nvfp4-modelopt", "nvfp4-ct"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-load")
    return {q: quantized_checkpoint(root / q, q) for q in QUANTS}


def _load(d, dtype=torch.float32):
    cfg = load_config(d)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    return model, load_checkpoint(model, d, cfg, dtype, torch.device("cpu"), progress=False), cfg


def _copy_edit(src, tmp_path, edit):
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("quant", QUANTS)
def test_rows_hold_the_released_bytes_and_non_experts_are_dequantized(ckpts, quant):
    d = ckpts[quant]
    model, pool, cfg = _load(d)
    sd = load_file(d / "model.safetensors")
    lay, E, I = pool.layout, cfg.num_experts, cfg.moe_intermediate_size
    assert pool.compute_dtype == torch.float32 and pool.row_bytes < 3 * 64 * 64 * 2  # smaller than a bf16 row
    j, e = 2, 5
    fid, pre = j * E + e, f"model.layers.{cfg.moe_layers[j]}.mlp.experts"
    w13, w2 = lay.view(pool.bank, "w13")[fid], lay.view(pool.bank, "w2")[fid]
    s13, s2 = lay.view(pool.bank, "w13_scale")[fid], lay.view(pool.bank, "w2_scale")[fid]
    if quant == "mxfp4":  # gpt-oss's fused tensors, gate/up rows interleaved in the checkpoint
        blocks, scales = sd[f"{pre}.gate_up_proj_blocks"][e], sd[f"{pre}.gate_up_proj_scales"][e]
        assert torch.equal(w13[:I], blocks[0::2].flatten(1)) and torch.equal(w13[I:], blocks[1::2].flatten(1))
        assert torch.equal(s13, torch.cat((scales[0::2], scales[1::2])))
        assert torch.equal(w2, sd[f"{pre}.down_proj_blocks"][e].flatten(1))
        assert torch.equal(s2, sd[f"{pre}.down_proj_scales"][e])
    else:
        packed = "weight_packed" if quant == "nvfp4-ct" else "weight"
        gate, up, down = (f"{pre}.{e}.{p}_proj" for p in ("gate", "up", "down"))
        released13 = torch.cat((sd[f"{gate}.{packed}"], sd[f"{up}.{packed}"]))  # gate rows, then up rows
        assert torch.equal(w13.view(torch.uint8), released13.view(torch.uint8))
        assert torch.equal(w2.view(torch.uint8), sd[f"{down}.{packed}"].view(torch.uint8))
        scale = "weight_scale_inv" if quant == "fp8" else "weight_scale"
        assert torch.equal(s2.float(), sd[f"{down}.{scale}"].float())  # FP8: bf16 scales held as float32
        if quant == "nvfp4-modelopt":
            assert float(lay.view(pool.bank, "w2_scale2")[fid, 0]) == float(sd[f"{down}.weight_scale_2"])
        if quant == "nvfp4-ct":
            assert float(lay.view(pool.bank, "w2_scale2")[fid, 0]) == float(1 / sd[f"{down}.weight_global_scale"])
    params = dict(model.named_parameters())
    scheme = detect_scheme(d)
    q = "model.layers.1.self_attn.q_proj"
    t = {k.rpartition(".")[2]: v for k, v in sd.items() if k.startswith(q + ".")}
    want = dequantize_linear(scheme, q, t, tuple(params[f"{q}.weight"].shape), "f", torch.float32)
    assert torch.equal(params[f"{q}.weight"], want)
    if quant != "mxfp4":  # the FP8 / NVFP4 releases quantize attention too
        assert set(t) != {"weight"}
    assert torch.equal(params["model.layers.0.mlp.gate.weight"], sd["model.layers.0.mlp.gate.weight"].float())


@pytest.mark.parametrize("quant", QUANTS)
def test_ftw_keeps_the_packed_rows(ckpts, quant, tmp_path):
    d = ckpts[quant]
    out = convert(d, tmp_path / "q.ftw", progress=False, dtype="float32")  # float tensors in the engine's dtype
    man = read_manifest(out)
    hf = ModelRunner(d, CFG, progress=False)
    ftw = ModelRunner(out, CFG, progress=False)
    assert man.layout == hf.pool.layout.to_json() and ftw.pool.layout == hf.pool.layout
    assert (out / "experts.bin").stat().st_size == hf.pool.nbytes
    assert torch.equal(ftw.pool.bank, hf.pool.bank) and ftw.load_stats.read.zero_copy
    ne = load_file(out / "non_expert.safetensors")
    assert all(v.dtype == torch.float32 for v in ne.values())  # quantized non-expert linears dequantized
    a, b = dict(hf.model.named_parameters()), dict(ftw.model.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert greedy_decode(ftw, PROMPT, 4, free=True)[1] == greedy_decode(hf, PROMPT, 4, free=True)[1]


FP8_EXPERT = "model.layers.0.mlp.experts.3.down_proj"


@pytest.mark.parametrize("quant,edit,match", [
    ("fp8", lambda sd: sd.__setitem__(f"{FP8_EXPERT}.weight_scale_inv", torch.ones(1, 2, dtype=torch.bfloat16)),
     rf"tensor {FP8_EXPERT}\.weight_scale_inv has shape \[1, 2\], expected \[1, 1\] \(FP8 block scales"),
    ("fp8", lambda sd: sd.__setitem__(f"{FP8_EXPERT}.weight", torch.zeros(64, 64, dtype=torch.bfloat16)),
     rf"tensor {FP8_EXPERT}\.weight has dtype bfloat16, expected float8_e4m3fn"),
    ("fp8", lambda sd: sd.pop(f"{FP8_EXPERT}.weight_scale_inv"),
     rf"module {FP8_EXPERT} lacks tensor {FP8_EXPERT}\.weight_scale_inv"),
    ("fp8", lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(3, 3)),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv has shape \[3, 3\], expected \[1, 1\]"),
    ("fp8", lambda sd: sd.update({"model.layers.0.mlp.gate.weight": sd["model.layers.0.mlp.gate.weight"].to(
        torch.float8_e4m3fn), "model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 1)}),
     r"module model\.layers\.0\.mlp\.gate carries quantized tensors .* excludes it from quantization"),
    ("fp8", lambda sd: sd.update({f"{FP8_EXPERT}.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}) or sd.pop(
        f"{FP8_EXPERT}.weight_scale_inv"), r"is a bf16 routed expert, but the experts before it are fp8_block"),
    ("nvfp4-modelopt", lambda sd: sd.pop(f"{FP8_EXPERT}.weight_scale_2"),
     rf"module {FP8_EXPERT} lacks tensor {FP8_EXPERT}\.weight_scale_2"),
    ("nvfp4-modelopt",
     lambda sd: sd.__setitem__(f"{FP8_EXPERT}.weight_scale", torch.zeros(64, 2).to(torch.float8_e4m3fn)),
     rf"tensor {FP8_EXPERT}\.weight_scale has shape \[64, 2\], expected \[64, 4\] \(NVFP4 block scales"),
    ("nvfp4-ct", lambda sd: sd.__setitem__(f"{FP8_EXPERT}.weight_packed", torch.zeros(64, 64, dtype=torch.uint8)),
     rf"tensor {FP8_EXPERT}\.weight_packed has shape \[64, 64\], expected \[64, 32\]"),
    ("mxfp4",
     lambda sd: sd.__setitem__("model.layers.2.mlp.experts.down_proj_scales",
                               torch.zeros(16, 64, 3, dtype=torch.uint8)),
     r"tensor model\.layers\.2\.mlp\.experts\.down_proj_scales has shape \[16, 64, 3\], expected \[16, 64, 2\]"),
    ("mxfp4", lambda sd: sd.__setitem__("model.layers.2.mlp.experts.down_proj_bias", torch.zeros(16, 64)),
     r"tensor model\.layers\.2\.mlp\.experts\.down_proj_bias: routed-expert biases, but Qwen3MoeForCausalLM's "
     "experts have none"),
], ids=["fp8-scale-shape", "fp8-weight-dtype", "fp8-missing-scale", "fp8-attention-scale", "fp8-excluded-router",
        "mixed-formats", "modelopt-missing-scale2", "modelopt-scale-shape", "ct-packed-shape", "mxfp4-scales-shape",
        "mxfp4-bias"])
def test_a_tensor_that_does_not_fit_the_scheme_names_file_and_tensor(ckpts, tmp_path, quant, edit, match):
    d = _copy_edit(ckpts[quant], tmp_path, edit)
    with pytest.raises(CheckpointError, match=match) as e:
        _load(d)
    msg = str(e.value)
    assert "\n" not in msg and str(d / "model.safetensors") in msg
    with pytest.raises(CheckpointError, match=match):
        convert(d, tmp_path / "bad.ftw", progress=False)
    assert not list(tmp_path.glob("bad.ftw*"))


def test_quantized_tensors_without_a_quantization_config(ckpts, tmp_path):
    d = _copy_edit(ckpts["fp8"], tmp_path, lambda sd: None)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"looks quantized .* declares no quantization_config"):
        _load(d)


def test_an_unsupported_quantization_method_names_the_field(ckpts, tmp_path):
    d = _copy_edit(ckpts["fp8"], tmp_path, lambda sd: None)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantConfigError, match=r"config\.json: quantization_config\.quant_method = 'gptq' is not "
                                               r"supported"):
        ModelRunner(d, CFG, progress=False)


@pytest.mark.parametrize("quant,fmt", [("fp8", WeightFormat.FP8_BLOCK), ("nvfp4-modelopt", WeightFormat.NVFP4),
                                       ("mxfp4", WeightFormat.MXFP4)])
def test_make_model_quant_and_dummy_weights_of_a_format(tmp_path, quant, fmt, capsys):
    out = tmp_path / "ckpt"
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--quant", quant]) == 0
    assert (out / "hf_quant_config.json").exists() == (quant == "nvfp4-modelopt")
    assert ModelRunner(out, CFG, progress=False).pool.format is fmt
    cfg_only = tmp_path / "config-only"
    assert main(["make-model", "--preset", "tiny", "--out", str(cfg_only), "--quant", quant, "--config-only"]) == 0
    assert not list(cfg_only.glob("*.safetensors"))
    r = ModelRunner(cfg_only, EngineConfig(device="cpu", load_format="dummy", expert_policy="cpu-all"), progress=False)
    assert r.pool.format is fmt
    w13, w2 = r.pool.layout.dequant_rows(r.pool.bank, range(r.pool.num_ids))
    assert torch.isfinite(w13).all() and torch.isfinite(w2).all() and w13.std() > 0
    assert (w13[0] != w13[1]).any()  # rows differ
    logits = greedy_decode(r, PROMPT, 1, free=True)[0]
    assert torch.isfinite(logits).all()
    with pytest.raises(SystemExit):
        main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "x"), "--quant", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_convert_dequantizes_non_expert_linears_into_the_checkpoint_dtype(ckpts, tmp_path):
    out = convert(ckpts["nvfp4-ct"], tmp_path / "ct.ftw", progress=False)  # no --dtype: config.json's bfloat16
    ne = load_file(out / "non_expert.safetensors")
    assert ne["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert not any(k.endswith(("weight_packed", "weight_scale", "weight_global_scale")) for k in ne)
    assert read_manifest(out).layout["format"] == "nvfp4"


def test_fp8_with_power_of_two_scales_loads(tmp_path):
    """FP8 releases with ``scale_fmt: ue8m0`` may store ``weight_scale_inv`` as float8_e8m0fnu (safetensors
    ``F8_E8M0``): read, held as float32 multipliers, and computed exactly as the float reference."""
    import transformers
    from quant_reference import float_copy

    from edgemoe.quant.quantize import quantization_config, quantize_state_dict, release_scheme
    from edgemoe.quant.scheme import QuantMethod
    from edgemoe.synth import make_model

    src = make_model(tmp_path / "bf16", "qwen3_moe", "tiny", seed=3, dtype="bfloat16")
    scheme = dataclasses.replace(release_scheme(QuantMethod.FP8_BLOCK), scale_fmt="ue8m0")
    sd = load_file(src / "model.safetensors")
    linears = [k.removesuffix(".weight") for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2
               and "embed_tokens" not in k]
    d = tmp_path / "ue8m0"
    shutil.copytree(src, d)
    q = quantize_state_dict(sd, scheme, linears, scale_dtype=torch.float8_e8m0fnu)
    save_file(q, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(scheme)
    (d / "config.json").write_text(json.dumps(cfg))
    assert q["model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    runner = ModelRunner(d, CFG, progress=False)
    assert runner.pool.format is WeightFormat.FP8_BLOCK
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(float_copy(d, tmp_path / "f32", torch.float32),
                                                           dtype=torch.float32).eval()
    ref_logits, ref_toks = reference_greedy(ref, PROMPT, 4)
    logits, toks = greedy_decode(runner, PROMPT, 4, free=True)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
