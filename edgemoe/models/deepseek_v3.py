"""DeepSeek-V3 / R1 and Kimi-K2 (``DeepseekV3ForCausalLM``, HF ``model_type`` ``deepseek_v3``; Kimi-K2's
checkpoints name the same architecture with ``model_type`` ``kimi_k2``).

Decoder layers: ``x += mla(input_layernorm(x)); x += mlp(post_attention_layernorm(x))`` where attention is
multi-head latent attention over a paged cache of latent rows (:mod:`edgemoe.layers.mla`) and the MLP is
a dense SwiGLU MLP on the first ``first_k_dense_replace`` layers, then a MoE block: sigmoid routing with
a score-correction bias and group-limited top-k (:class:`~edgemoe.layers.router.GroupLimitedSigmoidRouter`),
routed experts through the hybrid executor, plus ``n_shared_experts`` shared experts. Reference:
transformers' ``modeling_deepseek_v3.py``. Parameter names equal the checkpoint's, except routed
experts, which go to the host expert pool. The multi-token-prediction layers of a release
(``model.layers.{N}...`` for ``N >= num_hidden_layers``) and the rotary ``inv_freq`` buffers some
releases saved are skipped.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, ClassVar

import torch

from edgemoe.config import (
    GroupLimitedRoutingConfig,
    LatentAttentionConfig,
    ModelConfig,
    hf_dtype,
    require,
    rope_from_hf,
    token_ids,
)
from edgemoe.kvcache.pool import KVSpec
from edgemoe.layers.decoder import DecoderStack, PreNormDecoderLayer, moe_or_dense
from edgemoe.layers.mla import LatentAttention
from edgemoe.layers.moe import SharedExpertsMoeBlock
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.base import MoECausalLM

# Transformers names the HF config class's model type deepseek_v3; Kimi-K2's checkpoints say kimi_k2.
REFERENCE_MODEL_TYPE = "deepseek_v3"

# DeepSeek-V3's YaRN extension as released (deepseek-ai/DeepSeek-V3 config.json ``rope_scaling``).
_DEEPSEEK_V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}


def mtp_layers(raw: dict[str, Any]) -> int:
    """Multi-token-prediction layers of the checkpoint: ``num_nextn_predict_layers`` (transformers 5 also
    reads ``num_mtp_layers``), default 1 as in transformers' ``DeepseekV3Config``."""
    value = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 1))
    return int(value or 0)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for a non-default rope type
    with a non-zero ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    return scale


class DeepseekV3ForCausalLM(MoECausalLM):
    """DeepSeek-V3 causal LM with a latent KV cache (see :class:`~edgemoe.models.base.MoECausalLM`).

    Every layer is an attention layer caching one latent row of ``kv_lora_rank + qk_rope_head_dim``
    values per token (``kv_spec``). The router's weight and correction bias stay float32 at any serving
    dtype (as transformers keeps them).
    """

    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3", "kimi_k2")
    hf_classes = ("DeepseekV3Config", "DeepseekV3ForCausalLM")
    float32_parameters = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    fixed_vocab_presets = frozenset({"deepseek-v3", "kimi-k2"})
    # The tiny presets draw weights with std 0.2 (``initializer_range``), as Qwen3-MoE's: trained-like
    # router sharpness and varied greedy continuations.
    presets: ClassVar[dict[str, dict]] = {
        # Every MLA/routing feature at a small size: q LoRA, YaRN with mscale (softmax scale x mscale^2),
        # interleaved RoPE, 4 groups of 4 experts (2 chosen), one dense layer, two shared experts.
        "tiny": {
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 24,  # != qk_nope_head_dim, so the two up-projections cannot be confused
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1,
            "max_position_embeddings": 2048,
            "rope_parameters": {**_DEEPSEEK_V3_ROPE, "factor": 4.0, "original_max_position_embeddings": 512},
            "rope_interleave": True,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "initializer_range": 0.2,
        },
        # deepseek-ai/DeepSeek-V3 (and DeepSeek-R1, same geometry) config.json: 671 B parameters without
        # the MTP layer. The release's FP8 quantization_config is left out (dummy weights are bf16).
        "deepseek-v3": {
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 3,
            "num_nextn_predict_layers": 1,
            "max_position_embeddings": 163840,
            "rope_parameters": _DEEPSEEK_V3_ROPE,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
        # moonshotai/Kimi-K2-Instruct config.json (model_type kimi_k2): 1.03 T parameters, 384 experts in
        # one group, 64 heads, one dense layer, no MTP layer, YaRN x32 over rope theta 50000.
        "kimi-k2": {
            "vocab_size": 163840,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 384,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.827,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 0,
            "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "bos_token_id": 163584,
            "eos_token_id": 163585,
        },
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        with torch.device("cpu"):
            rotary = RotaryEmbedding(cfg, interleaved=cfg.latent_attention.rope_interleave)
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        self.model = DecoderStack(cfg, (
            PreNormDecoderLayer(cfg, i, LatentAttention(cfg, i, rotary), moe_or_dense(cfg, i, SharedExpertsMoeBlock),
                                norm)
            for i in range(cfg.num_layers)), norm())
        # the base class skips the multi-token-prediction layers; Kimi-K2 also saves inv_freq buffers
        self.skipped_prefixes += tuple(f"model.layers.{i}.self_attn.rotary_emb." for i in range(cfg.num_layers))

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Normalize a ``deepseek_v3`` (or ``kimi_k2``) config. Missing fields take transformers'
        ``DeepseekV3Config`` defaults (the reference implementation's); ``rope_scaling`` (the releases'
        spelling) and ``rope_parameters`` are both read. Decoder layer ``i`` is a MoE layer when ``i >=
        first_k_dense_replace``. The number of multi-token-prediction layers
        (``num_nextn_predict_layers``, default 1) only decides which checkpoint layers are skipped.

        Raises:
            ValueError: a missing required field, or a field the reference does not implement
                (``scoring_func`` other than sigmoid, ``topk_method`` other than ``noaux_tc``,
                ``moe_layer_freq`` other than 1, ``num_key_value_heads`` other than
                ``num_attention_heads``, an activation other than SiLU) or an inconsistent grouping of
                experts; the message names ``where`` and the field.
        """
        def need(key: str, *alts: str):
            return require(raw, key, *alts, where=where)

        def check(field: str, ok: bool, rule: str) -> None:
            if not ok:
                raise ValueError(f"{where}: {field} {raw.get(field)!r} is not served: {rule}")

        check("scoring_func", raw.get("scoring_func", "sigmoid") == "sigmoid",
              "DeepSeek-V3 routing scores with sigmoid")
        check("topk_method", raw.get("topk_method", "noaux_tc") == "noaux_tc",
              "DeepSeek-V3 routing is noaux_tc (score-correction bias, group-limited top-k)")
        check("moe_layer_freq", int(raw.get("moe_layer_freq", 1) or 1) == 1,
              "every layer from first_k_dense_replace on is a MoE layer (as transformers builds DeepseekV3)")
        check("hidden_act", raw.get("hidden_act", "silu") == "silu", "the MLPs are SwiGLU (silu)")
        hidden = int(need("hidden_size"))
        heads = int(raw.get("num_attention_heads", 128))
        check("num_key_value_heads", int(raw.get("num_key_value_heads") or heads) == heads,
              "multi-head latent attention has one key and value per query head")
        num_layers = int(raw.get("num_hidden_layers", 61))
        num_experts = int(need("n_routed_experts", "num_local_experts", "num_experts"))
        top_k = int(raw.get("num_experts_per_tok", 8))
        n_group, topk_group = int(raw.get("n_group", 8) or 0), int(raw.get("topk_group", 4) or 0)
        if n_group < 1 or num_experts % n_group or num_experts // n_group < 2 or not 1 <= topk_group <= n_group \
                or not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(f"{where}: n_routed_experts {num_experts}, n_group {n_group}, topk_group {topk_group}, "
                             f"num_experts_per_tok {top_k}: the experts must form n_group groups of at least 2, "
                             "topk_group in [1, n_group], top-k within the chosen groups")
        first_dense = int(raw.get("first_k_dense_replace", 3) or 0)
        moe_intermediate = int(need("moe_intermediate_size"))
        q_lora = raw.get("q_lora_rank", 1536)
        nope, rope_dim = int(raw.get("qk_nope_head_dim", 128)), int(raw.get("qk_rope_head_dim", 64))
        rope = rope_from_hf(raw)
        reference = {**raw, "model_type": REFERENCE_MODEL_TYPE}
        archs = raw.get("architectures") or cls.architectures
        return ModelConfig(
            architecture=archs[0],
            model_type=raw.get("model_type") or cls.model_types[0],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=rope_dim,  # the rotary width (transformers sets head_dim = qk_rope_head_dim)
            intermediate_size=int(raw.get("intermediate_size", 18432)),
            moe_intermediate_size=moe_intermediate,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            moe_layers=tuple(range(first_dense, num_layers)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act="silu",
            torch_dtype=hf_dtype(raw),
            eos_token_ids=token_ids(raw.get("eos_token_id", 1)),
            bos_token_id=raw.get("bos_token_id", 0),
            pad_token_id=raw.get("pad_token_id"),
            shared_expert_intermediate_size=moe_intermediate * int(raw.get("n_shared_experts", 1) or 0),
            num_mtp_layers=mtp_layers(raw),
            latent_attention=LatentAttentionConfig(
                q_lora_rank=None if q_lora is None else int(q_lora),
                kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
                qk_nope_head_dim=nope,
                qk_rope_head_dim=rope_dim,
                v_head_dim=int(raw.get("v_head_dim", 128)),
                rope_interleave=bool(raw.get("rope_interleave", True)),
                softmax_scale=softmax_scale(nope + rope_dim, rope),
            ),
            group_routing=GroupLimitedRoutingConfig(n_group=n_group, topk_group=topk_group,
                                                    routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5))),
            raw=reference,
        )

    def attention_layers(self) -> list[LatentAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def kv_spec(self) -> KVSpec:
        """One latent row of ``kv_lora_rank + qk_rope_head_dim`` per token and layer (the first ``kv_lora_rank``
        values are the value of the absorbed form)."""
        mla = self.config.latent_attention
        return KVSpec.latent(len(self.attention_layers()), mla.latent_dim, mla.kv_lora_rank)
