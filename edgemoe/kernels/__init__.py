"""Triton kernels of the GPU decode fast path and of prefill's expert compute: pure functions over
tensors (imports only torch and triton), every one CUDA-graph capturable (no host synchronization, no
data-dependent shapes or allocations; outputs go to caller-provided buffers; ``grouped_gemm``
allocates scratch whose size follows the input shapes only).

- :mod:`.route_control`: one MoE layer's routing control (dedupe, hit/miss, q, LRU victims, table
  rewrite, CPU work layout) — the device twin of ``edgemoe.experts.hybrid.plan_step``.
- :mod:`.cpu_work`: the packed layout of a step's CPU work shared with the native executor (torch only).
- :mod:`.doorbell`: ring / wait, handing a decode step's CPU work to the native executor's server
  thread through pinned memory and waiting for it (a polling kernel, or stream memory operations).
- :mod:`.cuda_driver`: the CUDA driver's stream memory operations (``cuStreamWaitValue32`` /
  ``cuStreamWriteValue32``) through ctypes (torch and ctypes only; no Triton).
- :mod:`.gather`: the layer's fills, host expert pool → device cache slots, zero-copy over PCIe.
- :mod:`.embedding`: a step's token-embedding rows from a page-locked host table (``--token-embedding host``),
  zero-copy over PCIe.
- :mod:`.expert_gemv`: grouped SwiGLU expert GEMVs over cache slots for decode batches (float slots, and
  FP8 block / MXFP4 / NVFP4 slots dequantized in registers).
- :mod:`.grouped_gemm`: grouped SwiGLU expert GEMMs over cache slots for prefill and large batches
  (routes aligned by expert on the device; quantized weight tiles dequantized before each dot).
- :mod:`.quant_slots`: ``QuantSlots``, a quantized slot bank as those kernels read it (torch only).
- :mod:`.decode_attention`: paged decode attention, split-KV (flash-decoding) with a merge pass.
- :mod:`.norm_rope`: fused RMSNorm and RoPE for the decode step.
- :mod:`.router_topk`: the softmax router's top-k (softmax, top-k, renormalization, padding rows) in one launch.
- :mod:`.gated_delta`: the gated delta rule of ``qwen3_5_moe``'s linear attention (prefill and decode).

Importing a submodule imports triton; this package imports none of them eagerly; :func:`kernel_module` is how
the rest of edgemoe reaches them.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

log = logging.getLogger(__name__)


@functools.cache
def _triton_import_error() -> str | None:
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return f"Triton is not installed ({exc})"
    return None


def unavailable_reason(device: torch.device | str) -> str | None:
    """``None`` when the Triton kernels can run on ``device``, else why not (one line).

    The one test of kernel availability: every caller asks this (or :func:`kernel_module`) instead
    of importing Triton itself.
    """
    if torch.device(device).type != "cuda":
        return "the Triton kernels need CUDA"
    return _triton_import_error()


@functools.cache
def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:  # Triton present but a kernel module does not import: say so once
        log.warning("edgemoe.kernels.%s unavailable (%s): the torch-ops path runs instead", name, exc)
        return None


def kernel_module(name: str, device: torch.device | str) -> ModuleType | None:
    """The kernel module ``edgemoe.kernels.<name>`` when it can run on ``device``, else ``None``
    (imported once, lazily, so a CPU-only path never imports Triton)."""
    if unavailable_reason(device) is not None:
        return None
    return _load(name)
