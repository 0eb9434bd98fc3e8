"""Routed-expert compute shared by every path: one expert (SwiGLU, or gpt-oss's clamped SwiGLU with
biases), and all of one MoE layer's routes grouped by expert over the expert cache's slot banks.

Decode (the eager path's large batches), on-demand prefill waves and streamed prefill all call
:func:`run_sorted_experts`, and the torch CPU executor calls :func:`swiglu_expert`, so every path
rounds at the same points (references: transformers' ``Qwen3MoeExperts.forward`` and
``GptOssExperts``). The activation and biases come from the model's
:class:`~edgemoe.config.ExpertActivation`; only plain SiLU SwiGLU (no biases) runs on the Triton
grouped kernels, anything else on torch ops.

Expert biases (gpt-oss): ``b13 [., 2I]`` (gate's bias then up's) and ``b2 [., H]``, float32, indexed like
the weights they belong to. They are temporary banks beside the weight banks (the host pool's
``b13``/``b2``, and on the compute device a full copy indexed by flat id) until expert rows carry
their bias sections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgemoe.config import SILU_SWIGLU as SILU
from edgemoe.config import ExpertActivation
from edgemoe.kernels import kernel_module


def gated_activation(gate: torch.Tensor, up: torch.Tensor, act: ExpertActivation = SILU) -> torch.Tensor:
    """The expert's gated activation of its gate and up projections (``[..., I]`` each, same dtype).

    ``silu``: ``silu(gate) * up``. ``swiglu_oai``: ``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)`` with
    ``g = min(gate, limit)``, op for op as transformers' ``GptOssExperts._apply_gate`` (so 16-bit inputs
    round at the same points).
    """
    if act.kind == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(min=None, max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def _add_bias(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b.to(y.dtype)


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: ExpertActivation = SILU,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """One routed expert: ``down(act(gate(x), up(x)))``, each projection followed by its bias when given.

    Args:
        x: ``[n, H]`` tokens routed to the expert, in the weights' dtype.
        w13: ``[2I, H]`` gate rows then up rows. w2: ``[H, I]``.
        act: the activation (:func:`gated_activation`).
        b13: ``[2I]`` gate's bias then up's, or ``None``; b2: ``[H]`` or ``None`` (any float dtype, cast to
            the weights'; added after the product, as transformers' experts do).

    Returns:
        ``[n, H]`` in the weights' dtype (references: ``Qwen3MoeExperts.forward``, ``GptOssExperts``).
    """
    gate, up = _add_bias(F.linear(x, w13), b13).chunk(2, dim=-1)  # [n, I] each
    return _add_bias(F.linear(gated_activation(gate, up, act), w2), b2)  # [n, H]


def run_sorted_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_slots: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, routed: torch.Tensor, zero_missing: bool = True,
                       act: ExpertActivation = SILU,
                       biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Compute every route of one MoE layer whose expert is on the device, routes grouped by expert.

    Plain SiLU experts where the Triton kernels run (CUDA): one grouped kernel pair,
    :func:`edgemoe.kernels.grouped_gemm.grouped_swiglu` (no host synchronization). Elsewhere, and for
    any other activation or with biases: :func:`run_experts_loop`. Both round where ``swiglu_expert`` does.

    Args:
        x: ``[T, H]`` hidden states (any float dtype; cast to the weights' dtype).
        topk_ids: ``[T, k]`` int64 layer-local expert ids, on ``x``'s device.
        topk_weights: ``[T, k]`` router weights.
        expert_slots: ``[E]`` int64 on ``x``'s device: the slot holding expert ``e``, or -1.
        w13: ``[S, 2I, H]`` and ``w2``: ``[S, H, I]``, the cache's slot banks.
        routed: ``[T, k, H]`` in the weights' dtype; row ``(t, j)`` is overwritten with
            ``topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` when that expert has a slot, else
            with zeros (``zero_missing``) or left as it is.
        act: the experts' activation.
        biases: ``(b13 [E, 2I], b2 [E, H])`` of the layer's experts by layer-local id, or ``None``.
    """
    grouped = kernel_module("grouped_gemm", x.device) if act.plain and biases is None else None
    if grouped is not None:
        grouped.grouped_swiglu(x, topk_ids, topk_weights, expert_slots, w13, w2, routed, zero_missing=zero_missing)
    else:
        run_experts_loop(x, topk_ids, topk_weights, expert_slots, w13, w2, routed, zero_missing, act, biases)


def run_experts_loop(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_slots: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, routed: torch.Tensor, zero_missing: bool = True,
                     act: ExpertActivation = SILU, biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """:func:`run_sorted_experts` with torch ops on any device: a stable sort of the routes by expert, then
    one ``swiglu_expert`` per expert over its block (the per-expert counts and slots are read on the host).

    Each expert sees its tokens in increasing ``(t, j)`` order (reference: ``Qwen3MoeExperts.forward``).
    """
    k, E = topk_ids.shape[1], expert_slots.numel()
    dtype = w13.dtype
    flat = topk_ids.reshape(-1)  # [P]
    order = torch.argsort(flat, stable=True)  # [P]
    counts = torch.bincount(flat, minlength=E).tolist()
    slots = expert_slots.tolist()
    xd = x.to(dtype)  # [T, H]
    tok = order // k  # [P] token of each sorted route
    wts = topk_weights.reshape(-1).index_select(0, order).to(dtype)  # [P]
    out = routed.view(-1, routed.shape[-1])  # [P, H], row t·k + j
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = order.narrow(0, start, n)  # [n]
        if slots[e] >= 0:
            b13, b2 = (None, None) if biases is None else (biases[0][e], biases[1][e])
            y = swiglu_expert(xd.index_select(0, tok.narrow(0, start, n)), w13[slots[e]], w2[slots[e]], act,
                              b13, b2)  # [n, H]
            out.index_copy_(0, rows, y * wts.narrow(0, start, n)[:, None])
        elif zero_missing:
            out.index_fill_(0, rows, 0)
        start += n


def run_experts_torch(pool, x: torch.Tensor, work: list[tuple[int, torch.Tensor, torch.Tensor]],
                      out: torch.Tensor) -> None:
    """Accumulate ``Σ weight · expert(x[token])`` of ``work`` into ``out`` with torch ops, each expert's
    weights read in place from the host pool (the torch CPU executor, and the native executor's path
    for GEMM-sized experts).

    Args:
        pool: the ``HostExpertPool`` (``w13 [N, 2I, H]``, ``w2 [N, H, I]``; its ``activation`` and, with
            biases, ``b13 [N, 2I]`` / ``b2 [N, H]``).
        x: ``[T, H]`` hidden states on the CPU (any float dtype; cast to the weights' dtype).
        work: per expert ``(flat_id, token_idx [n] int64, weight [n] float)``.
        out: ``[T, H]`` float32 CPU accumulator (added to, not overwritten).
    """
    w13, w2, act = pool.w13, pool.w2, pool.activation
    xd = x.to(w13.dtype)
    for fid, tok, wt in work:
        b13, b2 = (pool.b13[fid], pool.b2[fid]) if act.bias else (None, None)
        y = swiglu_expert(xd.index_select(0, tok), w13[fid], w2[fid], act, b13, b2)  # [n, H]
        out.index_add_(0, tok, (y * wt.to(y.dtype)[:, None]).float())
