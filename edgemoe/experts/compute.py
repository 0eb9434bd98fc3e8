"""Routed-expert compute shared by every path: one expert (SwiGLU, or gpt-oss's clamped SwiGLU with
biases), an expert's weights from a byte bank, and all of one MoE layer's routes grouped by expert over
the expert cache's slot bank.

Decode (the eager path's large batches), on-demand prefill waves and streamed prefill all call
:func:`run_sorted_experts`, and the torch CPU executor calls :func:`swiglu_expert`, so every path
rounds at the same points (references: transformers' ``Qwen3MoeExperts.forward`` and ``GptOssExperts``).
The activation comes from the model's :class:`~edgemoe.config.ExpertActivation`; experts with biases
(gpt-oss) keep them in their rows (float32 sections ``b13 [2I]``, gate's then up's, and ``b2 [H]``), read
through :func:`expert_biases`. Every path computes both activations with or without biases: the Triton
kernels (float and quantized slots, decode GEMVs and grouped GEMMs: constexpr flags, :func:`swiglu_oai_args`),
the native CPU executor, and the torch ops here.

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

from edgemoe.config import SILU_SWIGLU as SILU
from edgemoe.config import ExpertActivation
from edgemoe.kernels import kernel_module
from edgemoe.kernels.quant_slots import QuantSlots, fp8_block_reason
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

DEQUANT_GROUP_BYTES = 256 << 20
"""Prefill / large batches over quantized slots: experts are dequantized in groups of at most this many
bytes of compute-dtype weights (bounds the temporary float bank)."""


def kernel_reason(layout: ExpertLayout) -> str | None:
    """``None`` when the Triton expert kernels read ``layout``'s rows (float rows; FP8 block, MXFP4 and NVFP4 rows
    dequantized in the kernels; for either activation, with or without biases), else why not (FP8 with a column
    block the kernels do not tile)."""
    if layout.format is WeightFormat.FP8_BLOCK:
        return fp8_block_reason(layout.block_size)
    return None


def swiglu_oai_args(act: ExpertActivation) -> tuple[float, float] | None:
    """The Triton expert kernels' ``swiglu_oai`` argument for ``act``: ``(alpha, limit)`` of gpt-oss's clamped
    SwiGLU, ``None`` for SiLU SwiGLU."""
    return (act.alpha, act.limit) if act.kind == "swiglu_oai" else None


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


def expert_biases(layout: ExpertLayout, bank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The bias sections of every row of a byte bank: float32 views ``(b13 [N, 2I], b2 [N, H])`` (no copy), or
    ``None`` for a layout without biases."""
    if not layout.has_bias:
        return None
    return layout.view(bank, "b13"), layout.view(bank, "b2")


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
                       zero_missing: bool = True, act: ExpertActivation = SILU) -> None:
    """Compute every route of one MoE layer whose expert is on the device, routes grouped by expert.

    Where the Triton kernels run (CUDA): one grouped kernel pair over the bank's section views (biases from
    the slots' bias sections), no host synchronization: :func:`edgemoe.kernels.grouped_gemm.grouped_swiglu`
    for float slots, :func:`~edgemoe.kernels.grouped_gemm.grouped_swiglu_quant` for quantized ones (weight
    tiles dequantized in registers before each ``tl.dot``). Elsewhere float slots take
    :func:`run_experts_loop`, and quantized slots the kernels do not read (:func:`kernel_reason`), or any
    quantized slots off CUDA, are dequantized in groups (:func:`gather_expert_weights`, at most
    ``DEQUANT_GROUP_BYTES`` each) into a temporary float bank over which the same float computation runs.
    Every path rounds where ``swiglu_expert`` does, and a route's row never depends on which group or call
    computed it.

    Args:
        x: ``[T, H]`` hidden states (any float dtype; cast to the compute dtype).
        topk_ids: ``[T, k]`` int64 layer-local expert ids, on ``x``'s device.
        topk_weights: ``[T, k]`` router weights.
        expert_slots: ``[E]`` int64 on ``x``'s device: the slot holding expert ``e``, or -1.
        layout, bank: the cache's slot bank, uint8 ``[S, row_bytes]``.
        routed: ``[T, k, H]`` in the compute dtype; row ``(t, j)`` is overwritten with
            ``topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` when that expert has a slot, else
            with zeros (``zero_missing``) or left as it is.
        act: the experts' activation (biases, when ``layout`` has them, come from the slots' rows).
    """
    biases = expert_biases(layout, bank)
    if layout.format.dense:
        _run_float(x, topk_ids, topk_weights, expert_slots, layout.view(bank, "w13"), layout.view(bank, "w2"), routed,
                   zero_missing, act, biases)
        return
    grouped = kernel_module("grouped_gemm", x.device)
    if grouped is not None and kernel_reason(layout) is None:
        grouped.grouped_swiglu_quant(x, topk_ids, topk_weights, expert_slots, quant_slots(layout, bank), routed,
                                     zero_missing=zero_missing, swiglu_oai=swiglu_oai_args(act), biases=biases)
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
        group_biases = None if biases is None else (biases[0].index_select(0, rows), biases[1].index_select(0, rows))
        _run_float(x, topk_ids, topk_weights, local_slots, w13, w2, routed, False, act, group_biases)
    if zero_missing and len(placed) < E:
        missing = expert_slots.index_select(0, topk_ids.reshape(-1)) < 0  # [P]
        routed.view(-1, routed.shape[-1])[missing] = 0


def _run_float(x, topk_ids, topk_weights, expert_slots, w13, w2, routed, zero_missing, act, biases) -> None:
    grouped = kernel_module("grouped_gemm", x.device)
    if grouped is not None:
        grouped.grouped_swiglu(x, topk_ids, topk_weights, expert_slots, w13, w2, routed, zero_missing=zero_missing,
                               swiglu_oai=swiglu_oai_args(act), biases=biases)
    else:
        run_experts_loop(x, topk_ids, topk_weights, expert_slots, w13, w2, routed, zero_missing, act, biases)


def run_experts_loop(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_slots: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, routed: torch.Tensor, zero_missing: bool = True,
                     act: ExpertActivation = SILU, biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """:func:`run_sorted_experts` over float banks with torch ops on any device: a stable sort of the routes
    by expert, then one ``swiglu_expert`` per expert over its block (the per-expert counts and slots are
    read on the host).

    Args:
        w13: ``[S, 2I, H]`` and w2: ``[S, H, I]`` float slot banks (section views: rows may be strided).
        act: the experts' activation. biases: ``(b13 [S, 2I], b2 [S, H])`` indexed like the slot banks, or
            ``None``.

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
            s = slots[e]
            b13, b2 = (None, None) if biases is None else (biases[0][s], biases[1][s])
            y = swiglu_expert(xd.index_select(0, tok.narrow(0, start, n)), w13[s], w2[s], act, b13, b2)  # [n, H]
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
        pool: the ``HostExpertPool`` (``bank``, ``layout``, ``compute_dtype``, ``activation``; biases from the
            rows when the layout has them).
        x: ``[T, H]`` hidden states on the CPU (any float dtype; cast to the compute dtype).
        work: per expert ``(flat_id, token_idx [n] int64, weight [n] float)``.
        out: ``[T, H]`` float32 CPU accumulator (added to, not overwritten).
    """
    xd = x.to(pool.compute_dtype)
    biases = expert_biases(pool.layout, pool.bank)
    for fid, tok, wt in work:
        w13, w2 = expert_weights(pool.layout, pool.bank, int(fid), pool.compute_dtype)
        b13, b2 = (None, None) if biases is None else (biases[0][int(fid)], biases[1][int(fid)])
        y = swiglu_expert(xd.index_select(0, tok), w13, w2, pool.activation, b13, b2)  # [n, H]
        out.index_add_(0, tok, (y * wt.to(y.dtype)[:, None]).float())
