"""Dense SwiGLU MLP (used by MoE models' dense layers, e.g. Qwen3-MoE ``mlp_only_layers``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.layers.linear import Linear


class DenseMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; ``[T, H] -> [T, H]``, weights ``[I, H]``, ``[I, H]``, ``[H, I]``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
