"""The decode step of a MoE layer with its control on the device.

Per MoE layer, with no host synchronization, so the whole decode step can be captured in a CUDA graph
(one stream; the CPU branch runs on the native executor's threads, not on a GPU stream):

1. ``route_control`` (one Triton launch): dedupe the step's experts, classify them against the
   residency table, q from the policy parameters held in a device tensor, LRU victims, table
   rewrite; it emits a fixed-shape fill list and the CPU work in the native executor's packed format;
2. hand-off of the CPU branch: :func:`~edgemoe.kernels.cpu_handoff.handoff` (one program) stores ``x``
   and the packed work straight into the registered step's pinned host buffers, fences them and rings
   the doorbell (:mod:`edgemoe.kernels.doorbell`); the executor's server thread
   (``RegisteredStep.serve``), polling it, starts computing the CPU experts at once. A layer step without
   CPU work (the count ``route_control`` wrote) stores and rings nothing: an armed CPU branch costs a
   layer without misses two launches that return at once;
3. meanwhile on the GPU: ``gather_fills`` (one launch copying every fill's packed row from the pinned
   host pool's byte bank into its slot, zero-copy) and ``expert_gemv`` (hits and fills over the cache
   bank's ``w13`` / ``w2`` section views, every (token, k) route in its own row of ``routed [T, k, H]``);
4. join: ``y = Σ_k routed`` (float32, in the order of ``routed.sum(dim=1, dtype=torch.float32)`` on CUDA;
   summed by the last of each token's routes in ``expert_gemv``'s down launch, and rounded there to the
   model dtype when no CPU partial follows), then :func:`~edgemoe.kernels.cpu_handoff.collect`:
   after a hand-off it waits for the executor's answer and adds its float32 partial (read from pinned
   host memory), and casts to the model dtype. The wait is collect's own polling of the done word
   (``wait_mode="kernel"``, holding an SM meanwhile), or, before collect,
   :func:`~edgemoe.kernels.doorbell.wait_stream_op` (``"stream-op"``: a ``cuStreamWaitValue32`` on the
   release word, which waits in the GPU's front end, and a write resetting it; collect then finds the
   answer at its first look; see :func:`resolve_doorbell_wait`).

The ring is enqueued before the fills on purpose: ``gather_fills`` is a persistent grid that
occupies every SM until the last fill row is copied, so a hand-off placed on a second stream
(as the first version did, with a ``cudaLaunchHostFunc`` node) could not start until the fills
were done and the two branches ran one after the other (measured on an H200: ``docs/benchmarks/decode.md``).

Without CUDA (tests run the Triton kernels in the interpreter on the CPU) the same sequence runs in
program order, with the server thread on the other side of the doorbell. The CPU branch needs the
native executor; with the torch-ops executor it reads the work list back to the host (a sync) and
the step cannot be captured.

``expert_gemv`` reads float rows (bf16 / f16 / float32) through the bank's ``w13`` / ``w2`` views; for FP8
block, MXFP4 and NVFP4 rows ``expert_gemv_quant`` reads the packed codes and scales of the same slot rows and
dequantizes them in registers (``edgemoe.experts.compute.quant_slots``); both compute SiLU SwiGLU or gpt-oss's
clamped SwiGLU with the slots' bias sections. Either way a fill moves the packed
row, and ``fill-all`` is bit-identical to all-resident: the same kernel reads the same slot bytes, and a
route's output depends on its own slot only. A layout neither kernel reads
(:func:`~edgemoe.experts.compute.kernel_reason`) decodes on the eager path (``ExpertRuntime`` says why in its
``decode_path_reason``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from edgemoe.config import DOORBELL_WAITS, JOIN_LATENESS
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.compute import kernel_reason, quant_slots, swiglu_oai_args
from edgemoe.experts.cpu_executor import CpuExecutor
from edgemoe.experts.policy import ExpertPolicy
from edgemoe.experts.pool import HostExpertPool

log = logging.getLogger(__name__)

ARMED_BRANCH_S = 8e-6
"""Seconds an armed CPU branch costs a CUDA decode layer step without CPU work (its hand-off and join
launches), told to the policy (:meth:`ExpertPolicy.price_armed_branch`). Estimated from runs on the H200
host, Qwen3-30B-A3B geometry (48 MoE layers, 16 GB cache, nearly every expert hitting): policies that
keep the branch armed ran 7-13 µs per layer step slower than ``fill-all``, which drops it."""

AUTO_DOORBELL_WAIT = "kernel"
"""What ``auto`` resolves to: the polling kernel, the wait the decode benchmarks measured
(``docs/benchmarks/decode.md``); ``stream-op`` is taken only when named (``benchmarks/doorbell_wait.py``
measures both on a GPU: wake-up latency, the cost to concurrent GPU work, tokens/s)."""


def resolve_doorbell_wait(requested: str, device: torch.device) -> tuple[str, str]:
    """The doorbell wait the device decode path uses, and a phrase for the start-up summary.

    Args:
        requested: ``doorbell_wait`` (:data:`DOORBELL_WAITS`): ``kernel`` (a one-program polling
            kernel), ``stream-op`` (stream memory operations, CUDA driver 11.7 or later) or ``auto``
            (:data:`AUTO_DOORBELL_WAIT`).
        device: the compute device.

    Returns:
        ``(mode, phrase)``: ``mode`` in ``edgemoe.kernels.doorbell.WAIT_MODES``.

    Raises:
        ValueError: an unknown mode, or ``stream-op`` where the driver cannot enqueue stream memory
            operations on ``device`` (the message says why).
    """
    from edgemoe.kernels import cuda_driver

    if requested not in DOORBELL_WAITS:
        raise ValueError(f"doorbell_wait {requested!r}: choose one of {', '.join(DOORBELL_WAITS)}")
    if requested == "auto":
        return AUTO_DOORBELL_WAIT, f"{AUTO_DOORBELL_WAIT} (auto)"
    if requested == "stream-op" and (why := cuda_driver.unavailable_reason(device)) is not None:
        raise ValueError(f"doorbell_wait stream-op: {why}; use --doorbell-wait kernel")
    return requested, requested


class DeviceDecode:
    """Buffers and launches of the device-controlled decode step, shared by all MoE layers.

    Layers run one after another, so one set of buffers serves every layer (and every batch size up
    to ``max_tokens``); a CUDA graph captured over :meth:`forward` replays with them.

    Args:
        pool: host expert pool (pinned, so the device reads it at its host address).
        cache: the expert cache; its tables and ``clock`` live on the compute device.
        policy: gives the device policy parameters: ``fill_rule()`` as ``[3]`` float64, or a
            ``per_layer`` policy's ``fill_table()`` ``[L, M + 1]`` int32 (:meth:`push_policy` refreshes them).
        cpu_executor: the CPU executor (native: the CPU branch runs without a host sync; torch: a sync).
        num_experts: ``E``, experts per MoE layer.
        top_k: routed experts per token.
        max_tokens: largest decode batch.
        wait_mode: how the device waits for the CPU branch: ``kernel`` or ``stream-op``
            (:func:`resolve_doorbell_wait`; stream-op needs CUDA).
        lateness: how each join is counted in :attr:`join_stats` (``JOIN_LATENESS``): ``yes-no`` (the GPU found
            the CPU branch still running) or ``graded`` (CUDA with the kernel wait and the native executor: by how
            long against :attr:`join_limits`, in halves; :func:`~edgemoe.kernels.cpu_handoff.collect`).

    The experts' activation is ``pool.activation`` (SiLU SwiGLU, or gpt-oss's clamped SwiGLU); their biases,
    if any, are the cache slots' bias sections.

    Raises:
        ValueError: a cache whose rows the kernels do not read (:func:`~edgemoe.experts.compute.kernel_reason`),
            ``cache.num_experts`` is not ``num_experts`` (its reuse rows would be wrong), or a ``wait_mode``
            this device cannot run.

    Attributes:
        counters: ``[4]`` int64 on the device: decode (hits, misses, fills, cpu) since creation.
        join_stats: ``[L, 2]`` int64 on the device, per MoE layer: hand-offs to the native executor and
            those whose join found the CPU branch still running, since creation (graded: in halves, see
            :attr:`late_unit`).
        join_limits: ``[L, 2]`` int64 nanoseconds on the device (graded lateness): the wait and slack limits,
            one fill and one CPU expert as the policy prices them (:meth:`ExpertPolicy.join_limits`), one pair for
            every layer, refreshed by :meth:`push_join_limits` (between steps; :meth:`push_policy` calls it); ``None``
            when joins are counted yes/no.
        late_unit: counts of :attr:`join_stats`'s second column per late join (1 yes-no, 2 graded).
        cpu_branch: whether the CPU branch exists at all (``False`` when every expert is resident, or when
            every step's misses fit the evictable slots and the policy fills them all).
        armed: whether steps enqueue it now (:meth:`push_policy`); the decode graphs are keyed by it.
        fills: whether ``gather_fills`` is launched (``False`` when every expert is resident).
        wait_mode: ``kernel`` or ``stream-op``.
    """

    def __init__(self, pool: HostExpertPool, cache: ExpertCache, policy: ExpertPolicy, cpu_executor: CpuExecutor,
                 num_experts: int, top_k: int, max_tokens: int, wait_mode: str = "kernel",
                 lateness: str = "yes-no"):
        from edgemoe.kernels import cuda_driver, doorbell
        from edgemoe.kernels.cpu_handoff import collect, handoff
        from edgemoe.kernels.expert_gemv import expert_gemv, expert_gemv_quant, route_sum_counters
        from edgemoe.kernels.gather import gather_fills
        from edgemoe.kernels.route_control import RouteOutputs, route_control

        if (reason := kernel_reason(cache.layout)) is not None:
            raise ValueError(f"the device decode kernels do not read these {cache.layout.format.value} expert rows: "
                             f"{reason}")
        self._route_control, self._gather_fills = route_control, gather_fills
        self._expert_gemv, self._expert_gemv_quant = expert_gemv, expert_gemv_quant
        self._handoff, self._collect, self._wait_stream_op = handoff, collect, doorbell.wait_stream_op
        if wait_mode not in doorbell.WAIT_MODES:
            raise ValueError(f"wait_mode {wait_mode!r}: choose one of {', '.join(doorbell.WAIT_MODES)}")
        if wait_mode == "stream-op" and (why := cuda_driver.unavailable_reason(cache.device)) is not None:
            raise ValueError(f"wait_mode stream-op: {why}")
        self.wait_mode = wait_mode
        if lateness not in JOIN_LATENESS:
            raise ValueError(f"lateness {lateness!r}: choose one of {', '.join(JOIN_LATENESS)}")
        if lateness == "graded" and (cache.device.type != "cuda" or wait_mode != "kernel"
                                     or not cpu_executor.registers_steps):
            raise ValueError("graded lateness needs a CUDA device, the kernel doorbell wait and the native CPU "
                             "executor (the join times itself on the GPU's clock against the server's step time)")
        self.lateness = lateness
        self.late_unit = 2 if lateness == "graded" else 1
        self.pool, self.cache, self.top_k, self.max_tokens = pool, cache, top_k, max_tokens
        if cache.num_experts != num_experts:
            raise ValueError(f"the expert cache counts {cache.num_experts} experts per layer, the model {num_experts} "
                             "(ExpertCache(num_experts=...))")
        self.num_experts = num_experts
        self.swiglu_oai = swiglu_oai_args(pool.activation)
        dev = self.device = cache.device
        P = max_tokens * top_k
        H, I = pool.hidden, pool.intermediate
        self.out = RouteOutputs.empty(P, dev)
        dt = cache.compute_dtype
        self.act = torch.zeros(P, I, dtype=dt, device=dev)  # [P, I] SiLU(gate)·up scratch
        self.routed = torch.zeros(max_tokens, top_k, H, dtype=dt, device=dev)  # [T, k, H]
        self.route_sums = route_sum_counters(max_tokens, H, dev)  # arrival counters of the in-kernel Σ_k
        self.counters = torch.zeros(4, dtype=torch.int64, device=dev)
        self.rule = policy
        self.policy = torch.zeros(3, dtype=torch.float64, device=dev)  # [3] (num, den, q_min) of a one-rule policy
        self.fill_table = policy.fill_table().to(dev) if policy.per_layer else None  # [L, M + 1] int32
        num, den, q_min = (0.0, 1.0, 0.0) if policy.per_layer else policy.fill_rule()
        evictable = min(cache.evictable([], layer) for layer in range(cache.num_layers))  # per victim range
        all_resident = int((cache.owner_of >= 0).sum()) >= pool.num_ids  # e.g. static with every layer placed
        fills_all = num >= den and q_min == 0 and not policy.online  # an online policy may switch
        # a layer step misses at most min(P, E) experts: filling every miss never needs the CPU when every victim
        # range holds that many (a cache of every expert split per layer holds E per layer, fewer than a batch's P)
        holds_misses = evictable >= min(P, num_experts)
        self.cpu_branch = not (all_resident or (fills_all and holds_misses))
        self._disarmable = self.cpu_branch and holds_misses
        if self._disarmable and dev.type == "cuda":
            policy.price_armed_branch(ARMED_BRANCH_S)
        self.armed = self.cpu_branch
        self.fills = not all_resident  # every expert resident: route_control never emits a fill
        self.cpu = cpu_executor
        self.step = None  # RegisteredStep of the native executor
        self.cpu_out = torch.zeros(max_tokens, H, dtype=torch.float32, device=dev)  # [T, H] CPU partial
        self.cuda = dev.type == "cuda"
        self.seq = torch.zeros(1, dtype=torch.int64, device=dev)  # last doorbell request rung
        self.join_stats = torch.zeros(cache.num_layers, 2, dtype=torch.int64, device=dev)  # [L, (hand-offs, late)]
        graded = lateness == "graded"
        self.join_limits = torch.zeros(cache.num_layers, 2, dtype=torch.int64, device=dev) if graded else None
        self.ring_ns = torch.zeros(1, dtype=torch.int64, device=dev) if graded else None  # the last ring's time
        self._limits_ns: list[int] | None = None  # the pair last copied into join_limits (push_join_limits)
        self.push_join_limits()
        self.bell = None
        self._release_address: int | None = None  # device address of the release word (stream-op)
        self._release_word: torch.Tensor | None = None  # [1] int32 view of it, stored by a hand-off without work
        if self.cpu_branch and cpu_executor.registers_steps:
            x_dtype = dt if dt in (torch.float32, torch.bfloat16) else torch.float32
            self.step = cpu_executor.make_step(max_tokens, P, P, x_dtype=x_dtype, zero_out=True, pin_memory=self.cuda)
            stream_op = wait_mode == "stream-op"
            self.bell = self.step.serve(pin_memory=self.cuda,
                                        release_timeout_s=doorbell.RELEASE_TIMEOUT_S if stream_op else None)
            if stream_op:
                self._release_word = doorbell.release_word(self.bell)
                self._release_address = cuda_driver.host_device_pointer(self._release_word, dev)
        self._seen = (0, 0)  # waits given up and executor failures already reported by check()
        self.push_policy()
        self.prefetch_out: RouteOutputs | None = None
        self.prefetch_counters: torch.Tensor | None = None  # [4] int64: (hits, misses, fills, -) of predictions
        self._fill_all = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64, device=dev)
        self._ones = torch.ones(max_tokens, top_k, dtype=torch.float32, device=dev)  # [T, k] placeholder weights

    def set_prefetch(self, on: bool) -> None:
        """Allocate (or drop) the buffers of :meth:`prefetch` (next-layer prefetch on or off)."""
        from edgemoe.kernels.route_control import RouteOutputs

        self.prefetch_out = RouteOutputs.empty(self.max_tokens * self.top_k, self.device) if on else None
        self.prefetch_counters = torch.zeros(4, dtype=torch.int64, device=self.device) if on else None

    def prefetch(self, moe_layer: int, pred: torch.Tensor) -> None:
        """Fill the experts ``pred [T, k]`` (int64, within MoE layer ``moe_layer``) that are not resident, into
        least recently used slots of the layer's victim range, on the device (no host sync: one
        ``route_control`` launch under fill-all into its own buffers and counters, then ``gather_fills``).
        Predicted experts that are resident count as hits there and have their recency refreshed. Its fills pair
        with the residents they displace as the cache's ``admit`` pairs them (the reuse tables stay those of the
        eager path), and nothing is counted: predictions are not requests. The copies are in stream order with
        the step's other work.
        """
        c, o = self.cache, self.prefetch_out
        T = pred.shape[0]
        self._route_control(pred.contiguous(), self._ones[:T], moe_layer * self.num_experts, c.slot_of, c.owner_of,
                            c.last_used, c.pinned, c.clock, self._fill_all, self.prefetch_counters, o,
                            slots=c.victim_range(moe_layer), moe_layer=moe_layer,
                            reuse=(c.ghost_slot, c.slot_ghost, c.reuse), num_experts=self.num_experts,
                            count_reuse=False)
        self._gather_fills(o.meta, o.fill_fid, o.fill_slot, self.pool.bank, c.bank)

    def push_policy(self) -> None:
        """Copy the policy's current rule (or per-layer table) into the device tensors the control reads
        (between steps; a captured graph reads the same tensors), and arm or disarm the CPU branch: while
        an online policy's rule fills every miss and the victim ranges hold a step's misses, steps are
        enqueued (and captured) without it, as under ``fill-all``."""
        if self.fill_table is not None:
            self.fill_table.copy_(self.rule.fill_table())
        else:
            self.policy.copy_(torch.tensor(self.rule.fill_rule(), dtype=torch.float64))
        self.push_join_limits()
        armed = self.cpu_branch and not (self._disarmable and self.rule.fills_every_miss())
        if armed != self.armed:
            log.info("CPU branch %s: the %s policy's rule %s", "armed" if armed else "disarmed", self.rule.name,
                     "sends misses to the CPU" if armed else "fills every miss")
        self.armed = armed

    def push_join_limits(self) -> None:
        """Copy the policy's join limits (:meth:`ExpertPolicy.join_limits`, seconds) into :attr:`join_limits` (ns),
        where joins are graded; between steps (the balance controller's level moves them with or without a new
        table). Copies only limits that changed: the copy from host memory waits for the device."""
        if self.join_limits is not None and (limits := self.rule.join_limits()) is not None:
            ns = [round(t * 1e9) for t in limits]
            if ns != self._limits_ns:
                self.join_limits.copy_(torch.tensor(ns, dtype=torch.int64))
                self._limits_ns = ns

    @property
    def can_disarm(self) -> bool:
        """Whether steps may run without the CPU branch at times: an online policy whose rule can come to
        fill every miss, with victim ranges that hold a step's misses."""
        return self._disarmable and self.rule.online

    @contextmanager
    def arming(self, armed: bool):
        """Within: steps are enqueued with (``armed``) or without the CPU branch, to capture both variants
        of a decode step ahead of their use; the previous state is restored on exit."""
        was, self.armed = self.armed, bool(armed)
        try:
            yield
        finally:
            self.armed = was

    @property
    def counts_joins(self) -> bool:
        """Whether :attr:`join_stats` is kept: hand-offs through the doorbell with the kernel wait (a
        ``stream-op`` wait, or the synchronous torch-executor branch, has no lateness to count)."""
        return self.step is not None and self._release_address is None

    @property
    def capturable(self) -> bool:
        """Whether :meth:`forward` has no host synchronization (CUDA, and a native CPU branch if any)."""
        return self.cuda and (not self.cpu_branch or self.step is not None)

    def counter_dict(self) -> dict[str, int]:
        """The device counters as ``{hits, misses, fills, cpu}`` (deduplicated experts; one host read)."""
        h, m, f, c = self.counters.tolist()
        return {"hits": h, "misses": m, "fills": f, "cpu": c}

    def check(self) -> None:
        """After the step's work has completed: raise if a CPU branch of it went wrong (host reads only).

        Raises:
            RuntimeError: a doorbell wait gave up (the executor's server did not answer) or the
                native executor failed a step since the last check; those layers' outputs lack
                their CPU part.
        """
        if self.step is None:
            return
        gave_up, failed = int(self.bell[1]), self.step.failed
        new = (gave_up - self._seen[0], failed - self._seen[1])
        self._seen = (gave_up, failed)
        if new[0]:
            raise RuntimeError(f"{new[0]} CPU-branch waits gave up ({self.wait_mode} wait): the native executor's "
                               f"server did not answer ({self.step.served} steps served)")
        if new[1]:
            raise RuntimeError(f"{new[1]} CPU-branch steps failed in the native executor "
                               f"(last status {self.step.status})")

    def close(self) -> None:
        """Stop the CPU branch's server thread (if any) and free its registered step; a later
        :meth:`forward` runs the CPU branch synchronously."""
        if self.step is not None:
            self.step.close()
            self.step = self.bell = self._release_address = self._release_word = None

    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed-expert output of one MoE layer's decode step.

        Args:
            moe_layer: MoE layer ordinal.
            x: ``[T, H]`` hidden states on the device, ``T <= max_tokens``.
            topk_ids: ``[T, k]`` int64 expert indices within the layer.
            topk_weights: ``[T, k]`` router weights.

        Returns:
            ``[T, H]`` in ``x.dtype``.
        """
        T = topk_ids.shape[0]
        c, o = self.cache, self.out
        self._route_control(topk_ids, topk_weights, moe_layer * self.num_experts, c.slot_of, c.owner_of, c.last_used,
                            c.pinned, c.clock, self.policy, self.counters, o, fill_table=self.fill_table,
                            moe_layer=moe_layer, reuse=(c.ghost_slot, c.slot_ghost, c.reuse),
                            num_experts=self.num_experts, slots=c.victim_range(moe_layer))
        cpu_out = self.cpu_out[:T]
        if self.armed and self.step is not None:  # hand-off first: the fills below hold every SM
            self._handoff(x, self.step.x, o.cpu_pack, self.step.pack, o.meta[3:], self.seq, self.bell,
                          release=self._release_word, ring_ns=self.ring_ns)
        elif self.armed:
            self._cpu_branch_sync(x, cpu_out)
        if self.fills:
            self._gather_fills(o.meta, o.fill_fid, o.fill_slot, self.pool.bank, c.bank)
        routed = self.routed[:T]
        # the slots' sections, viewed per step as the weights are: nothing here outlives the bank (a rebuilt cache
        # releases it before allocating the next, so a view kept would hold two banks at once)
        biases = (c.view("b13"), c.view("b2")) if c.layout.has_bias else None
        # y = Σ_k routed in float32, summed in the down launch: rounded there to x.dtype unless a CPU partial
        # is still to be added (in float32)
        y = torch.empty(T, x.shape[1], dtype=torch.float32 if self.armed else x.dtype, device=x.device)  # [T, H]
        if c.layout.format.dense:
            self._expert_gemv(x, o.slot_tk, topk_weights, c.view("w13"), c.view("w2"), routed, self.act,
                              self.swiglu_oai, biases, y=y, counters=self.route_sums)
        else:  # packed codes and scales of the same slot rows, dequantized in registers
            self._expert_gemv_quant(x, o.slot_tk, topk_weights, quant_slots(c.layout, c.bank), routed, self.act,
                                    self.swiglu_oai, biases, y=y, counters=self.route_sums)
        if self.armed and self.step is not None:  # waits, and adds the partial, only after a hand-off
            if self._release_address is not None:  # released at once by a hand-off without CPU work
                self._wait_stream_op(self._release_address, torch.cuda.current_stream(self.device).cuda_stream)
            # the stream-op wait leaves collect nothing to wait for: no lateness to count, and a give-up
            # already counted by the server's watchdog
            kernel_wait = self._release_address is None
            return self._collect(y, self.step.out, o.meta[3:], self.seq, self.bell, x.dtype,
                                 stats=self.join_stats if kernel_wait else None, layer=moe_layer,
                                 count_give_up=kernel_wait, ring_ns=self.ring_ns, limits=self.join_limits)
        if self.armed:
            return (y + cpu_out).to(x.dtype)
        return y

    def _cpu_branch_sync(self, x: torch.Tensor, cpu_out: torch.Tensor) -> None:
        """The CPU branch without a registered native step (the torch executor): read the work list
        back (a sync) and run it here."""
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
