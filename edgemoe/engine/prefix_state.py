"""Prefix reuse across requests: the radix-tree prefix cache and, for hybrid models, recurrent-state
checkpoints.

A model without recurrent state keeps everything a layer needs in its KV pages, so a new request
reuses the longest cached run of whole pages its prompt starts with. A hybrid model's gated DeltaNet
layers summarize the whole prefix in a state that cannot be partly reused, so it resumes instead at
the deepest *state checkpoint* whose tokens start the prompt: checkpoints are taken after anchor
tokens (where agent harnesses edit context: ``</think>``, ``</tool_call>``, ``</tool_response>``,
end of turn) and every ``interval`` tokens, each holding the full recurrent state plus the KV rows
of its partial last page, LRU-evicted independently of KV pages (FreeToken, arXiv 2608.16157).
"""

from __future__ import annotations

from array import array

import torch

from edgemoe.core import Phase, StepInput
from edgemoe.kvcache.pool import KVCacheFullError, PagedKVPool
from edgemoe.kvcache.state import RecurrentStatePool
from edgemoe.kvcache.state_checkpoints import StateCheckpointStore, anchor_token_ids, checkpoint_positions

Plan = list[tuple[int, int]]
"""One sequence's checkpoints due in a step: ``(absolute position, checkpoint slot)`` ascending."""


class PrefixStateManager:
    """Attaches cached prefixes to new sequences and runs the state-checkpoint store.

    Args:
        kv: the paged KV pool (its radix tree is the prefix cache; ``None`` tree = prefix caching off).
        state: the recurrent-state pool, or ``None`` for models without recurrent state.
        tokenizer: looks up the anchor tokens.
        eos_token_ids: also anchors.
        dtype, device: of the checkpoint store.

    Attributes:
        checkpoints: the :class:`StateCheckpointStore`, or ``None`` (no recurrent state, prefix caching
            off, zero slots, or nothing would ever be checkpointed).
        anchor_ids: the anchor token ids in use. interval: the checkpoint interval (0: anchors only).
    """

    def __init__(self, kv: PagedKVPool, state: RecurrentStatePool | None, tokenizer,
                 eos_token_ids: list[int], dtype: torch.dtype, device: torch.device):
        self.kv, self.state = kv, state
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.dtype, self.device = dtype, device
        self.checkpoints: StateCheckpointStore | None = None
        self.anchor_ids: frozenset[int] = frozenset()
        self.interval = 0
        self._tokens: dict[int, array] = {}  # seq_id -> its tokens so far (the key of its checkpoints)

    # ------------------------------------------------------------------ configuration
    def set_checkpoints(self, slots: int, interval: int, anchors: bool = True) -> None:
        """(Re)build the checkpoint store at a safe point between steps, dropping what it held (the
        caller rebinds the model's state layers to :attr:`checkpoints`).

        Args:
            slots: checkpoints kept, LRU (0: none, so a hybrid model reuses no cached prefix).
            interval: also checkpoint every ``interval`` tokens (0: only at anchors).
            anchors: checkpoint after each anchor token (``anchor_token_ids`` of the tokenizer plus
                the model's EOS ids).

        Raises:
            ValueError: negative ``slots`` or ``interval``.
        """
        if slots < 0 or interval < 0:
            raise ValueError(f"state checkpoints: slots ({slots}) and interval ({interval}) must be >= 0")
        self.interval = interval
        self.anchor_ids = anchor_token_ids(self.tokenizer, self.eos_token_ids) if anchors else frozenset()
        self._tokens.clear()
        self.checkpoints = None  # the old store is released before the new one is allocated
        if self.state is None or not slots or self.kv.prefix_cache is None or not (self.anchor_ids or interval):
            return
        kv = self.kv
        self.checkpoints = StateCheckpointStore(self.state.spec, slots, self.dtype, kv.spec, kv.page_size,
                                                kv.planes[0].dtype, self.device)

    def forget(self, seq_id: int) -> None:
        """Drop ``seq_id``'s token record (it finished, or a failed step dropped its state)."""
        self._tokens.pop(seq_id, None)

    # ------------------------------------------------------------------ prefixes
    def attach(self, seq_id: int, token_ids: list[int]) -> int:
        """Give the new sequence ``seq_id`` the longest reusable cached prefix of ``token_ids`` (the
        tokens it must hold: a prompt or, after preemption, prompt + output).

        At least the last token is always left to compute (its logits are needed); the match is
        floored to whole pages. A model with recurrent state resumes instead at the deepest state
        checkpoint whose tokens start ``token_ids`` and whose whole KV pages the tree holds: it
        borrows those pages, gets the checkpoint's partial-page KV rows in a fresh page of its own
        and its recurrent state restored; without a usable checkpoint it reuses nothing.

        Returns:
            tokens reused: the sequence's prefill starts at this position (0 when prefix caching is off).
        """
        cache, ps = self.kv.prefix_cache, self.kv.page_size
        if cache is None or len(token_ids) <= ps:
            return 0
        match = cache.match_prefix(token_ids[:-1])
        if self.state is not None:
            return self._restore_checkpoint(seq_id, token_ids, match.num_tokens)
        n = match.num_tokens // ps * ps
        if n == 0:
            return 0
        if n < match.num_tokens:
            match = cache.match_prefix(token_ids[:n])
        self.kv.attach_prefix(seq_id, match)
        return n

    def _restore_checkpoint(self, seq_id: int, token_ids: list[int], kv_tokens: int) -> int:
        """Resume the new sequence ``seq_id`` at the deepest usable state checkpoint (``kv_tokens``:
        leading tokens whose whole pages are cached); returns its position, 0 (nothing attached) when
        none is usable, no state slot is free or no page is free for the partial page."""
        store = self.checkpoints
        if store is None or not self.state.can_hold(seq_id):
            return 0
        ids = array("q", token_ids)
        found = store.find(ids, len(ids) - 1, kv_tokens)
        if found is None:
            return 0
        ps, p = self.kv.page_size, found.num_tokens
        full = p // ps * ps
        if full:
            self.kv.attach_prefix(seq_id, self.kv.prefix_cache.match_prefix(token_ids[:full]))
        if p > full:
            try:
                self.kv.allocate(seq_id, p)
            except KVCacheFullError:
                self.kv.free(seq_id)
                return 0
            store.load_kv(found.slot, self.kv.planes, self.kv.slots(seq_id, full, p))
        self.state.restore(seq_id, store.snapshot(found.slot))
        self._tokens[seq_id] = ids[:p]
        return p

    def cache(self, seq_id: int, token_ids: list[int]) -> None:
        """Make the full KV pages of ``seq_id`` (holding ``token_ids`` from position 0) reusable by
        later requests (no-op when prefix caching is off)."""
        self.kv.cache_prefix(seq_id, token_ids)

    # ------------------------------------------------------------------ per step
    def _track_tokens(self, inp: StepInput) -> array | None:
        """Append ``inp``'s tokens to its sequence's token record (cut back to ``start_pos`` first, which
        a rewind may need); ``None`` (and the record dropped) when the tokens before ``start_pos`` are
        unknown here, e.g. after a caller's state restore."""
        tokens = self._tokens.get(inp.seq_id)
        if inp.start_pos == 0:
            tokens = array("q")
        elif tokens is None or len(tokens) < inp.start_pos:
            self._tokens.pop(inp.seq_id, None)
            return None
        else:
            del tokens[inp.start_pos:]
        tokens.extend(inp.token_ids)
        self._tokens[inp.seq_id] = tokens
        return tokens

    def plan(self, inputs: list[StepInput]) -> list[Plan]:
        """Per input, the checkpoints this step passes where one is due (after an anchor token, at a
        multiple of the interval), each slot reserved (pending) in the store. Only the deepest
        ``num_slots`` of a sequence are taken (no more can survive the step); positions already
        checkpointed with the same tokens are skipped."""
        store = self.checkpoints
        plans: list[Plan] = [[] for _ in inputs]
        if store is None:
            return plans
        for inp, plan in zip(inputs, plans):
            tokens = self._track_tokens(inp)
            if tokens is None:
                continue
            due = checkpoint_positions(inp.token_ids, inp.start_pos, self.anchor_ids, self.interval)
            for p in due[-store.num_slots:]:
                slot = store.reserve(tokens[:p])
                if slot is not None:
                    plan.append((p, slot))
        return plans

    def commit(self, inputs: list[StepInput], state_slots: list[int | None], plans: list[Plan],
               phase: Phase) -> None:
        """After a successful step: complete its checkpoints (a decode step's state is copied here; the
        layers saved a prefill step's) with the KV rows of their partial last page."""
        store, kv = self.checkpoints, self.kv
        if store is None:
            return
        for inp, state_slot, plan in zip(inputs, state_slots, plans):
            for p, slot in plan:
                if phase is Phase.DECODE:
                    store.save_state(slot, self.state, state_slot)
                if p % kv.page_size:
                    store.save_kv(slot, kv.planes, kv.slots(inp.seq_id, p - p % kv.page_size, p))
                store.commit(slot)

    def discard(self, inputs: list[StepInput], plans: list[Plan]) -> None:
        """After a failed step: drop its sequences' token records and the checkpoints it reserved."""
        for inp in inputs:
            self._tokens.pop(inp.seq_id, None)
        if self.checkpoints is not None:
            for plan in plans:
                for _, slot in plan:
                    self.checkpoints.discard(slot)
