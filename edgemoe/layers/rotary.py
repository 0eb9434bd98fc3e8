"""Rotary position embedding (RoPE, Su et al. 2021) with the rope types Qwen3 and DeepSeek-V3 checkpoints
use, rotating halves or (DeepSeek-V3) interleaved pairs.

Inverse frequencies and the attention scaling factor come from ``transformers``'
``ROPE_INIT_FUNCTIONS`` (default, linear, dynamic, yarn, llama3, longrope), so scaled variants match
the reference exactly. ``dynamic`` NTK scaling is evaluated once at the configured maximum length.
"""

from __future__ import annotations

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.layers.norm import fused_kernels


def _inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        base = float(cfg.rope_parameters["rope_theta"])
        dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; known: default, {sorted(ROPE_INIT_FUNCTIONS)}")
    return ROPE_INIT_FUNCTIONS[rope_type](cfg.hf_config(), torch.device("cpu"))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query/key heads by absolute position.

    ``forward(q [T, Hq, D], k [T, Hk, D], positions [T] int64) -> (q, k)`` in the input dtype; cos/sin
    are computed in float32 and cast to the input dtype, as the reference does. With a
    ``partial_rotary_factor`` below 1 only the first ``R = 2 * len(inv_freq)`` dims of each head
    rotate and the rest pass through (``Qwen3_5MoeTextRotaryEmbedding``; for text the three mRoPE
    position streams are equal, so mRoPE reduces to this).

    ``interleaved``: the rotary dims are pairs ``(x0, x1), (x2, x3), ...``, each rotated by one frequency,
    and the result is laid out de-interleaved (``[even', odd']``), as transformers'
    ``apply_rotary_pos_emb_interleave`` does for DeepSeek-V3; queries and keys are permuted alike, so
    their dot products are those of the interleaved rotation.
    """

    def __init__(self, cfg: ModelConfig, interleaved: bool = False):
        super().__init__()
        self.interleaved = interleaved
        inv_freq, scale = _inv_freq(cfg)
        # a plain attribute, computed on the CPU: survives meta-device construction and ``to_empty``
        self._inv_freq = {torch.device("cpu"): inv_freq.float().cpu()}
        self.scale = float(scale)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """``[D/2]`` float32 inverse frequencies on ``device``."""
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        return self._inv_freq[device]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    @staticmethod
    def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, R/2] each
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, R]`` in ``dtype``: computed in float32, scaled, then cast."""
        freqs = positions[:, None].float() * self.inv_freq(positions.device)[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R], R = D unless partial
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def step_tables(self, positions: torch.Tensor, dtype: torch.dtype,
                    step_cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`tables`, computed once per step and dtype when ``step_cache`` (``ForwardBatch.step_cache``)
        is given and shared by the layers."""
        key = ("rope", id(self), dtype)
        if step_cache is not None and key in step_cache:
            return step_cache[key]
        cos_sin = self.tables(positions, dtype)
        if step_cache is not None:
            step_cache[key] = cos_sin
        return cos_sin

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, step_cache: dict | None = None):
        """Rotate ``q``/``k``; ``step_cache`` (``ForwardBatch.step_cache``) shares the cos/sin tables
        among the layers of one step."""
        cos, sin = self.step_tables(positions, q.dtype, step_cache)  # [T, R]
        if self.interleaved:
            half = cos.shape[-1] // 2  # cos/sin are cat(freqs, freqs): the first half holds each pair's angle
            cos, sin = cos[:, None, :half], sin[:, None, :half]  # [T, 1, R/2]
            return self._rotate_pairs(q, cos, sin), self._rotate_pairs(k, cos, sin)
        if (fused := fused_kernels(q)) is not None:  # one launch per tensor, same rounding points
            return fused.apply_rope(q, cos, sin), fused.apply_rope(k, cos, sin)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R]
        R = cos.shape[-1]
        if R < q.shape[-1]:  # partial rotary: rotate [..., :R], pass [..., R:] through
            q_rot, k_rot = q[..., :R], k[..., :R]
            q = torch.cat((q_rot * cos + self._rotate_half(q_rot) * sin, q[..., R:]), dim=-1)
            k = torch.cat((k_rot * cos + self._rotate_half(k_rot) * sin, k[..., R:]), dim=-1)
            return q, k
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
