"""Qwen3-MoE (``Qwen3MoeForCausalLM``, HF ``model_type`` ``qwen3_moe``).

Decoder layers: ``x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))`` where the MLP
is a routed-expert block (``SparseMoeBlock``) on MoE layers and a dense SwiGLU MLP on
``mlp_only_layers`` / off-``decoder_sparse_step`` layers. Reference: ``transformers``'
``modeling_qwen3_moe.py``. Parameter names equal the checkpoint's, except routed experts, which go to
the host expert pool.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch

from edgemoe.config import ModelConfig, hf_dtype, require, rope_from_hf, token_ids
from edgemoe.core import ForwardBatch
from edgemoe.layers.attention import Qwen3Attention
from edgemoe.layers.decoder import DecoderStack, PreNormDecoderLayer, moe_or_dense
from edgemoe.layers.moe import SparseMoeBlock
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.base import MoECausalLM


class DecoderLayer(PreNormDecoderLayer):
    """The pre-norm layer with the second residual add fused into the post-attention RMSNorm and, on MoE
    layers, into the routed block's output (``residual``): the same sums in fewer passes over ``x``."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), batch))
        return self.mlp(h, batch, residual=x) if self.is_moe else x + self.mlp(h)


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3-MoE causal LM (every layer full attention; see :class:`~edgemoe.models.base.MoECausalLM`)."""

    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    hf_classes = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")
    fixed_vocab_presets = frozenset({"qwen3-30b-a3b"})
    # The tiny presets draw weights with std 0.2 (``initializer_range``): with HF's default 0.02 the
    # router softmax is nearly flat (entropy 0.996 of log E) and greedy decoding falls into 2-token
    # loops; 0.2 gives trained-like routing (top-k mass ~0.77) and varied greedy continuations.
    presets: ClassVar[dict[str, dict]] = {
        # 0.85 M params (1.7 MB in bf16); builds and saves in well under a second.
        "tiny": {
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,  # deliberately != hidden_size / num_attention_heads
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 64,
            "intermediate_size": 128,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],  # one dense-MLP layer so that path is exercised
            "norm_topk_prob": True,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "initializer_range": 0.2,
        },
        # 25.6 M params (51 MB in bf16).
        "small": {
            "vocab_size": 1024,
            "hidden_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,  # != 256 / 8
            "num_experts": 32,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 128,
            "intermediate_size": 512,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
            "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "initializer_range": 0.1,  # 0.2 * sqrt(64 / 256): same router sharpness as tiny
        },
        # Qwen/Qwen3-30B-A3B config.json geometry (30.5 B params, ~61 GB in bf16).
        "qwen3-30b-a3b": {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "intermediate_size": 6144,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "max_position_embeddings": 40960,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "bos_token_id": None,
            "eos_token_id": [151645, 151643],  # <|im_end|>, <|endoftext|> of the Qwen3 tokenizer
            "pad_token_id": 151643,
        },
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        with torch.device("cpu"):
            rotary = RotaryEmbedding(cfg)
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        self.model = DecoderStack(cfg, (
            DecoderLayer(cfg, i, Qwen3Attention(cfg, i, rotary), moe_or_dense(cfg, i, SparseMoeBlock), norm)
            for i in range(cfg.num_layers)), norm())

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Normalize a ``qwen3_moe`` config; accepts transformers-4 (``num_experts``, ``rope_theta`` /
        ``rope_scaling``) and transformers-5 (``num_local_experts``, ``rope_parameters``) spellings.
        MoE layers follow the reference: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``.

        Raises:
            ValueError: a missing required field (the message names ``where``).
        """
        def need(key: str, *alts: str):
            return require(raw, key, *alts, where=where)

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        num_layers = int(need("num_hidden_layers"))
        num_experts = int(need("num_experts", "num_local_experts"))
        step = int(raw.get("decoder_sparse_step") or 1)  # >= 1 when given (check_config_fields: 0 divides by zero)
        mlp_only = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(num_layers)
                           if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)
        archs = raw.get("architectures") or cls.architectures
        return ModelConfig(
            architecture=archs[0],
            model_type=raw.get("model_type") or cls.model_types[0],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw.get("intermediate_size") or 0),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_experts=num_experts,
            top_k=int(need("num_experts_per_tok")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            moe_layers=moe_layers,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope_from_hf(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            torch_dtype=hf_dtype(raw),
            eos_token_ids=token_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            raw=dict(raw),
        )

    def attention_layers(self) -> list[Qwen3Attention]:
        return [layer.self_attn for layer in self.model.layers]
