"""Routed-expert compute shared by every path: one expert (SwiGLU), an expert's weights from a byte bank,
and all of one MoE layer's routes grouped by expert over the expert cache's slot bank.

Decode (the eager path's large batches), on-demand prefill waves and streamed prefill all call
:func:`run_sorted_experts`, and the torch CPU executor calls :func:`swiglu_expert`, so every path
rounds at the same points (reference: transformers' ``Qwen3MoeExperts.forward``).

Where a quantized row is dequantized: on CUDA the Triton kernels read the packed sections of the slot bank
(:func:`quant_slots`) and dequantize each weight tile in registers; elsewhere (the torch reference path, and
the torch CPU executor) :func:`expert_weights` and :func:`gather_expert_weights` dequantize whole rows with
:meth:`~edgemoe.quant.layout.ExpertLayout.dequant_rows` (float32 products, as ``transformers`` dequantizes)
and round the result to the compute dtype, then the float expert math runs unchanged. Both round at the same
points: the float32 product of code and scale, rounded once to the compute dtype. Float rows are used in
place through typed views (no copy, no rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgemoe.kernels import kernel_module
from edgemoe.kernels.quant_slots import QuantSlots, fp8_block_reason
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

DEQUANT_GROUP_BYTES = 256 << 20
"""Prefill / large batches over quantized slots: experts are dequantized in groups of at most this many
bytes of compute-dtype weights (bounds the temporary float bank)."""


def kernel_reason(layout: ExpertLayout) -> str | None:
    """``None`` when the Triton expert kernels read ``layout``'s rows (float rows, or FP8 block / MXFP4 /
    NVFP4 dequantized in the kernels), else why not (FP8 with a column block the kernels do not tile)."""
    if layout.format is WeightFormat.FP8_BLOCK:
        return fp8_block_reason(layout.block_size)
    return None


def quant_slots(layout: ExpertLayout, bank: torch.Tensor) -> QuantSlots:
    """The quantized kernels' view of a slot bank: every section of ``layout`` as a typed view of ``bank``
    (uint8 ``[S, row_bytes]``, no copy).

    Raises:
        ValueError: a float layout (its kernels take ``w13`` / ``w2`` views directly).
    """
    if layout.format.dense:
        raise ValueError(f"{layout.format.value} rows are not quantized: use the w13 / w2 section views")
    nv = layout.format is WeightFormat.NVFP4
    return QuantSlots(layout.format.value, layout.view(bank, "w13"), layout.view(bank, "w13_scale"),
                      layout.view(bank, "w2"), layout.view(bank, "w2_scale"),
                      layout.view(bank, "w13_scale2") if nv else None, layout.view(bank, "w2_scale2") if nv else None,
                      layout.block_size)


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One routed expert: ``down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[n, H]`` tokens routed to the expert, in the weights' dtype.
        w13: ``[2I, H]`` gate rows then up rows. w2: ``[H, I]``.

    Returns:
        ``[n, H]`` in the weights' dtype (reference: ``Qwen3MoeExperts.forward``).
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w2)  # [n, H]


def expert_weights(layout: ExpertLayout, bank: torch.Tensor, row: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The float weights of expert row ``row`` of a byte bank.

    Args:
        layout: the bank's row layout. bank: uint8 ``[N, row_bytes]``.
        dtype: the compute dtype (a float layout's own dtype).

    Returns:
        ``(w13 [2I, H], w2 [H, I])`` in ``dtype``: typed views into the bank for a float layout, the row
        dequantized (float32, then rounded to ``dtype``) for a quantized one.
    """
    if layout.format.dense:
        return layout.view(bank, "w13")[row], layout.view(bank, "w2")[row]
    w13, w2 = layout.dequant_rows(bank, [row])  # [1, 2I, H], [1, H, I] float32
    return w13[0].to(dtype), w2[0].to(dtype)


def gather_expert_weights(layout: ExpertLayout, bank: torch.Tensor, rows: torch.Tensor,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The float weights of several rows: ``(w13 [n, 2I, H], w2 [n, H, I])`` in ``dtype`` (gathered copies).

    Args:
        rows: ``[n]`` int64 row indices on ``bank``'s device (repeats allowed).
    """
    if layout.format.dense:
        return layout.view(bank, "w13").index_select(0, rows), layout.view(bank, "w2").index_select(0, rows)
    w13, w2 = layout.dequant_rows(bank, rows)
    return w13.to(dtype), w2.to(dtype)


def run_sorted_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_slots: torch.Tensor,
                       layout: ExpertLayout, bank: torch.Tensor, routed: torch.Tensor,
                       zero_missing: bool = True) -> None:
    """Compute every route of one MoE layer whose expert is on the device, routes grouped by expert.

    Where the Triton kernels run (CUDA): one grouped kernel pair over the bank's section views, no host
    synchronization: :func:`edgemoe.kernels.grouped_gemm.grouped_swiglu` for float slots,
    :func:`~edgemoe.kernels.grouped_gemm.grouped_swiglu_quant` for quantized ones (weight tiles dequantized
    in registers before each ``tl.dot``). Elsewhere float slots take :func:`run_experts_loop`, and quantized
    slots are dequantized in groups (:func:`gather_expert_weights`, at most ``DEQUANT_GROUP_BYTES`` each)
    into a temporary float bank over which the same float computation runs. Every path rounds where
    ``swiglu_expert`` does, and a route's row never depends on which group or call computed it.

    Args:
        x: ``[T, H]`` hidden states (any float dtype; cast to the compute dtype).
        topk_ids: ``[T, k]`` int64 layer-local expert ids, on ``x``'s device.
        topk_weights: ``[T, k]`` router weights.
        expert_slots: ``[E]`` int64 on ``x``'s device: the slot holding expert ``e``, or -1.
        layout, bank: the cache's slot bank, uint8 ``[S, row_bytes]``.
        routed: ``[T, k, H]`` in the compute dtype; row ``(t, j)`` is overwritten with
            ``topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` when that expert has a slot, else
            with zeros (``zero_missing``) or left as it is.
    """
    if layout.format.dense:
        _run_float(x, topk_ids, topk_weights, expert_slots, layout.view(bank, "w13"), layout.view(bank, "w2"), routed,
                   zero_missing)
        return
    grouped = kernel_module("grouped_gemm", x.device)
    if grouped is not None and kernel_reason(layout) is None:
        grouped.grouped_swiglu_quant(x, topk_ids, topk_weights, expert_slots, quant_slots(layout, bank), routed,
                                     zero_missing=zero_missing)
        return
    E, dtype = expert_slots.numel(), routed.dtype
    slots = expert_slots.tolist()
    placed = [e for e in range(E) if slots[e] >= 0]
    per_expert = 3 * layout.hidden * layout.intermediate * routed.element_size()
    group = max(1, DEQUANT_GROUP_BYTES // per_expert)
    for g0 in range(0, len(placed), group):
        experts = placed[g0:g0 + group]
        rows = torch.tensor([slots[e] for e in experts], dtype=torch.int64, device=bank.device)
        w13, w2 = gather_expert_weights(layout, bank, rows, dtype)  # [g, 2I, H], [g, H, I]
        local = [-1] * E
        for j, e in enumerate(experts):
            local[e] = j
        local_slots = torch.tensor(local, dtype=torch.int64, device=x.device)
        _run_float(x, topk_ids, topk_weights, local_slots, w13, w2, routed, zero_missing=False)
    if zero_missing and len(placed) < E:
        missing = expert_slots.index_select(0, topk_ids.reshape(-1)) < 0  # [P]
        routed.view(-1, routed.shape[-1])[missing] = 0


def _run_float(x, topk_ids, topk_weights, expert_slots, w13, w2, routed, zero_missing) -> None:
    grouped = kernel_module("grouped_gemm", x.device)
    if grouped is not None:
        grouped.grouped_swiglu(x, topk_ids, topk_weights, expert_slots, w13, w2, routed, zero_missing=zero_missing)
    else:
        run_experts_loop(x, topk_ids, topk_weights, expert_slots, w13, w2, routed, zero_missing)


def run_experts_loop(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_slots: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, routed: torch.Tensor, zero_missing: bool = True) -> None:
    """:func:`run_sorted_experts` over float banks with torch ops on any device: a stable sort of the routes
    by expert, then one ``swiglu_expert`` per expert over its block (the per-expert counts and slots are
    read on the host).

    Args:
        w13: ``[S, 2I, H]`` and w2: ``[S, H, I]`` float slot banks (section views: rows may be strided).

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
            y = swiglu_expert(xd.index_select(0, tok.narrow(0, start, n)), w13[slots[e]], w2[slots[e]])  # [n, H]
            out.index_copy_(0, rows, y * wts.narrow(0, start, n)[:, None])
        elif zero_missing:
            out.index_fill_(0, rows, 0)
        start += n


def run_experts_torch(pool, x: torch.Tensor, work: list[tuple[int, torch.Tensor, torch.Tensor]],
                      out: torch.Tensor) -> None:
    """Accumulate ``Σ weight · expert(x[token])`` of ``work`` into ``out`` with torch ops, each expert's
    weights read from its row of the host pool (:func:`expert_weights`: float rows in place, quantized rows
    dequantized) — the torch CPU executor, and the native executor's path for GEMM-sized experts.

    Args:
        pool: the ``HostExpertPool`` (``bank``, ``layout``, ``compute_dtype``).
        x: ``[T, H]`` hidden states on the CPU (any float dtype; cast to the compute dtype).
        work: per expert ``(flat_id, token_idx [n] int64, weight [n] float)``.
        out: ``[T, H]`` float32 CPU accumulator (added to, not overwritten).
    """
    xd = x.to(pool.compute_dtype)
    for fid, tok, wt in work:
        w13, w2 = expert_weights(pool.layout, pool.bank, int(fid), pool.compute_dtype)
        y = swiglu_expert(xd.index_select(0, tok), w13, w2)  # [n, H]
        out.index_add_(0, tok, (y * wt.to(y.dtype)[:, None]).float())
