"""The CPU expert executor: computes routed experts in place from the host pool (DESIGN.md §2).

Two executors share one interface, ``run(x [T, H], work, out [T, H] float32)`` plus ``name`` and
``threads``:

- ``NativeCpuExecutor`` (``edgemoe/experts/native.py``): C++ kernels on a pinned thread pool,
  bandwidth-bound GEMVs for decode batches; the default where it builds.
- ``TorchCpuExecutor`` (here): one GEMM pair per expert with torch ops, intra-op threads set by
  ``--cpu-threads``; the fallback, and the reference the native one is tested against.

:func:`make_cpu_executor` picks one (``EngineConfig.cpu_executor``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from edgemoe.config import CPU_EXECUTORS
from edgemoe.experts.pool import HostExpertPool

log = logging.getLogger(__name__)


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One routed expert: ``down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[n, H]`` tokens routed to the expert, in the weights' dtype.
        w13: ``[2I, H]`` gate rows then up rows. w2: ``[H, I]``.

    Returns:
        ``[n, H]`` in the weights' dtype (reference: ``Qwen3MoeExperts.forward``).
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w2)  # [n, H]


class TorchCpuExecutor:
    """Runs a set of experts on the CPU with torch ops, weights read from the host pool.

    Args:
        pool: the host expert pool (source of ``w13``/``w2`` rows).
        threads: intra-op threads for the CPU branch (``None`` keeps torch's setting).
    """

    name = "torch"

    def __init__(self, pool: HostExpertPool, threads: int | None = None):
        self.pool = pool
        if threads:
            torch.set_num_threads(int(threads))
        self.threads = torch.get_num_threads()

    def with_pool(self, pool: HostExpertPool) -> "TorchCpuExecutor":
        """The same executor over another pool (e.g. a bandwidth-rotation pool); threads unchanged."""
        return TorchCpuExecutor(pool, None)

    def run(self, x: torch.Tensor, work: list[tuple[int, torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
        """Accumulate ``Σ weight · expert(x[token])`` into ``out``.

        Args:
            x: ``[T, H]`` hidden states on the CPU (any float dtype).
            work: per expert ``(flat_id, token_idx [n] int64, weight [n] float)``.
            out: ``[T, H]`` float32 CPU accumulator (added to, not overwritten).
        """
        w13, w2 = self.pool.w13, self.pool.w2
        xd = x.to(w13.dtype)
        for fid, tok, wt in work:
            y = swiglu_expert(xd.index_select(0, tok), w13[fid], w2[fid])  # [n, H]
            out.index_add_(0, tok, (y * wt.to(y.dtype)[:, None]).float())


_logged_fallbacks: set[str] = set()


def make_cpu_executor(pool: HostExpertPool, threads: int | None = None, kind: str = "auto", **native_kw):
    """The CPU expert executor for ``pool``.

    Args:
        pool: the host expert pool.
        threads: executor threads (``--cpu-threads``). ``None``: native uses one per physical core,
            torch keeps its setting. When given, torch's intra-op threads are set to it too (as the
            torch executor always did), so torch-ops work beside the native kernels follows it.
        kind: ``"auto"`` or ``"native"`` (native where it builds and supports the pool's dtype, else
            torch with a one-line warning), or ``"torch"``.
        native_kw: passed to :class:`~edgemoe.experts.native.NativeCpuExecutor` (``isa``, ``spin_us``, ...).

    Returns:
        A ``NativeCpuExecutor`` or a ``TorchCpuExecutor``. Never fails for lack of a compiler: the
        reason is logged once per process (one line) and the torch executor is returned.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in CPU_EXECUTORS:
        raise ValueError(f"cpu executor {kind!r}: choose one of {CPU_EXECUTORS}")
    if kind == "torch":
        return TorchCpuExecutor(pool, threads)
    from edgemoe.experts.native import NativeCpuExecutor, NativeUnavailable

    try:
        ex = NativeCpuExecutor(pool, threads, **native_kw)
    except NativeUnavailable as e:
        msg = f"native CPU expert executor unavailable ({e}); using the torch-ops executor"
        if msg not in _logged_fallbacks:
            _logged_fallbacks.add(msg)
            log.warning(msg)
        return TorchCpuExecutor(pool, threads)
    if threads:
        torch.set_num_threads(int(threads))
    return ex
