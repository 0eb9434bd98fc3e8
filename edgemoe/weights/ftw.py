"""FTW: edgemoe's pre-merged weight format (expert banks + manifest) — writer, reader and the spec.

``edgemoe convert HF_DIR OUT_DIR`` turns a Hugging Face checkpoint into an FTW directory that the
engine bootstraps with parallel direct I/O straight into the host expert pool (DESIGN.md §5). An FTW
directory is self-contained: it serves with ``edgemoe serve OUT_DIR`` like the HF one.

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

Manifest (``ftw.json``), a JSON object::

    format          "edgemoe-ftw"
    format_version  1 (a reader refuses any other version)
    model_type, architecture          from config.json
    created, edgemoe_version          when and by which edgemoe the directory was written
    alignment       4096
    experts         {num_moe_layers, num_experts, moe_layers, hidden_size, moe_intermediate_size, num_rows}
    banks           {"w13": BANK, "w2": BANK}, BANK = {file, dtype ("bfloat16" | "float16" |
                    "float32"), shape [N, *row_shape], offset, row_bytes, row_stride, nbytes (file size),
                    checksum {algorithm "crc32", chunk_bytes, chunks [int, ...]}}
    non_expert      {file, nbytes, num_tensors, checksum {...}}
    files           names of the copied config/tokenizer/generation files
    source          {path, fingerprint ("sha256:" of config.json and every weight file's name, size and
                    safetensors header), files [{name, bytes}]}

Atomicity. ``convert`` writes into ``OUT_DIR.partial-<pid>`` beside ``OUT_DIR``, fsyncs the data,
writes the manifest last and renames the directory into place. A killed convert leaves only a
``*.partial-<pid>`` directory (removed by the next convert once that process is gone); a directory
without ``ftw.json`` is never taken for FTW.

Loading (:func:`load_ftw`) checks the manifest's version and geometry against ``config.json`` and
every file's size before reading a byte, then reads ``non_expert.safetensors`` and both banks with one
pool of direct-I/O readers (``edgemoe.weights.bootstrap``), verifying every chunk's crc32 as it
arrives; the non-expert tensors are copied into the model while the banks are still being read. Any failure raises
an :class:`FTWError` (a :class:`~edgemoe.weights.loader.CheckpointError`) naming the file and the
problem; the runner then does not exist, so nothing is half-loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgemoe.config import ModelConfig, parse_dtype
from edgemoe.weights.bootstrap import (
    ALIGN,
    BankSource,
    FileSource,
    FTWChecksumError,
    FTWError,
    FTWTruncatedError,
    ReadStats,
    crc32_file,
    read_banks,
    tensor_bytes,
)
from edgemoe.weights.loader import CheckpointError, _check, checkpoint_files

log = logging.getLogger(__name__)

__all__ = [
    "BANK_FILES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "NON_EXPERT_FILE",
    "FTWChecksumError",
    "FTWConfigError",
    "FTWError",
    "FTWLoadStats",
    "FTWTruncatedError",
    "FTWVersionError",
    "FTWWriter",
    "convert",
    "is_ftw",
    "load_ftw",
    "read_manifest",
    "register_cli",
]

FORMAT = "edgemoe-ftw"
FORMAT_VERSION = 1
MANIFEST = "ftw.json"
NON_EXPERT_FILE = "non_expert.safetensors"
BANK_FILES = {"w13": "experts.w13.bin", "w2": "experts.w2.bin"}
DEFAULT_CHUNK_BYTES = 16 << 20
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"}
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}  # floating


class FTWVersionError(FTWError):
    """A manifest of another format or format version."""


class FTWConfigError(FTWError):
    """``config.json`` disagrees with the manifest's banks (model type, expert count or shapes)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def _chunk_bytes_for(row_stride: int, target: int | None = None) -> int:
    return row_stride * max(1, round((target or DEFAULT_CHUNK_BYTES) / row_stride))


def bank_row_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Row shape of each bank for ``cfg``: ``w13 (2I, H)``, ``w2 (H, I)``."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    return {"w13": (2 * I, H), "w2": (H, I)}


def is_ftw(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds an FTW manifest (``ftw.json``)."""
    return (Path(model_dir) / MANIFEST).is_file()


# ---------------------------------------------------------------------------------------- reading


def read_manifest(model_dir: str | Path) -> dict[str, Any]:
    """Parse and check ``model_dir/ftw.json``.

    Raises:
        FTWError: missing or unparsable manifest, or missing fields.
        FTWVersionError: another format or format version.
    """
    path = Path(model_dir) / MANIFEST
    try:
        man = json.loads(path.read_text())
    except FileNotFoundError:
        raise FTWError(f"{path}: no FTW manifest") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FTWError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise FTWVersionError(f"{path}: not an edgemoe FTW manifest (format {man.get('format') if isinstance(man, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    if man.get("format_version") != FORMAT_VERSION:
        raise FTWVersionError(f"{path}: FTW format version {man.get('format_version')!r}; this edgemoe reads version "
                              f"{FORMAT_VERSION}: re-run `edgemoe convert` on the Hugging Face checkpoint")
    for key in ("banks", "experts", "non_expert", "model_type"):
        if key not in man:
            raise FTWError(f"{path}: manifest lacks {key!r}")
    for name in BANK_FILES:
        if name not in man["banks"]:
            raise FTWError(f"{path}: manifest lacks bank {name!r}")
    return man


def _check_config(man: dict, cfg: ModelConfig, model_dir: Path) -> None:
    where = f"{model_dir / 'config.json'} disagrees with {model_dir / MANIFEST}"
    if man["model_type"] != cfg.model_type:
        raise FTWConfigError(f"{where}: model_type {cfg.model_type!r} vs {man['model_type']!r}")
    ex = man["experts"]
    want = {"num_moe_layers": cfg.num_moe_layers, "num_experts": cfg.num_experts, "hidden_size": cfg.hidden_size,
            "moe_intermediate_size": cfg.moe_intermediate_size}
    for k, v in want.items():
        if ex.get(k) != v:
            raise FTWConfigError(f"{where}: {k} {v} in config.json, {ex.get(k)} in the banks")
    n = cfg.num_moe_layers * cfg.num_experts
    for name, row_shape in bank_row_shapes(cfg).items():
        shape = tuple(man["banks"][name]["shape"])
        if shape != (n, *row_shape):
            raise FTWConfigError(f"{where}: bank {name} ({man['banks'][name]['file']}) has shape {list(shape)}, "
                                 f"config.json implies {[n, *row_shape]}")


def bank_sources(man: dict, model_dir: str | Path) -> dict[str, BankSource]:
    """The manifest's banks as :class:`BankSource` s, after checking each file's size.

    Raises:
        FTWTruncatedError: a bank file missing, shorter or longer than ``offset + N * row_stride``.
        FTWError: an inconsistent bank entry (stride, alignment, chunking, dtype).
    """
    model_dir = Path(model_dir)
    out = {}
    E = man["experts"].get("num_experts")
    for name, b in man["banks"].items():
        path = model_dir / b["file"]
        try:
            dtype = parse_dtype(b["dtype"])
            shape = tuple(int(d) for d in b["shape"])
            src = BankSource(path, int(b["offset"]), shape[0], shape[1:], dtype, int(b["row_stride"]),
                             int(b["checksum"]["chunk_bytes"]), [int(c) for c in b["checksum"]["chunks"]],
                             rows_per_layer=E)
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise FTWError(f"{model_dir / MANIFEST}: bank {name}: invalid entry ({e!r})") from None
        if (src.row_stride < src.row_bytes or src.row_stride % ALIGN or src.offset % ALIGN
                or src.chunk_bytes % src.row_stride or len(src.crcs) != src.num_chunks):
            raise FTWError(f"{model_dir / MANIFEST}: bank {name}: inconsistent row_stride/offset/chunking "
                           f"(row_bytes {src.row_bytes}, row_stride {src.row_stride}, offset {src.offset}, "
                           f"chunk_bytes {src.chunk_bytes}, {len(src.crcs)} checksums for {src.num_chunks} chunks)")
        want = src.offset + src.nbytes
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise FTWTruncatedError(f"{path}: bank file {name} is missing") from None
        if size != want:
            what = "truncated" if size < want else "longer than the manifest says"
            raise FTWTruncatedError(f"{path}: bank file is {what}: {size} bytes, expected {want} "
                                    f"({src.rows} rows x {src.row_stride} bytes + offset {src.offset})")
        out[name] = src
    return out


@dataclass
class FTWLoadStats:
    """Timings of one :func:`load_ftw` (seconds; bytes; GB/s = 1e9 bytes per second).

    Attributes:
        read: the parallel read of both banks and ``non_expert.safetensors`` (all bytes, one pool).
        expert_bytes / non_expert_bytes: bytes of the banks / of the non-expert file.
        non_expert_ready_s: from the start of the read until the non-expert file was in (and verified).
        non_expert_load_s: copying the non-expert tensors into the model's parameters.
        check_s: manifest, config and size checks before the read. total_s: the whole load.
    """

    read: ReadStats
    expert_bytes: int = 0
    non_expert_bytes: int = 0
    non_expert_ready_s: float = 0.0
    non_expert_load_s: float = 0.0
    check_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict:
        r = self.read
        return {"read_bytes": r.bytes, "read_s": r.seconds, "read_gbps": r.gbps, "direct_io": r.direct,
                "zero_copy": r.zero_copy, "verified": r.verified, "workers": r.workers, "fallbacks": r.fallbacks,
                "expert_bytes": self.expert_bytes, "non_expert_bytes": self.non_expert_bytes,
                "non_expert_ready_s": self.non_expert_ready_s, "non_expert_load_s": self.non_expert_load_s,
                "check_s": self.check_s, "total_s": self.total_s}

    def describe(self) -> str:
        r = self.read
        route = ("direct I/O" if r.direct else "buffered I/O") + (", zero-copy" if r.zero_copy else ", staged")
        return (f"FTW: read {self.expert_bytes / 1e9:.2f} GB of experts + {self.non_expert_bytes / 1e9:.2f} GB "
                f"non-expert in {r.seconds:.2f} s ({r.gbps:.2f} GB/s, {route}, {r.workers} readers"
                f"{', crc32 verified' if r.verified else ''}); load done in {self.total_s:.2f} s")


_ST_ELEMENT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}


def safetensors_views(buf: torch.Tensor, nbytes: int, path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in memory (``buf``: ``uint8``, the file's ``nbytes`` bytes
    first), as views of ``buf`` without copying (a tensor whose offset is not a multiple of its element
    size is copied). Layout: 8-byte little-endian header length ``n``, ``n`` bytes of JSON
    ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data.

    Raises:
        FTWError: a malformed header or offsets outside the file (``path`` named).
    """
    try:
        n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
        if n > nbytes - 8:
            raise ValueError(f"header length {n} exceeds the file")
        header = json.loads(buf[8:8 + n].numpy().tobytes())
        out = {}
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = _ST_ELEMENT[info["dtype"]], [int(d) for d in info["shape"]]
            b, e = (int(x) for x in info["data_offsets"])
            numel = int(torch.Size(shape).numel())
            if not 0 <= b <= e <= nbytes - base or e - b != numel * torch.empty((), dtype=dtype).element_size():
                raise ValueError(f"tensor {name}: data_offsets {[b, e]} do not fit shape {shape} {info['dtype']}")
            raw = buf[base + b:base + e]
            if (base + b) % torch.empty((), dtype=dtype).element_size():
                raw = raw.clone()
            out[name] = raw.view(dtype).view(shape)
        return out
    except FTWError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise FTWError(f"{path}: not a valid safetensors file ({e})") from None


def _load_non_expert(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    """Strictly copy ``tensors`` (HF names) into ``model``'s parameters (cast to ``dtype``)."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in params:
                raise CheckpointError(f"{path.name}: unexpected tensor {name} (not a parameter of {type(model).__name__})")
            _check(name, path, t, tuple(params[name].shape))
            params[name].copy_(t.to(dtype))
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def load_ftw(model: nn.Module, pool, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
             cfg: ModelConfig, *, verify: bool | None = None, workers: int | None = None, direct: bool = True,
             progress: bool = True) -> FTWLoadStats:
    """Fill ``model`` (built on the meta device) and ``pool`` from the FTW directory ``model_dir``.

    One pool of reader threads reads ``non_expert.safetensors`` (first) and both banks with direct
    I/O: the banks straight into ``pool.w13 [N, 2I, H]`` / ``pool.w2 [N, H, I]`` (zero-copy when the
    pool has the banks' dtype, else staged and cast), the non-expert file into a page-aligned buffer
    whose tensors this thread copies into the model while the banks are still being read. Pinning is
    the caller's (after this returns: DESIGN.md §5).

    Args:
        model: an edgemoe model; its parameters may be on ``meta``.
        pool: :class:`~edgemoe.experts.pool.HostExpertPool` sized for ``cfg``.
        dtype: parameter / pool dtype (the banks' is cast when different).
        device: where non-expert parameters live.
        cfg: the normalized ``config.json`` of ``model_dir``.
        verify: check every chunk's crc32 inside the parallel readers. ``None``: on unless the
            environment sets ``EDGEMOE_FTW_VERIFY=0``. It costs CPU time (zlib.crc32, ~2 GB/s per
            core): hidden where cores are plenty for the disk's GB/s, up to 3x slower reads on 2 busy
            cores (docs/benchmarks/bootstrap.md).
        workers: reader threads; direct: try ``O_DIRECT``; progress: tqdm bar.

    Returns:
        :class:`FTWLoadStats`.

    Raises:
        FTWVersionError: another format version. FTWConfigError: config.json disagrees with the banks.
        FTWTruncatedError: a file of the wrong size. FTWChecksumError: a chunk that fails crc32.
        CheckpointError: a missing, unexpected or mis-shaped non-expert tensor (file and tensor named).
    """
    from edgemoe.experts.pool import host_empty

    t0 = time.perf_counter()
    if verify is None:
        verify = os.environ.get("EDGEMOE_FTW_VERIFY", "1").strip().lower() not in ("0", "false", "no", "off")
    model_dir = Path(model_dir)
    man = read_manifest(model_dir)
    _check_config(man, cfg, model_dir)
    sources = bank_sources(man, model_dir)
    ne = man["non_expert"]
    ne_path = model_dir / ne.get("file", NON_EXPERT_FILE)
    try:
        ne_src = FileSource(ne_path, int(ne["nbytes"]), int(ne["checksum"]["chunk_bytes"]),
                            [int(c) for c in ne["checksum"]["chunks"]])
    except (KeyError, ValueError, TypeError) as e:
        raise FTWError(f"{model_dir / MANIFEST}: non_expert: invalid entry ({e!r})") from None
    if not ne_path.is_file():
        raise FTWTruncatedError(f"{ne_path}: non-expert weights file is missing")
    if ne_path.stat().st_size != ne_src.nbytes:
        raise FTWTruncatedError(f"{ne_path}: {ne_path.stat().st_size} bytes, manifest says {ne_src.nbytes} (truncated?)")
    if ne_src.chunk_bytes % ALIGN or len(ne_src.crcs) != ne_src.num_chunks:
        raise FTWError(f"{model_dir / MANIFEST}: non_expert: inconsistent chunking")
    stats = FTWLoadStats(ReadStats(), expert_bytes=sum(s.nbytes for s in sources.values()),
                         non_expert_bytes=ne_src.nbytes, check_s=time.perf_counter() - t0)

    model.to(dtype).to_empty(device=device)
    ne_buf = host_empty((_round_up(ne_src.nbytes),), torch.uint8)
    result: dict[str, Any] = {}
    ne_ready = threading.Event()

    def job_done(i: int) -> None:
        if i == 0:
            result["non_expert_ready"] = time.perf_counter()
            ne_ready.set()

    def read() -> None:
        try:
            result["stats"] = read_banks([(ne_src, ne_buf), (sources["w13"], pool.w13), (sources["w2"], pool.w2)],
                                         workers=workers, direct=direct, verify=verify, progress=progress,
                                         on_job_done=job_done)
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e
        finally:
            ne_ready.set()

    t1 = time.perf_counter()
    reader = threading.Thread(target=read, name="ftw-banks", daemon=True)
    reader.start()
    try:
        ne_ready.wait()
        if "non_expert_ready" in result:
            stats.non_expert_ready_s = result["non_expert_ready"] - t1
            t2 = time.perf_counter()
            _load_non_expert(model, safetensors_views(ne_buf, ne_src.nbytes, ne_path), ne_path, dtype)
            stats.non_expert_load_s = time.perf_counter() - t2
    finally:
        reader.join()
        del ne_buf
    if "error" in result:
        raise result["error"]
    stats.read = result["stats"]
    stats.total_s = time.perf_counter() - t0
    log.info("%s", stats.describe())
    return stats


# ---------------------------------------------------------------------------------------- writing


class _ChunkCrc:
    """Running per-chunk crc32 of a byte stream cut into ``chunk_bytes`` chunks."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes, self.fill, self.crc, self.chunks = chunk_bytes, 0, 0, []

    def update(self, data: memoryview) -> None:
        while len(data):
            n = min(len(data), self.chunk_bytes - self.fill)
            self.crc = zlib.crc32(data[:n], self.crc)
            self.fill += n
            data = data[n:]
            if self.fill == self.chunk_bytes:
                self.chunks.append(self.crc)
                self.crc, self.fill = 0, 0

    def finish(self) -> list[int]:
        if self.fill:
            self.chunks.append(self.crc)
            self.crc, self.fill = 0, 0
        return self.chunks


class _BankWriter:
    def __init__(self, path: Path, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype):
        self.path, self.rows, self.row_shape, self.dtype = path, rows, tuple(row_shape), dtype
        self.row_bytes = int(torch.Size(row_shape).numel()) * torch.empty((), dtype=dtype).element_size()
        self.row_stride = _round_up(self.row_bytes)
        self.chunk_bytes = _chunk_bytes_for(self.row_stride)
        self.crc = _ChunkCrc(self.chunk_bytes)
        self.written = 0
        self.f = open(path, "wb")

    def write(self, rows: torch.Tensor) -> int:
        rows = rows.to(self.dtype).contiguous()
        n = rows.shape[0]
        if tuple(rows.shape[1:]) != self.row_shape:
            raise ValueError(f"{self.path.name}: rows of shape {tuple(rows.shape[1:])}, bank rows are {self.row_shape}")
        if self.written + n > self.rows:
            raise ValueError(f"{self.path.name}: more than {self.rows} rows written")
        if self.row_stride != self.row_bytes:
            padded = torch.zeros((n, self.row_stride), dtype=torch.uint8)
            padded[:, : self.row_bytes].copy_(rows.reshape(n, -1).view(torch.uint8))
            rows = padded
        data = tensor_bytes(rows)
        self.crc.update(data)
        self.f.write(data)
        self.written += n
        return len(data)

    def close(self) -> dict:
        if self.written != self.rows:
            raise ValueError(f"{self.path.name}: {self.written} of {self.rows} rows written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"file": self.path.name, "dtype": _dtype_name(self.dtype), "shape": [self.rows, *self.row_shape],
                "offset": 0, "row_bytes": self.row_bytes, "row_stride": self.row_stride,
                "nbytes": self.rows * self.row_stride,
                "checksum": {"algorithm": "crc32", "chunk_bytes": self.chunk_bytes, "chunks": self.crc.finish()}}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FTWWriter:
    """Writes one FTW directory atomically (see the module docstring for the format).

    Usage: ``with FTWWriter(out_dir, cfg, dtype) as w:`` then ``w.write_rows("w13", rows)`` /
    ``w.write_rows("w2", rows)`` in flat-id order (any batch size), ``w.write_non_expert(tensors)``,
    ``w.copy_files(src_dir)``, and ``w.finish()`` (manifest last, rename into place). Leaving the block
    without ``finish`` (an exception) removes the partial directory.

    Args:
        out_dir: final directory; must not exist (or be empty) unless ``overwrite``.
        cfg: the model's normalized config (bank geometry).
        dtype: bank dtype.
        source: recorded in the manifest (``{"path", "fingerprint", "files"}``).
        overwrite: replace an existing ``out_dir`` (only once the new one is complete).

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty, without ``overwrite``.
    """

    def __init__(self, out_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, *, source: dict | None = None,
                 overwrite: bool = False):
        self.out_dir = Path(out_dir).absolute()
        self.cfg, self.dtype, self.source, self.overwrite = cfg, dtype, source or {}, overwrite
        _check_target(self.out_dir, overwrite)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(self.out_dir)
        self.tmp = self.out_dir.parent / f"{self.out_dir.name}.partial-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        n = cfg.num_moe_layers * cfg.num_experts
        self.banks = {name: _BankWriter(self.tmp / BANK_FILES[name], n, shape, dtype)
                      for name, shape in bank_row_shapes(cfg).items()}
        self.non_expert: dict | None = None
        self.files: list[str] = []
        self.done = False

    def __enter__(self) -> "FTWWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.done:
            self.abort()

    @property
    def bank_bytes(self) -> int:
        return sum(b.rows * b.row_stride for b in self.banks.values())

    def write_rows(self, bank: str, rows: torch.Tensor) -> int:
        """Append ``rows [n, *row_shape]`` (cast to the bank dtype) to ``bank``; returns bytes written."""
        return self.banks[bank].write(rows)

    def write_non_expert(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write the non-expert tensors (HF names) to ``non_expert.safetensors``."""
        from safetensors.torch import save_file

        path = self.tmp / NON_EXPERT_FILE
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        chunk = DEFAULT_CHUNK_BYTES
        self.non_expert = {"file": NON_EXPERT_FILE, "nbytes": path.stat().st_size, "num_tensors": len(tensors),
                           "checksum": {"algorithm": "crc32", "chunk_bytes": chunk, "chunks": crc32_file(path, chunk)}}

    def copy_files(self, src_dir: str | Path, names: list[str] | None = None) -> list[str]:
        """Copy config/tokenizer/generation files: ``names``, or every top-level file of ``src_dir``
        that is not a weight file (``*.safetensors``, ``*.bin``, ...), an index or an FTW file."""
        src_dir = Path(src_dir)
        if names is None:
            names = sorted(p.name for p in src_dir.iterdir() if p.is_file() and p.suffix not in _WEIGHT_SUFFIXES
                           and not p.name.endswith(".index.json") and p.name != MANIFEST)
        for name in names:
            shutil.copyfile(src_dir / name, self.tmp / name)
            self.files.append(name)
        return names

    def finish(self) -> Path:
        """Close the banks, write the manifest last, rename into place; returns ``out_dir``.

        Raises:
            ValueError: a bank with missing rows, or no non-expert file / no config.json.
            FileExistsError: ``out_dir`` appeared meanwhile (without ``overwrite``).
        """
        banks = {name: w.close() for name, w in self.banks.items()}
        if self.non_expert is None:
            raise ValueError("FTWWriter.finish: write_non_expert was not called")
        if not (self.tmp / "config.json").is_file():
            raise ValueError("FTWWriter.finish: no config.json copied")
        from edgemoe import __version__

        cfg = self.cfg
        man = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model_type": cfg.model_type,
            "architecture": cfg.architecture,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "edgemoe_version": __version__,
            "alignment": ALIGN,
            "experts": {"num_moe_layers": cfg.num_moe_layers, "num_experts": cfg.num_experts,
                        "moe_layers": list(cfg.moe_layers), "hidden_size": cfg.hidden_size,
                        "moe_intermediate_size": cfg.moe_intermediate_size,
                        "num_rows": cfg.num_moe_layers * cfg.num_experts,
                        "row_id": "moe_layer * num_experts + expert"},
            "banks": banks,
            "non_expert": self.non_expert,
            "files": sorted(self.files),
            "source": self.source,
        }
        tmp_man = self.tmp / (MANIFEST + ".tmp")
        with open(tmp_man, "w") as f:
            json.dump(man, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_man, self.tmp / MANIFEST)
        _fsync_dir(self.tmp)
        old = None
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            if not self.overwrite:
                raise FileExistsError(f"{self.out_dir} appeared while converting (not replaced without overwrite)")
            old = self.out_dir.parent / f"{self.out_dir.name}.old-{os.getpid()}"
            os.replace(self.out_dir, old)
        elif self.out_dir.exists():
            self.out_dir.rmdir()
        os.replace(self.tmp, self.out_dir)
        _fsync_dir(self.out_dir.parent)
        self.done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out_dir

    def abort(self) -> None:
        """Close files and remove the partial directory."""
        for w in self.banks.values():
            if not w.f.closed:
                w.f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.done = True


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite / --overwrite to replace it)")


def _remove_stale_partials(out_dir: Path) -> None:
    """Remove ``OUT_DIR.partial-<pid>`` directories left by converts that were killed."""
    for p in out_dir.parent.glob(f"{out_dir.name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def source_fingerprint(hf_dir: Path, files: list[Path]) -> dict:
    """``sha256`` over config.json and each weight file's name, size and safetensors header (cheap:
    no tensor data is read)."""
    h = hashlib.sha256()
    h.update((hf_dir / "config.json").read_bytes())
    listing = []
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f.name.encode() + b"\0" + str(size).encode() + b"\0")
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                h.update(fh.read(min(n, 100 << 20)))
        listing.append({"name": f.name, "bytes": size})
    return {"path": str(hf_dir.absolute()), "fingerprint": "sha256:" + h.hexdigest(), "files": listing}


def convert(hf_dir: str | Path, out_dir: str | Path, progress: bool = True, *, dtype: str | torch.dtype | None = None,
            overwrite: bool = False) -> Path:
    """Convert the Hugging Face checkpoint ``hf_dir`` into the FTW directory ``out_dir`` (atomically).

    Every tensor is checked first (the loader's strict rules: unexpected, missing, mis-shaped or
    non-floating tensors are :class:`CheckpointError` s naming tensor and file) and nothing is written
    until the whole checkpoint matches ``config.json``. Experts are then streamed in flat-id order
    into the banks (crc32 computed while writing), the non-expert tensors go to
    ``non_expert.safetensors``, config/tokenizer/generation files are copied, and the manifest is
    written last before the directory is renamed into place.

    Args:
        hf_dir: HF checkpoint directory (config.json + safetensors, per-expert or fused expert layout).
        out_dir: the FTW directory to create.
        progress: tqdm bar over bytes written.
        dtype: bank and non-expert dtype (``"bfloat16"``, ...); ``None`` keeps the checkpoint's
            (``config.json``'s when the expert tensors mix dtypes).
        overwrite: replace an existing non-empty ``out_dir``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileNotFoundError: no config.json. ValueError: unsupported architecture, or ``hf_dir`` is
        already FTW. CheckpointError: a checkpoint that does not match its config.
        FileExistsError: ``out_dir`` exists and is not empty, without ``overwrite``.
    """
    from contextlib import ExitStack

    from safetensors import safe_open

    from edgemoe.models import load_config, model_class

    hf_dir, out = Path(hf_dir), Path(out_dir)
    if is_ftw(hf_dir):
        raise ValueError(f"{hf_dir} is already an FTW directory ({MANIFEST} present)")
    cfg = load_config(hf_dir)
    _check_target(out.absolute(), overwrite)
    where = checkpoint_files(hf_dir)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    params = {k: tuple(p.shape) for k, p in model.named_parameters()}
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    n_rows = cfg.num_moe_layers * E
    # (flat id, role) -> (file, tensor name, index into a fused [E, ...] tensor or None)
    experts: dict[tuple[int, str], tuple[Path, str, int | None]] = {}
    non_expert: dict[str, Path] = {}
    expert_dtypes: set[torch.dtype] = set()
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), "pt", device="cpu")) for f in sorted(set(where.values()))}
        for name, f in where.items():
            if name.startswith(model.skipped_prefixes):  # e.g. a vision tower: not served, not converted
                continue
            sl = handles[f].get_slice(name)
            shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
            if st_dtype not in _ST_DTYPES:
                raise CheckpointError(f"{f.name}: tensor {name} has dtype {st_dtype}, expected a floating-point dtype")
            try:
                target = model.expert_target(name)
            except ValueError as e:
                raise CheckpointError(f"{f.name}: {e}") from None
            if target is None:
                if name not in params:
                    raise CheckpointError(f"{f.name}: unexpected tensor {name} (not a parameter of {type(model).__name__})")
                if shape != params[name]:
                    raise CheckpointError(f"{f.name}: tensor {name} has shape {shape}, expected {params[name]}")
                non_expert[name] = f
                continue
            expert_dtypes.add(_ST_DTYPES[st_dtype])
            j, e, role = target
            if e is None:
                want = (E, 2 * I, H) if role == "gate_up_proj" else (E, H, I)
                if shape != want:
                    raise CheckpointError(f"{f.name}: tensor {name} has shape {shape}, expected {want}")
                for ee in range(E):
                    roles = ("gate_proj", "up_proj") if role == "gate_up_proj" else ("down_proj",)
                    for r in roles:
                        experts[(j * E + ee, r)] = (f, name, ee)
            else:
                if e >= E:
                    raise CheckpointError(f"{f.name}: tensor {name}: expert {e} >= num_experts {E}")
                want = (H, I) if role == "down_proj" else (I, H)
                if shape != want:
                    raise CheckpointError(f"{f.name}: tensor {name} has shape {shape}, expected {want}")
                experts[(j * E + e, role)] = (f, name, None)
        missing = sorted(set(params) - set(non_expert))
        if missing:
            raise CheckpointError(f"{hf_dir}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for fid in range(n_rows):
            for r in ("gate_proj", "up_proj", "down_proj"):
                if (fid, r) not in experts:
                    n_miss = sum((i, rr) not in experts for i in range(n_rows) for rr in ("gate_proj", "up_proj", "down_proj"))
                    raise CheckpointError(f"{hf_dir}: missing {n_miss} routed-expert tensor(s), first: MoE layer "
                                          f"ordinal {fid // E} expert {fid % E} {r}")
        if dtype is not None:
            bank_dtype = parse_dtype(dtype)
        elif len(expert_dtypes) == 1:
            bank_dtype = next(iter(expert_dtypes))
        else:
            bank_dtype = parse_dtype(cfg.torch_dtype)

        def fetch(fid: int, role: str) -> torch.Tensor:
            f, name, idx = experts[(fid, role)]
            if idx is None:
                return handles[f].get_tensor(name)
            t = handles[f].get_slice(name)[idx]  # [2I, H] or [H, I]
            if role == "gate_proj":
                return t[:I]
            if role == "up_proj":
                return t[I:]
            return t

        source = source_fingerprint(hf_dir, sorted(set(where.values())))
        with FTWWriter(out, cfg, bank_dtype, source=source, overwrite=overwrite) as w:
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=w.bank_bytes, desc=f"convert {hf_dir.name}", unit="B", unit_scale=True)
            try:
                for fid in range(n_rows):
                    g, u = experts[(fid, "gate_proj")], experts[(fid, "up_proj")]
                    if g[2] is not None and g == u:  # fused gate_up_proj [E, 2I, H]: the row as stored
                        row13 = handles[g[0]].get_slice(g[1])[g[2]]  # [2I, H]
                    else:
                        row13 = torch.cat([fetch(fid, "gate_proj"), fetch(fid, "up_proj")], 0)  # [2I, H]
                    nb = w.write_rows("w13", row13[None])
                    nb += w.write_rows("w2", fetch(fid, "down_proj")[None])  # [1, H, I]
                    if bar is not None:
                        bar.update(nb)
                tensors = {}
                for name, f in non_expert.items():
                    t = handles[f].get_tensor(name)
                    tensors[name] = t.to(parse_dtype(dtype)) if dtype is not None else t
                w.write_non_expert(tensors)
                del tensors
                w.copy_files(hf_dir)
                return w.finish()
            finally:
                if bar is not None:
                    bar.close()


# ---------------------------------------------------------------------------------------- CLI


def _cmd_convert(args: argparse.Namespace) -> int:
    import sys

    try:
        path = convert(args.hf_dir, args.out_dir, progress=not args.no_progress, dtype=args.dtype,
                       overwrite=args.overwrite)
    except FileExistsError as e:
        print(f"edgemoe: error: {e}", file=sys.stderr)
        return 2
    man = read_manifest(path)
    gb = sum(b["nbytes"] for b in man["banks"].values()) / 1e9
    print(f"{path}: FTW v{FORMAT_VERSION}, {man['experts']['num_rows']} experts, {gb:.2f} GB of expert banks "
          f"({man['banks']['w13']['dtype']}) + {man['non_expert']['nbytes'] / 1e9:.2f} GB non-expert")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``edgemoe convert HF_DIR OUT_DIR [--dtype D] [--overwrite] [--no-progress]`` to ``subparsers``
    (``func`` = the handler, returning the exit status)."""
    p = subparsers.add_parser("convert", help="convert a Hugging Face checkpoint to FTW (fast bootstrap)",
                              description="Write expert banks + manifest for direct-I/O bootstrap (edgemoe.weights.ftw).")
    p.add_argument("hf_dir", help="Hugging Face checkpoint directory")
    p.add_argument("out_dir", help="FTW directory to create")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="store weights in this dtype (default: the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)
    return p
