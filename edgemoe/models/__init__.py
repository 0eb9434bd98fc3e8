"""Model registry: one file per architecture, keyed by the HF ``architectures[0]`` names it declares.

A new architecture is a new file with a :class:`~edgemoe.models.base.MoECausalLM` subclass and one
entry in ``FAMILIES``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgemoe.config import ModelConfig, read_hf_config
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
    with its architecture's ``config_from_hf``, chosen by ``architectures[0]`` (else ``model_type``).

    Raises:
        FileNotFoundError: no ``config.json`` at the path.
        ValueError: not valid JSON, an architecture edgemoe does not serve, or a missing or
            inconsistent field; the message names the file.
    """
    raw, where = read_hf_config(source)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs, list) else ""
    cls = MODEL_REGISTRY.get(arch) or _BY_MODEL_TYPE.get(str(raw.get("model_type", "")))
    if cls is None:
        raise ValueError(f"{where}: unsupported architecture {arch or '?'} "
                         f"(model_type {raw.get('model_type') or '?'}); edgemoe serves: {_served()}")
    return cls.config_from_hf(raw, where)
