"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as in the Hugging Face Qwen3 reference."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x^2) + eps))``, normalized over the last dim.

    Input ``[..., D]`` of any float dtype; the statistic is computed in float32 and the result is cast
    back to the input dtype before the weight multiply (matching ``Qwen3MoeRMSNorm``).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
