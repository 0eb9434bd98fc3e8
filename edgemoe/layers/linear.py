"""Linear layers whose few-row GEMVs a CPU-only engine runs on the native CPU executor.

A CPU decode step's dense linear layers (attention projections, routers, dense MLPs, the LM head) are
GEMVs bound by the bytes of their weights, which torch's bf16 matmul reads at a fraction of the DRAM
bandwidth. The model runner binds the native CPU decode kernels (``edgemoe.experts.native.DenseKernels``)
to every module that computes such a product (:class:`UsesCpuDense`, through ``MoECausalLM.bind``), and
:func:`linear` sends the product there when they take it (bf16 CPU tensors, a decode step's few rows),
else to ``torch.nn.functional.linear``. The binding is per module, so the step's other operations keep
torch's own dispatch cost (a ``TorchFunctionMode`` around the forward sends every one of them through
Python: about 900 calls a token for four Qwen3-30B-A3B layers; removing it saved a median 1.6 ms of a 45 ms
CPU-only step at two threads and 3 ms of 80 at one on the development VM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class UsesCpuDense:
    """Mixin of a module that uses the native CPU decode kernels where the runner binds them.

    ``cpu_dense``: an ``edgemoe.experts.native.DenseKernels`` (set by ``MoECausalLM.bind`` on a CPU
    device with the native executor), or ``None``: torch operations.
    """

    cpu_dense = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, dense=None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: on the native CPU GEMV kernels when ``dense`` takes the product
    (``DenseKernels.takes_linear``: bf16 CPU tensors, at most the executor's rows), else
    ``torch.nn.functional.linear``.

    Args:
        x: ``[..., K]``. weight: ``[N, K]``. bias: ``[N]`` or ``None``.
        dense: the bound ``DenseKernels``, or ``None``.

    Returns:
        ``[..., N]`` in ``x``'s dtype (the native result equals torch's up to float32 summation order).
    """
    if dense is not None and (y := dense.try_linear(x, weight, bias)) is not None:
        return y
    return F.linear(x, weight, bias)


class Linear(UsesCpuDense, nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint names) whose forward is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cpu_dense)
