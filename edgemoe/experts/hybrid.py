"""Hybrid routed-expert execution: cache hits and fills on the device, the rest on the CPU.

Per MoE layer and step (DESIGN.md §2):

1. dedupe the step's routed experts and classify them against the residency table: hits H, misses M;
2. ``q = policy(m)`` clamped to the slots that may be evicted this step (hits are never evicted);
3. the ``q`` misses routed by the most tokens are filled into LRU victim slots (host→device copies);
4. the other ``m − q`` run on the CPU executor from host memory, concurrently with the device work
   (device kernels are enqueued first and run asynchronously while the CPU computes);
5. ``out = Σ_routes weight · expert(x)``: device and CPU partials are accumulated in float32 and added.

Prefill under a streaming policy brings every needed expert through the cache in *waves* of at most
the cache's evictable capacity, so it never exceeds the budget however small the cache is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgemoe.core import Phase
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.cpu_executor import TorchCpuExecutor, swiglu_expert
from edgemoe.experts.policy import ExpertPolicy, StaticPolicy
from edgemoe.experts.pool import HostExpertPool


PAIR_PATH_MAX_ROUTES = 64  # decode batches with at most this many (token, k) routes use the batched path


@dataclass
class _Route:
    """Tokens routed to one expert in this step: ``tok [n]`` row indices, ``kpos [n]`` top-k column."""

    fid: int
    tok: torch.Tensor
    kpos: torch.Tensor


class HybridExperts:
    """Owner of the routed-expert path for all MoE layers of one model.

    Args:
        pool: host expert pool (every routed expert).
        cache: device expert cache (slot banks on the compute device).
        policy: decides q per step.
        cpu: the CPU executor.
        num_experts: ``E`` (experts per MoE layer).
        device: compute device.
    """

    def __init__(self, pool: HostExpertPool, cache: ExpertCache, policy: ExpertPolicy, cpu: TorchCpuExecutor,
                 num_experts: int, device: torch.device):
        self.pool, self.cache, self.policy, self.cpu = pool, cache, policy, cpu
        self.num_experts = num_experts
        self.device = torch.device(device)
        if isinstance(policy, StaticPolicy):
            self.place_static()

    # ------------------------------------------------------------------ placement
    def place_static(self) -> None:
        """Fill the cache with whole MoE layers from the last one backwards and pin them."""
        E, S = self.num_experts, self.cache.num_slots
        ids = []
        for layer in range(self.pool.num_ids // E - 1, -1, -1):
            ids.extend(range(layer * E, (layer + 1) * E))
        ids = ids[:S]
        for slot, fid in enumerate(ids):
            self.cache.admit(fid, slot, step=0)
            self._copy_in(fid, slot)
        self.cache.pinned[: len(ids)] = True

    def _copy_in(self, fid: int, slot: int) -> None:
        non_blocking = self.pool.pinned and self.device.type == "cuda"
        for dst, src in zip(self.cache.banks, self.pool.banks()):
            dst[slot].copy_(src[fid], non_blocking=non_blocking)

    # ------------------------------------------------------------------ forward
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
        T = x.shape[0]
        flat = (topk_ids.to("cpu", torch.int64) + moe_layer * self.num_experts)  # [T, k]
        routes: dict[int, _Route] = {}
        for fid in torch.unique(flat).tolist():
            tok, kpos = (flat == fid).nonzero(as_tuple=True)
            routes[fid] = _Route(fid, tok, kpos)
        counters = self.cache.counters[phase.value]
        hits, misses = self.cache.lookup(list(routes))
        counters.hits += len(hits)
        counters.misses += len(misses)
        self.cache.touch(list(hits.values()), step)

        # most-routed misses first: they are the most expensive to compute on the CPU
        misses.sort(key=lambda f: -routes[f].tok.numel())
        stream = phase is Phase.PREFILL and self.policy.streams_prefill
        evictable = self.cache.evictable(exclude=list(hits.values()))
        if stream:
            n_fill = len(misses) if self.cache.num_slots > 0 else 0
        else:
            n_fill = min(self.policy.num_fills(len(misses)), evictable)
        fill_ids, cpu_ids = misses[:n_fill], misses[n_fill:]

        x_cpu = x.to("cpu") if cpu_ids else None  # D2H before the device work is enqueued
        out = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
        if not stream:
            # decode: one wave (q <= evictable), hits and fills computed together
            victims = self.cache.choose_victims(len(fill_ids), exclude=list(hits.values()))
            placed = dict(hits)
            for fid, slot in zip(fill_ids, victims):
                self.cache.admit(fid, slot, step)
                self._copy_in(fid, slot)
                placed[fid] = slot
            if placed:
                if topk_ids.numel() <= PAIR_PATH_MAX_ROUTES:
                    self._run_device_pairs(x, topk_weights, flat, placed, out)
                else:
                    self._run_device(x, topk_weights, [(routes[f], s) for f, s in sorted(placed.items())], out)
        else:
            self._stream(x, topk_weights, routes, hits, fill_ids, cpu_ids, evictable, step, out)
        counters.fills += len(misses) - len(cpu_ids)
        counters.cpu += len(cpu_ids)
        # CPU branch, concurrent with the enqueued device work
        if cpu_ids:
            if x_cpu is None:
                x_cpu = x.to("cpu")
            out_cpu = torch.zeros((T, x.shape[1]), dtype=torch.float32)
            w_cpu = topk_weights.to("cpu")
            work = [(f, routes[f].tok, w_cpu[routes[f].tok, routes[f].kpos]) for f in sorted(cpu_ids)]
            self.cpu.run(x_cpu, work, out_cpu)
            out += out_cpu.to(x.device, non_blocking=False)
        return out.to(x.dtype)

    def _stream(self, x, w, routes: dict[int, _Route], hits: dict[int, int], fill_ids: list[int], cpu_ids: list[int],
                evictable: int, step: int, out: torch.Tensor) -> None:
        """Prefill: hits, then the misses in waves of at most the evictable slots (appends to ``cpu_ids``
        what cannot be streamed because every slot is pinned)."""
        self._run_device(x, w, [(routes[f], s) for f, s in sorted(hits.items())], out)
        exclude = list(hits.values())
        pending = fill_ids
        while pending:
            if evictable == 0 and exclude:  # this step's hits fill the cache: they are computed already
                exclude, evictable = [], self.cache.evictable(exclude=[])
            if evictable == 0:  # every slot pinned: nothing can be streamed
                cpu_ids.extend(pending)
                return
            wave, pending = pending[:evictable], pending[evictable:]
            victims = self.cache.choose_victims(len(wave), exclude)
            placed = []
            for fid, slot in zip(wave, victims):
                self.cache.admit(fid, slot, step)
                self._copy_in(fid, slot)
                placed.append((routes[fid], slot))
            self._run_device(x, w, sorted(placed, key=lambda rs: rs[0].fid), out)
            exclude = []  # later waves may evict earlier waves (stream-ordered on the device)
            evictable = self.cache.evictable(exclude=[])

    def _run_device_pairs(self, x: torch.Tensor, w: torch.Tensor, flat: torch.Tensor, placed: dict[int, int],
                          out: torch.Tensor) -> None:
        """Small batches: every (token, k) route in one batched GEMV pair over gathered slot weights.

        Routes whose expert is not on the device (CPU set) are computed against slot 0 and zeroed, so
        the sum over k runs in a fixed order (deterministic, no atomics).
        """
        T, k = flat.shape
        slot_tk = torch.tensor([placed.get(f, -1) for f in flat.view(-1).tolist()], dtype=torch.int64)
        valid = (slot_tk >= 0).to(x.device, non_blocking=True)  # [P]
        s = slot_tk.clamp(min=0).to(x.device, non_blocking=True)  # [P]
        w13, w2 = self.cache.banks
        xp = x.to(w13.dtype).repeat_interleave(k, dim=0)  # [P, H]
        h = torch.bmm(w13.index_select(0, s), xp[:, :, None]).squeeze(-1)  # [P, 2I]
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up  # [P, I]
        y = torch.bmm(w2.index_select(0, s), a[:, :, None]).squeeze(-1)  # [P, H]
        y = y * w.reshape(-1, 1).to(y.dtype)
        y = torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
        out += y.view(T, k, -1).float().sum(dim=1)

    def _run_device(self, x: torch.Tensor, w: torch.Tensor, items: list[tuple[_Route, int]], out: torch.Tensor) -> None:
        """Per-expert path (prefill, large batches): tokens of each resident expert, in expert-id order."""
        if not items:
            return
        w13, w2 = self.cache.banks
        dtype = w13.dtype
        for r, slot in items:
            tok = r.tok.to(x.device, non_blocking=True)
            kpos = r.kpos.to(x.device, non_blocking=True)
            y = swiglu_expert(x.index_select(0, tok).to(dtype), w13[slot], w2[slot])  # [n, H]
            out.index_add_(0, tok, (y * w[tok, kpos].to(dtype)[:, None]).float())

    def stats(self) -> dict:
        return {ph: c.as_dict() for ph, c in self.cache.counters.items()}
