"""The per-step context shared by the scheduler, the model runner and the layers.

The scheduler hands the runner one :class:`StepInput` per sequence; the runner builds one
:class:`ForwardBatch` for the step and passes it down through every layer, so nothing per-step lives
in globals (as mini-sglang's ``Batch``/``Context``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class Phase(str, Enum):
    """Which kind of step a batch is: all its sequences prefill, or all decode one token."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class StepInput:
    """One sequence's work in a step.

    Attributes:
        seq_id: engine-chosen id; owns KV pages until the runner frees it.
        token_ids: the new tokens to compute (a prompt, a prefill chunk, or one decode token).
        start_pos: absolute position of ``token_ids[0]``; the KV cache already holds ``[0, start_pos)``.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int


@dataclass
class SeqSlice:
    """One sequence's part of a batch.

    Attributes:
        seq_id: the runner-level sequence id (owner of the KV pages).
        q_start: offset of this sequence's first new token in the flattened batch.
        q_len: number of new tokens computed in this step.
        kv_len: tokens in the KV cache after this step (cached prefix + new tokens).
        page_table: ``[ceil(kv_len / page_size)]`` int64 page ids on the compute device.
        state_slot: the sequence's slot in the recurrent-state pool (models with linear-attention
            layers); ``None`` for models without recurrent state.
        checkpoints: prefill only: ``(offset, slot)`` pairs, ascending: after the first ``offset``
            (``1..q_len``) new tokens, the linear-attention layers save their state into checkpoint
            ``slot`` of the runner's :class:`~edgemoe.kvcache.state_checkpoints.StateCheckpointStore`.
    """

    seq_id: int
    q_start: int
    q_len: int
    kv_len: int
    page_table: torch.Tensor
    state_slot: int | None = None
    checkpoints: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class DecodeMeta:
    """Fixed-shape decode metadata for the device path (Triton paged attention, CUDA graphs).

    Attributes:
        block_tables: ``[B, max_pages]`` int32 page ids of each sequence (padding rows point at a
            scratch page).
        context_lens: ``[B]`` int32 KV length of each sequence after this step.
        valid: ``[B]`` bool, ``False`` on the padding rows of a captured batch size.
        attn_scratch: partition buffers of ``edgemoe.kernels.decode_attention`` (reused by every layer).
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    valid: torch.Tensor
    attn_scratch: object


@dataclass
class ForwardBatch:
    """Everything a forward step needs beyond the weights.

    Attributes:
        phase: prefill or decode.
        input_ids: ``[T]`` int64, the new tokens of all sequences, flattened.
        positions: ``[T]`` int64 absolute positions of those tokens.
        kv_slots: ``[T]`` int64 flat KV slot (``page * page_size + offset``) each new token writes.
        seqs: per-sequence slices, in batch order.
        logits_index: ``[B]`` int64, the row in ``[T]`` whose logits each sequence needs (its last
            new token).
        step: monotonically increasing model-step counter (drives the expert cache's LRU clock).
        record: optional routing-trace callback ``record(batch, moe_layer, topk_ids [T, k] int64,
            topk_weights [T, k])``, called by every MoE layer right after its router (``moe_layer`` is
            the MoE-layer ordinal; weights as the experts receive them, i.e. after ``norm_topk_prob``).
            ``None`` when off (one attribute test per layer). See ``edgemoe.bench.trace.RoutingRecorder``.
        decode: fixed-shape decode metadata when the step runs on the device decode path (CUDA),
            else ``None`` (the per-sequence ``seqs`` path).
        step_cache: tensors derived once per step and shared by the layers (e.g. RoPE tables).
        state_slots: ``[B]`` int64 each sequence's ``state_slot`` on the compute device, in batch
            order; ``None`` for models without recurrent state.
    """

    phase: Phase
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_slots: torch.Tensor
    seqs: list[SeqSlice]
    logits_index: torch.Tensor
    step: int = 0
    record: object | None = field(default=None, repr=False)
    decode: DecodeMeta | None = field(default=None, repr=False)
    step_cache: dict = field(default_factory=dict, repr=False)
    state_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
