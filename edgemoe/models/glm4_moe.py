"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (``Glm4MoeForCausalLM``, HF ``model_type`` ``glm4_moe``).

Decoder layers: ``x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))``. The first
``first_k_dense_replace`` layers have a dense SwiGLU MLP; every later layer a MoE block of routed
experts with sigmoid, bias-corrected, group-limited routing
(:class:`~edgemoe.layers.router.GroupLimitedSigmoidRouter`, weights times
``routed_scaling_factor``) plus ungated shared experts
(:class:`~edgemoe.layers.moe.SharedExpertsMoeBlock`). Attention is GQA with biased q/k/v projections
(``attention_bias``; ``o_proj`` never has one), an optional per-head RMSNorm of q and k
(``use_qk_norm``: GLM-4.5/4.6/4.7 yes, 4.5-Air no) and partial RoPE (``partial_rotary_factor``,
0.5 in the releases). The ``num_nextn_predict_layers`` multi-token-prediction layers the releases
store after the decoder (``model.layers.{num_hidden_layers + i}.*``) are skipped.

Reference: ``transformers``' ``modeling_glm4_moe.py``. Parameter names equal the checkpoint's; routed
experts (per expert or fused) go to the host expert pool. The router's weight and correction bias
stay float32 at every model dtype, as the reference keeps them.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from edgemoe.config import GroupLimitedRoutingConfig, ModelConfig, hf_dtype, require, rope_from_hf, token_ids
from edgemoe.core import ForwardBatch
from edgemoe.kvcache.pool import PagedKVPool
from edgemoe.layers.attention import FusedQKV, write_and_attend
from edgemoe.layers.decoder import DecoderStack, PreNormDecoderLayer, moe_or_dense
from edgemoe.layers.linear import Linear
from edgemoe.layers.moe import SharedExpertsMoeBlock
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.base import MoECausalLM

# The released GLM-4.5 (zai-org/GLM-4.5) geometry; GLM-4.6 and GLM-4.7 have the same one with a
# 202,752-token context (max_position_embeddings).
_GLM_4_5 = {
    "vocab_size": 151552,
    "hidden_size": 5120,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": True,
    "use_qk_norm": True,
    "intermediate_size": 12288,
    "first_k_dense_replace": 3,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": None,
    "eos_token_id": [151329, 151336, 151338],  # <|endoftext|>, <|user|>, <|observation|>
    "pad_token_id": 151329,
}


class Glm4MoeAttention(FusedQKV, nn.Module):
    """GLM-4.5 attention over the paged KV cache (``Glm4MoeAttention``).

    ``forward(x [T, H], batch) -> [T, H]``: q/k/v projections (bias when ``cfg.attention_bias``),
    per-head RMSNorm of q and k when ``cfg.qk_norm``, RoPE on the first ``partial_rotary_factor *
    head_dim`` dims, attention, ``o_proj`` (no bias). Weight names match the checkpoint (``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``); q/k/v may run as one GEMM
    (:class:`~edgemoe.layers.attention.FusedQKV`).
    """

    def __init__(self, cfg: ModelConfig, attn_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, H, bias=False)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn_index = attn_index
        self.rotary = rotary  # shared, not a registered submodule's weights
        self.kv: PagedKVPool | None = None  # bound by the model runner

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.project_qkv(x)
        q = q.view(T, self.num_heads, D)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, D)  # [T, Hk, D]
        v = v.view(T, self.num_kv_heads, D)  # [T, Hk, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, batch.positions, batch.step_cache)
        o = write_and_attend(q, k, v, self.kv, self.attn_index, batch, D ** -0.5)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * D))


class Glm4MoeForCausalLM(MoECausalLM):
    """GLM-4.5-family causal LM (every layer full attention; see :class:`~edgemoe.models.base.MoECausalLM`)."""

    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)
    hf_classes = ("Glm4MoeConfig", "Glm4MoeForCausalLM")
    float32_parameters = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    synth_tokenizer = "glm4_moe"
    fixed_vocab_presets = frozenset({"glm-4.5", "glm-4.5-air", "glm-4.7"})
    presets: ClassVar[dict[str, dict]] = {
        # A dense first layer, 4 groups of 4 experts of which the 2 best groups are eligible, 2 shared
        # experts (one [64, 64] MLP), q/k norm, q/k/v bias, half-rotary heads and one MTP layer declared
        # (transformers does not build it; tests add its tensors). std 0.2, as Qwen3-MoE's tiny preset:
        # varied routing and greedy continuations at this width.
        "tiny": {
            "vocab_size": 1024,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,  # != hidden_size / num_attention_heads, as in the releases
            "attention_bias": True,
            "use_qk_norm": True,
            "intermediate_size": 128,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
            "n_routed_experts": 16,
            "n_shared_experts": 2,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "num_nextn_predict_layers": 1,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "initializer_range": 0.2,
        },
        # zai-org/GLM-4.5 config.json: 92 layers (3 dense), 160 routed + 1 shared expert, top-8, 2.5x.
        "glm-4.5": _GLM_4_5,
        # zai-org/GLM-4.5-Air config.json: 46 layers (1 dense), 128 routed + 1 shared, no q/k norm, 1.0x.
        "glm-4.5-air": {
            **_GLM_4_5,
            "hidden_size": 4096,
            "num_hidden_layers": 46,
            "use_qk_norm": False,
            "intermediate_size": 10944,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 1408,
            "n_routed_experts": 128,
            "routed_scaling_factor": 1.0,
        },
        # zai-org/GLM-4.7 (and GLM-4.6) config.json: GLM-4.5's geometry, 202,752-token context.
        "glm-4.7": {**_GLM_4_5, "max_position_embeddings": 202752},
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        with torch.device("cpu"):
            rotary = RotaryEmbedding(cfg)
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        self.model = DecoderStack(cfg, (
            PreNormDecoderLayer(cfg, i, Glm4MoeAttention(cfg, i, rotary), moe_or_dense(cfg, i, SharedExpertsMoeBlock),
                                norm)
            for i in range(cfg.num_layers)), norm())

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Normalize a ``glm4_moe`` config; defaults are those of transformers' ``Glm4MoeConfig``
        (``partial_rotary_factor`` 0.5, ``first_k_dense_replace`` 1, ...). Accepts both spellings of the
        experts (``n_routed_experts`` / ``num_local_experts``) and MTP layers
        (``num_nextn_predict_layers`` / ``num_mtp_layers``), RoPE as ``rope_theta`` / ``rope_scaling``
        or ``rope_parameters``, ``partial_rotary_factor`` at the top level or inside the RoPE parameters.

        Raises:
            ValueError: a missing required field, a ``hidden_act`` other than SiLU, a
                ``first_k_dense_replace`` outside ``[0, num_hidden_layers]``, or a group routing the
                experts cannot satisfy (the message names ``where`` and the field).
        """
        def need(key: str, *alts: str):
            return require(raw, key, *alts, where=where)

        def get(key: str, *alts: str, default: Any = None) -> Any:
            return next((raw[k] for k in (key, *alts) if raw.get(k) is not None), default)

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        num_layers = int(need("num_hidden_layers"))
        num_experts = int(need("n_routed_experts", "num_local_experts"))
        top_k = int(need("num_experts_per_tok"))
        first_dense = int(get("first_k_dense_replace", default=1))
        if not 0 <= first_dense <= num_layers:
            raise ValueError(f"{where}: first_k_dense_replace {first_dense} must be in "
                             f"[0, num_hidden_layers = {num_layers}]")
        act = str(get("hidden_act", default="silu"))
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (the experts compute SwiGLU with SiLU)")
        routing = GroupLimitedRoutingConfig(n_group=int(get("n_group", default=1)),
                                            topk_group=int(get("topk_group", default=1)),
                                            routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)))
        routing.check(num_experts, top_k, where)
        rope = rope_from_hf(raw)
        partial = float(rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 0.5)
        rope["partial_rotary_factor"] = partial
        text = {**raw, "rope_parameters": rope}
        text.pop("rope_scaling", None)
        moe_intermediate = int(need("moe_intermediate_size"))
        archs = raw.get("architectures") or cls.architectures
        return ModelConfig(
            architecture=archs[0],
            model_type=raw.get("model_type") or cls.model_types[0],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", default=8)),
            head_dim=int(get("head_dim", default=hidden // heads)),
            intermediate_size=int(need("intermediate_size") if first_dense else get("intermediate_size", default=0)),
            moe_intermediate_size=moe_intermediate,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=bool(get("norm_topk_prob", default=True)),
            moe_layers=tuple(range(first_dense, num_layers)),
            rms_norm_eps=float(get("rms_norm_eps", default=1e-5)),
            rope_parameters=rope,
            max_position_embeddings=int(get("max_position_embeddings", default=131072)),
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            attention_bias=bool(get("attention_bias", default=False)),
            hidden_act=act,
            torch_dtype=hf_dtype(raw),
            eos_token_ids=token_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            partial_rotary_factor=partial,
            shared_expert_intermediate_size=moe_intermediate * int(get("n_shared_experts", default=1)),
            qk_norm=bool(get("use_qk_norm", default=False)),
            group_routing=routing,
            num_mtp_layers=int(get("num_nextn_predict_layers", "num_mtp_layers", default=1)),
            raw=text,
        )

    def attention_layers(self) -> list[Glm4MoeAttention]:
        return [layer.self_attn for layer in self.model.layers]
