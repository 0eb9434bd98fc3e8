"""FTW, edgemoe's pre-merged weight format: the specification, the manifest schema and its checks.

``edgemoe convert HF_DIR OUT_DIR`` turns a Hugging Face checkpoint into an FTW directory whose expert
banks the engine reads with parallel direct I/O straight into the host expert pool, then pins. An
FTW directory is self-contained: it serves with ``edgemoe serve OUT_DIR`` like the HF one.

Format, version 2
=================

Files of an FTW directory::

    ftw.json                 manifest (written last: its presence marks a complete directory)
    experts.bin              the expert bank: one packed byte row per routed expert
    non_expert.safetensors   every other tensor (attention, norms, embeddings, router, dense MLPs),
                             under its Hugging Face name, in safetensors format, float (quantized
                             non-expert linears of the source are dequantized when converting)
    config.json, generation_config.json, tokenizer files, chat template, ...
                             copied verbatim from the HF directory (every top-level file that is not
                             a weight file or a safetensors index)

Expert bank. Row ``i`` holds the expert with flat id ``i = moe_layer * E + expert`` (``moe_layer`` =
ordinal among the MoE layers, ``E`` = experts per layer), ``N = num_moe_layers * E`` rows of
``row_bytes`` bytes each, in the manifest's expert ``layout`` (:class:`~edgemoe.quant.layout.ExpertLayout`,
its ``to_json()``): every tensor of one expert — gate ‖ up rows ``w13`` and down ``w2``, and for a
quantized format their block scales and per-tensor scales — as sections at fixed offsets, in the
format's own encoding (bf16 / float32 elements, FP8 e4m3 codes with float32 128x128 block scales,
MXFP4 / NVFP4 packed E2M1 nibbles with E8M0 / E4M3 group scales). ``row_bytes`` is a multiple of 4096
and the padding is zero bytes, so every row is 4 KiB-aligned, the bank reads with ``O_DIRECT`` and it
is byte-identical to the host pool's bank: the reader reads it straight into the pool. The file is
exactly ``N * row_bytes`` bytes.

Checksums. The bank's bytes are cut into chunks of ``checksum.chunk_bytes`` (a whole number of rows,
about 16 MiB; the last chunk may be shorter); ``checksum.chunks[k]`` is the ``zlib.crc32`` of chunk
``k`` (padding included). Per-chunk values
let parallel readers verify while they read. ``non_expert.safetensors`` is checksummed the same way
over the whole file.

Manifest (``ftw.json``), a JSON object (:class:`Manifest`; no other keys)::

    format          "edgemoe-ftw"
    format_version  2 (a reader refuses any other version; version 1, two float banks ``w13`` / ``w2``,
                    is refused with a request to re-run ``edgemoe convert``)
    model_type, architecture          from config.json
    created, edgemoe_version          when and by which edgemoe the directory was written
    alignment       4096
    experts         {num_moe_layers, num_experts, moe_layers, hidden_size, moe_intermediate_size, num_rows,
                    row_id}
    layout          the row layout, ExpertLayout.to_json(): {format ("bf16" | "fp16" | "fp32" | "fp8_block" |
                    "mxfp4" | "nvfp4"), hidden_size, moe_intermediate_size, has_bias, block_size, row_bytes,
                    sections [{name, offset, dtype, shape}, ...]}
    bank            {file, rows N, row_bytes, nbytes (file size), checksum {algorithm "crc32", chunk_bytes,
                    chunks [int, ...]}}
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
before reading a byte, then reads and verifies the data (:mod:`edgemoe.weights.ftw.reader`); the
layout must be one this edgemoe builds (:meth:`~edgemoe.quant.layout.ExpertLayout.from_json`). Every
failure is an :class:`FTWError` (a :class:`~edgemoe.weights.index.CheckpointError`): one line naming
the file and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError, field_validator

from edgemoe.quant.layout import ExpertLayout, LayoutError
from edgemoe.weights.index import CheckpointError, ExpertGeometry

__all__ = [
    "ALIGN",
    "BANK_FILE",
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
    "bank_source",
    "check_config",
    "is_ftw",
    "non_expert_source",
    "read_manifest",
]

FORMAT = "edgemoe-ftw"
FORMAT_VERSION = 2
MANIFEST = "ftw.json"
NON_EXPERT_FILE = "non_expert.safetensors"
BANK_FILE = "experts.bin"
ALIGN = 4096  # bytes: alignment of rows (direct-I/O alignment of offsets, lengths and buffers)


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
    """The expert bank file: ``rows`` packed rows of ``row_bytes`` bytes (the manifest's ``layout``)."""

    file: str
    rows: NonNegativeInt
    row_bytes: PositiveInt
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
    format_version: Literal[2]
    model_type: str
    architecture: str
    created: str
    edgemoe_version: str
    alignment: Literal[4096]
    experts: Experts
    layout: dict[str, Any]
    bank: Bank
    non_expert: NonExpert
    files: list[str]
    source: Source | None

    @field_validator("source", mode="before")
    @classmethod
    def _no_source(cls, source):  # an empty object: what writers before the schema wrote for "none"
        return None if source == {} else source

    def expert_layout(self, path: Path) -> ExpertLayout:
        """The bank's row layout.

        Raises:
            FTWError: a layout this edgemoe does not build (the manifest ``path`` named).
        """
        try:
            return ExpertLayout.from_json(self.layout)
        except LayoutError as e:
            raise FTWError(f"{path}: manifest field layout: {e}") from None


def is_ftw(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds an FTW manifest (``ftw.json``)."""
    return (Path(model_dir) / MANIFEST).is_file()


def read_manifest(model_dir: str | Path) -> Manifest:
    """Parse and validate ``model_dir/ftw.json``.

    Raises:
        FTWError: a missing or unparsable manifest, or one that does not follow the schema (the first
            offending field named), or an expert layout this edgemoe does not build.
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
    version = raw.get("format_version")
    if version == 1 and not isinstance(version, bool):
        raise FTWVersionError(f"{path}: FTW format version 1 (two float banks experts.w13.bin / experts.w2.bin); this "
                              f"edgemoe reads version {FORMAT_VERSION} (one bank of packed expert rows, any format): "
                              "re-run `edgemoe convert` on the Hugging Face checkpoint")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise FTWVersionError(f"{path}: FTW format version {version!r}; this edgemoe reads version "
                              f"{FORMAT_VERSION}: re-run `edgemoe convert` on the Hugging Face checkpoint")
    try:
        man = Manifest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise FTWError(f"{path}: manifest field {where}: {err['msg']}{more}") from None
    man.expert_layout(path)
    return man


def check_config(man: Manifest, cfg, model_dir: str | Path) -> ExpertLayout:
    """Check that ``cfg`` (the :class:`~edgemoe.config.ModelConfig` of ``model_dir/config.json``)
    describes the bank of ``man``; return the bank's row layout.

    Raises:
        FTWConfigError: another model type, expert geometry or row layout (both values named), or expert
            biases in the rows but not in the config (or the reverse).
        FTWError: a layout this edgemoe does not build.
    """
    model_dir = Path(model_dir)
    where = f"{model_dir / 'config.json'} disagrees with {model_dir / MANIFEST}"
    if man.model_type != cfg.model_type:
        raise FTWConfigError(f"{where}: model_type {cfg.model_type!r} vs {man.model_type!r}")
    geometry = ExpertGeometry.from_config(cfg)
    for k in ("num_moe_layers", "num_experts", "hidden_size", "moe_intermediate_size"):
        v, got = getattr(geometry, k), getattr(man.experts, k)
        if got != v:
            raise FTWConfigError(f"{where}: {k} {v} in config.json, {got} in the banks")
    layout = man.expert_layout(model_dir / MANIFEST)
    if (layout.hidden, layout.intermediate) != (geometry.hidden_size, geometry.moe_intermediate_size):
        raise FTWConfigError(f"{where}: the bank's rows are H={layout.hidden} I={layout.intermediate}, config.json "
                             f"implies H={geometry.hidden_size} I={geometry.moe_intermediate_size}")
    if layout.has_bias != geometry.bias:
        raise FTWConfigError(f"{where}: the bank's rows {'have' if layout.has_bias else 'lack'} expert biases, "
                             f"config.json's experts {'have' if geometry.bias else 'have none'}")
    if man.bank.rows != geometry.num_rows or man.bank.row_bytes != layout.row_bytes:
        raise FTWConfigError(f"{where}: bank {man.bank.file} has {man.bank.rows} rows of {man.bank.row_bytes} bytes, "
                             f"config.json and the layout imply {geometry.num_rows} rows of {layout.row_bytes}")
    return layout


@dataclass
class BankSource:
    """The expert bank on disk, as the manifest describes it.

    Attributes:
        path: the bank file.
        rows: ``N`` rows (flat expert ids ``moe_layer * E + expert``).
        layout: the rows' :class:`~edgemoe.quant.layout.ExpertLayout` (``row_bytes`` apart, from byte 0).
        chunk_bytes: bytes per checksum chunk, a multiple of ``row_bytes`` (the last chunk may be shorter).
        crcs: ``zlib.crc32`` of each chunk (``None``: nothing to verify against).
        rows_per_layer: ``E``, only used to name MoE layers in error messages.
        target: the layout of the destination rows in memory when it differs from ``layout`` (float rows
            of another dtype: the reader casts section by section); ``None``: the same bytes.
        offset: always 0 (the reader treats banks and files alike).
    """

    path: Path
    rows: int
    layout: ExpertLayout
    chunk_bytes: int
    crcs: list[int] | None = None
    rows_per_layer: int | None = None
    target: ExpertLayout | None = None
    offset: int = 0

    @property
    def dest_layout(self) -> ExpertLayout:
        """The layout of the rows in memory."""
        return self.target or self.layout

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of rows on disk (padding included)."""
        return self.rows * self.row_bytes

    @property
    def num_chunks(self) -> int:
        return -(-self.nbytes // self.chunk_bytes) if self.nbytes else 0

    def chunk_range(self, k: int) -> tuple[int, int]:
        """``[start, end)`` byte range of chunk ``k``."""
        return k * self.chunk_bytes, min((k + 1) * self.chunk_bytes, self.nbytes)

    def describe_rows(self, start: int, end: int) -> str:
        r0, r1 = start // self.row_bytes, -(-end // self.row_bytes) - 1
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


def bank_source(man: Manifest, model_dir: str | Path) -> BankSource:
    """The manifest's bank as a :class:`BankSource`, after checking its file's size.

    Raises:
        FTWTruncatedError: the bank file missing, shorter or longer than ``N * row_bytes``.
        FTWError: an inconsistent bank entry (row size, chunking) or layout.
    """
    model_dir = Path(model_dir)
    b = man.bank
    layout = man.expert_layout(model_dir / MANIFEST)
    path = model_dir / b.file
    src = BankSource(path, b.rows, layout, b.checksum.chunk_bytes, list(b.checksum.chunks),
                     rows_per_layer=man.experts.num_experts)
    if (b.row_bytes != layout.row_bytes or src.chunk_bytes % src.row_bytes or len(src.crcs) != src.num_chunks
            or b.nbytes != src.nbytes):
        raise FTWError(f"{model_dir / MANIFEST}: bank: inconsistent row_bytes/chunking (rows {b.rows}, row_bytes "
                       f"{b.row_bytes}, layout row_bytes {layout.row_bytes}, nbytes {b.nbytes}, chunk_bytes "
                       f"{src.chunk_bytes}, {len(src.crcs)} checksums for {src.num_chunks} chunks)")
    size = _file_size(path, "expert bank file")
    if size != src.nbytes:
        what = "truncated" if size < src.nbytes else "longer than the manifest says"
        raise FTWTruncatedError(f"{path}: bank file is {what}: {size} bytes, expected {src.nbytes} "
                                f"({src.rows} rows x {src.row_bytes} bytes)")
    return src


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
