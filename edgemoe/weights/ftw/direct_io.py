"""Parallel direct-I/O reads of FTW banks and files into their final host buffers, verified per chunk.

The reader splits every bank into its checksum chunks (a whole number of rows, a multiple of 4 KiB;
see :mod:`edgemoe.weights.ftw.spec` for the format) and hands the chunks of all banks to one pool of
worker threads. Each worker ``preadv``\\ s a chunk and, when verification is on, checksums it
(``zlib.crc32``) while other workers' reads are in flight; both calls release the GIL.

Two routes, chosen per bank:

- **zero-copy** (preferred): the destination bank is page-aligned and contiguous and holds the file's
  row layout. Chunks are read straight into the destination's memory with ``O_DIRECT`` (no page
  cache, no copy).
- **staging**: otherwise (float rows cast to another dtype, an unaligned destination) each worker
  reads into its own page-aligned staging buffer and copies (casting, section by section) the rows
  into the destination.

``O_DIRECT`` is refused by some filesystems (``EINVAL`` at open or at the first read); the reader then
falls back to buffered reads for that file and records it in :class:`ReadStats`.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgemoe.weights.ftw.spec import ALIGN, BankSource, FileSource, FTWChecksumError, FTWTruncatedError

log = logging.getLogger(__name__)

__all__ = ["ReadStats", "default_workers", "read_banks", "tensor_bytes"]


@dataclass
class ReadStats:
    """What one :func:`read_banks` call did.

    Attributes:
        bytes: bytes read from disk (padding included).
        seconds: wall time of the whole read (all banks).
        direct: every file was read with ``O_DIRECT``.
        zero_copy: every bank was read straight into its destination (no staging copy).
        verified: every chunk's crc32 was checked.
        workers: reader threads.
        fallbacks: files where ``O_DIRECT`` was refused, with the reason.
    """

    bytes: int = 0  # all jobs (expert banks and raw files)
    seconds: float = 0.0
    direct: bool = True
    zero_copy: bool = True
    verified: bool = False
    workers: int = 0
    fallbacks: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """Read throughput in GB/s (1e9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def default_workers() -> int:
    """Reader threads: one per core, at least 8 (requests in flight for the disk's queue), at most 16."""
    return max(8, min(16, os.cpu_count() or 8))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy).

    Raises:
        ValueError: a non-contiguous or non-CPU tensor.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(nbytes, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class _File:
    """A bank file opened for direct I/O when the filesystem allows it, else buffered."""

    def __init__(self, path: Path, direct: bool):
        self.path = path
        self.fd_direct: int | None = None
        self.fallback: str | None = None
        self._lock = threading.Lock()
        self.fd_buffered = os.open(path, os.O_RDONLY)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd_direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                self.fallback = f"{path.name}: O_DIRECT refused at open ({e.strerror}); buffered reads"
        elif direct:
            self.fallback = f"{path.name}: O_DIRECT not available on this OS; buffered reads"
        if self.fd_direct is None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd_buffered, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def pread_into(self, buf: memoryview, offset: int, need: int | None = None) -> None:
        """Read ``buf`` from ``offset``, at least ``need`` bytes (default ``len(buf)``: an aligned
        ``buf`` may reach past the end of the file); direct when possible, buffered after a refusal.

        Raises:
            FTWTruncatedError: end of file before ``need`` bytes.
        """
        need = len(buf) if need is None else need
        fd = self.fd_direct
        if fd is not None:
            try:
                self._read_full(fd, buf, offset, need)
                return
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                with self._lock:
                    if self.fd_direct is not None:
                        self.fallback = f"{self.path.name}: O_DIRECT read refused ({e.strerror}); buffered reads"
                        os.close(self.fd_direct)
                        self.fd_direct = None
        self._read_full(self.fd_buffered, buf, offset, need)

    def _read_full(self, fd: int, buf: memoryview, offset: int, need: int) -> None:
        got = 0
        while got < need:
            n = os.preadv(fd, [buf[got:]], offset + got)
            if n == 0:
                raise FTWTruncatedError(f"{self.path}: truncated: end of file at byte {offset + got}, "
                                        f"expected at least {offset + need} bytes")
            got += n

    def close(self) -> None:
        for fd in (self.fd_direct, self.fd_buffered):
            if fd is not None:
                os.close(fd)
        self.fd_direct = None


def _zero_copy_ok(src: BankSource | FileSource, dest: torch.Tensor) -> bool:
    if isinstance(src, FileSource):
        return True
    return (dest.device.type == "cpu" and dest.is_contiguous() and src.dest_layout == src.layout
            and dest.data_ptr() % ALIGN == 0 and src.offset % ALIGN == 0 and src.chunk_bytes % ALIGN == 0)


def _check_destination(src: BankSource | FileSource, dest: torch.Tensor) -> None:
    """Raise ``ValueError`` when ``dest`` does not fit ``src``: uint8 ``[rows, row_bytes]`` of the
    destination layout for a bank; a page-aligned contiguous CPU ``uint8`` tensor of at least ``nbytes``
    rounded up to :data:`ALIGN` for a file."""
    if isinstance(src, FileSource):
        if (dest.dtype != torch.uint8 or dest.device.type != "cpu" or not dest.is_contiguous()
                or dest.data_ptr() % ALIGN or dest.numel() < -(-src.nbytes // ALIGN) * ALIGN):
            raise ValueError(f"{src.path.name}: a file is read into a page-aligned uint8 CPU buffer of "
                             f">= {-(-src.nbytes // ALIGN) * ALIGN} bytes")
        return
    want = (src.rows, src.dest_layout.row_bytes)
    if dest.dtype != torch.uint8 or tuple(dest.shape) != want:
        raise ValueError(f"{src.path.name}: destination {dest.dtype} {tuple(dest.shape)} is not a uint8 bank of "
                         f"shape {want}")
    if src.target is not None and not (src.layout.format.dense and src.target.format.dense):
        raise ValueError(f"{src.path.name}: {src.layout.format.value} rows cannot be cast to "
                         f"{src.target.format.value} rows (only float rows change dtype)")


def read_banks(jobs: list[tuple[BankSource | FileSource, torch.Tensor]], *, workers: int | None = None,
               direct: bool = True, verify: bool = True, staging: bool = False, progress: bool = False,
               on_job_done: Callable[[int], None] | None = None) -> ReadStats:
    """Read each source of ``jobs`` into its destination tensor, in parallel, verifying crc32 per chunk.

    Chunks are issued in job order (put a job first to have it complete first).

    Args:
        jobs: ``(source, dest)`` pairs. A bank's ``dest`` is a uint8 ``[rows, row_bytes]`` CPU bank of the
            source's ``dest_layout`` (float rows of another dtype are cast through the staging route); a
            file's is a page-aligned ``uint8`` buffer (at least ``nbytes`` rounded up to
            :data:`~edgemoe.weights.ftw.spec.ALIGN`).
        workers: reader threads (default :func:`default_workers`).
        direct: try ``O_DIRECT`` (falls back to buffered reads where refused).
        verify: compare each chunk's crc32 with ``source.crcs`` (skipped for sources without crcs).
        staging: force the staging route for banks even where zero-copy is possible (for benchmarks).
        progress: a tqdm bar over bytes.
        on_job_done: called with a job's index, from a reader thread, once all its chunks are in
            (and verified).

    Returns:
        :class:`ReadStats`. On error no worker is still writing when this returns.

    Raises:
        FTWTruncatedError: a file shorter than its rows.
        FTWChecksumError: a chunk whose crc32 differs (file, byte range, rows and MoE layers named).
        ValueError: a destination of the wrong shape.
        OSError: an I/O error other than a direct-I/O refusal.
    """
    for src, dest in jobs:
        _check_destination(src, dest)
    workers = workers or default_workers()
    stats = ReadStats(workers=workers, verified=verify and all(s.crcs is not None for s, _ in jobs))
    files = [_File(src.path, direct) for src, _ in jobs]
    routes = [(not staging) and _zero_copy_ok(src, dest) for src, dest in jobs]
    stats.zero_copy = all(routes)
    dest_bytes = [tensor_bytes(dest) if zc else None for (_, dest), zc in zip(jobs, routes)]
    max_chunk = max((src.chunk_bytes for (src, _), zc in zip(jobs, routes) if not zc), default=0)
    local = threading.local()
    bar_lock = threading.Lock()
    bar = None
    total = sum(src.nbytes for src, _ in jobs)
    remaining = [src.num_chunks for src, _ in jobs]
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="weights", unit="B", unit_scale=True, leave=False)

    def staging_buffer() -> memoryview:
        buf = getattr(local, "buf", None)
        if buf is None:
            local.mm = _aligned_buffer(max_chunk)
            buf = local.buf = memoryview(local.mm)
        return buf

    def read_chunk(b: int, k: int) -> None:
        src, dest = jobs[b]
        start, end = src.chunk_range(k)
        padded = -(-(end - start) // ALIGN) * ALIGN  # O_DIRECT lengths are whole pages
        view = dest_bytes[b][start:start + padded] if routes[b] else staging_buffer()[:padded]
        files[b].pread_into(view, src.offset + start, end - start)
        view = view[: end - start]
        if verify and src.crcs is not None:
            crc = zlib.crc32(view)
            if crc != src.crcs[k]:
                raise FTWChecksumError(
                    f"{src.path}: checksum mismatch in bytes [{src.offset + start}, {src.offset + end}) "
                    f"(chunk {k}, {src.describe_rows(start, end)}): crc32 {crc:#010x}, manifest says "
                    f"{src.crcs[k]:#010x}; the file is corrupt: re-run `edgemoe convert`")
        if not routes[b]:  # staged bank rows: copy, casting float sections to the destination's dtype
            r0, n = start // src.row_bytes, (end - start) // src.row_bytes
            rows = torch.frombuffer(view, dtype=torch.uint8, count=n * src.row_bytes).view(n, src.row_bytes)
            if src.target is None:
                dest[r0:r0 + n].copy_(rows)
            else:
                for sec in src.layout.sections:
                    src.target.view(dest[r0:r0 + n], sec.name).copy_(src.layout.view(rows, sec.name))
        with bar_lock:
            if bar is not None:
                bar.update(end - start)
            remaining[b] -= 1
            last = remaining[b] == 0
        if last and on_job_done is not None:
            on_job_done(b)

    tasks = [(b, k) for b, (src, _) in enumerate(jobs) for k in range(src.num_chunks)]
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="ftw-read") as ex:
            futures = [ex.submit(read_chunk, b, k) for b, k in tasks]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception()), None)
            if failed is not None:
                for f in futures:
                    f.cancel()
                ex.shutdown(wait=True, cancel_futures=True)
                raise failed.exception()
    finally:
        stats.seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        for f in files:
            if f.fallback:
                stats.fallbacks.append(f.fallback)
            f.close()
    stats.bytes = total
    stats.direct = direct and not stats.fallbacks
    for msg in stats.fallbacks:
        log.info("%s", msg)
    return stats
