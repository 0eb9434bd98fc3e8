"""Device side of the CPU-branch doorbell (issue 4 item 4; DESIGN.md §2).

The decode step hands its CPU work to the native executor without a host function in the stream:
after the step's inputs are copied into the registered pinned buffers, :func:`ring` (one program)
advances a device sequence counter and stores it into the doorbell's request word in mapped pinned
host memory; the executor's server thread (``RegisteredStep.serve``) sees it, runs the step and
stores the value into the done word; :func:`wait` (one program) polls the done word until it
catches up. Both are ordinary kernels, so the side stream keeps running other streams' kernels
concurrently (a ``cudaLaunchHostFunc`` node serialized them on the H200, docs/benchmarks/decode.md)
and the pair is capturable in a CUDA graph: each replay rings with the next counter value.

The counter lives on the device: ``seq [2]`` int64, ``seq[0]`` the last request rung, ``seq[1]``
the number of waits that gave up (a deadlock guard: after ``max_polls`` polls the wait returns and
counts; the caller's result for that step is then wrong and the runner reports it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_POLLS = 1 << 28  # ~ minutes of PCIe reads: only a dead server reaches it


@triton.jit
def _ring_kernel(seq_ptr, bell_ptr):
    n = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, n)
    tl.store(bell_ptr, n, cache_modifier=".wt")  # write through to host memory


@triton.jit
def _wait_kernel(seq_ptr, bell_ptr, DONE: tl.constexpr, max_polls):
    n = tl.load(seq_ptr)
    done = tl.load(bell_ptr + DONE, volatile=True)
    polls = 0
    while (done < n) & (polls < max_polls):
        done = tl.load(bell_ptr + DONE, volatile=True)
        polls += 1
    if done < n:
        tl.store(seq_ptr + 1, tl.load(seq_ptr + 1) + 1)


def _check(seq: torch.Tensor, bell: torch.Tensor) -> None:
    if seq.dtype != torch.int64 or seq.numel() < 2 or bell.dtype != torch.int64 or bell.numel() < 9:
        raise ValueError("seq must be [2] int64 and the doorbell [16] int64 (RegisteredStep.serve)")


def ring(seq: torch.Tensor, bell: torch.Tensor) -> None:
    """Advance ``seq[0]`` and store it into the doorbell's request word ``bell[0]`` (one program).

    Args:
        seq: ``[2]`` int64 on the device (see the module docstring).
        bell: ``[16]`` int64 doorbell from ``RegisteredStep.serve`` (pinned host memory, read by the
            device at its mapped address).

    Raises:
        ValueError: wrong dtypes or sizes.
    """
    _check(seq, bell)
    _ring_kernel[(1,)](seq, bell, num_warps=1)


def wait(seq: torch.Tensor, bell: torch.Tensor, max_polls: int = MAX_POLLS) -> None:
    """Return (on the stream) once the doorbell's done word ``bell[8]`` reaches ``seq[0]``.

    One program polls with volatile loads; after ``max_polls`` polls it gives up and increments
    ``seq[1]``. Raises ``ValueError`` on wrong dtypes or sizes.
    """
    _check(seq, bell)
    _wait_kernel[(1,)](seq, bell, DONE=8, max_polls=int(max_polls), num_warps=1)
