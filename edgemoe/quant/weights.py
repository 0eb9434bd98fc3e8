"""One linear's weights as released, validated and normalized to edgemoe's canonical quantized form.

Released tensors of one linear module ``M`` (``O`` = out features, ``I`` = in features):

============================  ==========================  ==================  ============================
scheme                        tensor                      dtype               shape
============================  ==========================  ==================  ============================
unquantized                   ``M.weight``                bf16 / f16 / f32    ``[O, I]``
FP8 block ``(bn, bk)``        ``M.weight``                float8_e4m3fn       ``[O, I]``
                              ``M.weight_scale_inv``      f32 (DeepSeek-V3),  ``[ceil(O/bn), ceil(I/bk)]``
                                                          bf16 (Qwen3 FP8);
                                                          f16, e8m0 accepted
                              ``M.input_scale``           f32, optional       ``[]`` or ``[1]``
NVFP4 ModelOpt                ``M.weight``                uint8               ``[O, I/2]``
                              ``M.weight_scale``          float8_e4m3fn       ``[O, I/16]``
                              ``M.weight_scale_2``        f32                 ``[]`` or ``[1]``
                              ``M.input_scale``           f32, optional       ``[]`` or ``[1]``
NVFP4 compressed-tensors      ``M.weight_packed``         uint8               ``[O, I/2]``
                              ``M.weight_scale``          float8_e4m3fn       ``[O, I/16]``
                              ``M.weight_global_scale``   f32                 ``[1]`` (``[]`` accepted)
                              ``M.input_global_scale``    f32, optional       ``[1]`` (``[]`` accepted)
MXFP4 (gpt-oss fused experts  ``P_blocks``                uint8               ``[E, O, I/32, 16]``
``P = ...mlp.experts.         ``P_scales``                uint8 (E8M0)        ``[E, O, I/32]``
{gate_up,down}_proj``)        ``P_bias``                  bf16 (f32 ok)       ``[E, O]``
============================  ==========================  ==================  ============================

Any module may also carry ``M.bias`` (floating, ``[O]``). The activation scales (``input_scale``,
``input_global_scale``) serve W4A4/W8A8 kernels; edgemoe computes with bf16/fp32 activations (as
``transformers`` does when it dequantizes), so they are validated and not used.

Whether a module is quantized is decided by its tensors (a float ``weight`` and nothing but ``bias`` means
unquantized, as ``transformers``' loaders do); a module the config excludes must not carry quantized tensors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from edgemoe.quant.dequant import (
    dequant_fp8_block,
    dequant_mxfp4_packed,
    dequant_nvfp4_ct,
    dequant_nvfp4_modelopt,
)
from edgemoe.quant.scheme import QuantMethod, QuantScheme

__all__ = [
    "SAFETENSORS_DTYPES",
    "QuantTensorError",
    "QuantizedWeight",
    "TensorMeta",
    "WeightFormat",
    "check_scale_values",
    "dequantize_linear",
    "gpt_oss_gate_up",
    "linear_weight",
    "mxfp4_expert_weight",
    "validate_linear",
    "validate_mxfp4_experts",
]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}

_DENSE = (torch.bfloat16, torch.float16, torch.float32)
_FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


class QuantTensorError(ValueError):
    """A released tensor that does not fit the declared scheme; the message names the file and the tensor."""


class WeightFormat(enum.Enum):
    """Storage format of a weight in edgemoe (the checkpoint's scheme, normalized)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_BLOCK = "fp8_block"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"

    @property
    def dense(self) -> bool:
        return self in (WeightFormat.BF16, WeightFormat.FP16, WeightFormat.FP32)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weight data: the float dtype for dense formats, fp8 / uint8 (packed) otherwise."""
        return {WeightFormat.BF16: torch.bfloat16, WeightFormat.FP16: torch.float16,
                WeightFormat.FP32: torch.float32, WeightFormat.FP8_BLOCK: torch.float8_e4m3fn,
                WeightFormat.MXFP4: torch.uint8, WeightFormat.NVFP4: torch.uint8}[self]

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> WeightFormat:
        """The dense format of a float dtype (bf16 / f16 / f32)."""
        try:
            return {torch.bfloat16: cls.BF16, torch.float16: cls.FP16, torch.float32: cls.FP32}[dtype]
        except KeyError:
            raise ValueError(f"no dense weight format for dtype {dtype}") from None

    @classmethod
    def for_scheme(cls, scheme: QuantScheme, dense_dtype: torch.dtype = torch.bfloat16) -> WeightFormat:
        """The format quantized modules of ``scheme`` take (``dense_dtype``'s for an unquantized checkpoint)."""
        fmt = {QuantMethod.FP8_BLOCK: cls.FP8_BLOCK, QuantMethod.MXFP4: cls.MXFP4,
               QuantMethod.NVFP4_MODELOPT: cls.NVFP4, QuantMethod.NVFP4_CT: cls.NVFP4}.get(scheme.method)
        return fmt if fmt is not None else cls.for_dtype(dense_dtype)


@dataclass(frozen=True)
class TensorMeta:
    """Dtype and shape of a tensor, read without its data (e.g. from a safetensors header)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor | TensorMeta) -> TensorMeta:
        """Metadata of a tensor (or a :class:`TensorMeta`, returned as is)."""
        return t if isinstance(t, TensorMeta) else cls(t.dtype, tuple(t.shape))

    @classmethod
    def from_safetensors(cls, handle, name: str, file: str) -> TensorMeta:
        """From an open ``safetensors.safe_open`` handle of ``file``, reading only the header.

        Raises:
            QuantTensorError: a dtype torch cannot represent (named with ``file`` and the tensor).
        """
        sl = handle.get_slice(name)
        code = sl.get_dtype()
        if code not in SAFETENSORS_DTYPES:
            raise QuantTensorError(f"{file}: tensor {name} has safetensors dtype {code}, which edgemoe does not read")
        return cls(SAFETENSORS_DTYPES[code], tuple(sl.get_shape()))


@dataclass(frozen=True)
class QuantizedWeight:
    """One ``[O, I]`` weight in edgemoe's canonical form (what an expert row stores per role).

    Attributes:
        format: the storage format.
        shape: logical ``(O, I)``.
        data: dense: ``[O, I]`` in the format's dtype; FP8: float8_e4m3fn ``[O, I]``; MXFP4 / NVFP4: uint8
            ``[O, I/2]`` packed E2M1 codes, low nibble first.
        scale: FP8: float32 ``[ceil(O/bn), ceil(I/bk)]`` multipliers; MXFP4: uint8 E8M0 ``[O, I/32]``;
            NVFP4: float8_e4m3fn ``[O, I/16]``; ``None`` for dense.
        scale2: NVFP4 only: float32 ``[]`` per-tensor **multiplier** (ModelOpt's ``weight_scale_2``;
            ``1 / weight_global_scale`` of a compressed-tensors checkpoint).
        block_size: FP8 only, ``(bn, bk)``.
    """

    format: WeightFormat
    shape: tuple[int, int]
    data: torch.Tensor
    scale: torch.Tensor | None = None
    scale2: torch.Tensor | None = None
    block_size: tuple[int, int] | None = None

    def dequant(self) -> torch.Tensor:
        """float32 ``[O, I]``: dense data cast; FP8 ``data * scale`` per block; MXFP4 ``E2M1 * 2^(e-127)``;
        NVFP4 ``E2M1 * (float(scale) * scale2)`` (:mod:`edgemoe.quant.dequant`)."""
        f = self.format
        if f.dense:
            return self.data.float()
        if f is WeightFormat.FP8_BLOCK:
            assert self.scale is not None and self.block_size is not None
            return dequant_fp8_block(self.data, self.scale, self.block_size)
        if f is WeightFormat.MXFP4:
            assert self.scale is not None
            return dequant_mxfp4_packed(self.data, self.scale)
        assert self.scale is not None and self.scale2 is not None
        return dequant_nvfp4_modelopt(self.data, self.scale, self.scale2)


def _shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _check(file: str, name: str, meta: TensorMeta, dtypes: tuple[torch.dtype, ...],
           shapes: tuple[tuple[int, ...], ...], what: str) -> None:
    if meta.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise QuantTensorError(f"{file}: tensor {name} has dtype {str(meta.dtype).removeprefix('torch.')}, "
                               f"expected {want} ({what})")
    if meta.shape not in shapes:
        want = " or ".join(_shape_str(s) for s in shapes)
        raise QuantTensorError(f"{file}: tensor {name} has shape {_shape_str(meta.shape)}, expected {want} ({what})")


def _expected_params(scheme: QuantScheme, out_f: int, in_f: int, module: str,
                     file: str) -> dict[str, tuple]:
    """{param: (dtypes, shapes, what)} of a quantized linear; a trailing ``?`` marks an optional param."""
    m = scheme.method
    scalar = ((), (1,))
    if m is QuantMethod.FP8_BLOCK:
        assert scheme.block_size is not None
        bn, bk = scheme.block_size
        grid = (math.ceil(out_f / bn), math.ceil(in_f / bk))
        return {"weight": ((torch.float8_e4m3fn,), ((out_f, in_f),), f"FP8 e4m3 [out, in] = [{out_f}, {in_f}]"),
                "weight_scale_inv": (_FP8_SCALE_DTYPES, (grid,),
                                     f"FP8 block scales [ceil(out/{bn}), ceil(in/{bk})]"),
                "input_scale?": ((torch.float32,), scalar, "per-tensor activation scale")}
    if m in (QuantMethod.NVFP4_MODELOPT, QuantMethod.NVFP4_CT):
        if in_f % 16:
            raise QuantTensorError(f"{file}: module {module}: in_features {in_f} is not a multiple of 16 (NVFP4)")
        packed = "weight" if m is QuantMethod.NVFP4_MODELOPT else "weight_packed"
        glob = "weight_scale_2" if m is QuantMethod.NVFP4_MODELOPT else "weight_global_scale"
        act = "input_scale" if m is QuantMethod.NVFP4_MODELOPT else "input_global_scale"
        return {packed: ((torch.uint8,), ((out_f, in_f // 2),), "NVFP4 packed E2M1 [out, in/2]"),
                "weight_scale": ((torch.float8_e4m3fn,), ((out_f, in_f // 16),), "NVFP4 block scales [out, in/16]"),
                glob: ((torch.float32,), scalar, "NVFP4 per-tensor scale"),
                act + "?": ((torch.float32,), scalar, "NVFP4 per-tensor activation scale")}
    raise QuantTensorError(f"{file}: module {module}: quantized linear tensors are not part of the "
                           f"{scheme.method.value} scheme ({scheme.source})")


def validate_linear(scheme: QuantScheme, module: str, tensors: Mapping[str, torch.Tensor | TensorMeta],
                    shape: tuple[int, int], file: str) -> WeightFormat:
    """Check the released tensors of one linear module against the declared scheme.

    Args:
        scheme: the checkpoint's scheme (:func:`edgemoe.quant.scheme.detect_scheme`).
        module: the module name, e.g. ``model.layers.3.mlp.experts.7.gate_proj``.
        tensors: the module's tensors by parameter name (``"weight"``, ``"weight_scale_inv"``, ``"bias"``,
            ...), as tensors or :class:`TensorMeta` (so a loader can validate from headers alone).
        shape: ``(out_features, in_features)`` the model expects.
        file: the file the tensors come from, for messages.

    Returns:
        The module's format: the dense format of its dtype when unquantized, else the scheme's format.

    Raises:
        QuantTensorError: a missing or unexpected tensor, a wrong dtype or shape (scale shapes included:
            FP8 ``[ceil(out/bn), ceil(in/bk)]``, NVFP4 ``[out, in/16]``), or quantized tensors on a module the
            config excludes; the message names ``file`` and the tensor.
    """
    out_f, in_f = shape
    metas = {k: TensorMeta.of(v) for k, v in tensors.items()}
    if "bias" in metas:
        _check(file, f"{module}.bias", metas["bias"], _DENSE, ((out_f,),), "bias [out]")
    params = set(metas) - {"bias"}
    w = metas.get("weight")
    if params == {"weight"} and w is not None and w.dtype in _DENSE:
        _check(file, f"{module}.weight", w, _DENSE, ((out_f, in_f),), "unquantized [out, in]")
        return WeightFormat.for_dtype(w.dtype)
    if not params:
        raise QuantTensorError(f"{file}: module {module} has no weight tensor")
    if not scheme.quantized:
        extra = sorted(params - {"weight"}) or ["weight"]
        raise QuantTensorError(f"{file}: tensor {module}.{extra[0]} looks quantized "
                               f"({str(metas[extra[0]].dtype).removeprefix('torch.')}), but the checkpoint declares "
                               "no quantization_config")
    pat = scheme.excluded_by(module)
    if pat is not None:
        raise QuantTensorError(f"{file}: module {module} carries quantized tensors ({', '.join(sorted(params))}) but "
                               f"{scheme.source} excludes it from quantization (pattern {pat!r})")
    spec = _expected_params(scheme, out_f, in_f, module, file)
    for key, (dtypes, shapes, what) in spec.items():
        p = key.removesuffix("?")
        if p not in metas:
            if key.endswith("?"):
                continue
            raise QuantTensorError(f"{file}: module {module} lacks tensor {module}.{p} ({what}); "
                                   f"has {sorted(params)}")
        _check(file, f"{module}.{p}", metas[p], dtypes, shapes, what)
    unexpected = params - {k.removesuffix("?") for k in spec}
    if unexpected:
        raise QuantTensorError(f"{file}: unexpected tensor {module}.{min(unexpected)} for the "
                               f"{scheme.method.value} scheme (expected {sorted(k.removesuffix('?') for k in spec)})")
    return WeightFormat.for_scheme(scheme)


def check_scale_values(t: torch.Tensor, name: str, file: str) -> None:
    """Check that the scale tensor ``name`` of ``file`` holds no NaN or infinity (E4M3 codes ``0x7F`` / ``0xFF``,
    E8M0 bytes ``0xFF``, non-finite floats): one such scale makes its whole layer's output NaN.

    Raises:
        QuantTensorError: a NaN or infinite value; the message names ``file`` and the tensor.
    """
    if t.dtype == torch.float8_e4m3fn:  # no infinities; NaN is S.1111.111
        bad = (t.view(torch.uint8) & 0x7F) == 0x7F
    elif t.dtype in (torch.uint8, torch.float8_e8m0fnu):  # E8M0: 0xFF is NaN
        bad = t.view(torch.uint8) == 0xFF
    else:
        bad = ~torch.isfinite(t)
    n = int(bad.sum())
    if n:
        raise QuantTensorError(f"{file}: tensor {name} holds {n} NaN or infinite value(s) of {t.numel()} (a corrupt "
                               "scale: its layer's output would be NaN)")


def _check_scales(scheme: QuantScheme, module: str, tensors: Mapping[str, torch.Tensor], file: str) -> None:
    """The values of a quantized linear's weight scales (:func:`check_scale_values`; a compressed-tensors global
    scale must not be 0, as its reciprocal is the multiplier)."""
    for p in ("weight_scale_inv", "weight_scale", "weight_scale_2", "weight_global_scale"):
        if p in tensors:
            check_scale_values(tensors[p], f"{module}.{p}", file)
    g = tensors.get("weight_global_scale")
    if scheme.method is QuantMethod.NVFP4_CT and g is not None and bool((g == 0).any()):
        raise QuantTensorError(f"{file}: tensor {module}.weight_global_scale is 0 (its reciprocal, the per-tensor "
                               "scale, is infinite)")


def linear_weight(scheme: QuantScheme, module: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int],
                  file: str) -> QuantizedWeight:
    """Validate one linear's released tensors (:func:`validate_linear`, and the scales' values: no NaN or
    infinity, no compressed-tensors global scale of 0) and normalize them.

    FP8 scales become float32 (exact from bf16 / f16 / e8m0); a compressed-tensors global scale ``g``
    becomes the multiplier ``1/g`` (float32; its dequantization then differs from
    :func:`~edgemoe.quant.dequant.dequant_nvfp4_ct` by float32 rounding only, at most a few ulp).

    Raises:
        QuantTensorError: as :func:`validate_linear`, or a scale that is NaN, infinite or (a global scale) 0.
    """
    fmt = validate_linear(scheme, module, tensors, shape, file)
    if fmt.dense:
        return QuantizedWeight(fmt, shape, tensors["weight"])
    _check_scales(scheme, module, tensors, file)
    if fmt is WeightFormat.FP8_BLOCK:
        return QuantizedWeight(fmt, shape, tensors["weight"], tensors["weight_scale_inv"].float(),
                               block_size=scheme.block_size)
    if scheme.method is QuantMethod.NVFP4_MODELOPT:
        s2 = tensors["weight_scale_2"].float().reshape(())
        return QuantizedWeight(fmt, shape, tensors["weight"], tensors["weight_scale"], s2)
    s2 = (1.0 / tensors["weight_global_scale"].float()).reshape(())
    return QuantizedWeight(fmt, shape, tensors["weight_packed"], tensors["weight_scale"], s2)


def dequantize_linear(scheme: QuantScheme, module: str, tensors: Mapping[str, torch.Tensor],
                      shape: tuple[int, int], file: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A non-expert linear (attention, shared expert, dense MLP, ...) as a dense weight, for loading.

    Unquantized weights are cast to ``dtype``; quantized ones are dequantized by the format's definition
    (:mod:`edgemoe.quant.dequant`; compressed-tensors NVFP4 divides by its global scale exactly as
    compressed-tensors does) in float32, then cast. The module's ``bias``, if any, is not part of the result.

    Returns:
        ``[O, I]`` in ``dtype``.

    Raises:
        QuantTensorError: as :func:`linear_weight`.
    """
    fmt = validate_linear(scheme, module, tensors, shape, file)
    if scheme.method is QuantMethod.NVFP4_CT and not fmt.dense:
        _check_scales(scheme, module, tensors, file)
        w = dequant_nvfp4_ct(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"])
    else:
        w = linear_weight(scheme, module, tensors, shape, file).dequant()
    return w.to(dtype)


def validate_mxfp4_experts(scheme: QuantScheme, module: str, proj: str,
                           tensors: Mapping[str, torch.Tensor | TensorMeta], num_experts: int,
                           shape: tuple[int, int], file: str) -> None:
    """Check gpt-oss's fused MXFP4 expert tensors ``{module}.{proj}_{blocks,scales,bias}``.

    Args:
        module: e.g. ``model.layers.3.mlp.experts``.
        proj: ``"gate_up_proj"`` (``shape = (2I, H)``) or ``"down_proj"`` (``shape = (H, I)``).
        tensors: by suffix: ``"blocks"``, ``"scales"``, optional ``"bias"``.
        shape: ``(out, in)`` of one expert's projection; ``in`` must be a multiple of 32.

    Raises:
        QuantTensorError: wrong dtype / shape, a missing tensor, or an excluded module; names ``file`` and
            the tensor.
    """
    if scheme.method is not QuantMethod.MXFP4:
        raise QuantTensorError(f"{file}: tensor {module}.{proj}_blocks is MXFP4, but the checkpoint declares "
                               f"{scheme.method.value} ({scheme.source})")
    pat = scheme.excluded_by(module)
    if pat is not None:
        raise QuantTensorError(f"{file}: module {module} carries MXFP4 tensors but {scheme.source} excludes it "
                               f"(pattern {pat!r})")
    out_f, in_f = shape
    if in_f % 32:
        raise QuantTensorError(f"{file}: {module}.{proj}: in_features {in_f} is not a multiple of 32 (MXFP4)")
    metas = {k: TensorMeta.of(v) for k, v in tensors.items()}
    e, g = num_experts, in_f // 32
    spec = {"blocks": ((torch.uint8,), ((e, out_f, g, 16),), "MXFP4 blocks [E, out, in/32, 16]"),
            "scales": ((torch.uint8,), ((e, out_f, g),), "E8M0 scales [E, out, in/32]"),
            "bias": (_DENSE, ((e, out_f),), "expert bias [E, out]")}
    for key, (dtypes, shapes, what) in spec.items():
        name = f"{module}.{proj}_{key}"
        if key not in metas:
            if key == "bias":
                continue
            raise QuantTensorError(f"{file}: missing tensor {name} ({what})")
        _check(file, name, metas[key], dtypes, shapes, what)
    unexpected = set(metas) - set(spec)
    if unexpected:
        raise QuantTensorError(f"{file}: unexpected tensor {module}.{proj}_{min(unexpected)}")


def mxfp4_expert_weight(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """One expert's MXFP4 projection from gpt-oss tensors: blocks uint8 ``[O, G, 16]``, scales ``[O, G]``."""
    out_f, g = scales.shape
    return QuantizedWeight(WeightFormat.MXFP4, (out_f, 32 * g), blocks.reshape(out_f, 16 * g), scales)


def gpt_oss_gate_up(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> tuple[QuantizedWeight, QuantizedWeight, torch.Tensor | None]:
    """Split one gpt-oss expert's interleaved ``gate_up_proj`` into gate and up.

    gpt-oss interleaves the ``2I`` output rows: row ``2j`` is gate row ``j``, row ``2j+1`` is up row ``j``
    (``transformers``' ``GptOssExperts._apply_gate``: ``gate_up[..., ::2]``, ``gate_up[..., 1::2]``).

    Args:
        blocks: uint8 ``[2I, H/32, 16]`` (one expert of ``gate_up_proj_blocks``).
        scales: uint8 ``[2I, H/32]``.
        bias: ``[2I]`` (one expert of ``gate_up_proj_bias``) or ``None``.

    Returns:
        ``(gate, up, b13)``: two MXFP4 :class:`QuantizedWeight` ``[I, H]`` and the bias de-interleaved the
        same way (gate's then up's, float32 ``[2I]``), or ``None``.
    """
    gate = mxfp4_expert_weight(blocks[0::2], scales[0::2])
    up = mxfp4_expert_weight(blocks[1::2], scales[1::2])
    b13 = None if bias is None else torch.cat((bias[0::2], bias[1::2])).float()
    return gate, up, b13
