"""Grouped-query attention over the paged KV cache, with Qwen3's per-head q/k RMSNorm.

Per step: project, q/k norm, RoPE, write the new keys/values into their KV slots, then attend each
sequence's queries to its cached keys with a causal offset (query ``i`` of a sequence whose cache
holds ``kv_len`` tokens sees keys ``[0, kv_len - q_len + i]``). Attention itself is
``torch.nn.functional.scaled_dot_product_attention`` with GQA. Reference: ``Qwen3MoeAttention``.

Two variants gpt-oss uses (reference: transformers' ``GptOssAttention`` and its
``eager_attention_forward``), on every path:

- a sliding window of ``W`` keys: the query at position ``p`` sees keys ``(p - W, p]``;
- attention sinks: a learned logit ``sink[h]`` per query head joins each softmax as one more column
  whose value is zero, so ``out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink[h]})``. Under SDPA the sink is
  an extra key: queries get one more dimension holding 1, the sink key holds ``sink[h] / scale`` there
  (zero elsewhere, and a zero value), so its scaled score is exactly ``sink[h]``; the dimensions are
  padded to a multiple of 8 so SDPA keeps its fused kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from edgemoe.config import ModelConfig
from edgemoe.core import ForwardBatch
from edgemoe.kvcache.pool import PagedKVPool
from edgemoe.layers.linear import Linear, UsesCpuDense
from edgemoe.layers.norm import RMSNorm, ZeroCenteredRMSNorm, fused_kernels
from edgemoe.layers.rotary import RotaryEmbedding

SINK_PAD = 8  # extra head dims carrying the sink logit (a multiple of 8: SDPA's fused kernels need it)
WINDOW_QUERY_BLOCK = 1024  # queries per SDPA call in a sliding-window layer (keys per call <= this + W - 1)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                   mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """SDPA with one sink logit per head (module docstring).

    Args:
        q: ``[Hq, n, D]``; k, v: ``[Hq, m, D]`` (KV heads already expanded to the query heads).
        sinks: ``[Hq]`` sink logits (any float dtype).
        scale: softmax scale of ``q · k``.
        mask: a boolean ``[n, m]`` (True = visible), or ``None``: every key visible, or with ``causal``
            query ``i`` sees keys ``[0, m - n + i]`` (lower-right aligned). The sink is always visible.

    Returns:
        ``[Hq, n, D]`` in ``q.dtype``.
    """
    Hq, n, D = q.shape
    m = k.shape[1]
    one = q.new_zeros(Hq, n, SINK_PAD)
    one[..., 0] = 1
    q1 = torch.cat([q, one], dim=-1)  # [Hq, n, D + P]
    sink_key = q.new_zeros(Hq, 1, D + SINK_PAD)
    sink_key[:, 0, D] = sinks.float() / scale
    k1 = torch.cat([sink_key, torch.cat([k, k.new_zeros(Hq, m, SINK_PAD)], dim=-1)], dim=1)  # [Hq, m + 1, D + P]
    v1 = torch.cat([v.new_zeros(Hq, 1, D + SINK_PAD), torch.cat([v, v.new_zeros(Hq, m, SINK_PAD)], dim=-1)],
                   dim=1)  # [Hq, m + 1, D + P]
    if mask is not None:
        mask = torch.cat([mask.new_ones(n, 1), mask], dim=1)  # [n, m + 1]
    elif causal:
        mask = causal_lower_right(n, m + 1)  # the sink key first: query i still sees keys [0, m - n + i]
    o = F.scaled_dot_product_attention(q1[None], k1[None], v1[None], attn_mask=mask, scale=scale)[0]
    return o[..., :D]


def _gather_kv(k_all: torch.Tensor, v_all: torch.Tensor, page_table: torch.Tensor, ps: int, lo: int, hi: int,
               rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions ``[lo, hi)`` of one sequence, KV heads repeated ``rep`` times:
    ``[Hk·rep, hi - lo, D]`` each."""
    pos = torch.arange(lo, hi, device=k_all.device)
    slots = page_table[pos // ps] * ps + pos % ps  # [hi - lo]
    k = k_all.index_select(0, slots).transpose(0, 1)  # [Hk, hi - lo, D]
    v = v_all.index_select(0, slots).transpose(0, 1)
    return k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)


def _window_sink_attention(qs: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, s, ps: int, scale: float,
                           sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """One sequence's queries ``qs [Hq, q_len, D]`` with a sliding window and/or sinks: ``[Hq, q_len, D]``.

    A windowed layer computes its queries in blocks of :data:`WINDOW_QUERY_BLOCK`, each against the keys its
    window reaches only, so the cost grows with ``q_len · W`` rather than ``q_len · kv_len``.
    """
    Hq = qs.shape[0]
    rep = Hq // k_all.shape[1]
    first = s.kv_len - s.q_len  # absolute position of the first query
    block = WINDOW_QUERY_BLOCK if window else s.q_len
    out = []
    for a in range(0, s.q_len, block):
        b = min(a + block, s.q_len)
        lo = max(0, first + a - window + 1) if window else 0
        hi = first + b
        k, v = _gather_kv(k_all, v_all, s.page_table, ps, lo, hi, rep)  # [Hq, hi - lo, D]
        mask = None
        if window:
            qpos = torch.arange(first + a, hi, device=qs.device)[:, None]  # [n, 1]
            kpos = torch.arange(lo, hi, device=qs.device)[None, :]  # [1, m]
            mask = (kpos <= qpos) & (kpos > qpos - window)  # [n, m]
        causal = mask is None and b - a > 1
        qb = qs[:, a:b]
        if sinks is not None:
            out.append(sink_attention(qb, k, v, sinks, scale, mask, causal))
            continue
        bias = causal_lower_right(b - a, hi - lo) if causal else mask
        out.append(F.scaled_dot_product_attention(qb[None], k[None], v[None], attn_mask=bias, scale=scale)[0])
    return torch.cat(out, dim=1)


def paged_attention(q: torch.Tensor, kv: PagedKVPool, layer: int, batch: ForwardBatch, scale: float,
                    sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of the batch's new queries against each sequence's paged KV.

    Args:
        q: ``[T, Hq, D]`` queries of the new tokens (RoPE applied).
        kv: the pool; the new tokens' keys/values must already be written.
        layer: attention-layer index into the pool.
        batch: gives each sequence's query range, KV length and page table.
        scale: softmax scale (``D ** -0.5``).
        sinks: ``[Hq]`` attention-sink logits (gpt-oss), or ``None``.
        window: sliding window in positions (the query's own included), or ``None`` for full attention.

    Returns:
        ``[T, Hq, D]`` attention output in ``q.dtype``.
    """
    out = torch.empty_like(q)
    k_all, v_all = kv.k[layer], kv.v[layer]  # [S, Hk, D]
    ps = kv.page_size
    for s in batch.seqs:
        if sinks is not None or window:
            qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [Hq, q_len, D]
            o = _window_sink_attention(qs, k_all, v_all, s, ps, scale, sinks, window)
            out[s.q_start:s.q_start + s.q_len] = o.transpose(0, 1)
            continue
        key = ("kv_slots", s.seq_id, ps)
        if (slots := batch.step_cache.get(key)) is None:  # the same for every layer of the step
            pos = torch.arange(s.kv_len, device=q.device)
            slots = batch.step_cache[key] = s.page_table[pos // ps] * ps + pos % ps  # [kv_len]
        k = k_all.index_select(0, slots).transpose(0, 1)  # [Hk, kv_len, D]
        v = v_all.index_select(0, slots).transpose(0, 1)
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [Hq, q_len, D]
        if s.q_len == 1:  # decode: every cached key is visible, so a KV head's G query heads attend as G
            # query rows of that head with no mask: GQA without expanding K/V to every query head
            hk, d = k.shape[0], k.shape[-1]
            qg = qs.reshape(1, hk, -1, d)  # [1, Hk, G, D]
            o = F.scaled_dot_product_attention(qg, k[None], v[None], scale=scale)[0].reshape(qs.shape)  # [Hq, 1, D]
        else:
            # prefill: 4-D inputs with the KV heads expanded and the causal mask as a lower-right bias, so
            # SDPA takes a fused kernel (flash or memory-efficient: neither accepts 3-D inputs, a boolean
            # mask, or GQA with a bias); query i sees keys [0, kv_len - q_len + i]
            rep = qs.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)  # [Hq, kv_len, D]
            o = F.scaled_dot_product_attention(qs[None], k[None], v[None],
                                               attn_mask=causal_lower_right(s.q_len, s.kv_len), scale=scale)[0]
        out[s.q_start:s.q_start + s.q_len] = o.transpose(0, 1)
    return out


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKVPool, layer: int,
                     batch: ForwardBatch, scale: float, sinks: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Write the new tokens' ``k``/``v`` ``[T, Hk, D]`` into their KV slots, then attend ``q [T, Hq, D]``.

    Decode steps on the device path (``batch.decode`` set) use the Triton paged decode kernel over
    the block tables (fixed shapes, graph-capturable); other steps use :func:`paged_attention`.
    ``sinks`` (``[Hq]`` logits) and ``window`` (positions) as in :func:`paged_attention`, on both paths.

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``.
    """
    kv.k[layer].index_copy_(0, batch.kv_slots, k.to(kv.k.dtype))
    kv.v[layer].index_copy_(0, batch.kv_slots, v.to(kv.v.dtype))
    return attend(q, kv, layer, batch, scale, sinks, window)


def attend(q: torch.Tensor, kv: PagedKVPool, layer: int, batch: ForwardBatch, scale: float,
           sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Attend ``q [T, Hq, D]`` over the paged KV whose new tokens' keys/values are already written:
    :func:`write_and_attend` after its write. Returns ``[T, Hq, D]`` in ``q.dtype``."""
    if batch.decode is None:
        return paged_attention(q, kv, layer, batch, scale, sinks, window)
    from edgemoe.kernels.decode_attention import paged_decode_attention

    o = torch.empty_like(q)  # [B, Hq, D]
    paged_decode_attention(q, kv.k[layer], kv.v[layer], batch.decode.block_tables, batch.decode.context_lens, scale,
                           o, batch.decode.attn_scratch, kv.page_size, sinks=sinks, window=window or 0)
    return o


def fuse_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """Make the weights (and biases) of ``linears`` row blocks of one matrix, in order.

    Each module keeps its parameters under their names and shapes, rebound as views of the fused
    storage (values copied in), so loading a checkpoint into them fills the fused matrix and the
    separate storages are freed; ``F.linear(x, weight, bias).split(sizes, -1)`` then equals the
    modules' outputs up to the GEMM's choice of kernel. Moving the module (``.to``) afterwards
    would break the sharing: this is done once the parameters are on their device.

    Args:
        linears: ``nn.Linear`` modules over the same input (same ``in_features``, dtype and device),
            all with a bias or all without.

    Returns:
        ``(weight [sum out, in], bias [sum out] or None, sizes)``, ``sizes`` the modules' ``out_features``.
    """
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
        raise ValueError("fuse_linears: the modules differ in input features, dtype or device")
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("fuse_linears: some modules have a bias and some do not")
    sizes = tuple(w.shape[0] for w in weights)
    with torch.no_grad():
        weight = torch.cat([w.data for w in weights])
        bias = None if biases[0] is None else torch.cat([b.data for b in biases])
    start = 0
    for m, n in zip(linears, sizes):
        m.weight.data = weight[start:start + n]
        if bias is not None:
            m.bias.data = bias[start:start + n]
        start += n
    return weight, bias, sizes


class FusedQKV(UsesCpuDense):
    """Mixin of an attention module with ``q_proj``, ``k_proj``, ``v_proj`` (``nn.Linear`` over the same
    input): :meth:`fuse_qkv` concatenates them into one ``[Nq + Nk + Nv, H]`` matrix
    (:func:`fuse_linears`; checkpoint names and memory unchanged) and :meth:`project_qkv` then runs one
    GEMM instead of three (a decode step's q/k/v GEMVs are launch-bound: three become one; on a CPU,
    three native GEMV calls, each a dispatch to the executor's threads, become one).
    ``MoECausalLM.materialize`` fuses every such module of a model in a 16-bit dtype.
    """

    qkv_weight: torch.Tensor | None = None  # [Nq + Nk + Nv, H] once fused
    qkv_bias: torch.Tensor | None = None
    qkv_sizes: tuple[int, ...] = ()

    def fuse_qkv(self) -> None:
        self.qkv_weight, self.qkv_bias, self.qkv_sizes = fuse_linears((self.q_proj, self.k_proj, self.v_proj))

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, H] -> (q [T, Nq], k [T, Nk], v [T, Nv])``; once fused, column views of one ``[T, N]``
        output (last dim contiguous). On the CPU the fused matrix is one product only where the native
        GEMVs take it (a decode step's rows, computed row by row, so the result is the three's bit for bit);
        other products run per module over its row block of the fused matrix, as unfused (oneDNN blocks
        a GEMM by its output width, so one fused GEMM could differ from the three in the last bits)."""
        if self.qkv_weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if x.device.type != "cpu":
            return F.linear(x, self.qkv_weight, self.qkv_bias).split(self.qkv_sizes, dim=-1)
        dense = self.cpu_dense
        if dense is not None and (y := dense.try_linear(x, self.qkv_weight, self.qkv_bias)) is not None:
            return y.split(self.qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class Qwen3Attention(FusedQKV, nn.Module):
    """Qwen3 attention: q/k/v/o projections, per-head RMSNorm on q and k, RoPE, paged KV.

    ``forward(x [T, H], batch) -> [T, H]``. Weight names match the HF checkpoint
    (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``); q/k/v may run as one GEMM
    (:class:`FusedQKV`), and then a CUDA decode step in 16-bit runs the q/k norms, RoPE and the KV write
    as one kernel over its output (``edgemoe.kernels.norm_rope.qk_norm_rope_kv_write``).
    """

    def __init__(self, cfg: ModelConfig, attn_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn_index = attn_index
        self.rotary = rotary  # shared, not a registered submodule's weights
        self.kv: PagedKVPool | None = None  # bound by the model runner

    def _cpu_dense_decode(self, x: torch.Tensor, batch: ForwardBatch):
        """The native CPU decode kernels when they take this step (a CPU decode step in bf16 with one token
        per sequence, half-split RoPE, plain RMSNorm q/k norms of one eps and scaling), else ``None``."""
        dense = self.cpu_dense
        qn, kn = self.q_norm, self.k_norm
        if dense is None or self.rotary.interleaved or type(qn) is not RMSNorm or type(kn) is not RMSNorm:
            return None
        if qn.eps != kn.eps or qn.float32_scale != kn.float32_scale:
            return None
        if any(w.dtype != torch.bfloat16 or w.numel() != self.head_dim for w in (qn.weight, kn.weight)):
            return None
        if not dense.takes_decode_attention(x, self.kv.k[self.attn_index], batch):
            return None
        return dense

    def _fused_decode_kernels(self, x: torch.Tensor, batch: ForwardBatch):
        """``edgemoe.kernels.norm_rope`` when this decode step can run q/k norm, RoPE and the KV write
        as one launch over the fused q/k/v output (CUDA, 16-bit, q/k/v fused, half-split RoPE, norm
        weights and KV planes in ``x``'s dtype), else ``None``."""
        if batch.decode is None or self.qkv_weight is None or self.rotary.interleaved:
            return None
        fused = fused_kernels(x)
        if fused is None or self.q_norm.eps != self.k_norm.eps or self.kv.k.dtype != x.dtype:
            return None
        if self.q_norm.weight.dtype != x.dtype or self.k_norm.weight.dtype != x.dtype:
            return None
        if self.q_norm.float32_scale or self.k_norm.float32_scale:  # the kernel rounds before the weight
            return None
        return fused

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        scale = self.head_dim ** -0.5
        if (fused := self._fused_decode_kernels(x, batch)) is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [T, (Hq + 2 Hk) * D]
            cos, sin = self.rotary.step_tables(batch.positions, x.dtype, batch.step_cache)  # [T, R]
            q = fused.qk_norm_rope_kv_write(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin,
                                            batch.kv_slots, self.kv.k[self.attn_index], self.kv.v[self.attn_index])
            o = attend(q, self.kv, self.attn_index, batch, scale)  # [T, Hq, D]
            return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
        if (dense := self._cpu_dense_decode(x, batch)) is not None:
            cos, sin = self.rotary.step_tables(batch.positions, x.dtype, batch.step_cache)  # [T, R]
            args = dict(q_norm=self.q_norm.weight, k_norm=self.k_norm.weight, eps=self.q_norm.eps,
                        float32_scale=self.q_norm.float32_scale, cos=cos, sin=sin, k_cache=self.kv.k[self.attn_index],
                        v_cache=self.kv.v[self.attn_index], batch=batch, page_size=self.kv.page_size, scale=scale)
            if (self.qkv_weight is not None and self.qkv_bias is None and self.o_proj.bias is None and (
                    y := dense.try_attention_layer(x, self.qkv_weight, self.o_proj.weight, **args)) is not None):
                return y  # projections, attention and output projection in one native call
            q, k, v = self.project_qkv(x)  # [T, Hq * D], [T, Hk * D] x 2
            o = dense.decode_attention(q, k, v, **args)  # [T, Hq, D]
            return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
        q, k, v = self.project_qkv(x)  # [T, Hq * D], [T, Hk * D] x 2
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))  # [T, Hq, D]
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))  # [T, Hk, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        q, k = self.rotary(q, k, batch.positions, batch.step_cache)
        o = write_and_attend(q, k, v, self.kv, self.attn_index, batch, scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class GatedAttention(Qwen3Attention):
    """Qwen3.5 gated full attention over the paged KV cache (``Qwen3_5MoeAttention``).

    Like :class:`Qwen3Attention` (GQA, per-head q/k RMSNorm, RoPE, paged KV), with three differences:
    q/k norms are zero-centered (``1 + weight``); RoPE may be partial (``cfg.partial_rotary_factor``);
    and with ``cfg.attn_output_gate`` ``q_proj`` yields ``[T, Hq, 2D]``, per head a query half and a
    gate half, and the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj`` (gated
    attention, Qiu et al. 2025, arXiv 2505.06708). ``forward(x [T, H], batch) -> [T, H]``.
    """

    def __init__(self, cfg: ModelConfig, attn_index: int, rotary: RotaryEmbedding):
        super().__init__(cfg, attn_index, rotary)
        self.gated = cfg.attn_output_gate
        if self.gated:  # q_proj also yields the output gate: [T, Hq, 2D]
            self.q_proj = Linear(cfg.hidden_size, 2 * self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, Hq, D = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.project_qkv(x)  # [T, Hq * D * (2 if gated else 1)], [T, Hk * D] x 2
        gate = None
        if self.gated:
            q, gate = q.view(T, Hq, 2 * D).chunk(2, dim=-1)  # [T, Hq, D] each
        q = self.q_norm(q.reshape(T, Hq, D))  # [T, Hq, D]
        k = self.k_norm(k.view(T, self.num_kv_heads, D))  # [T, Hk, D]
        v = v.view(T, self.num_kv_heads, D)  # [T, Hk, D]
        q, k = self.rotary(q, k, batch.positions, batch.step_cache)
        o = write_and_attend(q, k, v, self.kv, self.attn_index, batch, D ** -0.5).reshape(T, Hq * D)  # [T, Hq * D]
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(T, Hq * D))
        return self.o_proj(o)
