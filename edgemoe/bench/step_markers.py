"""Clock stamps at the start and end of each model forward, taken on the device: where a decode step's time goes.

Under a profiler every host operation of a step is slower, so its trace overstates the time between two decode
steps' CUDA graphs, and a step's wall time alone does not say whether the GPU was busy for all of it.
:class:`StepMarkers` wraps a model's forward with two one-program Triton launches that store the GPU's global
timer (PTX ``%globaltimer``, nanoseconds) into a device buffer at a device-side counter; captured into a decode
step's CUDA graph they stamp every replay. From the stamps (:func:`step_times`): the forward's GPU time (its first
stamp to its second) and the GPU's idle time between consecutive forwards (one's end to the next one's start: the
host's work between two steps, such as the sampling, the next step's inputs and the graph launch, as the GPU sees
it). On a CPU device the stamps are the host's ``perf_counter_ns`` around the (synchronous) forward.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

try:  # an optional dependency; without it CUDA stamps are unavailable
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _stamp_kernel(stamps_ptr, counter_ptr, capacity, END: tl.constexpr):
        i = tl.load(counter_ptr)
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(stamps_ptr + i * 2 + END, t, mask=i < capacity)
        if END:
            tl.debug_barrier()  # every thread has read the counter before it moves
            tl.store(counter_ptr, i + 1)


class StepMarkers:
    """Start and end stamps of every forward of a wrapped model, in a buffer on the model's device.

    Args:
        device: the model's device (CUDA: device-clock stamps by a Triton kernel; CPU: host-clock stamps).
        capacity: forwards stamped at most (later ones are not stored; :meth:`read` says how many ran).

    Raises:
        RuntimeError: a CUDA device without Triton.
    """

    def __init__(self, device: torch.device, capacity: int = 4096):
        self.device, self.capacity = torch.device(device), int(capacity)
        if self.device.type == "cuda" and triton is None:
            raise RuntimeError("device-clock step markers need Triton")
        self.stamps = torch.zeros(self.capacity, 2, dtype=torch.int64, device=self.device)  # [capacity, 2] ns
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)  # forwards stamped so far

    def stamp(self, end: bool) -> None:
        """Store the clock into row ``counter`` (column 0 at a forward's start, 1 at its end; the end advances
        the counter). Enqueued on the current stream on CUDA (capturable), immediate on the CPU."""
        if self.device.type == "cuda":
            _stamp_kernel[(1,)](self.stamps, self.counter, self.capacity, END=bool(end))
            return
        i = int(self.counter)
        if i < self.capacity:
            self.stamps[i, int(end)] = time.perf_counter_ns()
        if end:
            self.counter += 1

    @contextmanager
    def wrap(self, model: torch.nn.Module) -> Iterator[StepMarkers]:
        """Within the context, ``model``'s forward stamps its start and end (an instance attribute shadows the
        class's ``forward``; removed on exit). A CUDA graph captured in the context keeps the stamps after it."""
        inner, shadowed = model.forward, model.__dict__.get("forward")

        def forward(*args, **kwargs):
            self.stamp(False)
            out = inner(*args, **kwargs)
            self.stamp(True)
            return out

        model.forward = forward
        try:
            yield self
        finally:
            if shadowed is None:
                del model.forward
            else:
                model.forward = shadowed

    def reset(self) -> None:
        """Forget the stamps so far (the next forward is row 0)."""
        self.counter.zero_()
        self.stamps.zero_()

    def read(self) -> list[tuple[int, int]]:
        """``(start_ns, end_ns)`` of each forward stamped since the last :meth:`reset`, in order (a sync)."""
        n = min(int(self.counter), self.capacity)
        return [tuple(row) for row in self.stamps[:n].tolist()]


def step_times(stamps: list[tuple[int, int]]) -> dict:
    """Summary of consecutive forwards' stamps (:meth:`StepMarkers.read`), in milliseconds.

    Returns:
        ``{"steps", "forward_ms": [...], "gap_ms": [...], "forward_median_ms", "gap_median_ms",
        "forward_mean_ms", "gap_mean_ms"}``: each forward's duration, and the idle time before each forward but the
        first (its start minus the end of the one before). Empty lists and ``None`` summaries without stamps.

    Raises:
        ValueError: a forward that ends before it starts, or starts before the one before ended (stamps of
            different clocks, or forwards that overlap).
    """
    forward = [(e - s) / 1e6 for s, e in stamps]
    gaps = [(s - e0) / 1e6 for (_, e0), (s, _) in itertools.pairwise(stamps)]
    if any(f < 0 for f in forward) or any(g < 0 for g in gaps):
        raise ValueError("step stamps out of order: a forward ends before it starts or overlaps the one before")

    def stat(f, xs):
        return f(xs) if xs else None

    return {"steps": len(stamps), "forward_ms": forward, "gap_ms": gaps,
            "forward_median_ms": stat(statistics.median, forward), "gap_median_ms": stat(statistics.median, gaps),
            "forward_mean_ms": stat(statistics.fmean, forward), "gap_mean_ms": stat(statistics.fmean, gaps)}
