"""Model registry: one file per architecture, keyed by the HF ``architectures[0]`` name."""

from __future__ import annotations

from edgemoe.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from edgemoe.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,  # served text only
}


def model_class(architecture: str):
    """The edgemoe model class for an HF architecture name.

    Raises:
        ValueError: the architecture is not served (the message lists the ones that are).
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; served: {sorted(MODEL_REGISTRY)}") from None
