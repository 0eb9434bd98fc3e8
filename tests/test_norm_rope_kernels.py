"""Fused RMSNorm / RoPE Triton kernels against the torch modules they replace on CUDA, to rounding:
the norm's float32 reduction order and ``rsqrt`` differ from torch's by an ulp, and the interpreter
rounds bfloat16 its own way (run in Triton's interpreter on the CPU; the CUDA parity tests cover the
compiled kernels through the models)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from edgemoe.kernels.norm_rope import apply_rope, rms_norm
from edgemoe.layers.norm import RMSNorm, ZeroCenteredRMSNorm

DTYPES = [torch.float32, torch.bfloat16]


def _close(a, b):
    tol = 1e-5 if a.dtype == torch.float32 else 2e-2  # a float32 ulp or so; two bfloat16 ulps
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 48), (1, 200)])
def test_rms_norm_matches_the_torch_modules(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    plain, zc = RMSNorm(shape[-1], 1e-6), ZeroCenteredRMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(shape[-1], generator=g))
        zc.weight.copy_(torch.randn(shape[-1], generator=g) * 0.1)
    plain, zc = plain.to(dtype), zc.to(dtype)
    _close(rms_norm(x, plain.weight, 1e-6), plain(x))
    _close(rms_norm(x, zc.weight, 1e-6, zero_centered=True), zc(x))


def _rope_ref(x, cos, sin):
    R = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    xr = x[..., :R]
    x1, x2 = xr.chunk(2, dim=-1)
    rot = xr * c + torch.cat((-x2, x1), dim=-1) * s
    return torch.cat((rot, x[..., R:]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D,R", [(4, 32, 32), (3, 64, 16), (20, 16, 16)])
def test_rope_matches_the_torch_expression(dtype, H, D, R):
    g = torch.Generator().manual_seed(1)
    T = 5
    x = torch.randn(T, H, D, generator=g).to(dtype)
    ang = torch.randn(T, R // 2, generator=g) * 3
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    _close(apply_rope(x, cos, sin), _rope_ref(x, cos, sin))
    strided = torch.randn(T, H, 2 * D, generator=g).to(dtype)[..., :D]  # last dim contiguous, rows strided
    _close(apply_rope(strided, cos, sin), _rope_ref(strided, cos, sin))
