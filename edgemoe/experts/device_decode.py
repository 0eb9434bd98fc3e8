"""The decode step of a MoE layer with its control on the device (DESIGN.md §2, issue 3).

Per MoE layer, with no host synchronization, so the whole decode step can be captured in a CUDA graph:

1. ``route_control`` (one Triton launch): dedupe the step's experts, classify them against the
   residency table, q from the policy parameters held in a device tensor, LRU victims, table
   rewrite; it emits a fixed-shape fill list and the CPU work in the native executor's format;
2. the CPU branch, on a side stream: device→pinned-host copies of ``x`` and the CPU work, then the
   hand-off to the native executor (``cpu_join``): ``"doorbell"`` (default) rings a doorbell in
   pinned memory that the executor's server thread polls, and waits on its done word with a
   one-program polling kernel (:mod:`edgemoe.kernels.doorbell`); ``"host-func"`` enqueues a host node
   (``cudaLaunchHostFunc``) running ``edgemoe_run_step``, which on the H200 kept the other streams'
   kernels from running meanwhile (docs/benchmarks/decode.md). Then the host→device copy of the
   executor's float32 partial;
3. meanwhile on the main stream: ``gather_fills`` (one launch copying every fill row of both banks
   from pinned host memory into its slot, zero-copy) and ``expert_gemv`` (hits and fills, every
   (token, k) route in its own row of ``routed [T, k, H]``);
4. join: ``out = Σ_k routed (fixed order, float32) + CPU partial``.

Without CUDA (tests run the Triton kernels in the interpreter on the CPU) the doorbell path runs the
same way in program order (the wait polls until the server thread is done). The CPU branch needs
the native executor; with the torch-ops executor it reads the work list back to the host (a sync)
and the step cannot be captured.
"""

from __future__ import annotations

import ctypes
import logging
from contextlib import nullcontext
from pathlib import Path

import torch

from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.policy import ExpertPolicy
from edgemoe.experts.pool import HostExpertPool

from edgemoe.config import CPU_JOINS

log = logging.getLogger(__name__)


def device_path_available(device: torch.device) -> str | None:
    """``None`` when the device decode path can run on ``device``, else the reason it cannot."""
    if device.type != "cuda":
        return "the device decode path needs CUDA"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


_CUDART = None


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (found in ``/proc/self/maps``), through ctypes."""
    global _CUDART
    if _CUDART is None:
        torch.cuda.init()
        paths = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                        if "libcudart.so" in line})
        if not paths:
            raise RuntimeError("libcudart is not loaded in this process; cannot launch host functions")
        lib = ctypes.CDLL(paths[0])
        lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaLaunchHostFunc.restype = ctypes.c_int
        _CUDART = lib
    return _CUDART


def launch_host_func(stream: torch.cuda.Stream, fn_address: int, arg_address: int) -> None:
    """Enqueue ``fn(arg)`` on ``stream`` (``cudaLaunchHostFunc``); recorded as a host node when
    ``stream`` is being captured into a CUDA graph, and run again on every replay.

    Raises:
        RuntimeError: the runtime refused the launch (its error code is given).
    """
    err = _cudart().cudaLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn_address),
                                       ctypes.c_void_p(arg_address))
    if err != 0:
        raise RuntimeError(f"cudaLaunchHostFunc failed with CUDA error {err}")


class DeviceDecode:
    """Buffers and launches of the device-controlled decode step, shared by all MoE layers.

    Layers run one after another, so one set of buffers serves every layer (and every batch size up
    to ``max_tokens``); a CUDA graph captured over :meth:`forward` replays with them.

    Args:
        pool: host expert pool (pinned, so the device reads it at its host address).
        cache: the expert cache; its tables and ``clock`` live on the compute device.
        policy: gives the device policy parameters ``(ratio, q_min)``.
        cpu_executor: the CPU executor (native: the CPU branch runs without a host sync; torch: a sync).
        num_experts: ``E``, experts per MoE layer.
        top_k: routed experts per token.
        max_tokens: largest decode batch.
        cpu_join: ``"doorbell"`` or ``"host-func"`` (module docstring); the latter only on CUDA.

    Attributes:
        counters: ``[4]`` int64 on the device: decode (hits, misses, fills, cpu) since creation.
        cpu_branch: whether the CPU branch is enqueued at all (``False`` when every expert is resident,
            or when every step's misses fit the evictable slots and the policy fills them all).
    """

    def __init__(self, pool: HostExpertPool, cache: ExpertCache, policy: ExpertPolicy, cpu_executor,
                 num_experts: int, top_k: int, max_tokens: int, cpu_join: str = "doorbell"):
        if cpu_join not in CPU_JOINS:
            raise ValueError(f"cpu_join {cpu_join!r}: choose one of {CPU_JOINS}")
        from edgemoe.kernels import doorbell
        from edgemoe.kernels.expert_gemv import expert_gemv
        from edgemoe.kernels.gather import gather_fills
        from edgemoe.kernels.route_control import RouteOutputs, route_control

        self._route_control, self._gather_fills, self._expert_gemv = route_control, gather_fills, expert_gemv
        self._ring, self._wait = doorbell.ring, doorbell.wait
        self.pool, self.cache, self.top_k, self.max_tokens = pool, cache, top_k, max_tokens
        self.num_experts = num_experts
        dev = self.device = cache.device
        P = max_tokens * top_k
        H, I = pool.hidden, pool.intermediate
        self.out = RouteOutputs.empty(P, dev)
        self.act = torch.zeros(P, I, dtype=cache.dtype, device=dev)  # [P, I] SiLU(gate)·up scratch
        self.routed = torch.zeros(max_tokens, top_k, H, dtype=cache.dtype, device=dev)  # [T, k, H]
        self.counters = torch.zeros(4, dtype=torch.int64, device=dev)
        num, den, q_min = policy.fill_rule()
        self.policy = torch.tensor([num, den, q_min], dtype=torch.float64, device=dev)
        evictable = int((~cache.pinned).sum())
        all_resident = int((cache.owner_of >= 0).sum()) >= pool.num_ids  # e.g. static with every layer placed
        fills_all = num >= den and q_min == 0 and not hasattr(policy, "observe")  # an online policy may switch
        self.cpu_branch = not (all_resident or (fills_all and evictable >= P))
        self.cpu = cpu_executor
        self.step = None  # RegisteredStep of the native executor
        self.cpu_out = torch.zeros(max_tokens, H, dtype=torch.float32, device=dev)  # [T, H] CPU partial
        self.cuda = dev.type == "cuda"
        self.cpu_join = cpu_join if self.cuda else "doorbell"
        self.side = torch.cuda.Stream(dev) if self.cuda else None
        self.seq = torch.zeros(2, dtype=torch.int64, device=dev)  # doorbell counter, timed-out waits
        self.bell = None
        if self.cpu_branch and hasattr(cpu_executor, "make_step"):
            x_dtype = cache.dtype if cache.dtype in (torch.float32, torch.bfloat16) else torch.float32
            self.step = cpu_executor.make_step(max_tokens, P, P, x_dtype=x_dtype, zero_out=True, pin_memory=self.cuda)
            if self.cpu_join == "doorbell":
                self.bell = self.step.serve(pin_memory=self.cuda)

    @property
    def capturable(self) -> bool:
        """Whether :meth:`forward` has no host synchronization (CUDA, and a native CPU branch if any)."""
        return self.cuda and (not self.cpu_branch or self.step is not None)

    def counter_dict(self) -> dict[str, int]:
        """The device counters as ``{hits, misses, fills, cpu}`` (deduplicated experts; one host read).

        Raises:
            RuntimeError: a doorbell wait gave up (the executor's server stopped answering), so some
                decode output missed its CPU part.
        """
        h, m, f, c = self.counters.tolist()
        if self.bell is not None and int(self.seq[1]):
            raise RuntimeError(f"{int(self.seq[1])} CPU-branch waits timed out: the native executor's server "
                               f"did not answer ({self.step.served} steps served)")
        return {"hits": h, "misses": m, "fills": f, "cpu": c}

    def close(self) -> None:
        """Stop the CPU branch's server thread (if any) and free its registered step."""
        if self.step is not None:
            self.step.close()

    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed-expert output of one MoE layer's decode step.

        Args:
            moe_layer: MoE layer ordinal.
            x: ``[T, H]`` hidden states on the device, ``T <= max_tokens``.
            topk_ids: ``[T, k]`` int64 expert indices within the layer.
            topk_weights: ``[T, k]`` router weights.

        Returns:
            ``[T, H]`` in ``x.dtype``.
        """
        T, k = topk_ids.shape
        P = T * k
        c, o = self.cache, self.out
        self._route_control(topk_ids, topk_weights, moe_layer * self.num_experts, c.slot_of, c.owner_of, c.last_used,
                      c.pinned, c.clock, self.policy, self.counters, o)
        cpu_out = self.cpu_out[:T]
        if self.cpu_branch and self.step is not None:
            main = torch.cuda.current_stream(self.device) if self.cuda else None
            if self.cuda:
                self.side.wait_stream(main)
            with torch.cuda.stream(self.side) if self.cuda else nullcontext():
                st = self.step
                st.x[:T].copy_(x, non_blocking=True)
                st.dims.copy_(o.cpu_dims, non_blocking=True)
                st.fids[:P].copy_(o.cpu_fids[:P], non_blocking=True)
                st.offsets[:P + 1].copy_(o.cpu_offsets[:P + 1], non_blocking=True)
                st.tok[:P].copy_(o.cpu_tok[:P], non_blocking=True)
                st.wt[:P].copy_(o.cpu_wt[:P], non_blocking=True)
                if self.bell is not None:
                    self._ring(self.seq, self.bell)
                    self._wait(self.seq, self.bell)
                else:
                    launch_host_func(self.side, st.fn_address, st.address)
                cpu_out.copy_(st.out[:T], non_blocking=True)
        elif self.cpu_branch:
            self._cpu_branch_sync(x, cpu_out)
        w13, w2 = c.banks
        self._gather_fills(o.meta, o.fill_fid, o.fill_slot, self.pool.w13, self.pool.w2, w13, w2)
        routed = self.routed[:T]
        self._expert_gemv(x, o.slot_tk, topk_weights, w13, w2, routed, self.act)
        y = routed.sum(dim=1, dtype=torch.float32)  # [T, H]
        if self.cpu_branch:
            if self.step is not None and self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self.side)
            y = y + cpu_out
        return y.to(x.dtype)

    def _cpu_branch_sync(self, x: torch.Tensor, cpu_out: torch.Tensor) -> None:
        """The CPU branch without a host node: read the work list back (a sync) and run it here."""
        o = self.out
        n = int(o.cpu_dims[1])
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        if n:
            offs = o.cpu_offsets[: n + 1].tolist()
            fids = o.cpu_fids[:n].tolist()
            tok, wt = o.cpu_tok.cpu(), o.cpu_wt.cpu()
            work = [(fids[e], tok[offs[e]:offs[e + 1]], wt[offs[e]:offs[e + 1]]) for e in range(n)]
            self.cpu.run(x.to("cpu"), work, out)
        cpu_out.copy_(out)
