"""The device expert cache: (layer, expert) slots under one global LRU across all MoE layers.

One byte bank of slots on the compute device (``[S, row_bytes]``, rows in the host
pool's :class:`~edgemoe.quant.layout.ExpertLayout`, so a fill copies one packed row), a residency table
``slot_of[moe_layer * E + expert]`` (-1 when not resident), its inverse ``owner_of[slot]`` (-1 when
free), and ``last_used[slot]``, the model step at which the slot was last hit or filled. A hit
refreshes recency, a fill admits a row into the least recently used slot not needed this step
(ties: the smaller slot index). The cache is a performance lever only: shrinking it never changes
results.

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

    Attributes:
        bank: uint8 ``[S, row_bytes]`` on ``device``; ``view(name)`` gives a section's typed view.
        slot_of: ``[N]`` int64, slot of each flat id or -1.
        owner_of: ``[S]`` int64, flat id held by each slot or -1.
        last_used: ``[S]`` int64, LRU clock (model step); free slots hold -1.
        pinned: ``[S]`` bool, slots never evicted (static placement).
        clock: ``[1]`` int64, the current model step for device-side control (its caller advances it
            once per step; the eager path passes ``step`` explicitly instead).

    All tables are on ``device``.
    """

    num_slots: int
    num_ids: int
    layout: ExpertLayout | None
    compute_dtype: torch.dtype
    device: torch.device
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
        return torch.tensor(idx, dtype=torch.int64, device=self.slot_of.device)

    def lookup(self, ids: list[int]) -> tuple[dict[int, int], list[int]]:
        """Split flat ids into hits (``{id: slot}``) and misses (ids, in input order)."""
        slots = self.slot_of[self._index(ids)].tolist() if ids else []
        hits = {i: s for i, s in zip(ids, slots) if s >= 0}
        misses = [i for i, s in zip(ids, slots) if s < 0]
        return hits, misses

    def touch(self, slots: list[int], step: int) -> None:
        """Refresh recency of ``slots`` to ``step``."""
        if slots:
            self.last_used[self._index(slots)] = step

    def choose_victims(self, k: int, exclude: list[int]) -> list[int]:
        """The ``k`` least recently used slots, skipping ``exclude`` (needed this step) and pinned ones.

        Free slots (``last_used == -1``) come first; equal ``last_used`` goes to the smaller slot index
        (the order ``edgemoe.kernels.route_control`` reproduces). Returns the victims in that order,
        fewer than ``k`` when not enough slots are evictable.
        """
        if k <= 0 or self.num_slots == 0:
            return []
        slot = torch.arange(self.num_slots, dtype=torch.int64, device=self.last_used.device)
        key = self.last_used * self.num_slots + slot  # [S] unique: (last_used, slot) in lexicographic order
        blocked = self.pinned.clone()
        if exclude:
            blocked[self._index(exclude)] = True
        key[blocked] = torch.iinfo(torch.int64).max
        k = min(k, int((~blocked).sum()))
        if k == 0:
            return []
        return torch.topk(key, k, largest=False, sorted=True).indices.tolist()

    def evictable(self, exclude: list[int]) -> int:
        """Slots that could receive a fill this step (not pinned and not in ``exclude``)."""
        blocked = self.pinned.clone()
        if exclude:
            blocked[self._index(exclude)] = True
        return int((~blocked).sum())

    def admit(self, flat_id: int, slot: int, step: int) -> None:
        """Make ``slot`` hold ``flat_id`` (evicting its previous owner). Tables only; no data copy."""
        old, prev = torch.stack([self.owner_of[slot], self.slot_of[flat_id]]).tolist()  # one host read
        if old >= 0:
            self.slot_of[old] = -1
        if prev >= 0 and old != flat_id:
            raise RuntimeError(f"expert {flat_id} already resident in slot {prev}")
        self.owner_of[slot] = flat_id
        self.slot_of[flat_id] = slot
        self.last_used[slot] = step

    def admit_many(self, flat_ids: list[int], slots: list[int], step: int) -> None:
        """:meth:`admit` for many pairs at once (distinct ids, distinct slots): one vectorized update.

        Raises:
            RuntimeError: one of ``flat_ids`` is already resident.
        """
        if not flat_ids:
            return
        ids, idx = self._index(flat_ids), self._index(slots)
        prev = self.slot_of[ids]
        if bool((prev >= 0).any()):
            raise RuntimeError(f"experts {ids[prev >= 0].tolist()} already resident")
        self.evict(slots)
        self.slot_of[ids] = idx
        self.owner_of[idx] = ids
        self.last_used[idx] = step

    def evict(self, slots: list[int]) -> None:
        """Empty ``slots``: their residents become misses, the slots free (``last_used = -1``). Tables only."""
        if not slots:
            return
        idx = self._index(slots)
        owners = self.owner_of[idx]
        self.slot_of[owners[owners >= 0]] = -1
        self.owner_of[idx] = -1
        self.last_used[idx] = -1

    def clear(self) -> None:
        """Drop all residency (data stays allocated)."""
        self.slot_of.fill_(-1)
        self.owner_of.fill_(-1)
        self.last_used.fill_(-1)
        self.pinned.fill_(False)

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
