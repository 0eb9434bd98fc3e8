"""Native CPU expert kernels (``edgemoe/experts/native.py``, ``edgemoe/experts/csrc/``).

- every ISA level this CPU supports (forced through the ``isa`` cap) matches a float64 reference for
  every shape class (tails: H/I not multiples of 16/32; the Qwen3-30B-A3B expert H=2048, I=768),
  T = 1, 3, 8, 17, threads 1, 2, 3, bf16 and float32 weights;
- results do not depend on the thread count (bit-identical);
- the native executor rounds where the torch-ops executor does (bf16: a few one-ulp flips at most);
- ISA selection never picks a level the CPU lacks (fake feature sets), the env cap works;
- the C entry point over registered buffers (the future CUDA-graph host node) computes the same step;
- fallback to the torch executor when the extension cannot be built.

Skipped as a whole, with the reason, when the extension cannot be built here.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import torch
from native_helpers import native_executor, needs_native, random_work

from edgemoe.config import EngineConfig
from edgemoe.experts import native
from edgemoe.experts.cpu_executor import TorchCpuExecutor, make_cpu_executor
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

pytestmark = needs_native

SHAPES = {  # name: (H, I, experts in the pool)
    "tiny-tails": (37, 23, 8),       # nothing a multiple of 8: every vector/row/chunk tail
    "tails-16": (80, 48, 6),         # multiples of 16 but not 32 (bf16 line tails)
    "row-tails": (33, 17, 6),        # with threads: last chunks of one row (fewer rows than a row block)
    "qwen3-30b-a3b": (2048, 768, 4),
}
TOKENS = (1, 3, 8, 17)
THREADS = (1, 2, 3)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# avx512bf16 (vdpbf16ps) has only a bf16-weight kernel: float32 weights stop at avx512 by design
ISA_DTYPES = [(isa, d) for isa in native.ISA_LEVELS for d in DTYPES if not (isa == "avx512bf16" and d == "fp32")]
# max |error| / max |reference|: bf16 allows a one-ulp flip (2^-8) of a route's output where float32
# accumulation crosses a rounding boundary the float64 reference does not. Flips come in clusters (a
# flipped activation moves all of its route's outputs by a fraction of an ulp: seen up to 6% of them
# with the scalar kernel's sequential sums at H=2048); with other rounding points all of them differ.
TOL = {torch.bfloat16: 8e-3, torch.float32: 1e-5}
MAX_DIFFERING = 0.25

_pools: dict = {}
_refs: dict = {}


def _pool(shape: str, dtype: torch.dtype) -> HostExpertPool:
    key = (shape, dtype)
    if key not in _pools:
        H, I, N = SHAPES[shape]
        p = HostExpertPool.dense(N, H, I, dtype)
        p.fill_random(seed=11, std=0.05)
        _pools[key] = p
    return _pools[key]


def _skip_unsupported(isa: str, dtype: torch.dtype) -> None:
    if isa not in native.supported_isas(dtype):
        pytest.skip(f"this CPU (or dtype {dtype}) has no {isa} kernel: supported {native.supported_isas(dtype)}")


def _x(T: int, H: int, seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def reference(pool: HostExpertPool, x: torch.Tensor, work) -> torch.Tensor:
    """float64 ``Σ w · down(silu(gate(x)) · up(x))`` with the kernels' documented rounding points: for
    bf16 weights those of the torch path and the GPU kernels (x, gate, up, SiLU(gate), the
    activation, the down projection y, the router weight and y·w rounded to bf16)."""
    bf16 = pool.compute_dtype == torch.bfloat16
    I = pool.intermediate

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).double() if bf16 else t.double()

    xr = r(x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = pool.view("w13"), pool.view("w2")
    for fid, tok, wt in work:
        h = xr[tok] @ w13[fid].double().T  # [n, 2I]
        a = r(r(torch.nn.functional.silu(r(h[:, :I]))) * r(h[:, I:]))  # [n, I]
        y = r(a @ w2[fid].double().T)  # [n, H]
        out.index_add_(0, tok, r(y * r(wt.float())[:, None]))
    return out


def _differing(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of elements where ``out`` is not ``ref`` to float32 precision: with the same rounding
    points, only a float32-accumulation difference that crosses a bf16 rounding boundary remains."""
    return float(((out.double() - ref).abs() > 1e-6 * ref.abs().max()).double().mean())


def _ref(shape, dtype, T):
    key = (shape, dtype, T)
    if key not in _refs:
        pool = _pool(shape, dtype)
        x, work = _x(T, pool.hidden, seed=T), random_work(T, pool.num_ids, seed=100 + T, k=4)
        _refs[key] = (x, work, reference(pool, x, work))
    return _refs[key]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("isa,dtype", ISA_DTYPES)
def test_kernels_match_float64_reference(isa, dtype, shape, T, threads):
    dtype = DTYPES[dtype]
    _skip_unsupported(isa, dtype)
    pool = _pool(shape, dtype)
    x, work, ref = _ref(shape, dtype, T)
    ex = native_executor(pool, isa, threads)
    assert ex.isa == isa and ex.name == f"native-{isa}" and ex.threads == threads
    out = torch.zeros(T, pool.hidden)
    ex.run(x, work, out)
    assert _rel_err(out, ref) < TOL[dtype], f"{ex.name}: relative error {_rel_err(out, ref):.2e}"
    assert _differing(out, ref) < MAX_DIFFERING, f"{ex.name}: {_differing(out, ref):.1%} of outputs differ"


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_results_do_not_depend_on_thread_count(isa):
    pool = _pool("qwen3-30b-a3b", torch.bfloat16)
    _skip_unsupported(isa, pool.compute_dtype)
    x, work, _ = _ref("qwen3-30b-a3b", torch.bfloat16, 8)
    outs = []
    for threads in THREADS:
        out = torch.zeros(8, pool.hidden)
        native_executor(pool, isa, threads).run(x, work, out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_accumulates_into_out_and_accepts_bf16_x():
    pool = _pool("tails-16", torch.bfloat16)
    x, work, ref = _ref("tails-16", torch.bfloat16, 3)
    ex = native_executor(pool, native.supported_isas()[-1], 2)
    base = torch.randn(3, pool.hidden)
    out = base.clone()
    ex.run(x.to(torch.bfloat16), work, out)  # bf16 x is used as is (same values the kernel rounds to)
    assert _rel_err(out - base, ref) < TOL[torch.bfloat16]
    out16 = torch.zeros(3, pool.hidden)
    ex.run(x.to(torch.float16), work, out16)  # other float dtypes are converted
    assert _rel_err(out16, reference(pool, x.to(torch.float16).float(), work)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("T", (1, 8))
@pytest.mark.parametrize("shape", ("tiny-tails", "qwen3-30b-a3b"))
def test_native_matches_torch_executor(shape, T, dtype):
    dtype = DTYPES[dtype]
    pool = _pool(shape, dtype)
    x, work, _ = _ref(shape, dtype, T)
    ex = make_cpu_executor(pool, None, "native")
    assert isinstance(ex, native.NativeCpuExecutor)
    out, ref = torch.zeros(T, pool.hidden), torch.zeros(T, pool.hidden)
    ex.run(x, work, out)
    TorchCpuExecutor(pool).run(x, work, ref)
    scale = float(ref.abs().max())
    # the same rounding points: bf16 results differ only where float32 accumulation orders cross a
    # rounding boundary (oneDNN's order is not the kernels'), a one-ulp flip of a few outputs
    torch.testing.assert_close(out, ref, atol=TOL[dtype] * scale, rtol=0)
    assert _differing(out, ref.double()) < MAX_DIFFERING


def test_large_per_expert_batches_take_the_torch_path(monkeypatch):
    pool = _pool("tails-16", torch.float32)
    ex = native.NativeCpuExecutor(pool, 2, max_tokens_per_expert=4, min_parallel_bytes=0)
    T = 9
    x = _x(T, pool.hidden, seed=5)
    work = [(1, torch.arange(T), torch.rand(T)), (3, torch.tensor([2, 7]), torch.rand(2))]  # heavy + light
    out = torch.zeros(T, pool.hidden)
    torch_path, real = [], native.run_experts_torch
    monkeypatch.setattr(native, "run_experts_torch", lambda p, x_, w, o: (torch_path.extend(f for f, _, _ in w),
                                                                            real(p, x_, w, o)))
    ex.run(x, work, out)
    assert torch_path == [1]  # the heavy expert went to torch ops
    assert _rel_err(out, reference(pool, x, work)) < TOL[torch.float32]


@pytest.mark.parametrize("max_tokens", [1 << 30, 2])
def test_run_grouped_equals_run_over_the_split_work(max_tokens):
    """Routes grouped by expert in flat arrays give ``run``'s bits over the split work list; with experts
    above ``max_tokens_per_expert`` (2) it goes through ``run`` (the torch path for those); bad counts raise."""
    pool = _pool("tails-16", torch.float32)
    ex = native.NativeCpuExecutor(pool, 2, max_tokens_per_expert=max_tokens, min_parallel_bytes=0)
    T = 6
    x = _x(T, pool.hidden, seed=7)
    work = sorted(random_work(T, pool.num_ids, seed=8, k=3))
    fids = [f for f, _, _ in work]
    counts = [t.numel() for _, t, _ in work]
    tok, wt = torch.cat([t for _, t, _ in work]), torch.cat([w for _, _, w in work])
    want, got = torch.zeros(T, pool.hidden), torch.zeros(T, pool.hidden)
    ex.run(x, work, want)
    ex.run_grouped(x, fids, counts, tok, wt, got)
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        ex.run_grouped(x, fids, counts[:-1], tok, wt, got)
    with pytest.raises(ValueError):
        ex.run_grouped(x, fids, counts, tok, wt[:-1], got)


# ------------------------------------------------------------------------------------------ ISA dispatch
def test_select_isa_with_fake_feature_sets():
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    bf16, f32 = torch.bfloat16, torch.float32
    assert native.select_isa(set(), None, bf16) == "scalar"
    assert native.select_isa({"avx2"}, None, bf16) == "scalar"  # AVX2 kernels need FMA too
    assert native.select_isa({"avx2", "fma"}, None, bf16) == "avx2"
    assert native.select_isa({"avx2", "fma", "avx512f"}, None, bf16) == "avx2"  # no BW/VL: no masked bf16 tails
    assert native.select_isa(avx512, None, bf16) == "avx512"
    assert native.select_isa(avx512 | {"avx512_bf16"}, None, bf16) == "avx512bf16"
    assert native.select_isa(avx512 | {"avx512_bf16"}, None, f32) == "avx512"  # no bf16 dot for fp32 weights
    assert native.select_isa({"avx512_bf16", "amx_bf16"}, None, bf16) == "scalar"  # bf16 bit alone is not enough
    assert native.select_isa(avx512 | {"avx512_bf16"}, "avx2", bf16) == "avx2"
    assert native.select_isa(avx512 | {"avx512_bf16"}, "scalar", bf16) == "scalar"
    assert native.select_isa({"avx2", "fma"}, "avx512bf16", bf16) == "avx2"  # a cap is not a request
    assert native.select_isa(avx512, None, torch.float16) is None  # no fp16 kernel
    with pytest.raises(ValueError):
        native.select_isa({"sse9"}, None, bf16)
    with pytest.raises(ValueError):
        native.select_isa(set(), "avx1024", bf16)


@pytest.mark.parametrize("cap", native.ISA_LEVELS)
def test_executor_never_selects_an_isa_the_cpu_lacks(cap):
    feats = {name for name, on in native.cpu_features().items() if on}
    pool = _pool("tiny-tails", torch.bfloat16)
    ex = native.NativeCpuExecutor(pool, 1, isa=cap)
    assert ex.isa == native.select_isa(feats, cap, pool.compute_dtype)
    assert ex.isa in native.supported_isas(pool.compute_dtype)
    assert native.ISA_LEVELS.index(ex.isa) <= native.ISA_LEVELS.index(cap)


def test_env_var_caps_the_isa(monkeypatch):
    pool = _pool("tiny-tails", torch.bfloat16)
    monkeypatch.setenv("EDGEMOE_CPU_ISA", "scalar")
    assert native.NativeCpuExecutor(pool, 1).name == "native-scalar"
    monkeypatch.setenv("EDGEMOE_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="avx1024"):
        native.NativeCpuExecutor(pool, 1)
    monkeypatch.setenv("EDGEMOE_CPU_ISA", "avx2")
    report = native.isa_report()
    assert report["cap"] == "avx2" and report["selected"]["bfloat16"] in ("scalar", "avx2")
    assert report["supported"]["bfloat16"][0] == "scalar"


# ------------------------------------------------------------------------------------------ C entry point
@pytest.mark.parametrize("x_dtype", (torch.float32, torch.bfloat16))
def test_registered_step_through_the_c_entry_point(x_dtype):
    pool = _pool("qwen3-30b-a3b", torch.bfloat16)
    ex = native_executor(pool, native.supported_isas()[-1], 2)
    x, work, ref = _ref("qwen3-30b-a3b", torch.bfloat16, 3)
    step = ex.make_step(max_tokens=8, max_experts=4, x_dtype=x_dtype)
    assert step.fn_address and step.address
    step.set_work(x, work)
    step()
    step()  # zero_out: a replay recomputes, it does not accumulate
    assert step.calls == 2
    direct = torch.zeros(3, pool.hidden)
    ex.run(x.to(x_dtype), work, direct)
    assert torch.equal(step.out[:3], direct)
    assert _rel_err(step.out[:3], ref) < TOL[torch.bfloat16]
    step.dims[0] = 9  # beyond the registered capacity
    with pytest.raises(ValueError, match="capacity"):
        step()
    with pytest.raises(ValueError, match="capacity"):
        step.set_work(_x(9, pool.hidden, 0), work)
    step.close()


# ------------------------------------------------------------------------------------------ errors, pool
def test_invalid_steps_raise_and_leave_out_untouched():
    pool = _pool("tiny-tails", torch.float32)
    ex = native_executor(pool, "scalar", 2)
    x, out = _x(3, pool.hidden, 0), torch.zeros(3, pool.hidden)
    with pytest.raises(IndexError, match="token"):
        ex.run(x, [(0, torch.tensor([0, 3]), torch.ones(2))], out)
    with pytest.raises(IndexError, match="expert"):
        ex.run(x, [(0, torch.tensor([0]), torch.ones(1)), (pool.num_ids, torch.tensor([1]), torch.ones(1))], out)
    assert not out.any()
    with pytest.raises(ValueError, match="weights"):
        ex.run(x, [(0, torch.tensor([0, 1]), torch.ones(1))], out)
    with pytest.raises(TypeError):
        ex.run(x, [(0, torch.tensor([0]), torch.ones(1))], torch.zeros(3, pool.hidden, dtype=torch.float64))
    with pytest.raises(ValueError):
        ex.run(x[:, :-1], [(0, torch.tensor([0]), torch.ones(1))], out[:, :-1].contiguous())
    ex.run(x, [], out)  # nothing to do
    assert not out.any()
    work = [(2, torch.tensor([], dtype=torch.int64), torch.ones(0)),
            (5, torch.tensor([1, 1]), torch.tensor([0.5, 0.25]))]
    ex.run(x, work, out)  # an expert without tokens is skipped; a token twice on one expert adds twice
    assert _rel_err(out, reference(pool, x, work)) < TOL[torch.float32]


def test_workers_wake_after_sleeping():
    pool = _pool("tails-16", torch.float32)
    ex = native.NativeCpuExecutor(pool, 3, spin_us=0, min_parallel_bytes=0, oversubscribe=True)  # workers sleep at once
    x, work, ref = _ref("tails-16", torch.float32, 8)
    for _ in range(3):
        time.sleep(0.02)
        out = torch.zeros(8, pool.hidden)
        ex.run(x, work, out)
        assert _rel_err(out, ref) < TOL[torch.float32]


def test_parallel_sum_reads_every_element():
    ex = native_executor(_pool("tiny-tails", torch.float32), native.supported_isas(torch.float32)[-1], 3)
    t = torch.rand(1_000_003)
    assert ex.sum_f32(t) == pytest.approx(float(t.double().sum()), rel=1e-6)


def test_physical_core_cpus():
    import os

    cpus = native.physical_core_cpus()
    assert cpus and set(cpus) <= os.sched_getaffinity(0)


# ------------------------------------------------------------------------------------------ factory, config
def test_factory_kinds_and_fallback(monkeypatch, caplog):
    pool = _pool("tiny-tails", torch.bfloat16)
    assert isinstance(make_cpu_executor(pool, None, "torch"), TorchCpuExecutor)
    ex = make_cpu_executor(pool, None, "auto")
    assert isinstance(ex, native.NativeCpuExecutor) and ex.name.startswith("native-")
    with pytest.raises(ValueError):
        make_cpu_executor(pool, None, "fastest")
    # no compiler: a one-line warning and the torch executor
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert "no-such-compiler-xyz" in native.unavailable_reason()
    native.build.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="edgemoe.experts.cpu_executor"):
            ex = make_cpu_executor(pool, None, "native")
    finally:
        native.build.cache_clear()  # the next use loads the real extension again
    assert isinstance(ex, TorchCpuExecutor) and ex.name == "torch"
    assert any("no C++ compiler" in r.getMessage() and "torch-ops executor" in r.getMessage() for r in caplog.records)


def test_factory_falls_back_for_formats_without_kernel(caplog):
    fmt = WeightFormat.FP16
    pool = HostExpertPool(2, ExpertLayout.build(fmt, 32, 32))
    pool.fill_random(seed=0)
    with pytest.raises(native.NativeUnavailable, match=f"no native kernel for {fmt.value} expert rows"):
        native.NativeCpuExecutor(pool, 1)
    with caplog.at_level(logging.WARNING, logger="edgemoe.experts.cpu_executor"):
        ex = make_cpu_executor(pool, None, "auto")
    assert isinstance(ex, TorchCpuExecutor)
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
        f"native CPU expert executor unavailable (no native kernel for {fmt.value} expert rows (bf16, float32, "
        "fp8_block, mxfp4 and nvfp4 rows have them)); using the torch-ops executor"]


@pytest.mark.parametrize("fmt", list(WeightFormat), ids=[f.value for f in WeightFormat])
@pytest.mark.parametrize("geometry", [(256, 192), (2048, 768)], ids=["partial-fp8-block", "qwen3-30b"])
def test_bank_description_points_each_projection_at_its_row_sections(fmt, geometry):
    """The ``ExpertBanks`` struct handed to the executor and its kernels: for every
    format, ``expert_matrix`` of each projection of each expert points at the bytes the layout says, with the
    scale geometry the row encodes (``csrc/executor.h``)."""
    H, I = geometry
    lay = ExpertLayout.build(fmt, H, I)
    pool = HostExpertPool(3, lay)
    pool.fill_random(seed=1)
    banks = native.expert_banks(native.load_extension(), pool)
    assert (banks.row_bytes, banks.num_ids, banks.fmt) == (lay.row_bytes, 3, native.NATIVE_FORMATS[fmt])
    base = pool.bank.data_ptr()
    for fid in (0, 2):
        row = base + fid * lay.row_bytes
        gate, up, down = (banks.matrix(fid, p) for p in range(3))
        w13, w2 = lay.section("w13"), lay.section("w2")
        per_row13, per_row2 = w13.nbytes // (2 * I), w2.nbytes // H  # bytes of one matrix row
        assert gate["data"] == row + w13.offset and up["data"] == row + w13.offset + I * per_row13
        assert down["data"] == row + w2.offset
        assert (gate["row_stride_bytes"], down["row_stride_bytes"]) == (per_row13, per_row2)
        if fmt.dense:
            assert gate["scales"] == up["scales"] == down["scales"] == 0
            continue
        s13, s2 = lay.section("w13_scale"), lay.section("w2_scale")
        assert gate["scales"] == row + s13.offset and down["scales"] == row + s2.offset
        if fmt is WeightFormat.FP8_BLOCK:  # up's grid starts after gate's ceil(I / 128) scale rows
            assert (gate["scale_rows"], gate["scale_cols"]) == (128, 128)
            assert gate["scale_row_stride_bytes"] == 4 * -(-H // 128)
            assert down["scale_row_stride_bytes"] == 4 * -(-I // 128)
            assert up["scales"] == gate["scales"] + -(-I // 128) * gate["scale_row_stride_bytes"]
        else:
            g = 32 if fmt is WeightFormat.MXFP4 else 16
            assert (gate["scale_rows"], gate["scale_cols"], gate["scale_row_stride_bytes"]) == (1, g, H // g)
            assert up["scales"] == gate["scales"] + I * (H // g) and down["scale_row_stride_bytes"] == I // g
        if fmt is WeightFormat.NVFP4:  # the per-tensor multipliers stored in the row
            s13_2 = lay.view(pool.bank, "w13_scale2")[fid]
            assert (gate["global_scale"], up["global_scale"]) == tuple(s13_2.tolist())
            assert down["global_scale"] == float(lay.view(pool.bank, "w2_scale2")[fid, 0])
        else:
            assert gate["global_scale"] == up["global_scale"] == down["global_scale"] == 1.0


def test_engine_config_validates_cpu_executor():
    assert EngineConfig(cpu_executor="torch").cpu_executor == "torch"
    with pytest.raises(ValueError, match="cpu_executor"):
        EngineConfig(cpu_executor="gpu")


def test_measure_cpu_uses_the_executor():
    from edgemoe.experts.bandwidth import measure_cpu

    pool = _pool("tails-16", torch.bfloat16)
    ex = native_executor(pool, native.supported_isas()[-1], 2)
    assert measure_cpu(pool, ex, 0.02) > 0
    assert measure_cpu(pool, ex, 0.02, tokens=2, experts_per_call=3) > 0
    assert measure_cpu(pool, TorchCpuExecutor(pool), 0.02, tokens=2, experts_per_call=2) > 0


def test_step_bench_computes_the_rotated_experts():
    """The C++ measurement loop runs the registered step on the experts it was given: after a run long
    enough for one call, ``out`` equals the reference of the last call's experts."""
    pool = _pool("tails-16", torch.bfloat16)
    ex = native_executor(pool, native.supported_isas()[-1], 2)
    step = ex.make_step(2, 2, 4, zero_out=True)
    x = torch.randn(2, pool.hidden)
    step.x.copy_(x)
    order = torch.tensor([3, 1], dtype=torch.int64)
    calls, dt = step.bench(order, tokens=2, experts_per_call=2, seconds=0.0)
    assert calls == 1 and dt >= 0
    ref = torch.zeros(2, pool.hidden)
    TorchCpuExecutor(pool).run(x, [(f, torch.arange(2), torch.full((2,), 0.125)) for f in (3, 1)], ref)
    torch.testing.assert_close(step.out, ref, rtol=2e-2, atol=2e-3)
    with pytest.raises(ValueError):
        step.bench(order, tokens=3, experts_per_call=2, seconds=0.0)  # over the registered capacity
    step.close()


def test_build_without_ninja(monkeypatch):
    """The direct-compiler build (hosts without ninja, e.g. the offline GPU host) gives a working module."""
    bdir = native.build_dir() / "direct"
    with native.build_lock(bdir):
        mod = native._build_direct(bdir)
    monkeypatch.setattr(native, "load_extension", lambda: mod)
    pool = _pool("tails-16", torch.bfloat16)
    x, work, ref = _ref("tails-16", torch.bfloat16, 3)
    ex = native.NativeCpuExecutor(pool, 2, min_parallel_bytes=0)
    out = torch.zeros(3, pool.hidden)
    ex.run(x, work, out)
    assert _rel_err(out, ref) < TOL[torch.bfloat16]


def test_build_lock_removes_a_stopped_builds_lock_file(tmp_path):
    """torch's ``cpp_extension.load`` waits forever while ``<build dir>/lock`` exists; a build killed mid-way
    leaves it. The edgemoe build lock removes it (it cannot belong to a live build: those hold the lock)."""
    (tmp_path / "lock").write_text("")
    with native.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert (tmp_path / "build.lock").exists()


def test_a_stopped_build_does_not_hang_the_next_load(tmp_path):
    """The real loader in a fresh process, with the lock file a killed build leaves in the build directory:
    it loads (before the build lock, ``cpp_extension.load`` polled that file forever)."""
    code = ("from edgemoe.experts import native; d = native.build_dir(); d.mkdir(parents=True, exist_ok=True); "
            "(d / 'lock').write_text(''); r = native.build(); print(r.error, r.builder)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("None "), r.stdout + r.stderr


def _child_step(ex, x, work, conn):
    out = torch.zeros(x.shape)
    ex.run(x, work, out)  # the pool's workers did not survive fork(): the caller does all the work
    conn.send(out.tolist())


def test_executor_keeps_working_in_a_forked_child():
    import multiprocessing

    pool = _pool("tails-16", torch.float32)
    x, work, ref = _ref("tails-16", torch.float32, 3)
    ex = native.NativeCpuExecutor(pool, 2, min_parallel_bytes=0)
    ex.run(x, work, torch.zeros(3, pool.hidden))  # workers started and used in the parent
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child_step, args=(ex, x, work, send))
    p.start()
    assert recv.poll(60), "child did not answer (hung in the thread pool?)"
    out = torch.tensor(recv.recv())
    p.join(30)
    assert p.exitcode == 0
    assert _rel_err(out, ref) < TOL[torch.float32]


def test_detected_features_match_proc_cpuinfo():
    """The cpuid bits the extension reads agree with the kernel's flags (Linux): a wrong bit would otherwise only
    make the tests of the levels that need it skip."""
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = next((set(line.split(":", 1)[1].split()) for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("no flags line in /proc/cpuinfo")
    feats = native.cpu_features()
    for name in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c",
                 "avx512_fp16"):
        assert feats[name] == (name in flags), name
