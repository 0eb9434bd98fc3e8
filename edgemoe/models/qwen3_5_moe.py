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
expert pool, per expert or fused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from edgemoe.config import LinearAttentionConfig, ModelConfig, hf_dtype, require, rope_from_hf, token_ids
from edgemoe.core import ForwardBatch
from edgemoe.kvcache.state import StateSpec
from edgemoe.layers.attention import GatedAttention
from edgemoe.layers.decoder import DecoderStack
from edgemoe.layers.gated_deltanet import GatedDeltaNet
from edgemoe.layers.moe import SharedExpertMoeBlock
from edgemoe.layers.norm import ZeroCenteredRMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.base import MoECausalLM

CONDITIONAL_GENERATION = "Qwen3_5MoeForConditionalGeneration"
LAYER_TYPES = ("full_attention", "linear_attention")
# The hybrid layer pattern of Qwen3.5/3.6-MoE: three gated DeltaNet layers, then one full-attention layer.
_QWEN3_5_LAYER_TYPES_40 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10


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


class _MultimodalModel(nn.Module):
    """The ``model`` of the conditional-generation layout, holding only its ``language_model``."""

    def __init__(self, language_model: DecoderStack):
        super().__init__()
        self.language_model = language_model


class Qwen3_5MoeForCausalLM(MoECausalLM):
    """Qwen3.5-MoE causal LM (see :class:`~edgemoe.models.base.MoECausalLM`).

    Full-attention layers use the paged KV pool (``attention_layers``); gated DeltaNet layers use
    the recurrent-state pool (``state_layers``, geometry ``state_spec()``).
    """

    architectures = ("Qwen3_5MoeForCausalLM", CONDITIONAL_GENERATION)  # the latter served text only
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    skipped_prefixes = ("model.visual.", "mtp.")  # vision tower, multi-token-prediction head
    hf_classes = ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")
    fixed_vocab_presets = frozenset({"qwen3.6-35b-a3b"})
    presets: ClassVar[dict[str, dict]] = {
        # Hybrid in miniature: 2 gated DeltaNet + 2 gated full-attention layers (both orders), GQA-style
        # 2 q/k heads for 4 value heads in the DeltaNet as in the real model, partial rotary.
        "qwen3.5-moe-tiny": {
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,  # the GPU kernels miscompute at 16 x 16 (tests/gpu/test_gated_delta_gpu.py)
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "attn_output_gate": True,
            "initializer_range": 0.2,  # as Qwen3-MoE's tiny preset
        },
        # Qwen/Qwen3.6-35B-A3B (same text geometry as Qwen/Qwen3.5-35B-A3B): text_config of the released
        # config.json, i.e. transformers' Qwen3_5MoeTextConfig defaults (documented there as the
        # Qwen3.5-35B-A3B checkpoint) plus the released max_position_embeddings 262144, rope theta 1e7,
        # mRoPE sections [11, 11, 10] and eos 248044. 256 routed experts x 40 layers = 64.4 GB in bf16.
        "qwen3.6-35b-a3b": {
            "vocab_size": 248320,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "layer_types": _QWEN3_5_LAYER_TYPES_40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "attn_output_gate": True,
            "initializer_range": 0.02,
            "bos_token_id": None,
            "eos_token_id": 248044,
            "pad_token_id": None,
        },
    }

    def __init__(self, cfg: ModelConfig):
        nested = cfg.architecture == CONDITIONAL_GENERATION
        super().__init__(cfg, "model.language_model." if nested else "model.")
        with torch.device("cpu"):
            rotary = RotaryEmbedding(cfg)
        linear = [cfg.is_linear_attention(i) for i in range(cfg.num_layers)]
        text = DecoderStack(cfg, (
            DecoderLayer(cfg, i, rotary, attn_index=i - sum(linear[:i]), state_index=sum(linear[:i]))
            for i in range(cfg.num_layers)), ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.model = _MultimodalModel(text) if nested else text

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Normalize a ``qwen3_5_moe`` config: a ``Qwen3_5MoeForCausalLM`` text config, or the
        ``Qwen3_5MoeForConditionalGeneration`` config whose language model sits in ``text_config``
        (served text only). Defaults are those of transformers' ``Qwen3_5MoeTextConfig``; an mRoPE
        ``rope_type`` is served as plain RoPE (for text the three position streams coincide).

        Raises:
            ValueError: a missing required field, or ``layer_types`` of the wrong length or with an
                unknown entry (the message names ``where``).
        """
        nested = isinstance(raw.get("text_config"), dict)
        text = dict(raw["text_config"]) if nested else dict(raw)
        text.setdefault("model_type", "qwen3_5_moe_text")
        at = f"{where} text_config" if nested else where

        def need(key: str):
            return require(text, key, where=at)

        num_layers = int(need("num_hidden_layers"))
        types = text.get("layer_types")
        if types is None:  # the reference's rule: every ``full_attention_interval``-th layer is full attention
            every = int(text.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(num_layers)]
        if len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"{at}: layer_types must list {num_layers} entries of 'full_attention' / "
                             f"'linear_attention', got {types}")
        rope = rope_from_hf(text)
        if rope["rope_type"] == "mrope":
            rope["rope_type"] = "default"
        partial = float(rope.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 0.25)
        rope["partial_rotary_factor"] = partial
        text["rope_parameters"] = rope
        archs = raw.get("architectures") or cls.architectures
        return ModelConfig(
            architecture=archs[0],
            model_type=raw.get("model_type") or "qwen3_5_moe_text",
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_layers=num_layers,
            num_heads=int(text.get("num_attention_heads", 16)),
            num_kv_heads=int(text.get("num_key_value_heads") or 2),
            head_dim=int(text.get("head_dim") or 256),
            intermediate_size=0,
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_experts=int(need("num_experts")),
            top_k=int(need("num_experts_per_tok")),
            norm_topk_prob=True,  # the reference router always renormalizes the top-k weights
            moe_layers=tuple(range(num_layers)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool((raw if nested else text).get("tie_word_embeddings", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            hidden_act=str(text.get("hidden_act", "silu")),
            torch_dtype=hf_dtype(text, raw),
            eos_token_ids=token_ids(text.get("eos_token_id", raw.get("eos_token_id"))),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
            layer_types=tuple(types),
            partial_rotary_factor=partial,
            attn_output_gate=bool(text.get("attn_output_gate", True)),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 512)),
            linear_attention=LinearAttentionConfig(
                num_key_heads=int(text.get("linear_num_key_heads", 16)),
                num_value_heads=int(text.get("linear_num_value_heads", 32)),
                key_head_dim=int(text.get("linear_key_head_dim", 128)),
                value_head_dim=int(text.get("linear_value_head_dim", 128)),
                conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            ),
            raw=text,
        )

    def attention_layers(self) -> list[GatedAttention]:
        """The full-attention layers, in order (the only owners of KV pages)."""
        return [layer.self_attn for layer in self.decoder.layers if not layer.is_linear]

    def state_layers(self) -> list[GatedDeltaNet]:
        """The gated DeltaNet layers, in order (owners of recurrent state)."""
        return [layer.linear_attn for layer in self.decoder.layers if layer.is_linear]

    def state_spec(self) -> StateSpec | None:
        layers = self.state_layers()
        if not layers:
            return None
        la = layers[0]
        return StateSpec(num_layers=len(layers), conv_dim=la.conv_dim, conv_width=la.kernel - 1,
                         num_heads=la.num_v_heads, k_head_dim=la.head_k_dim, v_head_dim=la.head_v_dim)
