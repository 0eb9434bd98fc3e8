"""How the native executor cuts a call into chunks never changes its result.

A call's two phases (gate/up rows per expert, then down rows of every expert) are cut into chunks that the pool's
threads take in turn: four per thread by rows, or fewer where chunks would hold less than ``min_chunk_bytes`` of
weights. For every row format (bf16, FP8 block, MXFP4, NVFP4; quantized rows computing in float32 and bfloat16) and
every ISA level this CPU runs, shapes whose chunks are not multiples of 16 rows of themselves (the rule rounds them
up), calls of 1-5 experts with every second one given no tokens, and floors that leave the rule four chunks per
thread, fewer, or one: 2 and 3 threads give bit for bit what 1 thread (one chunk per phase) gives.

Skipped as a whole, with the reason, when the extension cannot be built here.
"""

from __future__ import annotations

import pytest
import torch

from edgemoe.experts import native
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

try:
    native.load_extension()
    UNAVAILABLE = None
except native.NativeUnavailable as e:
    UNAVAILABLE = str(e)

pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"native CPU extension unavailable: {UNAVAILABLE}")

FORMATS = {"bf16": None, "fp8": WeightFormat.FP8_BLOCK, "mxfp4": WeightFormat.MXFP4, "nvfp4": WeightFormat.NVFP4}
SHAPES = [(224, 800), (1056, 352)]  # (H, I): 4 chunks a thread of either phase is not a whole number of 16 rows
FLOORS = [0, 8 * 1024, native.DEFAULT_MIN_CHUNK_BYTES]  # by rows only; fewer chunks a thread; one chunk a thread
_executors: dict = {}


def _pool(fmt: str, H: int, I: int, compute: torch.dtype) -> HostExpertPool:
    if FORMATS[fmt] is None:
        pool = HostExpertPool.dense(6, H, I, torch.bfloat16)
    else:
        pool = HostExpertPool(6, ExpertLayout.build(FORMATS[fmt], H, I), compute)
    pool.fill_random(seed=5, std=0.05)
    return pool


def _executor(pool: HostExpertPool, isa: str, threads: int, floor: int) -> native.NativeCpuExecutor:
    key = (isa, threads, floor)
    if key not in _executors:
        _executors[key] = native.NativeCpuExecutor(pool, threads, isa=isa, min_parallel_bytes=0, min_chunk_bytes=floor,
                                                   max_tokens_per_expert=1 << 30, oversubscribe=True)
    return _executors[key].with_pool(pool)


@pytest.mark.parametrize("floor", FLOORS)
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_chunking_gives_the_one_thread_result(fmt, shape, compute, floor):
    compute = getattr(torch, compute)
    if FORMATS[fmt] is None and compute == torch.float32:
        pytest.skip("a dense bf16 pool computes in bfloat16")
    H, I = shape
    pool = _pool(fmt, H, I, compute)
    isas = native.supported_isas(FORMATS[fmt], compute) if FORMATS[fmt] else native.supported_isas(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for isa in isas:
        for T in (1, 3):
            x = torch.randn(T, H, generator=g)  # [T, H] float32
            for n_experts in (1, 3, 5):
                work = [(e, torch.arange(0 if e % 2 else T), torch.rand(0 if e % 2 else T, generator=g) + 0.1)
                        for e in range(n_experts)]  # every second expert routed no token
                outs = []
                for threads in (1, 2, 3):
                    out = torch.zeros(T, H)
                    _executor(pool, isa, threads, floor).run(x, work, out)
                    outs.append(out)
                for threads, out in zip((2, 3), outs[1:]):
                    assert torch.equal(outs[0], out), (isa, T, n_experts, threads)
