"""Paged decode attention, split over the context (flash-decoding).

One new query token per sequence attends to keys ``[0, context_len)`` of its sequence, stored in the
paged KV layout of :class:`edgemoe.kvcache.pool.PagedKVPool` (token ``t`` of sequence ``b`` at flat
row ``block_tables[b, t // page_size]·page_size + t % page_size``).

- Launch 1, grid ``(B, Hk, max_partitions)``: a program takes the ``G = Hq / Hk`` query heads sharing
  one KV head (GQA: K/V read once for the group) and one partition of ``partition_size`` tokens; it
  streams the partition in blocks of ``BLOCK_N`` tokens with an online softmax (FlashAttention,
  Dao et al. 2022, §3.1) and writes its running max, sum and unnormalized output to the scratch.
  Programs past the context return at once, so ``max_partitions`` (from ``max_model_len``) is fixed
  and the launch is CUDA-graph capturable.
- Launch 2, grid ``(B, Hq)``: merges the partitions of each head (rescaled by ``exp(m_p − max m)``),
  as in flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023) and vLLM's
  PagedAttention v2 reduce step.

A sequence with ``context_len = 0`` (a padding row of a captured batch) gets zeros.

gpt-oss's variants (reference: transformers' ``GptOssAttention``): a sliding ``window`` restricts a
sequence to its last ``window`` keys (launch 1 skips the partitions and blocks before them, the merge
ignores their partitions), and per-head attention ``sinks`` add one logit to each head's softmax with a
zero value: the merge takes ``max(m, sink)`` as its reference and adds ``2^(sink·log2 e − max)`` to the
denominator.

:func:`paged_latent_decode_attention` is the multi-head latent attention twin (DeepSeek-V3's absorbed
decode, as SGLang's and vLLM's MLA decode kernels): every query head attends to one shared row per token
(``[c ‖ k_pe]``, width ``C + R``) and the value is the row's first ``C`` values; launch 1 takes a block of
query heads against one partition (the row tile read once for the block), launch 2 is the same merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DEFAULT_PARTITION = 256  # tokens per partition: 128 partitions × 4 KV heads at 32k context, batch 1
LATENT_PARTITION = 1024  # latent rows per partition: 32 partitions × 8 head blocks (128 heads) at 32k, batch 1
BLOCK_N = 64  # tokens per inner block
LATENT_BLOCK_N = 32  # latent rows per inner block (a [32, 512] tile; SGLang's MLA decode uses 32 too)
LATENT_BLOCK_H = 16  # query heads per latent program (the smallest tl.dot dimension)
_LOG2E = 1.4426950408889634


@dataclass
class DecodeAttentionScratch:
    """Partial results of launch 1, sized once for ``(max_batch, Hq, D, max_model_len)``.

    Attributes:
        m: ``[max_batch, Hq, max_partitions]`` float32, running max of ``score·log2(e)`` per partition.
        l: ``[max_batch, Hq, max_partitions]`` float32, sum of ``2^(score·log2 e − m)``.
        acc: ``[max_batch, Hq, max_partitions, D]`` float32, unnormalized output per partition.
        partition_size: tokens per partition (a power of two, multiple of ``BLOCK_N``).
    """

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    partition_size: int

    @property
    def max_partitions(self) -> int:
        return self.m.shape[2]


def make_decode_scratch(max_batch: int, num_q_heads: int, head_dim: int, max_model_len: int,
                        device: torch.device | str, partition_size: int = DEFAULT_PARTITION) -> DecodeAttentionScratch:
    """Scratch for :func:`paged_decode_attention` over contexts up to ``max_model_len`` tokens.

    Bytes: ``4·max_batch·Hq·ceil(max_model_len / partition_size)·(head_dim + 2)``.

    Raises:
        ValueError: ``partition_size`` not a power of two >= ``BLOCK_N``, or a non-positive size.
    """
    if partition_size < BLOCK_N or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= {BLOCK_N}, got {partition_size}")
    if min(max_batch, num_q_heads, head_dim, max_model_len) < 1:
        raise ValueError("max_batch, num_q_heads, head_dim and max_model_len must be positive")
    parts = math.ceil(max_model_len / partition_size)
    f32 = dict(dtype=torch.float32, device=device)
    return DecodeAttentionScratch(m=torch.empty(max_batch, num_q_heads, parts, **f32),
                                  l=torch.empty(max_batch, num_q_heads, parts, **f32),
                                  acc=torch.empty(max_batch, num_q_heads, parts, head_dim, **f32),
                                  partition_size=partition_size)


@triton.jit
def _window_start(ctx, window):
    """First key position a query at ``ctx - 1`` sees: ``ctx - window`` (at least 0), or 0 without a window."""
    return tl.where(window > 0, tl.maximum(ctx - window, 0), 0)


@triton.jit
def _partition_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, qk_scale, window,
                      stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                      stride_mb, stride_mh, stride_ab, stride_ah, stride_ap,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                      PART: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    lo = _window_start(ctx, window)
    start = part * PART
    if start < ctx and start + PART > lo:
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        head = kvh * G + g  # [BG] query heads of this KV head
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        end = tl.minimum(start + PART, ctx)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        first = tl.maximum(start, (lo // BLOCK_N) * BLOCK_N)  # blocks wholly before the window are skipped
        for n0 in range(first, end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)  # [BN] token positions
            tmask = (t < end) & (t >= lo)
            page = tl.load(bt_ptr + b * stride_bt + t // PAGE, mask=tmask, other=0)
            row = page.to(tl.int64) * PAGE + t % PAGE  # [BN] flat KV rows
            kt = tl.load(k_ptr + row[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=tmask[:, None],
                         other=0.0)
            s = tl.dot(q, tl.trans(kt), input_precision="ieee") * qk_scale  # [BG, BN] log2 units
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_ptr + row[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=tmask[:, None],
                         other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
            m_i = m_new
        mo = b * stride_mb + head * stride_mh + part
        tl.store(m_ptr + mo, m_i, mask=gmask)
        tl.store(l_ptr + mo, l_i, mask=gmask)
        ao = b.to(tl.int64) * stride_ab + head[:, None] * stride_ah + part * stride_ap + d[None, :]
        tl.store(acc_ptr + ao, acc, mask=gmask[:, None])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, ctx_ptr, out_ptr, sinks_ptr, window, stride_mb, stride_mh, stride_ab,
                  stride_ah, stride_ap, stride_ob, stride_oh, max_parts, D: tl.constexpr, PART: tl.constexpr,
                  BLOCK_PARTS: tl.constexpr, CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    n = tl.minimum(tl.cdiv(ctx, PART), max_parts)  # partitions written by launch 1
    p0 = _window_start(ctx, window) // PART  # partitions before the window's were not written
    pi = tl.arange(0, BLOCK_PARTS)
    pvalid = (pi < n) & (pi >= p0)
    mrow = m_ptr + b * stride_mb + h * stride_mh
    mv = tl.load(mrow + pi, mask=pvalid, other=float("-inf"))  # [BLOCK_PARTS]
    m_max = tl.where(n > 0, tl.max(mv), 0.0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # log2 units, like m
        m_max = tl.where(n > 0, tl.maximum(m_max, sink), 0.0)
    lv = tl.load(l_ptr + b * stride_mb + h * stride_mh + pi, mask=pvalid, other=0.0)
    total = tl.sum(tl.exp2(mv - m_max) * lv)
    if HAS_SINKS:
        total += tl.exp2(sink - m_max)  # the sink's column: its value is zero
    d = tl.arange(0, D)
    o = tl.zeros([D], tl.float32)
    arow = acc_ptr + b.to(tl.int64) * stride_ab + h * stride_ah
    for c0 in range(p0 // CHUNK * CHUNK, n, CHUNK):
        pc = c0 + tl.arange(0, CHUNK)
        pmask = (pc < n) & (pc >= p0)
        wc = tl.exp2(tl.load(mrow + pc, mask=pmask, other=float("-inf")) - m_max)  # [CHUNK]
        ac = tl.load(arow + pc[:, None] * stride_ap + d[None, :], mask=pmask[:, None], other=0.0)  # [CHUNK, D]
        o += tl.sum(wc[:, None] * ac, axis=0)
    o = tl.where(n > 0, o / tl.where(n > 0, total, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                           scratch: DecodeAttentionScratch, page_size: int, sinks: torch.Tensor | None = None,
                           window: int = 0) -> None:
    """``out[b, h] = softmax(scale · q[b, h] · K_bᵀ) · V_b`` over the first ``context_lens[b]`` tokens
    (the last ``window`` of them when ``window > 0``), with one more softmax column of logit ``sinks[h]``
    and value zero when ``sinks`` is given.

    Args:
        q: ``[B, Hq, D]`` one query token per sequence (bf16/fp16/fp32; last dim contiguous).
            ``D`` is a power of two >= 16 (64 and 128 in practice).
        k_cache, v_cache: ``[num_pages·page_size, Hk, D]`` one layer of the paged KV pool (last dim
            contiguous), same dtype as ``q``. ``Hq = G·Hk``; query head ``h`` reads KV head ``h // G``.
        block_tables: ``[B, max_pages]`` int32 page table per sequence (unused entries are never read).
        context_lens: ``[B]`` int32 tokens to attend (the new token included); 0 gives zeros.
        scale: softmax scale (e.g. ``D**-0.5``).
        out: ``[B, Hq, D]`` result (last dim contiguous), any float dtype.
        scratch: from :func:`make_decode_scratch` with ``max_batch >= B`` and the same ``Hq`` and
            ``D``; contexts beyond its ``max_partitions·partition_size`` tokens are not attended.
        page_size: tokens per KV page (a power of two).
        sinks: ``[Hq]`` attention-sink logits (any float dtype, contiguous; gpt-oss), or ``None``.
        window: sliding window in tokens, the new one included (gpt-oss's sliding layers: 128); 0 = none.

    Raises:
        ValueError: shape, dtype, layout or scratch mismatch.

    Scores and the softmax are float32; the probabilities are rounded to the KV dtype before the
    ``P·V`` product (FlashAttention's practice), so bf16 results differ from a float32 softmax by a
    few bf16 ulps.
    """
    B, Hq, D = q.shape
    Hk = k_cache.shape[1]
    if k_cache.dim() != 3 or tuple(v_cache.shape) != tuple(k_cache.shape) or k_cache.shape[2] != D:
        raise ValueError(f"k_cache/v_cache must be [rows, Hk, {D}], "
                         f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if Hq % Hk or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q [B, {Hq}, {D}] {q.dtype} does not match KV heads {Hk} {k_cache.dtype}")
    if D < 16 or D & (D - 1) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"head_dim ({D}) must be a power of two >= 16 and page_size ({page_size}) a power of two")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q, k_cache, v_cache and out need a contiguous last dimension")
    if tuple(out.shape) != (B, Hq, D):
        raise ValueError(f"out must be [{B}, {Hq}, {D}], got {tuple(out.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] < B \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be an int32 [>= {B}, max_pages] tensor with contiguous rows")
    if context_lens.dtype != torch.int32 or context_lens.numel() < B:
        raise ValueError(f"context_lens must be an int32 tensor of at least {B} entries")
    sm, sa = scratch.m, scratch.acc
    if sm.shape[0] < B or sm.shape[1] != Hq or sa.shape[3] != D:
        raise ValueError(f"scratch {tuple(sa.shape)} does not fit B={B}, Hq={Hq}, D={D}")
    if sinks is not None and (sinks.shape != (Hq,) or sinks.stride(0) != 1 or sinks.device != q.device):
        raise ValueError(f"sinks must be a contiguous [{Hq}] tensor on {q.device}, got {tuple(sinks.shape)}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = none), got {window}")
    G = Hq // Hk
    part = scratch.partition_size
    _partition_kernel[(B, Hk, scratch.max_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, sm, scratch.l, sa, float(scale) * _LOG2E, int(window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), sm.stride(0), sm.stride(1), sa.stride(0), sa.stride(1), sa.stride(2),
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, PAGE=page_size, PART=part, BLOCK_N=min(BLOCK_N, part),
        num_warps=4)
    _merge_kernel[(B, Hq)](
        sm, scratch.l, sa, context_lens, out, sm if sinks is None else sinks, int(window), sm.stride(0), sm.stride(1),
        sa.stride(0), sa.stride(1), sa.stride(2), out.stride(0), out.stride(1), scratch.max_partitions, D=D, PART=part,
        BLOCK_PARTS=triton.next_power_of_2(scratch.max_partitions), CHUNK=16, HAS_SINKS=sinks is not None,
        num_warps=4)


@triton.jit
def _latent_partition_kernel(q_ptr, kv_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, qk_scale, H,
                             stride_qb, stride_qh, stride_kt, stride_bt, stride_mb, stride_mh, stride_ab, stride_ah,
                             stride_ap, C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
                             PART: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = part * PART
    if start < ctx:
        head = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
        hmask = head < H
        c = tl.arange(0, C)
        r = tl.arange(0, R)
        qrow = q_ptr + b * stride_qb + head[:, None] * stride_qh
        q_c = tl.load(qrow + c[None, :], mask=hmask[:, None], other=0.0)  # [BH, C] absorbed nope part
        q_r = tl.load(qrow + C + r[None, :], mask=hmask[:, None], other=0.0)  # [BH, R] rotary part
        end = tl.minimum(start + PART, ctx)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, C], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)  # [BN] token positions
            tmask = t < end
            page = tl.load(bt_ptr + b * stride_bt + t // PAGE, mask=tmask, other=0)
            row = kv_ptr + (page.to(tl.int64) * PAGE + t % PAGE)[:, None] * stride_kt  # [BN, 1] latent rows
            kc = tl.load(row + c[None, :], mask=tmask[:, None], other=0.0)  # [BN, C]: key nope part and value
            kr = tl.load(row + C + r[None, :], mask=tmask[:, None], other=0.0)  # [BN, R]
            s = tl.dot(q_c, tl.trans(kc), input_precision="ieee")
            s = (s + tl.dot(q_r, tl.trans(kr), input_precision="ieee")) * qk_scale  # [BH, BN] log2 units
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc, input_precision="ieee")
            m_i = m_new
        mo = b * stride_mb + head * stride_mh + part
        tl.store(m_ptr + mo, m_i, mask=hmask)
        tl.store(l_ptr + mo, l_i, mask=hmask)
        ao = b.to(tl.int64) * stride_ab + head[:, None] * stride_ah + part * stride_ap + c[None, :]
        tl.store(acc_ptr + ao, acc, mask=hmask[:, None])


def paged_latent_decode_attention(q: torch.Tensor, latent: torch.Tensor, block_tables: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                                  scratch: DecodeAttentionScratch, page_size: int) -> None:
    """``out[b, h] = softmax(scale · q[b, h] · rowsᵀ) · rows[:, :C]`` over the first ``context_lens[b]``
    latent rows of sequence ``b`` (multi-head latent attention decode in the absorbed form).

    Args:
        q: ``[B, H, C + R]`` absorbed queries ``[q_lat ‖ q_pe]`` (bf16/fp16/fp32; last dim contiguous);
            ``C`` and ``R`` powers of two >= 16 (512 and 64 for DeepSeek-V3 and Kimi-K2).
        latent: ``[num_pages·page_size, C + R]`` one layer of the paged latent pool (rows contiguous),
            ``q``'s dtype.
        block_tables: ``[B, max_pages]`` int32 page table per sequence (unused entries are never read).
        context_lens: ``[B]`` int32 rows to attend (the new token's included); 0 gives zeros.
        scale: softmax scale.
        out: ``[B, H, C]`` result (last dim contiguous), any float dtype.
        scratch: from :func:`make_decode_scratch` with ``max_batch >= B``, ``H`` heads and ``head_dim = C``
            (partitions of :data:`LATENT_PARTITION` rows); rows beyond ``max_partitions·partition_size``
            are not attended.
        page_size: tokens per KV page (a power of two).

    Raises:
        ValueError: shape, dtype, layout or scratch mismatch.

    Numerics as :func:`paged_decode_attention`: float32 scores and softmax, probabilities rounded to the
    pool's dtype before the ``P·V`` product.
    """
    B, H, W = q.shape
    C = out.shape[2] if out.dim() == 3 else -1
    R = W - C
    if latent.dim() != 2 or latent.shape[1] != W or latent.dtype != q.dtype or latent.stride(1) != 1:
        raise ValueError(f"latent must be a [rows, {W}] {q.dtype} tensor with contiguous rows, got "
                         f"{latent.dtype} {tuple(latent.shape)}")
    for name, d in (("C", C), ("R", R)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"latent widths C={C} (value) and R={R} (rotary) must be powers of two >= 16 ({name})")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size ({page_size}) must be a power of two")
    if q.stride(2) != 1 or out.stride(2) != 1 or tuple(out.shape) != (B, H, C):
        raise ValueError(f"q [B, H, C + R] and out [{B}, {H}, C] need a contiguous last dimension, got "
                         f"{tuple(q.shape)} / {tuple(out.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] < B \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be an int32 [>= {B}, max_pages] tensor with contiguous rows")
    if context_lens.dtype != torch.int32 or context_lens.numel() < B:
        raise ValueError(f"context_lens must be an int32 tensor of at least {B} entries")
    sm, sa = scratch.m, scratch.acc
    if sm.shape[0] < B or sm.shape[1] != H or sa.shape[3] != C:
        raise ValueError(f"scratch {tuple(sa.shape)} does not fit B={B}, H={H}, C={C}")
    part = scratch.partition_size
    _latent_partition_kernel[(B, triton.cdiv(H, LATENT_BLOCK_H), scratch.max_partitions)](
        q, latent, block_tables, context_lens, sm, scratch.l, sa, float(scale) * _LOG2E, H,
        q.stride(0), q.stride(1), latent.stride(0), block_tables.stride(0), sm.stride(0), sm.stride(1), sa.stride(0),
        sa.stride(1), sa.stride(2), C=C, R=R, BLOCK_H=LATENT_BLOCK_H, PAGE=page_size, PART=part,
        BLOCK_N=min(LATENT_BLOCK_N, part), num_warps=4, num_stages=2)
    _merge_kernel[(B, H)](
        sm, scratch.l, sa, context_lens, out, sm, 0, sm.stride(0), sm.stride(1), sa.stride(0), sa.stride(1),
        sa.stride(2), out.stride(0), out.stride(1), scratch.max_partitions, D=C, PART=part,
        BLOCK_PARTS=triton.next_power_of_2(scratch.max_partitions), CHUNK=16, HAS_SINKS=False, num_warps=4)
