"""The CPU branch's hand-off and collection on the device decode path, each one launch.

A decode step's MoE layer gives its CPU experts to the native executor through the doorbell
(:mod:`edgemoe.kernels.doorbell`: request word ``bell[0]``, done word ``bell[8]``, give-ups ``bell[1]``).
Two kernels do the device side:

- :func:`handoff`: when the layer has CPU work (``work[0] > 0``, route_control's CPU expert count), store
  the hidden states ``x`` and the packed work list straight into the registered step's pinned host
  buffers (the GPU writes host memory at its mapped address), fence them to system scope, then ring
  (advance ``seq`` and store it into ``bell[0]``). Without CPU work it returns at once and rings nothing
  (for the ``stream-op`` wait it then stores the release word itself).
- :func:`collect`: the layer's output ``y`` (GPU experts' sum, float32) cast to the model dtype; when
  the layer had CPU work, each program first polls the done word until it reaches ``seq`` (the same
  deadlock guard as :func:`edgemoe.kernels.doorbell.wait`) and adds the CPU partial, read from pinned
  host memory. It can count, per layer, the hand-offs and those where the GPU had to wait for the CPU
  (the signal the ``auto`` policy balances its split on), or, graded (CUDA), by how long: waited longer than
  one expert's time, done earlier by more than one, or neither.

Against two device-to-host copies, a ring, a wait, a host-to-device copy and two element-wise kernels,
a layer whose misses are all filled (most layers at a high hit rate) now pays for two launches that
exit at once, and a layer with CPU work moves the same bytes without the copy engine's per-copy
latency. Both are capturable in a CUDA graph.

Memory ordering: every thread of :func:`handoff` fences its stores to system scope (``membar.sys``)
before the block barrier after which the request word is written; :func:`collect` fences after seeing
the done word and reads the partial with volatile loads. On the CPU (the Triton interpreter, used by
the tests) the fences are not emitted: the interpreter runs programs one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgemoe.kernels.doorbell import CPU_NS, DONE, GAVE_UP, GAVE_UP_AT, MAX_POLLS, check_words

HANDOFF_BLOCK = 1024
COLLECT_BLOCK = 4096


@triton.jit
def _fence_sys(token):
    """``membar.sys`` executed by every thread (the result is a dummy equal to ``token``)."""
    return tl.inline_asm_elementwise("membar.sys;\n\tmov.b32 $0, $1;", "=r,r", [token], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _clock_ns():
    """The GPU's global timer (PTX ``%globaltimer``), nanoseconds."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _handoff_kernel(x_ptr, xh_ptr, n_x, pack_ptr, packh_ptr, n_pack, work_ptr, seq_ptr, bell_ptr, release_ptr,
                    ring_ns_ptr, BLOCK: tl.constexpr, FENCE: tl.constexpr, RELEASE: tl.constexpr,
                    TIMED: tl.constexpr):
    work = tl.load(work_ptr)
    if work > 0:
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_x, BLOCK):
            m = start + offs < n_x
            v = tl.load(x_ptr + start + offs, mask=m)
            tl.store(xh_ptr + start + offs, v.to(xh_ptr.dtype.element_ty), mask=m, cache_modifier=".wt")
        for start in range(0, n_pack, BLOCK):
            m = start + offs < n_pack
            tl.store(packh_ptr + start + offs, tl.load(pack_ptr + start + offs, mask=m), mask=m,
                     cache_modifier=".wt")
        if FENCE:
            work = _fence_sys(work)
        tl.debug_barrier()
        n = tl.load(seq_ptr) + 1
        tl.store(seq_ptr, n)
        if TIMED:  # the ring's time, for the join's graded lateness
            tl.store(ring_ns_ptr, _clock_ns())
        tl.store(bell_ptr, n, cache_modifier=".wt")
    else:
        if RELEASE:  # no CPU work: this step's stream wait is released here, not by the executor's server
            tl.store(release_ptr, 1, cache_modifier=".wt")


@triton.jit
def _collect_kernel(y_ptr, out_ptr, cpu_ptr, n, work_ptr, seq_ptr, bell_ptr, max_polls, stats_ptr, layer,
                    ring_ns_ptr, limits_ptr, BLOCK: tl.constexpr, DONE: tl.constexpr, CPU_NS: tl.constexpr,
                    GAVE_UP: tl.constexpr, GAVE_UP_AT: tl.constexpr, FENCE: tl.constexpr, STATS: tl.constexpr,
                    GRADED: tl.constexpr, COUNT_GIVE_UP: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(y_ptr + offs, mask=m)
    work = tl.load(work_ptr)
    if work > 0:
        target = tl.load(seq_ptr)
        done = tl.load(bell_ptr + DONE, volatile=True)
        gave_up = tl.load(bell_ptr + GAVE_UP, volatile=True)
        late = done < target  # the CPU branch was still running as the GPU got here
        if GRADED:
            arrived = _clock_ns()
        polls = tl.where(gave_up > 0, max_polls, 0)  # the server is gone: do not wait again
        while (done < target) & (polls < max_polls):
            done = tl.load(bell_ptr + DONE, volatile=True)
            polls += 1
        if GRADED:
            waited = _clock_ns() - arrived
        if COUNT_GIVE_UP:
            if done < target:  # any program that gives up counts it, once per request (GAVE_UP_AT)
                if tl.load(bell_ptr + GAVE_UP_AT, volatile=True) != target:
                    tl.store(bell_ptr + GAVE_UP, gave_up + 1, cache_modifier=".wt")
                    tl.store(bell_ptr + GAVE_UP_AT, target, cache_modifier=".wt")
        if FENCE:
            work = _fence_sys(work)
        if STATS:
            if pid == 0:  # one hand-off, and its lateness
                tl.atomic_add(stats_ptr + layer * 2, 1)
                if GRADED:  # in halves: 2 waited longer than the limit (or never saw the CPU finish), 0 the CPU
                    # was done earlier by more than its limit; after the fence, so bell[CPU_NS] is this request's
                    if late:
                        w = tl.where((waited > tl.load(limits_ptr + layer * 2)) | (done < target), 2, 1)
                    else:
                        slack = arrived - tl.load(ring_ns_ptr) - tl.load(bell_ptr + CPU_NS, volatile=True)
                        w = tl.where(slack > tl.load(limits_ptr + layer * 2 + 1), 0, 1)
                    tl.atomic_add(stats_ptr + layer * 2 + 1, w.to(tl.int64))
                else:
                    tl.atomic_add(stats_ptr + layer * 2 + 1, late.to(tl.int64))
        y += tl.load(cpu_ptr + offs, mask=m, volatile=True)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def handoff(x: torch.Tensor, x_host: torch.Tensor, pack: torch.Tensor, pack_host: torch.Tensor, work: torch.Tensor,
            seq: torch.Tensor, bell: torch.Tensor, release: torch.Tensor | None = None,
            ring_ns: torch.Tensor | None = None) -> None:
    """Hand a layer's CPU work to the executor when it has any (one program, enqueued on the stream).

    Args:
        x: ``[T, H]`` hidden states on the device (any float dtype), contiguous.
        x_host: the registered step's input rows (pinned host memory, at least ``T·H`` elements, float32
            or bfloat16; ``x`` is converted on the store).
        pack: ``[W]`` int64 packed CPU work list on the device (``RouteOutputs.cpu_pack``).
        pack_host: the registered step's ``[W]`` int64 pinned work list.
        work: ``[1]`` int32 on the device: the layer's CPU expert count (``RouteOutputs.meta[3:]``).
        seq: ``[1]`` int64 device sequence counter; bell: ``[24]`` int64 pinned doorbell
            (:mod:`edgemoe.kernels.doorbell`).
        release: the doorbell's ``[1]`` int32 release word (``doorbell.release_word``) for the ``stream-op``
            wait, or ``None``: without CPU work the kernel stores 1 into it (the server does after work).
        ring_ns: ``[1]`` int64 on a CUDA device, or ``None``: a ring also stores the GPU's global timer (ns)
            into it, for :func:`collect`'s graded lateness.

    Raises:
        ValueError: wrong dtypes or sizes, or ``ring_ns`` off a CUDA device.
    """
    check_words(seq, bell, work)
    _check_ring_ns(ring_ns, x.device)
    if release is not None and (release.dtype != torch.int32 or release.numel() != 1):
        raise ValueError("release must be the doorbell's [1] int32 release word")
    if not x.is_contiguous() or x_host.numel() < x.numel() or pack_host.numel() < pack.numel():
        raise ValueError(f"x must be contiguous and fit the step's rows ({tuple(x.shape)} into "
                         f"{x_host.numel()} elements; work list {pack.numel()} into {pack_host.numel()} words)")
    if pack.dtype != torch.int64 or pack_host.dtype != torch.int64:
        raise ValueError("the packed work lists must be int64")
    _handoff_kernel[(1,)](x, x_host, x.numel(), pack, pack_host, pack.numel(), work, seq, bell,
                          work if release is None else release, seq if ring_ns is None else ring_ns,
                          BLOCK=HANDOFF_BLOCK, FENCE=x.device.type == "cuda", RELEASE=release is not None,
                          TIMED=ring_ns is not None, num_warps=4)


def _check_ring_ns(ring_ns: torch.Tensor | None, device: torch.device) -> None:
    if ring_ns is not None and (ring_ns.dtype != torch.int64 or ring_ns.numel() != 1 or device.type != "cuda"
                                or ring_ns.device != device):
        raise ValueError("ring_ns must be a [1] int64 tensor on the CUDA device of the step (the GPU's clock "
                         "has no counterpart in the Triton interpreter)")


def collect(y: torch.Tensor, cpu_out: torch.Tensor, work: torch.Tensor, seq: torch.Tensor, bell: torch.Tensor,
            dtype: torch.dtype, max_polls: int = MAX_POLLS, stats: torch.Tensor | None = None,
            layer: int = 0, count_give_up: bool = True, ring_ns: torch.Tensor | None = None,
            limits: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output: ``y`` plus, when the layer had CPU work, the executor's partial once it is done.

    Args:
        y: ``[T, H]`` float32 on the device (the GPU experts' weighted sum), contiguous.
        cpu_out: the registered step's float32 output rows (pinned host memory, at least ``T·H``).
        work, seq, bell: as in :func:`handoff`; the wait polls ``bell[8]`` until it reaches ``seq[0]``
            (at most ``max_polls`` polls; a give-up is counted once in ``bell[1]``, whichever programs give
            up, with the request in ``bell[2]``; the partial is then wrong).
        dtype: the output dtype.
        stats: ``[L, 2]`` int64 on the device, or ``None``: after a hand-off, ``stats[layer, 0]`` counts it
            and ``stats[layer, 1]`` counts it as late when the done word had not reached ``seq`` at the
            join's first look (the GPU waited for the CPU branch).
        layer: the MoE layer's row of ``stats``.
        count_give_up: count a wait that gave up in ``bell[1]`` (``False`` after a ``stream-op`` wait: the
            server's watchdog counted it when it released the wait).
        ring_ns, limits: graded lateness (CUDA, with ``stats``): ``ring_ns`` the ``[1]`` int64 word :func:`handoff`
            stored its ring's time into, ``limits`` ``[L, 2]`` int64 nanoseconds per MoE layer (a wait limit, a slack
            limit). ``stats[layer, 1]`` then counts in halves: 2 when the GPU waited longer than the wait limit or never
            saw the CPU branch finish (a give-up, now or earlier), 0 when the CPU branch was done before the GPU got
            here by more than the slack limit (the GPU's time since the ring minus the server's step time in
            ``bell[9]``, counted from its last poll that found no request: an upper bound, so a join errs toward "not
            early"), 1 otherwise. The two limits are one expert's time on each side: a move of one expert to the other
            side shortens the layer step only past them. Durations only: the CPU's and the GPU's clocks are never
            compared. The join reads ``bell[9]`` after its system fence (it is written before the done word), and only
            when the CPU branch was done at the join's first look.

    Returns:
        ``[T, H]`` in ``dtype``: ``y + cpu_out[:T]`` when ``work[0] > 0``, else ``y``.

    Raises:
        ValueError: wrong dtypes or sizes; ``limits`` without ``stats`` and ``ring_ns``, or off a CUDA device.
    """
    check_words(seq, bell, work)
    if limits is not None:
        if ring_ns is None:
            raise ValueError("graded lateness (limits) needs ring_ns, the word the hand-off stored its ring's time in")
        _check_ring_ns(ring_ns, y.device)
        if stats is None or limits.dtype != torch.int64 or limits.shape != stats.shape or limits.device != y.device:
            raise ValueError("graded lateness needs stats, and limits as [L, 2] int64 on the step's device")
    if y.dtype != torch.float32 or cpu_out.dtype != torch.float32 or not y.is_contiguous() \
            or cpu_out.numel() < y.numel():
        raise ValueError("y and the CPU partial must be float32, y contiguous, the partial at least as large")
    if stats is not None and (stats.dtype != torch.int64 or stats.dim() != 2 or stats.shape[1] != 2
                              or not 0 <= layer < stats.shape[0]):
        raise ValueError(f"stats must be [L, 2] int64 with layer {layer} in range, got {stats.dtype} "
                         f"{tuple(stats.shape)}")
    out = torch.empty(y.shape, dtype=dtype, device=y.device)
    n = y.numel()
    _collect_kernel[(triton.cdiv(n, COLLECT_BLOCK),)](y, out, cpu_out, n, work, seq, bell, int(max_polls),
                                                      seq if stats is None else stats, int(layer),
                                                      seq if ring_ns is None else ring_ns,
                                                      seq if limits is None else limits,
                                                      BLOCK=COLLECT_BLOCK, DONE=DONE, CPU_NS=CPU_NS, GAVE_UP=GAVE_UP,
                                                      GAVE_UP_AT=GAVE_UP_AT,
                                                      FENCE=y.device.type == "cuda", STATS=stats is not None,
                                                      GRADED=limits is not None,
                                                      COUNT_GIVE_UP=bool(count_give_up), num_warps=4)
    return out
