"""What checkpoint generation knows about each architecture: its ``transformers`` classes and presets.

One :class:`SynthArch` per architecture. The ``transformers`` model class defines the checkpoint's
tensor names and shapes (its own init and ``save_pretrained`` write them, as for a real release);
the presets are the geometries edgemoe tests and benchmarks with; ``param_count`` states the same
tensor shapes as arithmetic, so sizes are known without building a model. Everything generic (random
init, sharding, tokenizer, ``generation_config.json``) is in :mod:`edgemoe.synth.writer` and
:mod:`edgemoe.synth.tokenizer`, which read an architecture only through :data:`ARCHS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers takes ~2 s to import; import it only where it is used
    import transformers

__all__ = ["ARCHS", "PRESETS", "SynthArch", "param_count"]


@dataclass(frozen=True)
class SynthArch:
    """Checkpoint generation's knowledge of one architecture.

    Attributes:
        model_type: the key of :data:`ARCHS` (``make-model --arch``), e.g. ``"qwen3_moe"``.
        config_class, model_class: names of the ``transformers`` classes whose init and
            ``save_pretrained`` write the checkpoint.
        presets: preset name -> ``config_class`` kwargs. ``vocab_size`` is nominal unless the preset is
            in ``fixed_vocab``: the writer sets it from the tokenizer.
        fixed_vocab: presets whose ``vocab_size`` is a floor set by a real tokenizer (kept even if the
            tokenizer is smaller).
        param_count: parameters of a ``config_class`` instance (embeddings, lm_head and every layer,
            routed experts included).
    """

    model_type: str
    config_class: str
    model_class: str
    presets: dict[str, dict]
    param_count: Callable[[transformers.PretrainedConfig], int]
    fixed_vocab: frozenset[str] = field(default_factory=frozenset)

    def classes(self) -> tuple[type, type]:
        """The ``transformers`` (config class, model class)."""
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)


def _param_count_qwen3_moe(config) -> int:
    """Parameter count of a Qwen3-MoE config (embeddings + lm_head + layers)."""
    h, v, n_layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 2 * hd
    dense = 3 * h * config.intermediate_size
    e = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    moe = e * 3 * h * config.moe_intermediate_size + e * h
    step = getattr(config, "decoder_sparse_step", 1) or 1
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    total = v * h * (1 if config.tie_word_embeddings else 2) + h
    for i in range(n_layers):
        sparse = e > 0 and i not in mlp_only and (i + 1) % step == 0
        total += attn + 2 * h + (moe if sparse else dense)
    return total


def _param_count_qwen3_5(config) -> int:
    """Parameter count of a Qwen3.5-MoE text config (embeddings + lm_head + hybrid layers)."""
    h, v = config.hidden_size, config.vocab_size
    kd = config.linear_num_key_heads * config.linear_key_head_dim
    vd = config.linear_num_value_heads * config.linear_value_head_dim
    hv = config.linear_num_value_heads
    conv = 2 * kd + vd
    linear = h * conv + h * vd + 2 * h * hv + conv * config.linear_conv_kernel_dim + 2 * hv \
        + config.linear_value_head_dim + vd * h
    hq, hk, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    full = h * hq * d * 2 + 2 * h * hk * d + hq * d * h + 2 * d
    e = config.num_experts
    moe = e * 3 * h * config.moe_intermediate_size + e * h + 3 * h * config.shared_expert_intermediate_size + h
    total = v * h * (1 if config.tie_word_embeddings else 2) + h
    for kind in config.layer_types:
        total += (linear if kind == "linear_attention" else full) + moe + 2 * h
    return total


# The hybrid layer pattern of Qwen3.5/3.6-MoE: three gated DeltaNet layers, then one full-attention layer.
_QWEN3_5_LAYER_TYPES_40 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10

# _INIT_NOTE: with HF's default std 0.02, tiny's router softmax is nearly flat (entropy 0.996 of
# log E, top-4 of 16 carry 30% of the mass) and greedy decoding falls into 2-token loops. std 0.2
# (tiny) / 0.1 (small) gives trained-like routing (top-k mass ~0.77, entropy ~0.67-0.72 of log E)
# and greedy continuations with ~15-25 distinct tokens in 48 (measured over 3 seeds x 3 prompts).

QWEN3_MOE = SynthArch(
    model_type="qwen3_moe",
    config_class="Qwen3MoeConfig",
    model_class="Qwen3MoeForCausalLM",
    param_count=_param_count_qwen3_moe,
    fixed_vocab=frozenset({"qwen3-30b-a3b"}),
    presets={
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
            "initializer_range": 0.2,  # see _INIT_NOTE
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
    },
)

QWEN3_5_MOE = SynthArch(
    model_type="qwen3_5_moe",
    config_class="Qwen3_5MoeTextConfig",
    model_class="Qwen3_5MoeForCausalLM",
    param_count=_param_count_qwen3_5,
    fixed_vocab=frozenset({"qwen3.6-35b-a3b"}),
    presets={
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
            "initializer_range": 0.2,  # see _INIT_NOTE
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
    },
)

ARCHS: dict[str, SynthArch] = {a.model_type: a for a in (QWEN3_MOE, QWEN3_5_MOE)}

# arch -> preset -> config kwargs (a view of ARCHS)
PRESETS: dict[str, dict[str, dict]] = {a.model_type: a.presets for a in ARCHS.values()}


def param_count(config: transformers.PretrainedConfig) -> int:
    """Parameters of a config of one of :data:`ARCHS` (dispatched on the config's class).

    Raises:
        ValueError: a config class no architecture of :data:`ARCHS` uses.
    """
    for arch in ARCHS.values():
        if type(config).__name__ == arch.config_class:
            return arch.param_count(config)
    raise ValueError(f"no architecture with config class {type(config).__name__}; known: "
                     f"{sorted(a.config_class for a in ARCHS.values())}")
