"""Fused RMSNorm and rotary-embedding kernels for the GPU decode step (fewer, larger launches).

A decode step at batch 1 is bound by launches, not bytes: in eager torch ops, one RMSNorm is six
element-wise kernels and one RoPE application about a dozen, four norms and one RoPE per layer.
These kernels do each in one launch and round where the torch modules do
(``edgemoe.layers.norm.RMSNorm`` / ``ZeroCenteredRMSNorm`` and ``edgemoe.layers.rotary``); they agree
with them to an ulp (the norm's float32 reduction order and ``rsqrt`` differ from torch's).
Reference: ``Qwen3MoeRMSNorm`` and ``apply_rotary_pos_emb`` in ``transformers``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, inner, stride_x0, stride_x1, stride_o, eps, ZERO_CENTERED: tl.constexpr,
                     FLOAT32_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # row (row // inner, row % inner) of x viewed as [rows / inner, inner, D]
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + (row // inner) * stride_x0 + (row % inner) * stride_x1 + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = h * (1.0 + w)
    elif FLOAT32_SCALE:
        y = h * w  # the weight multiply in float32, then one rounding
    else:
        y = h.to(x.dtype).to(tl.float32) * w  # cast back to the input dtype before the weight multiply
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             float32_scale: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in one launch.

    Args:
        x: ``[..., D]``; normalized in float32. A 3-D ``[T, G, D]`` whose last dim is contiguous is read
            in place whatever its other strides (heads split from a fused q/k/v output); other inputs
            are read as ``reshape(-1, D)``.
        weight: ``[D]``; ``zero_centered``: the scale is ``1 + weight`` (Qwen3.5's norms);
            ``float32_scale``: the weight multiplies the float32 normalized value before the one rounding
            to ``x.dtype`` (gpt-oss's norms), instead of the value rounded to ``x.dtype``.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x.dtype``, or in the promoted dtype of ``weight`` and ``x`` for the plain norm
        (what ``weight * h.to(x.dtype)`` gives in torch).
    """
    D = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1:
        src, inner, s0, s1 = x, x.shape[1], x.stride(0), x.stride(1)
    else:
        src = x.reshape(-1, D)
        if src.stride(-1) != 1:
            src = src.contiguous()
        inner, s0, s1 = 1, src.stride(0), 0
    n = x.numel() // D if D else 0
    dtype = x.dtype if zero_centered or float32_scale else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((n, D), dtype=dtype, device=x.device)
    if n:
        _rms_norm_kernel[(n,)](src, weight, out, D, inner, s0, s1, out.stride(0), float(eps),
                               ZERO_CENTERED=zero_centered, FLOAT32_SCALE=float32_scale,
                               BLOCK=triton.next_power_of_2(D), num_warps=4 if D <= 2048 else 8)
    return out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                 HALF: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    cols = tl.arange(0, BLOCK_D)[None, :]  # [1, BD]
    mask = (heads < H) & (cols < D)
    base = x_ptr + t * stride_xt + heads * stride_xh
    x = tl.load(base + cols, mask=mask, other=0.0)
    rot = cols < 2 * HALF
    first = cols < HALF
    partner = tl.where(first, cols + HALF, cols - HALF)
    xp = tl.load(base + partner, mask=mask & rot, other=0.0).to(tl.float32)
    xp = tl.where(first, -xp, xp)  # rotate_half: (-x2, x1)
    c = tl.load(cos_ptr + t * stride_c + cols, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + cols, mask=rot, other=0.0).to(tl.float32)
    # the torch reference rounds each product and the sum to the input dtype
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    b = (xp.to(x.dtype).to(tl.float32) * s).to(x.dtype).to(tl.float32)
    y = tl.where(rot, (a + b).to(x.dtype), x)
    tl.store(out_ptr + t * stride_ot + heads * stride_oh + cols, y, mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x·cos + rotate_half(x)·sin`` on the first ``R`` dims of every head (the rest pass through).

    Args:
        x: ``[T, H, D]`` query or key heads (last dim contiguous).
        cos, sin: ``[T, R]`` in ``x.dtype`` (``R`` even, ``R <= D``), the per-position tables.

    Returns:
        ``[T, H, D]`` in ``x.dtype``, rounded as the torch expression rounds.
    """
    T, H, D = x.shape
    R = cos.shape[-1]
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        BLOCK_H = min(triton.next_power_of_2(H), 16)
        _rope_kernel[(T, triton.cdiv(H, BLOCK_H))](x, cos, sin, out, H, x.stride(0), x.stride(1), out.stride(0),
                                                   out.stride(1), cos.stride(0), HALF=R // 2, D=D, BLOCK_H=BLOCK_H,
                                                   BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out


@triton.jit
def _norm_rope_head(base, w_ptr, c, s, rstd_eps, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head: RMSNorm (rounded to the input dtype before the weight multiply) then RoPE, rounded
    where :func:`rms_norm` and :func:`apply_rope` round. The partner element of ``rotate_half`` is
    re-read and normalized by the same statistic, so the head never leaves registers between the two."""
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x_raw = tl.load(base + cols, mask=mask, other=0.0)
    dt = x_raw.dtype
    x = x_raw.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + rstd_eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((x * rstd).to(dt).to(tl.float32) * w).to(dt)
    rot = cols < 2 * HALF
    first = cols < HALF
    partner = tl.where(first, cols + HALF, cols - HALF)
    xp = tl.load(base + partner, mask=mask & rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=mask & rot, other=0.0).to(tl.float32)
    yp = ((xp * rstd).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    yp = tl.where(first, -yp, yp)  # rotate_half: (-x2, x1)
    a = (y.to(tl.float32) * c).to(dt).to(tl.float32)
    b = (yp.to(dt).to(tl.float32) * s).to(dt).to(tl.float32)
    return tl.where(rot, (a + b).to(dt), y)


@triton.jit
def _qk_norm_rope_kv_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                            Hq, Hk, stride_t, stride_c, stride_qt, stride_slot, eps, D: tl.constexpr,
                            HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # head of the fused row: [0, Hq) queries, [Hq, Hq + Hk) keys, then values
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    base = qkv_ptr + t * stride_t + h * D
    slot = tl.load(slots_ptr + t)
    if h >= Hq + Hk:
        v = tl.load(base + cols, mask=mask, other=0.0)
        tl.store(v_cache_ptr + slot * stride_slot + (h - Hq - Hk) * D + cols, v.to(v_cache_ptr.dtype.element_ty),
                 mask=mask)
    else:
        rot = cols < 2 * HALF
        c = tl.load(cos_ptr + t * stride_c + cols, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_c + cols, mask=rot, other=0.0).to(tl.float32)
        if h < Hq:
            y = _norm_rope_head(base, qw_ptr, c, s, eps, D, HALF, BLOCK_D)
            tl.store(q_ptr + t * stride_qt + h * D + cols, y, mask=mask)
        else:
            y = _norm_rope_head(base, kw_ptr, c, s, eps, D, HALF, BLOCK_D)
            tl.store(k_cache_ptr + slot * stride_slot + (h - Hq) * D + cols, y.to(k_cache_ptr.dtype.element_ty),
                     mask=mask)


def qk_norm_rope_kv_write(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, kv_slots: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor) -> torch.Tensor:
    """A decode step's attention input in one launch: per-head RMSNorm of q and k, RoPE on both, and the
    new keys and values written into their KV-cache slots (the six launches of ``q_norm``, ``k_norm``,
    two :func:`apply_rope` and two ``index_copy_`` in one; Qwen3's ``Qwen3MoeAttention`` order: norm,
    then rotate). Rounds where :func:`rms_norm` and :func:`apply_rope` round.

    Args:
        qkv: ``[T, (Hq + 2 Hk) * D]`` the fused q/k/v projection (last dim contiguous).
        q_weight, k_weight: ``[D]`` the q/k norm weights, in ``qkv.dtype``.
        eps: added to the mean square.
        cos, sin: ``[T, R]`` in ``qkv.dtype`` (``R`` even, ``R <= D``): the first ``R`` dims of each head
            rotate by halves, the rest pass through.
        kv_slots: ``[T]`` int64 flat KV slot each token writes.
        k_cache, v_cache: ``[slots, Hk, D]`` one layer's KV planes (contiguous), written in place.

    Returns:
        ``[T, Hq, D]`` the rotated queries in ``qkv.dtype``.

    Raises:
        ValueError: KV planes that are not contiguous ``[slots, Hk, D]`` of one shape, or a ``qkv`` whose
            width is not ``(Hq + 2 Hk) · D`` or whose last dim is strided.
    """
    T = qkv.shape[0]
    Hk, D = k_cache.shape[1], k_cache.shape[2]
    Hq = qkv.shape[1] // D - 2 * Hk
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        raise ValueError(f"k_cache and v_cache must be contiguous [slots, Hk, D] planes of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if qkv.stride(-1) != 1 or Hq < 1 or qkv.shape[1] != (Hq + 2 * Hk) * D:
        raise ValueError(f"qkv must be [T, (Hq + 2 * {Hk}) * {D}] with its last dim contiguous, got "
                         f"{tuple(qkv.shape)} strides {qkv.stride()}")
    q = torch.empty((T, Hq, D), dtype=qkv.dtype, device=qkv.device)
    if T:
        _qk_norm_rope_kv_kernel[(T, Hq + 2 * Hk)](qkv, q_weight, k_weight, cos, sin, kv_slots, q, k_cache, v_cache,
                                                  Hq, Hk, qkv.stride(0), cos.stride(0), q.stride(0), k_cache.stride(0),
                                                  float(eps), D=D, HALF=cos.shape[-1] // 2,
                                                  BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return q


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, D, stride_x, stride_d, stride_s, stride_o, eps,
                         FLOAT32_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
    r = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual sum, rounded as torch's add rounds
    tl.store(sum_ptr + row * stride_s + cols, r, mask=mask)
    h = r.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FLOAT32_SCALE:
        y = h * w
    else:
        y = h.to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 float32_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one launch: ``r = x + delta``, ``(r, rms_norm(r))``.

    Args:
        x, delta: ``[T, D]`` in one 16-bit dtype (last dim contiguous).
        weight: ``[D]`` in ``x.dtype``; ``float32_scale`` as in :func:`rms_norm`.
        eps: added to the mean square.

    Returns:
        ``(r [T, D], normed [T, D])`` both in ``x.dtype``; ``r`` rounded once as ``x + delta`` rounds.
    """
    T, D = x.shape
    x, delta = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, delta))
    r = torch.empty_like(x)
    out = torch.empty_like(x)
    if T:
        _add_rms_norm_kernel[(T,)](x, delta, weight, r, out, D, x.stride(0), delta.stride(0), r.stride(0),
                                   out.stride(0), float(eps), FLOAT32_SCALE=float32_scale,
                                   BLOCK=triton.next_power_of_2(D), num_warps=4 if D <= 2048 else 8)
    return r, out
