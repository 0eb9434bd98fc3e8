"""Per-sequence recurrent state of linear-attention layers (gated DeltaNet in ``qwen3_5_moe``).

A linear-attention layer carries, per sequence, a fixed-size state instead of a growing KV cache:
the last ``kernel - 1`` inputs of its causal conv1d and the ``[Hv, Dk, Dv]`` delta-rule memory. The
pool holds a fixed number of *slots* on the compute device; a running sequence owns one slot (all
linear layers at the same index) from its first prefill chunk until the runner frees it. Unlike KV
pages a state cannot be partially reused: a prefix is resumed only by restoring a full copy
(:meth:`RecurrentStatePool.snapshot` / :meth:`RecurrentStatePool.restore`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgemoe.kvcache.pool import KVCacheFullError


class StateSlotsFullError(KVCacheFullError):
    """Every recurrent-state slot is owned by a running sequence. Nothing is allocated then.

    A subclass of :class:`KVCacheFullError`, so the engine treats it like KV exhaustion (it preempts
    the newest sequence and retries).
    """


@dataclass(frozen=True)
class StateSpec:
    """Geometry of a model's per-sequence recurrent state.

    Attributes:
        num_layers: linear-attention layers (each has its own state).
        conv_dim: channels of the causal conv1d (``2 * Hk * Dk + Hv * Dv`` for gated DeltaNet).
        conv_width: past inputs the conv keeps (``kernel - 1``).
        num_heads: value heads ``Hv`` of the delta-rule memory.
        k_head_dim, v_head_dim: ``Dk``, ``Dv``.
    """

    num_layers: int
    conv_dim: int
    conv_width: int
    num_heads: int
    k_head_dim: int
    v_head_dim: int

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes across all layers (conv in ``conv_dtype``, memory float32)."""
        conv = self.conv_dim * self.conv_width * torch.empty((), dtype=conv_dtype).element_size()
        memory = self.num_heads * self.k_head_dim * self.v_head_dim * 4
        return self.num_layers * (conv + memory)


@dataclass(frozen=True)
class StateSnapshot:
    """A copy of one sequence's state in every linear layer (opaque to callers).

    Attributes:
        conv: ``[L, conv_dim, conv_width]`` in the pool's conv dtype.
        recurrent: ``[L, Hv, Dk, Dv]`` float32.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


class RecurrentStatePool:
    """Fixed slots of recurrent state on the compute device, one per running sequence.

    Args:
        spec: the model's state geometry.
        num_slots: sequences that can hold a state at once (the engine's ``max_num_seqs``).
        dtype: dtype of the conv state (the model's activation dtype); the delta-rule memory is float32.
        device: where the state lives.

    Storage: ``conv[layer]`` is ``[num_slots, conv_dim, conv_width]``, ``recurrent[layer]`` is
    ``[num_slots, Hv, Dk, Dv]`` float32. Bytes: ``num_slots * spec.bytes_per_slot(dtype)``.

    Raises:
        ValueError: ``num_slots < 1``.
    """

    def __init__(self, spec: StateSpec, num_slots: int, dtype: torch.dtype, device: torch.device):
        if num_slots < 1:
            raise ValueError("recurrent-state pool needs at least one slot")
        self.spec = spec
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.conv = torch.zeros((spec.num_layers, num_slots, spec.conv_dim, spec.conv_width), dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros((spec.num_layers, num_slots, spec.num_heads, spec.k_head_dim, spec.v_head_dim),
                                     dtype=torch.float32, device=device)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of all slots' conv and recurrent states."""
        return self.conv.nbytes + self.recurrent.nbytes

    @property
    def free_slots(self) -> int:
        """Slots not held by a sequence."""
        return len(self._free)

    def slot(self, seq_id: int) -> int | None:
        """The slot of ``seq_id`` (``None`` when it holds none)."""
        return self._slot.get(seq_id)

    def can_hold(self, seq_id: int) -> bool:
        """Whether ``seq_id`` has a slot or one is free."""
        return seq_id in self._slot or bool(self._free)

    def allocate(self, seq_id: int) -> int:
        """Give ``seq_id`` a zeroed slot (its existing slot is zeroed again): the state before token 0.

        Raises:
            StateSlotsFullError: no free slot (nothing changes then).
        """
        slot = self._slot.get(seq_id)
        if slot is None:
            if not self._free:
                raise StateSlotsFullError(
                    f"recurrent-state slots full: sequence {seq_id} needs one, all {self.num_slots} are in use")
            slot = self._free.pop()
            self._slot[seq_id] = slot
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot

    def free(self, seq_id: int) -> None:
        """Return the slot of ``seq_id`` to the pool (no-op for an unknown id)."""
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def snapshot(self, seq_id: int) -> StateSnapshot:
        """Copy ``seq_id``'s state in every layer (device memory; independent of later steps).

        Raises:
            KeyError: ``seq_id`` holds no slot.
        """
        slot = self._slot[seq_id]
        return StateSnapshot(self.conv[:, slot].clone(), self.recurrent[:, slot].clone())

    def restore(self, seq_id: int, snap: StateSnapshot) -> int:
        """Make ``snap`` the state of ``seq_id`` (allocating a slot if it holds none); returns the slot.

        Raises:
            ValueError: a snapshot of another geometry.
            StateSlotsFullError: ``seq_id`` holds no slot and none is free.
        """
        if snap.conv.shape != self.conv[:, 0].shape or snap.recurrent.shape != self.recurrent[:, 0].shape:
            raise ValueError(f"state snapshot of shapes {tuple(snap.conv.shape)}, {tuple(snap.recurrent.shape)} "
                             f"does not fit this pool ({tuple(self.conv[:, 0].shape)}, "
                             f"{tuple(self.recurrent[:, 0].shape)})")
        slot = self._slot.get(seq_id)
        if slot is None:
            slot = self.allocate(seq_id)
        self.conv[:, slot].copy_(snap.conv)
        self.recurrent[:, slot].copy_(snap.recurrent)
        return slot
