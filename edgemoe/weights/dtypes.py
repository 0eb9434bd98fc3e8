"""The dtype table of edgemoe: torch dtypes, their names, their safetensors codes and their sizes.

One table serves every reader and writer of weights: config dtype names (``"bfloat16"``,
``"bf16"``), FTW manifests (canonical names), safetensors headers (codes such as ``"BF16"``; the
codes of the safetensors format specification) and byte sizes. It imports only torch, so any module
(the configuration included) can use it.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "WEIGHT_DTYPES",
    "checkpoint_dtype",
    "dtype_from_safetensors",
    "dtype_name",
    "dtype_size",
    "parse_dtype",
]

# (dtype, canonical name, safetensors code, other accepted names)
_TABLE: tuple[tuple[torch.dtype, str, str, tuple[str, ...]], ...] = (
    (torch.bfloat16, "bfloat16", "BF16", ("bf16",)),
    (torch.float16, "float16", "F16", ("fp16",)),
    (torch.float32, "float32", "F32", ("fp32",)),
    (torch.float64, "float64", "F64", ()),
    (torch.float8_e4m3fn, "float8_e4m3fn", "F8_E4M3", ()),
    (torch.float8_e5m2, "float8_e5m2", "F8_E5M2", ()),
    (torch.float8_e8m0fnu, "float8_e8m0fnu", "F8_E8M0", ()),  # power-of-two scales (FP8 releases with scale_fmt ue8m0)
    (torch.int64, "int64", "I64", ()),
    (torch.int32, "int32", "I32", ()),
    (torch.int16, "int16", "I16", ()),
    (torch.int8, "int8", "I8", ()),
    (torch.uint64, "uint64", "U64", ()),
    (torch.uint32, "uint32", "U32", ()),
    (torch.uint16, "uint16", "U16", ()),
    (torch.uint8, "uint8", "U8", ()),
    (torch.bool, "bool", "BOOL", ()),
)

# Dtypes edgemoe keeps dense weights and computes in (``--dtype``, ``config.json``'s ``dtype``, FTW banks).
WEIGHT_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

_BY_NAME = {name: dt for dt, name, _, aliases in _TABLE for name in (name, *aliases)}
_NAME = {dt: name for dt, name, _, _ in _TABLE}
_BY_SAFETENSORS = {code: dt for dt, _, code, _ in _TABLE}
_WEIGHT_NAMES = {n: dt for n, dt in _BY_NAME.items() if _NAME[dt] in WEIGHT_DTYPES}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a weight dtype name (``"bfloat16" | "bf16" | "float16" | "fp16" | "float32" | "fp32"``, any
    case) or a ``torch.dtype`` to the ``torch.dtype``.

    Raises:
        ValueError: a name that is not one of the weight dtypes.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return _WEIGHT_NAMES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_WEIGHT_NAMES)}") from None


def checkpoint_dtype(name: str, model_dir) -> torch.dtype:
    """The weight dtype ``name`` that ``config.json`` of ``model_dir`` declares (its ``dtype``, transformers-4
    ``torch_dtype``), which ``--dtype auto`` computes in.

    Raises:
        ValueError: ``name`` is not one of the weight dtypes; the message names the file, the field and
            ``--dtype``.
    """
    try:
        return parse_dtype(name)
    except ValueError:
        raise ValueError(f"{Path(model_dir) / 'config.json'}: dtype {name!r} is not a weight dtype edgemoe computes "
                         f"in ({', '.join(WEIGHT_DTYPES)}); choose one with --dtype") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``), as FTW manifests record it.

    Raises:
        ValueError: a dtype outside the table.
    """
    try:
        return _NAME[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no name in edgemoe's dtype table") from None


def dtype_from_safetensors(code: str) -> torch.dtype:
    """The ``torch.dtype`` of a safetensors header's dtype code (``"BF16"``, ``"F8_E4M3"``, ``"I32"``, ...).

    Raises:
        ValueError: a code outside the table.
    """
    try:
        return _BY_SAFETENSORS[code]
    except (KeyError, TypeError):
        raise ValueError(f"unknown safetensors dtype {code!r}") from None


def dtype_size(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype`` or any name of the table, e.g. ``"float8_e4m3fn"``).

    Raises:
        ValueError: a name outside the table.
    """
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    try:
        return _BY_NAME[str(dtype).lower()].itemsize
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
