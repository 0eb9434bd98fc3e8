"""Shared pieces of the native CPU executor's tests: whether the extension builds here (``needs_native``
skips a module or test with the build's own reason), one executor per (ISA cap, threads, chunk size)
rebound to each test's pool, and random routed work."""

from __future__ import annotations

import pytest
import torch

from edgemoe.experts import native
from edgemoe.experts.pool import HostExpertPool

try:
    native.load_extension()
    UNAVAILABLE = None
except native.NativeUnavailable as e:
    UNAVAILABLE = str(e)

needs_native = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"native CPU extension unavailable: {UNAVAILABLE}")

_executors: dict = {}


def native_executor(pool: HostExpertPool, isa: str, threads: int, min_chunk_bytes: int = 0) -> native.NativeCpuExecutor:
    """The executor of ``threads`` threads capped at ``isa`` (one thread pool per cap, thread count and chunk size,
    kept for the session), bound to ``pool``; every call parallelizes (no size thresholds) and may oversubscribe."""
    key = (isa, threads, min_chunk_bytes)
    if key not in _executors:
        _executors[key] = native.NativeCpuExecutor(pool, threads, isa=isa, min_parallel_bytes=0,
                                                   min_chunk_bytes=min_chunk_bytes, max_tokens_per_expert=1 << 30,
                                                   oversubscribe=True)
    return _executors[key].with_pool(pool)


def random_work(T: int, num_ids: int, seed: int, k: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Each of ``T`` tokens routed to ``min(k, num_ids)`` distinct experts with weights in [0.1, 1.1), grouped
    per expert in random order: ``[(flat expert id, token indices int64, weights float32)]``."""
    g = torch.Generator().manual_seed(seed)
    k = min(k, num_ids)
    ids = torch.stack([torch.randperm(num_ids, generator=g)[:k] for _ in range(T)])  # [T, k]
    w = torch.rand(T, k, generator=g) + 0.1
    work = []
    for fid in torch.randperm(num_ids, generator=g).tolist():
        tok, kpos = (ids == fid).nonzero(as_tuple=True)
        if tok.numel():
            work.append((fid, tok, w[tok, kpos]))
    return work
