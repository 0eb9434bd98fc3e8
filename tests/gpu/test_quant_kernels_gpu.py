"""CUDA checks of the quantized expert kernels (FP8 block-128, MXFP4, NVFP4 slots dequantized in registers) at the
Qwen3-30B-A3B expert geometry: the decode GEMV and the prefill grouped GEMM against the reference dequantizer
(``ExpertLayout.dequant_rows``, float32, rounded to bf16) and the torch expert math, their time against the packed
bytes they read, CUDA-graph capture of both, and one MoE decode step of a quantized pool (route control, fills of
packed rows from the pinned host pool, the quantized GEMV) captured in one CUDA graph and replayed against the plan
of ``plan_step`` and the reference."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from edgemoe.core import Phase
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.compute import quant_slots
from edgemoe.experts.hybrid import plan_step
from edgemoe.experts.policy import Bandwidths, QStarPolicy
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

H, I, TOPK, E = 2048, 768, 8, 128  # Qwen3-30B-A3B experts
CUDA = torch.device("cuda")
FORMATS = [WeightFormat.FP8_BLOCK, WeightFormat.MXFP4, WeightFormat.NVFP4]


def _report(name: str, **values) -> None:
    print(f"[{name}] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "quant_kernels_perf.jsonl"), "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


def _seconds(fn, iters: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


@pytest.fixture(scope="module", params=FORMATS, ids=[f.value for f in FORMATS])
def bank(request):
    """A device slot bank of 64 quantized experts (random valid rows: ``HostExpertPool.fill_random``)."""
    pool = HostExpertPool(64, ExpertLayout.build(request.param, H, I), torch.bfloat16)
    pool.fill_random(seed=3, std=0.02)
    return pool.layout, pool.bank.to(CUDA)


def _dequantized(layout, bank):
    w13, w2 = layout.dequant_rows(bank, torch.arange(bank.shape[0], device=bank.device))
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)  # [S, 2I, H], [S, H, I]


def _route_reference(x, slot_of_route, w, w13, w2):
    """Every route through torch: bf16 weights, the rounding points of ``swiglu_expert``."""
    T, k = w.shape
    s = slot_of_route.long().clamp(min=0)
    xp = x.to(torch.bfloat16).repeat_interleave(k, dim=0)  # [P, H]
    h = torch.bmm(w13.index_select(0, s), xp[:, :, None]).squeeze(-1)  # [P, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(w2.index_select(0, s), (F.silu(gate) * up)[:, :, None]).squeeze(-1)  # [P, H]
    y = y * w.reshape(-1, 1).to(y.dtype)
    return torch.where((slot_of_route >= 0)[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device)).view(T, k, -1)


@pytest.mark.parametrize("T", [1, 8])
def test_expert_gemv_quant_matches_reference_and_reads_packed_bytes(bank, T):
    from edgemoe.kernels.expert_gemv import expert_gemv_quant

    layout, b = bank
    S = b.shape[0]
    g = torch.Generator().manual_seed(T)
    P = T * TOPK
    slot_tk = torch.randint(0, S, (P,), generator=g, dtype=torch.int32)
    slot_tk[1] = -1  # a CPU route
    slot_tk = slot_tk.to(CUDA)
    x = torch.randn(T, H, device=CUDA).to(torch.bfloat16)
    w = torch.rand(T, TOPK, device=CUDA)
    out = torch.empty(T, TOPK, H, dtype=torch.bfloat16, device=CUDA)
    a = torch.empty(P, I, dtype=torch.bfloat16, device=CUDA)
    qs = quant_slots(layout, b)
    expert_gemv_quant(x, slot_tk, w, qs, out, a)
    ref = _route_reference(x, slot_tk, w, *_dequantized(layout, b))
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-5, atol=2**-5 * ref.abs().max().item())
    assert not out.view(P, H)[1].any()
    rotations = [torch.where(slot_tk >= 0, (slot_tk + 8 * r) % S, slot_tk) for r in range(S // 8)]
    graph = torch.cuda.CUDAGraph()  # captured: no host sync; replayed over other slots (HBM, not L2)
    with torch.cuda.graph(graph):
        for rot in rotations:
            expert_gemv_quant(x, rot, w, qs, out, a)
    graph.replay()
    torch.cuda.synchronize()
    ref_last = _route_reference(x, rotations[-1], w, *_dequantized(layout, b))
    torch.testing.assert_close(out.float(), ref_last.float(), rtol=2**-5, atol=2**-5 * ref_last.abs().max().item())
    sec = _seconds(graph.replay) / len(rotations)
    read = int((slot_tk >= 0).sum()) * layout.row_bytes  # packed bytes each route reads
    _report("expert_gemv_quant", format=layout.format.value, T=T, us=sec * 1e6, packed_TBps=read / sec / 1e12,
            bf16_equivalent_TBps=int((slot_tk >= 0).sum()) * 6 * H * I / sec / 1e12)


@pytest.mark.parametrize("T", [64, 1024, 2048, 4096, 8192])
def test_grouped_swiglu_quant_matches_reference_and_captures(bank, T):
    """The chosen path (FP4 from 16 routes per expert: dequantized chunks then the bf16 pair; else tiles
    dequantized in registers) against the bf16 pair over the reference-dequantized bank, graph replay against
    eager, and the time of both paths against the bf16 pair."""
    from dataclasses import replace

    from edgemoe.kernels.grouped_gemm import choose_quant_config, grouped_swiglu, grouped_swiglu_quant

    layout, b = bank
    S = b.shape[0]
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]).to(CUDA)  # [T, k]
    slots = torch.full((E,), -1, dtype=torch.long)
    slots[torch.randperm(E, generator=g)[:S]] = torch.arange(S)  # half of the experts on the device
    slots = slots.to(CUDA)
    x = torch.randn(T, H, device=CUDA).to(torch.bfloat16)
    w = torch.rand(T, TOPK, device=CUDA)
    qs = quant_slots(layout, b)
    out = torch.empty(T, TOPK, H, dtype=torch.bfloat16, device=CUDA)
    cfg = choose_quant_config(T * TOPK, E, qs, torch.bfloat16)
    grouped_swiglu_quant(x, ids, w, slots, qs, out)
    w13, w2 = _dequantized(layout, b)
    ref = torch.empty_like(out)
    grouped_swiglu(x, ids, w, slots, w13, w2, ref, config=cfg)  # the float kernel over the dequantized bank
    if cfg.dequant_experts:
        assert torch.equal(out, ref)  # the same bf16 pair over the same bf16 weights
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    some = _route_reference(x[:4], slots.index_select(0, ids[:4].reshape(-1)), w[:4], w13, w2)
    torch.testing.assert_close(out[:4].float(), some.float(), rtol=2**-5, atol=2**-5 * some.abs().max().item())
    graph = torch.cuda.CUDAGraph()
    again = torch.zeros_like(out)
    with torch.cuda.graph(graph):
        grouped_swiglu_quant(x, ids, w, slots, qs, again)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, out)  # replay = eager, bit for bit
    sec_q = _seconds(lambda: grouped_swiglu_quant(x, ids, w, slots, qs, again))  # both eager, same overheads
    sec_f = _seconds(lambda: grouped_swiglu(x, ids, w, slots, w13, w2, ref))
    fused = replace(cfg, dequant_experts=0)
    sec_r = _seconds(lambda: grouped_swiglu_quant(x, ids, w, slots, qs, again, config=fused))
    _report("grouped_swiglu_quant", format=layout.format.value, T=T, dequant_experts=cfg.dequant_experts,
            quant_ms=sec_q * 1e3, bf16_ms=sec_f * 1e3, ratio=sec_q / sec_f, in_register_ms=sec_r * 1e3)


def test_quantized_moe_decode_step_captured_in_one_cuda_graph(bank):
    """Route control, fills of packed rows (pinned host pool -> slots) and the quantized GEMV, captured once and
    replayed for several steps: tables equal ``plan_step``'s, slots hold the owners' packed rows, every device
    route equals its expert dequantized from the host pool."""
    from edgemoe.kernels.expert_gemv import expert_gemv_quant
    from edgemoe.kernels.gather import gather_fills
    from edgemoe.kernels.route_control import RouteOutputs, route_control

    fmt = bank[0].format
    L, E_, H_, I_, S, T, k = 4, 16, 512, 128, 20, 2, 4
    P = T * k
    pool = HostExpertPool(L * E_, ExpertLayout.build(fmt, H_, I_), torch.bfloat16)
    pool.fill_random(seed=11, std=0.05)
    if not pool.pin():
        pytest.skip("cudaHostRegister refused: no pinned pool")
    try:
        cache = ExpertCache(S, L * E_, pool.layout, torch.bfloat16, CUDA)
        ref = ExpertCache(S, L * E_, None, torch.float32, torch.device("cpu"))
        policy = QStarPolicy(Bandwidths(30.0, 40.0))
        rule = torch.tensor(policy.fill_rule(), dtype=torch.float64, device=CUDA)
        counters = torch.zeros(4, dtype=torch.int64, device=CUDA)
        ids = torch.zeros(L, T, k, dtype=torch.int64, device=CUDA)
        wts = torch.zeros(L, T, k, dtype=torch.bfloat16, device=CUDA)
        x = torch.zeros(L, T, H_, dtype=torch.bfloat16, device=CUDA)
        outs = [RouteOutputs.empty(P, CUDA) for _ in range(L)]
        y = torch.zeros(L, T, k, H_, dtype=torch.bfloat16, device=CUDA)
        a = torch.zeros(P, I_, dtype=torch.bfloat16, device=CUDA)
        qs = quant_slots(cache.layout, cache.bank)

        def step():
            cache.clock.add_(1)
            for layer in range(L):
                o = outs[layer]
                route_control(ids[layer], wts[layer], layer * E_, cache.slot_of, cache.owner_of, cache.last_used,
                              cache.pinned, cache.clock, rule, counters, o)
                gather_fills(o.meta, o.fill_fid, o.fill_slot, pool.bank, cache.bank)
                expert_gemv_quant(x[layer], o.slot_tk, wts[layer], qs, y[layer], a)

        step()  # compile every kernel before capture, then reset the cache
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        cache.clear()
        cache.clock.zero_()
        counters.zero_()
        pool13, pool2 = (t.to(torch.bfloat16) for t in pool.layout.dequant_rows(pool.bank, range(pool.num_ids)))
        g = torch.Generator().manual_seed(0)
        for stp in range(1, 6):
            new_ids = torch.stack([torch.stack([torch.randperm(E_, generator=g)[:k] for _ in range(T)])
                                   for _ in range(L)])
            new_w = torch.rand(L, T, k, generator=g).to(torch.bfloat16)
            new_x = torch.randn(L, T, H_, generator=g).to(torch.bfloat16)
            ids.copy_(new_ids)
            wts.copy_(new_w)
            x.copy_(new_x)
            graph.replay()
            torch.cuda.synchronize()
            for layer in range(L):
                flat = new_ids[layer] + layer * E_
                plan = plan_step(ref, policy, {f: int((flat == f).sum()) for f in torch.unique(flat).tolist()},
                                 Phase.DECODE, stp)
                placed = {**plan.hits, **dict(plan.waves[0] if plan.waves else [])}
                for p, f in enumerate(flat.view(-1).tolist()):
                    t, j = divmod(p, k)
                    got = y[layer, t, j].cpu().float()
                    if f not in placed:
                        assert not got.any(), f"CPU route {p} of layer {layer} not zero at step {stp}"
                        continue
                    gate, up = F.linear(new_x[layer, t:t + 1], pool13[f]).chunk(2, dim=-1)
                    want = (F.linear(F.silu(gate) * up, pool2[f]) * new_w[layer, t, j])[0].float()
                    torch.testing.assert_close(got, want, rtol=2**-5, atol=2**-5 * want.abs().max().item())
            for n in ("slot_of", "owner_of", "last_used"):
                assert torch.equal(getattr(cache, n).cpu(), getattr(ref, n)), f"{n} differs after step {stp}"
            for slot, owner in enumerate(cache.owner_of.tolist()):
                if owner >= 0:
                    assert torch.equal(cache.bank[slot].cpu(), pool.bank[owner])
        c = ref.counters["decode"]
        assert counters.tolist() == [c.hits, c.misses, c.fills, c.cpu] and c.fills > 0 and c.cpu > 0
    finally:
        pool.unpin()
