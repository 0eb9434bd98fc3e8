"""CUDA checks of deepseek_v3 (skipped without a GPU): the Triton latent decode kernel at DeepSeek-V3's
geometry (128 heads, 512 + 64 latent) up to 32k context, captured and replayed; the device decode path
in CUDA graphs against transformers over contexts longer than one kernel partition, padded batches, and
bf16 against fp32.

Measured numbers are printed (run with ``-s``) and, when ``$OUT`` is set, appended as JSON lines to
``$OUT/deepseek_v3_perf.jsonl``.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from test_deepseek_v3 import _hf_model, make_checkpoint

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.expert_runtime import DecodePath
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.kernels.decode_attention import LATENT_PARTITION, make_decode_scratch, paged_latent_decode_attention
from edgemoe.layers.mla import latent_decode_attention

from conftest import greedy_decode, reference_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
C, R, H = 512, 64, 128  # DeepSeek-V3's kv_lora_rank, qk_rope_head_dim, heads
LONG = [(i * 37 + 11) % 1000 + 3 for i in range(1100)]  # over one LATENT_PARTITION of rows


def _report(name: str, **values) -> None:
    line = json.dumps({"test": name, **values})
    print(line)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "deepseek_v3_perf.jsonl"), "a") as f:
            f.write(line + "\n")


def _latent(lens: list[int], page: int, g: torch.Generator):
    pages = sum(-(-n // page) for n in lens) + 1
    latent = torch.randn(pages * page, C + R, generator=g, device=CUDA).to(torch.bfloat16)
    perm = torch.randperm(pages, generator=g, device=CUDA).to(torch.int32)
    width = max(-(-n // page) for n in lens)
    tables, at = torch.zeros(len(lens), width, dtype=torch.int32, device=CUDA), 0
    for b, n in enumerate(lens):
        k = -(-n // page)
        tables[b, :k] = perm[at:at + k]
        at += k
    return latent, tables


def _torch_reference(q, latent, tables, ctx, scale, page):
    pos = torch.arange(tables.shape[1] * page, device=CUDA)
    slots = tables.long()[:, pos // page] * page + pos % page
    out = latent_decode_attention(q.float(), latent.float(), slots, ctx.long().clamp(min=1), C, scale)
    return torch.where((ctx > 0)[:, None, None], out, 0.0)


@pytest.mark.parametrize("page", [16, 64])
def test_latent_kernel_at_deepseek_v3_geometry_up_to_32k(page):
    g = torch.Generator(device=CUDA).manual_seed(page)
    lens = [1, 0, 1000, 32768, 4097]
    latent, tables = _latent(lens, page, g)
    q = torch.randn(len(lens), H, C + R, generator=g, device=CUDA).to(torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    scratch = make_decode_scratch(8, H, C, 40960, CUDA, partition_size=LATENT_PARTITION)
    out = torch.empty(len(lens), H, C, dtype=torch.bfloat16, device=CUDA)
    paged_latent_decode_attention(q, latent, tables, ctx, 0.1, out, scratch, page)
    torch.testing.assert_close(out.float(), _torch_reference(q, latent, tables, ctx, 0.1, page), rtol=2e-2, atol=2e-2)


def test_latent_kernel_graph_replay_and_bandwidth_at_32k():
    g = torch.Generator(device=CUDA).manual_seed(1)
    page, max_len = 16, 32768
    latent, tables = _latent([max_len], page, g)
    q = torch.randn(1, H, C + R, generator=g, device=CUDA).to(torch.bfloat16)
    ctx = torch.tensor([max_len], dtype=torch.int32, device=CUDA)
    scratch = make_decode_scratch(1, H, C, max_len, CUDA, partition_size=LATENT_PARTITION)
    out = torch.empty(1, H, C, dtype=torch.bfloat16, device=CUDA)

    def call():
        paged_latent_decode_attention(q, latent, tables, ctx, 0.1, out, scratch, page)

    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for n in (1, 777, max_len):  # the captured launch follows the context length in the buffer
        ctx.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), _torch_reference(q, latent, tables, ctx, 0.1, page), rtol=2e-2,
                                   atol=2e-2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    sec = (time.perf_counter() - t0) / 50
    latent_bytes = max_len * (C + R) * 2  # 37.7 MB per layer at batch 1
    _report("latent_decode_attention_32k", us=sec * 1e6, read_TBps=latent_bytes / sec / 1e12)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = make_checkpoint(tmp_path_factory.mktemp("dsv3-gpu") / "m", {"max_position_embeddings": 4096})
    ref = _hf_model(out).to(CUDA)
    return out, ref


def test_graphs_match_transformers_over_partitions(checkpoint):
    """Decode in CUDA graphs (device path, Triton latent kernel) over a 1100-token context."""
    path, ref = checkpoint
    with torch.device(CUDA):
        ref_logits, ref_toks = reference_greedy(ref, LONG, 4)
    runner = ModelRunner(path, EngineConfig(device="cuda", dtype="float32", expert_policy="fill-all",
                                            expert_cache_slots=10**6, max_model_len=2048), progress=False)
    assert runner.experts.decode_path is DecodePath.DEVICE_GRAPHS, runner.experts.decode_path_reason
    logits, toks = greedy_decode(runner, LONG, 4, free=True)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits.cpu(), rtol=1e-4, atol=1e-4)
    assert 1 in runner.graphs.captured_sizes()  # batch size 1 was captured and replayed


def test_padded_graph_batch_matches_alone(checkpoint):
    """Three sequences (padded to a captured batch of 4) decode as each does alone."""
    path, _ = checkpoint
    runner = ModelRunner(path, EngineConfig(device="cuda", dtype="float32", expert_policy="fill-all",
                                            expert_cache_slots=10**6, max_model_len=2048), progress=False)
    prompts = [LONG[:1050], LONG[7:40], LONG[100:300]]
    alone = [greedy_decode(runner, p, 3, seq_id=9, free=True) for p in prompts]
    first = runner.execute([StepInput(i, p, 0) for i, p in enumerate(prompts)], Phase.PREFILL)
    toks = [[int(first[i].argmax())] for i in range(3)]
    logits = [[first[i]] for i in range(3)]
    for s in range(3):
        out = runner.execute([StepInput(i, [toks[i][-1]], len(p) + s) for i, p in enumerate(prompts)], Phase.DECODE)
        for i in range(3):
            logits[i].append(out[i])
            toks[i].append(int(out[i].argmax()))
    assert 4 in runner.graphs.captured_sizes()
    for i in range(3):
        assert toks[i] == alone[i][1]
        torch.testing.assert_close(torch.stack(logits[i]).cpu(), alone[i][0], rtol=1e-4, atol=1e-4)


def test_bf16_device_path_tracks_fp32(checkpoint):
    path, _ = checkpoint
    cfg = dict(device="cuda", expert_policy="fill-all", expert_cache_slots=10**6, max_model_len=2048)
    fp32, t32 = greedy_decode(ModelRunner(path, EngineConfig(dtype="float32", **cfg), progress=False), LONG[:300], 3)
    runner = ModelRunner(path, EngineConfig(dtype="bfloat16", **cfg), progress=False)
    assert runner.model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    bf16, t16 = greedy_decode(runner, LONG[:300], 3)
    assert t16[0] == t32[0]
    torch.testing.assert_close(bf16[0], fp32[0], rtol=0, atol=0.25)
