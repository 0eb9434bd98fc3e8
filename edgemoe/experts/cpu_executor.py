"""The CPU expert executor: computes routed experts in place from the host pool.

Every executor implements :class:`CpuExecutor`: ``run(x [T, H], work, out [T, H] float32)``,
``with_pool``, ``name``, ``threads``, ``forward_threads``, ``dense`` and the capability ``registers_steps``
(whether :meth:`CpuExecutor.make_step` gives a step a device kernel can hand to the executor without
a host sync, which a captured decode step needs). Two implement it:

- ``NativeCpuExecutor`` (``edgemoe.experts.native``): C++ kernels on a pinned thread pool,
  bandwidth-bound GEMVs for decode batches, for every expert the engine serves (SiLU SwiGLU, and
  gpt-oss's clamped SwiGLU with biases); the default where it builds.
- :class:`TorchCpuExecutor` (here): one GEMM pair per expert with torch ops on torch's intra-op
  threads; the fallback, and the reference the native one is tested against.

:func:`make_cpu_executor` picks one (``EngineConfig.cpu_executor``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Protocol

import torch

from edgemoe.config import CPU_EXECUTORS
from edgemoe.experts.compute import run_experts_torch
from edgemoe.experts.pool import HostExpertPool

if TYPE_CHECKING:
    from edgemoe.experts.native import DenseKernels, RegisteredStep

log = logging.getLogger(__name__)

Work = list[tuple[int, torch.Tensor, torch.Tensor]]
"""A step's CPU set: per expert ``(flat_id, token_idx [n] int64, weight [n] float)``."""


class CpuExecutor(Protocol):
    """What the expert path needs from a CPU executor."""

    name: str
    threads: int
    threads_note: str | None  # why ``threads`` differs from the count asked for (None: it does not)
    registers_steps: bool

    def run(self, x: torch.Tensor, work: Work, out: torch.Tensor) -> None:
        """Accumulate ``Σ weight · expert(x[token])`` of ``work`` into ``out [T, H]`` float32 (CPU)."""

    def run_grouped(self, x: torch.Tensor, fids: list[int], counts: list[int], tok: torch.Tensor, wt: torch.Tensor,
                    out: torch.Tensor) -> None:
        """:meth:`run` over routes already grouped by expert: expert ``fids[e]`` takes the next
        ``counts[e]`` entries of ``tok [P]`` int64 (token rows) and ``wt [P]`` (weights), in order (what
        ``run(x, list(zip(fids, tok.split(counts), wt.split(counts))), out)`` computes, without the split)."""

    def with_pool(self, pool: HostExpertPool) -> CpuExecutor:
        """The same executor (same threads) over another pool, e.g. a bandwidth-rotation pool."""

    def forward_threads(self, rows: int) -> contextlib.AbstractContextManager:
        """A context for a CPU forward over ``rows`` tokens setting torch's intra-op threads for it (a decode
        step whose dense GEMVs run on this executor's threads through :attr:`dense` needs few)."""

    @property
    def dense(self) -> DenseKernels | None:
        """Native single-call versions of a CPU decode step's dense GEMVs, norms and attention
        (``edgemoe.experts.native.DenseKernels``), or ``None``: the model keeps its torch operations."""

    def make_step(self, max_tokens: int, max_experts: int, max_routes: int | None = None,
                  x_dtype: torch.dtype = torch.float32, zero_out: bool = True,
                  pin_memory: bool = False) -> RegisteredStep:
        """Buffers registered once for steps run without Python (only when ``registers_steps``)."""


class TorchCpuExecutor:
    """Runs a set of experts on the CPU with torch ops, weights read from the host pool, on torch's
    intra-op threads (the engine sets their number once, at start-up).

    Args:
        pool: the host expert pool (source of ``w13``/``w2`` rows).
    """

    name = "torch"
    registers_steps = False
    threads_note = None
    dense = None  # the model's own torch operations

    def __init__(self, pool: HostExpertPool):
        self.pool = pool

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    def with_pool(self, pool: HostExpertPool) -> TorchCpuExecutor:
        return TorchCpuExecutor(pool)

    def forward_threads(self, rows: int) -> contextlib.AbstractContextManager:
        """Nothing changes: the dense layers are torch ops on torch's threads."""
        return contextlib.nullcontext()

    def run(self, x: torch.Tensor, work: Work, out: torch.Tensor) -> None:
        """Accumulate ``Σ weight · expert(x[token])`` into ``out``.

        Args:
            x: ``[T, H]`` hidden states on the CPU (any float dtype).
            work: per expert ``(flat_id, token_idx [n] int64, weight [n] float)``.
            out: ``[T, H]`` float32 CPU accumulator (added to, not overwritten).
        """
        run_experts_torch(self.pool, x, work, out)

    def run_grouped(self, x: torch.Tensor, fids: list[int], counts: list[int], tok: torch.Tensor, wt: torch.Tensor,
                    out: torch.Tensor) -> None:
        """:meth:`CpuExecutor.run_grouped`: split into :meth:`run`'s work list."""
        self.run(x, list(zip(fids, tok.split(counts), wt.split(counts))), out)

    def make_step(self, *args, **kwargs) -> RegisteredStep:
        raise NotImplementedError("the torch-ops CPU executor has no registered steps (registers_steps is False)")


def make_cpu_executor(pool: HostExpertPool, threads: int | None = None, kind: str = "auto", alongside: int = 0,
                      **native_kw) -> CpuExecutor:
    """The CPU expert executor for ``pool``.

    Args:
        pool: the host expert pool.
        threads: native executor threads (``--cpu-threads``; ``None``: the most that never
            oversubscribe the cores, :func:`edgemoe.experts.native.plan_threads`). The torch executor
            runs on torch's intra-op threads, which the engine sets.
        kind: ``"auto"`` or ``"native"`` (native where it builds and has kernels for the pool's rows:
            :func:`~edgemoe.experts.native.native_reason`; else torch with a one-line warning), or
            ``"torch"``. The native kernels compute both activations (SiLU SwiGLU, gpt-oss's clamped SwiGLU)
            with or without expert biases.
        alongside: busy threads outside the native pool that need a core while it computes (on CUDA
            :data:`edgemoe.experts.native.ALONGSIDE_CUDA`).
        native_kw: passed to :class:`~edgemoe.experts.native.NativeCpuExecutor` (``isa``, ``spin_us``, ...).

    Returns:
        A ``NativeCpuExecutor`` or a :class:`TorchCpuExecutor`. Never fails for lack of a compiler:
        the reason is logged (one line) and the torch executor is returned.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in CPU_EXECUTORS:
        raise ValueError(f"cpu executor {kind!r}: choose one of {CPU_EXECUTORS}")
    if kind == "torch":
        return TorchCpuExecutor(pool)
    from edgemoe.experts.native import NativeCpuExecutor, NativeUnavailable

    try:
        return NativeCpuExecutor(pool, threads, alongside=alongside, **native_kw)
    except NativeUnavailable as e:
        log.warning("native CPU expert executor unavailable (%s); using the torch-ops executor", e)
        return TorchCpuExecutor(pool)
