"""transformers' gated-delta-rule reference functions, called the same way under every transformers
version the project meets (shared by the CPU-interpreter and the GPU kernel tests)."""

from __future__ import annotations

from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    causal_conv1d_update as ref_conv_update,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

__all__ = ["ref_chunk", "ref_conv_update", "ref_recurrent"]


def _heads_repeated(ref):
    """``ref`` called with q/k repeated to the value heads (``repeat_interleave``): the functions of
    transformers 5.17 do not repeat them, those of 5.24 do; repeated q/k suit both."""

    def call(query, key, value, *args, **kwargs):
        rep = value.shape[2] // key.shape[2]
        return ref(query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2), value, *args, **kwargs)

    return call


ref_chunk = _heads_repeated(torch_chunk_gated_delta_rule)
ref_recurrent = _heads_repeated(torch_recurrent_gated_delta_rule)
