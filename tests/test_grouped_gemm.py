"""The grouped SwiGLU expert GEMM (``edgemoe/kernels/grouped_gemm.py``) against float64 and torch references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (tiny shapes; ``conftest.py`` patches
the interpreter's bugs). Real geometry, the torch loop at bf16 tolerance and CUDA-graph capture are
checked in ``tests/gpu/test_grouped_gemm_gpu.py``.
"""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

triton = pytest.importorskip("triton")

from edgemoe.config import ExpertActivation  # noqa: E402
from edgemoe.experts.compute import run_experts_loop, swiglu_expert  # noqa: E402
from edgemoe.kernels.grouped_gemm import GroupedConfig, align_routes, choose_config, grouped_swiglu  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(T: int, k: int, E: int, H: int, I: int, S: int, dtype: torch.dtype, seed: int):
    """Random layer: x, ids with repeats inside a token and unrouted experts, weights, slots (some -1), banks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, max(E - 2, 1), (T, k), generator=g)  # the last two experts get no route
    if k > 1:
        ids[::3, 1] = ids[::3, 0]  # a token routed twice to one expert
    w = torch.rand(T, k, generator=g)
    slots = torch.randperm(S, generator=g)[:E]
    slots[1] = -1  # expert 1 is not on the device
    w13 = (torch.randn(S, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(S, H, I, generator=g) / I**0.5).to(dtype)
    return x, ids, w, slots, w13, w2


def _dev(*ts):
    return [t.to(DEV) for t in ts]


def _reference(x, ids, w, slots, w13, w2) -> torch.Tensor:
    """float64, route by route: ``w · swiglu(x)`` of the route's slot, zeros for slot -1."""
    T, k = ids.shape
    out = torch.zeros(T, k, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            s = int(slots[ids[t, j]])
            if s >= 0:
                out[t, j] = float(w[t, j]) * swiglu_expert(x[t:t + 1].double(), w13[s].double(), w2[s].double())[0]
    return out


@pytest.mark.parametrize("dtype,T,k,E,H,I", [
    (torch.float32, 11, 2, 6, 40, 24),  # T·k not a multiple of any tile
    (torch.bfloat16, 11, 2, 6, 40, 24),
    (torch.bfloat16, 7, 1, 4, 24, 20),  # k = 1
    (torch.bfloat16, 9, 8, 12, 32, 16),  # k = 8
    (torch.float32, 40, 8, 5, 16, 8),  # 64 routes per expert: block_m 64, dims below one tile
])
def test_grouped_swiglu_matches_references(dtype, T, k, E, H, I):
    x, ids, w, slots, w13, w2 = _case(T, k, E, H, I, S=E + 3, dtype=dtype, seed=T * k + H)
    out = torch.full((T, k, H), 7.0, dtype=dtype, device=DEV)  # stale rows must be overwritten
    grouped_swiglu(*_dev(x, ids, w, slots, w13, w2), out)
    out = out.cpu()
    ref = _reference(x, ids, w, slots, w13, w2)
    missing = slots[ids] < 0  # [T, k]
    assert missing.any() and not out[missing].any()
    loop = torch.full_like(out, 7.0)  # the torch path: same rounding points
    run_experts_loop(x, ids, w, slots, w13, w2, loop)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, loop, rtol=1e-5, atol=1e-6)
    else:  # bf16: the torch path's rounding points; summation order may flip a rare last bit
        scale = ref.abs().max().item()
        torch.testing.assert_close(out.double(), ref, rtol=2**-5, atol=2**-6 * scale)
        torch.testing.assert_close(out.float(), loop.float(), rtol=2**-7, atol=2**-8 * scale)
        assert (out != loop).float().mean() <= 0.01


GPT_OSS = ExpertActivation("swiglu_oai", alpha=1.702, limit=0.5, bias=True)  # a limit that bites here


def _slot_biases(S: int, I: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 biases as a cache bank holds them: ``b13 [S, 2I]`` and ``b2 [S, H]`` views of one row per slot."""
    rows = torch.randn(S, 2 * I + H + 5, generator=torch.Generator().manual_seed(seed)) * 0.5  # [S, row]
    return rows[:, :2 * I], rows[:, 2 * I:2 * I + H]


@pytest.mark.parametrize("dtype,T,k,E,H,I", [(torch.float32, 11, 2, 6, 40, 24), (torch.bfloat16, 9, 4, 6, 32, 24)])
def test_grouped_swiglu_computes_gpt_oss_experts(dtype, T, k, E, H, I):
    """gpt-oss's clamped SwiGLU with the slots' biases (strided section views) against ``swiglu_expert`` in
    float64 and the torch loop (the same rounding points); both clamps bite."""
    S = E + 3
    x, ids, w, slots, w13, w2 = _case(T, k, E, H, I, S=S, dtype=dtype, seed=5 * T + k)
    w13, w2 = w13 * 3, w2  # gate / up beyond ±limit
    b13, b2 = _slot_biases(S, I, H, seed=T)
    out = torch.full((T, k, H), 7.0, dtype=dtype, device=DEV)
    grouped_swiglu(*_dev(x, ids, w, slots, w13, w2), out, swiglu_oai=(GPT_OSS.alpha, GPT_OSS.limit),
                   biases=tuple(_dev(b13, b2)))
    out = out.cpu()
    ref = torch.zeros(T, k, H, dtype=torch.float64)
    gates = []
    for t in range(T):
        for j in range(k):
            s = int(slots[ids[t, j]])
            if s >= 0:
                xt = x[t:t + 1].to(dtype).double()
                gates.append(xt @ w13[s, :I].double().T + b13[s, :I].double())
                ref[t, j] = float(w[t, j]) * swiglu_expert(xt, w13[s].double(), w2[s].double(), GPT_OSS,
                                                           b13[s].double(), b2[s].double())[0]
    assert (torch.cat(gates) > GPT_OSS.limit).float().mean() > 0.1  # the clamp bites
    missing = slots[ids] < 0
    assert missing.any() and not out[missing].any()
    loop = torch.full_like(out, 7.0)
    run_experts_loop(x, ids, w, slots, w13, w2, loop, act=GPT_OSS, biases=(b13, b2))
    scale = ref.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(out, loop, rtol=1e-5, atol=1e-6 * scale)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=2**-5, atol=2**-5 * scale)
        torch.testing.assert_close(out.float(), loop.float(), rtol=2**-7, atol=2**-8 * scale)
        assert (out != loop).float().mean() <= 0.02


def test_zero_missing_false_leaves_rows_of_missing_experts():
    x, ids, w, slots, w13, w2 = _case(10, 2, 6, 32, 16, S=9, dtype=torch.float32, seed=1)
    out = torch.full((10, 2, 32), 7.0, device=DEV)
    grouped_swiglu(*_dev(x, ids, w, slots, w13, w2), out, zero_missing=False)
    out = out.cpu()
    missing = slots[ids] < 0
    assert missing.any() and (out[missing] == 7.0).all()
    torch.testing.assert_close(out[~missing].double(), _reference(x, ids, w, slots, w13, w2)[~missing],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_route_row_does_not_depend_on_the_batch_composition(dtype):
    """Bit-identical rows whether a token is computed alone, among others, or with only some experts on
    the device (the streamed and the wave prefill paths split one layer's routes differently)."""
    T, k, E, H, I = 21, 4, 5, 48, 40
    x, ids, w, slots, w13, w2 = _case(T, k, E, H, I, S=8, dtype=dtype, seed=7)
    cfg = choose_config(T * k, E, H, I, dtype)  # alone, T = 1 would choose smaller tiles
    full = torch.empty(T, k, H, dtype=dtype, device=DEV)
    grouped_swiglu(*_dev(x, ids, w, slots, w13, w2), full, config=cfg)
    for t in (0, 5, T - 1):
        alone = torch.empty(1, k, H, dtype=dtype, device=DEV)
        grouped_swiglu(*_dev(x[t:t + 1], ids[t:t + 1], w[t:t + 1], slots, w13, w2), alone, config=cfg)
        assert torch.equal(alone[0], full[t])
    some = torch.where(torch.arange(E) % 2 == 0, slots, -1)  # only the even experts on the device
    part = torch.zeros(T, k, H, dtype=dtype, device=DEV)
    grouped_swiglu(*_dev(x, ids, w, some, w13, w2), part, zero_missing=False)  # its own (same) config
    kept = (some[ids] >= 0).to(DEV)
    assert kept.any() and torch.equal(part[kept], full[kept])


def test_align_routes_cuts_one_expert_tiles_covering_every_route_once():
    g = torch.Generator().manual_seed(3)
    E, bm = 7, 16
    ids = torch.randint(0, E, (37, 3), generator=g)
    ids[ids == 4] = 5  # expert 4 unrouted
    slots = torch.tensor([6, -1, 0, 2, 3, 1, 5])
    order, meta = align_routes(ids.to(DEV), slots.to(DEV), bm)
    order, meta = order.cpu(), meta.cpu()
    P = ids.numel()
    assert meta.shape == (3, min(triton.cdiv(P, bm) + E, P)) and meta.dtype == torch.int32
    flat = ids.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    covered = []
    for first, end, slot in meta.t().tolist():
        if first == end:
            continue
        stop = min(first + bm, end)
        experts = flat[order[first:end]].unique().tolist()  # the rest of the expert's block
        assert len(experts) == 1 and slot == int(slots[experts[0]])
        assert end == P or int(flat[order[end]]) != experts[0]
        covered.extend(range(first, stop))
    assert covered == list(range(P))  # every sorted position once, tiles in order
    real = meta[1] > meta[0]
    assert real[: int(real.sum())].all()  # the unused tiles come last


def test_choose_config_follows_routes_per_expert_and_respects_dot_minimums():
    small = choose_config(8, 128, 2048, 768, torch.bfloat16)
    large = choose_config(8192 * 8, 128, 2048, 768, torch.bfloat16)
    assert (small.block_m, large.block_m) == (16, 64)
    assert choose_config(40 * 128, 128, 2048, 768, torch.bfloat16).block_m == 32
    assert large.num_stages == 3 and choose_config(8192, 128, 2048, 768, torch.float32).num_stages == 2
    tiny = choose_config(4, 2, 8, 4, torch.float32)
    assert min(tiny.block_m, tiny.block_n1, tiny.block_k1, tiny.block_n2, tiny.block_k2) >= 16


def test_grouped_swiglu_rejects_bad_inputs():
    x, ids, w, slots, w13, w2 = _dev(*_case(4, 2, 3, 16, 8, S=4, dtype=torch.float32, seed=0))
    out = torch.empty(4, 2, 16, device=DEV)
    with pytest.raises(ValueError, match="routed"):
        grouped_swiglu(x, ids, w, slots, w13, w2, out.to(torch.bfloat16))
    with pytest.raises(ValueError, match="banks"):
        grouped_swiglu(x, ids, w, slots, w13, w2[:, :, :4], out)
    with pytest.raises(ValueError, match="topk_ids"):
        grouped_swiglu(x, ids[:3], w, slots, w13, w2, out)
    with pytest.raises(ValueError, match="integer"):
        grouped_swiglu(x, ids.float(), w, slots, w13, w2, out)
    grouped_swiglu(x[:0], ids[:0], w[:0], slots, w13, w2, out[:0])  # no routes: nothing to do
    assert isinstance(choose_config(8, 3, 16, 8, torch.float32), GroupedConfig)


def test_benchmark_cpu_smoke(tmp_path, load_benchmark):
    bench = load_benchmark("grouped_gemm")
    assert bench.main(["--device", "cpu", "--tokens", "3,24", "--hidden", "32", "--inter", "16", "--experts", "4",
                       "--top-k", "2", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "grouped_gemm.json").read_text())["results"]
    assert [r["tokens"] for r in rows] == [3, 24] and [r["config"]["block_m"] for r in rows] == [16, 16]
    for r in rows:
        assert r["grouped_s"] > 0 and r["loop_s"] > 0 and r["grouped_tflops"] > 0
        assert r["max_rel_diff"] <= 2**-7  # bf16: the same rounding points as the torch loop
