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
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, ZERO_CENTERED: tl.constexpr,
                     FLOAT32_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
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
        x: ``[..., D]`` (last dim contiguous); normalized in float32.
        weight: ``[D]``; ``zero_centered``: the scale is ``1 + weight`` (Qwen3.5's norms);
            ``float32_scale``: the weight multiplies the float32 normalized value before the one rounding
            to ``x.dtype`` (gpt-oss's norms), instead of the value rounded to ``x.dtype``.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x.dtype``, or in the promoted dtype of ``weight`` and ``x`` for the plain norm
        (what ``weight * h.to(x.dtype)`` gives in torch).
    """
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    dtype = x.dtype if zero_centered or float32_scale else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, D, rows.stride(0), out.stride(0), float(eps),
                                           ZERO_CENTERED=zero_centered, FLOAT32_SCALE=float32_scale,
                                           BLOCK=triton.next_power_of_2(D),
                                           num_warps=4 if D <= 2048 else 8)
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
