"""The device expert cache: (layer, expert) slots under LRU, global across MoE layers or per layer.

One byte bank of slots on the compute device (``[S, row_bytes]``, rows in the host
pool's :class:`~edgemoe.quant.layout.ExpertLayout`, so a fill copies one packed row), a residency table
``slot_of[moe_layer * E + expert]`` (-1 when not resident), its inverse ``owner_of[slot]`` (-1 when
free), and ``last_used[slot]``, the model step at which the slot was last hit or filled. A hit
refreshes recency, a fill admits a row into the least recently used slot not needed this step
(ties: the smaller slot index) among the layer's *victim range*: every slot under global LRU
(FreeToken's rule), or, under per-layer LRU (``partition_layers``), the layer's equal share of the
slots (``S // L`` each, the first ``S mod L`` layers one more). Hits are found in any slot, so
experts another layer or a streamed prefill left in a partition stay usable until that partition's
layer evicts them. On the Mixtral-8x7B decode traces per-layer LRU misses less than global LRU at
every capacity (50.5 % against 57.2 % at a 37 % cache, ``docs/benchmarks/policy.md``): with the model
step as the clock all layers of a step share one age, and a global victim is often an expert the
next layers of the step are about to route. The cache is a performance lever only: shrinking it never changes
results.

Reuse accounting (for the ``auto`` miss policy, which values a fill by what it buys): a fill that displaces a
resident remembers the id it displaced, its *ghost* (``ghost_slot[ghost] = slot``, ``slot_ghost[slot] = ghost``);
the pair is live while the filled id stays in that slot and the ghost is not displaced by another fill (it may
be filled again itself). In decode, ``reuse[l, 0]`` gains one for every hit of MoE layer ``l`` on a resident
with a live ghost and loses one for every request (hit or miss) of a live ghost whose displacer is of layer
``l``; ``reuse[l, 1]`` counts layer ``l``'s fills that displaced a resident. Their ratio over a window is the
net reuse of such a fill against the cache without it: the hits it bought minus the requests the displaced
expert would have met (zero in expectation without routing locality, and where every fill displaces an expert
as much in use as itself). Two choices keep it a marginal value, what one more fill buys, rather than an
average over the cache: a ghost filled again is still charged to its displacer (otherwise a chain of fills,
each displacing an expert the next one brings back, is credited with every hit and charged almost nothing),
and the hits of residents without a live ghost (filled into a free slot, streamed in by a prefill, or whose
ghost a later fill displaced) are credited to no fill (otherwise a cache smaller than a steady working set,
whose long-lived residents are hit every step, credits their hits to the few fills that cycle its other
slots: one to several hits a fill where one more fill buys none).

The tables live on the cache's device, so the device-side control of a decode step
(``edgemoe.kernels.route_control``) reads and updates the very tensors these methods use; the methods
work on any device (host reads go through ``.tolist()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgemoe.quant.layout import ExpertLayout


@dataclass
class CacheCounters:
    """Per-phase counts of (layer, expert) uses, deduplicated over the tokens of a step.

    ``hits``: resident when routed. ``misses``: not resident. ``fills``: experts copied into a slot.
    ``cpu``: misses computed by the CPU executor. ``misses == fills + cpu``, except in a streamed
    prefill step (``edgemoe.experts.prefill``), which copies every non-resident expert of each layer
    before its routing is known: there ``cpu == 0`` and ``fills >= misses``.
    """

    hits: int = 0
    misses: int = 0
    fills: int = 0
    cpu: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "fills": self.fills, "cpu": self.cpu}


def device_int64(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor ``[n]`` on ``device``; on CUDA through pinned memory and an asynchronous copy,
    so building it does not wait for the work queued on the stream (``torch.tensor(..., device=cuda)`` synchronizes
    the stream after its copy). The pinned staging block is kept by torch's host allocator until the copy is done."""
    t = torch.tensor(values, dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


MOVE_CHUNK_BYTES = 64 << 20  # the temporary one indexed copy of ExpertCache.move_indexed gathers (at least a row)


def _set_where(table: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, value: torch.Tensor | int) -> None:
    """``table[index[mask]] = value[mask]`` (``value`` a tensor like ``index``, or one int) without reading ``mask``
    to the host: the masked-off entries become no-ops of two ``scatter_reduce_`` passes (``amin`` to -1, then
    ``amax`` to the value), so no boolean indexing (a host synchronization on CUDA) is needed. Requires every
    value and every entry of ``table`` it writes to be ``>= -1``, and the masked-on indices to be distinct.

    ``table``: ``[N]`` int64; ``index``, ``mask``: ``[n]`` (int64 with -1 where masked off, bool)."""
    at = index.clamp(min=0)
    big = torch.iinfo(torch.int64).max
    table.scatter_reduce_(0, at, torch.where(mask, -1, big), reduce="amin")
    if not (isinstance(value, int) and value == -1):
        table.scatter_reduce_(0, at, torch.where(mask, value, -2), reduce="amax")


@dataclass
class ExpertCache:
    """Residency bookkeeping plus the slot bank.

    Args:
        num_slots: ``S``, slots in the cache (0 disables it: every expert runs on the CPU).
        num_ids: ``N``, flat expert ids (``num_moe_layers * num_experts``).
        layout: the byte layout of one slot row (the host pool's), or ``None`` for the residency tables
            alone (a bank of empty rows: routing-trace replay, table tests).
        compute_dtype: the dtype the experts compute in (the host pool's ``compute_dtype``).
        device: slot storage.
        num_experts: ``E``, experts per MoE layer (the layer of a flat id is ``id // E``); 0: one layer.
        partition_layers: per-layer LRU (each MoE layer evicts only within its share of the slots);
            ``False``: one global LRU. With fewer slots than layers the cache stays global.

    Attributes:
        bank: uint8 ``[S, row_bytes]`` on ``device``; ``view(name)`` gives a section's typed view.
        slot_of: ``[N]`` int64, slot of each flat id or -1.
        owner_of: ``[S]`` int64, flat id held by each slot or -1.
        last_used: ``[S]`` int64, LRU clock (model step); free slots hold -1.
        pinned: ``[S]`` bool, slots never evicted (static placement).
        clock: ``[1]`` int64, the current model step for device-side control (its caller advances it
            once per step; the eager path passes ``step`` explicitly instead).
        ghost_slot: ``[N]`` int64, the slot whose current owner's fill displaced the id (resident again
            or not), or -1.
        slot_ghost: ``[S]`` int64, the id the slot's current owner displaced, or -1.
        reuse: ``[L, 2]`` int64, per MoE layer (net reuse hits, fills that displaced a resident) in decode since
            creation (module docstring).

    All tables are on ``device``.
    """

    num_slots: int
    num_ids: int
    layout: ExpertLayout | None
    compute_dtype: torch.dtype
    device: torch.device
    num_experts: int = 0
    partition_layers: bool = False
    bank: torch.Tensor = field(init=False)
    counters: dict[str, CacheCounters] = field(init=False)

    def __post_init__(self):
        S = self.num_slots
        row = 0 if self.layout is None else self.layout.row_bytes
        self.bank = torch.empty((S, row), dtype=torch.uint8, device=self.device)  # [S, row_bytes]
        dev = self.device
        self.slot_of = torch.full((self.num_ids,), -1, dtype=torch.int64, device=dev)
        self.owner_of = torch.full((S,), -1, dtype=torch.int64, device=dev)
        self.last_used = torch.full((S,), -1, dtype=torch.int64, device=dev)
        self.pinned = torch.zeros(S, dtype=torch.bool, device=dev)
        self.clock = torch.zeros(1, dtype=torch.int64, device=dev)
        self.num_experts = self.num_experts or max(1, self.num_ids)
        self.num_layers = max(1, -(-self.num_ids // self.num_experts))
        self.ghost_slot = torch.full((self.num_ids,), -1, dtype=torch.int64, device=dev)
        self.slot_ghost = torch.full((S,), -1, dtype=torch.int64, device=dev)
        self.reuse = torch.zeros(self.num_layers, 2, dtype=torch.int64, device=dev)
        self.partition_layers = self.partition_layers and S >= self.num_layers
        self.counters = {"prefill": CacheCounters(), "decode": CacheCounters()}

    def view(self, name: str) -> torch.Tensor:
        """Typed view of section ``name`` over every slot (``[S, *section.shape]``, no copy).

        Raises:
            ValueError: a cache without a layout (tables only).
        """
        if self.layout is None:
            raise ValueError("this expert cache holds residency tables only (no layout, no slot rows)")
        return self.layout.view(self.bank, name)

    def release(self) -> None:
        """Free the slot bank's memory (before a larger cache is allocated); the tables stay."""
        self.bank = torch.empty((0, self.bank.shape[1]), dtype=torch.uint8, device=self.device)

    @property
    def slots_used(self) -> int:
        return int((self.owner_of >= 0).sum())

    @property
    def nbytes(self) -> int:
        return self.bank.numel()

    def _index(self, idx: list[int]) -> torch.Tensor:
        return device_int64(idx, self.slot_of.device)

    def lookup(self, ids: list[int]) -> tuple[dict[int, int], list[int]]:
        """Split flat ids into hits (``{id: slot}``) and misses (ids, in input order)."""
        slots = self.slot_of[self._index(ids)].tolist() if ids else []
        hits = {i: s for i, s in zip(ids, slots) if s >= 0}
        misses = [i for i, s in zip(ids, slots) if s < 0]
        return hits, misses

    def touch(self, slots: list[int], step: int) -> None:
        """Refresh recency of ``slots`` to ``step``."""
        if slots:
            self.last_used.index_fill_(0, self._index(slots), step)

    def victim_range(self, layer: int | None) -> tuple[int, int]:
        """``(lo, hi)``: the slots a fill of MoE layer ``layer`` may evict (all when global, or ``None``)."""
        if layer is None or not self.partition_layers:
            return 0, self.num_slots
        S, L = self.num_slots, self.num_layers
        return layer * (S // L) + min(layer, S % L), (layer + 1) * (S // L) + min(layer + 1, S % L)

    def _blocked(self, exclude: list[int], layer: int | None) -> torch.Tensor:
        blocked = self.pinned.clone()
        if exclude:
            blocked.index_fill_(0, self._index(exclude), True)
        lo, hi = self.victim_range(layer)
        blocked[:lo] = True
        blocked[hi:] = True
        return blocked

    def choose_victims(self, k: int, exclude: list[int], layer: int | None = None) -> list[int]:
        """The ``k`` least recently used slots of ``layer``'s victim range (:meth:`victim_range`),
        skipping ``exclude`` (needed this step) and pinned ones.

        Free slots (``last_used == -1``) come first; equal ``last_used`` goes to the smaller slot index
        (the order ``edgemoe.kernels.route_control`` reproduces). Returns the victims in that order,
        fewer than ``k`` when not enough slots are evictable.
        """
        if k <= 0 or self.num_slots == 0:
            return []
        slot = torch.arange(self.num_slots, dtype=torch.int64, device=self.last_used.device)
        key = self.last_used * self.num_slots + slot  # [S] unique: (last_used, slot) in lexicographic order
        blocked = self._blocked(exclude, layer)
        key[blocked] = torch.iinfo(torch.int64).max
        k = min(k, int((~blocked).sum()))
        if k == 0:
            return []
        return torch.topk(key, k, largest=False, sorted=True).indices.tolist()

    def free_slots(self, layer: int | None = None) -> int:
        """Slots of ``layer``'s victim range that hold nothing and are not pinned."""
        free = (self.owner_of < 0) & ~self.pinned
        lo, hi = self.victim_range(layer)
        return int(free[lo:hi].sum())

    def evictable(self, exclude: list[int], layer: int | None = None) -> int:
        """Slots of ``layer``'s victim range that could receive a fill this step (not pinned and not in
        ``exclude``)."""
        return int((~self._blocked(exclude, layer)).sum())

    def admit(self, flat_id: int, slot: int, step: int) -> None:
        """Make ``slot`` hold ``flat_id`` (evicting its previous owner). Tables only; no data copy."""
        old, prev = torch.stack([self.owner_of[slot], self.slot_of[flat_id]]).tolist()  # one host read
        if old >= 0:
            self.slot_of[old] = -1
        if prev >= 0 and old != flat_id:
            raise RuntimeError(f"expert {flat_id} already resident in slot {prev}")
        self._displace(self._index([flat_id]), self._index([slot]), self._index([old]))
        self.owner_of[slot] = flat_id
        self.slot_of[flat_id] = slot
        self.last_used[slot] = step

    def admit_many(self, flat_ids: list[int], slots: list[int], step: int, check: bool = True) -> None:
        """:meth:`admit` for many pairs at once (distinct ids, distinct slots): one vectorized update, with no
        host read when ``check`` is false (the caller knows none of ``flat_ids`` is resident: a streamed
        prefill step keeps a host copy of the tables).

        Raises:
            RuntimeError: ``check`` and one of ``flat_ids`` is already resident.
        """
        if not flat_ids:
            return
        ids, idx = self._index(flat_ids), self._index(slots)
        if check:
            prev = self.slot_of[ids]
            if bool((prev >= 0).any()):
                raise RuntimeError(f"experts {ids[prev >= 0].tolist()} already resident")
        self.admit_indexed(ids, idx, step)

    def admit_indexed(self, ids: torch.Tensor, idx: torch.Tensor, step: int) -> None:
        """:meth:`admit_many` without its check, from index tensors already on the cache's device: ``ids`` and
        ``idx`` int64 ``[n]`` (distinct flat ids, none resident; distinct slots). Launches device operations only,
        so a caller that stages its indices through its own pinned buffer (a streamed prefill step) makes no host
        allocation here."""
        olds = self.owner_of[idx].clone()
        self._evict_indexed(idx)
        self._displace(ids, idx, olds)
        self.slot_of[ids] = idx
        self.owner_of[idx] = ids
        self.last_used.index_fill_(0, idx, step)

    def move_indexed(self, src: torch.Tensor, dst: torch.Tensor, valid: torch.Tensor, step: int) -> None:
        """Move the residents of slots ``src`` into the free slots ``dst`` where ``valid``: their rows copied in the
        bank, the residency tables pointed at ``dst`` (``last_used`` = ``step``), the ``src`` slots freed and their
        ghosts forgotten (a moved expert was displaced by no fill). Entries not ``valid`` change nothing. Launches
        device operations only (no host read: ``valid`` stays on the device).

        Args:
            src: ``[n]`` int64, distinct slots holding an expert where ``valid`` (anything elsewhere).
            dst: ``[n]`` int64, distinct free slots, none of them in ``src``.
            valid: ``[n]`` bool.
            step: the recency the moved experts get.
        """
        src = torch.where(valid, src, dst)  # an entry not valid copies its free slot onto itself
        rows = max(1, MOVE_CHUNK_BYTES // max(1, self.bank.shape[1]))  # the gathered rows are a temporary
        for i in range(0, dst.numel(), rows):
            self.bank[dst[i:i + rows]] = self.bank[src[i:i + rows]]
        ids = self.owner_of[src]
        self._forget_ghosts(src)
        _set_where(self.slot_of, ids, valid, dst)
        _set_where(self.owner_of, dst, valid, ids)
        _set_where(self.owner_of, src, valid, -1)
        _set_where(self.last_used, dst, valid, step)
        _set_where(self.last_used, src, valid, -1)

    def evict(self, slots: list[int]) -> None:
        """Empty ``slots``: their residents become misses, the slots free (``last_used = -1``). Tables only."""
        if slots:
            self._evict_indexed(self._index(slots))

    def _evict_indexed(self, idx: torch.Tensor) -> None:
        self._forget_ghosts(idx)
        owners = self.owner_of[idx]
        _set_where(self.slot_of, owners, owners >= 0, -1)
        self.owner_of.index_fill_(0, idx, -1)
        self.last_used.index_fill_(0, idx, -1)

    def _forget_ghosts(self, idx: torch.Tensor) -> None:
        """The ghosts of slots ``idx`` are forgotten (their owners leave or are replaced)."""
        g = self.slot_ghost[idx]
        mine = (g >= 0) & (self.ghost_slot[g.clamp(min=0)] == idx)  # a ghost that was filled since is someone else's
        _set_where(self.ghost_slot, g, mine, -1)
        self.slot_ghost.index_fill_(0, idx, -1)

    def _displace(self, ids: torch.Tensor, idx: torch.Tensor, olds: torch.Tensor) -> None:
        """Ghost tables for fills of ``ids`` into slots ``idx`` whose previous owners were ``olds`` (-1: free)."""
        self._forget_ghosts(idx)
        _set_where(self.ghost_slot, olds, olds >= 0, idx)
        self.slot_ghost[idx] = olds

    def count_reuse(self, layer: int, requested: list[int], hit_slots: list[int], victims: list[int]) -> None:
        """Decode reuse accounting of one MoE layer's step (module docstring), on the tables as before this step's
        fills: the step's ``requested`` experts (distinct flat ids), the slots of those that hit, and the slots
        its fills take (their owners, where any, are displaced)."""
        if requested:
            gs = self.ghost_slot[self._index(requested)]
            gs = gs[gs >= 0]
            if gs.numel():
                owners = self.owner_of[gs]
                owners = owners[owners >= 0]
                self.reuse[:, 0].index_add_(0, owners // self.num_experts, torch.full_like(owners, -1))
        if hit_slots:
            idx = self._index(hit_slots)
            g = self.slot_ghost[idx]
            live = (g >= 0) & (self.ghost_slot[g.clamp(min=0)] == idx)
            self.reuse[layer, 0] += live.sum()
        if victims:
            self.reuse[layer, 1] += (self.owner_of[self._index(victims)] >= 0).sum()

    def clear(self) -> None:
        """Drop all residency (data stays allocated)."""
        self.slot_of.fill_(-1)
        self.owner_of.fill_(-1)
        self.last_used.fill_(-1)
        self.pinned.fill_(False)
        self.ghost_slot.fill_(-1)
        self.slot_ghost.fill_(-1)

    def check_invariants(self) -> None:
        """Assert ``slot_of`` and ``owner_of`` are inverse maps (used by tests).

        Raises:
            AssertionError: the tables disagree.
        """
        slot_of, owner_of = self.slot_of.tolist(), self.owner_of.tolist()
        for slot, owner in enumerate(owner_of):
            if owner >= 0:
                assert slot_of[owner] == slot, f"slot {slot} owner {owner} maps back to {slot_of[owner]}"
        for fid, slot in enumerate(slot_of):
            if slot >= 0:
                assert owner_of[slot] == fid, f"id {fid} -> slot {slot} owned by {owner_of[slot]}"
