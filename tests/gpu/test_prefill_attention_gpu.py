"""Prefill attention on CUDA takes a fused SDPA kernel (flash / memory-efficient), for a first chunk and for
a chunk after a cached prefix, and equals the float64 reference. Skipped without CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from edgemoe.core import SeqSlice
from edgemoe.kvcache.pool import KVSpec, PagedKVPool
from edgemoe.layers.attention import paged_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("prefix,chunk", [(0, 1024), (1024, 512), (1000, 77)])
def test_prefill_attention_is_fused_and_exact(prefix, chunk):
    dev, Hq, Hk, D, ps = torch.device("cuda"), 8, 2, 128, 16
    total = prefix + chunk
    kv = PagedKVPool(KVSpec.heads(1, Hk, D), total // ps + 2, ps, torch.bfloat16, dev)
    kv.allocate(0, total)
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(total, Hk, D, device=dev, dtype=torch.bfloat16, generator=g)
    vals = torch.randn(total, Hk, D, device=dev, dtype=torch.bfloat16, generator=g)
    table = kv.page_table(0).to(dev)
    pos = torch.arange(total, device=dev)
    slots = table[pos // ps] * ps + pos % ps
    kv.k[0].index_copy_(0, slots, keys)
    kv.v[0].index_copy_(0, slots, vals)
    q = torch.randn(chunk, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    batch = SimpleNamespace(seqs=[SeqSlice(seq_id=0, q_start=0, q_len=chunk, kv_len=total, page_table=table)],
                            step_cache={})
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # raises if only math would do
        out = paged_attention(q, kv, 0, batch, D ** -0.5)
    rep = Hq // Hk
    k64, v64 = keys.double().repeat_interleave(rep, 1), vals.double().repeat_interleave(rep, 1)  # [total, Hq, D]
    s = torch.einsum("qhd,khd->hqk", q.double(), k64) * D ** -0.5
    visible = pos[None, :] <= (prefix + torch.arange(chunk, device=dev))[:, None]
    ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v64)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
