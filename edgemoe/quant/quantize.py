"""Quantizers that turn float weights into the tensors the quantized releases ship (for test checkpoints).

Round-to-nearest, no calibration: these exist so ``edgemoe make-model`` can write tiny checkpoints whose
tensor names, dtypes, shapes, scale encodings and ``quantization_config`` are those of the real releases,
and which ``transformers`` (FP8 block, MXFP4) loads. The rules:

- FP8 block (DeepSeek-V3 / Qwen3 FP8): per ``bn x bk`` block ``scale_inv = amax / 448`` (1 for an all-zero
  block), stored in ``scale_dtype`` (float32 as DeepSeek-V3, bfloat16 as the Qwen3 releases); the weight is
  ``clamp(w / scale_inv_stored, ±448)`` rounded to float8_e4m3fn.
- MXFP4 (gpt-oss): per 32 elements the scale is ``2^ceil(log2(amax / 6))`` (rounded *up* to a power of two,
  as gpt-oss's ``triton_kernels`` ``downcast_to_mxfp`` does, so no element saturates), E8M0 byte
  ``exponent + 127`` clamped to ``[0, 254]``; elements rounded to E2M1, ties to the even code.
- NVFP4: ``amax`` of the tensor gives the per-tensor scale (ModelOpt multiplier ``amax / (6 * 448)``;
  compressed-tensors' ``weight_global_scale = 6 * 448 / amax``); per 16 elements the FP8 E4M3 block scale is
  ``block_amax / 6`` divided by the per-tensor multiplier (times the global scale in compressed-tensors);
  elements ``w / (block_scale * multiplier)`` (``/ (block_scale / global)``) rounded to E2M1. The activation
  scales of these W4A4 releases (``input_scale``, ``input_global_scale``) are written as 1.0: there is no
  calibration, and edgemoe does not use them.

Tensor names: :func:`quantize_linear` writes ``{module}.weight`` + ``{module}.weight_scale_inv`` (FP8),
``{module}.weight`` / ``weight_scale`` / ``weight_scale_2`` / ``input_scale`` (ModelOpt) or
``{module}.weight_packed`` / ``weight_scale`` / ``weight_global_scale`` / ``input_global_scale``
(compressed-tensors) for a module such as ``model.layers.3.mlp.experts.7.gate_proj`` (Qwen3-MoE's per-expert
release layout); :func:`quantize_gpt_oss_experts` writes ``{module}.gate_up_proj_{blocks,scales,bias}`` and
``{module}.down_proj_{blocks,scales,bias}`` for ``module = model.layers.3.mlp.experts``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch

from edgemoe.quant.dequant import E2M1_VALUES, FP4_MAX, FP8_E4M3_MAX
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.scheme import (
    FP8_DEFAULT_BLOCK,
    MXFP4_GROUP,
    NVFP4_GROUP,
    PatternSyntax,
    QuantMethod,
    QuantScheme,
)
from edgemoe.quant.weights import QuantizedWeight, WeightFormat, mxfp4_expert_weight

__all__ = [
    "hf_quant_config",
    "pack_float_expert",
    "pack_fp4",
    "quantization_config",
    "quantize_fp8_block",
    "quantize_gpt_oss_experts",
    "quantize_linear",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_state_dict",
    "quantize_weight",
    "release_scheme",
    "round_to_e2m1",
]

_E2M1_GRID = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float ``[...]`` -> uint8 E2M1 codes ``[...]``: nearest value, ties to the even code, saturating at ±6."""
    x = x.float()
    grid = _E2M1_GRID.to(x.device)
    a = x.abs().clamp(max=FP4_MAX)
    lo = (torch.searchsorted(grid, a.contiguous(), right=True) - 1).clamp(0, 7)  # largest grid value <= a
    hi = (lo + 1).clamp(max=7)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0) & (hi != lo))
    code = torch.where(take_hi, hi, lo)
    return (code | (torch.signbit(x).long() << 3)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., 2n]`` -> packed uint8 ``[..., n]`` (element ``2j`` in the low nibble of byte ``j``)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_fp8_block(w: torch.Tensor, block_size: tuple[int, int] = FP8_DEFAULT_BLOCK,
                       scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[O, I]`` -> (float8_e4m3fn ``[O, I]``, ``weight_scale_inv`` ``[ceil(O/bn), ceil(I/bk)]``)."""
    o, i = w.shape
    bn, bk = block_size
    so, si = math.ceil(o / bn), math.ceil(i / bk)
    padded = torch.zeros(so * bn, si * bk, dtype=torch.float32, device=w.device)
    padded[:o, :i] = w.float()
    amax = padded.view(so, bn, si, bk).abs().amax(dim=(1, 3))  # [So, Si]
    inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    s = inv.float().repeat_interleave(bn, 0)[:o].repeat_interleave(bk, 1)[:, :i]  # [O, I]
    q = (w.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, inv


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[..., R, C]`` (``C % 32 == 0``) -> gpt-oss ``(blocks, scales)``.

    Returns:
        blocks uint8 ``[..., R, C/32, 16]`` and E8M0 scales uint8 ``[..., R, C/32]``.
    """
    if w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of 32, got {tuple(w.shape)}")
    g = w.float().unflatten(-1, (-1, MXFP4_GROUP))  # [..., R, G, 32]
    amax = g.abs().amax(dim=-1)  # [..., R, G]
    mant, exp = torch.frexp(amax / FP4_MAX)  # amax/6 = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # ceil(log2(amax / 6))
    e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    scale = torch.ldexp(torch.ones_like(amax), e)  # [..., R, G]
    codes = round_to_e2m1(g / scale[..., None])  # [..., R, G, 32]
    return pack_fp4(codes).contiguous(), (e + 127).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor, convention: QuantMethod = QuantMethod.NVFP4_MODELOPT
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float ``[O, I]`` (``I % 16 == 0``) -> NVFP4 ``(packed, block_scale, per_tensor)``.

    ``packed`` is uint8 ``[O, I/2]``, ``block_scale`` float8_e4m3fn ``[O, I/16]``. The per-tensor value is
    float32 ``[]``: ModelOpt's multiplier ``weight_scale_2`` for ``NVFP4_MODELOPT``, compressed-tensors'
    ``weight_global_scale`` (its reciprocal convention) for ``NVFP4_CT``.
    """
    if w.shape[-1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs in_features to be a multiple of 16, got {tuple(w.shape)}")
    wf = w.float()
    g = wf.unflatten(-1, (-1, NVFP4_GROUP))  # [O, I/16, 16]
    amax = wf.abs().max()
    blk = g.abs().amax(dim=-1)  # [O, I/16]
    top = FP4_MAX * FP8_E4M3_MAX
    if convention is QuantMethod.NVFP4_MODELOPT:
        s2 = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        scale = (blk / FP4_MAX / s2).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        eff = scale.float() * s2
        per_tensor = s2
    elif convention is QuantMethod.NVFP4_CT:
        gs = torch.where(amax > 0, top / amax, torch.ones_like(amax))
        scale = (gs * (blk / FP4_MAX)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        eff = scale.float() / gs
        per_tensor = gs
    else:
        raise ValueError(f"not an NVFP4 convention: {convention}")
    ratio = torch.where(eff[..., None] > 0, g / eff[..., None], torch.zeros_like(g))  # [O, I/16, 16]
    return pack_fp4(round_to_e2m1(ratio.flatten(-2))).contiguous(), scale, per_tensor.reshape(()).float()


def quantize_linear(scheme: QuantScheme, module: str, weight: torch.Tensor,
                    scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The released tensors of one quantized linear ``module`` (names as in the module docstring).

    Args:
        scheme: FP8 block, NVFP4 ModelOpt or NVFP4 compressed-tensors.
        weight: float ``[O, I]``.
        scale_dtype: FP8 ``weight_scale_inv`` dtype (float32: DeepSeek-V3; bfloat16: Qwen3 FP8 releases).

    Raises:
        ValueError: MXFP4 (only gpt-oss's fused experts are MXFP4: :func:`quantize_gpt_oss_experts`) or an
            unquantized scheme.
    """
    m = scheme.method
    if m is QuantMethod.FP8_BLOCK:
        q, inv = quantize_fp8_block(weight, scheme.block_size or FP8_DEFAULT_BLOCK, scale_dtype)
        return {f"{module}.weight": q, f"{module}.weight_scale_inv": inv}
    one = torch.ones((), dtype=torch.float32)
    if m is QuantMethod.NVFP4_MODELOPT:
        packed, scale, s2 = quantize_nvfp4(weight, m)
        return {f"{module}.weight": packed, f"{module}.weight_scale": scale, f"{module}.weight_scale_2": s2,
                f"{module}.input_scale": one}
    if m is QuantMethod.NVFP4_CT:
        packed, scale, gs = quantize_nvfp4(weight, m)
        return {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale,
                f"{module}.weight_global_scale": gs.reshape(1), f"{module}.input_global_scale": one.reshape(1)}
    raise ValueError(f"quantize_linear: no per-linear release layout for {m.value}")


def quantize_gpt_oss_experts(module: str, gate_up: torch.Tensor, down: torch.Tensor,
                             gate_up_bias: torch.Tensor | None = None,
                             down_bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """gpt-oss's released MXFP4 expert tensors for ``module`` (e.g. ``model.layers.3.mlp.experts``).

    Args:
        gate_up: float ``[E, 2I, H]`` in the release's ``[out, in]`` orientation, rows interleaved (gate row
            ``j`` at ``2j``, up row ``j`` at ``2j+1``). ``transformers``' ``GptOssExperts.gate_up_proj`` is
            the transpose ``[E, H, 2I]``.
        down: float ``[E, H, I]`` (``GptOssExperts.down_proj`` transposed).
        gate_up_bias, down_bias: ``[E, 2I]``, ``[E, H]``, written as given (the release ships bfloat16).

    Returns:
        ``{module}.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``, ``_scales`` uint8 ``[E, 2I, H/32]``,
        ``{module}.down_proj_blocks`` ``[E, H, I/32, 16]``, ``_scales`` ``[E, H, I/32]`` and the biases.
    """
    out: dict[str, torch.Tensor] = {}
    for proj, w, b in (("gate_up_proj", gate_up, gate_up_bias), ("down_proj", down, down_bias)):
        blocks, scales = quantize_mxfp4(w)
        out[f"{module}.{proj}_blocks"] = blocks
        out[f"{module}.{proj}_scales"] = scales
        if b is not None:
            out[f"{module}.{proj}_bias"] = b
    return out


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], scheme: QuantScheme, linears: Collection[str],
                        scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A float checkpoint's tensors rewritten in the release layout of ``scheme``.

    FP8 / NVFP4: each module in ``linears`` (names without ``.weight``) that the scheme does not exclude has
    its ``.weight`` replaced by :func:`quantize_linear`'s tensors. MXFP4: each fused expert module
    ``*.mlp.experts`` not excluded becomes :func:`quantize_gpt_oss_experts`' tensors, from gpt-oss's float
    layout as ``transformers`` saves it (``gate_up_proj [E, H, 2I]`` with gate/up interleaved along ``2I``,
    ``down_proj [E, I, H]``, ``_bias``) or from per-expert ``*.mlp.experts.{e}.{gate,up,down}_proj.weight``
    (the Qwen3-MoE layout; gate and up interleaved into gpt-oss's ``gate_up_proj`` rows); ``linears`` is
    unused. Every other tensor is kept as is.

    Raises:
        KeyError: a module of ``linears`` has no ``.weight`` in ``state_dict``, or an expert projection is
            missing.
    """
    out = dict(state_dict)
    if scheme.method is QuantMethod.MXFP4:
        per_expert: dict[str, set[int]] = {}
        for name in list(state_dict):
            module, _, param = name.rpartition(".")
            m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.gate_proj\.weight", name)
            if m and not scheme.excludes(m.group(1)):
                per_expert.setdefault(m.group(1), set()).add(int(m.group(2)))
            if param != "gate_up_proj" or not module.endswith("mlp.experts") or scheme.excludes(module):
                continue
            gate_up = out.pop(f"{module}.gate_up_proj").transpose(1, 2)  # [E, 2I, H]
            down = out.pop(f"{module}.down_proj").transpose(1, 2)  # [E, H, I]
            gb, db = out.pop(f"{module}.gate_up_proj_bias", None), out.pop(f"{module}.down_proj_bias", None)
            out.update(quantize_gpt_oss_experts(module, gate_up, down, gb, db))
        for module, experts in per_expert.items():
            rows = [(out.pop(f"{module}.{e}.gate_proj.weight"), out.pop(f"{module}.{e}.up_proj.weight"))
                    for e in sorted(experts)]
            gate_up = torch.stack([torch.stack((g, u), dim=1).flatten(0, 1) for g, u in rows])  # [E, 2I, H] interleaved
            down = torch.stack([out.pop(f"{module}.{e}.down_proj.weight") for e in sorted(experts)])  # [E, H, I]
            out.update(quantize_gpt_oss_experts(module, gate_up, down))
        return out
    for module in linears:
        if scheme.excludes(module):
            continue
        w = out.pop(f"{module}.weight")
        out.update(quantize_linear(scheme, module, w, scale_dtype))
    return out


def release_scheme(method: QuantMethod) -> QuantScheme:
    """The scheme the public releases of ``method`` declare (exclusions as they list them).

    FP8: Qwen3 FP8 releases (router ``mlp.gate``, ``lm_head`` and embeddings stay bf16); MXFP4: gpt-oss's
    ``modules_to_not_convert``; NVFP4 ModelOpt: ``lm_head`` and routers excluded; NVFP4 compressed-tensors:
    llm-compressor's ``ignore: ["lm_head", "re:.*mlp.gate$"]``.
    """
    if method is QuantMethod.FP8_BLOCK:
        return QuantScheme(method, block_size=FP8_DEFAULT_BLOCK, ignore=("lm_head", "model.embed_tokens", "mlp.gate"),
                           pattern_syntax=PatternSyntax.TRANSFORMERS, source="release")
    if method is QuantMethod.MXFP4:
        return QuantScheme(method, group_size=MXFP4_GROUP,
                           ignore=("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"), pattern_syntax=PatternSyntax.TRANSFORMERS, source="release")
    if method is QuantMethod.NVFP4_MODELOPT:
        return QuantScheme(method, group_size=NVFP4_GROUP, ignore=("lm_head", "model.layers.*.mlp.gate"),
                           pattern_syntax=PatternSyntax.FNMATCH, source="release")
    if method is QuantMethod.NVFP4_CT:
        return QuantScheme(method, group_size=NVFP4_GROUP, ignore=("lm_head", "re:.*mlp.gate$"),
                           pattern_syntax=PatternSyntax.COMPRESSED_TENSORS, source="release")
    raise ValueError(f"no release convention for {method.value}")


def _nvfp4_args(dynamic: bool | str) -> dict[str, Any]:
    return {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP,
            "symmetric": True, "dynamic": dynamic, "actorder": None, "block_structure": None,
            "observer": "minmax" if dynamic is False else None, "observer_kwargs": {}}


def quantization_config(scheme: QuantScheme) -> dict[str, Any]:
    """The ``config.json`` ``quantization_config`` object declaring ``scheme`` as the releases spell it."""
    ignore = list(scheme.ignore)
    m = scheme.method
    if m is QuantMethod.FP8_BLOCK:
        cfg: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                               "weight_block_size": list(scheme.block_size or FP8_DEFAULT_BLOCK)}
        if scheme.scale_fmt == "ue8m0":
            cfg["scale_fmt"] = "ue8m0"
        if ignore:
            cfg["modules_to_not_convert"] = ignore
        return cfg
    if m is QuantMethod.MXFP4:
        return {"modules_to_not_convert": ignore, "quant_method": "mxfp4"}
    if m is QuantMethod.NVFP4_MODELOPT:
        return {"config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float",
                                                                    "group_size": NVFP4_GROUP},
                                              "weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                          "group_size": NVFP4_GROUP},
                                              "targets": ["Linear"]}},
                "ignore": ignore, "quant_algo": "NVFP4", "producer": {"name": "modelopt", "version": "unknown"},
                "quant_method": "modelopt"}
    if m is QuantMethod.NVFP4_CT:
        return {"config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                              "weights": _nvfp4_args(False), "input_activations": _nvfp4_args("local"),
                                              "output_activations": None}},
                "format": "nvfp4-pack-quantized", "global_compression_ratio": None, "ignore": ignore,
                "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
                "sparsity_config": {}, "transform_config": {}}
    raise ValueError(f"no quantization_config for {m.value}")


def hf_quant_config(scheme: QuantScheme) -> dict[str, Any]:
    """ModelOpt's ``hf_quant_config.json`` for an NVFP4 ModelOpt ``scheme`` (written beside ``config.json``).

    Raises:
        ValueError: ``scheme`` is not NVFP4 ModelOpt.
    """
    if scheme.method is not QuantMethod.NVFP4_MODELOPT:
        raise ValueError(f"hf_quant_config.json is ModelOpt's; scheme is {scheme.method.value}")
    return {"producer": {"name": "modelopt", "version": "unknown"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": NVFP4_GROUP,
                             "exclude_modules": list(scheme.ignore)}}


def quantize_weight(fmt: WeightFormat, w: torch.Tensor,
                    block_size: tuple[int, int] = FP8_DEFAULT_BLOCK) -> QuantizedWeight:
    """Float ``[O, I]`` -> a :class:`~edgemoe.quant.weights.QuantizedWeight` of ``fmt`` in edgemoe's canonical form.

    Dense formats are a cast; FP8 :func:`quantize_fp8_block` (float32 scales); MXFP4 :func:`quantize_mxfp4`;
    NVFP4 :func:`quantize_nvfp4` with ModelOpt's multiplier convention.
    """
    shape = (int(w.shape[0]), int(w.shape[1]))
    if fmt.dense:
        return QuantizedWeight(fmt, shape, w.to(fmt.dtype))
    if fmt is WeightFormat.FP8_BLOCK:
        q, inv = quantize_fp8_block(w, block_size)
        return QuantizedWeight(fmt, shape, q, inv.float(), block_size=tuple(block_size))
    if fmt is WeightFormat.MXFP4:
        blocks, scales = quantize_mxfp4(w)
        return mxfp4_expert_weight(blocks, scales)
    packed, scale, s2 = quantize_nvfp4(w, QuantMethod.NVFP4_MODELOPT)
    return QuantizedWeight(fmt, shape, packed, scale, s2)


def pack_float_expert(layout: ExpertLayout, w13: torch.Tensor, w2: torch.Tensor,
                      out: torch.Tensor | None = None, b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize one float expert into ``layout``'s format and pack its row (round-to-nearest, as
    :func:`quantize_weight`).

    Args:
        w13: float ``[2I, H]`` (gate rows, then up rows). w2: float ``[H, I]``.
        out: uint8 ``[row_bytes]`` to write into, or ``None`` for a new row.
        b13: ``[2I]`` gate's bias then up's, b2: ``[H]`` (a layout with biases needs them; stored float32).

    Returns:
        uint8 ``[row_bytes]``.

    Raises:
        LayoutError: shapes that do not fit the layout, or biases missing / unexpected.
    """
    i = layout.intermediate
    block = layout.block_size or FP8_DEFAULT_BLOCK
    gate, up, down = (quantize_weight(layout.format, w, block) for w in (w13[:i], w13[i:], w2))
    return layout.pack_expert(gate, up, down, b13=b13, b2=b2, out=out)
