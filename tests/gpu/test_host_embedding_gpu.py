"""CUDA checks of the token embedding in page-locked host memory (``token_embedding="host"``; skipped without a
GPU): served with the option on and off, a model gives bit-identical logits (prefill, then decode replayed from
CUDA graphs) while the table stays in pinned host memory; the row gather is captured in a CUDA graph and replays
any ids; and at Qwen3.6-35B-A3B's table size (248320 x 2048 bf16) it equals ``index_select`` and its cost per
step is printed (run with ``-s``).
"""

from __future__ import annotations

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.layers.embedding import HostEmbedding
from edgemoe.synth import make_model

from conftest import greedy_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

triton = pytest.importorskip("triton")

PROMPT = [(7 * i + 3) % 1000 for i in range(40)] + [0, 1023]  # the table's first and last rows included
CUDA = torch.device("cuda")


@pytest.fixture(scope="module", params=[("qwen3_moe", "small"), ("qwen3_5_moe", "qwen3.5-moe-tiny")],
                ids=["qwen3_moe", "qwen3_5_moe"])
def model_dir(request, tmp_path_factory):
    arch, preset = request.param
    return make_model(tmp_path_factory.mktemp(f"host-embed-{arch}") / preset, arch, preset, seed=4, dtype="bfloat16")


def _runner(model_dir, embedding: str, **kw) -> ModelRunner:
    return ModelRunner(model_dir, EngineConfig(device="cuda", token_embedding=embedding, expert_policy="fill-all",
                                               max_model_len=512, **kw), progress=False)


@pytest.mark.parametrize("slots", [10**6, 12], ids=["all-resident", "offloaded"])
def test_served_logits_are_bit_identical_with_the_table_in_host_memory(model_dir, slots):
    runs = {}
    for embedding in ("device", "host"):
        runner = _runner(model_dir, embedding, expert_cache_slots=slots)
        emb = runner.model.decoder.embed_tokens
        if embedding == "host":
            assert isinstance(emb, HostEmbedding) and emb.pinned and emb.weight.device.type == "cpu"
            assert "token embedding: host (pinned, " in runner.summary()
        else:
            assert emb.weight.is_cuda
        logits, toks = greedy_decode(runner, PROMPT, 10, chunk_ends=[24], free=True)
        if runner.model.supports_cuda_graphs:
            assert runner.graphs is not None and 1 in runner.graphs.captured_sizes() and not runner.graphs.failed
        runs[embedding] = (logits, toks, runner.model.weight_bytes(), emb.weight.numel() * emb.weight.element_size())
        del runner, emb
        torch.cuda.empty_cache()
    (dl, dt, (d_dev, d_host), table), (hl, ht, (h_dev, h_host), _) = runs["device"], runs["host"]
    assert ht == dt
    assert torch.equal(hl, dl)
    assert d_host == 0 and h_host == table and h_dev == d_dev - table  # the GPU holds the table only in one run


def _captured(emb: HostEmbedding, T: int):
    """The gather of ``T`` ids captured in a CUDA graph: ``(graph, static ids, static output)``."""
    ids = torch.zeros(T, dtype=torch.int64, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (Triton compiles on the first launch)
        emb(ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = emb(ids)
    return graph, ids, out


def _pinned_table(V: int, H: int) -> HostEmbedding:
    """A ``[V, H]`` bf16 :class:`HostEmbedding` of random rows, built as the loader does (meta, then host memory)
    and pinned."""
    with torch.device("meta"):
        emb = HostEmbedding(V, H).to(torch.bfloat16)
    emb.to_empty(device="cpu")
    with torch.no_grad():
        emb.weight.normal_(generator=torch.Generator().manual_seed(0))
    if not emb.pin():
        pytest.skip("cudaHostRegister refused: no pinned table")
    return emb


@pytest.mark.parametrize("T", [1, 5, 64])
def test_gather_is_captured_in_a_cuda_graph_and_replays_any_ids(T):
    emb = _pinned_table(4099, 2048)
    try:
        graph, ids, out = _captured(emb, T)
        g = torch.Generator().manual_seed(T)
        for trial in range(4):
            new = torch.randint(0, 4099, (T,), generator=g)
            new[0] = (0, 4098, 7, 7)[trial]  # the first and the last row, a repeat
            if T > 1:
                new[-1] = new[0]
            ids.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), emb.weight.index_select(0, new))
    finally:
        emb.unpin()


def test_qwen36_table_size_equals_index_select_and_costs_little():
    """248320 x 2048 bf16 (1.02 GB of pinned host memory): decode (T=1) and a prefill chunk (T=2048) against the
    device table's ``index_select``, and the time of each (printed)."""
    V, H = 248320, 2048
    emb = _pinned_table(V, H)
    try:
        on_device = emb.weight.to(CUDA)
        for T in (1, 2048):
            ids = torch.randint(0, V, (T,), device=CUDA)
            ids[0], ids[-1] = 0, V - 1
            got = emb(ids)
            assert torch.equal(got, on_device.index_select(0, ids))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                emb(ids)
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) / 20 * 1e3
            print(f"[host embedding] T={T}: {us:.1f} us per gather, {T * H * 2 / (us * 1e3):.2f} GB/s over PCIe")
    finally:
        emb.unpin()
