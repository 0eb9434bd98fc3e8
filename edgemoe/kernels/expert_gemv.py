"""Grouped SwiGLU expert GEMVs over expert-cache slots for decode batches.

Every route ``p = t·k + j`` whose slot ``s = slot_tk[p]`` is on the device computes

    [g; u] = w13[s] @ x[t] (+ b13[s])   (g: rows [0, I), u: rows [I, 2I) — the layout of ``swiglu_expert``)
    out[t, j] = topk_weights[t, j] · (w2[s] @ act(g, u) (+ b2[s]))

with ``act`` SiLU SwiGLU, ``silu(g) · u``, or gpt-oss's clamped SwiGLU, ``(clamp(u, ±limit) + 1) ·
g' · sigmoid(alpha · g')`` with ``g' = min(g, limit)`` (``ExpertActivation("swiglu_oai")``), the
slot's bias sections when the experts have them (gpt-oss), and routes with ``s < 0`` (CPU set) writing
zeros. Two launches: gate/up + activation into a caller
scratch ``a [P, I]``, then down projection + router weight, and optionally (``y``) the sum over each
token's k routes, ``y[t] = Σ_j out[t, j]`` (see :func:`_sum_routes`). At decode a route reads its whole expert
once (``3·I·H`` weights) for one token, so both launches are bandwidth-bound GEMVs: the grids split
every route's output rows into blocks (``(P, I / BLOCK_I)`` and ``(P, H / BLOCK_O)``) so that even
``P = 8`` routes fill an H200's 132 SMs with several programs each.

Numerics follow ``swiglu_expert`` in the weights' dtype (the eager GPU path,
``HybridExperts._run_device_pairs``): x is rounded to the weight dtype; float32 accumulation; each
projection, each bias addition, every step of the activation (``silu(g)`` and its product; for
gpt-oss ``u + 1``, ``alpha · g'``, the sigmoid and both products, as ``gated_activation`` rounds them),
and the router-weight product are rounded to the weight dtype.

:func:`expert_gemv_quant` is the same pair, either activation, with or without biases, over quantized slots
(FP8 block, MXFP4, NVFP4: codes and scales read from the slot rows and dequantized in registers, each weight
rounded to the compute dtype as the torch path rounds its dequantized rows); its E2M1 / E8M0 decoders, the
activation (:func:`gated_act`) and the bias add serve ``grouped_gemm`` too. The activation and the biases
are constexpr flags of the kernels (``OAI``, ``HAS_BIAS``): the SiLU SwiGLU kernels without biases compile
as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgemoe.kernels.quant_slots import QuantSlots

# Tiles, from benchmarks/expert_gemv_sweep.py on an H200 at batch 1 (Qwen3-30B-A3B shape, 8 layers' banks
# in one CUDA graph): gate/up reads 2 x [4, 256] weights per iteration with 4 warps (15.8 us, 3.2 TB/s;
# [8, 256] took 18.9 us), down [16, 256] with 2 warps (9.7 us, 2.6 TB/s; 4 warps took 16.0 us). The
# columns per iteration fix each row's float32 summation order, so these tiles give the same bits as
# every other row count and warp count at 256 columns.
BLOCK_I, BLOCK_H = 4, 256  # gate/up: rows of g (and of u) per program, hidden columns per iteration
BLOCK_O, BLOCK_K = 16, 256  # down: output rows per program, intermediate columns per iteration
GATE_UP_WARPS, DOWN_WARPS = 4, 2


@triton.jit
def gated_act(g, u, alpha, limit, OAI: tl.constexpr, CDT: tl.constexpr):
    """The experts' gated activation of float32 tensors ``g``, ``u`` holding compute-dtype values (projections,
    biases added), returned in CDT: ``silu(g) · u``, or with ``OAI`` gpt-oss's clamped SwiGLU ``(clamp(u, ±limit)
    + 1) · g' · sigmoid(alpha · g')``, ``g' = min(g, limit)``. Every op is rounded to CDT as the torch path's ops
    in the compute dtype round it (``edgemoe.experts.compute.gated_activation``)."""
    if OAI:
        g = tl.minimum(g, limit).to(CDT).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit).to(CDT).to(tl.float32)
        z = (g * alpha).to(CDT).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-z))).to(CDT).to(tl.float32)
        a = ((g * sig).to(CDT).to(tl.float32) * (u + 1.0).to(CDT).to(tl.float32)).to(CDT)
    else:
        a = ((g / (1.0 + tl.exp(-g))).to(CDT).to(tl.float32) * u).to(CDT)
    return a


@triton.jit
def add_bias(v, b_ptrs, mask, HAS_BIAS: tl.constexpr, CDT: tl.constexpr):
    """``v`` (float32 holding compute-dtype values) plus the float32 biases at ``b_ptrs`` broadcast against it,
    rounded as the torch path's ``y + b.to(dtype)``: the bias and the sum to CDT. ``v`` as is without biases."""
    if HAS_BIAS:
        v = (v + tl.load(b_ptrs, mask=mask, other=0.0).to(CDT).to(tl.float32)).to(CDT).to(tl.float32)
    return v


def activation_args(swiglu_oai: tuple[float, float] | None) -> tuple[float, float, bool]:
    """``(alpha, limit, OAI)`` launch arguments of :func:`gated_act` for ``swiglu_oai`` (``None``: SiLU)."""
    alpha, limit = swiglu_oai if swiglu_oai is not None else (1.0, 0.0)
    return float(alpha), float(limit), swiglu_oai is not None


def bias_args(biases: tuple[torch.Tensor, torch.Tensor] | None, S: int, I: int, H: int,
              placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """``(b13, b2, stride_b13, stride_b2, HAS_BIAS)`` launch arguments for ``biases`` (``(b13 [S, 2I], b2 [S, H])``
    float32 slot sections, unit column stride; ``None``: no biases, ``placeholder`` pointers the kernels never
    read).

    Raises:
        ValueError: shapes, dtype or strides do not match.
    """
    if biases is None:
        return placeholder, placeholder, 0, 0, False
    b13, b2 = biases
    if (tuple(b13.shape) != (S, 2 * I) or tuple(b2.shape) != (S, H) or b13.stride(1) != 1 or b2.stride(1) != 1
            or b13.dtype != torch.float32 or b2.dtype != torch.float32):
        raise ValueError(f"biases must be float32 [{S}, {2 * I}] and [{S}, {H}] slot sections with unit column "
                         f"stride, got {b13.dtype} {tuple(b13.shape)} / {b2.dtype} {tuple(b2.shape)}")
    return b13, b2, b13.stride(0), b2.stride(0), True


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
        b = b13_ptr + s.to(tl.int64) * stride_b + rows  # the slot's gate bias, then up's
        g = add_bias(tl.sum(acc_g, axis=1).to(wdt).to(tl.float32), b, rmask, HAS_BIAS, wdt)  # [BI]
        u = add_bias(tl.sum(acc_u, axis=1).to(wdt).to(tl.float32), b + I, rmask, HAS_BIAS, wdt)
        tl.store(a_ptr + p.to(tl.int64) * I + rows, gated_act(g, u, alpha, limit, OAI, wdt), mask=rmask)


@triton.jit
def _sum_routes(out_ptr, y_ptr, cnt_ptr, p, rows, rmask, H, stride_y, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """The route sum of the down kernels, after this program stored its rows ``rows`` of route ``p``:
    the last of the ``TOPK`` programs of token ``t = p // TOPK`` (and these rows) to finish computes
    ``y[t, rows] = Σ_j out[t, j, rows]`` in float32, rounded once to ``y``'s dtype.

    The order is that of ``out.sum(dim=1, dtype=torch.float32)`` on CUDA (PyTorch's reduction kernel
    over a strided dim: four accumulators, route ``j`` into accumulator ``j % 4`` in order from 0, then
    ``((a0 + a1) + a2) + a3``), whichever program is last, so the result is deterministic. Arrival is
    counted in ``cnt_ptr[t · programs(1) + block]`` (int32, zero before the launch, reset to zero by the
    last arriver): each program's stores are released by a barrier and an acq_rel atomic, and the
    last arriver reads the other routes' rows past L1 (``.cg``).
    """
    tl.debug_barrier()  # every thread's stores of this program, before the release below
    t = p // TOPK
    cnt = cnt_ptr + t * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == TOPK - 1:
        tl.store(cnt, 0)
        base = out_ptr + t.to(tl.int64) * TOPK * H + rows
        a0 = tl.zeros([BLOCK], tl.float32)
        a1 = tl.zeros([BLOCK], tl.float32)
        a2 = tl.zeros([BLOCK], tl.float32)
        a3 = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOPK):
            r = tl.load(base + j * H, mask=rmask, other=0.0, cache_modifier=".cg").to(tl.float32)
            if j % 4 == 0:
                a0 = a0 + r
            elif j % 4 == 1:
                a1 = a1 + r
            elif j % 4 == 2:
                a2 = a2 + r
            else:
                a3 = a3 + r
        y = ((a0 + a1) + a2) + a3
        tl.store(y_ptr + t.to(tl.int64) * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _down_kernel(a_ptr, slot_ptr, w2_ptr, b2_ptr, wt_ptr, out_ptr, y_ptr, cnt_ptr, H, I, stride_s, stride_b, stride_y,
                 HAS_BIAS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, SUM: tl.constexpr,
                 TOPK: tl.constexpr):
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
        y = add_bias(tl.sum(acc, axis=1).to(wdt).to(tl.float32), b2_ptr + s.to(tl.int64) * stride_b + rows, rmask,
                     HAS_BIAS, wdt)  # [BO]
        r = tl.load(wt_ptr + p).to(wdt).to(tl.float32)
        y = (y * r).to(wdt).to(odt)
    else:
        y = tl.zeros([BLOCK_O], odt)
    tl.store(out_ptr + p.to(tl.int64) * H + rows, y, mask=rmask)
    if SUM:
        _sum_routes(out_ptr, y_ptr, cnt_ptr, p, rows, rmask, H, stride_y, TOPK, BLOCK_O)


def route_sum_args(y: torch.Tensor | None, counters: torch.Tensor | None, T: int, k: int, H: int,
                   placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, bool, int]:
    """``(y, counters, stride_y, SUM, TOPK)`` launch arguments of the down kernels' route sum (``y None``: off,
    ``placeholder`` pointers the kernels never read).

    Raises:
        ValueError: ``y`` is not ``[T, H]`` with contiguous rows, or ``counters`` is missing, not int32
            contiguous, or smaller than :func:`route_sum_counters` makes it.
    """
    if y is None:
        return placeholder, placeholder, 0, False, 1
    if tuple(y.shape) != (T, H) or y.stride(1) != 1:
        raise ValueError(f"y must be a [{T}, {H}] tensor with contiguous rows, got {tuple(y.shape)}")
    if counters is None or counters.dtype != torch.int32 or not counters.is_contiguous() or \
            counters.numel() < T * triton.cdiv(H, MIN_DOWN_ROWS):
        raise ValueError(f"the route sum needs counters: a zeroed contiguous int32 tensor of at least "
                         f"{T * triton.cdiv(H, MIN_DOWN_ROWS)} entries (route_sum_counters)")
    return y, counters, y.stride(0), True, k


def route_sum_counters(max_tokens: int, hidden: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 arrival counters the route sum of :func:`expert_gemv` / :func:`expert_gemv_quant`
    needs for up to ``max_tokens`` tokens of ``hidden`` (one per token and block of output rows; every
    launch leaves them zero again, so one buffer serves every layer and every graph replay)."""
    return torch.zeros(max_tokens * triton.cdiv(hidden, MIN_DOWN_ROWS), dtype=torch.int32, device=device)


def expert_gemv(x: torch.Tensor, slot_tk: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, out: torch.Tensor, a: torch.Tensor, swiglu_oai: tuple[float, float] | None = None,
                biases: tuple[torch.Tensor, torch.Tensor] | None = None, y: torch.Tensor | None = None,
                counters: torch.Tensor | None = None) -> None:
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
            slot's vector contiguous, slots ``stride(0)`` apart, one stride for both: the cache bank's section
            views), or ``None``.
        y: optional ``[T, H]`` (rows contiguous, any float dtype): also ``y[t] = Σ_j out[t, j]`` summed in
            float32 and rounded once to ``y.dtype``, bit for bit ``out.sum(dim=1, dtype=torch.float32)``
            then ``.to(y.dtype)`` on CUDA (the order: :func:`_sum_routes`), in the down launch.
        counters: with ``y``, the arrival counters (:func:`route_sum_counters`), zero before and after.

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
    b13, b2, stride_b, stride_b2, has_bias = bias_args(biases, S, I, H, w13)
    if stride_b != stride_b2:
        raise ValueError(f"biases must share one slot stride, got {stride_b} and {stride_b2}")
    alpha, limit, oai = activation_args(swiglu_oai)
    y, counters, stride_y, summed, topk = route_sum_args(y, counters, T, k, H, out)
    _gate_up_kernel[(P, triton.cdiv(I, BLOCK_I))](x, slot_tk, w13, b13, a, k, H, I, x.stride(0), w13.stride(0),
                                                 stride_b, alpha, limit, OAI=oai, HAS_BIAS=has_bias, BLOCK_I=BLOCK_I,
                                                 BLOCK_H=BLOCK_H, num_warps=GATE_UP_WARPS)
    _down_kernel[(P, triton.cdiv(H, BLOCK_O))](a, slot_tk, w2, b2, topk_weights, out, y, counters, H, I, w2.stride(0),
                                              stride_b, stride_y, HAS_BIAS=has_bias, BLOCK_O=BLOCK_O, BLOCK_K=BLOCK_K,
                                              SUM=summed, TOPK=topk, num_warps=DOWN_WARPS)


def slot_matrices_contiguous(bank: torch.Tensor) -> bool:
    """Whether ``bank [S, R, C]`` holds one row-major matrix per slot (``stride = (any >= R·C, C, 1)``): a
    contiguous tensor, or a section view of a byte bank whose slots are ``row_bytes`` apart."""
    return bank.dim() == 3 and bank.stride(2) == 1 and bank.stride(1) == bank.shape[2] and (
        bank.shape[0] <= 1 or bank.stride(0) >= bank.shape[1] * bank.shape[2])


# ---------------------------------------------------------------- quantized slots
# Format codes of the quantized kernels (constexpr ``FMT``); shared with ``grouped_gemm``.
FP8, MXFP4, NVFP4 = 1, 2, 3
FORMAT_CODES = {"fp8_block": FP8, "mxfp4": MXFP4, "nvfp4": NVFP4}

# Tiles of the quantized GEMVs, per format: (rows per program, elements of a row per iteration, warps) of the
# gate/up launch and of the down launch, the fastest that `benchmarks/expert_gemv_sweep.py --quant` timed at batch 1
# on an H100 (docs/benchmarks/formats.md).
QUANT_TILES = {FP8: ((4, 256, 2), (32, 256, 4)), MXFP4: ((4, 512, 4), (16, 256, 4)),
               NVFP4: ((4, 512, 4), (8, 256, 4))}
MIN_DOWN_ROWS = min(BLOCK_O, *(down[0] for _, down in QUANT_TILES.values()))  # sizes the route-sum counters


def rounds_weights(fmt: int, compute_dtype: torch.dtype) -> bool:
    """Whether the quantized kernels round each dequantized weight to the compute dtype (the reference's
    ``dequant_rows(...).to(dtype)``). MXFP4 into bf16 or float32 skips it: an E2M1 value times a power of two
    has at most two significant bits and the exponent range of float32, so bf16 holds it exactly (subnormals,
    infinities and NaN included) and the rounding would return its input."""
    return not (fmt == MXFP4 and compute_dtype in (torch.bfloat16, torch.float32))


@triton.jit
def e2m1_to_f32(c):
    """FP4 E2M1 codes (the low 4 bits of an integer tensor) -> float32, exactly.

    The three magnitude bits ``e1 e0 m`` go to float16's exponent/mantissa boundary (bits 11..9), the
    sign to bit 15: that float16 is ``2^(e-15)·(1 + m/2)`` (``e > 0``) or the subnormal ``m·2^-15``, and
    times ``2^14`` it is the E2M1 value (OCP MX v1.0 §5.3.3: 0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    c = c.to(tl.int16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_to_f32(s):
    """E8M0 scale bytes -> float32 ``2^(s - 127)`` (0 -> 2^-127, 255 -> NaN, as the OCP MX definition)."""
    s = s.to(tl.int32)
    bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _vec_tile(v_ptr, c0, K, FMT: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, GB: tl.constexpr,
              CDT: tl.constexpr):
    """Elements ``[c0, c0 + G·GS)`` of a vector, rounded to CDT, as float32 ``[1, G, GB]`` tiles matching
    the weight tiles of :func:`_row_tile_dot`: FP8 one tile (``v1`` = ``v0``); FP4 the even and the odd
    elements (the low and the high nibbles of the weight bytes)."""
    grp = c0 // GS + tl.arange(0, G)  # [G]
    j = tl.arange(0, GB)  # [GB]
    if FMT == 1:
        cols = grp[:, None] * GS + j[None, :]  # [G, GS]
        v0 = tl.load(v_ptr + cols, mask=cols < K, other=0.0).to(CDT).to(tl.float32)[None, :, :]
        v1 = v0
    else:
        ev = grp[:, None] * GS + 2 * j[None, :]  # [G, GB] even elements
        m = ev < K
        v0 = tl.load(v_ptr + ev, mask=m, other=0.0).to(CDT).to(tl.float32)[None, :, :]
        v1 = tl.load(v_ptr + ev + 1, mask=m, other=0.0).to(CDT).to(tl.float32)[None, :, :]
    return v0, v1


@triton.jit
def _row_tile_dot(acc, w_rows, s_rows, s2, rmask, v0, v1, c0, K, FMT: tl.constexpr, G: tl.constexpr,
                  GS: tl.constexpr, GB: tl.constexpr, CDT: tl.constexpr, ROUND_W: tl.constexpr):
    """``acc [R, G, GB] += W[rows, c0 : c0 + G·GS] · v`` elementwise (reduced by the caller), W dequantized
    in registers and rounded to CDT: ``(code · scale).to(CDT)``, the float32 product of the reference
    (``ExpertLayout.dequant_rows``) followed by the compute dtype's rounding.

    ``w_rows [R, 1, 1]``: each row's first weight (FP8 element, FP4 byte); ``s_rows [R, 1]``: each row's
    first scale (FP8: its block row); ``s2``: NVFP4's per-tensor multiplier (a scalar). ``ROUND_W`` false
    skips the rounding where it is exact (:func:`rounds_weights`)."""
    grp = c0 // GS + tl.arange(0, G)  # [G] scale columns
    gmask = rmask[:, None] & (grp < tl.cdiv(K, GS))[None, :]  # [R, G]
    j = tl.arange(0, GB)
    if FMT == 1:
        cols = (grp[:, None] * GS + j[None, :])[None, :, :]  # [1, G, GS]
        w = tl.load(w_rows + cols, mask=rmask[:, None, None] & (cols < K), other=0.0).to(tl.float32)
        sc = tl.load(s_rows + grp[None, :], mask=gmask, other=0.0)  # [R, G]
        acc += (w * sc[:, :, None]).to(CDT).to(tl.float32) * v0
    else:
        b = (grp[:, None] * GB + j[None, :])[None, :, :]  # [1, G, GB] byte of each element pair
        q = tl.load(w_rows + b, mask=gmask[:, :, None], other=0)  # [R, G, GB] uint8
        if FMT == 2:
            sc = e8m0_to_f32(tl.load(s_rows + grp[None, :], mask=gmask, other=127))  # [R, G]
        else:
            sc = tl.load(s_rows + grp[None, :], mask=gmask, other=0.0).to(tl.float32) * s2
        lo = e2m1_to_f32(q & 15) * sc[:, :, None]
        hi = e2m1_to_f32(q >> 4) * sc[:, :, None]
        if ROUND_W:
            lo = lo.to(CDT).to(tl.float32)
            hi = hi.to(CDT).to(tl.float32)
        acc += lo * v0 + hi * v1
    return acc


@triton.jit
def _q_gate_up_kernel(x_ptr, slot_ptr, w_ptr, s_ptr, s2_ptr, b13_ptr, a_ptr, K, H, I, stride_x, stride_w, stride_s,
                      stride_s2, stride_b, ROW_W, ROW_S, BN_ROWS, alpha, limit, FMT: tl.constexpr,
                      OAI: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, G: tl.constexpr,
                      GS: tl.constexpr, GB: tl.constexpr, ROUND_W: tl.constexpr):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.load(slot_ptr + p)
    if s >= 0:
        cdt = a_ptr.dtype.element_ty
        rmask = rows < I
        s64 = s.to(tl.int64)
        w_g = w_ptr + s64 * stride_w + rows.to(tl.int64)[:, None, None] * ROW_W  # [R, 1, 1] gate rows
        w_u = w_g + I * ROW_W  # up rows
        if FMT == 1:  # scale rows: gate's block rows, then up's from ceil(I / bn) on
            s_g = s_ptr + s64 * stride_s + (rows // BN_ROWS)[:, None] * ROW_S  # [R, 1]
            s_u = s_g + tl.cdiv(I, BN_ROWS) * ROW_S
        else:
            s_g = s_ptr + s64 * stride_s + rows[:, None] * ROW_S
            s_u = s_g + I * ROW_S
        if FMT == 3:
            g2 = tl.load(s2_ptr + s64 * stride_s2)
            u2 = tl.load(s2_ptr + s64 * stride_s2 + 1)
        else:
            g2 = 1.0
            u2 = 1.0
        x_row = x_ptr + (p // K).to(tl.int64) * stride_x
        acc_g = tl.zeros([BLOCK_R, G, GB], tl.float32)
        acc_u = tl.zeros([BLOCK_R, G, GB], tl.float32)
        for c0 in range(0, H, G * GS):
            v0, v1 = _vec_tile(x_row, c0, H, FMT, G, GS, GB, cdt)
            acc_g = _row_tile_dot(acc_g, w_g, s_g, g2, rmask, v0, v1, c0, H, FMT, G, GS, GB, cdt, ROUND_W)
            acc_u = _row_tile_dot(acc_u, w_u, s_u, u2, rmask, v0, v1, c0, H, FMT, G, GS, GB, cdt, ROUND_W)
        b = b13_ptr + s64 * stride_b + rows  # the slot's gate bias, then up's
        g = add_bias(tl.sum(tl.sum(acc_g, axis=2), axis=1).to(cdt).to(tl.float32), b, rmask, HAS_BIAS, cdt)  # [R]
        u = add_bias(tl.sum(tl.sum(acc_u, axis=2), axis=1).to(cdt).to(tl.float32), b + I, rmask, HAS_BIAS, cdt)
        tl.store(a_ptr + p.to(tl.int64) * I + rows, gated_act(g, u, alpha, limit, OAI, cdt), mask=rmask)


@triton.jit
def _q_down_kernel(a_ptr, slot_ptr, w_ptr, s_ptr, s2_ptr, b2_ptr, wt_ptr, out_ptr, y_ptr, cnt_ptr, H, I, stride_w,
                   stride_s, stride_s2, stride_b, stride_y, ROW_W, ROW_S, BN_ROWS, FMT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, GB: tl.constexpr,
                   SUM: tl.constexpr, TOPK: tl.constexpr, ROUND_W: tl.constexpr):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < H
    s = tl.load(slot_ptr + p)
    odt = out_ptr.dtype.element_ty
    if s >= 0:
        cdt = a_ptr.dtype.element_ty
        s64 = s.to(tl.int64)
        w_rows = w_ptr + s64 * stride_w + rows.to(tl.int64)[:, None, None] * ROW_W  # [R, 1, 1]
        if FMT == 1:
            s_rows = s_ptr + s64 * stride_s + (rows // BN_ROWS)[:, None] * ROW_S  # [R, 1]
        else:
            s_rows = s_ptr + s64 * stride_s + rows[:, None] * ROW_S
        if FMT == 3:
            d2 = tl.load(s2_ptr + s64 * stride_s2)
        else:
            d2 = 1.0
        a_row = a_ptr + p.to(tl.int64) * I
        acc = tl.zeros([BLOCK_R, G, GB], tl.float32)
        for c0 in range(0, I, G * GS):
            v0, v1 = _vec_tile(a_row, c0, I, FMT, G, GS, GB, cdt)
            acc = _row_tile_dot(acc, w_rows, s_rows, d2, rmask, v0, v1, c0, I, FMT, G, GS, GB, cdt, ROUND_W)
        y = add_bias(tl.sum(tl.sum(acc, axis=2), axis=1).to(cdt).to(tl.float32), b2_ptr + s64 * stride_b + rows,
                     rmask, HAS_BIAS, cdt)  # [R]
        r = tl.load(wt_ptr + p).to(cdt).to(tl.float32)
        y = (y * r).to(cdt).to(odt)
    else:
        y = tl.zeros([BLOCK_R], odt)
    tl.store(out_ptr + p.to(tl.int64) * H + rows, y, mask=rmask)
    if SUM:
        _sum_routes(out_ptr, y_ptr, cnt_ptr, p, rows, rmask, H, stride_y, TOPK, BLOCK_R)


def quant_launch_args(slots: QuantSlots, role: str) -> tuple:
    """The pointer and stride arguments of one role (``"w13"`` or ``"w2"``) of quantized slots, shared by the
    GEMV and grouped-GEMM kernels: ``(w, scale, scale2, stride_w, stride_s, stride_s2, ROW_W, ROW_S, BN_ROWS,
    FMT, GS, GB)`` (``ROW_W``: weight storage units per row; ``ROW_S``: scales per (block) row; ``GS``:
    elements per scale; ``GB``: storage units per scale group)."""
    fmt = FORMAT_CODES[slots.format]
    w, sc = getattr(slots, role), getattr(slots, f"{role}_scale")
    s2 = getattr(slots, f"{role}_scale2") if fmt == NVFP4 else sc  # a placeholder pointer the kernel never reads
    gs = slots.group
    gb = gs if fmt == FP8 else gs // 2
    bn = slots.block[0] if fmt == FP8 else 1
    return (w, sc, s2, w.stride(0), sc.stride(0), s2.stride(0), w.shape[2], sc.shape[2], bn, fmt, gs, gb)


def expert_gemv_quant(x: torch.Tensor, slot_tk: torch.Tensor, topk_weights: torch.Tensor, slots: QuantSlots,
                      out: torch.Tensor, a: torch.Tensor, swiglu_oai: tuple[float, float] | None = None,
                      biases: tuple[torch.Tensor, torch.Tensor] | None = None, y: torch.Tensor | None = None,
                      counters: torch.Tensor | None = None,
                      tiles: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None) -> None:
    """:func:`expert_gemv` over quantized slots, dequantizing the packed rows in registers.

    Every (token, k) route ``p`` with ``slot_tk[p] >= 0`` reads its slot's packed weights and scales
    (FP8 block, MXFP4 or NVFP4: :class:`~edgemoe.kernels.quant_slots.QuantSlots`) and computes the weighted
    expert output (SiLU SwiGLU, or gpt-oss's clamped SwiGLU with the slots' biases); routes with ``slot < 0``
    write zeros.

    Rounding points (those of the torch reference path, which dequantizes rows with
    ``ExpertLayout.dequant_rows`` then runs ``swiglu_expert`` in the compute dtype): each weight is the
    float32 product of its code and scale (NVFP4: ``code · (float(scale) · scale2)``) rounded to the compute
    dtype ``a.dtype`` (skipped where exact: :func:`rounds_weights`); x is rounded to the compute dtype;
    float32 accumulation; each projection, each bias and projection-plus-bias sum, every op of the activation
    (:func:`gated_act`) and the router-weight product are rounded to the compute dtype. Only the order of the
    float32 sums differs from the reference.

    Args:
        x: ``[T, H]`` hidden states (any float dtype; rows contiguous).
        slot_tk: ``[>= T·k]`` int32 slot per route; -1: not on the device.
        topk_weights: ``[T, k]`` router weights, contiguous.
        slots: the cache's section views (:meth:`QuantSlots.check` passes).
        out: ``[T, k, H]`` contiguous, any float dtype; route rows are overwritten.
        a: ``[>= T·k, I]`` contiguous scratch in the compute dtype (bf16, fp16 or float32).
        swiglu_oai: ``(alpha, limit)`` of gpt-oss's clamped SwiGLU, or ``None`` for SiLU SwiGLU.
        biases: ``(b13 [S, 2I], b2 [S, H])`` float32 bias sections of the slots (each slot's vector contiguous,
            slots ``stride(0)`` apart: the cache bank's section views), or ``None``.
        y, counters: the route sum, as in :func:`expert_gemv`.
        tiles: ``((rows, elements, warps) of the gate/up launch, (...) of the down launch)``: rows per program
            (a power of two), elements of a row per iteration (a power of two, at least one scale group) and
            warps; default :data:`QUANT_TILES` of the format. Tiles change the float32 summation order only.

    Raises:
        ValueError: shape, dtype or contiguity mismatch; down tiles too small for the route sum.

    Source: as :func:`expert_gemv`; the formats' definitions are those of ``edgemoe.quant.dequant``.
    """
    slots.check()
    T, H = x.shape
    I = slots.intermediate
    k = topk_weights.shape[1] if topk_weights.dim() == 2 else -1
    P = T * k
    if slots.hidden != H:
        raise ValueError(f"slots of hidden size {slots.hidden} do not match x [T, {H}]")
    if tuple(topk_weights.shape) != (T, k) or not topk_weights.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"topk_weights must be a contiguous [T, k] tensor with T = {T} and x rows contiguous")
    if slot_tk.dtype != torch.int32 or slot_tk.numel() < P or not slot_tk.is_contiguous():
        raise ValueError(f"slot_tk must be a contiguous int32 tensor of at least {P} entries")
    if tuple(out.shape) != (T, k, H) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{T}, {k}, {H}] tensor, got {tuple(out.shape)}")
    if (a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or a.dim() != 2 or a.shape[0] < P
            or a.shape[1] != I or not a.is_contiguous()):
        raise ValueError(f"a must be a contiguous [>= {P}, {I}] float scratch, got {a.dtype} {tuple(a.shape)}")
    b13, b2, sb13, sb2, has_bias = bias_args(biases, slots.w13.shape[0], I, H, slots.w13_scale)
    alpha, limit, oai = activation_args(swiglu_oai)
    y, counters, stride_y, summed, topk = route_sum_args(y, counters, T, k, H, out)
    w, sc, s2, sw, ss, ss2, row_w, row_s, bn, fmt, gs, gb = quant_launch_args(slots, "w13")
    (r1, e1, nw1), (r2, e2, nw2) = tiles or QUANT_TILES[fmt]
    if summed and r2 < MIN_DOWN_ROWS:
        raise ValueError(f"down tiles of {r2} rows: the route sum's counters need at least {MIN_DOWN_ROWS}")
    rw = rounds_weights(fmt, a.dtype)
    _q_gate_up_kernel[(P, triton.cdiv(I, r1))](
        x, slot_tk, w, sc, s2, b13, a, k, H, I, x.stride(0), sw, ss, ss2, sb13, row_w, row_s, bn, alpha, limit,
        FMT=fmt, OAI=oai, HAS_BIAS=has_bias, BLOCK_R=r1, G=max(1, e1 // gs), GS=gs, GB=gb, ROUND_W=rw,
        num_warps=nw1)
    w, sc, s2, sw, ss, ss2, row_w, row_s, bn, fmt, gs, gb = quant_launch_args(slots, "w2")
    _q_down_kernel[(P, triton.cdiv(H, r2))](
        a, slot_tk, w, sc, s2, b2, topk_weights, out, y, counters, H, I, sw, ss, ss2, sb2, stride_y, row_w, row_s, bn,
        FMT=fmt, HAS_BIAS=has_bias, BLOCK_R=r2, G=max(1, e2 // gs), GS=gs, GB=gb, SUM=summed, TOPK=topk,
        ROUND_W=rw, num_warps=nw2)
