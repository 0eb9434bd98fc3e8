"""References for quantized checkpoints (shared by tests/test_quant_parity.py and tests/gpu/).

A tiny Qwen3-MoE checkpoint is written in each released quantized layout by ``edgemoe make-model --quant``;
its reference is ``transformers`` running the same checkpoint with its weights dequantized:

- FP8 block: ``transformers`` itself loads the checkpoint and dequantizes on the CPU (``accelerate`` needed).
- MXFP4 (gpt-oss's fused expert layout on a Qwen3-MoE model, which ``transformers`` cannot load: its MXFP4
  dequantizer writes gpt-oss's transposed parameters): a float copy whose experts ``transformers``' own
  MXFP4 dequantizer (``integrations.mxfp4.convert_moe_packed_tensors``) produced, gate/up de-interleaved.
- NVFP4 ModelOpt and compressed-tensors (no ``transformers`` CPU path): a float copy whose weights the
  format definitions' dequantizers (``edgemoe.quant.dequant``, written from the specs, independent of the
  engine's rows and kernels) produced.

A float copy holds each dequantized weight in float32 and casts it to the copy's dtype (float32 products,
then one rounding: what ``transformers`` does when it dequantizes).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from edgemoe.quant.dequant import dequant_fp8_block, dequant_nvfp4_ct, dequant_nvfp4_modelopt
from edgemoe.synth import make_model

QUANTS = ["fp8", "mxfp4", "nvfp4-modelopt", "nvfp4-ct"]


def quantized_checkpoint(out: Path, quant: str, seed: int = 7, preset: str = "tiny") -> Path:
    """``make-model --quant`` of the Qwen3-MoE ``preset`` (bf16 weights quantized)."""
    return make_model(out, "qwen3_moe", preset, seed=seed, dtype="bfloat16", quant=quant)


def _mxfp4_experts(module: str, t: dict[str, torch.Tensor], out: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gate_up = convert_moe_packed_tensors(t["gate_up_proj_blocks"], t["gate_up_proj_scales"], dtype=torch.float32)
    down = convert_moe_packed_tensors(t["down_proj_blocks"], t["down_proj_scales"], dtype=torch.float32)
    for e in range(gate_up.shape[0]):  # [E, H, 2I] (gpt-oss's parameter layout), gate = even columns
        out[f"{module}.{e}.gate_proj.weight"] = gate_up[e, :, 0::2].T.contiguous().to(dtype)
        out[f"{module}.{e}.up_proj.weight"] = gate_up[e, :, 1::2].T.contiguous().to(dtype)
        out[f"{module}.{e}.down_proj.weight"] = down[e].T.contiguous().to(dtype)  # [E, I, H] -> [H, I]


def float_copy(src: Path, dst: Path, dtype: torch.dtype, ct_expert_multiplier: bool = False) -> Path:
    """``src``'s checkpoint with every quantized weight dequantized (float32) and cast to ``dtype``, and every
    other tensor cast to ``dtype``; ``config.json`` without its ``quantization_config``.

    ``ct_expert_multiplier``: dequantize compressed-tensors NVFP4 *routed experts* with the reciprocal of
    ``weight_global_scale`` as a multiplier (the canonical form edgemoe's rows store,
    ``edgemoe.quant.weights.linear_weight``; a few float32 ulp from compressed-tensors' division) instead
    of by the division of the format's definition.
    """
    cfg = json.loads((src / "config.json").read_text())
    q = cfg.pop("quantization_config")
    block = tuple(q.get("weight_block_size") or (128, 128))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, t in tensors.items():
        module, _, param = name.rpartition(".")
        modules[module][param] = t
    out: dict[str, torch.Tensor] = {}
    for module, t in modules.items():
        if "gate_up_proj_blocks" in t:
            _mxfp4_experts(module, t, out, dtype)
        elif "weight_scale_inv" in t:
            out[f"{module}.weight"] = dequant_fp8_block(t["weight"], t["weight_scale_inv"], block).to(dtype)
        elif "weight_packed" in t:
            if ct_expert_multiplier and ".mlp.experts." in module:
                s2 = (1.0 / t["weight_global_scale"].float()).reshape(())
                w = dequant_nvfp4_modelopt(t["weight_packed"], t["weight_scale"], s2)
            else:
                w = dequant_nvfp4_ct(t["weight_packed"], t["weight_scale"], t["weight_global_scale"])
            out[f"{module}.weight"] = w.to(dtype)
        elif "weight_scale_2" in t:
            w = dequant_nvfp4_modelopt(t["weight"], t["weight_scale"], t["weight_scale_2"])
            out[f"{module}.weight"] = w.to(dtype)
        else:
            out.update({f"{module}.{p}": v.to(dtype) for p, v in t.items()})
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "hf_quant_config.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def reference_model(ckpt: Path, quant: str, work: Path) -> transformers.PreTrainedModel:
    """The float32 ``transformers`` reference of a quantized checkpoint (see the module docstring)."""
    if quant == "fp8":
        block = json.loads((ckpt / "config.json").read_text())["quantization_config"]["weight_block_size"]
        # dequantize=True: without it, transformers keeps FP8 weights when a CUDA device is present
        qc = transformers.FineGrainedFP8Config(weight_block_size=tuple(block), dequantize=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, quantization_config=qc)
        assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32  # dequantized on the CPU
        return model.eval()
    return transformers.Qwen3MoeForCausalLM.from_pretrained(float_copy(ckpt, work, torch.float32),
                                                            dtype=torch.float32).eval()


def native_weights_are_torch_weights(fmt: str) -> bool:
    """Whether the native CPU kernels multiply the same weights as the torch path when computing in bfloat16.
    Every native kernel multiplies the exact codes and scales each block's or group's partial sums by its
    float32 scale (the format's exact weights, unrounded); the torch path rounds each dequantized weight to
    bf16. The two are the same numbers for MXFP4 only (e2m1 values times powers of two are bf16 numbers);
    FP8 and NVFP4 agree within the bf16 tolerance. The float64 references of the native kernels take the
    unrounded weights (``round_weights=False``) for every format.

    Args:
        fmt: the format as the tests name it (``"nvfp4"``, ``"fp8"``, ``"mxfp4-bf16"``, ...: a prefix is enough).
    """
    return fmt.startswith("mxfp4")
