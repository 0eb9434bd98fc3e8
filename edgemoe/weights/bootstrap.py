"""The last step of every weight load: pin the filled host expert pool, or fall back to pageable memory.

Pinning (``cudaHostRegister``) comes after the pool is filled, whichever loader filled it (Hugging
Face safetensors, FTW, dummy weights): registering empty memory first would zero-fault every page in
``cudaHostRegister`` before the reads touch it again (``benchmarks/bootstrap.py`` measures both
orders). When pinning is refused the engine still serves, with pageable memory and every expert on
the CPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

__all__ = ["FALLBACK_POLICY", "PinOutcome", "pin_or_fallback"]


@dataclass(frozen=True)
class PinOutcome:
    """Result of :func:`pin_or_fallback`.

    Attributes:
        pinned: the host expert pool is page-locked.
        fallback: pinning was needed (a CUDA device) but refused: the engine must run with pageable
            memory and execute every expert on the CPU (policy ``cpu-all``, no expert cache).
        seconds: time spent in ``cudaHostRegister``.
        message: the warning given on fallback ("" otherwise).
    """

    pinned: bool
    fallback: bool
    seconds: float = 0.0
    message: str = ""


FALLBACK_POLICY = "cpu-all"


def pin_or_fallback(pool, device: torch.device) -> PinOutcome:
    """Pin ``pool`` (a filled :class:`~edgemoe.experts.pool.HostExpertPool`) when ``device`` is CUDA.

    On CPU nothing is pinned and nothing falls back. On CUDA a refused ``pool.pin()`` (OS limit such as
    ``RLIMIT_MEMLOCK``, not enough RAM, a driver refusal) logs one clear warning and returns
    ``fallback=True``: the caller then serves with pageable memory and CPU execution of all experts
    (policy :data:`FALLBACK_POLICY`) instead of failing. Never raises.
    """
    if torch.device(device).type != "cuda":
        return PinOutcome(False, False)
    t0 = time.perf_counter()
    ok = bool(pool.pin())
    dt = time.perf_counter() - t0
    if ok:
        return PinOutcome(True, False, dt)
    msg = (f"pinning the {pool.nbytes / 1e9:.2f} GB host expert pool was refused (cudaHostRegister; "
           f"check `ulimit -l` and free RAM): serving with pageable memory and CPU execution of every "
           f"expert (policy {FALLBACK_POLICY}, no GPU expert cache)")
    log.warning("%s", msg)
    return PinOutcome(False, True, dt, msg)
