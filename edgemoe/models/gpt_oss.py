"""gpt-oss-20b and gpt-oss-120b (``GptOssForCausalLM``, HF ``model_type`` ``gpt_oss``).

Decoder layers: ``x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))``, every layer a MoE
layer. Attention is GQA with q/k/v/o biases, YaRN RoPE (rotating halves), a learned *sink* logit per query
head that joins the softmax with a zero value, and, on the layers ``layer_types`` marks
``sliding_attention`` (every other one in the releases, from layer 0), a sliding window of
``sliding_window`` positions (128); the other layers attend to the whole prefix. The router is a linear
layer with a bias; a token takes the top-k (4) experts by logit and weighs them by the softmax of those k
logits. Experts have biases on both projections and compute gpt-oss's clamped SwiGLU
(``ExpertActivation("swiglu_oai", alpha, limit)``). A bf16 checkpoint stores them fused and transposed with
gate and up outputs interleaved (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``, their ``_bias``); the
releases store them MXFP4 (``gate_up_proj_blocks [E, 2I, H/32, 16]`` / ``_scales`` (E8M0), interleaved
too, ``down_proj_*``, bf16 ``_bias``). The loader undoes both layouts into the host pool's rows (MXFP4 rows
stay MXFP4, dequantized where they compute; biases in float32 row sections). RMSNorm multiplies by its
weight in float32 before rounding.

Reference: transformers' ``modeling_gpt_oss.py`` (``GptOssAttention`` with ``eager_attention_forward``,
``GptOssTopKRouter``, ``GptOssExperts``, ``GptOssRMSNorm``). Parameter names equal the checkpoint's;
routed experts and their biases go to the host expert pool. The KV pool keeps every position of a
sliding layer (a ring of ``sliding_window`` positions per sequence would do); see
:meth:`GptOssForCausalLM.attention_layers`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from edgemoe.config import ExpertActivation, ModelConfig, hf_dtype, require, rope_from_hf, token_ids
from edgemoe.core import ForwardBatch
from edgemoe.kvcache.pool import PagedKVPool
from edgemoe.layers.attention import FusedQKV, write_and_attend
from edgemoe.layers.decoder import DecoderStack, PreNormDecoderLayer
from edgemoe.layers.linear import Linear, UsesCpuDense, linear
from edgemoe.layers.moe import MoeBlock
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.layers.router import pad_routes
from edgemoe.models.base import FusedExpertLayout, MoECausalLM

LAYER_TYPES = ("sliding_attention", "full_attention")

# transformers' GptOssConfig default RoPE (the releases' rope_scaling): YaRN x32 over a 4096-token
# original context, theta 150000.
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}

# openai/gpt-oss-20b config.json: 24 layers, 32 experts (20.9 B parameters, 3.6 B active). The release's
# MXFP4 quantization_config is left out (``make-model --quant mxfp4`` adds it: dummy weights then MXFP4).
_GPT_OSS_20B = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True,
    "max_position_embeddings": 131072,
    "rope_parameters": {**_YARN, "rope_theta": 150000.0},
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "eos_token_id": 200002,  # <|return|>
    "pad_token_id": 199999,  # <|endoftext|>
}


_TINY = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # != hidden_size / num_attention_heads, as in the releases
    "num_local_experts": 16,
    "num_experts_per_tok": 4,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "attention_bias": True,
    "max_position_embeddings": 4096,
    "rope_parameters": {**_YARN, "factor": 8.0, "original_max_position_embeddings": 512,
                        "rope_theta": 150000.0},
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 1.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
}


class GptOssAttention(FusedQKV, nn.Module):
    """gpt-oss attention over the paged KV cache (``GptOssAttention``).

    ``forward(x [T, H], batch) -> [T, H]``: biased q/k/v projections, RoPE, attention with per-head sinks
    (``sinks [Hq]``) and, on a sliding layer, a window of ``cfg.sliding_window`` positions, then the
    biased ``o_proj``. Weight names match the checkpoint (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``sinks``); q/k/v may run as one GEMM (:class:`~edgemoe.layers.attention.FusedQKV`).
    """

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, H, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.window = cfg.sliding_window if cfg.is_sliding_attention(layer) else None
        self.attn_index = layer
        self.rotary = rotary  # shared, not a registered submodule's weights
        self.kv: PagedKVPool | None = None  # bound by the model runner

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.project_qkv(x)
        q = q.view(T, self.num_heads, D)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, D)  # [T, Hk, D]
        v = v.view(T, self.num_kv_heads, D)  # [T, Hk, D]
        q, k = self.rotary(q, k, batch.positions, batch.step_cache)
        o = write_and_attend(q, k, v, self.kv, self.attn_index, batch, D ** -0.5, self.sinks, self.window)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * D))


class GptOssTopKRouter(UsesCpuDense, nn.Module):
    """``forward(x [T, H], valid [T] bool | None) -> (topk_ids [T, k] int64, topk_weights [T, k] x.dtype)``:
    the top-k of the biased logits ``x·Wᵀ + b``, weighted by the softmax over those k logits, in their
    dtype (``GptOssTopKRouter``); rows where ``valid`` is False as :func:`~edgemoe.layers.router.pad_routes`
    says. ``weight [E, H]``, ``bias [E]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)
        self.top_k = cfg.top_k

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, self.bias, self.cpu_dense)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        return pad_routes(ids, torch.softmax(top, dim=1, dtype=top.dtype), valid)


class GptOssMLP(MoeBlock):
    """The MoE block of a gpt-oss layer: ``router`` + routed experts (``GptOssMLP``)."""

    def __init__(self, cfg: ModelConfig, moe_layer: int):
        super().__init__(moe_layer)
        self.router = GptOssTopKRouter(cfg)

    def route(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router(x, valid)


class GptOssForCausalLM(MoECausalLM):
    """gpt-oss causal LM (see :class:`~edgemoe.models.base.MoECausalLM`): every layer attention + MoE."""

    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    hf_classes = ("GptOssConfig", "GptOssForCausalLM")
    fused_experts = FusedExpertLayout(transposed=True, interleaved=True)
    synth_tokenizer = "gpt_oss"
    fixed_vocab_presets = frozenset({"gpt-oss-20b", "gpt-oss-120b"})
    # The tiny presets draw weights with std 0.2 (``initializer_range``), as Qwen3-MoE's: varied routing
    # and greedy continuations at this width. A window of 4 positions is shorter than the test prompts;
    # swiglu_limit 1.0 (the releases: 7.0) makes the clamps bite at this scale of activations.
    presets: ClassVar[dict[str, dict]] = {
        "tiny": _TINY,
        "tiny-tied": {**_TINY, "tie_word_embeddings": True},
        "gpt-oss-20b": _GPT_OSS_20B,
        # openai/gpt-oss-120b config.json: gpt-oss-20b's widths with 36 layers of 128 experts (116.8 B
        # parameters, 5.1 B active).
        "gpt-oss-120b": {**_GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                         "layer_types": ["sliding_attention", "full_attention"] * 18},
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        with torch.device("cpu"):
            rotary = RotaryEmbedding(cfg)
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, float32_scale=True)
        self.model = DecoderStack(cfg, (
            PreNormDecoderLayer(cfg, i, GptOssAttention(cfg, i, rotary), GptOssMLP(cfg, cfg.moe_ordinal(i)), norm)
            for i in range(cfg.num_layers)), norm())

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Normalize a ``gpt_oss`` config. The geometry (``hidden_size``, ``intermediate_size``,
        ``num_hidden_layers``, ``num_attention_heads``, ``num_local_experts``, ``vocab_size``) is required;
        other fields take transformers' ``GptOssConfig`` defaults: ``layer_types`` alternating sliding (even
        layers) and full attention, ``sliding_window`` 128, ``head_dim`` 64, 8 KV heads, top-4
        (``num_experts_per_tok``, or the releases' ``experts_per_token``), ``swiglu_alpha`` 1.702,
        ``swiglu_limit`` 7.0, attention biases, and YaRN x32 RoPE over theta 150000 when the config gives no
        ``rope_scaling`` / ``rope_parameters``.

        Raises:
            ValueError: a missing required field, a ``layer_types`` entry other than ``sliding_attention`` /
                ``full_attention`` or of the wrong length, sliding layers without a positive
                ``sliding_window``, or top-k outside ``[1, num_local_experts]`` (the message names ``where``
                and the field).
        """
        def need(key: str, *alts: str):
            return require(raw, key, *alts, where=where)

        def get(key: str, *alts: str, default: Any = None) -> Any:
            return next((raw[k] for k in (key, *alts) if raw.get(k) is not None), default)

        num_layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        num_experts = int(need("num_local_experts", "num_experts"))
        top_k = int(get("num_experts_per_tok", "experts_per_token", default=4))
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{where}: num_experts_per_tok {top_k} must be in [1, num_local_experts = {num_experts}]")
        layer_types = tuple(get("layer_types", default=[LAYER_TYPES[i % 2] for i in range(num_layers)]))
        if len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"{where}: layer_types must list {num_layers} entries of {' / '.join(LAYER_TYPES)}, "
                             f"got {list(layer_types)}")
        window = raw.get("sliding_window", 128)
        if "sliding_attention" in layer_types and not (isinstance(window, int) and window >= 1):
            raise ValueError(f"{where}: sliding_window {window!r} must be a positive integer (layer_types has "
                             "sliding_attention layers)")
        if raw.get("rope_parameters") or raw.get("rope_scaling"):
            rope = rope_from_hf(raw, default_theta=150000.0)
        else:
            rope = {**_YARN, "rope_theta": float(raw.get("rope_theta", 150000.0))}
        text = {**raw, "rope_parameters": rope}
        text.pop("rope_scaling", None)
        hidden = int(need("hidden_size"))
        archs = raw.get("architectures") or cls.architectures
        return ModelConfig(
            architecture=archs[0],
            model_type=raw.get("model_type") or cls.model_types[0],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", default=8)),
            head_dim=int(get("head_dim", default=64)),
            intermediate_size=0,
            moe_intermediate_size=int(need("intermediate_size")),
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=True,  # the softmax is taken over the k chosen logits
            moe_layers=tuple(range(num_layers)),
            rms_norm_eps=float(get("rms_norm_eps", default=1e-5)),
            rope_parameters=rope,
            max_position_embeddings=int(get("max_position_embeddings", default=131072)),
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            attention_bias=bool(get("attention_bias", default=True)),
            hidden_act="swiglu_oai",
            torch_dtype=hf_dtype(raw),
            eos_token_ids=token_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            layer_types=layer_types,
            qk_norm=False,
            sliding_window=int(window) if "sliding_attention" in layer_types else None,
            expert_activation=ExpertActivation("swiglu_oai", alpha=float(get("swiglu_alpha", default=1.702)),
                                               limit=float(get("swiglu_limit", default=7.0)), bias=True),
            raw=text,
        )

    def attention_layers(self) -> list[GptOssAttention]:
        """Every layer, sliding or full; a sliding layer keeps every position in the KV pool too, so the
        prefix cache and preemption treat all layers alike. A ring of ``sliding_window`` positions per
        sliding layer and sequence would cut the KV cache of a long context by about half (gpt-oss-120b at
        128k tokens: 18 of 36 layers x 2 x 8 heads x 64 x 2 bytes = 36 KiB of its 72 KiB per token in bf16,
        4.8 of 9.7 GB per sequence)."""
        return [layer.self_attn for layer in self.model.layers]
