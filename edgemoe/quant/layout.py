"""The packed expert row: every tensor of one routed (layer, expert), in every format, as one byte row.

The host expert pool, the FTW expert bank and the device expert cache hold experts as uint8
``[N, row_bytes]`` banks (row ``i`` = flat id ``moe_layer * E + expert``). One :class:`ExpertLayout` per
(format, hidden ``H``, intermediate ``I``, has_bias) says where each *section* lives in a row:

- every section starts at a multiple of 64 bytes (``SECTION_ALIGN``: one AVX-512 vector, a GPU 128-byte
  line's half), its unused tail and the row's tail are zero bytes;
- ``row_bytes`` is a multiple of 4096 (``ROW_ALIGN``), so rows are page-aligned and a bank reads with
  ``O_DIRECT``, and any section can be viewed as its dtype over the whole bank (:meth:`ExpertLayout.view`).

Canonical roles, the same for every format: ``w13`` = gate rows ``[0, I)`` then up rows ``[I, 2I)``
(``[2I, H]``; gpt-oss's gate/up row interleaving is undone at pack time, a lossless row permutation) and
``w2`` = down ``[H, I]``. Sections, in row order (``bn, bk`` = FP8 block, 128 in every release):

==========  ============  ========================================  ==========================================
format      section       dtype / shape                             meaning
==========  ============  ========================================  ==========================================
bf16/f16/   ``w13``       dtype ``[2I, H]``                         gate ‖ up
f32         ``w2``        dtype ``[H, I]``                          down
fp8_block   ``w13``       float8_e4m3fn ``[2I, H]``
            ``w13_scale`` float32 ``[2*ceil(I/bn), ceil(H/bk)]``    gate's block scales, then up's
            ``w2``        float8_e4m3fn ``[H, I]``
            ``w2_scale``  float32 ``[ceil(H/bn), ceil(I/bk)]``
mxfp4       ``w13``       uint8 ``[2I, H/2]``                       E2M1 codes, low nibble first
            ``w13_scale`` uint8 ``[2I, H/32]``                      E8M0 (bias 127)
            ``w2``        uint8 ``[H, I/2]``
            ``w2_scale``  uint8 ``[H, I/32]``
nvfp4       ``w13``       uint8 ``[2I, H/2]``
            ``w13_scale`` float8_e4m3fn ``[2I, H/16]``
            ``w13_scale2`` float32 ``[2]``                          per-tensor multipliers of gate, up
            ``w2``        uint8 ``[H, I/2]``
            ``w2_scale``  float8_e4m3fn ``[H, I/16]``
            ``w2_scale2`` float32 ``[1]``                           down's multiplier
has_bias    ``b13``       float32 ``[2I]``                          gate's bias then up's (after ``w13``'s
                                                                    sections)
            ``b2``        float32 ``[H]``                           down's bias (after ``w2``'s)
==========  ============  ========================================  ==========================================

Dequantization of a row (:meth:`ExpertLayout.dequant_rows`, the reference for every kernel): as
:meth:`~edgemoe.quant.weights.QuantizedWeight.dequant` per role; FP8 ``w13`` rows ``r < I`` use scale rows
``[0, ceil(I/bn))`` and rows ``r >= I`` scale rows from ``ceil(I/bn)`` on (``(r - I) // bn`` past it);
NVFP4 ``W = E2M1 * (float(scale) * scale2[role])``.

Bytes per expert (``row_bytes``, padding included):

=========  ===================================  ================================================
format     Qwen3-30B-A3B (H=2048, I=768)        gpt-oss-120b (H=2880, I=2880, biases)
=========  ===================================  ================================================
bf16       9,437,184 (2,304 pages)              49,803,264 (12,159 pages)
fp8_block  4,722,688 (1,153 pages; 0.50x bf16)  24,928,256 (6,086 pages; 0.50x)
mxfp4      2,506,752 (612 pages; 0.27x bf16)    13,254,656 (3,236 pages; 0.27x)
nvfp4      2,658,304 (649 pages; 0.28x bf16)    14,032,896 (3,426 pages; 0.28x)
=========  ===================================  ================================================

(``tests/test_quant_layout.py`` checks these numbers against :meth:`ExpertLayout.build`.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from edgemoe.quant.dequant import dequant_fp8_block, dequant_mxfp4_packed, unpack_fp4
from edgemoe.quant.weights import QuantizedWeight, WeightFormat

__all__ = ["ROW_ALIGN", "SECTION_ALIGN", "ExpertLayout", "LayoutError", "Section"]

SECTION_ALIGN = 64
ROW_ALIGN = 4096

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.uint8: "uint8"}


class LayoutError(ValueError):
    """A geometry the format cannot hold, or tensors that do not fit the layout (the message says which)."""


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Section:
    """One tensor of a row: ``dtype`` ``shape`` at byte ``offset`` (a multiple of ``SECTION_ALIGN``)."""

    name: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert row (see the module docstring for the sections of each format).

    Build with :meth:`build`; two layouts are equal iff they describe the same bytes.

    Attributes:
        format: the expert weight format.
        hidden, intermediate: ``H`` and ``I``.
        has_bias: whether ``b13`` / ``b2`` sections exist (gpt-oss).
        block_size: FP8 ``(bn, bk)``; ``None`` for other formats.
        sections: in row order.
        row_bytes: bytes per row, a multiple of ``ROW_ALIGN``.
    """

    format: WeightFormat
    hidden: int
    intermediate: int
    has_bias: bool
    block_size: tuple[int, int] | None
    sections: tuple[Section, ...]
    row_bytes: int

    @classmethod
    def build(cls, format: WeightFormat, hidden: int, intermediate: int, has_bias: bool = False,
              block_size: tuple[int, int] = (128, 128)) -> ExpertLayout:
        """The layout for ``format`` at ``(H, I)``.

        Args:
            block_size: FP8 block ``(bn, bk)`` (ignored by other formats).

        Raises:
            LayoutError: MXFP4 with ``H`` or ``I`` not a multiple of 32, NVFP4 not a multiple of 16.
        """
        h, i = hidden, intermediate
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        if format.dense:
            specs = [("w13", format.dtype, (2 * i, h)), ("w2", format.dtype, (h, i))]
        elif format is WeightFormat.FP8_BLOCK:
            bn, bk = block_size
            specs = [("w13", torch.float8_e4m3fn, (2 * i, h)),
                     ("w13_scale", torch.float32, (2 * math.ceil(i / bn), math.ceil(h / bk))),
                     ("w2", torch.float8_e4m3fn, (h, i)),
                     ("w2_scale", torch.float32, (math.ceil(h / bn), math.ceil(i / bk)))]
        else:
            g = 32 if format is WeightFormat.MXFP4 else 16
            if h % g or i % g:
                raise LayoutError(f"{format.value} experts need hidden ({h}) and intermediate ({i}) sizes that are "
                                  f"multiples of {g}")
            sdt = torch.uint8 if format is WeightFormat.MXFP4 else torch.float8_e4m3fn
            specs = [("w13", torch.uint8, (2 * i, h // 2)), ("w13_scale", sdt, (2 * i, h // g))]
            if format is WeightFormat.NVFP4:
                specs.append(("w13_scale2", torch.float32, (2,)))
            specs += [("w2", torch.uint8, (h, i // 2)), ("w2_scale", sdt, (h, i // g))]
            if format is WeightFormat.NVFP4:
                specs.append(("w2_scale2", torch.float32, (1,)))
        if has_bias:
            w2_at = next(k for k, s in enumerate(specs) if s[0] == "w2")
            specs.insert(w2_at, ("b13", torch.float32, (2 * i,)))
            specs.append(("b2", torch.float32, (h,)))
        sections, off = [], 0
        for name, dt, shape in specs:
            sec = Section(name, off, dt, shape)
            sections.append(sec)
            off = _align(sec.end, SECTION_ALIGN)
        return cls(format, h, i, has_bias, block_size if format is WeightFormat.FP8_BLOCK else None,
                   tuple(sections), _align(off, ROW_ALIGN))

    def section(self, name: str) -> Section:
        """The section called ``name``.

        Raises:
            KeyError: the layout has no such section.
        """
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(f"{self.format.value} expert layout has no section {name!r} "
                       f"(sections: {[s.name for s in self.sections]})")

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description (for an FTW manifest): format, geometry, row_bytes and every section."""
        return {"format": self.format.value, "hidden_size": self.hidden, "moe_intermediate_size": self.intermediate,
                "has_bias": self.has_bias, "block_size": list(self.block_size) if self.block_size else None,
                "row_bytes": self.row_bytes,
                "sections": [{"name": s.name, "offset": s.offset, "dtype": _DTYPE_NAMES[s.dtype],
                              "shape": list(s.shape)} for s in self.sections]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExpertLayout:
        """Rebuild from :meth:`to_json` output, checking that the recorded sections are this version's.

        Raises:
            LayoutError: the description does not match the layout this code builds for its parameters.
        """
        try:
            layout = cls.build(WeightFormat(d["format"]), int(d["hidden_size"]), int(d["moe_intermediate_size"]),
                               bool(d["has_bias"]), tuple(d["block_size"] or (128, 128)))
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"invalid expert layout description ({e})") from None
        if layout.to_json() != d:
            raise LayoutError(f"expert layout description {d} does not match this edgemoe's layout "
                              f"{layout.to_json()}")
        return layout

    def new_bank(self, num_rows: int) -> torch.Tensor:
        """A zero-filled uint8 ``[num_rows, row_bytes]`` bank (tests, small pools; the host pool allocates its own)."""
        return torch.zeros(num_rows, self.row_bytes, dtype=torch.uint8)

    def view(self, bank: torch.Tensor, name: str) -> torch.Tensor:
        """Typed view of one section over every row of a bank (no copy).

        Args:
            bank: uint8 ``[N, row_bytes]`` with unit stride along the row (any row stride divisible by 4,
                e.g. a contiguous bank or a slice of rows of one).

        Returns:
            ``[N, *section.shape]`` of the section's dtype, sharing ``bank``'s memory.

        Raises:
            LayoutError: ``bank`` is not uint8 ``[N, row_bytes]``.
        """
        if bank.dtype != torch.uint8 or bank.dim() != 2 or bank.shape[1] != self.row_bytes or bank.stride(1) != 1:
            raise LayoutError(f"expert bank must be uint8 [N, {self.row_bytes}] with unit stride along rows, got "
                              f"{bank.dtype} {tuple(bank.shape)} stride {tuple(bank.stride())}")
        s = self.section(name)
        return bank[:, s.offset:s.end].view(s.dtype).unflatten(1, s.shape)

    def _check_role(self, role: str, w: QuantizedWeight, shape: tuple[int, int]) -> None:
        if w.format is not self.format:
            raise LayoutError(f"{role}: weight format {w.format.value} does not match the {self.format.value} layout")
        if tuple(w.shape) != shape:
            raise LayoutError(f"{role}: weight shape {tuple(w.shape)}, expected {shape}")
        if self.format is WeightFormat.FP8_BLOCK and tuple(w.block_size or ()) != self.block_size:
            raise LayoutError(f"{role}: FP8 block size {w.block_size} does not match the layout's {self.block_size}")

    def pack_expert(self, gate: QuantizedWeight, up: QuantizedWeight, down: QuantizedWeight,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Write one expert's row.

        Args:
            gate, up: ``[I, H]`` weights in this layout's format (e.g. from
                :func:`~edgemoe.quant.weights.linear_weight`, or :func:`~edgemoe.quant.weights.gpt_oss_gate_up`).
            down: ``[H, I]``.
            b13: ``[2I]`` gate's bias then up's (required iff ``has_bias``), cast to float32.
            b2: ``[H]`` down's bias (required iff ``has_bias``).
            out: uint8 ``[row_bytes]`` to write into (e.g. a row of the host pool); a new tensor if ``None``.

        Returns:
            ``out`` (uint8 ``[row_bytes]``), every byte written (padding zeroed).

        Raises:
            LayoutError: a role of the wrong format, shape or block size, a missing or unexpected bias, or
                ``out`` of the wrong size.
        """
        h, i = self.hidden, self.intermediate
        for role, w, shape in (("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))):
            self._check_role(role, w, shape)
        if self.has_bias != (b13 is not None) or self.has_bias != (b2 is not None):
            raise LayoutError(f"layout has_bias={self.has_bias} but b13 / b2 given: "
                              f"{b13 is not None} / {b2 is not None}")
        if out is None:
            out = torch.empty(self.row_bytes, dtype=torch.uint8)
        if out.dtype != torch.uint8 or tuple(out.shape) != (self.row_bytes,) or not out.is_contiguous():
            raise LayoutError(f"out must be contiguous uint8 [{self.row_bytes}], got {out.dtype} {tuple(out.shape)}")
        out.zero_()
        row = out.view(1, -1)

        def put(name: str, value: torch.Tensor) -> None:
            dst = self.view(row, name)[0]
            if tuple(value.shape) != tuple(dst.shape):
                raise LayoutError(f"section {name}: got shape {tuple(value.shape)}, expected {tuple(dst.shape)}")
            if value.dtype != dst.dtype and not (dst.dtype == torch.float32 and value.is_floating_point()):
                raise LayoutError(f"section {name}: got dtype {value.dtype}, expected {dst.dtype}")
            dst.copy_(value)

        put("w13", torch.cat((gate.data, up.data)))
        put("w2", down.data)
        if not self.format.dense:
            put("w13_scale", torch.cat((gate.scale, up.scale)))
            put("w2_scale", down.scale)
        if self.format is WeightFormat.NVFP4:
            put("w13_scale2", torch.stack((gate.scale2.reshape(()), up.scale2.reshape(()))).float())
            put("w2_scale2", down.scale2.reshape(1).float())
        if self.has_bias:
            put("b13", b13.float())
            put("b2", b2.float())
        return out

    def dequant_rows(self, bank: torch.Tensor, ids: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference dequantization of some rows of a bank (the CPU fallback and every kernel's reference).

        Args:
            bank: uint8 ``[N, row_bytes]``.
            ids: row indices ``[n]``.

        Returns:
            ``(w13, w2)``: float32 ``[n, 2I, H]`` (gate rows then up rows) and ``[n, H, I]``.
        """
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=bank.device)
        rows = bank.index_select(0, ids_t)  # [n, row_bytes]
        w13, w2 = self.view(rows, "w13"), self.view(rows, "w2")
        f, i = self.format, self.intermediate
        if f.dense:
            return w13.float(), w2.float()
        s13, s2 = self.view(rows, "w13_scale"), self.view(rows, "w2_scale")
        if f is WeightFormat.FP8_BLOCK:
            assert self.block_size is not None
            bn = self.block_size[0]
            si = math.ceil(i / bn)
            gate = dequant_fp8_block(w13[:, :i], s13[:, :si], self.block_size)  # [n, I, H]
            up = dequant_fp8_block(w13[:, i:], s13[:, si:], self.block_size)  # [n, I, H]
            return torch.cat((gate, up), dim=1), dequant_fp8_block(w2, s2, self.block_size)
        if f is WeightFormat.MXFP4:
            return dequant_mxfp4_packed(w13, s13), dequant_mxfp4_packed(w2, s2)
        g13 = self.view(rows, "w13_scale2")  # [n, 2]
        g2 = self.view(rows, "w2_scale2")  # [n, 1]
        role = (torch.arange(2 * i, device=bank.device) >= i).long()  # [2I]: 0 gate, 1 up
        eff13 = s13.float() * g13[:, role][:, :, None]  # [n, 2I, H/16]
        eff2 = s2.float() * g2[:, :, None]  # [n, H, I/16]
        w13f = (unpack_fp4(w13).unflatten(-1, (-1, 16)) * eff13[..., None]).flatten(-2)
        w2f = (unpack_fp4(w2).unflatten(-1, (-1, 16)) * eff2[..., None]).flatten(-2)
        return w13f, w2f

    def bias_rows(self, bank: torch.Tensor, ids: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert biases of some rows: float32 ``([n, 2I], [n, H])``.

        Raises:
            LayoutError: the layout has no biases.
        """
        if not self.has_bias:
            raise LayoutError(f"{self.format.value} expert layout has no bias sections")
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=bank.device)
        rows = bank.index_select(0, ids_t)
        return self.view(rows, "b13").clone(), self.view(rows, "b2").clone()
