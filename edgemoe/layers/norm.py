"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as in the Hugging Face Qwen3 reference."""

from __future__ import annotations

import torch
from torch import nn

from edgemoe.kernels import kernel_module
from edgemoe.layers.linear import UsesCpuDense


def fused_kernels(x: torch.Tensor):
    """``edgemoe.kernels.norm_rope`` for CUDA tensors in a 16-bit dtype when the kernels run, else ``None``.

    float32 keeps the torch ops: it is the reference precision (parity tests compare greedy tokens
    with ``transformers``), and the fused kernels' reduction order and FMA contraction differ from
    torch's by an ulp, which the 16-bit rounding hides but float32 exposes.
    """
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    return kernel_module("norm_rope", x.device)


class RMSNorm(UsesCpuDense, nn.Module):
    """``y = weight * (x / sqrt(mean(x^2) + eps))``, normalized over the last dim.

    Input ``[..., D]`` of any float dtype; the statistic is computed in float32 and the result is cast
    back to the input dtype before the weight multiply (matching ``Qwen3MoeRMSNorm``), or, with
    ``float32_scale``, multiplied by the weight in float32 and then cast (matching ``GptOssRMSNorm``).
    """

    def __init__(self, dim: int, eps: float, float32_scale: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.float32_scale = float32_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (fused := fused_kernels(x)) is not None:  # one launch, same rounding points
            return fused.rms_norm(x, self.weight, self.eps, float32_scale=self.float32_scale)
        if self.cpu_dense is not None and (  # one call, a CPU decode step
                y := self.cpu_dense.try_rms_norm(x, self.weight, self.eps, self.float32_scale)) is not None:
            return y
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.float32_scale:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: ``r = x + delta`` (``[T, D]``), returns ``(r, self(r))``; one
        launch on CUDA in a 16-bit dtype, one native call in a CPU decode step (same rounding points as the two
        ops)."""
        fused = fused_kernels(x)
        if fused is None or x.dim() != 2 or self.weight.dtype != x.dtype or delta.dtype != x.dtype:
            if self.cpu_dense is not None and (  # one call for few bf16 rows on the CPU
                    got := self.cpu_dense.try_add_rms_norm(x, delta, self.weight, self.eps, self.float32_scale)):
                return got
            r = x + delta
            return r, self(r)
        return fused.add_rms_norm(x, delta, self.weight, self.eps, float32_scale=self.float32_scale)


class ZeroCenteredRMSNorm(nn.Module):
    """``y = (x / sqrt(mean(x^2) + eps)) * (1 + weight)``: RMSNorm with a zero-centered weight.

    Input ``[..., D]`` of any float dtype; normalization and the ``1 + weight`` scale are applied in
    float32 and the result is cast back to the input dtype (matching ``Qwen3_5MoeRMSNorm``, whose
    weights are stored as offsets from 1 and initialized to 0).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (fused := fused_kernels(x)) is not None:  # one launch, same rounding points
            return fused.rms_norm(x, self.weight, self.eps, zero_centered=True)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``y = weight * rmsnorm(x) * silu(gate)``: the output norm of a gated DeltaNet layer.

    ``forward(x [..., D], gate [..., D]) -> [..., D]`` in ``x.dtype``. The statistic is float32, the
    normalized value is cast to ``x.dtype`` before the weight multiply and the SiLU gate is applied
    in float32 (matching ``Qwen3_5MoeRMSNormGated``: norm before gate).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * torch.nn.functional.silu(gate.float())).to(dtype)
