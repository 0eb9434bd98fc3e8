"""Hybrid routed-expert execution: cache hits and fills on the device, the rest on the CPU.

Per MoE layer and step:

1. dedupe the step's routed experts and classify them against the residency table: hits H, misses M;
2. ``q = policy(m)`` clamped to the slots that may be evicted this step (hits are never evicted);
3. the ``q`` misses routed by the most tokens are filled into LRU victim slots (host→device copies);
   steps 1-3 are :func:`plan_step`, shared with the routing-trace replay;
4. the other ``m − q`` run on the CPU executor from host memory, concurrently with the device work
   (device kernels are enqueued first and run asynchronously while the CPU computes);
5. ``out = Σ_routes weight · expert(x)``: device and CPU partials are accumulated in float32 and added.

Prefill under a streaming policy streams whole layers through two staging regions of the cache,
copies of layer l+1 overlapping the compute of layer l (``edgemoe.experts.prefill``). When the cache
cannot spare two layers' slots, or the chunk is short, every needed expert is brought through the
cache on demand in *waves* of at most the cache's evictable capacity, so prefill never exceeds the
budget however small the cache is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgemoe.core import Phase
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.compute import expert_biases, gated_activation, gather_expert_weights, run_sorted_experts
from edgemoe.experts.cpu_executor import CpuExecutor
from edgemoe.experts.policy import ExpertPolicy
from edgemoe.experts.pool import HostExpertPool
from edgemoe.experts.prefill import PrefillStreamer

PAIR_PATH_MAX_ROUTES = 64  # decode batches with at most this many (token, k) routes use the batched path
SMALL_GROUPING_ROUTES = 256  # routes grouped by expert in Python up to this many (a decode step): no tensor ops


def group_routes(flat: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    """The routes of a step grouped by expert: the distinct ids ascending, each one's route count, and the
    routes' stable order ``[P]`` int64 (routes of one id in ascending (token, k) order), as
    ``torch.unique(flat, return_counts=True)`` and ``flat.reshape(-1).argsort(stable=True)`` give them.
    A decode step's few routes are grouped in Python (three torch operations cost more than the work).

    Args:
        flat: ``[T, k]`` int64 flat expert ids on the CPU.
    """
    P = flat.numel()
    if P > SMALL_GROUPING_ROUTES:
        fids, counts = torch.unique(flat, return_counts=True)
        return fids.tolist(), counts.tolist(), flat.reshape(-1).argsort(stable=True)
    ids = flat.reshape(-1).tolist()
    order = sorted(range(P), key=ids.__getitem__)  # sorted() is stable
    fids: list[int] = []
    counts: list[int] = []
    for i in order:
        if fids and fids[-1] == ids[i]:
            counts[-1] += 1
        else:
            fids.append(ids[i])
            counts.append(1)
    return fids, counts, torch.tensor(order, dtype=torch.int64)


@dataclass
class StepPlan:
    """What one MoE layer's step does with its routed experts (tables already updated).

    Attributes:
        hits: ``{flat_id: slot}`` resident when routed.
        waves: fills, as lists of ``(flat_id, slot)``; each wave's copies must follow the previous
            wave's compute (decode has at most one wave; prefill streams several through a small cache).
        cpu: flat ids computed by the CPU executor.
    """

    hits: dict[int, int]
    waves: list[list[tuple[int, int]]]
    cpu: list[int]


def plan_step(cache: ExpertCache, policy: ExpertPolicy, tokens_per_expert: dict[int, int], phase: Phase,
              step: int) -> StepPlan:
    """Classify a step's routed experts, choose fills and LRU victims, and update the residency tables.

    This is the whole control of the hybrid decode step: hits refresh recency; ``q = policy(m, layer)``
    clamped to the slots evictable this step; the most-routed misses fill; victims are the least recently
    used slots of the layer's victim range (``ExpertCache.victim_range``) not needed this step. Prefill under
    a streaming policy fills every miss, in waves of at most the evictable slots. Decode steps update
    the cache's reuse accounting (``ExpertCache.count_reuse``). The engine executes the plan; the
    routing-trace replay (``edgemoe.bench.replay``) runs this same function without data.

    Args:
        cache: the expert cache (tables are mutated; counters of ``phase`` are incremented).
        policy: decides q (decode) and whether prefill streams.
        tokens_per_expert: ``{flat_id: tokens routed to it this step}``; its keys are the step's experts.
        phase: prefill or decode.
        step: the LRU clock (model step).
    """
    counters = cache.counters[phase.value]
    if cache.num_slots == 0:  # nothing resident, nothing to fill (CPU-only, cpu-all's empty cache): the
        # general path below reduces to this without touching the tables (no slot, so no ghost either)
        cpu = sorted(tokens_per_expert, key=lambda f: -tokens_per_expert[f])  # most-routed first
        counters.misses += len(cpu)
        counters.cpu += len(cpu)
        return StepPlan({}, [], cpu)
    hits, misses = cache.lookup(list(tokens_per_expert))
    counters.hits += len(hits)
    counters.misses += len(misses)
    cache.touch(list(hits.values()), step)
    misses.sort(key=lambda f: -tokens_per_expert[f])  # most-routed first: the costliest on the CPU
    exclude = list(hits.values())
    evictable = cache.evictable(exclude=exclude)
    waves: list[list[tuple[int, int]]] = []
    if phase is Phase.PREFILL and policy.streams_prefill and cache.num_slots > 0:
        pending, cpu = misses, []
        while pending:
            if evictable == 0 and exclude:  # this step's hits fill the cache: they are computed first
                exclude, evictable = [], cache.evictable(exclude=[])
            if evictable == 0:  # every slot pinned: nothing can be streamed
                cpu = pending
                break
            wave, pending = pending[:evictable], pending[evictable:]
            victims = cache.choose_victims(len(wave), exclude)
            waves.append(list(zip(wave, victims)))
            cache.admit_many(wave, victims, step, check=False)  # misses: none resident
            exclude, evictable = [], cache.evictable(exclude=[])
    else:
        layer = next(iter(tokens_per_expert), 0) // cache.num_experts  # a step's experts share one layer
        evictable = cache.evictable(exclude=exclude, layer=layer)
        n_fill = policy.num_fills(len(misses), layer) if policy.admits else 0
        if policy.fills_free_slots:  # a fill into a free slot displaces nothing
            n_fill = max(n_fill, min(len(misses), cache.free_slots(layer)))
        n_fill = min(n_fill, evictable)
        fill, cpu = misses[:n_fill], misses[n_fill:]
        victims = cache.choose_victims(len(fill), exclude, layer) if fill else []
        if phase is Phase.DECODE:
            cache.count_reuse(layer, [*hits, *misses], exclude, victims)
        if fill:
            waves.append(list(zip(fill, victims)))
            cache.admit_many(fill, victims, step, check=False)
    counters.fills += len(misses) - len(cpu)
    counters.cpu += len(cpu)
    return StepPlan(hits, waves, cpu)


class HybridExperts:
    """Owner of the routed-expert path for all MoE layers of one model.

    Args:
        pool: host expert pool (every routed expert).
        cache: device expert cache (its slot bank on the compute device).
        policy: decides q per step.
        cpu: the CPU executor.
        num_experts: ``E`` (experts per MoE layer).
        device: compute device.

    Attributes:
        act: the experts' activation (``pool.activation``; biases, if any, live in the experts' rows).
    """

    def __init__(self, pool: HostExpertPool, cache: ExpertCache, policy: ExpertPolicy, cpu: CpuExecutor,
                 num_experts: int, device: torch.device):
        self.pool, self.cache, self.policy, self.cpu = pool, cache, policy, cpu
        self.num_experts = num_experts
        self.device = torch.device(device)
        self.act = pool.activation
        self.device_decode = None  # DeviceDecode: decode steps with their control on the device (CUDA)
        self.routers: list | None = None  # every MoE layer's router, when next-layer prefetch is on
        self.prefetch_counts = {"prefetched": 0, "prefetch_hits": 0}  # eager path (the device path: prefetched)
        self._prefetched: dict[int, set[int]] = {}  # MoE layer -> ids prefetched for its next decode step
        self.prefill = PrefillStreamer(pool, cache, policy, num_experts, self.device)
        if policy.places_static:
            self.place_static()

    # ------------------------------------------------------------------ placement
    def place_static(self) -> None:
        """Fill the cache with whole MoE layers from the last one backwards and pin them."""
        E, S = self.num_experts, self.cache.num_slots
        ids = []
        for layer in range(self.pool.num_ids // E - 1, -1, -1):
            ids.extend(range(layer * E, (layer + 1) * E))
        ids = ids[:S]
        self.cache.admit_many(ids, list(range(len(ids))), step=0)
        for slot, fid in enumerate(ids):
            self._copy_in(fid, slot)
        self.cache.pinned[: len(ids)] = True

    def _copy_in(self, fid: int, slot: int) -> None:
        """One fill: expert ``fid``'s packed row into slot ``slot`` (one copy, whatever the format)."""
        non_blocking = self.pool.pinned and self.device.type == "cuda"
        self.cache.bank[slot].copy_(self.pool.bank[fid], non_blocking=non_blocking)

    # ------------------------------------------------------------------ next-layer prefetch
    def set_prefetch(self, routers: list | None) -> None:
        """Turn next-layer prefetch on with every MoE layer's router (``MoeBlock.route``: ``(x [T, H], valid
        [T] bool | None) -> (ids [T, k], weights)``, in MoE-layer order), or off with ``None``."""
        self.routers = routers
        if self.device_decode is not None:
            self.device_decode.set_prefetch(routers is not None)

    def prefetch_next(self, moe_layer: int, x: torch.Tensor, batch) -> None:
        """After MoE layer ``moe_layer``'s decode step: apply the next MoE layer's router to this layer's
        hidden state ``x [T, H]`` (its normalized MLP input) and fill the predicted experts of the next
        layer that are not resident (most-predicted first, then the smaller id) into least recently used
        slots of its victim range; resident predicted experts have their recency refreshed and are not
        evicted. Placement only: which experts the next layer computes, and how, does not depend on it.
        Next-layer expert prediction from the current hidden state is the pre-gating of Hwang et al.,
        "Pre-gated MoE" (ISCA 2024). The device path does the same on the device (``DeviceDecode.prefetch``).

        Padding rows of a captured batch predict as row 0. No-op outside decode, without prefetch, after
        the last MoE layer, without cache slots, or under a policy that never fills.
        """
        if (self.routers is None or batch.phase is not Phase.DECODE or moe_layer + 1 >= len(self.routers)
                or self.cache.num_slots == 0 or not self.policy.admits):
            return
        pred, _ = self.routers[moe_layer + 1](x, batch.decode.valid if batch.decode is not None else None)  # [T, k]
        if self.device_decode is not None:
            self.device_decode.prefetch(moe_layer + 1, pred)
            return
        fids, counts = torch.unique(pred.to("cpu", torch.int64) + (moe_layer + 1) * self.num_experts,
                                    return_counts=True)
        tokens = dict(zip(fids.tolist(), counts.tolist()))
        hits, misses = self.cache.lookup(list(tokens))
        self.cache.touch(list(hits.values()), batch.step)
        if not misses:
            return
        misses.sort(key=lambda f: (-tokens[f], f))  # route_control's fill order
        victims = self.cache.choose_victims(len(misses), list(hits.values()), moe_layer + 1)
        self.cache.admit_many(misses[:len(victims)], victims, step=batch.step, check=False)
        for fid, slot in zip(misses, victims):
            self._copy_in(fid, slot)
        self.prefetch_counts["prefetched"] += len(victims)
        self._prefetched[moe_layer + 1] = set(misses[:len(victims)])

    # ------------------------------------------------------------------ forward
    def try_cpu_decode(self, moe_layer: int, x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                       norm_topk_prob: bool, phase: Phase, residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A softmax top-k MoE layer's decode step as one native call where every route runs on the CPU executor
        (no cache slots: a CPU-only engine, or ``cpu-all`` with an empty cache) and its dense kernels take it
        (``DenseKernels.try_moe_decode``: router, routing, experts, residual add); the counters move as
        :meth:`forward`'s would (every expert a miss computed on the CPU). Equal probabilities at the k-th place
        choose the lower expert, as ``TopKRouter`` does on every path.

        Args:
            moe_layer: MoE layer ordinal. x: ``[T, H]`` the MLP input. router_weight: ``[E, H]``.
            top_k, norm_topk_prob: the router's settings. phase: only decode is taken.
            residual: ``[T, H]`` added to the routed output, or ``None``.

        Returns:
            ``(out [T, H] (+ residual), ids [T, k] int64, weights [T, k])``, or ``None``: use the router and
            :meth:`forward`.
        """
        if phase is not Phase.DECODE or self.cache.num_slots or (dense := self.cpu.dense) is None:
            return None
        got = dense.try_moe_decode(x, router_weight, top_k, norm_topk_prob, moe_layer * self.num_experts, residual)
        if got is None:
            return None
        out, ids, weights, n = got
        self._count_cpu_only(phase, n)
        return out, ids, weights

    def _count_cpu_only(self, phase: Phase, n: int) -> None:
        """A step's ``n`` distinct experts, all computed on the CPU without the cache: what :func:`plan_step`
        counts with no slots (each a miss served by the CPU)."""
        counters = self.cache.counters[phase.value]
        counters.misses += n
        counters.cpu += n

    def _run_cpu_only(self, x: torch.Tensor, k: int, topk_weights: torch.Tensor, fids: list[int],
                      counts: list[int], order: torch.Tensor) -> torch.Tensor:
        """Routed output of a step whose every route runs on the CPU executor: ``[T, H]`` in ``x.dtype``.

        ``k`` routes per token, ``topk_weights [T, k]``; ``fids`` the distinct ids ascending, ``counts`` their
        routes and ``order`` the routes grouped by id (:func:`group_routes`). The work is the general path's
        (every expert in ascending id order, its routes in ascending (token, k) order), so the sum is the
        same; it is built from that one stable order of the routes instead of one mask per expert.
        """
        wts = topk_weights.to("cpu").reshape(-1)[order].float()
        out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32)  # [T, H]
        self.cpu.run_grouped(x.to("cpu"), fids, counts, order // k, wts, out)
        return out.to(x.device, x.dtype)

    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                phase: Phase, step: int) -> torch.Tensor:
        """Routed-expert output of one MoE layer.

        Args:
            moe_layer: MoE layer ordinal (0-based among MoE layers).
            x: ``[T, H]`` hidden states on the compute device.
            topk_ids: ``[T, k]`` int64 expert indices within the layer.
            topk_weights: ``[T, k]`` router weights (already normalized as the model requires).
            phase: prefill or decode (selects counters and the streaming rule).
            step: model-step counter, the LRU clock.

        Returns:
            ``[T, H]`` in ``x.dtype``: ``Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t])``.
        """
        if self.prefill.claims(moe_layer, phase, x.shape[0], topk_ids.shape[1], step):  # streamed prefill
            return self.prefill.forward(moe_layer, x, topk_ids, topk_weights)
        if phase is Phase.DECODE and self.device_decode is not None:
            return self.device_decode.forward(moe_layer, x, topk_ids, topk_weights)
        if phase is Phase.DECODE and not self.cache.num_slots and (dense := self.cpu.dense) is not None and (
                got := dense.try_moe_routes(x, topk_ids, topk_weights, self.num_experts,
                                            moe_layer * self.num_experts)) is not None:
            out, n = got  # every route on the CPU executor: grouping, experts and rounding in one native call
            self._count_cpu_only(phase, n)
            return out
        T = x.shape[0]
        flat = topk_ids.to("cpu", torch.int64) + moe_layer * self.num_experts  # [T, k]
        fids, counts, order = group_routes(flat)
        plan = plan_step(self.cache, self.policy, dict(zip(fids, counts)), phase, step)
        if self._prefetched and phase is Phase.DECODE:  # prefetched ids this step routes (and hits)
            self.prefetch_counts["prefetch_hits"] += len(self._prefetched.pop(moe_layer, set()) & plan.hits.keys())
        if not plan.hits and not plan.waves:  # every route on the CPU (CPU-only, cpu-all, an empty cache)
            return self._run_cpu_only(x, flat.shape[1], topk_weights, fids, counts, order)
        if plan.cpu:  # D2H before the device work is enqueued: a copy after it would wait for it
            x_cpu, w_cpu = x.to("cpu"), topk_weights.to("cpu")
        # each (token, k) route's weighted output lands in its own row of ``routed`` and the k rows are
        # summed in a fixed order: the result does not depend on which wave or branch computed a route
        routed = torch.zeros((T, topk_ids.shape[1], x.shape[1]), dtype=self.cache.compute_dtype,
                             device=x.device)  # [T, k, H]
        if phase is Phase.DECODE:  # at most one wave: hits and fills computed together
            fills = plan.waves[0] if plan.waves else []
            for fid, slot in fills:
                self._copy_in(fid, slot)
            placed = {**plan.hits, **dict(fills)}
            if placed and topk_ids.numel() <= PAIR_PATH_MAX_ROUTES:
                self._run_device_pairs(x, topk_weights, flat, placed, routed)
            else:
                self._run_device(moe_layer, x, topk_ids, topk_weights, placed, routed)
        else:  # prefill: hits, then each wave's copies and compute, stream-ordered on the device
            self._run_device(moe_layer, x, topk_ids, topk_weights, plan.hits, routed)
            for wave in plan.waves:
                for fid, slot in wave:
                    self._copy_in(fid, slot)
                self._run_device(moe_layer, x, topk_ids, topk_weights, dict(wave), routed)
        if plan.cpu:  # CPU branch, concurrent with the device work enqueued above
            out_cpu = torch.zeros((T, x.shape[1]), dtype=torch.float32)
            work = []
            for f in sorted(plan.cpu):
                tok, kpos = (flat == f).nonzero(as_tuple=True)  # [n] each
                work.append((f, tok, w_cpu[tok, kpos]))
            self.cpu.run(x_cpu, work, out_cpu)
            if not plan.hits and not plan.waves:  # nothing on the device: routed is all zeros
                return out_cpu.to(x.device, x.dtype)
            return (routed.sum(dim=1, dtype=torch.float32) + out_cpu.to(x.device)).to(x.dtype)
        return routed.sum(dim=1, dtype=torch.float32).to(x.dtype)

    def _run_device_pairs(self, x: torch.Tensor, w: torch.Tensor, flat: torch.Tensor, placed: dict[int, int],
                          routed: torch.Tensor) -> None:
        """Small batches: every (token, k) route in one batched GEMV pair over gathered slot weights
        (float slots gathered as they are, quantized slots dequantized: :func:`gather_expert_weights`).

        Writes every row of ``routed [T, k, H]``; routes whose expert is not on the device (CPU set)
        are computed against slot 0 and zeroed.
        """
        T, k = flat.shape
        slot_tk = torch.tensor([placed.get(f, -1) for f in flat.view(-1).tolist()], dtype=torch.int64)
        valid = (slot_tk >= 0).to(x.device, non_blocking=True)  # [P]
        s = slot_tk.clamp(min=0).to(x.device, non_blocking=True)  # [P]
        c = self.cache
        w13, w2 = gather_expert_weights(c.layout, c.bank, s, c.compute_dtype)  # [P, 2I, H], [P, H, I]
        xp = x.to(w13.dtype).repeat_interleave(k, dim=0)  # [P, H]
        biases = expert_biases(c.layout, c.bank)  # the slots' bias sections, or None
        h = torch.bmm(w13, xp[:, :, None]).squeeze(-1)  # [P, 2I]
        if biases is not None:
            h = h + biases[0].index_select(0, s).to(h.dtype)
        gate, up = h.chunk(2, dim=-1)
        a = gated_activation(gate, up, self.act)  # [P, I]
        y = torch.bmm(w2, a[:, :, None]).squeeze(-1)  # [P, H]
        if biases is not None:
            y = y + biases[1].index_select(0, s).to(y.dtype)
        y = y * w.reshape(-1, 1).to(y.dtype)
        y = torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
        routed.copy_(y.view(T, k, -1))

    def _run_device(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor,
                    placed: dict[int, int], routed: torch.Tensor) -> None:
        """Prefill and large batches: the routes of the experts in ``placed`` (``{flat_id: slot}``), each
        into its row of ``routed [T, k, H]``; other rows are left as they are (zeros, or an earlier
        wave's). One grouped kernel pair on CUDA, a per-expert loop elsewhere (``run_sorted_experts``)."""
        if not placed:
            return
        base = moe_layer * self.num_experts
        slots = [-1] * self.num_experts
        for fid, slot in placed.items():
            slots[fid - base] = slot
        expert_slots = torch.tensor(slots, dtype=torch.int64, pin_memory=x.is_cuda).to(x.device, non_blocking=True)
        run_sorted_experts(x, topk_ids, w, expert_slots, self.cache.layout, self.cache.bank, routed, zero_missing=False,
                           act=self.act)

    def stats(self) -> dict:
        """Per-phase counters; decode includes the device path's counters (read with one sync)."""
        out = {ph: c.as_dict() for ph, c in self.cache.counters.items()}
        if self.device_decode is not None:
            for key, v in self.device_decode.counter_dict().items():
                out["decode"][key] += v
        out["prefetch"] = dict(self.prefetch_counts)
        if self.device_decode is not None and self.device_decode.prefetch_counters is not None:
            out["prefetch"]["prefetched"] += int(self.device_decode.prefetch_counters[2])
        return out
