"""Grouped SwiGLU expert GEMVs over expert-cache slots for decode batches.

Every route ``p = t·k + j`` whose slot ``s = slot_tk[p]`` is on the device computes

    [g; u] = w13[s] @ x[t] (+ b13[s])   (g: rows [0, I), u: rows [I, 2I) — the layout of ``swiglu_expert``)
    out[t, j] = topk_weights[t, j] · (w2[s] @ act(g, u) (+ b2[s]))

with ``act`` SiLU SwiGLU, ``silu(g) · u``, or gpt-oss's clamped SwiGLU, ``(clamp(u, ±limit) + 1) ·
g' · sigmoid(alpha · g')`` with ``g' = min(g, limit)`` (``ExpertActivation("swiglu_oai")``), the
slot's bias sections when the experts have them (gpt-oss), and routes with ``s < 0`` (CPU set) writing
zeros. Two launches: gate/up + activation into a caller
scratch ``a [P, I]``, then down projection + router weight. At decode a route reads its whole expert
once (``3·I·H`` weights) for one token, so both launches are bandwidth-bound GEMVs: the grids split
every route's output rows into blocks (``(P, I / BLOCK_I)`` and ``(P, H / BLOCK_O)``) so that even
``P = 8`` routes fill an H200's 132 SMs with several programs each.

Numerics follow ``swiglu_expert`` in the weights' dtype (the eager GPU path,
``HybridExperts._run_device_pairs``): x is rounded to the weight dtype; float32 accumulation; each
projection, each bias addition, every step of the activation (``silu(g)`` and its product; for
gpt-oss ``u + 1``, ``alpha · g'``, the sigmoid and both products, as ``gated_activation`` rounds them),
and the router-weight product are rounded to the weight dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles (sm_90 compile: 64 and 72 registers, no spills, 4 warps): gate/up reads 2 x [8, 256] weights per
# iteration, down [16, 256]; at P = 8, I = 768, H = 2048 that is 768 and 1024 programs.
BLOCK_I, BLOCK_H = 8, 256  # gate/up: rows of g (and of u) per program, hidden columns per iteration
BLOCK_O, BLOCK_K = 16, 256  # down: output rows per program, intermediate columns per iteration
NUM_WARPS = 4


@triton.jit
def _gate_up_kernel(x_ptr, slot_ptr, w13_ptr, b13_ptr, a_ptr, K, H, I, stride_x, stride_s, stride_b, alpha, limit,
                    OAI: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    s = tl.load(slot_ptr + p)
    if s >= 0:
        wdt = w13_ptr.dtype.element_ty
        rmask = rows < I
        w_g = w13_ptr + s.to(tl.int64) * stride_s + rows[:, None].to(tl.int64) * H  # [BI, 1] gate rows
        w_u = w_g + I * H  # up rows
        x_row = x_ptr + (p // K).to(tl.int64) * stride_x
        acc_g = tl.zeros([BLOCK_I, BLOCK_H], tl.float32)
        acc_u = tl.zeros([BLOCK_I, BLOCK_H], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = cols < H
            xv = tl.load(x_row + cols, mask=cmask, other=0.0).to(wdt).to(tl.float32)  # [BH]
            m2 = rmask[:, None] & cmask[None, :]
            acc_g += tl.load(w_g + cols[None, :], mask=m2, other=0.0).to(tl.float32) * xv[None, :]
            acc_u += tl.load(w_u + cols[None, :], mask=m2, other=0.0).to(tl.float32) * xv[None, :]
        g = tl.sum(acc_g, axis=1).to(wdt).to(tl.float32)  # [BI]
        u = tl.sum(acc_u, axis=1).to(wdt).to(tl.float32)
        if HAS_BIAS:
            b = b13_ptr + s.to(tl.int64) * stride_b + rows  # the slot's gate bias, then up's
            g = (g + tl.load(b, mask=rmask, other=0.0).to(wdt).to(tl.float32)).to(wdt).to(tl.float32)
            u = (u + tl.load(b + I, mask=rmask, other=0.0).to(wdt).to(tl.float32)).to(wdt).to(tl.float32)
        if OAI:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            z = (g * alpha).to(wdt).to(tl.float32)
            sig = (1.0 / (1.0 + tl.exp(-z))).to(wdt).to(tl.float32)
            act = (g * sig).to(wdt).to(tl.float32)
            u = (u + 1.0).to(wdt).to(tl.float32)
        else:
            act = (g / (1.0 + tl.exp(-g))).to(wdt).to(tl.float32)
        tl.store(a_ptr + p.to(tl.int64) * I + rows, (act * u).to(wdt), mask=rmask)


@triton.jit
def _down_kernel(a_ptr, slot_ptr, w2_ptr, b2_ptr, wt_ptr, out_ptr, H, I, stride_s, stride_b,
                 HAS_BIAS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    rmask = rows < H
    s = tl.load(slot_ptr + p)
    odt = out_ptr.dtype.element_ty
    if s >= 0:
        wdt = w2_ptr.dtype.element_ty
        w_rows = w2_ptr + s.to(tl.int64) * stride_s + rows[:, None].to(tl.int64) * I  # [BO, 1]
        a_row = a_ptr + p.to(tl.int64) * I
        acc = tl.zeros([BLOCK_O, BLOCK_K], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < I
            av = tl.load(a_row + cols, mask=cmask, other=0.0).to(tl.float32)  # [BK]
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            acc += w.to(tl.float32) * av[None, :]
        y = tl.sum(acc, axis=1).to(wdt).to(tl.float32)  # [BO]
        if HAS_BIAS:
            b = tl.load(b2_ptr + s.to(tl.int64) * stride_b + rows, mask=rmask, other=0.0)
            y = (y + b.to(wdt).to(tl.float32)).to(wdt).to(tl.float32)
        r = tl.load(wt_ptr + p).to(wdt).to(tl.float32)
        y = (y * r).to(wdt).to(odt)
    else:
        y = tl.zeros([BLOCK_O], odt)
    tl.store(out_ptr + p.to(tl.int64) * H + rows, y, mask=rmask)


def expert_gemv(x: torch.Tensor, slot_tk: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, out: torch.Tensor, a: torch.Tensor, swiglu_oai: tuple[float, float] | None = None,
                biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Weighted expert outputs (SwiGLU, or gpt-oss's clamped SwiGLU with biases) of every (token, k) route
    whose expert sits in a cache slot.

    Args:
        x: ``[T, H]`` hidden states (any float dtype; rounded to the weight dtype; rows may be strided).
        slot_tk: ``[>= T·k]`` int32 slot per route, row-major over ``[T, k]``; -1: not on the device.
        topk_weights: ``[T, k]`` router weights, contiguous.
        w13: ``[S, 2I, H]`` slots (gate rows then up rows), w2: ``[S, H, I]``, same dtype: the cache bank's
            section views (each slot's matrix contiguous; slots ``stride(0)`` elements apart, the row size).
        out: ``[T, k, H]`` contiguous; route rows are overwritten (zeros for ``slot < 0``).
        a: ``[>= T·k, I]`` contiguous scratch in the weight dtype (the SwiGLU activations).
        swiglu_oai: ``(alpha, limit)`` of gpt-oss's clamped SwiGLU, or ``None`` for SiLU SwiGLU.
        biases: ``(b13 [S, 2I], b2 [S, H])`` float32 bias sections of the slots (gate's bias then up's; each
            slot's vector contiguous, slots ``stride(0)`` apart: the cache bank's section views), or ``None``.

    Raises:
        ValueError: shape, dtype or contiguity mismatch.

    Source: the experts of Qwen3-MoE and gpt-oss (``swiglu_expert``; ``transformers``' ``Qwen3MoeExperts``,
    ``GptOssExperts``); the split-rows GEMV is the usual bandwidth-bound decode layout (one program per
    block of output rows of one route).
    """
    T, H = x.shape
    k = topk_weights.shape[1] if topk_weights.dim() == 2 else -1
    S, two_i, H13 = w13.shape
    I = two_i // 2
    P = T * k
    if tuple(topk_weights.shape) != (T, k) or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be a contiguous [T, k] tensor with T = {T}, "
                         f"got {tuple(topk_weights.shape)}")
    if H13 != H or two_i != 2 * I or tuple(w2.shape) != (S, H, I) or w2.dtype != w13.dtype:
        raise ValueError(f"banks w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} {w2.dtype} do not match x [T, {H}]")
    if not (slot_matrices_contiguous(w13) and slot_matrices_contiguous(w2)) or x.stride(1) != 1:
        raise ValueError("w13, w2 must hold one contiguous matrix per slot and x rows must be contiguous")
    if slot_tk.dtype != torch.int32 or slot_tk.numel() < P or not slot_tk.is_contiguous():
        raise ValueError(f"slot_tk must be a contiguous int32 tensor of at least {P} entries")
    if tuple(out.shape) != (T, k, H) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{T}, {k}, {H}] tensor, got {tuple(out.shape)}")
    if a.dtype != w13.dtype or a.dim() != 2 or a.shape[0] < P or a.shape[1] != I or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [>= {P}, {I}] {w13.dtype} scratch, got {a.dtype} {tuple(a.shape)}")
    if biases is not None:
        b13, b2 = biases
        if tuple(b13.shape) != (S, 2 * I) or tuple(b2.shape) != (S, H) or b13.stride(1) != 1 or b2.stride(1) != 1 \
                or b13.stride(0) != b2.stride(0):
            raise ValueError(f"biases must be [{S}, {2 * I}] and [{S}, {H}] slot sections with unit column stride and "
                             f"one slot stride, got {tuple(b13.shape)} / {tuple(b2.shape)}")
        stride_b = b13.stride(0)
    else:
        b13 = b2 = w13  # unread placeholders
        stride_b = 0
    alpha, limit = swiglu_oai if swiglu_oai is not None else (1.0, 0.0)
    has_bias = biases is not None
    _gate_up_kernel[(P, triton.cdiv(I, BLOCK_I))](x, slot_tk, w13, b13, a, k, H, I, x.stride(0), w13.stride(0),
                                                 stride_b, float(alpha), float(limit), OAI=swiglu_oai is not None,
                                                 HAS_BIAS=has_bias, BLOCK_I=BLOCK_I, BLOCK_H=BLOCK_H,
                                                 num_warps=NUM_WARPS)
    _down_kernel[(P, triton.cdiv(H, BLOCK_O))](a, slot_tk, w2, b2, topk_weights, out, H, I, w2.stride(0), stride_b,
                                              HAS_BIAS=has_bias, BLOCK_O=BLOCK_O, BLOCK_K=BLOCK_K,
                                              num_warps=NUM_WARPS)


def slot_matrices_contiguous(bank: torch.Tensor) -> bool:
    """Whether ``bank [S, R, C]`` holds one row-major matrix per slot (``stride = (any >= R·C, C, 1)``): a
    contiguous tensor, or a section view of a byte bank whose slots are ``row_bytes`` apart."""
    return bank.dim() == 3 and bank.stride(2) == 1 and bank.stride(1) == bank.shape[2] and (
        bank.shape[0] <= 1 or bank.stride(0) >= bank.shape[1] * bank.shape[2])
