"""Grouped SwiGLU expert GEMMs over expert-cache slots for prefill and large batches.

Every ``(token, k)`` route ``p = t·k + j`` of one MoE layer whose expert ``e = topk_ids[t, j]`` sits in
cache slot ``s = expert_slots[e] >= 0`` computes

    [g; u] = w13[s] @ x[t] (+ b13[s])   (g: rows [0, I), u: rows [I, 2I) — the layout of ``swiglu_expert``)
    routed[t, j] = topk_weights[t, j] · (w2[s] @ act(g, u) (+ b2[s]))

with ``act`` SiLU SwiGLU, ``silu(g) · u``, or gpt-oss's clamped SwiGLU (``ExpertActivation("swiglu_oai")``,
:func:`~edgemoe.kernels.expert_gemv.gated_act`), and the slots' biases when the experts have them (gpt-oss),
in two launches, replacing a Python loop of one matmul pair per expert:

1. **Align by expert** (torch ops on the device, no host read): a stable sort of the flat expert ids
   groups the routes by expert (each expert's routes in increasing ``p``); ``searchsorted`` gives each
   expert's first sorted position; each expert's block is cut into M-tiles of ``BM`` routes, so that
   every tile belongs to exactly one expert. The grid is sized from the upper bound
   ``min(ceil(P / BM) + E, P)`` on the tile count (``P = T·k``), so shapes depend on ``T``, ``k`` and ``E``
   only and the pair can be captured in a CUDA graph; programs past the real tiles exit at once.
   This is the align-by-expert scheme of the fused-MoE kernels of vLLM and SGLang
   (``moe_align_block_size``), written here with per-tile metadata instead of padded id lists.
2. **Gate/up kernel**, one program per (M-tile, N-tile of ``I``): gathers the tile's token rows of
   ``x``, accumulates the gate and the up tile over ``K = H`` (two float32 accumulators), adds the biases,
   and stores ``act(g, u)`` into the activation scratch ``a [P, I]`` at the routes' sorted positions.
3. **Down kernel**, one program per (M-tile, N-tile of ``H``): ``a @ w2[s]^T`` plus the bias, times the
   route's weight, scattered into the route's own row of ``routed [T, k, H]``.

The activation and the biases are constexpr flags (``OAI``, ``HAS_BIAS``): the SiLU kernels without biases
compile as before. Numerics follow ``swiglu_expert`` in the weights' dtype (the torch path): x is rounded
to the weight dtype; float32 accumulation; each projection, each bias and projection-plus-bias sum, every
op of the activation and the router-weight product are rounded to the weight dtype. float32 weights use
IEEE products (``input_precision="ieee"``, no TF32), as torch's matmul does by default. There is no
split-K: each output row is reduced in one fixed order whatever other rows share its tile, so for a given
:class:`GroupedConfig` a route's row does not depend on the batch composition (which other routes, experts
or slots are in the call).

:func:`grouped_swiglu_quant` is the same pair over quantized slots (FP8 block, MXFP4, NVFP4), two ways, chosen by
shapes only (:func:`choose_quant_config`): each weight tile loaded packed, dequantized in registers and rounded to
the compute dtype, then fed to ``tl.dot`` (FP8 always; FP4 below 16 routes per expert or where the scratch would take
more than 8 chunks); or, for FP4 prefill chunks, a few experts at a time dequantized into a compute-dtype scratch
(:func:`dequantize_slots`, the same rounded numbers) and the float pair run over them. ``docs/quantization.md``
gives the measurements behind the choice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from edgemoe.kernels.expert_gemv import (
    activation_args,
    add_bias,
    bias_args,
    e2m1_to_f32,
    e8m0_to_f32,
    gated_act,
    quant_launch_args,
    slot_matrices_contiguous,
)
from edgemoe.kernels.quant_slots import QuantSlots


@dataclass(frozen=True)
class GroupedConfig:
    """Tiles of the kernel pair (``tl.dot`` needs every block dim >= 16).

    Attributes:
        block_m: routes per M-tile (all of one expert).
        block_n1, block_k1: gate/up kernel: columns of ``g`` (and of ``u``) per program; step over ``H``.
        block_n2, block_k2: down kernel: output columns per program; step over ``I``.
        num_warps, num_stages: Triton launch options of both kernels.
        dequant_experts: quantized FP4 slots only: 0 dequantizes each weight tile in registers inside the
            kernel pair; ``C > 0`` dequantizes ``C`` experts at a time into a compute-dtype scratch
            (:func:`dequantize_slots`) and runs the float pair over them (:func:`grouped_swiglu_quant`).
    """

    block_m: int
    block_n1: int
    block_k1: int
    block_n2: int
    block_k2: int
    num_warps: int = 4
    num_stages: int = 3
    dequant_experts: int = 0


def _pow2_in(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def choose_config(routes: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> GroupedConfig:
    """The fixed tile config for ``routes`` (``T·k``) over ``num_experts`` experts (no autotuning: no
    first-call search, and graph capture needs fixed launches).

    It depends on shapes only, never on the routing, so every call of one layer's step (all-resident,
    streamed, hits then fill waves) computes a route's row identically. ``block_m`` follows the mean
    routes per expert (16 / 32 / 64: few routes waste less of a tile); N 64 (gate and up: 128 columns of
    ``w13``) and 128, K 64, 4 warps and 3 stages; float32 (IEEE FMA dots, operands in registers): 8
    warps and 2 stages. Compiled for sm_90 (Triton 3.6, ptxas), the bf16 BM-64 pair uses wgmma, 72 KiB
    of shared memory and no spills.
    """
    per_expert = routes / max(num_experts, 1)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    return GroupedConfig(bm, _pow2_in(inter, 16, 64), _pow2_in(hidden, 16, 64), _pow2_in(hidden, 16, 128),
                         _pow2_in(inter, 16, 64), num_warps=8 if dtype == torch.float32 else 4,
                         num_stages=2 if dtype == torch.float32 else 3)


@triton.jit(do_not_specialize=["G"])  # G varies with T: one compile for every T
def _gate_up_kernel(x_ptr, order_ptr, meta_ptr, w13_ptr, b13_ptr, a_ptr, G, TOPK, H, I, stride_x, stride_s, stride_b,
                    alpha, limit, OAI: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    n_tiles = tl.cdiv(I, BN)
    tile = tl.program_id(0) // n_tiles  # consecutive programs share the tile's x rows and the expert
    first = tl.load(meta_ptr + tile)
    end = tl.load(meta_ptr + G + tile)
    slot = tl.load(meta_ptr + 2 * G + tile)
    if (first < end) & (slot >= 0):
        wdt = w13_ptr.dtype.element_ty
        pos = first + tl.arange(0, BM)  # [BM] sorted positions of the tile's routes
        pmask = pos < end
        tok = tl.load(order_ptr + pos, mask=pmask, other=0) // TOPK  # [BM] token of each route
        cols = (tl.program_id(0) % n_tiles) * BN + tl.arange(0, BN)  # [BN] rows of g (and of u)
        cmask = cols < I
        kk = tl.arange(0, BK)
        x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_x  # [BM, 1]
        w_g = w13_ptr + slot.to(tl.int64) * stride_s + cols.to(tl.int64)[None, :] * H  # [1, BN]
        w_u = w_g + I * H
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            kmask = (k0 + kk) < H
            xt = tl.load(x_rows + (k0 + kk)[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0).to(wdt)
            wmask = kmask[:, None] & cmask[None, :]
            acc_g = tl.dot(xt, tl.load(w_g + (k0 + kk)[:, None], mask=wmask, other=0.0), acc_g, input_precision="ieee")
            acc_u = tl.dot(xt, tl.load(w_u + (k0 + kk)[:, None], mask=wmask, other=0.0), acc_u, input_precision="ieee")
        b = b13_ptr + slot.to(tl.int64) * stride_b + cols[None, :]  # [1, BN] the slot's gate bias, then up's
        g = add_bias(acc_g.to(wdt).to(tl.float32), b, cmask[None, :], HAS_BIAS, wdt)  # [BM, BN]
        u = add_bias(acc_u.to(wdt).to(tl.float32), b + I, cmask[None, :], HAS_BIAS, wdt)
        tl.store(a_ptr + pos.to(tl.int64)[:, None] * I + cols[None, :], gated_act(g, u, alpha, limit, OAI, wdt),
                 mask=pmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["G"])  # G varies with T: one compile for every T
def _down_kernel(a_ptr, order_ptr, meta_ptr, w2_ptr, b2_ptr, wt_ptr, out_ptr, G, H, I, stride_s, stride_b,
                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 ZERO_MISSING: tl.constexpr):
    n_tiles = tl.cdiv(H, BN)
    tile = tl.program_id(0) // n_tiles
    first = tl.load(meta_ptr + tile)
    end = tl.load(meta_ptr + G + tile)
    slot = tl.load(meta_ptr + 2 * G + tile)
    if first < end:
        odt = out_ptr.dtype.element_ty
        pos = first + tl.arange(0, BM)  # [BM]
        pmask = pos < end
        route = tl.load(order_ptr + pos, mask=pmask, other=0)  # [BM] flat route t·k + j
        cols = (tl.program_id(0) % n_tiles) * BN + tl.arange(0, BN)  # [BN] output columns
        cmask = cols < H
        out_ptrs = out_ptr + route.to(tl.int64)[:, None] * H + cols[None, :]  # [BM, BN]
        omask = pmask[:, None] & cmask[None, :]
        if slot >= 0:
            wdt = w2_ptr.dtype.element_ty
            kk = tl.arange(0, BK)
            a_rows = a_ptr + pos.to(tl.int64)[:, None] * I  # [BM, 1]
            w_rows = w2_ptr + slot.to(tl.int64) * stride_s + cols.to(tl.int64)[None, :] * I  # [1, BN]
            acc = tl.zeros([BM, BN], tl.float32)
            for k0 in range(0, I, BK):
                kmask = (k0 + kk) < I
                at = tl.load(a_rows + (k0 + kk)[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
                wt = tl.load(w_rows + (k0 + kk)[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc = tl.dot(at, wt, acc, input_precision="ieee")
            r = tl.load(wt_ptr + route, mask=pmask, other=0.0).to(wdt).to(tl.float32)  # [BM]
            y = add_bias(acc.to(wdt).to(tl.float32), b2_ptr + slot.to(tl.int64) * stride_b + cols[None, :],
                         cmask[None, :], HAS_BIAS, wdt)  # [BM, BN]
            tl.store(out_ptrs, (y * r[:, None]).to(wdt).to(odt), mask=omask)
        else:
            if ZERO_MISSING:
                if slot == -1:  # -2: a tile another launch computes (a chunk of the dequantizing path)
                    tl.store(out_ptrs, tl.zeros([BM, BN], odt), mask=omask)


def _check_routes(x, topk_ids, topk_weights, expert_slots, T: int, k: int) -> None:
    if tuple(topk_ids.shape) != (T, k) or tuple(topk_weights.shape) != (T, k) or expert_slots.dim() != 1:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be "
                         f"[T, k] with T = {T}, expert_slots [E] (got {tuple(expert_slots.shape)})")
    if topk_ids.is_floating_point() or expert_slots.is_floating_point():
        raise ValueError("topk_ids and expert_slots must be integer tensors")


def align_routes(topk_ids: torch.Tensor, expert_slots: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes sorted by expert and cut into one-expert M-tiles, with torch ops on the device (no host read).

    Args:
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)``.
        expert_slots: ``[E]`` integer cache slot of each expert, -1 when not on the device.
        block_m: routes per M-tile.

    Returns:
        ``order [P]`` int64: flat routes ``t·k + j`` of expert 0, then expert 1, ..., each in increasing
        order; ``meta [3, G]`` int32, ``G = min(ceil(P / block_m) + E, P)``: per tile its first sorted
        position ``first``, the end of its expert's block ``end`` (the tile holds the sorted positions
        ``[first, min(first + block_m, end))``; ``first == end`` for the unused tiles past the real ones)
        and the slot of its expert.
    """
    order, first, end, e, real = _align(topk_ids, expert_slots.numel(), block_m)
    slot = torch.where(real, expert_slots.index_select(0, e).to(first.dtype), -1)  # [G]
    return order, torch.stack([first, end, slot]).to(torch.int32)


def _align(topk_ids: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """:func:`align_routes` before the slots: ``(order [P], first [G], end [G], expert [G], real [G])``, the
    expert of each tile clamped into ``[0, E)`` and ``real`` false for the unused tiles past the real ones."""
    flat = topk_ids.reshape(-1)  # [P]
    P, dev = flat.numel(), flat.device
    ids, order = torch.sort(flat, stable=True)  # [P] each
    bounds = torch.searchsorted(ids, torch.arange(E + 1, dtype=ids.dtype, device=dev))  # [E + 1]
    tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m  # [E] M-tiles per expert
    tile_end = torch.cumsum(tiles, 0)  # [E]
    G = min(triton.cdiv(P, block_m) + E, P)
    g = torch.arange(G, dtype=tile_end.dtype, device=dev)  # [G]
    e = torch.searchsorted(tile_end, g, right=True)  # [G] expert of each tile; E past the last one
    real = e < E
    e = e.clamp_(max=E - 1)
    first = bounds[e] + (g - tile_end[e] + tiles[e]) * block_m  # [G]
    end = torch.where(real, bounds[e + 1], first)  # [G]
    return order, first, end, e, real


def grouped_swiglu(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_slots: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, routed: torch.Tensor, *, zero_missing: bool = True,
                   config: GroupedConfig | None = None, swiglu_oai: tuple[float, float] | None = None,
                   biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Weighted expert output (SwiGLU, or gpt-oss's clamped SwiGLU with biases) of every (token, k) route of one
    MoE layer, one kernel pair for all experts.

    Args:
        x: ``[T, H]`` hidden states, rows contiguous (any float dtype; rounded to the weights' dtype).
        topk_ids: ``[T, k]`` integer layer-local expert ids in ``[0, E)`` (not checked: that would need
            a host read; a route with another id is left unwritten).
        topk_weights: ``[T, k]`` router weights (any float dtype; rounded to the weights' dtype).
        expert_slots: ``[E]`` integer, on the device: the cache slot holding expert ``e``, or -1 when
            it is not on the device (the CPU branch computes those routes elsewhere).
        w13: ``[S, 2I, H]`` slots, gate rows then up rows; w2: ``[S, H, I]``; one dtype; one contiguous matrix
            per slot, slots ``stride(0)`` elements apart (the cache bank's section views, or contiguous banks).
        routed: ``[T, k, H]`` contiguous output in the weights' dtype: row ``(t, j)`` is overwritten with
            ``topk_weights[t, j] · (down(act(gate(x_t) + b_g, up(x_t) + b_u)) + b_2)`` of expert ``topk_ids[t, j]``
            (biases only with ``biases``).
        zero_missing: rows of routes whose expert has slot -1 are written with zeros (``True``) or left
            as they are (``False``: a caller filling ``routed`` over several calls, e.g. fill waves).
        config: tiles; default :func:`choose_config` of ``(T·k, E, H, I)``.
        swiglu_oai: ``(alpha, limit)`` of gpt-oss's clamped SwiGLU, or ``None`` for SiLU SwiGLU
            (:func:`~edgemoe.kernels.expert_gemv.gated_act`).
        biases: ``(b13 [S, 2I], b2 [S, H])`` float32 biases indexed like the slots (unit column stride: the
            cache bank's section views, or contiguous tensors), or ``None``.

    Raises:
        ValueError: shape, dtype, device or contiguity mismatch.

    No host synchronization and no data-dependent shapes: capturable in a CUDA graph for a fixed ``T``.
    Source: the align-by-expert grouped GEMM of vLLM's / SGLang's fused-MoE Triton kernels (own code);
    the expert is Qwen3-MoE's SwiGLU or gpt-oss's (``swiglu_expert``, ``transformers``' ``Qwen3MoeExperts``,
    ``GptOssExperts``).
    """
    T, H = x.shape
    S, two_i, H13 = w13.shape
    I = two_i // 2
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    E = expert_slots.numel()
    _check_routes(x, topk_ids, topk_weights, expert_slots, T, k)
    if H13 != H or two_i != 2 * I or tuple(w2.shape) != (S, H, I) or w2.dtype != w13.dtype:
        raise ValueError(f"banks w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} {w2.dtype} do not match x [T, {H}]")
    if not (slot_matrices_contiguous(w13) and slot_matrices_contiguous(w2)) or x.stride(1) != 1:
        raise ValueError("w13, w2 must hold one contiguous matrix per slot and x rows must be contiguous")
    if tuple(routed.shape) != (T, k, H) or not routed.is_contiguous() or routed.dtype != w13.dtype:
        raise ValueError(f"routed must be a contiguous [{T}, {k}, {H}] {w13.dtype} tensor, "
                         f"got {routed.dtype} {tuple(routed.shape)}")
    if len({t.device for t in (x, topk_ids, topk_weights, expert_slots, w13, w2, routed)}) != 1:
        raise ValueError("all tensors must be on one device")
    P = T * k
    if P == 0:
        return
    cfg = config or choose_config(P, E, H, I, w13.dtype)
    order, meta = align_routes(topk_ids, expert_slots, cfg.block_m)  # [P], [3, G]
    _float_pair(x, order, meta, k, topk_weights, w13, w2, routed, cfg, zero_missing, swiglu_oai, biases)


def _float_pair(x: torch.Tensor, order: torch.Tensor, meta: torch.Tensor, k: int, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, routed: torch.Tensor, cfg: GroupedConfig, zero_missing: bool,
                swiglu_oai: tuple[float, float] | None, biases: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Launch the float kernel pair over aligned routes (``order``, ``meta`` of :func:`align_routes`)."""
    S, two_i, H = w13.shape
    I = two_i // 2
    P, G = order.numel(), meta.shape[1]
    b13, b2, sb13, sb2, has_bias = bias_args(biases, S, I, H, w13)
    alpha, limit, oai = activation_args(swiglu_oai)
    a = torch.empty((P, I), dtype=w13.dtype, device=x.device)  # SwiGLU activations, by sorted position
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_kernel[(G * triton.cdiv(I, cfg.block_n1),)](
        x, order, meta, w13, b13, a, G, k, H, I, x.stride(0), w13.stride(0), sb13, alpha, limit, OAI=oai,
        HAS_BIAS=has_bias, BM=cfg.block_m, BN=cfg.block_n1, BK=cfg.block_k1, **launch)
    _down_kernel[(G * triton.cdiv(H, cfg.block_n2),)](
        a, order, meta, w2, b2, topk_weights.reshape(-1), routed, G, H, I, w2.stride(0), sb2, HAS_BIAS=has_bias,
        BM=cfg.block_m, BN=cfg.block_n2, BK=cfg.block_k2, ZERO_MISSING=zero_missing, **launch)


# ---------------------------------------------------------------- quantized slots
@triton.jit
def _q_tile_dot(acc, x_rows, pmask, w_cols, s_cols, s2, cmask, k0, K, FMT: tl.constexpr, BK: tl.constexpr,
                GS: tl.constexpr, GB: tl.constexpr, CDT: tl.constexpr):
    """``acc [BM, BN] += x[:, k0 : k0 + BK] @ W[k0 : k0 + BK, cols]`` with the weight tile dequantized in
    registers and rounded to CDT before the dot (``(code · scale).to(CDT)``, as ``ExpertLayout.dequant_rows``
    then the compute dtype's rounding).

    ``x_rows [BM, 1]``: the routes' rows (any float dtype); ``w_cols [1, BN]``: the first weight (FP8
    element, FP4 byte) of each weight row; ``s_cols [1, BN]``: its first scale (FP8: of its block row).
    FP8: ``BK`` divides the block's ``GS`` columns, so one scale per weight row and tile. FP4: the low and
    the high nibbles are two dots of ``BK / 2`` (even and odd elements of x)."""
    if FMT == 1:
        kk = k0 + tl.arange(0, BK)  # [BK]
        kmask = kk < K
        xt = tl.load(x_rows + kk[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0).to(CDT)
        w = tl.load(w_cols + kk[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        sc = tl.load(s_cols + k0 // GS, mask=cmask[None, :], other=0.0)  # [1, BN]
        acc = tl.dot(xt, (w * sc).to(CDT), acc, input_precision="ieee")
    else:
        jj = k0 // 2 + tl.arange(0, BK // 2)  # [BK/2] bytes of the tile along a weight row
        ev = 2 * jj  # even elements (low nibbles)
        kmask = ev < K
        wmask = kmask[:, None] & cmask[None, :]
        q = tl.load(w_cols + jj[:, None], mask=wmask, other=0)  # [BK/2, BN] uint8
        if FMT == 2:
            sc = e8m0_to_f32(tl.load(s_cols + (jj // GB)[:, None], mask=wmask, other=127))  # [BK/2, BN]
        else:
            sc = tl.load(s_cols + (jj // GB)[:, None], mask=wmask, other=0.0).to(tl.float32) * s2
        lo = (e2m1_to_f32(q & 15) * sc).to(CDT)
        hi = (e2m1_to_f32(q >> 4) * sc).to(CDT)
        xm = pmask[:, None] & kmask[None, :]
        xe = tl.load(x_rows + ev[None, :], mask=xm, other=0.0).to(CDT)  # [BM, BK/2]
        xo = tl.load(x_rows + ev[None, :] + 1, mask=xm, other=0.0).to(CDT)
        acc = tl.dot(xe, lo, acc, input_precision="ieee")
        acc = tl.dot(xo, hi, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["G"])  # G varies with T: one compile for every T
def _q_gate_up_kernel(x_ptr, order_ptr, meta_ptr, w_ptr, s_ptr, s2_ptr, b13_ptr, a_ptr, G, TOPK, H, I, stride_x,
                      stride_w, stride_s, stride_s2, stride_b, ROW_W, ROW_S, BN_ROWS, alpha, limit, FMT: tl.constexpr,
                      OAI: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, GS: tl.constexpr, GB: tl.constexpr):
    n_tiles = tl.cdiv(I, BN)
    tile = tl.program_id(0) // n_tiles
    first = tl.load(meta_ptr + tile)
    end = tl.load(meta_ptr + G + tile)
    slot = tl.load(meta_ptr + 2 * G + tile)
    if (first < end) & (slot >= 0):
        cdt = a_ptr.dtype.element_ty
        pos = first + tl.arange(0, BM)  # [BM] sorted positions of the tile's routes
        pmask = pos < end
        tok = tl.load(order_ptr + pos, mask=pmask, other=0) // TOPK  # [BM]
        cols = (tl.program_id(0) % n_tiles) * BN + tl.arange(0, BN)  # [BN] rows of g (and of u)
        cmask = cols < I
        x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_x  # [BM, 1]
        s64 = slot.to(tl.int64)
        w_g = w_ptr + s64 * stride_w + cols.to(tl.int64)[None, :] * ROW_W  # [1, BN]
        w_u = w_g + I * ROW_W
        if FMT == 1:
            s_g = s_ptr + s64 * stride_s + (cols // BN_ROWS)[None, :] * ROW_S  # [1, BN]
            s_u = s_g + tl.cdiv(I, BN_ROWS) * ROW_S
        else:
            s_g = s_ptr + s64 * stride_s + cols[None, :] * ROW_S
            s_u = s_g + I * ROW_S
        if FMT == 3:
            g2 = tl.load(s2_ptr + s64 * stride_s2)
            u2 = tl.load(s2_ptr + s64 * stride_s2 + 1)
        else:
            g2 = 1.0
            u2 = 1.0
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            acc_g = _q_tile_dot(acc_g, x_rows, pmask, w_g, s_g, g2, cmask, k0, H, FMT, BK, GS, GB, cdt)
            acc_u = _q_tile_dot(acc_u, x_rows, pmask, w_u, s_u, u2, cmask, k0, H, FMT, BK, GS, GB, cdt)
        b = b13_ptr + s64 * stride_b + cols[None, :]  # [1, BN] the slot's gate bias, then up's
        g = add_bias(acc_g.to(cdt).to(tl.float32), b, cmask[None, :], HAS_BIAS, cdt)  # [BM, BN]
        u = add_bias(acc_u.to(cdt).to(tl.float32), b + I, cmask[None, :], HAS_BIAS, cdt)
        tl.store(a_ptr + pos.to(tl.int64)[:, None] * I + cols[None, :], gated_act(g, u, alpha, limit, OAI, cdt),
                 mask=pmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["G"])  # G varies with T: one compile for every T
def _q_down_kernel(a_ptr, order_ptr, meta_ptr, w_ptr, s_ptr, s2_ptr, b2_ptr, wt_ptr, out_ptr, G, H, I, stride_w,
                   stride_s, stride_s2, stride_b, ROW_W, ROW_S, BN_ROWS, FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GS: tl.constexpr, GB: tl.constexpr,
                   ZERO_MISSING: tl.constexpr):
    n_tiles = tl.cdiv(H, BN)
    tile = tl.program_id(0) // n_tiles
    first = tl.load(meta_ptr + tile)
    end = tl.load(meta_ptr + G + tile)
    slot = tl.load(meta_ptr + 2 * G + tile)
    if first < end:
        odt = out_ptr.dtype.element_ty
        pos = first + tl.arange(0, BM)  # [BM]
        pmask = pos < end
        route = tl.load(order_ptr + pos, mask=pmask, other=0)  # [BM] flat route t·k + j
        cols = (tl.program_id(0) % n_tiles) * BN + tl.arange(0, BN)  # [BN] output columns
        cmask = cols < H
        out_ptrs = out_ptr + route.to(tl.int64)[:, None] * H + cols[None, :]  # [BM, BN]
        omask = pmask[:, None] & cmask[None, :]
        if slot >= 0:
            cdt = a_ptr.dtype.element_ty
            s64 = slot.to(tl.int64)
            a_rows = a_ptr + pos.to(tl.int64)[:, None] * I  # [BM, 1]
            w_rows = w_ptr + s64 * stride_w + cols.to(tl.int64)[None, :] * ROW_W  # [1, BN]
            if FMT == 1:
                s_rows = s_ptr + s64 * stride_s + (cols // BN_ROWS)[None, :] * ROW_S
            else:
                s_rows = s_ptr + s64 * stride_s + cols[None, :] * ROW_S
            if FMT == 3:
                d2 = tl.load(s2_ptr + s64 * stride_s2)
            else:
                d2 = 1.0
            acc = tl.zeros([BM, BN], tl.float32)
            for k0 in range(0, I, BK):
                acc = _q_tile_dot(acc, a_rows, pmask, w_rows, s_rows, d2, cmask, k0, I, FMT, BK, GS, GB, cdt)
            r = tl.load(wt_ptr + route, mask=pmask, other=0.0).to(cdt).to(tl.float32)  # [BM]
            y = add_bias(acc.to(cdt).to(tl.float32), b2_ptr + s64 * stride_b + cols[None, :], cmask[None, :],
                         HAS_BIAS, cdt)  # [BM, BN]
            tl.store(out_ptrs, (y * r[:, None]).to(cdt).to(odt), mask=omask)
        else:
            if ZERO_MISSING:
                tl.store(out_ptrs, tl.zeros([BM, BN], odt), mask=omask)


DEQUANT_ROWS, DEQUANT_BYTES = 16, 256  # tile of :func:`dequantize_slots`: 16 rows x 512 elements
DEQUANT_MIN_ROUTES = 16
"""Mean routes per expert from which FP4 slots take the dequantize-then-float-pair path."""
DEQUANT_SCRATCH_ACTIVATIONS = 4
"""The float scratch of that path holds at most this many times the activation scratch ``a [P, I]`` (at least
one expert)."""
DEQUANT_MAX_CHUNKS = 8
"""Most chunks of experts that path may take; more keep the in-register kernels (each chunk launches the float
pair over the layer's whole tile grid)."""


@triton.jit
def _dequant_fp4_kernel(ids_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, ROWS, ROW_W, ROW_S, HALF, stride_w, stride_s,
                        stride_s2, FMT: tl.constexpr, GB: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Rows ``[BR·p1, BR·(p1 + 1))`` of one role of slot ``ids[p0]`` (skipped when < 0), dequantized into
    ``out[p0]`` (``[ROWS, 2·ROW_W]`` in the compute dtype); NVFP4 rows ``>= HALF`` use ``scale2[1]``."""
    e = tl.program_id(0)
    slot = tl.load(ids_ptr + e)
    if slot >= 0:
        cdt = out_ptr.dtype.element_ty
        s64 = slot.to(tl.int64)
        rows = tl.program_id(1) * BR + tl.arange(0, BR)  # [BR]
        rmask = rows < ROWS
        r64 = rows.to(tl.int64)[:, None]  # [BR, 1]
        w_rows = w_ptr + s64 * stride_w + r64 * ROW_W
        s_rows = s_ptr + s64 * stride_s + r64 * ROW_S
        o_rows = out_ptr + e.to(tl.int64) * ROWS * (2 * ROW_W) + r64 * (2 * ROW_W)
        if FMT == 3:
            s2 = tl.load(s2_ptr + s64 * stride_s2 + (rows >= HALF).to(tl.int32), mask=rmask, other=0.0)[:, None]
        else:
            s2 = 1.0
        jj = tl.arange(0, BC)
        oo = tl.arange(0, 2 * BC)
        for j0 in range(0, ROW_W, BC):
            j = j0 + jj  # [BC] bytes of the rows
            m = rmask[:, None] & (j < ROW_W)[None, :]
            q = tl.load(w_rows + j[None, :], mask=m, other=0)  # [BR, BC] uint8
            if FMT == 2:
                sc = e8m0_to_f32(tl.load(s_rows + (j // GB)[None, :], mask=m, other=127))
            else:
                sc = tl.load(s_rows + (j // GB)[None, :], mask=m, other=0.0).to(tl.float32) * s2
            lo = (e2m1_to_f32(q & 15) * sc).to(cdt)  # element 2j
            hi = (e2m1_to_f32(q >> 4) * sc).to(cdt)  # element 2j + 1
            o = 2 * j0 + oo
            tl.store(o_rows + o[None, :], tl.reshape(tl.join(lo, hi), (BR, 2 * BC)),
                     mask=rmask[:, None] & (o < 2 * ROW_W)[None, :])


def dequantize_slots(slots: QuantSlots, slot_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Dequantize FP4 slots into float banks: ``w13[i], w2[i]`` = slot ``slot_ids[i]``'s weights, each the
    float32 product of its code and scale (MXFP4 ``E2M1 · 2^(s - 127)``, NVFP4 ``E2M1 · (float(s) · scale2)``)
    rounded to the banks' dtype: the numbers of ``ExpertLayout.dequant_rows`` followed by that rounding, bit for
    bit. Rows ``i`` with ``slot_ids[i] < 0`` are left as they are.

    Args:
        slots: MXFP4 or NVFP4 slot views (:meth:`QuantSlots.check` passes).
        slot_ids: ``[C]`` integer slots, on the device.
        w13: ``[C, 2I, H]`` and w2: ``[C, H, I]`` contiguous, one float dtype (bf16, fp16 or float32).

    Raises:
        ValueError: another format, or banks of the wrong shape, dtype or layout.

    One launch per role, no host synchronization (capturable in a CUDA graph).
    """
    if slots.format not in ("mxfp4", "nvfp4"):
        raise ValueError(f"dequantize_slots reads FP4 slots, not {slots.format!r}")
    C, H, I = slot_ids.numel(), slots.hidden, slots.intermediate
    for name, t, shape in (("w13", w13, (C, 2 * I, H)), ("w2", w2, (C, H, I))):
        if tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != w2.dtype \
                or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name} must be a contiguous float {shape} bank, got {t.dtype} {tuple(t.shape)}")
    ids = slot_ids.to(torch.int32)
    for role, out, half in (("w13", w13, I), ("w2", w2, H)):
        w, sc, s2, sw, ss, ss2, row_w, row_s, _, fmt, _, gb = quant_launch_args(slots, role)
        rows = out.shape[1]
        _dequant_fp4_kernel[(C, triton.cdiv(rows, DEQUANT_ROWS))](
            ids, w, sc, s2, out, rows, row_w, row_s, half, sw, ss, ss2, FMT=fmt, GB=gb, BR=DEQUANT_ROWS,
            BC=DEQUANT_BYTES, num_warps=4)


def choose_quant_config(routes: int, num_experts: int, slots: QuantSlots, dtype: torch.dtype) -> GroupedConfig:
    """The tile config of :func:`grouped_swiglu_quant` for ``routes`` (``T·k``) over ``num_experts`` experts
    computed in ``dtype``: :func:`choose_config`, then :func:`quant_config`; for FP4 slots with at least
    :data:`DEQUANT_MIN_ROUTES` routes per expert, ``dequant_experts`` experts per dequantized chunk, as many as
    :data:`DEQUANT_SCRATCH_ACTIVATIONS` activation scratches hold (``4·P·I`` elements for ``3·H·I`` per expert),
    unless that makes more than :data:`DEQUANT_MAX_CHUNKS` chunks.

    Why (Qwen3-30B-A3B layer, 128 experts, top-8; ``tests/gpu/test_quant_kernels_gpu.py`` on an H100, ms per
    layer, in-register / dequantized / bf16 pair): 8192 tokens, 4 chunks of 42 experts: MXFP4 10.6 / 2.2 / 1.2,
    NVFP4 11.6 / 3.0 / 1.2; 1024 tokens, 26 chunks of 5: MXFP4 2.1 / 8.0 / 0.7, NVFP4 2.3 / 13.0 / 0.9 (each chunk
    costs ~0.3-0.5 ms). Shapes only, never the routing, decide: every call of one layer's step computes a route's
    row the same way.
    """
    H, I = slots.hidden, slots.intermediate
    cfg = quant_config(choose_config(routes, num_experts, H, I, dtype), slots)
    if slots.format == "fp8_block" or routes < DEQUANT_MIN_ROUTES * num_experts:
        return cfg
    chunk = max(1, min(num_experts, DEQUANT_SCRATCH_ACTIVATIONS * routes * I // (3 * H * I)))
    if -(-num_experts // chunk) > DEQUANT_MAX_CHUNKS:
        return cfg
    return replace(cfg, dequant_experts=chunk)


def _grouped_dequantized(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         expert_slots: torch.Tensor, slots: QuantSlots, routed: torch.Tensor, zero_missing: bool,
                         cfg: GroupedConfig, swiglu_oai: tuple[float, float] | None,
                         biases: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """:func:`grouped_swiglu_quant` in chunks of ``cfg.dequant_experts`` experts: each chunk's slots dequantized
    into a float scratch (:func:`dequantize_slots`), then the float pair over the routes of those experts
    (the routes aligned once; each chunk's tiles point at the scratch, every other tile exits). The first
    chunk's down kernel also zeroes the routes whose expert has no slot (``zero_missing``; tile slot -1, the
    other chunks' tiles -2), so no pass over the whole output follows."""
    k = topk_ids.shape[1]
    E, C, H, I, dev = expert_slots.numel(), cfg.dequant_experts, slots.hidden, slots.intermediate, x.device
    w13 = torch.empty((C, 2 * I, H), dtype=routed.dtype, device=dev)
    w2 = torch.empty((C, H, I), dtype=routed.dtype, device=dev)
    order, first, end, e, real = _align(topk_ids, E, cfg.block_m)
    on_device = real & (expert_slots.index_select(0, e) >= 0)  # [G] tiles whose expert has a slot
    skip = torch.where(on_device, -2, -1)  # [G] outside a chunk: -1 (zeroed by the first chunk) for no slot
    for c0 in range(0, E, C):
        ids = torch.nn.functional.pad(expert_slots[c0:c0 + C], (0, max(0, c0 + C - E)), value=-1)  # [C]
        dequantize_slots(slots, ids, w13, w2)
        local = torch.where(on_device & (e >= c0) & (e < c0 + C), e - c0, skip if c0 == 0 else -2)  # [G]
        meta = torch.stack([first, end, local]).to(torch.int32)
        chunk_biases = None if biases is None else tuple(b.index_select(0, ids.clamp(min=0)) for b in biases)
        _float_pair(x, order, meta, k, topk_weights, w13, w2, routed, cfg, zero_missing and c0 == 0, swiglu_oai,
                    chunk_biases)


def quant_config(cfg: GroupedConfig, slots: QuantSlots) -> GroupedConfig:
    """``cfg`` with the K steps the quantized tiles need: FP8 steps within one scale block (``BK <= bk``,
    both powers of two); FP4 steps of at least 32 elements (whole scale groups, dots of ``K >= 16``).

    Raises:
        ValueError: ``dequant_experts`` set for FP8 slots."""
    if slots.format == "fp8_block":
        if cfg.dequant_experts:
            raise ValueError("dequant_experts applies to FP4 slots only (FP8 tiles dequantize in registers)")
        bk = slots.group
        return replace(cfg, block_k1=min(cfg.block_k1, bk), block_k2=min(cfg.block_k2, bk))
    return replace(cfg, block_k1=max(cfg.block_k1, 32), block_k2=max(cfg.block_k2, 32))


def grouped_swiglu_quant(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         expert_slots: torch.Tensor, slots: QuantSlots, routed: torch.Tensor, *,
                         zero_missing: bool = True, config: GroupedConfig | None = None,
                         swiglu_oai: tuple[float, float] | None = None,
                         biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """:func:`grouped_swiglu` over quantized slots (FP8 block, MXFP4, NVFP4), dequantizing each weight tile
    in registers right before its ``tl.dot``: no dequantized copy of an expert ever reaches memory.

    Rounding points as :func:`~edgemoe.kernels.expert_gemv.expert_gemv_quant`: each weight is the float32
    product of its code and scale rounded to the compute dtype ``routed.dtype``; then the float kernels'
    rounding (x to the compute dtype, float32 accumulation, each projection, each bias and
    projection-plus-bias sum, every op of the activation and the router-weight product rounded to the compute
    dtype). A route's row does not depend on the batch composition for a given config (no split-K), as
    :func:`grouped_swiglu`.

    Args:
        x, topk_ids, topk_weights, expert_slots, zero_missing, swiglu_oai, biases: as :func:`grouped_swiglu`.
        slots: the cache's section views (:meth:`QuantSlots.check` passes).
        routed: ``[T, k, H]`` contiguous output in the compute dtype (bf16, fp16 or float32).
        config: tiles; default :func:`choose_quant_config` of ``(T·k, E, slots, routed.dtype)``; a given
            config passes :func:`quant_config` (its ``dequant_experts`` is kept: FP4 only).

    Raises:
        ValueError: shape, dtype, device or contiguity mismatch.
    """
    slots.check()
    T, H = x.shape
    I = slots.intermediate
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    E = expert_slots.numel()
    _check_routes(x, topk_ids, topk_weights, expert_slots, T, k)
    if slots.hidden != H or x.stride(1) != 1:
        raise ValueError(f"slots of hidden size {slots.hidden} do not match x [T, {H}] (rows contiguous)")
    if (tuple(routed.shape) != (T, k, H) or not routed.is_contiguous()
            or routed.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError(f"routed must be a contiguous [{T}, {k}, {H}] float tensor, got {routed.dtype} "
                         f"{tuple(routed.shape)}")
    if len({t.device for t in (x, topk_ids, topk_weights, expert_slots, slots.w13, routed)}) != 1:
        raise ValueError("all tensors must be on one device")
    P = T * k
    if P == 0:
        return
    cfg = quant_config(config, slots) if config else choose_quant_config(P, E, slots, routed.dtype)
    if cfg.dequant_experts:
        _grouped_dequantized(x, topk_ids, topk_weights, expert_slots, slots, routed, zero_missing, cfg, swiglu_oai,
                             biases)
        return
    order, meta = align_routes(topk_ids, expert_slots, cfg.block_m)  # [P], [3, G]
    G = meta.shape[1]
    b13, b2, sb13, sb2, has_bias = bias_args(biases, slots.w13.shape[0], I, H, slots.w13_scale)
    alpha, limit, oai = activation_args(swiglu_oai)
    a = torch.empty((P, I), dtype=routed.dtype, device=x.device)  # SwiGLU activations, by sorted position
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    w, sc, s2, sw, ss, ss2, row_w, row_s, bn, fmt, gs, gb = quant_launch_args(slots, "w13")
    _q_gate_up_kernel[(G * triton.cdiv(I, cfg.block_n1),)](
        x, order, meta, w, sc, s2, b13, a, G, k, H, I, x.stride(0), sw, ss, ss2, sb13, row_w, row_s, bn, alpha,
        limit, FMT=fmt, OAI=oai, HAS_BIAS=has_bias, BM=cfg.block_m, BN=cfg.block_n1, BK=cfg.block_k1, GS=gs,
        GB=gb, **launch)
    w, sc, s2, sw, ss, ss2, row_w, row_s, bn, fmt, gs, gb = quant_launch_args(slots, "w2")
    _q_down_kernel[(G * triton.cdiv(H, cfg.block_n2),)](
        a, order, meta, w, sc, s2, b2, topk_weights.reshape(-1), routed, G, H, I, sw, ss, ss2, sb2, row_w, row_s,
        bn, FMT=fmt, HAS_BIAS=has_bias, BM=cfg.block_m, BN=cfg.block_n2, BK=cfg.block_k2, GS=gs, GB=gb,
        ZERO_MISSING=zero_missing, **launch)
