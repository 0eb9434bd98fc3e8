"""The native CPU executor on gpt-oss's experts: the clamped SwiGLU and the expert biases.

- every ISA level this CPU supports (forced through the ``isa`` cap) × every row format (bf16, float32, FP8
  block, MXFP4, NVFP4; quantized rows computing in bfloat16 and in float32) matches a float64 reference with
  the documented rounding points, and the torch-ops executor (``swiglu_expert``), for experts with biases and
  ``ExpertActivation("swiglu_oai", alpha, limit)`` whose limit is small enough that both clamps bite (checked:
  a fraction of the gate values lies above the limit, of the up values beyond ±limit); SiLU SwiGLU with biases
  too (the bias adds do not depend on the activation);
- results do not depend on the thread count; the registered step (the device decode path's CPU branch) computes
  the same; ``make_cpu_executor`` picks the native executor for these pools.

Skipped as a whole, with the reason, when the extension cannot be built here.
"""

from __future__ import annotations

import pytest
import torch
from native_helpers import native_executor, needs_native, random_work
from quant_reference import native_weights_are_torch_weights

from edgemoe.config import ExpertActivation
from edgemoe.experts import native
from edgemoe.experts.cpu_executor import TorchCpuExecutor, make_cpu_executor
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

pytestmark = needs_native

LIMIT = 0.4  # gate / up projections (bias included) have std ~0.7 here: both clamps bite
OAI = ExpertActivation("swiglu_oai", alpha=1.702, limit=LIMIT, bias=True)
SILU_BIAS = ExpertActivation("silu", bias=True)
# format, compute dtype: float rows compute in their own dtype, quantized rows in bfloat16 or float32
POOLS = {
    "bf16": (WeightFormat.BF16, torch.bfloat16), "fp32": (WeightFormat.FP32, torch.float32),
    "fp8-bf16": (WeightFormat.FP8_BLOCK, torch.bfloat16), "fp8-f32": (WeightFormat.FP8_BLOCK, torch.float32),
    "mxfp4-bf16": (WeightFormat.MXFP4, torch.bfloat16), "mxfp4-f32": (WeightFormat.MXFP4, torch.float32),
    "nvfp4-bf16": (WeightFormat.NVFP4, torch.bfloat16), "nvfp4-f32": (WeightFormat.NVFP4, torch.float32),
}
H, I, N = 160, 96, 6  # FP4-friendly, not multiples of the FP8 block (partial blocks) nor of 128
TOKENS = (1, 3, 8)
THREADS = (1, 2)
# as tests/test_cpu_kernels.py: bf16 allows a one-ulp flip where float32 accumulation orders cross a boundary
TOL = {torch.bfloat16: 8e-3, torch.float32: 1e-5}
MAX_DIFFERING = 0.25

_pools: dict = {}


def _pool(name: str, act: ExpertActivation = OAI) -> HostExpertPool:
    key = (name, act)
    if key not in _pools:
        fmt, compute = POOLS[name]
        pool = HostExpertPool(N, ExpertLayout.build(fmt, H, I, has_bias=True), compute, act)
        pool.fill_random(seed=3, std=0.06)
        g = torch.Generator().manual_seed(4)
        pool.view("b13").copy_(torch.randn(N, 2 * I, generator=g) * 0.4)  # biases that matter
        pool.view("b2").copy_(torch.randn(N, H, generator=g) * 0.4)
        _pools[key] = pool
    return _pools[key]


def _x(T: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(T))


def reference(pool: HostExpertPool, x: torch.Tensor, work, clamps: list | None = None,
              round_weights: bool = True) -> torch.Tensor:
    """float64 ``Σ w · (down(act(gate(x) + b_g, up(x) + b_u)) + b_2)`` over the dequantized rows, rounded where
    the kernels document (those of ``swiglu_expert`` / ``gated_activation`` in the compute dtype): in bfloat16
    the weights (unless ``round_weights`` is false), x, each projection, each bias and each projection-plus-bias
    sum, each op of the activation, the router weight and y·w are bf16 values; in float32 nothing is.
    ``clamps`` collects, per expert, the fractions of gate values above the limit and of up values beyond
    ±limit."""
    bf16 = pool.compute_dtype == torch.bfloat16
    act = pool.activation
    alpha, limit = float(torch.tensor(act.alpha, dtype=torch.float32)), act.limit

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).double() if bf16 else t.double()

    def rw(t: torch.Tensor) -> torch.Tensor:
        return r(t) if round_weights else t.double()

    out = torch.zeros(x.shape, dtype=torch.float64)
    b13, b2 = pool.layout.bias_rows(pool.bank, range(pool.num_ids))
    for fid, tok, wt in work:
        w13, w2 = pool.layout.dequant_rows(pool.bank, [fid])  # [1, 2I, H], [1, H, I] float32
        h = r(r(x[tok]) @ rw(w13[0]).T)  # [n, 2I]
        h = r(h + r(b13[fid]))
        g, u = h[:, :I], h[:, I:]
        if act.kind == "silu":
            a = r(r(torch.nn.functional.silu(g)) * u)
        else:
            if clamps is not None:
                clamps.append((float((g > limit).double().mean()), float((u.abs() > limit).double().mean())))
            g, u = r(g.clamp(max=limit)), r(u.clamp(-limit, limit))
            a = r(r(u + 1) * r(g * r(torch.sigmoid(r(g * alpha)))))  # [n, I]
        y = r(r(a @ rw(w2[0]).T) + r(b2[fid]))  # [n, H]
        out.index_add_(0, tok, r(y * r(wt.float())[:, None]))
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _differing(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref).abs() > 1e-6 * ref.abs().max()).double().mean())


def _supported(name: str) -> list[str]:
    fmt, compute = POOLS[name]
    return native.supported_isas(fmt if not fmt.dense else compute, compute)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("name", list(POOLS))
@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_clamped_swiglu_with_biases_matches_float64_reference(isa, name, T, threads):
    if isa not in _supported(name):
        pytest.skip(f"no {isa} kernel for {name} here: supported {_supported(name)}")
    pool = _pool(name)
    x, work = _x(T), random_work(T, N, seed=20 + T, k=3)
    clamps: list = []
    ref = reference(pool, x, work, clamps, round_weights=False)
    gate_above = sum(c[0] for c in clamps) / len(clamps)
    up_beyond = sum(c[1] for c in clamps) / len(clamps)
    assert gate_above > 0.1 and up_beyond > 0.1, (gate_above, up_beyond)  # both clamps bite
    ex = native_executor(pool, isa, threads)
    assert ex.isa == isa and ex.threads == threads
    out = torch.zeros(T, H)
    ex.run(x, work, out)
    tol = TOL[pool.compute_dtype]
    assert _rel_err(out, ref) < tol, f"{ex.name} {name}: relative error {_rel_err(out, ref):.2e}"
    assert _differing(out, ref) < MAX_DIFFERING, f"{ex.name} {name}: {_differing(out, ref):.1%} of outputs differ"


@pytest.mark.parametrize("act", [OAI, SILU_BIAS], ids=["swiglu_oai", "silu-bias"])
@pytest.mark.parametrize("T", (1, 8))
@pytest.mark.parametrize("name", list(POOLS))
def test_native_matches_torch_executor(name, T, act):
    """The native executor against the torch-ops executor, whose experts are ``swiglu_expert`` with the rows'
    biases: the same rounding points, so bf16 differs only by one-ulp flips of a few outputs."""
    pool = _pool(name, act)
    x, work = _x(T), random_work(T, N, seed=40 + T, k=3)
    ex = make_cpu_executor(pool, None, "native")
    assert isinstance(ex, native.NativeCpuExecutor)
    out, ref = torch.zeros(T, H), torch.zeros(T, H)
    ex.run(x, work, out)
    TorchCpuExecutor(pool).run(x, work, ref)
    scale = float(ref.abs().max())
    torch.testing.assert_close(out, ref, atol=TOL[pool.compute_dtype] * scale, rtol=0)
    if native_weights_are_torch_weights(name) or pool.compute_dtype == torch.float32:
        assert _differing(out, ref.double()) < MAX_DIFFERING


@pytest.mark.parametrize("name", ["bf16", "mxfp4-bf16", "mxfp4-f32"])
def test_results_do_not_depend_on_thread_count(name):
    pool = _pool(name)
    isa = _supported(name)[-1]
    x, work = _x(8), random_work(8, N, seed=7, k=3)
    outs = []
    for threads in (1, 2, 3):
        out = torch.zeros(8, H)
        native_executor(pool, isa, threads).run(x, work, out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("name", ["bf16", "mxfp4-f32"])
def test_registered_step_computes_the_same(name):
    pool = _pool(name)
    ex = native_executor(pool, _supported(name)[-1], 2)
    x, work = _x(3), random_work(3, N, seed=9, k=3)
    step = ex.make_step(max_tokens=4, max_experts=N, x_dtype=torch.float32)
    try:
        step.set_work(x, work)
        step()
        direct = torch.zeros(3, H)
        ex.run(x, work, direct)
        assert torch.equal(step.out[:3], direct)
        assert _rel_err(direct, reference(pool, x, work)) < TOL[pool.compute_dtype]
    finally:
        step.close()


def test_factory_picks_native_for_gpt_oss_pools(caplog):
    pool = _pool("mxfp4-bf16")
    assert native.native_reason(pool) is None
    ex = make_cpu_executor(pool, None, "auto")
    assert isinstance(ex, native.NativeCpuExecutor) and ex.name.startswith("native-")
    banks = native.expert_banks(native.load_extension(), pool)
    assert banks.row_bytes == pool.row_bytes
