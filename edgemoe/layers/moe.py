"""The sparse MoE block: a router, then routed experts through the hybrid executor.

The default router follows ``Qwen3MoeTopKRouter``: ``softmax(x·Wᵀ)`` in float32, top-k, optional
renormalization of the k weights (``norm_topk_prob``), cast back to the hidden dtype. A config with
``group_routing`` gets :class:`~edgemoe.layers.router.GroupLimitedSigmoidRouter` instead (sigmoid,
bias-corrected, group-limited; DeepSeek-V3 and GLM-4.5). Shared experts come in two forms: one gated
shared expert (:class:`SharedExpertMoeBlock`, Qwen3.5) and ungated ``shared_experts``
(:class:`SharedExpertsMoeBlock`, DeepSeekMoE style: DeepSeek-V3, GLM-4.5).
"""

from __future__ import annotations

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.core import ForwardBatch
from edgemoe.kernels import kernel_module
from edgemoe.layers.linear import Linear, UsesCpuDense, linear
from edgemoe.layers.mlp import DenseMLP
from edgemoe.layers.router import GroupLimitedSigmoidRouter, pad_routes


def _fused_topk(logits: torch.Tensor, top_k: int):
    """``edgemoe.kernels.router_topk`` for CUDA logits in a 16-bit dtype that it covers, else ``None``.

    float32 keeps the torch ops, the reference precision (as ``edgemoe.layers.norm.fused_kernels``).
    """
    if not logits.is_cuda or logits.dtype not in (torch.bfloat16, torch.float16):
        return None
    module = kernel_module("router_topk", logits.device)
    if module is None or logits.shape[-1] > module.MAX_EXPERTS or top_k > module.MAX_TOP_K:
        return None
    return module


class TopKRouter(UsesCpuDense, nn.Module):
    """``forward(x [T, H], valid [T] bool | None) -> (topk_ids [T, k] int64, topk_weights [T, k] x.dtype)``;
    weight ``[E, H]`` (``Qwen3MoeTopKRouter``).

    ``softmax(x·Wᵀ)`` in float32, top-k (equal probabilities: the lower expert first, on every path, so a
    token routes the same alone or in a batch; ``torch.topk`` leaves their order unspecified), renormalized
    over the k when ``norm_topk_prob``, cast to the logits' dtype; rows where ``valid`` is False get row 0's
    ids and weight 0 (:func:`pad_routes`). On CUDA in a 16-bit dtype all of it is one kernel
    (:func:`edgemoe.kernels.router_topk.topk_softmax`, rounding as these torch ops round on CUDA), in a
    CPU-only decode step it is part of the MoE layer's one native call (:class:`SparseMoeBlock`); elsewhere
    the torch ops below run.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, None, self.cpu_dense)  # [T, E]
        if (fused := _fused_topk(logits, self.top_k)) is not None:
            return fused.topk_softmax(logits, self.top_k, self.norm_topk_prob, valid)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)  # equal: the lower expert first
        weights, ids = weights[:, :self.top_k], ids[:, :self.top_k]  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return pad_routes(ids, weights.to(logits.dtype), valid)


class MoeBlock(nn.Module):
    """Routed experts of one MoE layer behind a router; ``forward(x [T, H], batch) -> [T, H]``.

    The experts' weights are not parameters of this module: they live in the host pool and the
    device expert cache, reached through ``self.experts`` (a ``HybridExperts`` bound by the runner).
    A subclass owns the router (under the checkpoint's name for it) and implements :meth:`route`; its
    ids and weights are what every expert path computes with (and what next-layer prefetch predicts
    with: the runner hands every block's :meth:`route` to the experts).
    """

    def __init__(self, moe_layer: int):
        super().__init__()
        self.moe_layer = moe_layer
        self.experts = None  # HybridExperts, bound by the model runner

    def route(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H], valid [T] bool | None -> (topk_ids [T, k] int64, topk_weights [T, k])``; rows where
        ``valid`` is False (the padding rows of a captured batch) route like row 0 with weight 0
        (:func:`~edgemoe.layers.router.pad_routes`)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ids, weights = self.route(x, batch.decode.valid if batch.decode is not None else None)
        if batch.record is not None:
            batch.record(batch, self.moe_layer, ids, weights)
        out = self.experts.forward(self.moe_layer, x, ids, weights, batch.phase, batch.step)
        self.experts.prefetch_next(self.moe_layer, x, batch)
        return out


class SparseMoeBlock(MoeBlock):
    """A :class:`MoeBlock` whose router is ``gate``, chosen by the config (see the module docstring).

    ``forward(x [T, H], batch, residual [T, H] | None) -> [T, H]``: the routed output, plus ``residual`` when
    given (a decoder layer's residual add, which the native CPU decode step folds into its call).
    """

    def __init__(self, cfg: ModelConfig, moe_layer: int):
        super().__init__(moe_layer)
        self.gate = TopKRouter(cfg) if cfg.group_routing is None else GroupLimitedSigmoidRouter(cfg)

    def route(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x, valid)

    def _own_router(self) -> TopKRouter | None:
        """The router a one-call CPU decode step may compute in native code: this block's ``TopKRouter``, unless
        its routing was replaced on the instance (a benchmark's ``route`` or router ``forward``, or hooks that
        watch the router: they must see the torch path run)."""
        gate = self.gate
        if (type(gate) is not TopKRouter or "route" in vars(self) or "forward" in vars(gate)
                or gate._forward_hooks or gate._forward_pre_hooks):
            return None
        return gate

    def forward(self, x: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None) -> torch.Tensor:
        if (gate := self._own_router()) is not None and (got := self.experts.try_cpu_decode(
                self.moe_layer, x, gate.weight, gate.top_k, gate.norm_topk_prob, batch.phase, residual)) is not None:
            out, ids, weights = got  # a CPU-only decode step: router, experts and residual in one native call
            if batch.record is not None:
                batch.record(batch, self.moe_layer, ids, weights)
            return out
        out = super().forward(x, batch)
        return out if residual is None else residual + out


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus a gated shared expert (``Qwen3_5MoeSparseMoeBlock``).

    ``forward(x [T, H], batch) -> [T, H]`` = routed output (as :class:`SparseMoeBlock`) +
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``. The shared expert (a dense SwiGLU MLP of
    ``cfg.shared_expert_intermediate_size``) and its ``[1, H]`` gate are ordinary parameters on the
    compute device; only routed experts go through the host pool and expert cache.
    """

    def __init__(self, cfg: ModelConfig, moe_layer: int):
        super().__init__(cfg, moe_layer)
        self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        routed = super().forward(x, batch)  # [T, H]
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class SharedExpertsMoeBlock(SparseMoeBlock):
    """Routed experts plus ungated shared experts (DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066;
    ``Glm4MoeMoE`` and ``DeepseekV3MoE`` in ``transformers``).

    ``forward(x [T, H], batch) -> [T, H]`` = routed output (as :class:`SparseMoeBlock`) +
    ``shared_experts(x)``, a dense SwiGLU MLP of ``cfg.shared_expert_intermediate_size``
    (``n_shared_experts * moe_intermediate_size``: the shared experts fused into one MLP, as the
    checkpoints store them). It is an ordinary parameter on the compute device; only routed experts go
    through the host pool and expert cache.
    """

    def __init__(self, cfg: ModelConfig, moe_layer: int):
        super().__init__(cfg, moe_layer)
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        routed = super().forward(x, batch)  # [T, H]
        return routed + self.shared_experts(x)
