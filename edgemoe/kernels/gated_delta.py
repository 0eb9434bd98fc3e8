"""Triton kernels for the gated delta rule: the linear-attention layers of ``qwen3_5_moe`` on the GPU.

The gated delta rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh 2024, arXiv 2412.06464) keeps, per
sequence and value head, a recurrent state ``S [Dk, Dv]`` updated once per token ``t``::

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - k_t^T exp(g_t) S_{t-1})^T      o_t = S_t^T (q_t / sqrt(Dk))

with ``g_t <= 0`` the log decay and ``beta_t`` in (0, 1) the write strength. Two entry points mirror
transformers' reference functions (``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule`` in ``transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py``),
which the tests use as the oracle:

- ``chunk_gated_delta_rule`` (prefill): the chunked WY form of section 3 of the paper, chunks of 64
  tokens, five kernels: (1) per chunk, ``A_ij = beta_i k_i.k_j exp(gc_i - gc_j)`` for ``i > j`` (``gc``
  the in-chunk cumulative log decay); (2) ``T = (I + A)^-1`` by block forward substitution (16x16
  diagonal blocks by row substitution, then the off-diagonal blocks); (3) ``w = T (beta exp(gc) k)``,
  ``u = T (beta v)``; (4) per value-column block, a sequential scan over the chunks carries the float32
  state, writing each chunk's entry state and ``v_new = u - w S``; (5) per chunk, in parallel,
  ``o = (q exp(gc)) S + (q k^T exp(gc_i - gc_j), i >= j) v_new``. This is the structure of
  flash-linear-attention's chunked gated delta rule; the code here is our own.
- ``fused_recurrent_gated_delta_rule`` (decode): one kernel, the token recurrence with the state held in
  registers, updated in place (no host sync, fixed shapes: CUDA-graph capturable).

``causal_conv1d_update`` fuses the decode step of the layer's depthwise causal convolution (state shift,
convolution, SiLU).

Head contract (as in the reference): ``query``/``key`` have ``Hk`` heads, ``value``/``g``/``beta`` and the
state have ``Hv`` heads, ``Hv % Hk == 0``; value head ``h`` reads key head ``h // (Hv // Hk)`` (the
reference's ``repeat_interleave``), so callers pass q/k un-repeated (already repeated q/k, ``Hk == Hv``,
also work). Inputs may be strided views (e.g. splits of the fused qkv projection); the state is float32
``[B, Hv, Dk, Dv]``; all accumulation is float32. Matrix products take operands in the input dtype
(bf16/fp16 tensor cores; fp32 inputs use 3-pass tf32, about fp32 accuracy), as flash-linear-attention
does; the 16x16 triangular blocks are always inverted in exact float32.

Tensors must be on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1`` set before ``triton`` is
imported (the tests' mode). The first call per dtype, head size and flags compiles: make it before
capturing a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk of the prefill kernels (four 16-row sub-blocks)
MAX_HEAD_DIM = 256  # largest Dk and Dv the kernels take (register tiles of up to 256 x 256 per program)

_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of the kernels' matrix products (and of the prefill scratch tensors).

    The Triton 3.6 interpreter multiplies bfloat16 tiles as their raw uint16 bits, so under the
    interpreter bfloat16 inputs use float32 products."""
    return torch.float32 if dtype == torch.bfloat16 and _interpreting() else dtype


def _block(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not _interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got {dev}")


def _check_qkv(query, key, value, g, beta) -> tuple[int, int, int, int, int, int]:
    if query.dim() != 4 or key.shape != query.shape or value.dim() != 4:
        raise ValueError(f"query/key must be [B, T, Hk, Dk] and value [B, T, Hv, Dv], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    B, T, HK, DK = key.shape
    HV, DV = value.shape[-2:]
    if value.shape[:2] != (B, T) or HV % HK != 0:
        raise ValueError(f"value {tuple(value.shape)} does not match key {tuple(key.shape)} (Hv % Hk must be 0)")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B, T, Hv] = {(B, T, HV)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if query.dtype not in _TL_DTYPE:
        raise ValueError(f"unsupported dtype {query.dtype}: expected float32, float16 or bfloat16")
    if max(DK, DV) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported, got Dk={DK}, Dv={DV}")
    _check_device(query, key, value, g, beta)
    return B, T, HK, DK, HV, DV


def _check_state(state: torch.Tensor, rows: int | None, HV: int, DK: int, DV: int) -> None:
    if state.dim() != 4 or state.shape[1:] != (HV, DK, DV) or (rows is not None and state.shape[0] != rows):
        raise ValueError(f"initial_state must be [{rows if rows is not None else 'N'}, {HV}, {DK}, {DV}], "
                         f"got {tuple(state.shape)}")


# ------------------------------------------------------------------------------------------ shared pieces


@triton.jit
def _load_rows(base, stride_t, stride_d, t0, T, D, ROWS: tl.constexpr, BD: tl.constexpr, L2NORM: tl.constexpr):
    """Rows ``t0 .. t0+ROWS`` of a ``[T, D]`` view as float32 ``[ROWS, BD]`` (zero past T and D),
    optionally L2-normalized as transformers' ``l2norm`` (``x * rsqrt(sum x^2 + 1e-6)``)."""
    rows = t0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < T) & (cols[None, :] < D)
    x = tl.load(base + rows[:, None] * stride_t + cols[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _load_vec(base, stride_t, t0, T, ROWS: tl.constexpr):
    """Entries ``t0 .. t0+ROWS`` of a length-T strided vector as float32 (zero past T)."""
    rows = t0 + tl.arange(0, ROWS)
    return tl.load(base + rows * stride_t, mask=rows < T, other=0.0).to(tl.float32)


# -------------------------------------------------------- prefill kernels 1-2: the in-chunk triangular inverse


@triton.jit
def _chunk_kkt_kernel(k_ptr, g_ptr, beta_ptr, a_ptr,
                      skb, skt, skh, skd, sgb, sgt, sgh, sbb, sbt, sbh,
                      T, H, GROUP, DK,
                      BK: tl.constexpr, L2NORM: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr):
    """Grid ``(chunks, B*Hv)``: ``A_ij = beta_i k_i.k_j exp(gc_i - gc_j)`` for ``i > j`` (else 0) of one
    chunk, float32, into ``a [B*Hv, T, 64]``."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hv = bh % H
    t0 = c * 64
    rows = tl.arange(0, 64)
    k = _load_rows(k_ptr + b * skb + (hv // GROUP) * skh, skt, skd, t0, T, DK, 64, BK, L2NORM)  # [64, BK]
    gc = tl.cumsum(_load_vec(g_ptr + b * sgb + hv * sgh, sgt, t0, T, 64), axis=0)  # [64]
    beta = _load_vec(beta_ptr + b * sbb + hv * sbh, sbt, t0, T, 64)  # [64]
    a = tl.dot((k * beta[:, None]).to(DOT_DT), tl.trans(k.to(DOT_DT)), input_precision=PREC)  # [64, 64]
    a = a * tl.exp(tl.where(rows[:, None] > rows[None, :], gc[:, None] - gc[None, :], float("-inf")))
    tl.store(a_ptr + (bh.to(tl.int64) * T + t0 + rows[:, None]) * 64 + rows[None, :], a,
             mask=(t0 + rows[:, None]) < T)


@triton.jit
def _inv_unit_lower16(a):
    """``(I + a)^-1`` for a strictly lower-triangular float32 ``[16, 16]`` tile, by row substitution:
    ``T[i] = e_i - sum_{j<i} a[i, j] T[j]``."""
    r = tl.arange(0, 16)
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)  # [16, 16]
    for i in range(1, 16):
        a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)  # [16] row i of a
        row = tl.where(r == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t, axis=0)  # [16]
        t = tl.where(r[:, None] == i, row[None, :], t)
    return t


@triton.jit
def _block_ptrs(base, t0, i: tl.constexpr, j: tl.constexpr, T):
    """Pointers and row mask of block ``(i, j)`` (16x16) of a chunk's matrix, rows ``t0+16i..`` of
    ``base [T, 64]``."""
    r = tl.arange(0, 16)
    rows = t0 + 16 * i + r
    return base + rows[:, None] * 64 + 16 * j + r[None, :], rows[:, None] < T


@triton.jit
def _load_block(base, t0, i: tl.constexpr, j: tl.constexpr, T):
    ptrs, mask = _block_ptrs(base, t0, i, j, T)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_block(base, blk, t0, i: tl.constexpr, j: tl.constexpr, T):
    ptrs, mask = _block_ptrs(base, t0, i, j, T)
    tl.store(ptrs, blk.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_inverse_kernel(a_ptr, tm_ptr, T):
    """Grid ``(chunks, B*Hv)``: ``T = (I + A)^-1`` of one chunk, the lower 16x16 blocks of
    ``tm [B*Hv, T, 64]`` from ``a [B*Hv, T, 64]``. Diagonal blocks by row substitution, then block
    forward substitution ``T_ij = -T_ii sum_{j<=m<i} A_im T_mj`` (float32 products)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    t0 = c * 64
    a_base = a_ptr + bh * T * 64
    tm_base = tm_ptr + bh * T * 64
    t00 = _inv_unit_lower16(_load_block(a_base, t0, 0, 0, T))
    t11 = _inv_unit_lower16(_load_block(a_base, t0, 1, 1, T))
    t22 = _inv_unit_lower16(_load_block(a_base, t0, 2, 2, T))
    t33 = _inv_unit_lower16(_load_block(a_base, t0, 3, 3, T))
    a10 = _load_block(a_base, t0, 1, 0, T)
    a20 = _load_block(a_base, t0, 2, 0, T)
    a21 = _load_block(a_base, t0, 2, 1, T)
    a30 = _load_block(a_base, t0, 3, 0, T)
    a31 = _load_block(a_base, t0, 3, 1, T)
    a32 = _load_block(a_base, t0, 3, 2, T)
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision="ieee"), input_precision="ieee")
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision="ieee"), input_precision="ieee")
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee"),
                  input_precision="ieee")
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision="ieee"), input_precision="ieee")
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee"),
                  input_precision="ieee")
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision="ieee") + tl.dot(a31, t10, input_precision="ieee")
                  + tl.dot(a32, t20, input_precision="ieee"), input_precision="ieee")
    _store_block(tm_base, t00, t0, 0, 0, T)
    _store_block(tm_base, t10, t0, 1, 0, T)
    _store_block(tm_base, t11, t0, 1, 1, T)
    _store_block(tm_base, t20, t0, 2, 0, T)
    _store_block(tm_base, t21, t0, 2, 1, T)
    _store_block(tm_base, t22, t0, 2, 2, T)
    _store_block(tm_base, t30, t0, 3, 0, T)
    _store_block(tm_base, t31, t0, 3, 1, T)
    _store_block(tm_base, t32, t0, 3, 2, T)
    _store_block(tm_base, t33, t0, 3, 3, T)


# ------------------------------------------------------------------------------ prefill kernel 3: w and u


@triton.jit
def _chunk_wu_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, tm_ptr, w_ptr, u_ptr,
                     skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sbb, sbt, sbh,
                     T, H, GROUP, DK, DV,
                     BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                     DOT_DT: tl.constexpr, PREC: tl.constexpr):
    """Grid ``(chunks, B*Hv)``: ``w = T (beta exp(gc) k)`` ``[B*Hv, T, Dk]`` and ``u = T (beta v)``
    ``[B*Hv, T, Dv]`` of one chunk."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hv = bh % H
    bh64 = bh.to(tl.int64)
    t0 = c * 64
    rows = tl.arange(0, 64)
    row_ok = (t0 + rows) < T
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)

    tm = tl.load(tm_ptr + (bh64 * T + t0 + rows[:, None]) * 64 + rows[None, :],
                 mask=row_ok[:, None] & (rows[None, :] <= rows[:, None]), other=0.0)  # [64, 64]
    gc = tl.cumsum(_load_vec(g_ptr + b * sgb + hv * sgh, sgt, t0, T, 64), axis=0)  # [64]
    beta = _load_vec(beta_ptr + b * sbb + hv * sbh, sbt, t0, T, 64)  # [64]
    k = _load_rows(k_ptr + b * skb + (hv // GROUP) * skh, skt, skd, t0, T, DK, 64, BK, L2NORM)  # [64, BK]
    w = tl.dot(tm.to(DOT_DT), (k * (beta * tl.exp(gc))[:, None]).to(DOT_DT), input_precision=PREC)  # [64, BK]
    tl.store(w_ptr + (bh64 * T + t0 + rows[:, None]) * DK + ck[None, :], w.to(w_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (ck[None, :] < DK))
    v = _load_rows(v_ptr + b * svb + hv * svh, svt, svd, t0, T, DV, 64, BV, False)  # [64, BV]
    u = tl.dot(tm.to(DOT_DT), (v * beta[:, None]).to(DOT_DT), input_precision=PREC)  # [64, BV]
    tl.store(u_ptr + (bh64 * T + t0 + rows[:, None]) * DV + cv[None, :], u.to(u_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cv[None, :] < DV))


# ------------------------------------------------------------------- prefill kernel 4: the scan over chunks


@triton.jit
def _chunk_state_kernel(k_ptr, g_ptr, w_ptr, u_ptr, h0_ptr, hc_ptr, vnew_ptr, ht_ptr,
                        skb, skt, skh, skd, sgb, sgt, sgh,
                        T, NT, H, GROUP, DK, DV,
                        BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, HAS_H0: tl.constexpr,
                        STORE_HT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr):
    """Grid ``(Dv blocks, B*Hv)``: carries the float32 state ``[Dk, BV]`` over the chunks, storing each
    chunk's entry state ``hc [B*Hv, NT, Dk, Dv]``, ``v_new = u - w S`` ``[B*Hv, T, Dv]`` and the final
    state ``ht [B*Hv, Dk, Dv]``."""
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hv = bh % H
    bh64 = bh.to(tl.int64)
    k_base = k_ptr + b * skb + (hv // GROUP) * skh
    g_base = g_ptr + b * sgb + hv * sgh
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, 64)
    state_off = ck[:, None] * DV + cv[None, :]  # [BK, BV]
    state_mask = (ck[:, None] < DK) & (cv[None, :] < DV)

    if HAS_H0:
        s = tl.load(h0_ptr + bh64 * DK * DV + state_off, mask=state_mask, other=0.0)  # [BK, BV] fp32
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(NT):
        t0 = c * 64
        tl.store(hc_ptr + (bh64 * NT + c) * DK * DV + state_off, s.to(hc_ptr.dtype.element_ty), mask=state_mask)
        row_ok = (t0 + rows) < T  # [64]
        w = tl.load(w_ptr + (bh64 * T + t0 + rows[:, None]) * DK + ck[None, :],
                    mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)  # [64, BK]
        u = tl.load(u_ptr + (bh64 * T + t0 + rows[:, None]) * DV + cv[None, :],
                    mask=row_ok[:, None] & (cv[None, :] < DV), other=0.0).to(tl.float32)  # [64, BV]
        v_new = u - tl.dot(w.to(DOT_DT), s.to(DOT_DT), input_precision=PREC)  # [64, BV]
        tl.store(vnew_ptr + (bh64 * T + t0 + rows[:, None]) * DV + cv[None, :], v_new.to(vnew_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cv[None, :] < DV))
        g = _load_vec(g_base, sgt, t0, T, 64)  # [64], zero past T
        gc = tl.cumsum(g, axis=0)
        g_last = tl.sum(g, axis=0)  # = gc at the chunk's last valid token
        k = _load_rows(k_base, skt, skd, t0, T, DK, 64, BK, L2NORM)  # [64, BK]
        k = k * tl.exp(g_last - gc)[:, None]
        s = s * tl.exp(g_last) + tl.dot(tl.trans(k.to(DOT_DT)), v_new.to(DOT_DT), input_precision=PREC)
    if STORE_HT:
        tl.store(ht_ptr + bh64 * DK * DV + state_off, s, mask=state_mask)


# ------------------------------------------------------------------------- prefill kernel 5: the outputs


@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, g_ptr, hc_ptr, vnew_ptr, o_ptr,
                         sqb, sqt, sqh, sqd, skb, skt, skh, skd, sgb, sgt, sgh, sob, sot, soh,
                         T, NT, H, GROUP, DK, DV, scale,
                         BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                         DOT_DT: tl.constexpr, PREC: tl.constexpr):
    """Grid ``(Dv blocks, chunks, B*Hv)``: ``o = (q exp(gc)) S_c + (q k^T exp(gc_i - gc_j), i >= j) v_new``."""
    vb = tl.program_id(0)
    c = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    hv = bh % H
    bh64 = bh.to(tl.int64)
    t0 = c * 64
    hk = hv // GROUP
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, 64)
    row_ok = (t0 + rows) < T

    q = _load_rows(q_ptr + b * sqb + hk * sqh, sqt, sqd, t0, T, DK, 64, BK, L2NORM) * scale  # [64, BK]
    k = _load_rows(k_ptr + b * skb + hk * skh, skt, skd, t0, T, DK, 64, BK, L2NORM)  # [64, BK]
    gc = tl.cumsum(_load_vec(g_ptr + b * sgb + hv * sgh, sgt, t0, T, 64), axis=0)  # [64]
    s = tl.load(hc_ptr + (bh64 * NT + c) * DK * DV + ck[:, None] * DV + cv[None, :],
                mask=(ck[:, None] < DK) & (cv[None, :] < DV), other=0.0)  # [BK, BV]
    v_new = tl.load(vnew_ptr + (bh64 * T + t0 + rows[:, None]) * DV + cv[None, :],
                    mask=row_ok[:, None] & (cv[None, :] < DV), other=0.0)  # [64, BV]
    o = tl.dot((q * tl.exp(gc)[:, None]).to(DOT_DT), s.to(DOT_DT), input_precision=PREC)  # [64, BV]
    a = tl.dot(q.to(DOT_DT), tl.trans(k.to(DOT_DT)), input_precision=PREC)  # [64, 64]
    a = a * tl.exp(tl.where(rows[:, None] >= rows[None, :], gc[:, None] - gc[None, :], float("-inf")))
    o += tl.dot(a.to(DOT_DT), v_new.to(DOT_DT), input_precision=PREC)
    tl.store(o_ptr + b * sob + (t0 + rows[:, None]) * sot + hv * soh + cv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cv[None, :] < DV))


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over a whole sequence (prefill), chunked by 64 tokens; any ``T >= 1``.

    Args:
        query, key: ``[B, T, Hk, Dk]`` float32/float16/bfloat16 (strided views allowed).
        value: ``[B, T, Hv, Dv]``, ``Hv % Hk == 0``; value head ``h`` uses key head ``h // (Hv // Hk)``.
        g: ``[B, T, Hv]`` log decay (``<= 0``), any float dtype. beta: ``[B, T, Hv]`` write strength.
        initial_state: ``[B, Hv, Dk, Dv]`` state before the first token (any float dtype, read as
            float32; not modified), or None for zeros.
        output_final_state: return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head (in float32, eps 1e-6) first.

    Returns:
        ``(out, final_state)``: ``out [B, T, Hv, Dv]`` in ``query.dtype``; ``final_state`` a new float32
        ``[B, Hv, Dk, Dv]`` tensor, or None. Queries are scaled by ``Dk ** -0.5`` as in the reference.

    Raises:
        ValueError: on inconsistent shapes, head dims over 256, a query dtype other than float32,
            float16 or bfloat16, mixed devices, or CPU tensors without ``TRITON_INTERPRET=1``.

    Source: Yang et al. 2024 (arXiv 2412.06464) section 3 (chunkwise WY form); oracle: transformers'
    ``torch_chunk_gated_delta_rule``. Scratch memory per value head: ``A`` (float32) and ``T`` (``T x 64``),
    ``w``, ``u``, ``v_new`` (``T x D``) and the chunk entry states (``T/64 x Dk x Dv``), all but ``A`` in
    the input dtype.
    """
    B, T, HK, DK, HV, DV = _check_qkv(query, key, value, g, beta)
    if initial_state is not None:
        _check_state(initial_state, B, HV, DK, DV)
        _check_device(query, initial_state)
        initial_state = initial_state.to(torch.float32).contiguous()
    dev = query.device
    dot_dt = _dot_dtype(query.dtype)
    tl_dt = _TL_DTYPE[dot_dt]
    prec = "tf32x3" if dot_dt == torch.float32 else "tf32"  # fp32: three tf32 products; ignored for 16-bit
    NT = triton.cdiv(T, CHUNK)
    BK, BVF = _block(DK), _block(DV)
    group = HV // HK

    a = torch.empty(B * HV, T, CHUNK, dtype=torch.float32, device=dev)
    tm = torch.empty(B * HV, T, CHUNK, dtype=dot_dt, device=dev)
    w = torch.empty(B * HV, T, DK, dtype=dot_dt, device=dev)
    u = torch.empty(B * HV, T, DV, dtype=dot_dt, device=dev)
    v_new = torch.empty(B * HV, T, DV, dtype=dot_dt, device=dev)
    hc = torch.empty(B * HV, NT, DK, DV, dtype=dot_dt, device=dev)
    out = torch.empty(B, T, HV, DV, dtype=query.dtype, device=dev)
    final = torch.empty(B, HV, DK, DV, dtype=torch.float32, device=dev) if output_final_state else None

    _chunk_kkt_kernel[(NT, B * HV)](
        key, g, beta, a, *key.stride(), *g.stride(), *beta.stride(), T, HV, group, DK,
        BK=BK, L2NORM=use_qk_l2norm_in_kernel, DOT_DT=tl_dt, PREC=prec, num_warps=4,
    )
    _chunk_inverse_kernel[(NT, B * HV)](a, tm, T, num_warps=4)
    _chunk_wu_kernel[(NT, B * HV)](
        key, value, g, beta, tm, w, u, *key.stride(), *value.stride(), *g.stride(), *beta.stride(),
        T, HV, group, DK, DV, BK=BK, BV=BVF, L2NORM=use_qk_l2norm_in_kernel, DOT_DT=tl_dt, PREC=prec,
        num_warps=8,
    )
    bv_scan = min(32, BVF)
    # The scan's state tile has at least 64 rows (zero-padded past Dk). Its update k^T v_new is a
    # [BK, 64] x [64, BV] product; with BK < 64 (Dk <= 32) Triton 3.6 compiles it for sm_90 to mma.sync on a
    # tile replicated across the 8 warps, stored to shared memory as the next chunk's wgmma operand. That is
    # the structural difference from Dk = 128 (correct on an H200) of the Dk = 16 case, whose model outputs
    # went wrong there while the interpreter matches torch. Padded, every product of the scan is a wgmma.
    bk_scan = max(64, BK)
    _chunk_state_kernel[(triton.cdiv(DV, bv_scan), B * HV)](
        key, g, w, u, initial_state, hc, v_new, final, *key.stride(), *g.stride(),
        T, NT, HV, group, DK, DV, BK=bk_scan, BV=bv_scan, L2NORM=use_qk_l2norm_in_kernel,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, DOT_DT=tl_dt, PREC=prec, num_warps=8,
    )
    bv_out = min(64, BVF)
    _chunk_output_kernel[(triton.cdiv(DV, bv_out), NT, B * HV)](
        query, key, g, hc, v_new, out, *query.stride(), *key.stride(), *g.stride(), *out.stride()[:3],
        T, NT, HV, group, DK, DV, DK**-0.5, BK=BK, BV=bv_out, L2NORM=use_qk_l2norm_in_kernel,
        DOT_DT=tl_dt, PREC=prec, num_warps=8,
    )
    return out, final


# ----------------------------------------------------------------------------------- decode: recurrence


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, ht_ptr, o_ptr, idx_ptr,
                      sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sbb, sbt, sbh,
                      sob, sot, soh,
                      T, H, GROUP, DK, DV, scale,
                      BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, HAS_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, HAS_IDX: tl.constexpr):
    """Grid ``(Dv blocks, B*Hv)``: the token recurrence with the float32 state ``[Dk, BV]`` in registers."""
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hv = bh % H
    hk = hv // GROUP
    if HAS_IDX:
        row = tl.load(idx_ptr + b).to(tl.int64)
    else:
        row = b
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    k_ok = ck < DK
    v_ok = cv < DV
    state_ptrs = (row * H + hv) * DK * DV + ck[:, None] * DV + cv[None, :]  # [BK, BV]
    state_mask = k_ok[:, None] & v_ok[None, :]
    q_base = q_ptr + b * sqb + hk * sqh
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hv * svh
    g_base = g_ptr + b * sgb + hv * sgh
    beta_base = beta_ptr + b * sbb + hv * sbh
    o_base = o_ptr + b * sob + hv * soh

    if HAS_H0:
        s = tl.load(h0_ptr + state_ptrs, mask=state_mask, other=0.0).to(tl.float32)  # [BK, BV]
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(T):
        q = tl.load(q_base + t * sqt + ck * sqd, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        k = tl.load(k_base + t * skt + ck * skd, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        v = tl.load(v_base + t * svt + cv * svd, mask=v_ok, other=0.0).to(tl.float32)  # [BV]
        g_t = tl.load(g_base + t * sgt).to(tl.float32)
        beta_t = tl.load(beta_base + t * sbt).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        s = s * tl.exp(g_t)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta_t  # [BV]
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * (q * scale)[:, None], axis=0)  # [BV]
        tl.store(o_base + t * sot + cv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    if STORE_HT:
        tl.store(ht_ptr + state_ptrs, s, mask=state_mask)


def fused_recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule token by token (decode: ``T = 1``; correct for any small ``T``), state in place.

    Args:
        query, key: ``[B, T, Hk, Dk]``; value ``[B, T, Hv, Dv]``; g, beta ``[B, T, Hv]`` (as in
            ``chunk_gated_delta_rule``).
        initial_state: contiguous float32 ``[B, Hv, Dk, Dv]`` (or a state pool ``[N, Hv, Dk, Dv]`` with
            ``state_indices``), or None for zeros. With ``output_final_state`` it is **updated in place**
            to the state after the last token.
        output_final_state: write (and return) the final state; False leaves ``initial_state`` untouched.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head (float32, eps 1e-6).
        state_indices: optional int ``[B]`` (on the tensors' device): sequence ``b`` reads and updates
            ``initial_state[state_indices[b]]``; indices must be distinct.

    Returns:
        ``(out, final_state)``: ``out [B, T, Hv, Dv]`` in ``query.dtype``; ``final_state`` is
        ``initial_state`` itself (updated), a new float32 ``[B, Hv, Dk, Dv]`` when ``initial_state`` is
        None, or None when ``output_final_state`` is False.

    Raises:
        ValueError: on inconsistent shapes, a state that is not contiguous float32, ``state_indices``
            without ``initial_state``, unsupported dtypes, mixed devices, or CPU tensors without
            ``TRITON_INTERPRET=1``.

    No host synchronization and no data-dependent shapes: CUDA-graph capturable once compiled (call it
    once before capture). Oracle: transformers' ``torch_recurrent_gated_delta_rule``.
    """
    B, T, HK, DK, HV, DV = _check_qkv(query, key, value, g, beta)
    dev = query.device
    if initial_state is not None:
        _check_state(initial_state, None if state_indices is not None else B, HV, DK, DV)
        _check_device(query, initial_state)
        if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError("initial_state must be a contiguous float32 tensor (it is updated in place)")
        final = initial_state if output_final_state else None
    else:
        if state_indices is not None:
            raise ValueError("state_indices needs initial_state (the state pool)")
        final = torch.empty(B, HV, DK, DV, dtype=torch.float32, device=dev) if output_final_state else None
    if state_indices is not None:
        if state_indices.shape != (B,):
            raise ValueError(f"state_indices must be [B] = [{B}], got {tuple(state_indices.shape)}")
        _check_device(query, state_indices)
    out = torch.empty(B, T, HV, DV, dtype=query.dtype, device=dev)
    BK = triton.next_power_of_2(DK)
    BV = min(16, triton.next_power_of_2(DV))
    _recurrent_kernel[(triton.cdiv(DV, BV), B * HV)](
        query, key, value, g, beta, initial_state, final, out, state_indices,
        *query.stride(), *key.stride(), *value.stride(), *g.stride(), *beta.stride(), *out.stride()[:3],
        T, HV, HV // HK, DK, DV, DK**-0.5, BK=BK, BV=BV, L2NORM=use_qk_l2norm_in_kernel,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, HAS_IDX=state_indices is not None,
        num_warps=2,
    )
    return out, final


# --------------------------------------------------------------------------- decode: causal conv update


@triton.jit
def _conv_update_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, o_ptr,
                        sxb, sxc, sxt, ssb, ssc, sss, swc, swk, sob, soc, sot,
                        C, T, S,
                        K: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Grid ``(C blocks, B)``: over ``xs = [state | x]`` (``S + T`` columns), output column ``t`` is
    ``sum_j w[:, j] xs[:, S + t - K + 1 + j]``; then ``state <- xs[:, T:]``."""
    cb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ch = cb * BC + tl.arange(0, BC)
    c_ok = ch < C
    x_base = x_ptr + b * sxb + ch[:, None] * sxc
    s_base = state_ptr + b * ssb + ch[:, None] * ssc
    ts = tl.arange(0, BT)

    acc = tl.zeros([BC, BT], dtype=tl.float32)
    for j in tl.static_range(K):
        col = S + ts - (K - 1) + j  # [BT] column of xs
        from_x = (col >= S) & (ts < T)
        from_s = (col >= 0) & (col < S) & (ts < T)
        xv = tl.load(x_base + (col - S)[None, :] * sxt, mask=c_ok[:, None] & from_x[None, :], other=0.0)
        sv = tl.load(s_base + col[None, :] * sss, mask=c_ok[:, None] & from_s[None, :], other=0.0)
        wj = tl.load(w_ptr + ch * swc + j * swk, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
        acc += wj[:, None] * (xv.to(tl.float32) + sv.to(tl.float32))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(o_ptr + b * sob + ch[:, None] * soc + ts[None, :] * sot, acc.to(o_ptr.dtype.element_ty),
             mask=c_ok[:, None] & (ts[None, :] < T))

    ss = tl.arange(0, BS)
    src = ss + T  # [BS] column of xs that becomes state column ss
    keep = ss < S
    xv = tl.load(x_base + (src - S)[None, :] * sxt, mask=c_ok[:, None] & (keep & (src >= S))[None, :], other=0.0)
    sv = tl.load(s_base + src[None, :] * sss, mask=c_ok[:, None] & (keep & (src < S))[None, :], other=0.0)
    new_state = xv.to(state_ptr.dtype.element_ty) + sv
    tl.debug_barrier()  # all reads of the old state before any write
    tl.store(s_base + ss[None, :] * sss, new_state, mask=c_ok[:, None] & keep[None, :])


def causal_conv1d_update(
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Decode step of a depthwise causal conv1d: conv over ``[conv_state | hidden_states]``, optional SiLU,
    and the state shifted left by ``T`` in place (transformers' ``causal_conv1d_update`` semantics).

    Args:
        hidden_states: ``[B, C, T]`` new columns (small T; decode has T = 1), any strides.
        conv_state: ``[B, C, S]`` with ``S >= K - 1`` (transformers keeps ``S = K``), updated in place to
            the last ``S`` columns of ``[conv_state | hidden_states]``.
        weight: ``[C, K]`` depthwise kernel; bias ``[C]`` or None.
        activation: None, or ``"silu"``/``"swish"``.

    Returns:
        ``[B, C, T]`` in ``hidden_states.dtype`` (accumulated in float32).

    Raises:
        ValueError: on inconsistent shapes, ``S < K - 1``, an unknown activation, mixed devices, or CPU
            tensors without ``TRITON_INTERPRET=1``.
    """
    if hidden_states.dim() != 3 or conv_state.dim() != 3 or weight.dim() != 2:
        raise ValueError("hidden_states [B, C, T], conv_state [B, C, S] and weight [C, K] expected")
    B, C, T = hidden_states.shape
    S = conv_state.shape[-1]
    K = weight.shape[-1]
    if conv_state.shape[:2] != (B, C) or weight.shape[0] != C or S < K - 1 or (bias is not None and bias.shape != (C,)):
        raise ValueError(f"shape mismatch: hidden_states {tuple(hidden_states.shape)}, conv_state "
                         f"{tuple(conv_state.shape)}, weight {tuple(weight.shape)} (need S >= K - 1)")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    _check_device(hidden_states, conv_state, weight, *([bias] if bias is not None else []))
    out = torch.empty(B, C, T, dtype=hidden_states.dtype, device=hidden_states.device)
    BC = 256
    _conv_update_kernel[(triton.cdiv(C, BC), B)](
        hidden_states, conv_state, weight, bias, out, *hidden_states.stride(), *conv_state.stride(),
        *weight.stride(), *out.stride(), C, T, S, K=K, BC=BC, BT=triton.next_power_of_2(T),
        BS=triton.next_power_of_2(S), HAS_BIAS=bias is not None, SILU=activation is not None, num_warps=4,
    )
    return out
