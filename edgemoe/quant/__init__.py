"""Quantized weights: released schemes, validation, reference dequantization and the packed expert row.

Modules:

- :mod:`~edgemoe.quant.scheme`: which quantization a checkpoint declares (:func:`detect_scheme`,
  :class:`QuantScheme`: FP8 block, MXFP4, NVFP4 ModelOpt, NVFP4 compressed-tensors; exclusion patterns).
- :mod:`~edgemoe.quant.weights`: one linear's released tensors checked against the scheme
  (:func:`validate_linear`, :func:`validate_mxfp4_experts`) and normalized (:class:`QuantizedWeight`,
  :func:`linear_weight`, :func:`gpt_oss_gate_up`); :func:`dequantize_linear` for non-expert weights.
- :mod:`~edgemoe.quant.dequant`: reference dequantizers from the format definitions (float32 out).
- :mod:`~edgemoe.quant.layout`: :class:`ExpertLayout`, one routed expert's tensors as one aligned byte row.
- :mod:`~edgemoe.quant.quantize`: quantizers writing the released tensors and ``quantization_config`` (test
  checkpoints).
"""

from edgemoe.quant.layout import (
    ROW_ALIGN,
    SECTION_ALIGN,
    ExpertLayout,
    LayoutError,
    Section,
)
from edgemoe.quant.scheme import (
    PatternSyntax,
    QuantConfigError,
    QuantMethod,
    QuantScheme,
    detect_scheme,
    scheme_from_config,
)
from edgemoe.quant.weights import (
    QuantizedWeight,
    QuantTensorError,
    TensorMeta,
    WeightFormat,
    dequantize_linear,
    gpt_oss_gate_up,
    linear_weight,
    mxfp4_expert_weight,
    validate_linear,
    validate_mxfp4_experts,
)

__all__ = [
    "ROW_ALIGN",
    "SECTION_ALIGN",
    "ExpertLayout",
    "LayoutError",
    "PatternSyntax",
    "QuantConfigError",
    "QuantMethod",
    "QuantScheme",
    "QuantTensorError",
    "QuantizedWeight",
    "Section",
    "TensorMeta",
    "WeightFormat",
    "dequantize_linear",
    "detect_scheme",
    "gpt_oss_gate_up",
    "linear_weight",
    "mxfp4_expert_weight",
    "scheme_from_config",
    "validate_linear",
    "validate_mxfp4_experts",
]
