"""The decode step of a MoE layer with its control on the device.

Per MoE layer, with no host synchronization, so the whole decode step can be captured in a CUDA graph
(one stream; the CPU branch runs on the native executor's threads, not on a GPU stream):

1. ``route_control`` (one Triton launch): dedupe the step's experts, classify them against the
   residency table, q from the policy parameters held in a device tensor, LRU victims, table
   rewrite; it emits a fixed-shape fill list and the CPU work in the native executor's packed format;
2. hand-off of the CPU branch: two device→pinned-host copies (``x`` and the packed work) and
   :func:`~edgemoe.kernels.doorbell.ring`, a one-program kernel storing the next request number into
   a doorbell in pinned memory; the executor's server thread (``RegisteredStep.serve``), polling it,
   starts computing the CPU experts at once. A layer step without CPU work does not ring (the ring
   reads the work count ``route_control`` wrote), so its wait returns at once and the stale partial
   is not added: an armed CPU branch costs a layer without misses two small copies and two launches;
3. meanwhile on the GPU: ``gather_fills`` (one launch copying every fill's packed row from the pinned
   host pool's byte bank into its slot, zero-copy) and ``expert_gemv`` (hits and fills over the cache
   bank's ``w13`` / ``w2`` section views, every (token, k) route in its own row of ``routed [T, k, H]``);
4. join: :func:`~edgemoe.kernels.doorbell.wait` polls the doorbell's done word, then the
   executor's float32 partial is copied in and ``out = Σ_k routed (fixed order, float32) + partial``.

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

import torch

from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.compute import kernel_reason, quant_slots, swiglu_oai_args
from edgemoe.experts.cpu_executor import CpuExecutor
from edgemoe.experts.policy import ExpertPolicy
from edgemoe.experts.pool import HostExpertPool


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

    The experts' activation is ``pool.activation`` (SiLU SwiGLU, or gpt-oss's clamped SwiGLU); their biases,
    if any, are the cache slots' bias sections.

    Raises:
        ValueError: a cache whose rows the kernels do not read (:func:`~edgemoe.experts.compute.kernel_reason`),
            or ``cache.num_experts`` is not ``num_experts`` (its reuse rows would be wrong).

    Attributes:
        counters: ``[4]`` int64 on the device: decode (hits, misses, fills, cpu) since creation.
        cpu_branch: whether the CPU branch is enqueued at all (``False`` when every expert is resident,
            or when every step's misses fit the evictable slots and the policy fills them all).
        fills: whether ``gather_fills`` is launched (``False`` when every expert is resident).
    """

    def __init__(self, pool: HostExpertPool, cache: ExpertCache, policy: ExpertPolicy, cpu_executor: CpuExecutor,
                 num_experts: int, top_k: int, max_tokens: int):
        from edgemoe.kernels import doorbell
        from edgemoe.kernels.expert_gemv import expert_gemv, expert_gemv_quant
        from edgemoe.kernels.gather import gather_fills
        from edgemoe.kernels.route_control import RouteOutputs, route_control

        if (reason := kernel_reason(cache.layout)) is not None:
            raise ValueError(f"the device decode kernels do not read these {cache.layout.format.value} expert rows: "
                             f"{reason}")
        self._route_control, self._gather_fills = route_control, gather_fills
        self._expert_gemv, self._expert_gemv_quant = expert_gemv, expert_gemv_quant
        self._ring, self._wait = doorbell.ring, doorbell.wait
        self.pool, self.cache, self.top_k, self.max_tokens = pool, cache, top_k, max_tokens
        if cache.num_experts != num_experts:
            raise ValueError(f"the expert cache counts {cache.num_experts} experts per layer, the model {num_experts} "
                             "(ExpertCache(num_experts=...))")
        self.num_experts = num_experts
        self.swiglu_oai = swiglu_oai_args(pool.activation)
        self.biases = (cache.view("b13"), cache.view("b2")) if cache.layout.has_bias else None  # slots' sections
        dev = self.device = cache.device
        P = max_tokens * top_k
        H, I = pool.hidden, pool.intermediate
        self.out = RouteOutputs.empty(P, dev)
        dt = cache.compute_dtype
        self.act = torch.zeros(P, I, dtype=dt, device=dev)  # [P, I] SiLU(gate)·up scratch
        self.routed = torch.zeros(max_tokens, top_k, H, dtype=dt, device=dev)  # [T, k, H]
        self.counters = torch.zeros(4, dtype=torch.int64, device=dev)
        self.rule = policy
        self.policy = torch.zeros(3, dtype=torch.float64, device=dev)  # [3] (num, den, q_min) of a one-rule policy
        self.fill_table = policy.fill_table().to(dev) if policy.per_layer else None  # [L, M + 1] int32
        self.push_policy()
        num, den, q_min = (0.0, 1.0, 0.0) if policy.per_layer else policy.fill_rule()
        evictable = min(cache.evictable([], layer) for layer in range(cache.num_layers))  # per victim range
        all_resident = int((cache.owner_of >= 0).sum()) >= pool.num_ids  # e.g. static with every layer placed
        fills_all = num >= den and q_min == 0 and not policy.online  # an online policy may switch
        self.cpu_branch = not (all_resident or (fills_all and evictable >= P))
        self.fills = not all_resident  # every expert resident: route_control never emits a fill
        self.cpu = cpu_executor
        self.step = None  # RegisteredStep of the native executor
        self.cpu_out = torch.zeros(max_tokens, H, dtype=torch.float32, device=dev)  # [T, H] CPU partial
        self.cuda = dev.type == "cuda"
        self.seq = torch.zeros(1, dtype=torch.int64, device=dev)  # last doorbell request rung
        self.bell = None
        if self.cpu_branch and cpu_executor.registers_steps:
            x_dtype = dt if dt in (torch.float32, torch.bfloat16) else torch.float32
            self.step = cpu_executor.make_step(max_tokens, P, P, x_dtype=x_dtype, zero_out=True, pin_memory=self.cuda)
            self.bell = self.step.serve(pin_memory=self.cuda)
        self._seen = (0, 0)  # waits given up and executor failures already reported by check()
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
        ``route_control`` launch under fill-all, without reuse accounting, into its own buffers and
        counters, then ``gather_fills``). Predicted experts that are resident count as hits there and
        have their recency refreshed. The copies are in stream order with the step's other work.
        """
        c, o = self.cache, self.prefetch_out
        T = pred.shape[0]
        self._route_control(pred.contiguous(), self._ones[:T], moe_layer * self.num_experts, c.slot_of, c.owner_of,
                            c.last_used, c.pinned, c.clock, self._fill_all, self.prefetch_counters, o,
                            slots=c.victim_range(moe_layer))
        self._gather_fills(o.meta, o.fill_fid, o.fill_slot, self.pool.bank, c.bank)

    def push_policy(self) -> None:
        """Copy the policy's current rule (or per-layer table) into the device tensors the control reads
        (between steps; a captured graph reads the same tensors)."""
        if self.fill_table is not None:
            self.fill_table.copy_(self.rule.fill_table())
        else:
            self.policy.copy_(torch.tensor(self.rule.fill_rule(), dtype=torch.float64))

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
            raise RuntimeError(f"{new[0]} CPU-branch waits gave up: the native executor's server did not answer "
                               f"({self.step.served} steps served)")
        if new[1]:
            raise RuntimeError(f"{new[1]} CPU-branch steps failed in the native executor "
                               f"(last status {self.step.status})")

    def close(self) -> None:
        """Stop the CPU branch's server thread (if any) and free its registered step; a later
        :meth:`forward` runs the CPU branch synchronously."""
        if self.step is not None:
            self.step.close()
            self.step = self.bell = None

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
        if self.cpu_branch and self.step is not None:  # hand-off first: the fills below hold every SM
            self.step.x[:T].copy_(x, non_blocking=True)
            self.step.pack.copy_(o.cpu_pack, non_blocking=True)
            self._ring(self.seq, self.bell, work=o.meta[3:])  # rings only when this layer has CPU work
        elif self.cpu_branch:
            self._cpu_branch_sync(x, cpu_out)
        if self.fills:
            self._gather_fills(o.meta, o.fill_fid, o.fill_slot, self.pool.bank, c.bank)
        routed = self.routed[:T]
        if c.layout.format.dense:
            self._expert_gemv(x, o.slot_tk, topk_weights, c.view("w13"), c.view("w2"), routed, self.act,
                              self.swiglu_oai, self.biases)
        else:  # packed codes and scales of the same slot rows, dequantized in registers
            self._expert_gemv_quant(x, o.slot_tk, topk_weights, quant_slots(c.layout, c.bank), routed, self.act,
                                    self.swiglu_oai, self.biases)
        y = routed.sum(dim=1, dtype=torch.float32)  # [T, H]
        if self.cpu_branch:
            if self.step is not None:
                self._wait(self.seq, self.bell)  # returns at once when the ring was skipped
                cpu_out.copy_(self.step.out[:T], non_blocking=True)
                y = torch.where(o.meta[3] > 0, y + cpu_out, y)  # without CPU work the partial is a stale one
            else:
                y = y + cpu_out
        return y.to(x.dtype)

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
