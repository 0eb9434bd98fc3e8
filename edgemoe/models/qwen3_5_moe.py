"""Qwen3.5/3.6-MoE, text only (``Qwen3_5MoeForCausalLM`` and ``Qwen3_5MoeForConditionalGeneration``,
HF ``model_type`` ``qwen3_5_moe``).

A hybrid decoder: each layer's token mixer is either a gated DeltaNet (``layer_types[i] ==
"linear_attention"``, recurrent state per sequence) or gated full attention (paged KV), and every
layer's MLP is a MoE block with a gated shared expert. Norms are zero-centered RMSNorms::

    x += mixer(input_layernorm(x));  x += moe(post_attention_layernorm(x))

Reference: ``transformers``' ``modeling_qwen3_5_moe.py``. Parameter names equal the checkpoint's:
``model.layers.N...`` for ``Qwen3_5MoeForCausalLM``, ``model.language_model.layers.N...`` for the
conditional-generation layout, whose vision tower (``model.visual.*``) and multi-token-prediction
head (``mtp.*``) a text-only server skips (``skipped_prefixes``). Routed experts go to the host
expert pool (``expert_target``), per expert or fused.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.core import ForwardBatch
from edgemoe.kvcache.state import StateSpec
from edgemoe.layers.attention import GatedAttention
from edgemoe.layers.gated_deltanet import GatedDeltaNet
from edgemoe.layers.moe import SharedExpertMoeBlock
from edgemoe.layers.norm import ZeroCenteredRMSNorm
from edgemoe.layers.rotary import RotaryEmbedding

CONDITIONAL_GENERATION = "Qwen3_5MoeForConditionalGeneration"


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, attn_index: int, state_index: int):
        super().__init__()
        self.is_linear = cfg.is_linear_attention(layer)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, state_index)
        else:
            self.self_attn = GatedAttention(cfg, attn_index, rotary)
        self.mlp = SharedExpertMoeBlock(cfg, cfg.moe_ordinal(layer))
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        x = x + mixer(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x), batch)


class Qwen3_5MoeTextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        linear = [cfg.is_linear_attention(i) for i in range(cfg.num_layers)]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, rotary, attn_index=i - sum(linear[:i]), state_index=sum(linear[:i]))
            for i in range(cfg.num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _MultimodalModel(nn.Module):
    """The ``model`` of the conditional-generation layout, holding only its ``language_model``."""

    def __init__(self, language_model: Qwen3_5MoeTextModel):
        super().__init__()
        self.language_model = language_model


class Qwen3_5MoeForCausalLM(nn.Module):
    """Qwen3.5-MoE causal LM over a :class:`ForwardBatch`.

    ``forward(batch) -> logits [B, vocab] float32`` for each sequence's last new token. Full-attention
    layers use the paged KV pool bound by the runner (``attention_layers``); gated DeltaNet layers
    use its recurrent-state pool (``state_layers``, geometry ``state_spec()``). Build on the meta
    device, then let the weight loader materialize parameters.
    """

    skipped_prefixes = ("model.visual.", "mtp.")  # vision tower, multi-token-prediction head

    supports_cuda_graphs = True  # decode has fixed shapes on the device path (state slots included)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        with torch.device("cpu"):
            rotary = RotaryEmbedding(cfg)
        text = Qwen3_5MoeTextModel(cfg, rotary)
        self.nested = cfg.architecture == CONDITIONAL_GENERATION
        self.model = _MultimodalModel(text) if self.nested else text
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        prefix = re.escape("model.language_model." if self.nested else "model.")
        self._expert = re.compile(rf"^{prefix}layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
                                  r"\.weight$")
        self._fused = re.compile(rf"^{prefix}layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")

    @property
    def text_model(self) -> Qwen3_5MoeTextModel:
        """The decoder stack (``model`` or, in the conditional-generation layout, ``model.language_model``)."""
        return self.model.language_model if self.nested else self.model

    def attention_layers(self) -> list[GatedAttention]:
        """The full-attention layers, in order (the only owners of KV pages)."""
        return [layer.self_attn for layer in self.text_model.layers if not layer.is_linear]

    def state_layers(self) -> list[GatedDeltaNet]:
        """The gated DeltaNet layers, in order (owners of recurrent state)."""
        return [layer.linear_attn for layer in self.text_model.layers if layer.is_linear]

    def state_spec(self) -> StateSpec | None:
        """Per-sequence recurrent-state geometry for the runner's pool (``None`` without linear layers)."""
        layers = self.state_layers()
        if not layers:
            return None
        la = layers[0]
        return StateSpec(num_layers=len(layers), conv_dim=la.conv_dim, conv_width=la.kernel - 1,
                         num_heads=la.num_v_heads, k_head_dim=la.head_k_dim, v_head_dim=la.head_v_dim)

    def moe_blocks(self) -> list[SharedExpertMoeBlock]:
        """The MoE block of every layer, in layer order (the runner binds the routed experts to them)."""
        return [layer.mlp for layer in self.text_model.layers]

    def expert_target(self, name: str) -> tuple[int, int | None, str] | None:
        """Map a checkpoint tensor name to ``(moe_layer, expert or None, role)`` if it is a routed expert.

        ``role`` is ``gate_proj | up_proj | down_proj`` (per-expert layout, expert given) or
        ``gate_up_proj | down_proj`` (fused ``[E, ...]`` layout of the released checkpoints and of
        transformers 5, expert ``None``). Returns ``None`` for other tensors. Every layer is a MoE layer.
        """
        m = self._expert.match(name)
        if m:
            layer, expert, role = int(m.group(1)), int(m.group(2)), m.group(3)
        else:
            m = self._fused.match(name)
            if not m:
                return None
            layer, expert, role = int(m.group(1)), None, m.group(2)
        if layer >= self.config.num_layers:
            raise ValueError(f"tensor {name}: layer {layer} >= num_hidden_layers {self.config.num_layers}")
        return self.config.moe_ordinal(layer), expert, role

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        text = self.text_model
        x = text.embed_tokens(batch.input_ids)  # [T, H]
        for layer in text.layers:
            x = layer(x, batch)
        x = text.norm(x.index_select(0, batch.logits_index))  # [B, H]
        w = text.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(x, w).float()  # [B, V]
