"""Writing an FTW directory atomically (the format: :mod:`edgemoe.weights.ftw.spec`)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import zlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

import torch

from edgemoe.quant.layout import ExpertLayout
from edgemoe.weights.ftw.direct_io import tensor_bytes
from edgemoe.weights.ftw.spec import ALIGN, BANK_FILE, FORMAT, FORMAT_VERSION, MANIFEST, NON_EXPERT_FILE, Manifest
from edgemoe.weights.index import ExpertGeometry

__all__ = ["DEFAULT_CHUNK_BYTES", "FTWWriter", "check_target"]

DEFAULT_CHUNK_BYTES = 16 << 20  # target bytes per checksum chunk
# Files `copy_files` leaves out: weights in any format.
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"}


def _round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


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


def _crc32_file(path: Path, chunk_bytes: int) -> list[int]:
    """``zlib.crc32`` of each ``chunk_bytes`` chunk of the file ``path`` (the writer's pass over a file
    it just wrote)."""
    out = []
    mv = memoryview(bytearray(chunk_bytes))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(mv):
            out.append(zlib.crc32(mv[:n]))
    return out


class _BankWriter:
    def __init__(self, path: Path, rows: int, layout: ExpertLayout, chunk_target: int):
        self.path, self.rows, self.row_bytes = path, rows, layout.row_bytes
        self.chunk_bytes = self.row_bytes * max(1, round(chunk_target / self.row_bytes))  # whole rows
        self.crc = _ChunkCrc(self.chunk_bytes)
        self.written = 0
        self.f = open(path, "wb")

    def write(self, rows: torch.Tensor) -> int:
        n = rows.shape[0]
        if rows.dtype != torch.uint8 or tuple(rows.shape[1:]) != (self.row_bytes,):
            raise ValueError(f"{self.path.name}: rows must be uint8 [n, {self.row_bytes}], got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        if self.written + n > self.rows:
            raise ValueError(f"{self.path.name}: more than {self.rows} rows written")
        data = tensor_bytes(rows.contiguous())
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
        return {"file": self.path.name, "rows": self.rows, "row_bytes": self.row_bytes,
                "nbytes": self.rows * self.row_bytes,
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
    """Writes one FTW directory atomically.

    Usage: ``with FTWWriter(out_dir, cfg, layout) as w:`` then ``w.write_rows(rows)`` (packed rows in
    flat-id order, any batch size), ``w.write_non_expert(tensors)``, ``w.copy_files(src_dir)``, and
    ``w.finish()`` (manifest last, rename into place). Leaving the block without ``finish`` (an
    exception) removes the partial directory.

    Args:
        out_dir: final directory; must not exist (or be empty) unless ``overwrite``.
        cfg: the model's :class:`~edgemoe.config.ModelConfig` (model type, architecture, bank geometry).
        layout: the rows' :class:`~edgemoe.quant.layout.ExpertLayout` (any format).
        source: recorded in the manifest (``{"path", "fingerprint", "files"}``; ``None``: not converted
            from a Hugging Face directory).
        overwrite: replace an existing ``out_dir`` (only once the new one is complete).
        chunk_bytes: target bytes per checksum chunk (rounded to whole bank rows; default 16 MiB).

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty, without ``overwrite``.
    """

    def __init__(self, out_dir: str | Path, cfg, layout: ExpertLayout, *, source: dict | None = None,
                 overwrite: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.out_dir = Path(out_dir).absolute()
        self.cfg, self.layout, self.source, self.overwrite = cfg, layout, source, overwrite
        self.chunk_bytes = _round_up(chunk_bytes)
        check_target(self.out_dir, overwrite)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(self.out_dir)
        self.tmp = self.out_dir.parent / f"{self.out_dir.name}.partial-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        geometry = ExpertGeometry.from_config(cfg)
        self.bank = _BankWriter(self.tmp / BANK_FILE, geometry.num_rows, layout, self.chunk_bytes)
        self.non_expert: dict | None = None
        self.files: list[str] = []
        self.done = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.done:
            self.abort()

    @property
    def bank_bytes(self) -> int:
        return self.bank.rows * self.bank.row_bytes

    def write_rows(self, rows: torch.Tensor) -> int:
        """Append packed rows (uint8 ``[n, row_bytes]``) to the bank; returns bytes written."""
        return self.bank.write(rows)

    def write_non_expert(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write the non-expert tensors (HF names) to ``non_expert.safetensors``."""
        from safetensors.torch import save_file

        path = self.tmp / NON_EXPERT_FILE
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
        # safetensors writes its file 0600; give it the bank file's mode (what open() gives under the umask), so
        # whoever may read the bank may read this too
        os.chmod(path, stat.S_IMODE((self.tmp / BANK_FILE).stat().st_mode))
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        chunk = self.chunk_bytes
        self.non_expert = {"file": NON_EXPERT_FILE, "nbytes": path.stat().st_size, "num_tensors": len(tensors),
                           "checksum": {"algorithm": "crc32", "chunk_bytes": chunk, "chunks": _crc32_file(path, chunk)}}

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
        bank = self.bank.close()
        if self.non_expert is None:
            raise ValueError("FTWWriter.finish: write_non_expert was not called")
        if not (self.tmp / "config.json").is_file():
            raise ValueError("FTWWriter.finish: no config.json copied")
        from edgemoe import __version__

        cfg = self.cfg
        man = Manifest.model_validate({
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model_type": cfg.model_type,
            "architecture": cfg.architecture,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "edgemoe_version": __version__,
            "alignment": ALIGN,
            "experts": {"num_moe_layers": cfg.num_moe_layers, "num_experts": cfg.num_experts,
                        "moe_layers": list(cfg.moe_layers), "hidden_size": cfg.hidden_size,
                        "moe_intermediate_size": cfg.moe_intermediate_size,
                        "num_rows": cfg.num_moe_layers * cfg.num_experts,
                        "row_id": "moe_layer * num_experts + expert"},
            "layout": self.layout.to_json(),
            "bank": bank,
            "non_expert": self.non_expert,
            "files": sorted(self.files),
            "source": self.source,
        })
        tmp_man = self.tmp / (MANIFEST + ".tmp")
        with open(tmp_man, "w") as f:
            json.dump(man.model_dump(mode="json"), f, indent=1)
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
        if not self.bank.f.closed:
            self.bank.f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.done = True


def check_target(out_dir: Path, overwrite: bool) -> None:
    """Raise ``FileExistsError`` unless ``out_dir`` can be written: absent, an empty directory, or ``overwrite``."""
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
