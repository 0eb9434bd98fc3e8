"""Recurrent-state checkpoints at semantic anchors, for hybrid models.

A gated-DeltaNet layer's state after token ``p - 1`` summarizes the whole prefix ``[0, p)``, so unlike
KV pages it cannot be cut back to an earlier position: a new request can skip the prefill of a shared
prefix only when the state at the end of that prefix was saved. This module keeps a fixed number of
such saved states (*checkpoints*), taken where agent harnesses edit their context — right after the
token that ends a thinking block (``</think>``), a tool call (``</tool_call>``), a tool response
(``</tool_response>``) or a turn (``<|im_end|>``, and the model's EOS tokens) — and, so that an edit
which cuts mid-block still reuses most of its prefix, every ``interval`` tokens.

A checkpoint at position ``p`` holds, for every linear-attention layer, the conv window (the last
``kernel - 1`` conv inputs before ``p``) and the delta-rule memory after token ``p - 1``; it is keyed by
the exact token ids ``[0, p)`` it summarizes (compared in full, never by hash alone). The full-attention
layers need their KV of ``[0, p)`` too: the radix tree (:mod:`edgemoe.kvcache.radix`) shares whole
pages only, so a checkpoint also stores the KV rows (K/V or latent rows) of the partly filled last page,
``[p // page_size * page_size, p)``, of every attention layer, written into a fresh page on restore.
A restore therefore needs the tree to hold the whole pages ``[0, p // page_size * page_size)``.

Slots are reused least recently used first (a restore or a save refreshes a slot), independently of
the KV pages' eviction; a slot being written by the current model step (*pending*) is never evicted.
The engine side (which positions to checkpoint, when to restore) lives in
:class:`~edgemoe.engine.model_runner.ModelRunner`; the gated-DeltaNet layers write the states at the
positions a prefill step carries in ``SeqSlice.checkpoints``.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

import torch

from edgemoe.kvcache.pool import KVSpec
from edgemoe.kvcache.state import RecurrentStatePool, StateSnapshot, StateSpec

__all__ = ["ANCHOR_TOKENS", "CheckpointMatch", "StateCheckpointStore", "anchor_token_ids", "checkpoint_positions"]

ANCHOR_TOKENS = ("</think>", "</tool_call>", "</tool_response>", "<|im_end|>")
"""Token strings after which a checkpoint is taken, where the tokenizer has them as single tokens."""


def anchor_token_ids(tokenizer, extra_ids: Iterable[int] = (), names: Sequence[str] = ANCHOR_TOKENS) -> frozenset[int]:
    """The ids of the anchor tokens that ``tokenizer`` holds as single tokens, plus ``extra_ids``.

    A name counts only when ``convert_tokens_to_ids`` maps it to an id that maps back to the same
    token (so an unknown name, which some tokenizers map to the unknown token, is left out).

    Args:
        tokenizer: a ``transformers`` tokenizer.
        extra_ids: more anchor ids (the engine passes the model's EOS ids: the end of a turn).
        names: token strings to look up.
    """
    ids = set(int(i) for i in extra_ids)
    for name in names:
        i = tokenizer.convert_tokens_to_ids(name)
        if i is not None and tokenizer.convert_ids_to_tokens(i) == name:
            ids.add(int(i))
    return frozenset(ids)


def checkpoint_positions(token_ids: Sequence[int], start: int, anchors: Collection[int], interval: int) -> list[int]:
    """Positions ``p`` in ``(start, start + len(token_ids)]`` whose state a step computing ``token_ids``
    (from position ``start``) should save: ``p = i + 1`` after each anchor token at position ``i``, and
    every multiple of ``interval`` (``0``: none). Ascending, without duplicates."""
    end = start + len(token_ids)
    out = {start + i + 1 for i, t in enumerate(token_ids) if t in anchors} if anchors else set()
    if interval > 0:
        out.update(range((start // interval + 1) * interval, end + 1, interval))
    return sorted(out)


class CheckpointMatch(NamedTuple):
    """A restorable checkpoint: its ``slot`` and the tokens it summarizes (``num_tokens``)."""

    slot: int
    num_tokens: int


class _Entry:
    """Bookkeeping of one occupied slot: the token ids ``[0, p)`` it summarizes, its LRU time, whether
    its tensors are complete (``ready``) or still being written by the current step."""

    __slots__ = ("last_used", "ready", "tokens")

    def __init__(self, tokens: array, last_used: int):
        self.tokens = tokens
        self.last_used = last_used
        self.ready = False


class StateCheckpointStore:
    """A fixed number of recurrent-state checkpoints on the compute device, LRU over slots.

    Args:
        spec: the model's recurrent-state geometry (as the :class:`RecurrentStatePool`'s).
        num_slots: checkpoints kept (``--state-checkpoints``), ``>= 1``.
        conv_dtype: dtype of the conv windows (the model's activation dtype); memories are float32.
        kv_spec, page_size, kv_dtype: geometry of the paged KV pool whose partial last page a checkpoint
            carries.
        device: where the checkpoints live.

    Storage: ``conv [L, N, conv_dim, conv_width]``, ``recurrent [L, N, Hv, Dk, Dv]`` float32 (the state
    pool's layout), ``kv_rows``: per KV-pool plane ``[N, A, page_size - 1, *row]`` (keys and values ``[Hkv,
    D]``, or latent rows ``[W]``). Bytes: ``nbytes``; for Qwen3.6-35B-A3B
    (30 DeltaNet layers, bf16) about 64 MB per slot, nearly all of it the delta-rule memories.

    Counters: ``saved`` (checkpoints completed), ``evicted`` (ready checkpoints overwritten).

    Raises:
        ValueError: ``num_slots < 1``.
    """

    def __init__(self, spec: StateSpec, num_slots: int, conv_dtype: torch.dtype, kv_spec: KVSpec, page_size: int,
                 kv_dtype: torch.dtype, device: torch.device):
        if num_slots < 1:
            raise ValueError("a state checkpoint store needs at least one slot")
        self.spec = spec
        self.num_slots = num_slots
        self.page_size = page_size
        self.device = torch.device(device)
        L = spec.num_layers
        self.conv = torch.zeros((L, num_slots, spec.conv_dim, spec.conv_width), dtype=conv_dtype, device=device)
        self.recurrent = torch.zeros((L, num_slots, spec.num_heads, spec.k_head_dim, spec.v_head_dim),
                                     dtype=torch.float32, device=device)
        self.kv_rows = tuple(torch.zeros((num_slots, kv_spec.num_layers, page_size - 1, *row), dtype=kv_dtype,
                                         device=device) for row in kv_spec.planes)
        self._entries: list[_Entry | None] = [None] * num_slots
        self._clock = 0
        self.saved = 0
        self.evicted = 0

    @property
    def nbytes(self) -> int:
        """Bytes of all checkpoint slots (states and partial-page KV rows)."""
        return self.conv.nbytes + self.recurrent.nbytes + sum(r.nbytes for r in self.kv_rows)

    @property
    def slots_used(self) -> int:
        """Slots holding a complete checkpoint."""
        return sum(e is not None and e.ready for e in self._entries)

    def positions(self) -> list[int]:
        """Token counts of the complete checkpoints, in slot order (for tests and reports)."""
        return [len(e.tokens) for e in self._entries if e is not None and e.ready]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ taking checkpoints
    def reserve(self, tokens: Sequence[int]) -> int | None:
        """A slot for the checkpoint of the prefix ``tokens`` (``[0, p)``), pending until :meth:`commit`.

        Takes a free slot, else evicts the least recently used complete checkpoint.

        Returns:
            the slot, or ``None`` when a checkpoint of exactly these tokens exists already (it is
            refreshed instead) or every slot is pending in this step.
        """
        key = tokens if isinstance(tokens, array) else array("q", tokens)
        free = lru = None
        for slot, e in enumerate(self._entries):
            if e is None:
                free = slot if free is None else free
            elif len(e.tokens) == len(key) and e.tokens == key:
                e.last_used = self._tick()
                return None
            elif e.ready and (lru is None or e.last_used < self._entries[lru].last_used):
                lru = slot
        victim = free if free is not None else lru
        if victim is None:
            return None
        if self._entries[victim] is not None:
            self.evicted += 1
        self._entries[victim] = _Entry(key, self._tick())
        return victim

    def save_layer(self, slot: int, layer: int, conv_window: torch.Tensor, memory: torch.Tensor) -> None:
        """Write linear layer ``layer``'s state into the pending ``slot``.

        Args:
            conv_window: ``[conv_dim, conv_width]`` the conv inputs of the last ``conv_width`` tokens.
            memory: ``[Hv, Dk, Dv]`` the delta-rule memory after the checkpoint's last token.
        """
        self.conv[layer, slot].copy_(conv_window)
        self.recurrent[layer, slot].copy_(memory)

    def save_state(self, slot: int, pool: RecurrentStatePool, pool_slot: int) -> None:
        """Copy a sequence's whole state (every linear layer) from ``pool_slot`` of ``pool`` into ``slot``."""
        self.conv[:, slot].copy_(pool.conv[:, pool_slot])
        self.recurrent[:, slot].copy_(pool.recurrent[:, pool_slot])

    def save_kv(self, slot: int, planes: Sequence[torch.Tensor], kv_slots: torch.Tensor) -> None:
        """Keep the KV rows of the checkpoint's partial last page.

        Args:
            planes: the KV pool's ``planes`` (each ``[A, num_pages * page_size, *row]``).
            kv_slots: ``[r]`` flat KV slots of positions ``[p // page_size * page_size, p)``, ``r < page_size``.
        """
        r = kv_slots.shape[0]
        for rows, plane in zip(self.kv_rows, planes, strict=True):
            rows[slot, :, :r] = plane[:, kv_slots]  # [A, r, *row]

    def commit(self, slot: int) -> None:
        """The pending ``slot`` is complete: it can be found and restored."""
        self._entries[slot].ready = True
        self.saved += 1

    def discard(self, slot: int) -> None:
        """Drop the pending ``slot`` (its step failed); the slot is free again."""
        self._entries[slot] = None

    def clear(self) -> None:
        """Forget every checkpoint (counters kept)."""
        self._entries = [None] * self.num_slots

    # ------------------------------------------------------------------ restoring
    def find(self, token_ids: Sequence[int], max_tokens: int, kv_tokens: int) -> CheckpointMatch | None:
        """The deepest complete checkpoint a sequence starting with ``token_ids`` can resume from.

        A checkpoint of ``p`` tokens qualifies when ``p <= max_tokens``, its tokens equal
        ``token_ids[:p]`` and its whole pages are cached (``p // page_size * page_size <= kv_tokens``).
        The one returned is refreshed (most recently used).

        Args:
            token_ids: the new sequence's tokens.
            max_tokens: deepest usable position (the caller keeps the last token to compute).
            kv_tokens: leading tokens of ``token_ids`` whose KV pages the radix tree holds.
        """
        ps = self.page_size
        ids = token_ids if isinstance(token_ids, array) else array("q", token_ids)
        cands = sorted(((len(e.tokens), slot) for slot, e in enumerate(self._entries)
                        if e is not None and e.ready and len(e.tokens) <= max_tokens
                        and len(e.tokens) // ps * ps <= kv_tokens), reverse=True)
        for p, slot in cands:
            if self._entries[slot].tokens == ids[:p]:
                self._entries[slot].last_used = self._tick()
                return CheckpointMatch(slot, p)
        return None

    def snapshot(self, slot: int) -> StateSnapshot:
        """Views of ``slot``'s state for :meth:`RecurrentStatePool.restore` (which copies them)."""
        return StateSnapshot(self.conv[:, slot], self.recurrent[:, slot])

    def load_kv(self, slot: int, planes: Sequence[torch.Tensor], kv_slots: torch.Tensor) -> None:
        """Write ``slot``'s partial-page KV rows into the KV pool's ``planes`` at ``kv_slots`` (``[r]``, the
        restored sequence's positions ``[p // page_size * page_size, p)``); the inverse of :meth:`save_kv`."""
        r = kv_slots.shape[0]
        for rows, plane in zip(self.kv_rows, planes, strict=True):
            plane[:, kv_slots] = rows[slot, :, :r]
