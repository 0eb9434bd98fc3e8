"""Fused softmax router top-k for the GPU decode step: one launch instead of about ten.

``TopKRouter`` (reference: ``Qwen3MoeTopKRouter`` in ``transformers``) computes, per token,
``softmax(logits)`` in float32 over the E experts, the top-k, optionally renormalizes the k weights
(``norm_topk_prob``) and casts them back to the logits' dtype; in torch ops that is a cast, a softmax,
a two-kernel top-k (radix select and sort), a sum, a division and a cast, plus the captured batch's
padding (rows that route like row 0 with weight 0) as two more element-wise kernels.
:func:`topk_softmax` does all of it in one program per row.

Rounding. The selection compares the logits (order-preserving: ``exp`` and the division by a
positive sum are monotonic), ties going to the lower expert index, so the ids are the torch ids for
any logits without ties at the k-th place (where ``torch.topk`` promises no order). The weights are
computed where torch's CUDA kernels compute them, in the same order: ``exp(l - max)`` with
libdevice's ``expf`` (the ``std::exp`` of PyTorch's persistent warp softmax), the softmax sum as that
kernel sums (each of ``W = min(next_pow2(E), 32)`` lanes adds elements ``lane, lane + W, ...`` in
order, then an XOR butterfly from offset ``W/2`` down), an IEEE division; the renormalization sum as
PyTorch's reduction kernel sums ``k <= 32`` values (lane ``t < P = last_pow2(k)`` holds
``w[t] + w[t + P]``, then a shuffle-down tree from offset 1 up) and an IEEE division. Triton's
interpreter (CPU tensors) has no libdevice, so there ``exp`` is numpy's and the result is within a
float32 ulp or two of torch's CPU ops (which multiply by a reciprocal and sum in another order).
For float32 logits on CUDA the weights are within a few ulps of torch's (measured: up to 2), since the
emulated order is the one PyTorch uses before rounding to 16 bits; ``TopKRouter`` fuses 16-bit logits only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_EXPERTS = 1024  # PyTorch's persistent warp softmax covers E <= 1024 (float32); its order is the one emulated
MAX_TOP_K = 32


@triton.jit
def _topk_softmax_kernel(logits_ptr, valid_ptr, ids_ptr, w_ptr, E, stride_l, stride_i, stride_w,
                         K: tl.constexpr, RENORM: tl.constexpr, HAS_VALID: tl.constexpr,
                         PRECISE_EXP: tl.constexpr, WARP: tl.constexpr, ITER: tl.constexpr,
                         BLOCK_K: tl.constexpr, LANES_K: tl.constexpr):
    row = tl.program_id(0)
    src = row
    if HAS_VALID:  # a padding row routes as row 0 (weight 0 below)
        ok = tl.load(valid_ptr + row) != 0
        src = tl.where(ok, row, 0)
    it = tl.arange(0, ITER)[:, None]  # [ITER, 1]
    lane = tl.arange(0, WARP)[None, :]  # [1, WARP]
    cols = it * WARP + lane  # [ITER, WARP]: element it * WARP + lane, as the warp softmax holds them
    inside = cols < E
    logit = tl.load(logits_ptr + src * stride_l + cols, mask=inside, other=-float("inf")).to(tl.float32)
    mx = tl.max(tl.max(logit, axis=1), axis=0)

    # softmax denominator: per lane in element order from 0.0, then the XOR butterfly
    if PRECISE_EXP:
        e = libdevice.exp(logit - mx)
    else:
        e = tl.exp(logit - mx)
    s = tl.zeros((WARP,), dtype=tl.float32)
    for i in tl.static_range(ITER):
        s = s + tl.sum(tl.where(it == i, e, 0.0), axis=0)  # adds exactly one element per lane
    if WARP >= 32:
        s = tl.sum(tl.reshape(s, (2, 16)), axis=0)
    if WARP >= 16:
        s = tl.sum(tl.reshape(s, (2, 8)), axis=0)
    if WARP >= 8:
        s = tl.sum(tl.reshape(s, (2, 4)), axis=0)
    if WARP >= 4:
        s = tl.sum(tl.reshape(s, (2, 2)), axis=0)
    if WARP >= 2:
        s = tl.sum(tl.reshape(s, (2, 1)), axis=0)
    denom = tl.sum(s, axis=0)

    # top-k on the logits: the largest untaken value, the lowest index among equals
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    probs = tl.zeros((BLOCK_K,), dtype=tl.float32)
    taken = cols >= E
    for j in range(K):
        best = tl.max(tl.max(tl.where(taken, -float("inf"), logit), axis=1), axis=0)
        hit = (logit == best) & (~taken)
        idx = tl.min(tl.min(tl.where(hit, cols, 2 * ITER * WARP), axis=1), axis=0)
        taken = taken | (cols == idx)
        if PRECISE_EXP:
            pe = libdevice.exp(best - mx)
        else:
            pe = tl.exp(best - mx)
        ids = tl.where(kk == j, idx, ids)
        probs = tl.where(kk == j, tl.math.div_rn(pe, denom), probs)

    if RENORM:  # the reduction kernel's order: fold [P, 2P) onto [0, P), then adjacent pairs first
        r = probs
        if LANES_K != BLOCK_K:  # LANES_K = BLOCK_K / 2: lane t adds element t + LANES_K (0 past k)
            r = tl.sum(tl.reshape(r, (2, LANES_K)), axis=0)
        if LANES_K >= 32:
            r = tl.sum(tl.reshape(r, (16, 2)), axis=1)
        if LANES_K >= 16:
            r = tl.sum(tl.reshape(r, (8, 2)), axis=1)
        if LANES_K >= 8:
            r = tl.sum(tl.reshape(r, (4, 2)), axis=1)
        if LANES_K >= 4:
            r = tl.sum(tl.reshape(r, (2, 2)), axis=1)
        if LANES_K >= 2:
            r = tl.sum(tl.reshape(r, (1, 2)), axis=1)
        probs = tl.math.div_rn(probs, tl.sum(r, axis=0))

    w = probs.to(w_ptr.dtype.element_ty)
    if HAS_VALID:
        w = tl.where(ok, w, 0.0).to(w_ptr.dtype.element_ty)
    kmask = kk < K
    tl.store(ids_ptr + row * stride_i + kk, ids.to(tl.int64), mask=kmask)
    tl.store(w_ptr + row * stride_w + kk, w, mask=kmask)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of ``TopKRouter`` in one launch (rounding: see the module docstring).

    Args:
        logits: ``[T, E]`` router logits (float16, bfloat16 or float32; last dim contiguous),
            ``E <= MAX_EXPERTS``.
        top_k: experts per token, ``1 <= top_k <= min(E, MAX_TOP_K)``.
        renormalize: divide the k weights by their sum (``norm_topk_prob``).
        valid: optional ``[T]`` bool; a row where it is False gets row 0's ids and weight 0 (the padding
            rows of a captured decode batch).

    Returns:
        ``(ids [T, k] int64, weights [T, k] logits.dtype)``, experts by decreasing logit (ties: lower
        index first); weights are ``softmax(logits.float())`` at those experts, renormalized if asked,
        then cast to ``logits.dtype``.
    """
    T, E = logits.shape
    if not 1 <= top_k <= min(E, MAX_TOP_K) or E > MAX_EXPERTS:
        raise ValueError(f"topk_softmax covers E <= {MAX_EXPERTS} and 1 <= k <= min(E, {MAX_TOP_K}): "
                         f"got E={E}, k={top_k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((T, top_k), dtype=logits.dtype, device=logits.device)
    if T:
        width = triton.next_power_of_2(E)
        warp = min(width, 32)
        has_valid = valid is not None
        block_k = triton.next_power_of_2(top_k)
        _topk_softmax_kernel[(T,)](logits, valid if has_valid else ids, ids, weights, E, logits.stride(0),
                                   ids.stride(0), weights.stride(0), K=top_k, RENORM=bool(renormalize),
                                   HAS_VALID=has_valid, PRECISE_EXP=logits.is_cuda, WARP=warp,
                                   ITER=width // warp, BLOCK_K=block_k,
                                   LANES_K=block_k if block_k == top_k else block_k // 2, num_warps=1)
    return ids, weights
