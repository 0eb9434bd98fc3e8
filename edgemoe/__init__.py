"""edgemoe: serve Mixture-of-Experts LLMs larger than the GPU (host-resident experts, a global LRU
expert cache and a bandwidth-split hybrid CPU/GPU executor).

Public entry points (imported lazily, so ``import edgemoe.config`` stays light)::

    from edgemoe import LLM, SamplingParams
    llm = LLM("path/to/model", device="cpu")
    print(llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0))[0].outputs[0].text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from edgemoe.engine.llm import LLM
    from edgemoe.engine.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from edgemoe.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from edgemoe.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'edgemoe' has no attribute {name!r}")
