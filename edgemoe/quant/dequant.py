"""Reference dequantizers, written from the format definitions (plain torch, float32 out).

These are the numerical definitions every kernel is tested against; nothing here is tuned for speed.

Element formats:

- **FP4 E2M1** (OCP Microscaling Formats v1.0, §5.3.3): 1 sign, 2 exponent (bias 1), 1 mantissa bit;
  code ``c`` (4 bits) is ``(-1)^(c>>3) * E2M1[c & 7]`` with ``E2M1 = 0, 0.5, 1, 1.5, 2, 3, 4, 6``.
  Two codes per byte: element ``2j`` of a row is the **low** nibble of byte ``j``, element ``2j+1`` the
  high nibble (gpt-oss / ``transformers``' ``integrations/mxfp4.py``, ModelOpt and compressed-tensors'
  ``pack_fp4_to_uint8`` all pack this way).
- **E8M0** (OCP MX §5.4.1): a biased exponent byte, value ``2^(b - 127)``; ``b = 255`` is NaN.
- **FP8 E4M3** (``torch.float8_e4m3fn``): largest finite value 448.

Scaled formats:

- FP8 block (DeepSeek-V3): ``W[r, c] = float(weight[r, c]) * weight_scale_inv[r // bn, c // bk]``,
  ``(bn, bk) = weight_block_size``; the scale grid is ``[ceil(O/bn), ceil(I/bk)]`` (a partial last block
  has its own scale). Same as ``transformers``' ``Fp8Dequantize`` for shapes the block divides.
- MXFP4 (OCP MX, block of 32 along the input dimension): ``W[r, c] = E2M1(code[r, c]) * 2^(scale[r, c//32] - 127)``.
- NVFP4 (block of 16 along the input dimension, FP8 E4M3 block scales, one float32 per-tensor scale):
  ModelOpt stores the per-tensor **multiplier** ``weight_scale_2 = amax / (6 * 448)``;
  ``W = E2M1(code) * (float(weight_scale) * weight_scale_2)``. compressed-tensors stores its **reciprocal**
  ``weight_global_scale = 6 * 448 / amax`` and defines ``W = E2M1(code) * (float(weight_scale) /
  weight_global_scale)`` (``compressed_tensors.quantization.lifecycle.forward._dequantize``).
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "E8M0_BIAS",
    "FP4_MAX",
    "FP8_E4M3_MAX",
    "dequant_fp8_block",
    "dequant_mxfp4",
    "dequant_mxfp4_packed",
    "dequant_nvfp4_ct",
    "dequant_nvfp4_modelopt",
    "e8m0_to_float",
    "unpack_fp4",
]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
E8M0_BIAS = 127


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Decode packed FP4 E2M1 codes.

    Args:
        packed: uint8 ``[..., n]``, two codes per byte (low nibble first).

    Returns:
        float32 ``[..., 2n]``.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 must be uint8, got {packed.dtype}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    lo = lut[(packed & 0x0F).long()]  # [..., n]
    hi = lut[(packed >> 4).long()]  # [..., n]
    return torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., 2n]


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes (uint8 or ``float8_e8m0fnu``) -> float32 ``2^(b-127)`` (255 -> NaN)."""
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e8m0fnu)
    if scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"E8M0 scales must be uint8 or float8_e8m0fnu, got {scales.dtype}")
    return scales.float()


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    """[..., ceil(rows/bn), ceil(cols/bk)] -> [..., rows, cols] (each scale repeated over its block)."""
    return scale.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                      block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """FP8 block-scaled weights -> float32.

    Args:
        weight: float8_e4m3fn ``[..., O, I]``.
        scale_inv: ``[..., ceil(O/bn), ceil(I/bk)]`` in float32, bfloat16, float16 or float8_e8m0fnu (the
            multiplier, despite the name: ``W = weight * scale_inv``).
        block_size: ``(bn, bk)``.

    Returns:
        float32 ``[..., O, I]``.
    """
    rows, cols = weight.shape[-2:]
    bn, bk = block_size
    s = _expand_blocks(scale_inv.float(), rows, cols, bn, bk)  # [..., O, I]
    return weight.float() * s


def dequant_mxfp4_packed(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 rows -> float32.

    Args:
        packed: uint8 ``[..., O, I/2]`` (row-major codes, low nibble first).
        scales: E8M0 uint8 ``[..., O, I/32]``.

    Returns:
        float32 ``[..., O, I]``.
    """
    vals = unpack_fp4(packed).unflatten(-1, (-1, 32))  # [..., O, I/32, 32]
    return (vals * e8m0_to_float(scales)[..., None]).flatten(-2)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 in gpt-oss's released layout -> float32, in the checkpoint's ``[out, in]`` orientation.

    Args:
        blocks: uint8 ``[..., R, G, 16]`` (``G = in/32`` blocks of 16 bytes = 32 codes).
        scales: uint8 ``[..., R, G]``.

    Returns:
        float32 ``[..., R, 32G]``. ``transformers``' ``convert_moe_packed_tensors`` returns the transpose
        (``[E, in, out]``, its ``GptOssExperts`` parameter layout). For ``gate_up_proj`` the ``2I`` rows
        interleave gate (even rows) and up (odd rows): ``GptOssExperts._apply_gate`` takes
        ``gate_up[..., ::2]`` and ``gate_up[..., 1::2]``.
    """
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         "(expected blocks [..., R, G, 16], scales [..., R, G])")
    return dequant_mxfp4_packed(blocks.flatten(-2), scales)


def _nvfp4(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    vals = unpack_fp4(packed).unflatten(-1, (-1, 16))  # [..., O, I/16, 16]
    return (vals * block_scale[..., None]).flatten(-2)  # [..., O, I]


def dequant_nvfp4_modelopt(weight: torch.Tensor, weight_scale: torch.Tensor,
                           weight_scale_2: torch.Tensor) -> torch.Tensor:
    """NVFP4 as ModelOpt stores it -> float32: ``code * (float(weight_scale) * weight_scale_2)``.

    Args:
        weight: uint8 ``[..., O, I/2]``.
        weight_scale: float8_e4m3fn ``[..., O, I/16]``.
        weight_scale_2: float32 per-tensor multiplier, shape ``[]``/``[1]`` (or ``[..., 1, 1]`` to broadcast
            over leading dims).
    """
    s2 = weight_scale_2.float()
    if s2.dim() <= 1:
        s2 = s2.reshape(())
    return _nvfp4(weight, weight_scale.float() * s2)


def dequant_nvfp4_ct(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     weight_global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 as compressed-tensors stores it -> float32: ``code * (float(weight_scale) / weight_global_scale)``.

    Args:
        weight_packed: uint8 ``[O, I/2]``.
        weight_scale: float8_e4m3fn ``[O, I/16]``.
        weight_global_scale: float32 ``[1]`` (the reciprocal of ModelOpt's ``weight_scale_2``).
    """
    return _nvfp4(weight_packed, weight_scale.float() / weight_global_scale.float().reshape(()))
