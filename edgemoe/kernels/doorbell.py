"""Device side of the CPU-branch doorbell.

The decode step hands its CPU work to the native executor without a host function in the stream:
after the step's inputs are copied into the registered pinned buffers, :func:`ring` (one program)
advances a device sequence counter and stores it into the doorbell's request word in mapped pinned
host memory; the executor's server thread (``RegisteredStep.serve``) sees it, runs the step and
stores the value into the done word; :func:`wait` (one program) polls the done word until it
catches up. Both are ordinary one-program kernels: the GPU work enqueued between them runs while
the CPU computes, and the pair is capturable in a CUDA graph (each replay rings with the next
counter value).

Words: ``seq [1]`` int64 on the device, the last request rung; the doorbell ``bell [16]`` int64 in
pinned host memory: ``bell[0]`` request, ``bell[8]`` done (its own cache line), ``bell[1]`` the
number of waits that gave up. A wait gives up after ``max_polls`` polls (a deadlock guard), and at
once when an earlier wait gave up (the server is gone); the caller's CPU partial is then wrong, and
``bell[1]``, readable on the host without a device sync, tells it so
(``DeviceDecode.check``).

Memory ordering: the ring's store follows the copies of the step's inputs in stream order and is
written through to host memory; the wait's loads are volatile. That is enough on x86 hosts with
PCIe (strong ordering of posted writes); a weakly ordered host would want system-scope
release/acquire operations here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_POLLS = 1 << 24  # ~20-30 s of PCIe reads: far beyond any CPU step; only a dead server reaches it


@triton.jit
def _ring_kernel(seq_ptr, bell_ptr):
    n = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, n)
    tl.store(bell_ptr, n, cache_modifier=".wt")  # write through to host memory


@triton.jit
def _wait_kernel(seq_ptr, bell_ptr, DONE: tl.constexpr, GAVE_UP: tl.constexpr, max_polls):
    n = tl.load(seq_ptr)
    done = tl.load(bell_ptr + DONE, volatile=True)
    gave_up = tl.load(bell_ptr + GAVE_UP, volatile=True)
    polls = tl.where(gave_up > 0, max_polls, 0)  # the server is gone: do not wait again
    while (done < n) & (polls < max_polls):
        done = tl.load(bell_ptr + DONE, volatile=True)
        polls += 1
    if done < n:
        tl.store(bell_ptr + GAVE_UP, gave_up + 1, cache_modifier=".wt")


def _check(seq: torch.Tensor, bell: torch.Tensor) -> None:
    if seq.dtype != torch.int64 or seq.numel() < 1 or bell.dtype != torch.int64 or bell.numel() < 9:
        raise ValueError("seq must be [1] int64 and the doorbell [16] int64 (RegisteredStep.serve)")


def ring(seq: torch.Tensor, bell: torch.Tensor) -> None:
    """Advance ``seq[0]`` and store it into the doorbell's request word ``bell[0]`` (one program).

    Args:
        seq: ``[1]`` int64 on the device (see the module docstring).
        bell: ``[16]`` int64 doorbell from ``RegisteredStep.serve`` (pinned host memory, read by the
            device at its mapped address).

    Raises:
        ValueError: wrong dtypes or sizes.
    """
    _check(seq, bell)
    _ring_kernel[(1,)](seq, bell, num_warps=1)


def wait(seq: torch.Tensor, bell: torch.Tensor, max_polls: int = MAX_POLLS) -> None:
    """Return (on the stream) once the doorbell's done word ``bell[8]`` reaches ``seq[0]``.

    One program polls with volatile loads; after ``max_polls`` polls, or at once when ``bell[1]`` says
    an earlier wait gave up, it returns and increments ``bell[1]``. Raises ``ValueError`` on wrong
    dtypes or sizes.
    """
    _check(seq, bell)
    _wait_kernel[(1,)](seq, bell, DONE=8, GAVE_UP=1, max_polls=int(max_polls), num_warps=1)
