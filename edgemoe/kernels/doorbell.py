"""Device side of the CPU-branch doorbell.

The decode step hands its CPU work to the native executor without a host function in the stream:
after the step's inputs are copied into the registered pinned buffers, :func:`ring` (one program)
advances a device sequence counter and stores it into the doorbell's request word in mapped pinned
host memory; the executor's server thread (``RegisteredStep.serve``) sees it, runs the step and
stores the value into the done word; the device then waits for that answer in one of two ways
(:data:`WAIT_MODES`):

- ``kernel``: :func:`wait` (one program) polls the done word until it catches up. The program holds
  one warp of one SM for the whole wait, issuing a PCIe read per poll.
- ``stream-op``: :func:`wait_stream_op` enqueues a stream memory operation
  (``cuStreamWaitValue32``, :mod:`edgemoe.kernels.cuda_driver`) that waits in the GPU's front end,
  holding no SM, until the release word is 1, then one that stores 0 into it. The server stores 1
  after the done word (``serve(release_timeout_s=...)``); a ring without CPU work stores it itself.
  The compared value is fixed when a graph is captured, which is why this mode waits on a word the
  device resets instead of comparing against the advancing counter.

Both are capturable in a CUDA graph (each replay rings with the next counter value; the stream
operations become memory-operation nodes), and the GPU work enqueued between ring and wait runs
while the CPU computes.

Words: ``seq [1]`` int64 on the device, the last request rung; the doorbell ``bell [24]`` int64 in
pinned host memory: ``bell[0]`` request, ``bell[1]`` the number of waits given up, ``bell[8]`` done,
``bell[9]`` the last served step's time in nanoseconds since the server's last poll that found no request
(stored just before done), ``bell[16]`` (low 32 bits)
the release word; 0, 8 and 16 on cache lines of their own.

Give-up: a ``kernel`` wait gives up after ``max_polls`` polls (a deadlock guard), and at once when an
earlier wait gave up (the server is gone), counting each in ``bell[1]``. A ``stream-op`` wait cannot
time out; the server's watchdog stands in: a request unanswered for ``release_timeout_s`` is given
up (``bell[1]`` + 1, release word stored), and every later request is answered so at once; stopping
the server gives up a request still pending. Either way the caller's CPU partial is then wrong and
``bell[1]``, readable on the host without a device sync, tells it so (``DeviceDecode.check``).

Memory ordering: the ring's store follows the copies of the step's inputs in stream order and is
written through to host memory; the wait's loads are volatile (the wait operation reads host memory
directly). The release word's reset to 0 precedes the next ring in stream order, so the server's
next store of 1 lands after it. That is enough on x86 hosts with PCIe (strong ordering of posted
writes); a weakly ordered host would want system-scope release/acquire operations here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgemoe.kernels import cuda_driver

MAX_POLLS = 1 << 24  # ~20-30 s of PCIe reads: far beyond any CPU step; only a dead server reaches it
RELEASE_TIMEOUT_S = 20.0  # the stream-op mode's equivalent of MAX_POLLS (the server's watchdog)
WAIT_MODES = ("kernel", "stream-op")
REQUEST, GAVE_UP, DONE, RELEASE = 0, 1, 8, 16  # int64 words of the doorbell
CPU_NS = 9  # the server's last step time (ns, from its last empty poll), beside done
GAVE_UP_AT = 2  # the request a multi-program join last gave up on (its programs count the give-up once)
BELL_WORDS = 24


@triton.jit
def _ring_kernel(seq_ptr, bell_ptr, work_ptr, release_ptr, WORK: tl.constexpr, RELEASE: tl.constexpr):
    ring = True
    if WORK:
        ring = tl.load(work_ptr) > 0
    if ring:
        n = tl.load(seq_ptr) + 1
        tl.store(seq_ptr, n)
        tl.store(bell_ptr, n, cache_modifier=".wt")  # write through to host memory
    else:
        if RELEASE:  # no CPU work: this step's wait operation is released here, not by the server
            tl.store(release_ptr, 1, cache_modifier=".wt")


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


def check_words(seq: torch.Tensor, bell: torch.Tensor, work: torch.Tensor | None = None) -> None:
    """Validate the doorbell's words: ``seq [1]`` int64, ``bell [BELL_WORDS]`` int64 and, when given, the
    ``[1]`` int32 CPU expert count ``work``.

    Raises:
        ValueError: a wrong dtype or size.
    """
    if seq.dtype != torch.int64 or seq.numel() < 1 or bell.dtype != torch.int64 or bell.numel() < BELL_WORDS:
        raise ValueError(f"seq must be [1] int64 and the doorbell [{BELL_WORDS}] int64 (RegisteredStep.serve)")
    if work is not None and (work.dtype != torch.int32 or work.numel() < 1):
        raise ValueError("work must be a [1] int32 tensor (the step's CPU expert count)")


def release_word(bell: torch.Tensor) -> torch.Tensor:
    """The release word as a ``[1]`` int32 view of ``bell`` (the low half of ``bell[16]``, little-endian)."""
    return bell.view(torch.int32)[2 * RELEASE:2 * RELEASE + 1]


def ring(seq: torch.Tensor, bell: torch.Tensor, work: torch.Tensor | None = None, release: bool = False) -> None:
    """Advance ``seq[0]`` and store it into the doorbell's request word ``bell[0]`` (one program); with
    ``work`` (a ``[1]`` int32 device tensor: the step's CPU experts), only when ``work[0] > 0`` (the
    following :func:`wait` then returns at once; with ``release``, for :func:`wait_stream_op`, the
    program then stores 1 into the release word instead).

    Args:
        seq: ``[1]`` int64 on the device (see the module docstring).
        bell: ``[24]`` int64 doorbell from ``RegisteredStep.serve`` (pinned host memory, read by the
            device at its mapped address).

    Raises:
        ValueError: wrong dtypes or sizes.
    """
    check_words(seq, bell, work)
    _ring_kernel[(1,)](seq, bell, seq if work is None else work, release_word(bell), WORK=work is not None,
                       RELEASE=bool(release), num_warps=1)


def wait(seq: torch.Tensor, bell: torch.Tensor, max_polls: int = MAX_POLLS) -> None:
    """Return (on the stream) once the doorbell's done word ``bell[8]`` reaches ``seq[0]``.

    One program polls with volatile loads; after ``max_polls`` polls, or at once when ``bell[1]`` says
    an earlier wait gave up, it returns and increments ``bell[1]``. Raises ``ValueError`` on wrong
    dtypes or sizes.
    """
    check_words(seq, bell)
    _wait_kernel[(1,)](seq, bell, DONE=DONE, GAVE_UP=GAVE_UP, max_polls=int(max_polls), num_warps=1)


def wait_stream_op(release_address: int, stream: int) -> None:
    """Enqueue on ``stream`` the ``stream-op`` wait: a wait operation until the release word is >= 1,
    then a write operation storing 0 into it (ready for the next ring). No kernel is launched.

    Args:
        release_address: the device address of the release word
            (``cuda_driver.host_device_pointer(release_word(bell), device)``).
        stream: the ``CUstream`` handle to enqueue on (``torch.cuda.current_stream().cuda_stream``).

    Raises:
        cuda_driver.DriverError: the driver refused an operation.
    """
    cuda_driver.wait_value32(stream, release_address, 1, cuda_driver.WAIT_GEQ)
    cuda_driver.write_value32(stream, release_address, 0)
