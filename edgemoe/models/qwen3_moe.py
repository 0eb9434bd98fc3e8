"""Qwen3-MoE (``Qwen3MoeForCausalLM``, HF ``model_type`` ``qwen3_moe``).

Decoder layers: ``x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))`` where the MLP
is a routed-expert block (``SparseMoeBlock``) on MoE layers and a dense SwiGLU MLP on
``mlp_only_layers`` / off-``decoder_sparse_step`` layers. Reference: ``transformers``'
``modeling_qwen3_moe.py``. Parameter names equal the checkpoint's, except routed experts, which go to
the host expert pool (``expert_target``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.core import ForwardBatch
from edgemoe.layers.attention import Qwen3Attention
from edgemoe.layers.mlp import DenseMLP
from edgemoe.layers.moe import SparseMoeBlock
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer, rotary)
        if layer in cfg.moe_layers:
            self.mlp = SparseMoeBlock(cfg, cfg.moe_ordinal(layer))
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, batch) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(h))


class Qwen3MoeBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(nn.Module):
    """Qwen3-MoE causal LM over a :class:`ForwardBatch`.

    ``forward(batch) -> logits [B, vocab] float32`` for each sequence's last new token.
    Build on the meta device, then let the weight loader materialize parameters.
    """

    supports_cuda_graphs = True  # the decode step has fixed shapes on the device path
    skipped_prefixes: tuple[str, ...] = ()  # checkpoint tensors a text-only server skips: none

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        with torch.device("cpu"):
            rotary = RotaryEmbedding(cfg)
        self.model = Qwen3MoeBackbone(cfg, rotary)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def attention_layers(self) -> list[Qwen3Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def state_spec(self) -> None:
        """No recurrent state: every layer is full attention."""
        return None

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def expert_target(self, name: str) -> tuple[int, int | None, str] | None:
        """Map a checkpoint tensor name to ``(moe_layer, expert or None, role)`` if it is a routed expert.

        ``role`` is ``gate_proj | up_proj | down_proj`` (per-expert layout of released checkpoints,
        expert given) or ``gate_up_proj | down_proj`` (transformers-5 fused layout ``[E, ...]``,
        expert ``None``). Returns ``None`` for non-expert tensors.

        Raises:
            ValueError: an expert tensor of a layer that is not a MoE layer.
        """
        m = _EXPERT.match(name)
        if m:
            layer, expert, role = int(m.group(1)), int(m.group(2)), m.group(3)
        else:
            m = _FUSED.match(name)
            if not m:
                return None
            layer, expert, role = int(m.group(1)), None, m.group(2)
        if layer not in self.config.moe_layers:
            raise ValueError(f"tensor {name}: layer {layer} is not a MoE layer in this config")
        return self.config.moe_ordinal(layer), expert, role

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        for layer in self.model.layers:
            x = layer(x, batch)
        x = self.model.norm(x.index_select(0, batch.logits_index))  # [B, H]
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(x, w).float()  # [B, V]
