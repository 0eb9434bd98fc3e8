"""Double-buffered, layer-streamed prefill (FreeToken, arXiv 2608.16157, prefill).

A prefill chunk of thousands of tokens routes to nearly every expert of every MoE layer, so a
prefill step streams whole layers through the expert cache and is bound by the host→device link:

- **Staging regions.** At the start of a streamed step, two groups of ``E`` slots (``E`` = experts
  per layer) are carved out of the expert cache itself: the ``2E`` least recently used evictable
  slots, whose residents are evicted (under per-layer LRU, where ``2E`` slots are free, the last two
  layers' free slots first, which keep nothing, then free slots from the end of every other layer's
  share in turn). MoE layer ``l`` stages into region ``l % 2``.
  When the free slots can take every non-resident expert of the model, no region is carved and
  every expert is staged into a free slot, where it stays resident.
- **What stays.** Free slots left outside the regions are kept per layer (under per-layer LRU the
  ones in the layer's own share, else an equal part; none for the last two layers, whose regions are
  not reused in the step): once a layer's routing is known, its routed staged experts, the most
  routed first, are moved there from the region (a device-to-device copy of their rows and the
  tables updated on the device). A short prompt into a cold cache so leaves every layer the experts
  its tokens used, which decode is most likely to route next; staging into the free slots in layer
  order, as before, left the first layers' every expert (most of them unrouted) and nothing of the
  others (Qwen3-30B-A3B geometry, a 16 GB cache, a 32-token prompt of the Mixtral traces: decode's
  first step hit 104 of 384 experts, now 378).
- **What is copied.** A layer's routing is unknown before its router runs, so every expert of layer
  ``l + 1`` that is not resident is copied; a resident expert is used from its slot.
- **Overlap.** When layer ``l``'s MoE block starts, layer ``l + 1``'s copies are issued on a dedicated
  copy stream, after an event recorded when layer ``l − 1``'s expert compute finished (the region
  held ``l − 1``). Layer ``l``'s expert compute waits on the event recorded after layer ``l``'s copies,
  which were issued one layer earlier. The first MoE layer of a step issues its own copies (and
  layer 1's). On a CPU device the copies are plain copies in program order.
- **Residency.** Staged experts are admitted into the residency tables as they are staged
  (``last_used`` = the step), and evicted when their region slot is reused two layers later; after
  the step the regions hold the last two layers' experts as ordinary residents, so decode hits them.
  Once a layer's routing is known, its staged experts that no token routed get the oldest recency
  (``last_used`` = :data:`UNROUTED_STAGED_STEP`): a whole layer is copied, but only the routed experts
  were used, so a later fill evicts the others before any expert a token used (a short prompt streamed
  into a cold cache otherwise fills it with experts nobody asked for, and decode's first fills evict
  the useful ones among them as readily). Regions are chosen anew at every streamed step.
- **Compute.** :func:`run_sorted_experts`: on CUDA one grouped kernel pair for all the layer's routes
  (``edgemoe.kernels.grouped_gemm``: routes sorted by expert on the device, no host read); elsewhere
  (CPU) the routes are sorted by expert and each expert multiplies its contiguous block (a Python
  loop). Each ``(token, k)`` route lands in its own row of ``routed [T, k, H]`` and the ``k`` rows are
  summed in a fixed order, exactly as :class:`~edgemoe.experts.hybrid.HybridExperts` does (through the
  same function), so streamed prefill is bit-identical to all-resident execution.
- **No host reads between layers.** The step reads the residency tables to the host once, at its start, and
  keeps that copy current as it stages; a layer's hit/miss counts and recency updates are computed on the device
  from its routing, and the counts come back once, at the step's end. A host read per layer would drain the
  compute queue and leave the GPU idle while the host issues the next layer's kernels.
- **The step planned at its start, sent in one copy.** Which experts each layer copies into which slots is
  decided on the host copy of the tables when the step starts (nothing else changes them during the step), and
  every layer's index vectors (its staged ids and slots, its residency) go to the device in one copy from one
  page-locked buffer, before any expert copy. Small host-to-device copies issued on the compute stream between
  the layers were seen to wait for the large expert copies queued on the copy stream to finish, which held each
  layer's compute, and the copies that wait for it, back; and a page-locked allocation between two commands of
  different streams keeps them from running concurrently (CUDA's implicit synchronization).

A step streams only when the policy streams prefill, the chunk has ``T·k ≥ 2E`` routes per layer
(then ~86 % or more of a layer's experts are routed under uniform routing, ``1 − e^{-2}``; a shorter
chunk leaves many unrouted, and copying whole layers would move more bytes than the on-demand path
copies), and the cache can give two regions (or its free slots hold every missing expert).
Otherwise :func:`~edgemoe.experts.hybrid.plan_step`'s waves serve prefill on demand (the fallback).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from edgemoe.core import Phase
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.compute import run_sorted_experts
from edgemoe.experts.policy import ExpertPolicy
from edgemoe.experts.pool import HostExpertPool

STREAM_MIN_ROUTES_PER_EXPERT = 2  # a prefill step streams when T·k >= this x E
UNROUTED_STAGED_STEP = 0  # recency of a staged expert no token of the step routed: older than any use

PREFILL_MODES = ("overlap", "serial", "off")
"""``overlap``: copies on the copy stream, one layer ahead (the default). ``serial``: each layer's
copies on the compute stream right before its compute (single buffer; the baseline the benchmark
reports beside ``overlap``). ``off``: never stream (every prefill step takes the wave path)."""


def copy_runs(fids: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """Coalesce ``(flat id, slot)`` pairs into runs ``(first id, first slot, length)`` where both advance by 1.

    One copy per run replaces one per expert (the pool's rows and the cache's slots are contiguous
    byte rows).
    """
    runs: list[tuple[int, int, int]] = []
    for f, s in zip(fids, slots):
        if runs and f == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((f, s, 1))
    return runs


@dataclass
class _StagedLayer:
    """One MoE layer's experts for this step: ``on_device`` (``[2E]`` int64 on the compute device: whether each
    expert was resident before staging, a hit when routed, as 0/1; then its slot, resident or staged),
    ``copy_done`` (CUDA event after its copies; ``None`` when none are pending on the copy stream)."""

    on_device: torch.Tensor
    copy_done: torch.cuda.Event | None


@dataclass
class _LayerPlan:
    """What one MoE layer copies in this step, decided at its start: ``missing`` (the global ids of the experts to
    copy), ``dest`` (their slots, in the same order) and ``keep`` (free slots its routed staged experts move to
    once its routing is known, see :meth:`PrefillStreamer._keep_routed`)."""

    missing: list[int]
    dest: list[int]
    keep: list[int] = field(default_factory=list)


@dataclass
class _StreamedStep:
    """State of the streamed prefill step in progress (lives from its first MoE layer to its last)."""

    step: int
    regions: tuple[list[int], list[int]]
    spare: list[int]  # free slots outside the regions: staged into without regions, else kept for routed experts
    routed: torch.Tensor  # [T, k, H], reused by every layer of the step
    slot_of: list[int]  # host copy of the cache's slot_of, kept current by the step's admissions
    owner_of: list[int]  # host copy of the cache's owner_of, likewise
    hit_miss: torch.Tensor  # [2] int64 on the device: routed experts that were resident / were staged, so far
    plans: list[_LayerPlan] = field(default_factory=list)
    indices: torch.Tensor | None = None  # [L, 5E] int64 on the device: each layer's plan (see _plan_step)
    next_layer: int = 0
    staged: dict[int, _StagedLayer] = field(default_factory=dict)
    compute_done: torch.cuda.Event | None = None  # recorded after the previous layer's expert compute


class PrefillStreamer:
    """The streamed prefill path of :class:`~edgemoe.experts.hybrid.HybridExperts` (module docstring).

    Args:
        pool: host expert pool (source rows of its byte bank).
        cache: device expert cache (staging regions are its slots; its tables and prefill counters
            are updated).
        policy: prefill streams only when ``policy.streams_prefill``.
        num_experts: ``E``, experts per MoE layer.
        device: compute device; on CUDA a copy stream is created.

    The experts' activation is ``pool.activation`` (their biases, if any, are in the staged rows).

    Attributes:
        mode: one of :data:`PREFILL_MODES` (settable between steps; ``ValueError`` for another value).
    """

    def __init__(self, pool: HostExpertPool, cache: ExpertCache, policy: ExpertPolicy, num_experts: int,
                 device: torch.device):
        self.pool, self.cache, self.policy = pool, cache, policy
        self.num_experts = num_experts
        self.num_layers = pool.num_ids // num_experts
        self.device = torch.device(device)
        self._mode = "overlap"
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._cur: _StreamedStep | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in PREFILL_MODES:
            raise ValueError(f"prefill mode {value!r}: choose one of {PREFILL_MODES}")
        self._mode = value

    # ------------------------------------------------------------------ step control
    def can_stream(self, routes: int) -> bool:
        """Whether a prefill step with ``routes`` ``(token, k)`` pairs per layer would stream now."""
        cache, E = self.cache, self.num_experts
        if (self.mode == "off" or not self.policy.streams_prefill or cache.num_slots == 0
                or routes < STREAM_MIN_ROUTES_PER_EXPERT * E):
            return False
        if cache.evictable(exclude=[]) >= 2 * E:
            return True
        return len(self._free_slots()) >= int((cache.slot_of < 0).sum())

    def claims(self, moe_layer: int, phase: Phase, num_tokens: int, top_k: int, step: int) -> bool:
        """Whether :meth:`forward` serves this MoE layer's call (``HybridExperts.forward`` asks first).

        A streamed step starts at MoE layer 0 of a prefill step that :meth:`can_stream`, and claims
        its layers in order. A streamed step left unfinished (an error between layers) is closed: the
        compute stream is ordered after its pending copies, whose experts the tables already list.
        """
        cur = self._cur
        if cur is not None and phase is Phase.PREFILL and cur.step == step and cur.next_layer == moe_layer:
            return True
        if cur is not None:
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self._finish()
        if phase is not Phase.PREFILL or moe_layer != 0 or not self.can_stream(num_tokens * top_k):
            return False
        self._begin(step, num_tokens, top_k)
        return True

    def _free_slots(self) -> list[int]:
        c = self.cache
        return ((c.owner_of < 0) & ~c.pinned).nonzero().flatten().tolist()

    def _begin(self, step: int, num_tokens: int, top_k: int) -> None:
        cache, E = self.cache, self.num_experts
        free = self._free_slots()
        if len(free) >= int((cache.slot_of < 0).sum()):
            regions: tuple[list[int], list[int]] = ([], [])
        else:
            victims = self._region_slots(free)
            cache.evict(victims)
            regions = (sorted(victims[:E]), sorted(victims[E:]))
            free = sorted(set(free) - set(victims))
        if self._cuda:  # earlier steps' kernels may still read the slots about to be overwritten
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        routed = torch.empty((num_tokens, top_k, self.pool.hidden), dtype=cache.compute_dtype, device=self.device)
        # the step's one read of the tables: from here on only this step changes them, through _plan_step
        self._cur = _StreamedStep(step, regions, free, routed, cache.slot_of.tolist(), cache.owner_of.tolist(),
                                  torch.zeros(2, dtype=torch.int64, device=self.device))
        try:
            self._plan_step()
        except RuntimeError:
            self._cur = None  # no layer was admitted: nothing of the step is left to close
            raise
        if self.mode == "overlap":
            self._cur.staged[0] = self._stage(0, wait=None)

    def _region_slots(self, free: list[int]) -> list[int]:
        """The ``2E`` slots of the step's two staging regions. Under per-layer LRU with ``2E`` free slots: the free
        slots of the last two layers' shares first (they keep nothing, :meth:`_keep_slots`), then free ones from the
        end of every other layer's share in turn, so that each layer keeps about as many free slots of its own for its
        routed experts (:meth:`_keep_routed`); otherwise the cache's ``2E`` least recently used
        evictable slots (free ones first)."""
        cache, E = self.cache, self.num_experts
        if not cache.partition_layers or len(free) < 2 * E:
            return cache.choose_victims(2 * E, exclude=[])
        shares = [share[::-1] for share in self._by_share(free)]
        # the last two layers keep nothing (_keep_slots): their shares' free slots go to the regions first
        picked = [s for share in shares[max(len(shares) - 2, 0):] for s in share][:2 * E]
        shares = shares[:max(len(shares) - 2, 0)]
        depth = 0
        while len(picked) < 2 * E:
            picked += [share[depth] for share in shares if depth < len(share)][:2 * E - len(picked)]
            depth += 1
        return picked

    def _by_share(self, slots: list[int]) -> list[list[int]]:
        """``slots`` split by the layer whose share (``ExpertCache.victim_range``) each falls in, in the given
        order (one pass)."""
        cache = self.cache
        starts = [cache.victim_range(layer)[0] for layer in range(cache.num_layers)]
        shares: list[list[int]] = [[] for _ in starts]
        for s in slots:
            shares[bisect.bisect_right(starts, s) - 1].append(s)
        return shares

    def _keep_slots(self, spare: list[int]) -> list[list[int]]:
        """Per MoE layer, the free slots its routed staged experts move to (at most ``E``): under per-layer LRU the
        spare slots of its own share, else an equal part of ``spare``; none for the last two layers, whose regions
        are not staged into again in the step (their experts stay where they are)."""
        cache, E, L = self.cache, self.num_experts, self.num_layers
        n = max(L - 2, 0)
        if cache.partition_layers:
            keep = [share[:E] for share in self._by_share(spare)[:n]]
        else:
            q, r = divmod(len(spare), max(n, 1))
            starts = [layer * q + min(layer, r) for layer in range(n + 1)]
            keep = [spare[starts[layer]:starts[layer + 1]][:E] for layer in range(n)]
        return keep + [[] for _ in range(L - n)]

    def _plan_step(self) -> None:
        """Plan every layer of the step (which experts are copied into which slots) on the host copy of the tables,
        and send all the plans to the device in one copy, before any expert copy: ``indices[l]`` holds the staged
        ids in ``[0, n)``, their slots in ``[E, E + n)``, the layer's residency flags in ``[2E, 3E)``, its slots
        in ``[3E, 4E)`` and the free slots kept for its routed experts from ``4E`` on. One copy because small
        host-to-device copies issued on the compute stream between the layers were seen to wait for the large
        expert copies queued on the copy stream to finish (H100, 2026-12-06), which held each layer's compute, and
        the copies that wait for it, back. Its one page-locked host buffer is allocated here: a page-locked
        allocation between two commands of different streams keeps them from running concurrently (CUDA's
        implicit synchronization).

        Raises:
            RuntimeError: a layer has more experts to copy than its region and the spare slots hold.
        """
        cur, E = self._cur, self.num_experts
        carved = bool(cur.regions[0])
        keep = self._keep_slots(cur.spare) if carved else [[] for _ in range(self.num_layers)]
        rows = []
        for layer in range(self.num_layers):
            base = layer * E
            slots = cur.slot_of[base:base + E]
            resident = [s >= 0 for s in slots]
            missing = [base + e for e in range(E) if not resident[e]]
            n_spare = 0 if carved else min(len(missing), len(cur.spare))
            dest = cur.spare[:n_spare] + cur.regions[layer % 2][:len(missing) - n_spare]
            if len(dest) < len(missing):
                raise RuntimeError(f"streamed prefill: no staging slot for {len(missing) - len(dest)} experts "
                                   f"of layer {layer}")
            del cur.spare[:n_spare]
            for fid, s in zip(missing, dest):  # the host copy follows: the slot's previous owner leaves
                old = cur.owner_of[s]
                if old >= 0:
                    cur.slot_of[old] = -1
                cur.owner_of[s], cur.slot_of[fid] = fid, s
                slots[fid - base] = s
            cur.plans.append(_LayerPlan(missing, dest, keep[layer]))
            pad = [0] * (E - len(missing))
            rows.append(missing + pad + dest + pad + [int(r) for r in resident] + slots
                        + keep[layer] + [0] * (E - len(keep[layer])))
        staging = torch.tensor(rows, dtype=torch.int64)  # [L, 5E]
        if self.device.type == "cuda":
            staging = staging.pin_memory()
        cur.indices = staging.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ staging
    def _stage(self, layer: int, wait: torch.cuda.Event | None) -> _StagedLayer:
        """Admit layer ``layer``'s non-resident experts into the slots its plan gives them, and copy them.

        ``wait``: event the copies wait for (the compute that last read the region). Copies go on the
        copy stream in ``overlap`` mode on CUDA, else on the current stream.
        """
        cur, cache, E = self._cur, self.cache, self.num_experts
        plan, idx = cur.plans[layer], cur.indices[layer]
        n = len(plan.missing)
        if n:
            cache.admit_indexed(idx[:n], idx[E:E + n], cur.step)
        cache.counters[Phase.PREFILL.value].fills += n
        on_device = idx[2 * E:4 * E]
        runs = copy_runs(plan.missing, plan.dest)
        if not (runs and self._cuda and self.mode == "overlap"):
            self._copy(runs)
            return _StagedLayer(on_device, None)
        stream = self._copy_stream
        with torch.cuda.stream(stream):
            if wait is not None:
                stream.wait_event(wait)
            self._copy(runs)
            done = torch.cuda.Event()
            done.record(stream)
        return _StagedLayer(on_device, done)

    def _copy(self, runs: list[tuple[int, int, int]]) -> None:
        non_blocking = self.pool.pinned and self._cuda
        for fid, slot, n in runs:
            self.cache.bank[slot:slot + n].copy_(self.pool.bank[fid:fid + n], non_blocking=non_blocking)

    # ------------------------------------------------------------------ forward
    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed-expert output of one MoE layer of the streamed step (call only after :meth:`claims`).

        Args:
            moe_layer: MoE layer ordinal; layers come in order ``0 .. L-1``.
            x: ``[T, H]`` hidden states on the compute device.
            topk_ids: ``[T, k]`` int64 expert indices within the layer.
            topk_weights: ``[T, k]`` router weights.

        Returns:
            ``[T, H]`` in ``x.dtype``: ``Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t])``, summed
            in float32 over ``k`` in order (as ``HybridExperts.forward``).
        """
        cur, cache, E = self._cur, self.cache, self.num_experts
        overlap = self.mode == "overlap"
        if overlap and moe_layer + 1 < self.num_layers:  # the next layer's copies, before this layer's compute
            cur.staged[moe_layer + 1] = self._stage(moe_layer + 1, wait=cur.compute_done)
        flat = topk_ids.reshape(-1)  # [P]
        # serial: this layer's copies go on the compute stream now, after its router, before its compute
        staged = cur.staged.pop(moe_layer) if overlap else self._stage(moe_layer, wait=None)
        compute = torch.cuda.current_stream(self.device) if self._cuda else None
        if staged.copy_done is not None:
            compute.wait_event(staged.copy_done)
        # counters and recency from the layer's routing, on the device (no host read: the step's queue keeps going)
        seen = torch.zeros(E, dtype=torch.bool, device=flat.device).index_fill_(0, flat, True)  # [E] routed
        # [E] whether resident (a hit when routed), then [E] the slots (distinct: every expert has one)
        resident, slots = staged.on_device[:E].bool(), staged.on_device[E:]
        hit, unrouted_staged = seen & resident, ~(seen | resident)
        cur.hit_miss += torch.stack([hit.sum(), (seen & ~resident).sum()])
        lu = cache.last_used
        lu[slots] = torch.where(hit, cur.step, torch.where(unrouted_staged, UNROUTED_STAGED_STEP, lu[slots]))
        base = moe_layer * E  # the table's rows of this layer hold `slots`
        run_sorted_experts(x, topk_ids, topk_weights, cache.slot_of[base:base + E], cache.layout, cache.bank,
                           cur.routed, act=self.pool.activation)
        out = cur.routed.sum(dim=1, dtype=torch.float32).to(x.dtype)  # [T, H]
        self._keep_routed(moe_layer, flat, seen & ~resident, slots)
        if overlap and self._cuda:
            cur.compute_done = torch.cuda.Event()
            cur.compute_done.record(compute)
        cur.next_layer = moe_layer + 1
        if cur.next_layer == self.num_layers:
            self._finish()
        return out

    def _keep_routed(self, moe_layer: int, flat: torch.Tensor, routed_staged: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """Move the layer's routed experts staged in a region, the most routed first, into the free slots its plan
        keeps for them (``_LayerPlan.keep``), after its compute and before the region is staged into again (on CUDA
        the next staging of that region waits for this layer's compute event, recorded after these copies). A
        streamed step copies whole layers, and its regions are reused two layers later, so without this only the
        last two layers' experts stay resident and decode starts on a cache of the first layers' staged experts
        (with the spare slots taken in layer order). ``flat``: ``[P]`` the layer's routed expert indices;
        ``routed_staged``, ``slots``: ``[E]`` (bool; int64) per expert of the layer."""
        plan = self._cur.plans[moe_layer]
        E, n = self.num_experts, min(len(plan.keep), len(plan.missing))  # at most the staged experts move
        if n == 0:
            return
        # [E] routes per expert (not torch.bincount: on CUDA it reads the input's min and max back to the host)
        routes = torch.zeros(E, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        count, expert = torch.topk(torch.where(routed_staged, routes, -1), n)  # [n], n <= E
        dst = self._cur.indices[moe_layer, 4 * E:4 * E + n]
        self.cache.move_indexed(slots[expert], dst, count > 0, self._cur.step)

    def _finish(self) -> None:
        """End the streamed step: its hit and miss counts to the prefill counters (the step's one read back)."""
        hits, misses = self._cur.hit_miss.tolist()
        counters = self.cache.counters[Phase.PREFILL.value]
        counters.hits += hits
        counters.misses += misses
        self._cur = None
