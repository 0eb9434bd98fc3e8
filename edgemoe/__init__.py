"""edgemoe: serve Mixture-of-Experts LLMs larger than the GPU (host-resident experts, a global LRU
expert cache and a bandwidth-split hybrid CPU/GPU executor).

Public entry points (imported lazily, so ``import edgemoe.config`` stays light)::

    from edgemoe import LLM, SamplingParams
    llm = LLM("path/to/model", device="cpu")
    print(llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0))[0].outputs[0].text)
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# torch's CPU threads (GNU OpenMP in its Linux builds) busy-wait after every parallel region by
# default. When other processes load the CPU, or the native expert executor's threads run next, the
# spinning workers take the cores the working threads need: decode of the tiny model fell from
# ~100 to 1-4 tokens/s on a loaded 2-core machine; with passive waiting it keeps 40-80 (see
# README, "Threads"). OpenMP reads the policy once, when torch loads it, hence here, before any
# edgemoe module imports torch; a value the user set is kept.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
