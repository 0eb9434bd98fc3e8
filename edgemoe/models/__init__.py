"""Model registry: one file per architecture, keyed by the HF ``architectures[0]`` names it declares.

A new architecture is a new file with a :class:`~edgemoe.models.base.MoECausalLM` subclass and one
entry in ``FAMILIES``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgemoe.config import ModelConfig, check_config_fields, read_hf_config
from edgemoe.models.base import MoECausalLM
from edgemoe.models.deepseek_v3 import DeepseekV3ForCausalLM
from edgemoe.models.glm4_moe import Glm4MoeForCausalLM
from edgemoe.models.gpt_oss import GptOssForCausalLM
from edgemoe.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from edgemoe.models.qwen3_moe import Qwen3MoeForCausalLM

FAMILIES: tuple[type[MoECausalLM], ...] = (
    Qwen3MoeForCausalLM,
    Qwen3_5MoeForCausalLM,
    Glm4MoeForCausalLM,
    DeepseekV3ForCausalLM,
    GptOssForCausalLM,
)

MODEL_REGISTRY: dict[str, type[MoECausalLM]] = {arch: cls for cls in FAMILIES for arch in cls.architectures}
_BY_MODEL_TYPE: dict[str, type[MoECausalLM]] = {t: cls for cls in FAMILIES for t in cls.model_types}


def _served() -> str:
    return ", ".join(f"{arch} ({cls.model_types[0]})" for arch, cls in MODEL_REGISTRY.items())


def model_class(architecture: str) -> type[MoECausalLM]:
    """The edgemoe model class for an HF architecture name.

    Raises:
        ValueError: the architecture is not served (the message lists the ones that are).
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; edgemoe serves: {_served()}") from None


def load_config(source: dict[str, Any] | str | Path) -> ModelConfig:
    """Normalize a Hugging Face config (a dict, a ``config.json`` path or a checkpoint directory)
    with its architecture's ``config_from_hf``, chosen by ``architectures[0]`` (else, without
    ``architectures``, by ``model_type``).

    Raises:
        FileNotFoundError: no ``config.json`` at the path.
        ValueError: not valid JSON, an architecture edgemoe does not serve (``architectures[0]``, whatever
            ``model_type`` says), or a missing, mistyped or inconsistent field; the message names the file
            (and the field).
    """
    raw, where = read_hf_config(source)
    check_config_fields(raw, where)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs, list) else ""
    cls = MODEL_REGISTRY.get(arch) if arch else _BY_MODEL_TYPE.get(str(raw.get("model_type", "")))
    if cls is None:
        raise ValueError(f"{where}: unsupported architecture {arch or '?'} "
                         f"(model_type {raw.get('model_type') or '?'}); edgemoe serves: {_served()}")
    try:
        cfg = cls.config_from_hf(raw, where)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
        if str(exc).startswith(where):
            raise
        # A value the field checks do not cover (a family's own field): at least the file is named.
        raise ValueError(f"{where}: a field has a value this model family cannot use ({type(exc).__name__}: "
                         f"{exc})") from exc
    if cfg.moe_layers and not 0 < cfg.top_k <= cfg.num_experts:
        raise ValueError(f"{where}: num_experts_per_tok ({cfg.top_k}) must be in [1, {cfg.num_experts}], "
                         "the number of routed experts")
    return cfg
