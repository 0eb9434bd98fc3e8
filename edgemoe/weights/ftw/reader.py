"""Loading an FTW directory into a meta-built model and the host expert pool."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat
from edgemoe.weights.ftw.direct_io import ReadStats, read_banks
from edgemoe.weights.ftw.spec import ALIGN, bank_source, check_config, non_expert_source, read_manifest
from edgemoe.weights.index import CheckpointIndex, TensorInfo, parse_safetensors_header

log = logging.getLogger(__name__)

__all__ = ["FTWLoadStats", "load_ftw"]


@dataclass
class FTWLoadStats:
    """Timings of one :func:`load_ftw` (seconds; bytes; GB/s = 1e9 bytes per second).

    Attributes:
        read: the parallel read of the expert bank and ``non_expert.safetensors`` (all bytes, one pool).
        expert_bytes / non_expert_bytes: bytes of the bank / of the non-expert file.
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


def _header(buf: torch.Tensor, nbytes: int, path: Path) -> dict[str, TensorInfo]:
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little") if nbytes >= 8 else 0
    return parse_safetensors_header(buf[:min(8 + n, nbytes)].numpy().tobytes(), nbytes, path)


def _view(buf: torch.Tensor, t: TensorInfo) -> torch.Tensor:
    """Tensor ``t`` of a safetensors file held in ``buf`` (``uint8``), a view without copying unless
    its offset is not a multiple of its element size."""
    raw = buf[t.start:t.end]
    if t.start % t.dtype.itemsize:
        raw = raw.clone()
    return raw.view(t.dtype).view(t.shape)


def _load_non_expert(model: nn.Module, buf: torch.Tensor, nbytes: int, path: Path) -> None:
    """Strictly copy the non-expert tensors of the safetensors file in ``buf`` (its first ``nbytes``
    bytes) into ``model`` (each cast to its parameter's dtype)."""
    plan = CheckpointIndex(path, _header(buf, nbytes, path)).check(model, experts=None)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in plan.params.items():
            params[name].copy_(_view(buf, t))  # cast to the parameter's dtype


def load_ftw(model: nn.Module, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
             cfg, *, verify: bool | None = None, workers: int | None = None, direct: bool = True,
             progress: bool = True):
    """Fill ``model`` (built on the meta device) from the FTW directory ``model_dir`` and return the host
    expert pool holding its bank.

    One pool of reader threads reads ``non_expert.safetensors`` (first) and the expert bank with
    direct I/O: the bank straight into the pool's byte bank (zero-copy: same rows; float rows of
    another dtype than ``dtype`` are staged and cast), the non-expert file into a page-aligned buffer
    whose tensors this thread copies into the model while the bank is still being read. Pinning is
    the caller's, after this returns (:func:`edgemoe.weights.bootstrap.pin_or_fallback`): pinning
    empty memory first would zero-fault every page before the reads touch it again.

    Args:
        model: an edgemoe model; its parameters may be on ``meta``.
        dtype: parameter dtype; the pool's compute dtype (float rows of another dtype are cast to it,
            quantized rows are kept and dequantize into it).
        device: where non-expert parameters live.
        cfg: the :class:`~edgemoe.config.ModelConfig` of ``model_dir/config.json``.
        verify: check every chunk's crc32 inside the parallel readers. ``None``: on unless the
            environment sets ``EDGEMOE_FTW_VERIFY=0``. It costs CPU time (zlib.crc32, ~2 GB/s per
            core): hidden where cores are plenty for the disk's GB/s, up to 3x slower reads on 2 busy
            cores (docs/benchmarks/bootstrap.md).
        workers: reader threads; direct: try ``O_DIRECT``; progress: tqdm bar.

    Returns:
        ``(pool, stats)``: the :class:`~edgemoe.experts.pool.HostExpertPool` and :class:`FTWLoadStats`.

    Raises:
        FTWVersionError: another format version. FTWError: a manifest that does not follow the schema.
        FTWConfigError: config.json disagrees with the banks. FTWTruncatedError: a file missing or of
        the wrong size. FTWChecksumError: a chunk that fails crc32. CheckpointError: a malformed
        non-expert file, or a missing, unexpected or mis-shaped non-expert tensor (file and tensor named).
    """
    from edgemoe.experts.pool import HostExpertPool, host_empty

    t0 = time.perf_counter()
    if verify is None:
        verify = os.environ.get("EDGEMOE_FTW_VERIFY", "1").strip().lower() not in ("0", "false", "no", "off")
    model_dir = Path(model_dir)
    man = read_manifest(model_dir)
    layout = check_config(man, cfg, model_dir)
    src = bank_source(man, model_dir)
    ne_src = non_expert_source(man, model_dir)
    target = layout
    if layout.format.dense and layout.format.dtype != dtype:  # float rows of another dtype: cast while reading
        target = ExpertLayout.build(WeightFormat.for_dtype(dtype), layout.hidden, layout.intermediate,
                                    has_bias=layout.has_bias)
        src = replace(src, target=target)
    pool = HostExpertPool(src.rows, target, dtype, cfg.expert_activation)
    stats = FTWLoadStats(ReadStats(), expert_bytes=src.nbytes, non_expert_bytes=ne_src.nbytes,
                         check_s=time.perf_counter() - t0)

    model.materialize(dtype, device)
    ne_buf = host_empty((-(-ne_src.nbytes // ALIGN) * ALIGN,), torch.uint8)
    result: dict[str, Any] = {}
    ne_ready = threading.Event()

    def job_done(i: int) -> None:
        if i == 0:
            result["non_expert_ready"] = time.perf_counter()
            ne_ready.set()

    def read(jobs: list) -> None:
        try:
            result["stats"] = read_banks(jobs, workers=workers, direct=direct, verify=verify, progress=progress,
                                         on_job_done=job_done)
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e
        finally:
            ne_ready.set()

    t1 = time.perf_counter()
    jobs = [(ne_src, ne_buf), (src, pool.bank)]
    reader = threading.Thread(target=read, args=(jobs,), name="ftw-banks", daemon=True)
    reader.start()
    try:
        ne_ready.wait()
        if "non_expert_ready" in result:
            stats.non_expert_ready_s = result["non_expert_ready"] - t1
            t2 = time.perf_counter()
            _load_non_expert(model, ne_buf, ne_src.nbytes, ne_src.path)
            stats.non_expert_load_s = time.perf_counter() - t2
    finally:
        reader.join()
        del ne_buf, jobs
    if "error" in result:
        raise result["error"]
    stats.read = result["stats"]
    stats.total_s = time.perf_counter() - t0
    log.info("%s", stats.describe())
    return pool, stats
