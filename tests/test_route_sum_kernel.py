"""The route sum folded into the expert GEMVs' down launch (``expert_gemv(..., y=, counters=)`` and
``expert_gemv_quant``): ``y[t] = Σ_j out[t, j]`` in float32, rounded once to ``y.dtype``, summed by the last
of a token's routes to finish, in the order of ``out.sum(dim=1, dtype=torch.float32)`` on CUDA (route
``j`` into accumulator ``j % 4``, then ``((a0 + a1) + a2) + a3``).

Run in Triton's interpreter here: ``y`` is bitwise that order applied to the routes' rows the same launch
wrote, and the arrival counters are zero again after every launch. tests/gpu/test_route_sum_gpu.py compares
the compiled kernel with torch's CUDA reduction bit for bit.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from edgemoe.experts.compute import quant_slots
from edgemoe.kernels.expert_gemv import expert_gemv, expert_gemv_quant, route_sum_counters
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.quantize import pack_float_expert
from edgemoe.quant.weights import WeightFormat

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cuda_sum_order(routed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``routed [T, k, H]`` summed over k as PyTorch's CUDA reduction sums a strided dim, then cast."""
    acc = [torch.zeros(routed.shape[0], routed.shape[2]) for _ in range(4)]
    for j in range(routed.shape[1]):
        acc[j % 4] = acc[j % 4] + routed[:, j].float()
    return (((acc[0] + acc[1]) + acc[2]) + acc[3]).to(dtype)


def _inputs(T, k, H, I, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = (torch.randn(S, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(S, H, I, generator=g) / I**0.5).to(dtype)
    slot_tk = torch.randint(-1, S, (T * k,), generator=g, dtype=torch.int32)  # repeats and CPU routes (-1)
    w = torch.rand(T, k, generator=g)
    return x, w13, w2, slot_tk, w


@pytest.mark.parametrize("dtype,T,k,H", [(torch.bfloat16, 1, 8, 40), (torch.bfloat16, 2, 6, 24),
                                         (torch.float32, 2, 2, 40), (torch.bfloat16, 2, 1, 33)])
def test_route_sum_in_the_down_launch_is_the_cuda_reduction_order(dtype, T, k, H):
    I, S = 16, 5
    x, w13, w2, slot_tk, w = (t.to(DEV) for t in _inputs(T, k, H, I, S, dtype, seed=T * 10 + k))
    counters = route_sum_counters(T, H, DEV)
    a = torch.empty(T * k, I, dtype=dtype, device=DEV)
    plain = torch.full((T, k, H), 7.0, dtype=dtype, device=DEV)
    expert_gemv(x, slot_tk, w, w13, w2, plain, a)
    for y_dtype in (torch.float32, dtype):
        out = torch.full((T, k, H), 7.0, dtype=dtype, device=DEV)
        y = torch.full((T, H), 5.0, dtype=y_dtype, device=DEV)
        expert_gemv(x, slot_tk, w, w13, w2, out, a, y=y, counters=counters)
        assert torch.equal(out, plain)  # the routes' rows are unchanged by the sum
        assert torch.equal(y.cpu(), cuda_sum_order(out.cpu(), y_dtype))
        torch.testing.assert_close(y.float().cpu(), out.sum(dim=1, dtype=torch.float32).to(y_dtype).float().cpu(),
                                   rtol=1e-5, atol=1e-5)
        assert not counters.any()  # reset by every launch's last arrivals


def test_route_sum_over_quantized_slots_and_argument_checks():
    H, I, S, T, k = 32, 16, 3, 1, 8
    lay = ExpertLayout.build(WeightFormat.FP8_BLOCK, H, I, block_size=(16, 16))
    g = torch.Generator().manual_seed(4)
    bank = lay.new_bank(S)
    for r in range(S):
        pack_float_expert(lay, torch.randn(2 * I, H, generator=g) * 0.2, torch.randn(H, I, generator=g) * 0.2,
                          out=bank[r])
    bank = bank.to(DEV)
    x = torch.randn(T, H, generator=g).to(DEV)
    slot_tk = torch.tensor([0, 1, 2, -1, 2, 1, 0, 0], dtype=torch.int32, device=DEV)
    w = torch.rand(T, k, generator=g).to(DEV)
    out = torch.zeros(T, k, H, dtype=torch.bfloat16, device=DEV)
    a = torch.empty(T * k, I, dtype=torch.bfloat16, device=DEV)
    y = torch.empty(T, H, dtype=torch.bfloat16, device=DEV)
    counters = route_sum_counters(T, H, DEV)
    expert_gemv_quant(x, slot_tk, w, quant_slots(lay, bank), out, a, y=y, counters=counters)
    assert torch.equal(y.cpu(), cuda_sum_order(out.cpu(), torch.bfloat16)) and not counters.any()
    with pytest.raises(ValueError, match="counters"):
        expert_gemv_quant(x, slot_tk, w, quant_slots(lay, bank), out, a, y=y)
    with pytest.raises(ValueError, match="y must be"):
        expert_gemv_quant(x, slot_tk, w, quant_slots(lay, bank), out, a, y=y[:, :16], counters=counters)
