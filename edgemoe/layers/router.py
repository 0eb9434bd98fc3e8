"""Sigmoid routing with a score-correction bias and group-limited top-k (DeepSeek-V3's ``noaux_tc``).

DeepSeek-V3 (arXiv 2412.19437 §2.1.2) balances expert load without an auxiliary loss: a per-expert bias
``e_score_correction_bias``, tuned during training, is added to the sigmoid scores only to *choose*
experts; the weights of the chosen experts come from the uncorrected scores. Choice is group-limited:
the ``E`` experts form ``n_group`` equal groups, each group is scored by the sum of its two best
corrected scores, and a token picks its top-k experts within its ``topk_group`` best groups.
Reference: transformers' ``DeepseekV3TopkRouter.forward``, followed step by step (float32 throughout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.config import ModelConfig


class SigmoidGroupRouter(nn.Module):
    """``forward(x [T, H]) -> (topk_ids [T, k] int64, topk_weights [T, k] float32)``.

    Parameters (checkpoint names): ``weight [E, H]`` and ``e_score_correction_bias [E]``, both used in
    float32 (the owning model lists them in ``float32_params``, so a bf16 model keeps them exact).

    Steps, per token: ``s = sigmoid(x · Wᵀ)`` (float32); ``c = s + bias``; group score = sum of the two
    largest ``c`` of each group; keep the ``topk_group`` best groups (the others' ``c`` set to -inf);
    ``topk_ids`` = top-k of ``c``; weights = ``s[topk_ids]``, divided by their sum (+1e-20) when
    ``norm_topk_prob``, then times ``routed_scaling_factor``. Ties resolve as ``torch.topk`` does in the
    reference (same calls, same order).

    Args:
        num_experts: ``E``; hidden_size: ``H``; top_k: ``k``.
        n_group: expert groups (``E % n_group == 0`` and at least 2 experts per group).
        topk_group: groups a token may choose from (``1 <= topk_group <= n_group``).
        norm_topk_prob: renormalize the k weights to sum to 1 (before scaling).
        routed_scaling_factor: factor on the routed weights.

    Raises:
        ValueError: an inconsistent grouping or ``top_k`` larger than the experts of ``topk_group`` groups.
    """

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if n_group < 1 or num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(f"router: {num_experts} experts do not form n_group={n_group} groups of at least 2")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"router: topk_group={topk_group} must be in [1, n_group={n_group}]")
        if not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(f"router: top_k={top_k} must be in [1, experts of topk_group={topk_group} groups]")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> SigmoidGroupRouter:
        """The router of ``cfg`` (``cfg.group_routing`` must be set)."""
        g = cfg.group_routing
        return cls(cfg.num_experts, cfg.hidden_size, cfg.top_k, g.n_group, g.topk_group, cfg.norm_topk_prob,
                   g.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, E, G = x.shape[0], self.num_experts, self.n_group
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()  # [T, E]
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        score_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)  # [T, E]
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, ids)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor
