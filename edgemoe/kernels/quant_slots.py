"""Quantized expert-cache slots as the Triton expert kernels read them (torch only, no Triton import).

A quantized cache holds every slot as one byte row; the kernels read its sections through typed views of
the byte bank (one pointer and one slot stride per section), never a dequantized copy. :class:`QuantSlots`
carries those views and the format's parameters; ``edgemoe.experts.compute.quant_slots`` builds it from an
``ExpertLayout``.

Formats (``w13`` = gate rows ``[0, I)`` then up rows ``[I, 2I)``; ``w2`` = down ``[H, I]``):

- ``fp8_block``: ``w13`` float8_e4m3fn ``[S, 2I, H]``, ``w13_scale`` float32 ``[S, 2·ceil(I/bn), ceil(H/bk)]``
  (gate's block rows then up's), ``w2`` ``[S, H, I]``, ``w2_scale`` ``[S, ceil(H/bn), ceil(I/bk)]``;
  ``W[r, c] = w[r, c] · scale[r // bn, c // bk]``.
- ``mxfp4``: ``w13`` uint8 ``[S, 2I, H/2]`` (E2M1 codes, element ``2j`` in the low nibble of byte ``j``),
  ``w13_scale`` uint8 E8M0 ``[S, 2I, H/32]``; ``w2`` ``[S, H, I/2]``, ``w2_scale`` ``[S, H, I/32]``;
  ``W = E2M1 · 2^(scale - 127)``.
- ``nvfp4``: codes as MXFP4, ``w13_scale`` float8_e4m3fn ``[S, 2I, H/16]``, ``w13_scale2`` float32 ``[S, 2]``
  (gate's and up's multipliers), ``w2_scale`` ``[S, H, I/16]``, ``w2_scale2`` ``[S, 1]``;
  ``W = E2M1 · (float(scale) · scale2)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["QUANT_FORMATS", "QuantSlots", "fp8_block_reason"]

QUANT_FORMATS = ("fp8_block", "mxfp4", "nvfp4")
"""Formats the quantized expert kernels read (the ``WeightFormat`` values of ``edgemoe.quant``)."""

_GROUP = {"mxfp4": 32, "nvfp4": 16}


def fp8_block_reason(block: tuple[int, int]) -> str | None:
    """``None`` when the FP8 kernels read block size ``(bn, bk)``, else why not: their column tiles
    are whole scale blocks, so ``bk`` must be a power of two in ``[16, 256]`` (every release: 128)."""
    bn, bk = block
    if bn < 1 or bk < 16 or bk > 256 or bk & (bk - 1):
        return f"FP8 block {block}: the kernels need a column block that is a power of two in [16, 256]"
    return None


@dataclass(frozen=True)
class QuantSlots:
    """Typed section views of a quantized slot bank (shapes in the module docstring).

    Attributes:
        format: one of :data:`QUANT_FORMATS`.
        w13, w13_scale, w2, w2_scale: the sections, ``[S, ...]``, each slot's matrix row-major, slots
            ``stride(0)`` elements apart.
        w13_scale2, w2_scale2: NVFP4's per-tensor multipliers (``None`` otherwise).
        block: FP8's ``(bn, bk)`` (``None`` otherwise).
    """

    format: str
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_scale2: torch.Tensor | None = None
    w2_scale2: torch.Tensor | None = None
    block: tuple[int, int] | None = None

    @property
    def num_slots(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def group(self) -> int:
        """Elements per scale along a row: FP8's ``bk``, 32 (MXFP4) or 16 (NVFP4)."""
        return self.block[1] if self.format == "fp8_block" else _GROUP[self.format]

    def check(self) -> None:
        """Validate dtypes, shapes and strides against the format.

        Raises:
            ValueError: naming the section that does not fit.
        """
        f, H, I, S = self.format, self.hidden, self.intermediate, self.num_slots
        if f not in QUANT_FORMATS:
            raise ValueError(f"quantized slots of format {f!r}: choose one of {QUANT_FORMATS}")
        if f == "fp8_block":
            if self.block is None or (reason := fp8_block_reason(self.block)) is not None:
                raise ValueError(reason or "FP8 slots need their block size")
            bn, bk = self.block
            want = {"w13": (torch.float8_e4m3fn, (2 * I, H)),
                    "w13_scale": (torch.float32, (2 * math.ceil(I / bn), math.ceil(H / bk))),
                    "w2": (torch.float8_e4m3fn, (H, I)),
                    "w2_scale": (torch.float32, (math.ceil(H / bn), math.ceil(I / bk)))}
        else:
            g = _GROUP[f]
            if H % g or I % g:
                raise ValueError(f"{f} slots need H ({H}) and I ({I}) multiples of {g}")
            sdt = torch.uint8 if f == "mxfp4" else torch.float8_e4m3fn
            want = {"w13": (torch.uint8, (2 * I, H // 2)), "w13_scale": (sdt, (2 * I, H // g)),
                    "w2": (torch.uint8, (H, I // 2)), "w2_scale": (sdt, (H, I // g))}
            if f == "nvfp4":
                want |= {"w13_scale2": (torch.float32, (2,)), "w2_scale2": (torch.float32, (1,))}
        for name, (dt, shape) in want.items():
            t = getattr(self, name)
            if t is None or t.dtype != dt or tuple(t.shape) != (S, *shape):
                got = None if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ValueError(f"{f} slots: {name} must be {dt} {(S, *shape)}, got {got}")
            inner = math.prod(shape)
            row_major = all(t.stride(d) == math.prod(shape[d:]) for d in range(1, t.dim()))
            if not row_major or (S > 1 and t.stride(0) < inner) or t.device != self.w13.device:
                raise ValueError(f"{f} slots: {name} must hold one row-major matrix per slot on one device "
                                 f"(stride {tuple(t.stride())})")
