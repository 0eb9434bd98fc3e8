"""Normalized model configuration and engine options.

The Hugging Face ``config.json`` is read exactly once, by :meth:`ModelConfig.from_hf`; model code
never reads raw HF attribute names (DESIGN.md §7).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map ``"bfloat16" | "bf16" | "float32" | "fp32" | "float16"`` (or a ``torch.dtype``) to a dtype.

    Raises:
        ValueError: the name is not one of the supported dtypes.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(set(_DTYPES))}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture geometry of a MoE decoder, normalized from a Hugging Face ``config.json``.

    Sizes are element counts. ``moe_layers`` lists the decoder layers whose MLP is a routed-expert
    block; the others use a dense MLP of ``intermediate_size``. Routed experts of MoE layer ordinal
    ``j`` (the j-th entry of ``moe_layers``) have the flat id ``j * num_experts + e`` everywhere in
    the expert pool and cache.

    Hybrid models (``qwen3_5_moe``): ``layer_types[i]`` is ``"full_attention"`` (paged KV) or
    ``"linear_attention"`` (a gated DeltaNet layer with ``linear_num_key_heads`` q/k heads of
    ``linear_key_head_dim``, ``linear_num_value_heads`` v heads of ``linear_value_head_dim`` and a
    causal conv1d of ``linear_conv_kernel`` taps); full attention rotates the first
    ``partial_rotary_factor * head_dim`` dims and, with ``attn_output_gate``, gates its output by a
    sigmoid of a second ``q_proj`` half; each MoE block adds a shared expert of
    ``shared_expert_intermediate_size`` (0: none). For ``qwen3_moe`` every layer is full attention.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    shared_expert_intermediate_size: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def is_linear_attention(self, layer: int) -> bool:
        """Whether decoder ``layer`` is a linear-attention (gated DeltaNet) layer rather than full attention."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def moe_ordinal(self, layer: int) -> int:
        """Index of decoder ``layer`` among the MoE layers (raises ``ValueError`` for a dense layer)."""
        return self.moe_layers.index(layer)

    @property
    def expert_bytes_per_element(self) -> int:
        return torch.empty((), dtype=parse_dtype(self.torch_dtype)).element_size()

    def expert_numel(self) -> int:
        """Elements of one routed expert: gate+up ``[2I, H]`` and down ``[H, I]``."""
        return 3 * self.moe_intermediate_size * self.hidden_size

    def hf_config(self):
        """The ``transformers`` config object for this model (for the reference implementation)."""
        from transformers import AutoConfig

        raw = dict(self.raw)
        return AutoConfig.for_model(raw.pop("model_type"), **raw)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any] | str | Path) -> "ModelConfig":
        """Normalize a Hugging Face config (a dict, a ``config.json`` path or a checkpoint directory).

        Accepts both the transformers-4 spelling (``num_experts``, ``rope_theta``/``rope_scaling``) and
        the transformers-5 one (``num_local_experts``, ``rope_parameters``).

        Raises:
            FileNotFoundError: no ``config.json`` at the path.
            ValueError: an architecture edgemoe does not serve, or a missing required field.
        """
        if not isinstance(cfg, dict):
            p = Path(cfg)
            if p.is_dir():
                p = p / "config.json"
            if not p.exists():
                raise FileNotFoundError(f"{p}: no config.json")
            cfg = json.loads(p.read_text())
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = archs[0] if archs else ""
        if model_type in QWEN3_5_MOE_TYPES or arch in QWEN3_5_MOE_ARCHS:
            return cls._from_qwen3_5_moe(cfg, arch, model_type)
        if model_type != "qwen3_moe" and arch != "Qwen3MoeForCausalLM":
            raise ValueError(
                f"unsupported architecture {arch or '?'} (model_type {model_type or '?'}); edgemoe serves: "
                "Qwen3MoeForCausalLM (qwen3_moe), Qwen3_5MoeForCausalLM / Qwen3_5MoeForConditionalGeneration "
                "(qwen3_5_moe, text only)"
            )

        def need(key: str, *alts: str):
            for k in (key, *alts):
                if k in cfg and cfg[k] is not None:
                    return cfg[k]
            raise ValueError(f"config.json: missing required field {key!r}")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        num_layers = int(need("num_hidden_layers"))
        num_experts = int(need("num_experts", "num_local_experts"))
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(
            i for i in range(num_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
        )
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling")
        if scaling:
            rope.update(scaling)
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_theta", float(cfg.get("rope_theta", 10000.0)))
        rope.setdefault("rope_type", "default")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch or "Qwen3MoeForCausalLM",
            model_type=model_type or "qwen3_moe",
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_experts=num_experts,
            top_k=int(need("num_experts_per_tok")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            moe_layers=moe_layers,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            raw=dict(cfg),
        )

    @classmethod
    def _from_qwen3_5_moe(cls, cfg: dict[str, Any], arch: str, model_type: str) -> "ModelConfig":
        """Normalize a ``qwen3_5_moe`` config: a ``Qwen3_5MoeForCausalLM`` text config, or the
        ``Qwen3_5MoeForConditionalGeneration`` config whose language model sits in ``text_config``
        (served text only). Defaults are those of transformers' ``Qwen3_5MoeTextConfig``.

        Raises:
            ValueError: a missing required field, or ``layer_types`` of the wrong length or with an
                unknown entry.
        """
        nested = isinstance(cfg.get("text_config"), dict)
        text = dict(cfg["text_config"]) if nested else dict(cfg)
        text.setdefault("model_type", "qwen3_5_moe_text")

        def need(key: str):
            if text.get(key) is None:
                where = "config.json text_config" if nested else "config.json"
                raise ValueError(f"{where}: missing required field {key!r}")
            return text[key]

        hidden = int(need("hidden_size"))
        heads = int(text.get("num_attention_heads", 16))
        num_layers = int(need("num_hidden_layers"))
        types = text.get("layer_types")
        if types is None:  # the reference's rule: every ``full_attention_interval``-th layer is full attention
            every = int(text.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(num_layers)]
        if len(types) != num_layers or not set(types) <= {"full_attention", "linear_attention"}:
            raise ValueError(f"config.json: layer_types must list {num_layers} entries of 'full_attention' / "
                             f"'linear_attention', got {types}")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type") == "mrope":  # text only: the three position streams coincide
            rope["rope_type"] = "default"
        rope.setdefault("rope_theta", float(text.get("rope_theta", 10000.0)))
        rope.setdefault("rope_type", "default")
        partial = float(rope.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 0.25)
        rope["partial_rotary_factor"] = partial
        text["rope_parameters"] = rope
        eos = text.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        tie = cfg.get("tie_word_embeddings", False) if nested else text.get("tie_word_embeddings", False)
        return cls(
            architecture=arch or "Qwen3_5MoeForCausalLM",
            model_type=model_type or "qwen3_5_moe_text",
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
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
            tie_word_embeddings=bool(tie),
            attention_bias=bool(text.get("attention_bias", False)),
            hidden_act=str(text.get("hidden_act", "silu")),
            torch_dtype=str(text.get("dtype") or cfg.get("dtype") or text.get("torch_dtype")
                            or cfg.get("torch_dtype") or "bfloat16"),
            eos_token_ids=eos_ids,
            bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")),
            pad_token_id=text.get("pad_token_id", cfg.get("pad_token_id")),
            layer_types=tuple(types),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            partial_rotary_factor=partial,
            attn_output_gate=bool(text.get("attn_output_gate", True)),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 512)),
            raw=text,
        )


# HF names of the hybrid gated-DeltaNet MoE (``Qwen3_5MoeForCausalLM`` saves ``qwen3_5_moe_text``).
QWEN3_5_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
QWEN3_5_MOE_ARCHS = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")

EXPERT_POLICIES = ("qstar", "adaptive", "fill-all", "cpu-all", "static")
CPU_EXECUTORS = ("auto", "native", "torch")


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance (CLI flags map 1:1 onto these fields).

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` (``"auto"`` picks CUDA when present).
        dtype: compute/storage dtype of weights (``"auto"`` = the checkpoint's).
        expert_cache_slots: (layer, expert) slots in the device expert cache; ``None`` derives it
            from ``expert_cache_gb`` (or, on CUDA, from free memory; on CPU it defaults to 0).
        expert_cache_gb: expert-cache budget in GB (1e9 bytes).
        expert_policy: how decode-step misses are served: ``qstar`` (DESIGN.md §2), ``adaptive`` (q*
            corrected online by measured step times), ``fill-all``, ``cpu-all`` or ``static``.
        cpu_threads: threads of the CPU expert executor (``None``: one per physical core for the
            native executor, torch's default for the torch one). When set, torch's intra-op threads
            follow it too.
        cpu_executor: CPU expert executor: ``"auto"`` (the native C++ kernels where they build and
            support the weight dtype, else torch ops, with a one-line warning), ``"native"`` (the
            same), or ``"torch"`` (torch ops). See ``edgemoe/experts/native.py``.
        bandwidth_pcie_gbps / bandwidth_cpu_gbps: B_P and B_H overrides in GB/s; otherwise read from
            ``profile_path`` or measured quickly at start-up.
        max_num_seqs: requests decoded together (continuous batching).
        max_model_len: longest sequence (prompt + output) in tokens; ``None`` = the model's maximum.
        kv_cache_tokens: KV cache capacity in tokens (all sequences together); ``None`` = derived.
        page_size: tokens per KV page.
        enable_prefix_caching: share full KV pages between requests through a radix tree, so a
            request whose prompt starts with a cached prefix prefills only the rest (DESIGN.md §4).
        load_format: ``"auto"`` (safetensors) or ``"dummy"`` (random values from config.json).
        seed: seed for dummy weights.
        verify_weights: check FTW bank checksums while loading (``None`` = the default: on, unless
            ``EDGEMOE_FTW_VERIFY=0``).
        enforce_eager: never capture CUDA graphs (decode still takes the device path on CUDA).
        state_checkpoints: recurrent-state checkpoint slots of a hybrid model (DESIGN.md §4; LRU,
            independent of KV pages); 0 = none, so a hybrid model reuses no cached prefix. Needs
            prefix caching. Each slot holds one sequence's full state (~64 MB for Qwen3.6-35B-A3B).
        state_checkpoint_interval: also checkpoint every this many tokens (0 = only at anchors), so
            an edit that cuts mid-block still reuses most of its prefix.
        anchor_checkpoints: checkpoint after each anchor token (``</think>``, ``</tool_call>``,
            ``</tool_response>``, ``<|im_end|>`` and the EOS tokens, as the tokenizer has them).
    """

    device: str = "auto"
    dtype: str = "auto"
    expert_cache_slots: int | None = None
    expert_cache_gb: float | None = None
    expert_policy: str = "qstar"
    cpu_threads: int | None = None
    cpu_executor: str = "auto"
    bandwidth_pcie_gbps: float | None = None
    bandwidth_cpu_gbps: float | None = None
    profile_path: str | None = None
    max_num_seqs: int = 8
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    page_size: int = 16
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    verify_weights: bool | None = None
    enforce_eager: bool = False
    state_checkpoints: int = 32
    state_checkpoint_interval: int = 2048
    anchor_checkpoints: bool = True

    def __post_init__(self):
        if self.expert_policy not in EXPERT_POLICIES:
            raise ValueError(f"expert_policy {self.expert_policy!r}: choose one of {EXPERT_POLICIES}")
        if self.cpu_executor not in CPU_EXECUTORS:
            raise ValueError(f"cpu_executor {self.cpu_executor!r}: choose one of {CPU_EXECUTORS}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format {self.load_format!r}: choose 'auto' or 'dummy'")
        if self.expert_cache_slots is not None and self.expert_cache_slots < 0:
            raise ValueError("expert_cache_slots must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.state_checkpoints < 0 or self.state_checkpoint_interval < 0:
            raise ValueError("state_checkpoints and state_checkpoint_interval must be >= 0")

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineConfig":
        """Build from keyword options, rejecting unknown names with the list of valid ones."""
        names = {f.name for f in fields(cls)}
        bad = sorted(set(kw) - names)
        if bad:
            raise TypeError(f"unknown engine option(s) {bad}; valid: {sorted(names)}")
        return cls(**{k: v for k, v in kw.items() if v is not None or k in ("expert_cache_slots",)})

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda requested but CUDA is not available on this machine")
        return dev
