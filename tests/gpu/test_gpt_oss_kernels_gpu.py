"""CUDA checks of the Triton expert kernels on gpt-oss's experts (clamped SwiGLU, slot biases) at the released
geometry (H = I = 2880, alpha 1.702, limit 7): the decode GEMVs (``expert_gemv`` over bf16 slots,
``expert_gemv_quant`` over MXFP4 / NVFP4 / FP8 block slots) and the grouped GEMMs (``grouped_swiglu``,
``grouped_swiglu_quant``) against the torch reference ``swiglu_expert`` (rows dequantized by
``ExpertLayout.dequant_rows`` and rounded to bf16, the slots' float32 biases), with weights scaled so that both
clamps bite; the quantized GEMV pair captured in a CUDA graph and replayed. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from edgemoe.config import ExpertActivation
from edgemoe.experts.compute import expert_biases, quant_slots, swiglu_expert, swiglu_oai_args
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

H, I, TOPK, S = 2880, 2880, 4, 12  # gpt-oss-20b / 120b experts, top-4
ACT = ExpertActivation("swiglu_oai", alpha=1.702, limit=7.0, bias=True)  # the released constants
CUDA = torch.device("cuda")
FORMATS = [WeightFormat.BF16, WeightFormat.MXFP4, WeightFormat.NVFP4, WeightFormat.FP8_BLOCK]


@pytest.fixture(scope="module", params=FORMATS, ids=[f.value for f in FORMATS])
def slots(request):
    """A device slot bank of ``S`` gpt-oss experts in one format (bf16 compute), biases of std 2, and the
    reference weights (dequantized on the host, rounded to bf16)."""
    fmt = request.param
    pool = HostExpertPool(S, ExpertLayout.build(fmt, H, I, has_bias=True), torch.bfloat16, ACT)
    pool.fill_random(seed=5, std=0.12)  # projections of x ~ N(0, 1): std ~6.4, beyond the limit of 7 often
    g = torch.Generator().manual_seed(6)
    pool.view("b13").copy_(torch.randn(S, 2 * I, generator=g) * 2)
    pool.view("b2").copy_(torch.randn(S, H, generator=g) * 2)
    w13, w2 = pool.layout.dequant_rows(pool.bank, range(S))  # [S, 2I, H], [S, H, I] float32
    b13, b2 = pool.layout.bias_rows(pool.bank, range(S))
    return pool.layout, pool.bank.to(CUDA), (w13.to(torch.bfloat16).to(CUDA), w2.to(torch.bfloat16).to(CUDA),
                                             b13.to(CUDA), b2.to(CUDA))


def _reference(ref, x, slot_of_route, w) -> torch.Tensor:
    """``w · swiglu_expert(x)`` route by route in bf16 on the GPU (the eager path's math); zeros for slot -1."""
    w13, w2, b13, b2 = ref
    T, k = w.shape
    out = torch.zeros(T, k, H, dtype=torch.bfloat16, device=CUDA)
    for p, s in enumerate(slot_of_route):
        if s >= 0:
            t, j = divmod(p, k)
            y = swiglu_expert(x[t:t + 1].to(torch.bfloat16), w13[s], w2[s], ACT, b13[s], b2[s])  # [1, H]
            out[t, j] = (y * w[t, j].to(torch.bfloat16))[0]
    return out


def _clamp_fraction(ref, x, slot_of_route) -> tuple[float, float]:
    """Fractions of the gate values above the limit and of the up values beyond ±limit, over the routes."""
    w13, _, b13, _ = ref
    h = torch.stack([x[p // TOPK].to(torch.bfloat16) @ w13[s].T + b13[s].to(torch.bfloat16)
                     for p, s in enumerate(slot_of_route) if s >= 0]).float()  # [R, 2I]
    return float((h[:, :I] > ACT.limit).float().mean()), float((h[:, I:].abs() > ACT.limit).float().mean())


def _check(got, want) -> None:
    """bf16 at the reference's rounding points: ulp flips where the float32 sums (Triton's order, cuBLAS's) cross
    a rounding boundary, as the other kernel tests allow."""
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-5, atol=2**-5 * scale)


def _gemv(layout, bank, x, slot_tk, w, out, a):
    from edgemoe.kernels.expert_gemv import expert_gemv, expert_gemv_quant

    kw = dict(swiglu_oai=swiglu_oai_args(ACT), biases=expert_biases(layout, bank))
    if layout.format.dense:
        expert_gemv(x, slot_tk, w, layout.view(bank, "w13"), layout.view(bank, "w2"), out, a, **kw)
    else:
        expert_gemv_quant(x, slot_tk, w, quant_slots(layout, bank), out, a, **kw)


@pytest.mark.parametrize("T", [1, 4])
def test_decode_gemv_matches_swiglu_expert(slots, T):
    layout, bank, ref = slots
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(CUDA)
    slot_of_route = torch.randint(0, S, (T * TOPK,), generator=g).tolist()
    slot_of_route[1] = -1  # a CPU route
    w = torch.rand(T, TOPK, generator=g).to(CUDA)
    gate_above, up_beyond = _clamp_fraction(ref, x, slot_of_route)
    assert gate_above > 0.05 and up_beyond > 0.05, (gate_above, up_beyond)
    out = torch.full((T, TOPK, H), 9.0, dtype=torch.bfloat16, device=CUDA)
    a = torch.empty(T * TOPK, I, dtype=torch.bfloat16, device=CUDA)
    _gemv(layout, bank, x, torch.tensor(slot_of_route, dtype=torch.int32, device=CUDA), w, out, a)
    _check(out, _reference(ref, x, slot_of_route, w))
    assert not out[0, 1].any()


def test_decode_gemv_captured_in_a_cuda_graph(slots):
    layout, bank, ref = slots
    T = 2
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(CUDA)
    slot_tk = torch.randint(0, S, (T * TOPK,), generator=g).to(torch.int32).to(CUDA)
    w = torch.rand(T, TOPK, generator=g).to(CUDA)
    out = torch.zeros(T, TOPK, H, dtype=torch.bfloat16, device=CUDA)
    a = torch.empty(T * TOPK, I, dtype=torch.bfloat16, device=CUDA)
    _gemv(layout, bank, x, slot_tk, w, out, a)  # compile outside the capture
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _gemv(layout, bank, x, slot_tk, w, out, a)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn(T, H, generator=g))  # new inputs, same buffers
    graph.replay()
    torch.cuda.synchronize()
    _check(out, _reference(ref, x, slot_tk.tolist(), w))


@pytest.mark.parametrize("T", [3, 64])
def test_grouped_gemm_matches_swiglu_expert(slots, T):
    from edgemoe.kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_quant

    layout, bank, ref = slots
    E = S + 4
    g = torch.Generator().manual_seed(20 + T)
    x = torch.randn(T, H, generator=g).to(CUDA)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]).to(CUDA)  # [T, k]
    expert_slots = torch.cat([torch.randperm(S, generator=g), torch.full((4,), -1)]).to(CUDA)  # 4 experts off
    w = torch.rand(T, TOPK, generator=g).to(CUDA)
    out = torch.full((T, TOPK, H), 9.0, dtype=torch.bfloat16, device=CUDA)
    kw = dict(swiglu_oai=swiglu_oai_args(ACT), biases=expert_biases(layout, bank))
    if layout.format.dense:
        grouped_swiglu(x, ids, w, expert_slots, layout.view(bank, "w13"), layout.view(bank, "w2"), out, **kw)
    else:
        grouped_swiglu_quant(x, ids, w, expert_slots, quant_slots(layout, bank), out, **kw)
    slot_of_route = expert_slots[ids.reshape(-1)].tolist()
    _check(out, _reference(ref, x, slot_of_route, w))
