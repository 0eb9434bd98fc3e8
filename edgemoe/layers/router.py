"""Sigmoid routing with a score-correction bias and group-limited top-k.

The router of DeepSeek-V3 (``topk_method: noaux_tc``, "auxiliary-loss-free load balancing", DeepSeek-V3
technical report, arXiv 2412.19437 §2.1.2) and of GLM-4.5/4.6/4.7; reference: ``transformers``'
``Glm4MoeTopkRouter`` and ``DeepseekV3TopkRouter`` (the same computation). The weights it returns are
what every expert path receives (eager, device decode, streamed prefill, CPU executor), scaling
factor included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.config import ModelConfig

__all__ = ["GroupLimitedSigmoidRouter", "pad_routes"]


def pad_routes(ids: torch.Tensor, weights: torch.Tensor,
               valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of a captured batch's padding rows: where ``valid [T]`` (bool) is False, row 0's ids
    and weight 0. ``ids [T, k]``, ``weights [T, k]`` are returned as they are when ``valid`` is None.

    The router protocol: every router's ``forward(x, valid=None)`` (and ``MoeBlock.route``) returns
    routes padded this way, so a router may fold it into its own kernel.
    """
    if valid is None:
        return ids, weights
    keep = valid[:, None]  # [T, 1]
    return torch.where(keep, ids, ids[:1]), weights * keep.to(weights.dtype)


class GroupLimitedSigmoidRouter(nn.Module):
    """``forward(x [T, H], valid [T] bool | None) -> (topk_ids [T, k] int64, topk_weights [T, k] float32)``
    (rows where ``valid`` is False: see :func:`pad_routes`).

    Parameters (float32 whatever the model dtype, as the reference keeps them:
    ``_keep_in_fp32_modules_strict``): ``weight [E, H]`` and ``e_score_correction_bias [E]``.

    Per token, in float32: ``s = sigmoid(x·Wᵀ)``; choice scores ``c = s + bias``; each of the
    ``n_group`` groups of ``E / n_group`` experts scores the sum of its two best ``c``; the
    ``topk_group`` best groups stay eligible and the top-k of ``c`` among their experts are chosen.
    Their weights are ``s`` (not ``c``), divided by their sum (+1e-20) with ``norm_topk_prob``, times
    ``routed_scaling_factor``. Settings come from ``cfg.group_routing``
    (:class:`~edgemoe.config.GroupLimitedRoutingConfig`), ``cfg.top_k`` and ``cfg.norm_topk_prob``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        routing = cfg.group_routing
        if routing is None:
            raise ValueError("GroupLimitedSigmoidRouter needs cfg.group_routing")
        routing.check(cfg.num_experts, cfg.top_k)
        E = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(E, dtype=torch.float32), requires_grad=False)
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.n_group, self.topk_group = routing.n_group, routing.topk_group
        self.scaling = float(routing.routed_scaling_factor)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        T, E, G = x.shape[0], self.weight.shape[0], self.n_group
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()  # [T, E]
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        expert_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E).bool()  # [T, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, ids)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return pad_routes(ids, weights * self.scaling, valid)
