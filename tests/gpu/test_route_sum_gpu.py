"""CUDA checks of the route sum folded into the expert GEMVs' down launch (``expert_gemv(..., y=, counters=)``)
at Qwen3-30B-A3B sizes: ``y`` bit for bit ``out.sum(dim=1, dtype=torch.float32)`` (then the cast) as torch
computes it on CUDA, for float and FP8 slots, in float32 and bfloat16, with CPU routes; replayed from a CUDA
graph many times (the arrival counters reset themselves); and the time against the GEMVs followed by torch's
sum and cast.

Measured numbers are printed (run with ``-s``) and, when ``$OUT`` is set, appended as JSON lines to
``$OUT/route_sum_gpu.jsonl``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("triton")

from perf import capture, replay_us, report  # noqa: E402

from edgemoe.experts.compute import quant_slots  # noqa: E402
from edgemoe.kernels.expert_gemv import expert_gemv, expert_gemv_quant, route_sum_counters  # noqa: E402
from edgemoe.quant.layout import ExpertLayout  # noqa: E402
from edgemoe.quant.quantize import pack_float_expert  # noqa: E402
from edgemoe.quant.weights import WeightFormat  # noqa: E402

CUDA = torch.device("cuda")
S, H, I = 128, 2048, 768  # one Qwen3-30B-A3B MoE layer's experts


def _report(name: str, **values) -> None:
    report("route_sum_gpu.jsonl", name, **values)


@pytest.fixture(scope="module")
def banks():
    g = torch.Generator(device=CUDA).manual_seed(0)
    w13 = (torch.randn(S, 2 * I, H, device=CUDA, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(S, H, I, device=CUDA, generator=g) / I**0.5).to(torch.bfloat16)
    return w13, w2


def _routes(T, k, g):
    slot = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    slot[0, -1] = -1  # a CPU route: its row is zero and still summed
    return slot.flatten().to(CUDA), torch.rand(T, k, generator=g).to(CUDA)


@pytest.mark.parametrize("k", [8, 6, 2])
@pytest.mark.parametrize("T", [1, 4, 64])
def test_route_sum_is_torchs_cuda_sum_bit_for_bit(banks, T, k):
    w13, w2 = banks
    g = torch.Generator().manual_seed(T * 100 + k)
    slot, w = _routes(T, k, g)
    x = torch.randn(T, H, generator=g).to(CUDA, torch.bfloat16)
    out = torch.empty(T, k, H, dtype=torch.bfloat16, device=CUDA)
    a = torch.empty(T * k, I, dtype=torch.bfloat16, device=CUDA)
    counters = route_sum_counters(T, H, CUDA)
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.empty(T, H, dtype=dtype, device=CUDA)
        expert_gemv(x, slot, w, w13, w2, out, a, y=y, counters=counters)
        ref = out.sum(dim=1, dtype=torch.float32).to(dtype)
        differ = int((y != ref).sum())
        _report("route_sum_vs_torch", T=T, k=k, dtype=str(dtype), differing=differ, of=y.numel())
        assert differ == 0
        assert not counters.any()


def test_route_sum_over_fp8_slots():
    lay = ExpertLayout.build(WeightFormat.FP8_BLOCK, H, I, block_size=(128, 128))
    g = torch.Generator().manual_seed(1)
    bank = lay.new_bank(16)
    for r in range(16):
        pack_float_expert(lay, torch.randn(2 * I, H, generator=g) * 0.02, torch.randn(H, I, generator=g) * 0.02,
                          out=bank[r])
    bank = bank.to(CUDA)
    T, k = 4, 8
    slot = torch.randint(-1, 16, (T * k,), generator=g, dtype=torch.int32).to(CUDA)
    w = torch.rand(T, k, generator=g).to(CUDA)
    x = torch.randn(T, H, generator=g).to(CUDA, torch.bfloat16)
    out = torch.empty(T, k, H, dtype=torch.bfloat16, device=CUDA)
    a = torch.empty(T * k, I, dtype=torch.bfloat16, device=CUDA)
    y = torch.empty(T, H, dtype=torch.float32, device=CUDA)
    expert_gemv_quant(x, slot, w, quant_slots(lay, bank), out, a, y=y, counters=route_sum_counters(T, H, CUDA))
    assert torch.equal(y, out.sum(dim=1, dtype=torch.float32))


def test_route_sum_in_a_cuda_graph_and_its_time(banks):
    w13, w2 = banks
    g = torch.Generator().manual_seed(5)
    T, k = 1, 8
    slot, w = _routes(T, k, g)
    x = torch.randn(T, H, generator=g).to(CUDA, torch.bfloat16)
    out = torch.empty(T, k, H, dtype=torch.bfloat16, device=CUDA)
    a = torch.empty(T * k, I, dtype=torch.bfloat16, device=CUDA)
    counters = route_sum_counters(T, H, CUDA)
    y = torch.empty(T, H, dtype=torch.bfloat16, device=CUDA)

    def fused():
        expert_gemv(x, slot, w, w13, w2, out, a, y=y, counters=counters)

    def separate():
        expert_gemv(x, slot, w, w13, w2, out, a)
        return out.sum(dim=1, dtype=torch.float32).to(torch.bfloat16)

    (gf, gs), (_, ref) = capture(fused, separate, repeat=16)  # a step's 16 MoE layers, one counter buffer
    for _ in range(50):
        slot.copy_(_routes(T, k, g)[0])
        gf.replay()
        gs.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ref) and not counters.any()

    _report("route_sum_graph_us_per_layer", fused_us=replay_us(gf, 100, per=16),
            gemv_then_sum_us=replay_us(gs, 100, per=16))
