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

from edgemoe.kernels.norm_rope import add_rms_norm, apply_rope, qk_norm_rope_kv_write, rms_norm
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_heads_split_from_a_fused_projection_in_place(dtype):
    """``[T, G, D]`` column views of a fused q/k/v output (row stride > G·D) normalize exactly as their
    contiguous copy."""
    g = torch.Generator().manual_seed(2)
    T, G, D = 3, 4, 32
    qkv = torch.randn(T, (G + 2) * D, generator=g).to(dtype)
    w = torch.randn(D, generator=g).to(dtype)
    for heads in (qkv[:, :G * D].view(T, G, D), qkv[:, G * D:(G + 1) * D].view(T, 1, D)):
        assert not heads.is_contiguous() and heads.stride(-1) == 1
        assert torch.equal(rms_norm(heads, w, 1e-6), rms_norm(heads.contiguous(), w, 1e-6))


def _tables(T, R, dtype, g):
    ang = torch.randn(T, R // 2, generator=g) * 3
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,D,R", [(1, 4, 2, 32, 32), (3, 6, 2, 64, 16), (2, 8, 1, 16, 16)])
def test_qk_norm_rope_kv_write_matches_norm_then_rope_then_the_kv_write(dtype, T, Hq, Hk, D, R):
    """One launch = ``q_norm``/``k_norm`` (the RMSNorm module), RoPE on the first ``R`` dims (the torch
    expression), and the new k/v written to their slots; every other KV slot untouched."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(dtype) * 2
    q_norm, k_norm = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(D, generator=g))
        k_norm.weight.copy_(torch.randn(D, generator=g))
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    cos, sin = _tables(T, R, dtype, g)
    slots = torch.randperm(4 * T + 3, generator=g)[:T]
    k_cache = torch.full((4 * T + 3, Hk, D), 7.0, dtype=dtype)
    v_cache = torch.full((4 * T + 3, Hk, D), 7.0, dtype=dtype)

    q = qk_norm_rope_kv_write(qkv, q_norm.weight, k_norm.weight, 1e-6, cos, sin, slots, k_cache, v_cache)

    q_ref = _rope_ref(q_norm(qkv[:, :Hq * D].reshape(T, Hq, D)), cos, sin)
    k_ref = _rope_ref(k_norm(qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D)), cos, sin)
    assert q.shape == (T, Hq, D) and q.dtype == dtype
    _close(q, q_ref)
    _close(k_cache[slots], k_ref)
    assert torch.equal(v_cache[slots], qkv[:, (Hq + Hk) * D:].reshape(T, Hk, D))
    rest = torch.ones(k_cache.shape[0], dtype=torch.bool)
    rest[slots] = False
    assert bool((k_cache[rest] == 7).all()) and bool((v_cache[rest] == 7).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("float32_scale", [False, True])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, float32_scale):
    g = torch.Generator().manual_seed(4)
    T, D = 3, 96
    x = torch.randn(T, D, generator=g).to(dtype)
    delta = torch.randn(T, D, generator=g).to(dtype)
    norm = RMSNorm(D, 1e-5, float32_scale=float32_scale)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=g))
    norm = norm.to(dtype)
    r, h = add_rms_norm(x, delta, norm.weight, 1e-5, float32_scale=float32_scale)
    assert torch.equal(r, x + delta)
    _close(h, norm(x + delta))
    r2, h2 = norm.add_forward(x, delta)  # off CUDA: the two torch ops
    assert torch.equal(r2, x + delta) and torch.equal(h2, norm(x + delta))


def test_qk_norm_rope_kv_write_refuses_strided_kv_planes_and_a_wrong_width():
    T, Hq, Hk, D = 1, 2, 1, 16
    qkv = torch.zeros(T, (Hq + 2 * Hk) * D)
    w, cs, slots = torch.ones(D), torch.ones(T, D), torch.zeros(T, dtype=torch.int64)
    planes = torch.zeros(2, 4, Hk, D)
    with pytest.raises(ValueError, match="contiguous"):
        qk_norm_rope_kv_write(qkv, w, w, 1e-6, cs, cs, slots, planes[:, 0], planes[:, 1])
    with pytest.raises(ValueError, match="qkv must be"):
        qk_norm_rope_kv_write(qkv[:, :-1], w, w, 1e-6, cs, cs, slots, planes[0], planes[1])
