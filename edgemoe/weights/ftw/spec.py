"""FTW, edgemoe's pre-merged weight format: the specification, the manifest schema and its checks.

``edgemoe convert HF_DIR OUT_DIR`` turns a Hugging Face checkpoint into an FTW directory whose expert
banks the engine reads with parallel direct I/O straight into the host expert pool, then pins. An
FTW directory is self-contained: it serves with ``edgemoe serve OUT_DIR`` like the HF one.

Format, version 1
=================

Files of an FTW directory::

    ftw.json                 manifest (written last: its presence marks a complete directory)
    experts.w13.bin          expert bank "w13": gate ‖ up projections
    experts.w2.bin           expert bank "w2":  down projections
    non_expert.safetensors   every other tensor (attention, norms, embeddings, router, dense MLPs),
                             under its Hugging Face name, in safetensors format
    config.json, generation_config.json, tokenizer files, chat template, ...
                             copied verbatim from the HF directory (every top-level file that is not
                             a weight file or a safetensors index)

Expert banks. One bank file per expert tensor role. Row ``i`` holds the expert with flat id
``i = moe_layer * E + expert`` (``moe_layer`` = ordinal among the MoE layers, ``E`` = experts per
layer), ``N = num_moe_layers * E`` rows in all. Row contents, row-major, little-endian, in the bank's
``dtype``:

- ``w13``: ``[2I, H]``; rows ``[0, I)`` are ``mlp.experts.{e}.gate_proj.weight [I, H]``, rows
  ``[I, 2I)`` are ``up_proj.weight [I, H]`` (the pool's ``w13`` layout).
- ``w2``: ``[H, I]`` = ``down_proj.weight``.

Row ``i`` starts at byte ``offset + i * row_stride``; ``row_stride`` is ``row_bytes`` rounded up to
4096 (``alignment``) and the padding is zero bytes, so every row (and ``offset``, 0 in version 1)
is 4 KiB-aligned and a bank reads with ``O_DIRECT``; when ``row_stride == row_bytes`` (the usual
case) a bank is byte-identical to the pool's contiguous ``[N, *row_shape]`` tensor. The file is
exactly ``offset + N * row_stride`` bytes.

Checksums. Each bank's bytes ``[offset, offset + N * row_stride)`` are cut into chunks of
``checksum.chunk_bytes`` (a multiple of ``row_stride``, about 16 MiB; the last chunk may be shorter);
``checksum.chunks[k]`` is the ``zlib.crc32`` of chunk ``k`` (padding included). Per-chunk values
let parallel readers verify while they read. ``non_expert.safetensors`` is checksummed the same way
over the whole file.

Manifest (``ftw.json``), a JSON object (:class:`Manifest`; no other keys)::

    format          "edgemoe-ftw"
    format_version  1 (a reader refuses any other version)
    model_type, architecture          from config.json
    created, edgemoe_version          when and by which edgemoe the directory was written
    alignment       4096
    experts         {num_moe_layers, num_experts, moe_layers, hidden_size, moe_intermediate_size, num_rows,
                    row_id}
    banks           {"w13": BANK, "w2": BANK}, BANK = {file, dtype ("bfloat16" | "float16" |
                    "float32"), shape [N, *row_shape], offset, row_bytes, row_stride, nbytes (file size),
                    checksum {algorithm "crc32", chunk_bytes, chunks [int, ...]}}
    non_expert      {file, nbytes, num_tensors, checksum {...}}
    files           names of the copied config/tokenizer/generation files
    source          {path, fingerprint ("sha256:" of config.json and every weight file's name, size and
                    safetensors header), files [{name, bytes}]}, or null (banks not converted from a
                    Hugging Face directory)

Atomicity. ``convert`` writes into ``OUT_DIR.partial-<pid>`` beside ``OUT_DIR``, fsyncs the data,
writes the manifest last and renames the directory into place. A killed convert leaves only a
``*.partial-<pid>`` directory (removed by the next convert once that process is gone); a directory
without ``ftw.json`` is never taken for FTW.

Loading checks the manifest (:func:`read_manifest`), its geometry against ``config.json``
(:func:`check_config`) and every file's size (:func:`bank_sources`, :func:`non_expert_source`)
before reading a byte, then reads and verifies the data (:mod:`edgemoe.weights.ftw.reader`). Every
failure is an :class:`FTWError` (a :class:`~edgemoe.weights.index.CheckpointError`): one line naming
the file and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError, field_validator

from edgemoe.weights.dtypes import WEIGHT_DTYPES, parse_dtype
from edgemoe.weights.index import CheckpointError, ExpertGeometry

__all__ = [
    "ALIGN",
    "BANK_FILES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "NON_EXPERT_FILE",
    "BankSource",
    "FTWChecksumError",
    "FTWConfigError",
    "FTWError",
    "FTWTruncatedError",
    "FTWVersionError",
    "FileSource",
    "Manifest",
    "bank_sources",
    "check_config",
    "is_ftw",
    "non_expert_source",
    "read_manifest",
]

FORMAT = "edgemoe-ftw"
FORMAT_VERSION = 1
MANIFEST = "ftw.json"
NON_EXPERT_FILE = "non_expert.safetensors"
BANK_FILES = {"w13": "experts.w13.bin", "w2": "experts.w2.bin"}
ALIGN = 4096  # bytes: alignment of bank offsets and rows (direct-I/O alignment of offsets, lengths and buffers)

BankDtype = Literal[WEIGHT_DTYPES]


class FTWError(CheckpointError):
    """An FTW directory that cannot be loaded; the message names the file and what is wrong."""


class FTWVersionError(FTWError):
    """A manifest of another format or format version."""


class FTWConfigError(FTWError):
    """``config.json`` disagrees with the manifest's banks (model type, expert count or shapes)."""


class FTWChecksumError(FTWError):
    """A bank or file whose bytes do not match the manifest's checksum."""


class FTWTruncatedError(FTWError):
    """A bank or file missing, or shorter (or longer) than the manifest says."""


# ------------------------------------------------------------------------------------- manifest schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Checksum(_Strict):
    """``zlib.crc32`` of each ``chunk_bytes`` chunk of a bank or file, in order."""

    algorithm: Literal["crc32"]
    chunk_bytes: PositiveInt
    chunks: list[NonNegativeInt]


class Bank(_Strict):
    """One expert bank file: ``shape [N, *row_shape]`` rows of ``dtype``, ``row_stride`` bytes apart."""

    file: str
    dtype: BankDtype
    shape: list[NonNegativeInt]
    offset: NonNegativeInt
    row_bytes: PositiveInt
    row_stride: PositiveInt
    nbytes: NonNegativeInt
    checksum: Checksum


class NonExpert(_Strict):
    """The safetensors file of the non-expert tensors."""

    file: str
    nbytes: NonNegativeInt
    num_tensors: NonNegativeInt
    checksum: Checksum


class Experts(_Strict):
    """The routed-expert geometry the banks were written for."""

    num_moe_layers: NonNegativeInt
    num_experts: NonNegativeInt
    moe_layers: list[NonNegativeInt]
    hidden_size: PositiveInt
    moe_intermediate_size: PositiveInt
    num_rows: NonNegativeInt
    row_id: Literal["moe_layer * num_experts + expert"]


class SourceFile(_Strict):
    name: str
    bytes: NonNegativeInt


class Source(_Strict):
    """The Hugging Face directory the FTW directory was converted from."""

    path: str
    fingerprint: str
    files: list[SourceFile]


class Manifest(_Strict):
    """``ftw.json`` (field by field in the module docstring)."""

    format: Literal["edgemoe-ftw"]
    format_version: Literal[1]
    model_type: str
    architecture: str
    created: str
    edgemoe_version: str
    alignment: Literal[4096]
    experts: Experts
    banks: dict[Literal["w13", "w2"], Bank]
    non_expert: NonExpert
    files: list[str]
    source: Source | None

    @field_validator("source", mode="before")
    @classmethod
    def _no_source(cls, source):  # an empty object: what writers before the schema wrote for "none"
        return None if source == {} else source

    @field_validator("banks")
    @classmethod
    def _both_banks(cls, banks: dict[str, Bank]) -> dict[str, Bank]:
        missing = [name for name in BANK_FILES if name not in banks]
        if missing:
            raise ValueError(f"lacks bank {missing[0]!r}")
        return banks


def is_ftw(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds an FTW manifest (``ftw.json``)."""
    return (Path(model_dir) / MANIFEST).is_file()


def read_manifest(model_dir: str | Path) -> Manifest:
    """Parse and validate ``model_dir/ftw.json``.

    Raises:
        FTWError: a missing or unparsable manifest, or one that does not follow the schema (the first
            offending field named).
        FTWVersionError: another format or format version.
    """
    path = Path(model_dir) / MANIFEST
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise FTWError(f"{path}: no FTW manifest") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FTWError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise FTWVersionError(f"{path}: not an edgemoe FTW manifest (format "
                              f"{raw.get('format') if isinstance(raw, dict) else None!r}, expected {FORMAT!r})")
    if raw.get("format_version") != FORMAT_VERSION or isinstance(raw.get("format_version"), bool):
        raise FTWVersionError(f"{path}: FTW format version {raw.get('format_version')!r}; this edgemoe reads version "
                              f"{FORMAT_VERSION}: re-run `edgemoe convert` on the Hugging Face checkpoint")
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise FTWError(f"{path}: manifest field {where}: {err['msg']}{more}") from None


def check_config(man: Manifest, cfg, model_dir: str | Path) -> None:
    """Check that ``cfg`` (the :class:`~edgemoe.config.ModelConfig` of ``model_dir/config.json``)
    describes the banks of ``man``.

    Raises:
        FTWConfigError: another model type, expert geometry or bank shape (both values named), or a
            config with routed-expert biases (not stored by this version).
    """
    model_dir = Path(model_dir)
    where = f"{model_dir / 'config.json'} disagrees with {model_dir / MANIFEST}"
    if man.model_type != cfg.model_type:
        raise FTWConfigError(f"{where}: model_type {cfg.model_type!r} vs {man.model_type!r}")
    geometry = ExpertGeometry.from_config(cfg)
    if geometry.bias:
        raise FTWConfigError(f"{where}: config.json declares routed-expert biases ({cfg.model_type}), which "
                             f"FTW version {FORMAT_VERSION} does not store")
    for k in ("num_moe_layers", "num_experts", "hidden_size", "moe_intermediate_size"):
        v, got = getattr(geometry, k), getattr(man.experts, k)
        if got != v:
            raise FTWConfigError(f"{where}: {k} {v} in config.json, {got} in the banks")
    for name, row_shape in geometry.row_shapes().items():
        bank = man.banks[name]
        want = [geometry.num_rows, *row_shape]
        if bank.shape != want:
            raise FTWConfigError(f"{where}: bank {name} ({bank.file}) has shape {bank.shape}, config.json implies {want}")


@dataclass
class BankSource:
    """One expert bank on disk, as the manifest describes it.

    Attributes:
        path: the bank file.
        offset: byte offset of row 0 in the file (multiple of :data:`ALIGN`).
        rows: ``N`` rows (flat expert ids ``moe_layer * E + expert``).
        row_shape: shape of one row, e.g. ``(2I, H)`` for ``w13``.
        dtype: element dtype on disk.
        row_stride: bytes between row starts (``row_bytes`` rounded up to :data:`ALIGN`).
        chunk_bytes: bytes per checksum chunk, a multiple of ``row_stride`` (the last chunk may be shorter).
        crcs: ``zlib.crc32`` of each chunk (``None``: nothing to verify against).
        rows_per_layer: ``E``, only used to name MoE layers in error messages.
    """

    path: Path
    offset: int
    rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    row_stride: int
    chunk_bytes: int
    crcs: list[int] | None = None
    rows_per_layer: int | None = None

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.row_shape:
            n *= d
        return n * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of rows on disk (padding included)."""
        return self.rows * self.row_stride

    @property
    def num_chunks(self) -> int:
        return -(-self.nbytes // self.chunk_bytes) if self.nbytes else 0

    def chunk_range(self, k: int) -> tuple[int, int]:
        """``[start, end)`` byte range of chunk ``k`` relative to :attr:`offset`."""
        return k * self.chunk_bytes, min((k + 1) * self.chunk_bytes, self.nbytes)

    def describe_rows(self, start: int, end: int) -> str:
        r0, r1 = start // self.row_stride, -(-end // self.row_stride) - 1
        s = f"rows {r0}-{r1}"
        if self.rows_per_layer:
            s += f" (MoE layers {r0 // self.rows_per_layer}-{r1 // self.rows_per_layer})"
        return s


@dataclass
class FileSource:
    """A whole file read as raw bytes (``non_expert.safetensors``), cut into crc32 chunks.

    Attributes:
        path: the file; nbytes: its size in bytes.
        chunk_bytes: bytes per checksum chunk (a multiple of :data:`ALIGN`; the last chunk may be shorter).
        crcs: ``zlib.crc32`` of each chunk (``None``: nothing to verify against).
        offset: always 0 (the reader treats banks and files alike).
    """

    path: Path
    nbytes: int
    chunk_bytes: int
    crcs: list[int] | None = None
    offset: int = 0

    @property
    def num_chunks(self) -> int:
        return -(-self.nbytes // self.chunk_bytes) if self.nbytes else 0

    def chunk_range(self, k: int) -> tuple[int, int]:
        return k * self.chunk_bytes, min((k + 1) * self.chunk_bytes, self.nbytes)

    def describe_rows(self, start: int, end: int) -> str:
        return f"{end - start} bytes"


def _file_size(path: Path, what: str) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise FTWTruncatedError(f"{path}: {what} is missing") from None


def bank_sources(man: Manifest, model_dir: str | Path) -> dict[str, BankSource]:
    """The manifest's banks as :class:`BankSource` s, after checking each file's size.

    Raises:
        FTWTruncatedError: a bank file missing, shorter or longer than ``offset + N * row_stride``.
        FTWError: an inconsistent bank entry (stride, alignment, chunking).
    """
    model_dir = Path(model_dir)
    out = {}
    for name, b in man.banks.items():
        path = model_dir / b.file
        src = BankSource(path, b.offset, b.shape[0] if b.shape else 0, tuple(b.shape[1:]), parse_dtype(b.dtype),
                         b.row_stride, b.checksum.chunk_bytes, list(b.checksum.chunks),
                         rows_per_layer=man.experts.num_experts)
        if (not b.shape or b.row_bytes != src.row_bytes or src.row_stride < src.row_bytes or src.row_stride % ALIGN
                or src.offset % ALIGN or src.chunk_bytes % src.row_stride or len(src.crcs) != src.num_chunks
                or b.nbytes != src.offset + src.nbytes):
            raise FTWError(f"{model_dir / MANIFEST}: bank {name}: inconsistent shape/row_stride/offset/chunking "
                           f"(shape {b.shape}, row_bytes {b.row_bytes}, row_stride {src.row_stride}, offset "
                           f"{src.offset}, nbytes {b.nbytes}, chunk_bytes {src.chunk_bytes}, {len(src.crcs)} "
                           f"checksums for {src.num_chunks} chunks)")
        want = src.offset + src.nbytes
        size = _file_size(path, f"bank file {name}")
        if size != want:
            what = "truncated" if size < want else "longer than the manifest says"
            raise FTWTruncatedError(f"{path}: bank file is {what}: {size} bytes, expected {want} "
                                    f"({src.rows} rows x {src.row_stride} bytes + offset {src.offset})")
        out[name] = src
    return out


def non_expert_source(man: Manifest, model_dir: str | Path) -> FileSource:
    """The manifest's non-expert file as a :class:`FileSource`, after checking its size.

    Raises:
        FTWTruncatedError: the file missing or of another size than the manifest says.
        FTWError: inconsistent chunking.
    """
    ne = man.non_expert
    path = Path(model_dir) / ne.file
    src = FileSource(path, ne.nbytes, ne.checksum.chunk_bytes, list(ne.checksum.chunks))
    size = _file_size(path, "non-expert weights file")
    if size != src.nbytes:
        raise FTWTruncatedError(f"{path}: {size} bytes, manifest says {src.nbytes} (truncated?)")
    if src.chunk_bytes % ALIGN or len(src.crcs) != src.num_chunks:
        raise FTWError(f"{Path(model_dir) / MANIFEST}: non_expert: inconsistent chunking (chunk_bytes "
                       f"{src.chunk_bytes}, {len(src.crcs)} checksums for {src.num_chunks} chunks)")
    return src
