"""Multi-head latent attention (MLA) over a paged cache of latent rows (DeepSeek-V2 §2.1, DeepSeek-V3).

Per token the KV cache holds one row of ``kv_lora_rank + qk_rope_head_dim`` values: the RMS-normalized
compressed KV ``c`` and the rotated key ``k_pe`` that every head shares (the pool's latent plane), not
per-head keys and values. With ``W_UK [H, Dn, C]`` and ``W_UV [H, Dv, C]`` the two halves of
``kv_b_proj``, head ``h`` attends with key ``[W_UK[h] c ‖ k_pe]`` and value ``W_UV[h] c``.

- Prefill (naive form, as transformers' ``DeepseekV3Attention``): up-project every cached row of the
  sequence to per-head keys and values and run causal SDPA.
- Decode (absorbed form, as vLLM and SGLang): ``q_nope`` is absorbed through ``W_UK`` into the latent
  space (``q_lat[h] = W_UK[h]ᵀ q_nope[h]``), so scores are ``q_lat · c + q_pe · k_pe`` straight over the
  cached rows (one shared "key head" of width ``C + R``), the attention output stays latent
  (``Σ p · c``) and ``W_UV`` maps it to each head's value space. Both forms equal the reference's up to
  float rounding.

On the device decode path (``batch.decode`` set: CUDA, fixed shapes, CUDA-graph capturable) the latent
attention is the Triton split-KV kernel ``edgemoe.kernels.decode_attention.paged_latent_decode_attention``
over the block tables. Elsewhere (the eager path, and shapes the kernel does not take) it is
:func:`latent_decode_attention` with torch ops over gathered rows: exact lengths on the eager path; on the
device path every row of the block table, masked by the device context lengths, so the step stays
capturable (at a cost proportional to ``max_model_len`` instead of the context).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from torch.nn.utils.rnn import pad_sequence

from edgemoe.config import ModelConfig
from edgemoe.core import ForwardBatch, Phase, SeqSlice
from edgemoe.kernels import kernel_module
from edgemoe.kvcache.pool import PagedKVPool
from edgemoe.layers.linear import Linear
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding


def latent_decode_attention(q: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor | None,
                            value_dim: int, scale: float) -> torch.Tensor:
    """One decode query per sequence against its cached latent rows, all heads sharing the rows.

    Args:
        q: ``[B, H, W]`` absorbed queries ``[q_lat ‖ q_pe]`` (``W = C + R``).
        latent: ``[S, W]`` one layer's latent plane of the KV pool.
        slots: ``[B, L]`` int64 flat slots of each sequence's positions ``0..L-1`` (entries past a
            sequence's length may be any valid slot).
        lengths: ``[B]`` int64 KV length of each sequence, or ``None`` when every sequence has ``L``.
        value_dim: ``C``: the value is the first ``C`` values of a row.
        scale: softmax scale.

    Returns:
        ``[B, H, C]`` in ``q.dtype``: ``softmax(scale · q · rowsᵀ) · rows[:, :C]`` (the softmax in float32,
        or in ``q.dtype`` when that is wider).
    """
    rows = latent[slots].to(q.dtype)  # [B, L, W]
    scores = torch.bmm(q, rows.transpose(1, 2)).to(torch.promote_types(q.dtype, torch.float32)) * scale  # [B, H, L]
    if lengths is not None:
        valid = torch.arange(slots.shape[1], device=slots.device)[None, :] < lengths[:, None]  # [B, L]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)  # [B, H, L]
    return torch.bmm(p, rows[..., :value_dim])  # [B, H, C]


class LatentAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention; ``forward(x [T, H], batch) -> [T, H]``.

    Weight names match the checkpoint: ``q_proj`` (when ``q_lora_rank`` is ``None``) or ``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj``; ``kv_a_proj_with_mqa [C + R, H]``, ``kv_a_layernorm [C]``,
    ``kv_b_proj [heads * (Dn + Dv), C]``, ``o_proj [H, heads * Dv]``; with ``attention_bias``, biases on
    ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (as the reference). RoPE (``rotary``, of width
    ``R``) applies to ``q_pe`` and ``k_pe`` only, interleaved when the config says so.

    Args:
        cfg: the model config (``cfg.latent_attention`` set).
        attn_index: this layer's index into the KV pool.
        rotary: the shared rotary embedding of width ``qk_rope_head_dim``.
    """

    def __init__(self, cfg: ModelConfig, attn_index: int, rotary: RotaryEmbedding):
        super().__init__()
        mla = cfg.latent_attention
        self.num_heads = H = cfg.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.scale = mla.softmax_scale
        qk = self.nope_dim + self.rope_dim
        bias, hidden = cfg.attention_bias, cfg.hidden_size
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, H * qk, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(mla.q_lora_rank, H * qk, bias=False)
        self.q_lora = mla.q_lora_rank is not None
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(mla.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, hidden, bias=bias)
        self.attn_index = attn_index
        self.rotary = rotary  # shared, not a registered submodule's weights
        self.kv: PagedKVPool | None = None  # bound by the model runner

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, H, C, R = x.shape[0], self.num_heads, self.kv_lora_rank, self.rope_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(T, H, self.nope_dim + R).split([self.nope_dim, R], dim=-1)  # [T, H, Dn], [T, H, R]
        c, k_pe = self.kv_a_proj_with_mqa(x).split([C, R], dim=-1)  # [T, C], [T, R]
        c = self.kv_a_layernorm(c)
        q_pe, k_pe = self.rotary(q_pe, k_pe.view(T, 1, R), batch.positions, batch.step_cache)
        latent = self.kv.latent[self.attn_index]  # [S, C + R]
        latent.index_copy_(0, batch.kv_slots, torch.cat([c, k_pe.view(T, R)], dim=-1).to(latent.dtype))
        if batch.phase is Phase.DECODE:
            o = self._decode(q_nope, q_pe, latent, batch)
        else:
            o = self._prefill(q_nope, q_pe, latent, batch)
        return self.o_proj(o.reshape(T, H * self.v_dim))

    def _seq_slots(self, s: SeqSlice) -> torch.Tensor:
        ps = self.kv.page_size
        pos = torch.arange(s.kv_len, device=s.page_table.device)
        return s.page_table[pos // ps] * ps + pos % ps  # [kv_len]

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 batch: ForwardBatch) -> torch.Tensor:
        """Naive form per sequence: up-projected keys/values of all its cached rows, causal SDPA."""
        H, C, Dn, Dv = self.num_heads, self.kv_lora_rank, self.nope_dim, self.v_dim
        out = q_nope.new_empty(q_nope.shape[0], H, Dv)  # [T, H, Dv]
        for s in batch.seqs:
            rows = latent.index_select(0, self._seq_slots(s)).to(q_nope.dtype)  # [L, C + R]
            L = rows.shape[0]
            kv = self.kv_b_proj(rows[:, :C]).view(L, H, Dn + Dv)
            k_nope, v = kv.split([Dn, Dv], dim=-1)  # [L, H, Dn], [L, H, Dv]
            k = torch.cat([k_nope, rows[:, None, C:].expand(L, H, self.rope_dim)], dim=-1)  # [L, H, Dn + R]
            a, b = s.q_start, s.q_start + s.q_len
            q = torch.cat([q_nope[a:b], q_pe[a:b]], dim=-1)  # [q_len, H, Dn + R]
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], attn_mask=causal_lower_right(s.q_len, L),
                                               scale=self.scale)[0]  # [H, q_len, Dv]
            out[a:b] = o.transpose(0, 1)
        return out

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Absorbed form: one query per row of the batch (padding rows of a device batch included)."""
        H, C, Dn = self.num_heads, self.kv_lora_rank, self.nope_dim
        w = self.kv_b_proj.weight.view(H, Dn + self.v_dim, C)
        w_uk, w_uv = w[:, :Dn], w[:, Dn:]  # [H, Dn, C], [H, Dv, C]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
        q = torch.cat([q_lat, q_pe], dim=-1).to(latent.dtype)  # [B, H, C + R]
        ps, d = self.kv.page_size, batch.decode
        if d is not None and self._kernel_fits() and (kernels := kernel_module("decode_attention", q.device)):
            o_lat = q.new_empty(q.shape[0], H, C)  # [B, H, C]
            kernels.paged_latent_decode_attention(q, latent, d.block_tables, d.context_lens, self.scale, o_lat,
                                                  d.attn_scratch, ps)
        else:
            if d is not None:  # fixed shapes: every row of the block tables, lengths on the device
                tables, lengths = d.block_tables.long(), d.context_lens.long()  # [B, P], [B]
                L = tables.shape[1] * ps
            else:
                lens = [s.kv_len for s in batch.seqs]
                L = max(lens)
                tables = pad_sequence([s.page_table for s in batch.seqs], batch_first=True)  # [B, P]
                lengths = None if min(lens) == L else torch.tensor(lens, device=tables.device)
            pos = torch.arange(L, device=tables.device)
            slots = tables[:, pos // ps] * ps + pos % ps  # [B, L]
            o_lat = latent_decode_attention(q, latent, slots, lengths, C, self.scale)  # [B, H, C]
        o_lat = o_lat.to(q_nope.dtype)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, Dv]

    def _kernel_fits(self) -> bool:
        """Whether the Triton latent kernel takes this geometry (widths powers of two >= 16)."""
        return all(n >= 16 and not n & (n - 1) for n in (self.kv_lora_rank, self.rope_dim))
