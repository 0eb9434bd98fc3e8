"""The decoder scaffolding the model families share: a pre-norm residual decoder layer and the decoder
stack, under the parameter names of the Hugging Face layouts (``self_attn``, ``mlp``, ``input_layernorm``,
``post_attention_layernorm``; ``embed_tokens``, ``layers``, ``norm``).

Reference: the decoder layers of ``transformers``' ``modeling_deepseek_v3.py``, ``modeling_glm4_moe.py``,
``modeling_gpt_oss.py`` and ``modeling_qwen3_moe.py`` (the same two residual branches in each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.core import ForwardBatch
from edgemoe.layers.mlp import DenseMLP


class PreNormDecoderLayer(nn.Module):
    """``x += self_attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))``.

    On a MoE layer (``layer in cfg.moe_layers``) ``mlp`` is a routed block, called with the batch;
    elsewhere a dense MLP of the hidden states alone (:func:`moe_or_dense` builds either).

    Args:
        cfg: the normalized model config.
        layer: the layer's index in the decoder.
        self_attn: the attention module, called as ``self_attn(h [T, H], batch) -> [T, H]``.
        mlp: the MLP or routed-expert block.
        norm: builds one of the two RMSNorms (the family's kind, e.g. with a float32 scale for gpt-oss).
    """

    def __init__(self, cfg: ModelConfig, layer: int, self_attn: nn.Module, mlp: nn.Module,
                 norm: Callable[[], nn.Module]):
        super().__init__()
        self.self_attn = self_attn
        self.is_moe = layer in cfg.moe_layers
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x``: ``[T, H]`` hidden states in the model dtype; returns the layer's output, same shape and dtype."""
        x = x + self.self_attn(self.input_layernorm(x), batch)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, batch) if self.is_moe else self.mlp(h))


def moe_or_dense(cfg: ModelConfig, layer: int, moe_block: Callable[[ModelConfig, int], nn.Module]) -> nn.Module:
    """``moe_block(cfg, MoE ordinal)`` on a MoE layer, else a dense SwiGLU MLP of ``cfg.intermediate_size``."""
    if layer in cfg.moe_layers:
        return moe_block(cfg, cfg.moe_ordinal(layer))
    return DenseMLP(cfg.hidden_size, cfg.intermediate_size)


class DecoderStack(nn.Module):
    """The decoder under its checkpoint names: ``embed_tokens`` (``[vocab, H]``), ``layers`` and the final
    ``norm``; :class:`~edgemoe.models.base.MoECausalLM` runs its forward (the stack has none of its own).
    Models are built on the meta device and loaded by name, so the order the modules are created in does not
    matter."""

    def __init__(self, cfg: ModelConfig, layers: Iterable[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
