"""Normalized model configuration and engine options (frozen dataclasses).

A Hugging Face ``config.json`` is normalized once, by its architecture's ``config_from_hf`` in
``edgemoe.models`` (helpers for that live here); model code never reads raw HF attribute names.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from edgemoe.weights.dtypes import parse_dtype  # re-exported: config options name dtypes


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Geometry of the gated DeltaNet (linear-attention) layers of a hybrid model (``qwen3_5_moe``).

    ``num_key_heads`` q/k heads of ``key_head_dim``, ``num_value_heads`` v heads of
    ``value_head_dim``, and a causal depthwise conv1d of ``conv_kernel`` taps over the q/k/v
    projections.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int


EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(frozen=True)
class ExpertActivation:
    """The math of one routed expert beyond its three projections: its gated activation and biases.

    ``kind``:

    - ``"silu"``: ``down(silu(gate(x)) * up(x))`` (SwiGLU, Shazeer 2020; Qwen3-MoE, GLM-4.5,
      DeepSeek-V3);
    - ``"swiglu_oai"``: gpt-oss's clamped SwiGLU, ``g = min(gate, limit)``, ``u = clamp(up, -limit,
      limit)``, ``down((u + 1) * g * sigmoid(alpha * g))`` (transformers' ``GptOssExperts._apply_gate``).

    ``bias``: every projection adds a bias (``gate_up_proj_bias`` / ``down_proj_bias`` in gpt-oss),
    after its matrix product. ``alpha`` and ``limit`` are read only for ``swiglu_oai``.
    """

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False

    def __post_init__(self):
        if self.kind not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {self.kind!r}: choose one of {', '.join(EXPERT_ACTIVATIONS)}")

    def describe(self) -> str:
        """One phrase for logs and reasons, e.g. ``swiglu_oai (alpha 1.702, limit 7) with biases``."""
        what = self.kind if self.kind == "silu" else f"{self.kind} (alpha {self.alpha:g}, limit {self.limit:g})"
        return what + (" with biases" if self.bias else "")


SILU_SWIGLU = ExpertActivation()
"""Plain SwiGLU experts (the default)."""


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Geometry of multi-head latent attention (MLA: DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3).

    Queries come from the hidden state directly (``q_lora_rank is None``) or through a rank-``q_lora_rank``
    bottleneck with an RMSNorm. Keys and values are compressed into one latent per token: a
    ``kv_lora_rank``-wide vector ``c`` (RMS-normalized) plus a ``qk_rope_head_dim``-wide rotary key
    ``k_pe`` shared by all heads; the KV cache stores exactly these ``kv_lora_rank +
    qk_rope_head_dim`` values per token and layer. Per head, ``kv_b_proj`` up-projects ``c`` into a
    ``qk_nope_head_dim`` key part and a ``v_head_dim`` value.

    ``rope_interleave``: the rotary dims are rotated as interleaved pairs (transformers'
    ``apply_rotary_pos_emb_interleave``), else as halves. ``softmax_scale`` is
    ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for
    a scaled rope type with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def latent_dim(self) -> int:
        """Values the KV cache keeps per token and layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupLimitedRoutingConfig:
    """Sigmoid routing with a score-correction bias and group-limited top-k (DeepSeek-V3's ``noaux_tc``
    routing, also GLM-4.5's; read by :class:`~edgemoe.layers.router.GroupLimitedSigmoidRouter`).

    The ``E`` routed experts form ``n_group`` groups of ``E / n_group``; a token picks its top-k experts
    among the ``topk_group`` groups whose two best bias-corrected scores sum highest. The experts'
    weights are their uncorrected sigmoid scores (renormalized when ``ModelConfig.norm_topk_prob``)
    times ``routed_scaling_factor``.
    """

    n_group: int
    topk_group: int
    routed_scaling_factor: float

    def check(self, num_experts: int, top_k: int, where: str = "config.json") -> None:
        """Raise ``ValueError`` (naming ``where`` and the fields) unless ``num_experts`` experts split into
        ``n_group`` groups of at least two, ``1 <= topk_group <= n_group``, and the kept groups hold at
        least ``top_k`` experts."""
        g = self.n_group
        if g < 1 or num_experts % g or num_experts // g < 2:
            raise ValueError(f"{where}: n_group {g} must divide n_routed_experts {num_experts} into groups of >= 2")
        if not 1 <= self.topk_group <= g:
            raise ValueError(f"{where}: topk_group {self.topk_group} must be in [1, n_group = {g}]")
        if self.topk_group * (num_experts // g) < top_k:
            raise ValueError(f"{where}: topk_group {self.topk_group} groups of {num_experts // g} experts hold fewer "
                             f"than num_experts_per_tok {top_k}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture geometry of a MoE decoder, normalized from a Hugging Face ``config.json``.

    Each architecture's file in ``edgemoe.models`` builds it (``config_from_hf``); ``edgemoe.models.load_config``
    picks the file from ``architectures[0]``. Nothing else reads raw ``config.json`` names.

    Sizes are element counts. ``moe_layers`` lists the decoder layers whose MLP is a routed-expert
    block; the others use a dense MLP of ``intermediate_size``. Routed experts of MoE layer ordinal
    ``j`` (the j-th entry of ``moe_layers``) have the flat id ``j * num_experts + e`` everywhere in
    the expert pool and cache.

    ``layer_types[i]`` names decoder layer ``i``'s token mixer (``"full_attention"``,
    ``"sliding_attention"`` for attention over the last ``sliding_window`` positions (the query's
    own included), or ``"linear_attention"`` for a gated DeltaNet layer described by
    ``linear_attention``); empty means every layer is full attention. Full attention rotates the
    first ``partial_rotary_factor * head_dim`` dims and, with ``attn_output_gate``, gates its output by a
    sigmoid of a second ``q_proj`` half. ``shared_expert_intermediate_size`` > 0 adds a shared expert to
    every MoE block.
    ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3 always; optional for GLM-4.5).
    ``group_routing`` replaces the softmax top-k router by sigmoid, bias-corrected, group-limited
    routing. ``num_mtp_layers`` multi-token-prediction layers follow the decoder in the checkpoint
    (decoder layer indices ``num_layers, num_layers + 1, ...``); they are not served.
    ``expert_activation``: the routed experts' activation and biases (:class:`ExpertActivation`).
    ``raw`` is the architecture's HF config dict (the text config of a multimodal checkpoint), kept
    for ``hf_config`` (transformers' RoPE initializers and the reference implementation in tests).
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
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    shared_expert_intermediate_size: int = 0
    linear_attention: LinearAttentionConfig | None = None
    qk_norm: bool = True
    latent_attention: LatentAttentionConfig | None = None
    group_routing: GroupLimitedRoutingConfig | None = None
    num_mtp_layers: int = 0
    sliding_window: int | None = None
    expert_activation: ExpertActivation = SILU_SWIGLU
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

    def context_length(self) -> int:
        """The longest sequence (prompt + output tokens) the checkpoint's positions are meant for:
        ``max_position_embeddings``, extended by a RoPE scaling that states a ``factor`` (``linear``,
        ``dynamic``; ``yarn`` scales ``original_max_position_embeddings`` when it is given), as vLLM
        derives its default ``max_model_len``; ``llama3`` and ``longrope`` configs already state the
        extended length in ``max_position_embeddings``."""
        rope = self.rope_parameters
        kind, factor = rope.get("rope_type", "default"), rope.get("factor")
        if kind in ("default", "llama3", "longrope", "su") or not factor:
            return self.max_position_embeddings
        base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
        return int((base or self.max_position_embeddings) * float(factor))

    def expert_numel(self) -> int:
        """Elements of one routed expert: gate+up ``[2I, H]`` and down ``[H, I]``, plus their biases
        ``[2I]`` and ``[H]`` when ``expert_activation.bias``."""
        I, H = self.moe_intermediate_size, self.hidden_size
        return 3 * I * H + (2 * I + H if self.expert_activation.bias else 0)

    def is_sliding_attention(self, layer: int) -> bool:
        """Whether decoder ``layer`` attends over a sliding window of ``sliding_window`` keys."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def hf_config(self):
        """The ``transformers`` config object for this model (for the reference implementation)."""
        from transformers import AutoConfig

        raw = dict(self.raw)
        return AutoConfig.for_model(raw.pop("model_type"), **raw)


# ---------------------------------------------------------------- helpers for config_from_hf


def read_hf_config(source: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
    """The raw HF config and where it came from (for error messages).

    Args:
        source: a config dict, a ``config.json`` path or a checkpoint directory.

    Raises:
        FileNotFoundError: no ``config.json`` at the path.
        ValueError: the file is not a JSON object (the message names the file).
    """
    if isinstance(source, dict):
        return source, "config.json"
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no config.json")
    try:
        raw = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: not a JSON object")
    return raw, str(p)


def require(cfg: dict[str, Any], key: str, *alts: str, where: str = "config.json"):
    """``cfg[key]`` (or the first present alternative spelling), raising ``ValueError`` naming ``where``."""
    for k in (key, *alts):
        if cfg.get(k) is not None:
            return cfg[k]
    raise ValueError(f"{where}: missing required field {key!r}")


# The type of each config.json field the families read, checked before any family converts one (a string
# where a size belongs would otherwise fail deep inside as "invalid literal for int()", naming neither
# the file nor the field). ``None`` is always allowed: families treat it as absent.
_POSITIVE_INT_FIELDS = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_key_value_heads", "head_dim",
    "moe_intermediate_size", "num_experts_per_tok", "max_position_embeddings", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank", "n_group", "topk_group",
    "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "decoder_sparse_step",
)
_COUNT_FIELDS = (  # integers >= 0
    "intermediate_size", "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts",
    "first_k_dense_replace", "moe_layer_freq", "shared_expert_intermediate_size",
    "num_nextn_predict_layers", "num_mtp_layers",
)
_POSITIVE_NUMBER_FIELDS = ("rope_theta", "rms_norm_eps", "routed_scaling_factor", "partial_rotary_factor")
_BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "attention_bias", "attn_output_gate", "rope_interleave")
_OBJECT_FIELDS = ("rope_scaling", "rope_parameters", "text_config")
_ROPE_NUMBER_FIELDS = ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "attention_factor", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor",
                       "partial_rotary_factor")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_config_fields(raw: dict[str, Any], where: str = "config.json", prefix: str = "") -> None:
    """Check the types of the fields of an HF config that the model families read (sizes, counts,
    numbers, switches, sub-objects, token ids, name lists), and of its ``text_config``.

    Raises:
        ValueError: one line naming ``where`` and the field, e.g. ``config.json: num_hidden_layers must
            be a positive integer, got 'two'``.
    """
    def bad(key: str, what: str) -> ValueError:
        return ValueError(f"{where}: {prefix}{key} must be {what}, got {raw[key]!r}")

    for key, value in raw.items():
        if value is None:
            continue
        if key in _POSITIVE_INT_FIELDS and not (_is_int(value) and value > 0):
            raise bad(key, "a positive integer")
        if key in _COUNT_FIELDS and not (_is_int(value) and value >= 0):
            raise bad(key, "an integer >= 0")
        if key in _POSITIVE_NUMBER_FIELDS and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                    and value > 0):
            raise bad(key, "a positive number")
        if key in _BOOL_FIELDS and not isinstance(value, bool):
            raise bad(key, "true or false")
        if key in _OBJECT_FIELDS and not isinstance(value, dict):
            raise bad(key, "an object")
        if key in ("rope_scaling", "rope_parameters"):
            for k, v in value.items():
                if k in _ROPE_NUMBER_FIELDS and v is not None and (not isinstance(v, (int, float))
                                                                   or isinstance(v, bool)):
                    raise ValueError(f"{where}: {prefix}{key}.{k} must be a number, got {v!r}")
        if key == "eos_token_id" and not (_is_int(value) or (isinstance(value, list) and all(map(_is_int, value)))):
            raise bad(key, "a token id or a list of them")
        if key in ("bos_token_id", "pad_token_id") and not _is_int(value):
            raise bad(key, "a token id")
        if key in ("architectures", "layer_types") and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise bad(key, "a list of names")
        if key == "mlp_only_layers" and not (isinstance(value, list) and all(map(_is_int, value))):
            raise bad(key, "a list of layer indices")
    if isinstance(raw.get("text_config"), dict) and not prefix:
        check_config_fields(raw["text_config"], where, "text_config.")


def rope_from_hf(cfg: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """RoPE parameters in the transformers-5 form (``rope_parameters`` with ``rope_type`` and
    ``rope_theta``) from either spelling (transformers 4: ``rope_theta`` + ``rope_scaling`` with
    ``type``; a ``rope_scaling`` entry added to a transformers-5 config overrides its type)."""
    rope = {}
    for part in (cfg.get("rope_parameters"), cfg.get("rope_scaling")):
        part = dict(part or {})
        if "type" in part and "rope_type" not in part:
            part["rope_type"] = part.pop("type")
        rope.update(part)
    rope.setdefault("rope_theta", float(cfg.get("rope_theta", default_theta)))
    rope.setdefault("rope_type", "default")
    return rope


def token_ids(value) -> tuple[int, ...]:
    """An HF token-id field (an int, a list or ``None``) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def hf_dtype(*cfgs: dict[str, Any]) -> str:
    """The checkpoint dtype name (``dtype``, or transformers-4 ``torch_dtype``) of the first config
    that has one; ``"bfloat16"`` when none does."""
    for key in ("dtype", "torch_dtype"):
        for c in cfgs:
            if c.get(key):
                return str(c[key])
    return "bfloat16"


EXPERT_POLICIES = ("auto", "qstar", "adaptive", "fill-all", "cpu-all", "static")
EXPERT_EVICTIONS = ("layer-lru", "global-lru")
EXPERT_PREFETCH = ("off", "next-layer")
CPU_EXECUTORS = ("auto", "native", "torch")
DOORBELL_WAITS = ("auto", "kernel", "stream-op")
JOIN_LATENESS = ("yes-no", "graded")  # how a hand-off's join is counted for the auto policy's balance controller
LOAD_FORMATS = ("auto", "dummy")
TOKEN_EMBEDDINGS = ("device", "host")
DEFAULT_PREFILL_CHUNK_TOKENS = 8192


def option(default, help: str, **cli) -> Any:  # ``help`` as in argparse
    """A dataclass field with the metadata the CLI generates its flag from.

    ``cli`` may give ``flag`` (default ``--`` + the field name with dashes; a boolean given a
    ``--no-...`` flag is switched off by it, its help naming what it turns off), ``choices``, ``metavar``, ``type`` (for
    ``None`` defaults whose type cannot be read from the annotation) and ``cli=False`` (no flag).
    """
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance; ``edgemoe serve/generate/profile`` generate one flag per field
    (see :func:`option`), so the command line and this class cannot drift apart.

    Validation happens here (``ValueError`` naming the option), before anything is loaded.
    """

    device: str = option("auto", "compute device: cpu, cuda, cuda:N or auto (CUDA when present)")
    dtype: str = option("auto", "weight/compute dtype: auto (the checkpoint's), bfloat16, float16, float32")
    expert_cache_slots: int | None = option(
        None, "(layer, expert) slots in the device expert cache (default: from --expert-cache-gb, else on CUDA "
        "free memory minus 2 GiB, on CPU 0)", type=int)
    expert_cache_gb: float | None = option(None, "expert-cache budget in GB (1e9 bytes)", type=float)
    gpu_budget: str = option(
        "auto", "GPU memory for the expert cache and the KV cache together: auto (follow the device's free memory, "
        "NVML's view of every process, keeping --gpu-headroom-gb free; the default) or a fixed size in GB; "
        "CUDA only", metavar="auto|GB")
    gpu_headroom_gb: float = option(2.0, "device memory (GB) auto mode keeps free for other processes and "
                                    "activations: the expert cache shrinks when free memory drops below it")
    min_expert_cache_slots: int | None = option(
        None, "floor of expert-cache slots the KV cache may take memory from when it runs short (default: half "
        "the start-up slots)", type=int)
    expert_policy: str = option(
        "auto", "how decode-step expert misses are served: auto (the default: per-layer cost model from the "
        "bandwidths, the fixed cost of a copy and of a CPU call and the measured reuse of a fill, balanced by "
        "which branch finishes last; drops the CPU branch where it would save less than it costs), qstar (fill "
        "q* = m*B_P/B_H of m misses, the rest on the CPU), adaptive (q* corrected by measured step times), "
        "fill-all, cpu-all, static (whole layers placed at load)", choices=EXPERT_POLICIES)
    expert_eviction: str = option(
        "layer-lru", "which cached expert a decode fill replaces: layer-lru (the least recently used of the "
        "layer's equal share of the slots, when every share holds a token's top-k, else global; fewest misses on "
        "recorded routing) or global-lru (the least recently used of all slots)", choices=EXPERT_EVICTIONS)
    prefetch: str = option(
        "off", "expert prefetch in decode: next-layer (after a MoE layer, apply the next MoE layer's router to its "
        "hidden state and fill the predicted experts that are not resident; placement only, outputs unchanged)",
        choices=EXPERT_PREFETCH)
    cpu_threads: int | None = option(
        None, "threads of the CPU expert executor (default: one per physical core for the native executor)",
        type=int)
    cpu_executor: str = option("auto", "CPU expert executor: auto (native C++ kernels where they build), "
                               "native, torch (torch ops)", choices=CPU_EXECUTORS)
    keep_freed_host_memory: bool = option(
        True, "on a CPU device, glibc malloc keeps freed memory for reuse instead of returning it to the kernel "
        "(a CPU prefill's large temporaries then cost no page faults; the process keeps its peak heap)",
        flag="--no-keep-freed-host-memory")
    doorbell_wait: str = option(
        "auto", "how the device decode step waits for its CPU experts (CUDA): kernel (a one-program kernel polling "
        "pinned memory, holding an SM while it waits), stream-op (cuStreamWaitValue32 stream memory operations, "
        "waiting in the GPU's front end without an SM; CUDA driver 11.7 or later) or auto (kernel)",
        choices=DOORBELL_WAITS)
    join_lateness: str = option(
        "yes-no", "how the device decode step counts a CPU hand-off's join for the auto policy's balance controller "
        "(CUDA, kernel doorbell wait, native executor): yes-no (whether the GPU found the CPU branch still running) "
        "or graded (whether either side finished first by more than one expert's time; better in the step-time "
        "simulator, no better on an H100 host: opt-in)", choices=JOIN_LATENESS)
    bandwidth_pcie_gbps: float | None = option(None, "B_P override in GB/s (host->device expert copies)",
                                               type=float)
    bandwidth_cpu_gbps: float | None = option(None, "B_H override in GB/s (CPU expert execution)", type=float)
    profile_path: str | None = option(None, "bandwidth profile JSON written by `edgemoe profile`",
                                      flag="--profile", type=str, metavar="FILE")
    max_num_seqs: int = option(8, "requests decoded together (continuous batching)")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's, at most "
                                       "32768)", type=int)
    kv_cache_tokens: int | None = option(None, "KV cache capacity in tokens, all requests together (default: "
                                         "max_model_len)", type=int)
    page_size: int = option(16, "tokens per KV page")
    prefill_chunk_tokens: int = option(DEFAULT_PREFILL_CHUNK_TOKENS, "most prompt tokens computed in one "
                                       "prefill step (chunked prefill)")
    enable_prefix_caching: bool = option(True, "the prefix cache: a request reuses the cached KV pages of a common "
                                         "prompt prefix (on by default)", flag="--no-prefix-caching")
    load_format: str = option("auto", "auto (safetensors or FTW), dummy (random weights of config.json's "
                              "geometry, no weight files)", choices=LOAD_FORMATS)
    token_embedding: str = option(
        "device", "where the token-embedding table lives: device (the default) or host (page-locked host memory: "
        "each step's rows are gathered onto the GPU by one kernel reading the table over PCIe, which frees its "
        "V x H bytes of GPU memory for the expert cache; CUDA only, and only for models whose LM head is not "
        "tied to the embedding)", choices=TOKEN_EMBEDDINGS)
    trust_remote_code: bool = option(
        False, "run the Python code a checkpoint ships for its tokenizer (auto_map in tokenizer_config.json, e.g. "
        "Kimi-K2's tiktoken tokenizer); without it such a checkpoint is refused")
    seed: int = option(0, "seed of dummy weights")
    verify_weights: bool | None = option(None, "the FTW bank checksums while loading (on unless "
                                         "EDGEMOE_FTW_VERIFY=0)", flag="--no-verify-weights")
    enforce_eager: bool = option(False, "never capture CUDA graphs for decode (decode still takes the device path)")
    warmup: bool = option(True, "the start-up warm-up on a GPU: a short prefill and two decode steps of a throwaway "
                          "sequence compile the GPU kernels before the first request, then the expert cache, its "
                          "policy and every count start over cold (on by default)", flag="--no-warmup")
    state_checkpoints: int = option(32, "recurrent-state checkpoint slots of hybrid models (LRU; 0 = none)")
    state_checkpoint_interval: int = option(2048, "also checkpoint the recurrent state every N tokens "
                                            "(0 = only at anchor tokens)")
    anchor_checkpoints: bool = option(True, "recurrent-state checkpoints after </think>, </tool_call>, "
                                      "</tool_response>, <|im_end|> and EOS (on by default)",
                                      flag="--no-anchor-checkpoints")

    def __post_init__(self):
        for name, choices in (("expert_policy", EXPERT_POLICIES), ("expert_eviction", EXPERT_EVICTIONS),
                              ("prefetch", EXPERT_PREFETCH), ("cpu_executor", CPU_EXECUTORS),
                              ("doorbell_wait", DOORBELL_WAITS), ("join_lateness", JOIN_LATENESS),
                              ("load_format", LOAD_FORMATS),
                              ("token_embedding", TOKEN_EMBEDDINGS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} {getattr(self, name)!r}: choose one of {', '.join(choices)}")
        for name in ("expert_cache_slots", "min_expert_cache_slots", "state_checkpoints",
                     "state_checkpoint_interval"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        for name in ("max_num_seqs", "page_size", "prefill_chunk_tokens", "max_model_len", "kv_cache_tokens",
                     "cpu_threads"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        logical = os.cpu_count() or 1
        if self.cpu_threads is not None and self.cpu_threads > logical:  # torch started them all: the process died
            raise ValueError(f"cpu_threads {self.cpu_threads}: more than the {logical} logical CPUs of this machine")
        if self.expert_cache_slots is not None and self.expert_cache_gb is not None:  # slots won, gb went unread
            raise ValueError("expert_cache_slots and expert_cache_gb both given: size the expert cache by one")
        v = self.expert_cache_gb
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"expert_cache_gb must be a finite number >= 0, got {v}")
        self.gpu_budget_bytes  # noqa: B018 - validates the value
        v = self.gpu_headroom_gb
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"gpu_headroom_gb must be a finite number >= 0, got {v}")
        for name in ("bandwidth_pcie_gbps", "bandwidth_cpu_gbps"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number of GB/s > 0, got {v}")
        if self.profile_path is not None and None not in (self.bandwidth_pcie_gbps, self.bandwidth_cpu_gbps):
            raise ValueError(f"profile {self.profile_path!r} with bandwidth_pcie_gbps and bandwidth_cpu_gbps: the two "
                             "overrides leave nothing of the profile to read; give the profile or the bandwidths")
        if self.profile_path is not None and not Path(self.profile_path).is_file():
            raise ValueError(f"profile {self.profile_path!r}: no such file (write one with `edgemoe profile MODEL_DIR "
                             f"--out {self.profile_path}`)")
        if self.dtype != "auto":
            parse_dtype(self.dtype)

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineConfig":
        """Build from keyword options; ``None`` values keep the field's default.

        Raises:
            TypeError: an unknown option name (the message lists the valid ones).
            ValueError: a value the options reject.
        """
        names = {f.name for f in fields(cls)}
        bad = sorted(set(kw) - names)
        if bad:
            raise TypeError(f"unknown engine option(s) {bad}; valid: {sorted(names)}")
        return cls(**{k: v for k, v in kw.items() if v is not None})

    @property
    def gpu_budget_bytes(self) -> int | None:
        """``gpu_budget`` in bytes, or ``None`` for ``auto``.

        Raises:
            ValueError: neither ``auto`` nor a finite number of GB > 0.
        """
        if str(self.gpu_budget).strip().lower() == "auto":
            return None
        try:
            gb = float(self.gpu_budget)
        except ValueError:
            raise ValueError(f"gpu_budget {self.gpu_budget!r}: give auto or a size in GB") from None
        if not (gb > 0 and math.isfinite(gb)):
            raise ValueError(f"gpu_budget must be auto or a finite number of GB > 0, got {self.gpu_budget!r}")
        return int(gb * 1e9)

    def resolved_device(self) -> torch.device:
        """The compute device (``auto``: CUDA when present).

        Raises:
            RuntimeError: ``cuda`` requested on a machine without CUDA.
            ValueError: a device type other than ``cpu`` and ``cuda`` (or a malformed name).
        """
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type not in ("cpu", "cuda"):  # torch names many more (meta, mps, xla, ...): none runs the engine
            raise ValueError(f"device type {dev.type!r} is not supported; choose cpu, cuda, cuda:N or auto")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda requested but CUDA is not available on this machine")
        return dev
