"""The fused router top-k kernel (``edgemoe.kernels.router_topk``) in Triton's interpreter on the CPU,
against the torch ops of ``TopKRouter`` it replaces on CUDA.

Measured here: the ids are identical (logits without ties); bfloat16 weights are bitwise equal to the
torch ops' in every case below, float32 weights differ by up to 4 ulps (torch's CPU softmax multiplies
by a reciprocal and sums in another order; numpy's ``exp`` is not libdevice's), so the float32 checks
are to a tolerance. Against an emulation of the CUDA kernels' summation order with the interpreter's
``exp`` (numpy's), the float32 weights are bitwise equal: the kernel sums and divides in that order.
tests/gpu/test_router_topk_gpu.py compares the compiled kernel with torch's CUDA ops.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

pytest.importorskip("triton")

from router_reference import torch_route

from edgemoe.kernels.router_topk import topk_softmax


def cuda_order_route(logits, k, renorm):
    """The weights summed and divided in the order of PyTorch's CUDA kernels (the kernel's contract),
    ``exp`` from numpy as in the interpreter; ids by a stable sort (ties: lower index)."""
    x = logits.float()
    T, E = x.shape
    width = 1 << (E - 1).bit_length()
    W = min(width, 32)
    e = torch.from_numpy(np.exp((x - x.max(dim=-1, keepdim=True).values).numpy()))
    lanes = torch.zeros(T, width)
    lanes[:, :E] = e
    lanes = lanes.view(T, width // W, W)
    s = torch.zeros(T, W)
    for i in range(width // W):  # per lane, in element order
        s = s + lanes[:, i]
    while s.shape[1] > 1:  # XOR butterfly, offset W/2 first
        s = s[:, : s.shape[1] // 2] + s[:, s.shape[1] // 2:]
    ids = torch.sort(-x, dim=-1, stable=True).indices[:, :k]
    p = e.gather(1, ids) / s
    if renorm:
        P = 1 << (k.bit_length() - 1)
        r = p[:, :P].clone()
        r[:, : k - P] += p[:, P:]
        while r.shape[1] > 1:  # shuffle-down tree, adjacent pairs first
            r = r[:, 0::2] + r[:, 1::2]
        p = p / r
    return ids, p.to(logits.dtype)


def distinct_logits(T, E, dtype, g):
    """``[T, E]`` logits without ties, exact in bfloat16: a permutation of ``(j - E/2) / 16`` per row."""
    rows = [torch.randperm(E, generator=g) for _ in range(T)]
    return ((torch.stack(rows).float() - E // 2) / 16).to(dtype)


def ulps(a, b):
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return (a.view(view).long() - b.view(view).long()).abs()


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("E", [8, 128, 160, 256])
def test_topk_softmax_matches_the_torch_ops(E, k, renorm):
    g = torch.Generator().manual_seed(E * 10 + k)
    for dtype in (torch.bfloat16, torch.float32) if k == 8 else (torch.bfloat16,):  # float32: the orders at k = 8
        logits = distinct_logits(5, E, dtype, g)
        ids, w = topk_softmax(logits, k, renorm)
        ref_ids, ref_w = torch_route(logits, k, renorm)
        assert ids.dtype == torch.int64 and w.dtype == dtype and ids.shape == w.shape == (5, k)
        assert torch.equal(ids, ref_ids)
        if dtype == torch.bfloat16:
            assert torch.equal(w, ref_w)
        else:
            assert int(ulps(w, ref_w).max()) <= 4
            assert torch.equal(w, cuda_order_route(logits, k, renorm)[1])


@pytest.mark.parametrize("E,k,renorm", [(8, 2, False), (128, 8, True), (160, 8, True), (256, 8, False)])
def test_topk_softmax_pads_invalid_rows_like_row_zero(E, k, renorm):
    g = torch.Generator().manual_seed(E)
    logits = distinct_logits(5, E, torch.bfloat16, g)
    valid = torch.tensor([True, False, True, False, False])
    ids, w = topk_softmax(logits, k, renorm, valid)
    ref_ids, ref_w = torch_route(logits, k, renorm, valid)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
    assert torch.equal(ids[1], ids[0]) and not w[1].any()


def test_topk_softmax_single_token_and_a_full_captured_batch():
    g = torch.Generator().manual_seed(7)
    one = distinct_logits(1, 128, torch.bfloat16, g)
    for renorm in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(topk_softmax(one, 8, renorm), torch_route(one, 8, renorm)))
    batch = distinct_logits(64, 128, torch.bfloat16, g)
    valid = torch.arange(64) < 37
    got, ref = topk_softmax(batch, 2, True, valid), torch_route(batch, 2, True, valid)  # k = 2: interpreter time
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_topk_softmax_ties_go_to_the_lower_expert():
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 3, (6, 32), generator=g).to(torch.bfloat16)  # many ties
    ids, w = topk_softmax(logits, 8, True)
    ref_ids, ref_w = cuda_order_route(logits, 8, True)
    assert torch.equal(ids, ref_ids)
    assert int(ulps(w, ref_w).max()) <= 1
    with pytest.raises(ValueError):
        topk_softmax(logits, 33, True)
