"""Native CPU kernels over quantized expert rows (FP8 block-128, MXFP4, NVFP4), dequantized in registers.

- every ISA level this CPU supports (forced through the ``isa`` cap) × every format × compute dtype
  (float32, bfloat16) matches a float64 reference of the dequantized rows
  (:meth:`~edgemoe.quant.layout.ExpertLayout.dequant_rows`, unrounded: the kernels multiply the format's
  exact weights) with the documented rounding points, for odd shapes (FP8 with H and I not multiples of 16
  or 128, and not even of 8: the scalar and masked tails of the vector kernels; FP4 formats with I not a
  multiple of 128), the Qwen3-30B-A3B expert, several tokens and experts, 1 and 2 threads;
- results do not depend on the thread count, nor on how a call is cut into chunks (dense bf16 rows too); the native
  executor agrees with the torch executor;
- the registered step (the device decode path's CPU branch) runs quantized rows;
- which pools have no native kernel (float16 compute, FP8 blocks the kernels cannot tile).

Skipped as a whole, with the reason, when the extension cannot be built here.
"""

from __future__ import annotations

import pytest
import torch
from native_helpers import native_executor, needs_native, random_work
from quant_reference import native_weights_are_torch_weights

from edgemoe.experts import native
from edgemoe.experts.cpu_executor import TorchCpuExecutor, make_cpu_executor
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

pytestmark = needs_native

FORMATS = {"fp8": WeightFormat.FP8_BLOCK, "mxfp4": WeightFormat.MXFP4, "nvfp4": WeightFormat.NVFP4}
SHAPES = {  # format: {name: (H, I, experts)}
    "fp8": {"odd": (200, 72, 6), "partial-blocks": (304, 176, 5), "ragged": (203, 77, 4),
            "row-tails": (195, 65, 4), "qwen3-30b-a3b": (2048, 768, 3)},  # row-tails: chunks of 1 and 3 rows
    "mxfp4": {"odd": (96, 160, 6), "qwen3-30b-a3b": (2048, 768, 3)},
    "nvfp4": {"odd": (80, 48, 6), "partial-128": (144, 208, 5), "qwen3-30b-a3b": (2048, 768, 3)},
}
CASES = [(f, s) for f in FORMATS for s in SHAPES[f]]
COMPUTE = {"f32": torch.float32, "bf16": torch.bfloat16}
TOKENS = (1, 3, 8)
THREADS = (1, 2)
TOL = {torch.bfloat16: 8e-3, torch.float32: 1e-5}  # as tests/test_cpu_kernels.py: a bf16 one-ulp flip
MAX_DIFFERING = 0.25

_pools: dict = {}
_refs: dict = {}


def _pool(fmt: str, shape: str, compute: torch.dtype) -> HostExpertPool:
    key = (fmt, shape, compute)
    if key not in _pools:
        H, I, N = SHAPES[fmt][shape]
        p = HostExpertPool(N, ExpertLayout.build(FORMATS[fmt], H, I), compute)
        p.fill_random(seed=7, std=0.05)
        _pools[key] = p
    return _pools[key]


def q15_lanes(t: torch.Tensor) -> torch.Tensor:
    """The FP4 integer kernels' activation (``Q15_LANES``), written from its definition: each lane of 8
    consecutive elements rounded (half to even) to a multiple of ``2^(E - 13)``, where ``2^E <= max |x| < 2^(E + 1)``
    over the lane. ``t``: [n, K] float64 bf16 values, K a multiple of 8."""
    lanes = t.reshape(t.shape[0], -1, 8)
    mx = lanes.abs().amax(-1, keepdim=True)
    unit = torch.where(mx > 0, torch.exp2(torch.floor(torch.log2(mx.clamp_min(1e-300))) - 13), torch.ones_like(mx))
    return (torch.round(lanes / unit) * unit).reshape(t.shape)


def reference(pool: HostExpertPool, x: torch.Tensor, work, round_weights: bool = True,
              q15: bool = False) -> torch.Tensor:
    """float64 ``Σ w · down(silu(gate(x)) · up(x))`` over the dequantized rows (``dequant_rows``: float32, as
    the torch path dequantizes), rounded where the kernels document: in bfloat16 the weights (unless
    ``round_weights`` is false), x, gate, up, SiLU(gate), the activation, y, the router weight and y·w are
    bf16 values; in float32 nothing is. ``q15``: x and the activation further rounded as the FP4 integer
    kernels take them (:func:`q15_lanes`)."""
    bf16 = pool.compute_dtype == torch.bfloat16
    I = pool.intermediate

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).double() if bf16 else t.double()

    def rw(t: torch.Tensor) -> torch.Tensor:
        return r(t) if round_weights else t.double()

    def ra(t: torch.Tensor) -> torch.Tensor:
        return q15_lanes(r(t)) if q15 else r(t)

    xr = ra(x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for fid, tok, wt in work:
        w13, w2 = pool.layout.dequant_rows(pool.bank, [fid])  # [1, 2I, H], [1, H, I] float32
        h = xr[tok] @ rw(w13[0]).T  # [n, 2I]
        a = ra(r(torch.nn.functional.silu(r(h[:, :I]))) * r(h[:, I:]))  # [n, I]
        y = r(a @ rw(w2[0]).T)  # [n, H]
        out.index_add_(0, tok, r(y * r(wt.float())[:, None]))
    return out


def _ref(fmt, shape, compute, T, round_weights: bool = True, q15: bool = False):
    key = (fmt, shape, compute, T, round_weights, q15)
    if key not in _refs:
        pool = _pool(fmt, shape, compute)
        x = torch.randn(T, pool.hidden, generator=torch.Generator().manual_seed(T))
        work = random_work(T, pool.num_ids, seed=50 + T, k=3)
        _refs[key] = (x, work, reference(pool, x, work, round_weights, q15))
    return _refs[key]


def _takes_q15(isa: str, fmt: str, compute: torch.dtype) -> bool:
    """Whether the (isa, format, compute) kernel takes Q15_LANES activations: the FP4 integer kernels."""
    return isa in ("avx2int", "avx2vnni", "avx512bf16") and fmt in ("mxfp4", "nvfp4") and compute == torch.bfloat16


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _differing(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref).abs() > 1e-6 * ref.abs().max()).double().mean())


def _skip_unsupported(isa: str, fmt: str, compute: torch.dtype) -> None:
    have = native.supported_isas(FORMATS[fmt], compute)
    if isa not in have:
        pytest.skip(f"no {isa} kernel for {fmt} computing in {compute} here: supported {have}")


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("compute", list(COMPUTE))
@pytest.mark.parametrize("fmt,shape", CASES, ids=[f"{f}-{s}" for f, s in CASES])
@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_quantized_kernels_match_float64_reference(isa, fmt, shape, compute, T, threads):
    compute = COMPUTE[compute]
    _skip_unsupported(isa, fmt, compute)
    pool = _pool(fmt, shape, compute)
    x, work, ref = _ref(fmt, shape, compute, T, round_weights=False, q15=_takes_q15(isa, fmt, compute))
    ex = native_executor(pool, isa, threads)
    assert ex.isa == isa and ex.threads == threads
    out = torch.zeros(T, pool.hidden)
    ex.run(x, work, out)
    assert _rel_err(out, ref) < TOL[compute], f"{ex.name} {fmt}: relative error {_rel_err(out, ref):.2e}"
    assert _differing(out, ref) < MAX_DIFFERING, f"{ex.name} {fmt}: {_differing(out, ref):.1%} of outputs differ"


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("fmt,shape", [c for c in CASES if c[0] in ("mxfp4", "nvfp4")],
                         ids=[f"{f}-{s}" for f, s in CASES if f in ("mxfp4", "nvfp4")])
def test_avx2int_equals_avx2vnni_bit_for_bit(fmt, shape, T):
    """The AVX2 byte multiply-adds sum the same exact integers as `vpdpbusd`: the two levels' FP4 kernels give
    the same bits."""
    for isa in ("avx2int", "avx2vnni"):
        _skip_unsupported(isa, fmt, torch.bfloat16)
    pool = _pool(fmt, shape, torch.bfloat16)
    x, work, _ = _ref(fmt, shape, torch.bfloat16, T, round_weights=False, q15=True)
    outs = []
    for isa in ("avx2int", "avx2vnni"):
        out = torch.zeros(T, pool.hidden)
        native_executor(pool, isa, 2).run(x, work, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
@pytest.mark.parametrize("compute", list(COMPUTE))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_results_do_not_depend_on_thread_count(fmt, compute, isa):
    compute = COMPUTE[compute]
    _skip_unsupported(isa, fmt, compute)
    pool = _pool(fmt, "qwen3-30b-a3b", compute)
    x, work, _ = _ref(fmt, "qwen3-30b-a3b", compute, 8)
    outs = []
    for threads in (1, 2, 3):
        out = torch.zeros(8, pool.hidden)
        native_executor(pool, isa, threads).run(x, work, out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("compute", list(COMPUTE))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_native_matches_torch_executor(fmt, compute):
    """The torch executor dequantizes the rows (float32, then the compute dtype) and runs the float expert;
    the native kernels compute the same numbers up to float32 summation order (and, for the FP4 integer
    kernels, the rounding of the activation's small elements: within the bf16 tolerance, not mostly equal)."""
    compute = COMPUTE[compute]
    pool = _pool(fmt, "qwen3-30b-a3b", compute)
    x, work, _ = _ref(fmt, "qwen3-30b-a3b", compute, 3)
    ex = make_cpu_executor(pool, None, "auto")
    assert isinstance(ex, native.NativeCpuExecutor)
    out, ref = torch.zeros(3, pool.hidden), torch.zeros(3, pool.hidden)
    ex.run(x, work, out)
    TorchCpuExecutor(pool).run(x, work, ref)
    torch.testing.assert_close(out, ref, atol=TOL[compute] * float(ref.abs().max()), rtol=0)
    if (native_weights_are_torch_weights(fmt) or compute == torch.float32) and not _takes_q15(ex.isa, fmt, compute):
        assert _differing(out, ref.double()) < MAX_DIFFERING


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_registered_step_runs_quantized_rows(fmt):
    pool = _pool(fmt, "odd", torch.bfloat16)
    x, work, ref = _ref(fmt, "odd", torch.bfloat16, 3)
    ex = native.NativeCpuExecutor(pool, 2, min_parallel_bytes=0, oversubscribe=True)
    step = ex.make_step(max_tokens=4, max_experts=pool.num_ids, x_dtype=torch.bfloat16)
    try:
        step.set_work(x.to(torch.bfloat16), work)
        step()
        assert _rel_err(step.out[:3], ref) < TOL[torch.bfloat16]
    finally:
        step.close()


def test_pools_without_a_native_kernel():
    f16 = HostExpertPool(2, ExpertLayout.build(WeightFormat.NVFP4, 32, 32), torch.float16)
    with pytest.raises(native.NativeUnavailable, match=r"computing in torch\.float16"):
        native.NativeCpuExecutor(f16, 1)
    odd_block = HostExpertPool(2, ExpertLayout.build(WeightFormat.FP8_BLOCK, 64, 64, block_size=(128, 96)))
    with pytest.raises(native.NativeUnavailable, match="FP8 block size"):
        native.NativeCpuExecutor(odd_block, 1)
    assert isinstance(make_cpu_executor(odd_block, None, "auto"), TorchCpuExecutor)


def test_isa_for_quantized_formats_in_float32_stops_at_avx512():
    """``vdpbf16ps`` needs bf16 operands: a quantized pool computing in float32 runs the AVX-512F kernels."""
    feats = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"]
    for fmt in FORMATS.values():
        assert native.select_isa(feats, None, fmt, torch.float32) == "avx512"
        assert native.select_isa(feats, "avx2", fmt, torch.bfloat16) == "avx2"
        assert native.select_isa([], None, fmt) == "scalar"


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_tokens_result_does_not_depend_on_the_other_tokens(fmt, isa):
    """Eight tokens on one expert (two tiles of four) give each token the bits it gets alone or in a tile of
    three."""
    pool = _pool(fmt, "qwen3-30b-a3b", torch.bfloat16)
    x = torch.randn(8, pool.hidden, generator=torch.Generator().manual_seed(3))
    wt = torch.rand(8, generator=torch.Generator().manual_seed(4))
    _skip_unsupported(isa, fmt, torch.bfloat16)
    ex = native_executor(pool, isa, 2)
    full = torch.zeros(8, pool.hidden)
    ex.run(x, [(1, torch.arange(8), wt)], full)
    for toks in (torch.tensor([5]), torch.tensor([0, 2, 7])):
        part = torch.zeros(8, pool.hidden)
        ex.run(x, [(1, toks, wt[toks])], part)
        assert torch.equal(part[toks], full[toks])


def _crafted_pool(fmt: str, H: int, I: int, seed: int) -> HostExpertPool:
    """A bf16-computing pool whose codes and scales the kernels' special cases hit: FP8 rows cycling
    through every finite e4m3 code (subnormals, ±0, the largest), MXFP4 rows with E8M0 scale bytes
    spread over 0 .. 254 plus their extremes (0: 2^-127, 1, 254), small enough where the products
    would overflow, and with K = 640 whole steps of 256 with and without a zero byte; NVFP4 rows with zero
    scale bytes in about one group of ten (every row's first) and subnormal ones."""
    pool = HostExpertPool(2, ExpertLayout.build(FORMATS[fmt], H, I), torch.bfloat16)
    pool.fill_random(seed=seed, std=0.05)
    lay, g = pool.layout, torch.Generator().manual_seed(seed)
    for name in ("w13", "w2"):
        codes = lay.view(pool.bank, name)  # [2, rows, K or K/2]
        if fmt == "fp8":
            finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
            idx = torch.randint(0, finite.numel(), codes.shape, generator=g)
            codes.view(torch.uint8).copy_(finite[idx])
        elif fmt == "nvfp4":
            scales = lay.view(pool.bank, f"{name}_scale").view(torch.uint8)  # [2, rows, K / 16] e4m3
            zero = torch.rand(scales.shape, generator=g) < 0.1
            zero[..., 0] = True
            scales[zero] = 0  # eff 0: the line's tables from float32 products (an exponent add would not give 0)
            scales[1, 1::3, 1] = 0x01  # the smallest subnormal e4m3, 2^-9: eff far below the others
        else:
            scales = lay.view(pool.bank, f"{name}_scale")  # [2, rows, K / 32] uint8
            s = torch.randint(100, 140, scales.shape, generator=g, dtype=torch.int32)
            s[..., 0] = 0
            s[0, 0::3, -1] = 1
            s[1, 1::3, -1] = 254  # with codes of magnitude <= 1 (2^127 at most): finite weights
            if s.shape[-1] > 1:
                s[1, 2::3, 1] = 150
            if s.shape[-1] > 12:  # a zero byte mid-step in some rows: the AVX-512-BF16 step's tested fast path misses
                s[:, 1::4, 12] = 0
            scales.copy_(s.to(torch.uint8))
            big = s[..., -1] == 254
            row = codes[..., -16:]  # the last scale group of each row
            row[big] = row[big] & 0xAA  # every nibble's magnitude bits <= 0b010 (e2m1 <= 1.0), sign kept
    return pool


@pytest.mark.parametrize("fmt,H,I", [("fp8", 352, 224), ("mxfp4", 352, 224), ("mxfp4", 256, 128), ("mxfp4", 640, 128),
                                     ("nvfp4", 352, 208)])
@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_crafted_codes_and_scales_match_the_reference(isa, fmt, H, I):
    """Every finite FP8 code (subnormal codes exact, not flushed), MXFP4 scales across the E8M0 range
    (the power-of-two post-scaling of whole blocks of 128, and the in-order chunks of the K % 128 tail) and
    NVFP4 zero and subnormal group scales (lines whose tables cannot come from exponent adds) give the
    reference's numbers at every ISA level; rows are whole 128-blocks plus a tail (96, NVFP4 80)."""
    _skip_unsupported(isa, fmt, torch.bfloat16)
    pool = _crafted_pool(fmt, H, I, seed=11)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(5)) * (1e-30 if fmt == "mxfp4" else 1.0)
    work = [(0, torch.tensor([0, 2, 4]), torch.tensor([0.5, 1.0, 0.25])),
            (1, torch.tensor([1, 2, 3, 4]), torch.tensor([1.0, 0.5, 0.75, 0.3]))]
    ref = reference(pool, x, work, round_weights=False)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    out = torch.zeros(5, H)
    native_executor(pool, isa, 1).run(x, work, out)
    assert _rel_err(out, ref) < TOL[torch.bfloat16], f"{fmt} {isa}: relative error {_rel_err(out, ref):.2e}"


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_fp4_scale_special_cases_inside_whole_steps(isa):
    """MXFP4: a whole step of 256 whose only nonzero codes sit in a group of scale byte 0 (2^-127) among bytes
    of 1 (a kernel testing the step's bytes for the special codes must see it mid-step); NVFP4: a global scale
    of 2^9, where the folded constant global_scale * 2^120 overflows float32 (the unfolded path)."""
    _skip_unsupported(isa, "mxfp4", torch.bfloat16)
    H, I = 640, 128  # two whole steps of 256 and a tail of 128
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(8))
    work = [(0, torch.tensor([0, 2]), torch.tensor([0.5, 1.0])), (1, torch.tensor([1]), torch.tensor([1.0]))]
    mx = HostExpertPool(2, ExpertLayout.build(WeightFormat.MXFP4, H, I), torch.bfloat16)
    mx.fill_random(seed=4, std=0.05)
    codes, scales = mx.layout.view(mx.bank, "w13"), mx.layout.view(mx.bank, "w13_scale")  # [2, 2I, H/2], [.., H/32]
    scales.fill_(1)
    scales[:, :, 12] = 0  # group 12: elements 384 .. 415, bytes 192 .. 207 of a row, in the second step
    keep = codes[:, :, 192:208].clone()
    codes.zero_()
    codes[:, :, 192:208] = keep
    lay = mx.layout
    w2 = lay.view(mx.bank, "w2_scale")
    w2.fill_(127)
    xs = x * 2.0**100  # products of 2^-127-scaled weights stay normal float32 numbers
    ref = reference(mx, xs, work, round_weights=False)
    assert ref.abs().max() > 0
    out = torch.zeros(3, H)
    native_executor(mx, isa, 1).run(xs, work, out)
    assert _rel_err(out, ref) < TOL[torch.bfloat16], f"mxfp4 {isa}: relative error {_rel_err(out, ref):.2e}"
    nv = HostExpertPool(2, ExpertLayout.build(WeightFormat.NVFP4, H, I), torch.bfloat16)
    nv.fill_random(seed=4, std=0.05)
    for name in ("w13_scale2", "w2_scale2"):
        nv.layout.view(nv.bank, name).fill_(2.0**9)
    ref = reference(nv, x * 2.0**-20, work, round_weights=False)
    out = torch.zeros(3, H)
    native_executor(nv, isa, 1).run(x * 2.0**-20, work, out)
    assert torch.isfinite(ref).all() and _rel_err(out, ref) < TOL[torch.bfloat16], f"nvfp4 {isa}"


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_fp8_zero_exponent_codes_are_exact(isa):
    """FP8 codes with a zero exponent field (±0 and the subnormals m * 2^-9), which the AVX-512-BF16 kernel looks
    up instead of shifting into place: a pool of nothing but those codes in most lines, and lines that hold a
    single one among normal codes, gives the reference's numbers (a kernel that flushed them to zero, or read
    them as normals, would be off by the whole output in the first case)."""
    _skip_unsupported(isa, "fp8", torch.bfloat16)
    H, I = 352, 224  # two whole blocks of 128 and a tail of 96
    pool = HostExpertPool(2, ExpertLayout.build(WeightFormat.FP8_BLOCK, H, I), torch.bfloat16)
    pool.fill_random(seed=3, std=0.05)
    g = torch.Generator().manual_seed(3)
    for name in ("w13", "w2"):
        codes = pool.layout.view(pool.bank, name).view(torch.uint8)  # [2, rows, K] e4m3
        zero_exp = torch.tensor([s | m for s in (0, 0x80) for m in range(8)], dtype=torch.uint8)
        codes[0] = zero_exp[torch.randint(0, 16, codes[0].shape, generator=g)]  # expert 0: only such codes
        rows, K = codes.shape[1:]
        one = torch.randint(0, K, (rows,), generator=g)  # expert 1: one per row, in a random line
        codes[1, torch.arange(rows), one] = zero_exp[torch.randint(1, 8, (rows,), generator=g)]
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(5))
    for fid in (0, 1):
        work = [(fid, torch.tensor([0, 1, 3]), torch.tensor([0.5, 1.0, 0.25]))]
        ref = reference(pool, x, work, round_weights=False)
        assert ref.abs().max() > 0
        out = torch.zeros(4, H)
        native_executor(pool, isa, 1).run(x, work, out)
        assert _rel_err(out, ref) < TOL[torch.bfloat16], f"{isa} expert {fid}: relative error {_rel_err(out, ref):.2e}"


@pytest.mark.parametrize("HI", [(352, 224), (357, 229), (45, 21), (143, 137)])
@pytest.mark.parametrize("block", [(128, 64), (64, 32), (32, 16), (128, 256)])
@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_fp8_blocks_other_than_128(isa, block, HI):
    """FP8 blocks of 16, 32, 64 or 256 columns (the kernels accept power-of-two blocks from 16 up; no release has
    them): a scale per group of lanes in the whole blocks of 128, per chunk of 16 in the tail; rows shorter than
    a block, and tails that are not whole vectors."""
    _skip_unsupported(isa, "fp8", torch.bfloat16)
    H, I = HI
    pool = HostExpertPool(3, ExpertLayout.build(WeightFormat.FP8_BLOCK, H, I, block_size=block), torch.bfloat16)
    pool.fill_random(seed=9, std=0.05)
    scales = [pool.layout.view(pool.bank, f"{n}_scale") for n in ("w13", "w2")]
    g = torch.Generator().manual_seed(9)
    for sc in scales:  # scales 1/16 .. 16 times their filled values, so each group's scale shows
        sc.mul_(torch.exp2(torch.randint(-4, 5, sc.shape, generator=g).float()))
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(6))
    work = [(0, torch.tensor([0, 2, 4]), torch.tensor([0.5, 1.0, 0.25])),
            (2, torch.tensor([1, 2, 3, 4]), torch.tensor([1.0, 0.5, 0.75, 0.3]))]
    ref = reference(pool, x, work, round_weights=False)
    out = torch.zeros(5, H)
    native_executor(pool, isa, 2).run(x, work, out)
    assert _rel_err(out, ref) < TOL[torch.bfloat16], f"{isa} {block}: relative error {_rel_err(out, ref):.2e}"
    assert _differing(out, ref) < MAX_DIFFERING


@pytest.mark.parametrize("col", [130, 131, 300, 301])
@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_fp8_isolated_zero_exponent_codes(isa, col):
    """Each gate/up row holds one zero-exponent FP8 code (a subnormal, either sign), all in column ``col``, and
    x is one-hot there: gate and up are then exactly those codes times their scales, so a code read as zero or
    as a normal number shows at once. Columns in a whole block of 128 (even and odd element) and in the tail."""
    _skip_unsupported(isa, "fp8", torch.bfloat16)
    H, I = 357, 64
    pool = HostExpertPool(1, ExpertLayout.build(WeightFormat.FP8_BLOCK, H, I), torch.bfloat16)
    pool.fill_random(seed=3, std=0.05)
    codes = pool.layout.view(pool.bank, "w13").view(torch.uint8)  # [1, 2I, H]
    sub = torch.tensor([s | m for s in (0, 0x80) for m in range(1, 8)], dtype=torch.uint8)
    codes[0, :, col] = sub[torch.randint(0, 14, (codes.shape[1],), generator=torch.Generator().manual_seed(3))]
    x = torch.zeros(2, H)
    x[:, col] = torch.tensor([300.0, -200.0])
    work = [(0, torch.tensor([0, 1]), torch.tensor([1.0, 0.5]))]
    ref = reference(pool, x, work, round_weights=False)
    assert ref.abs().max() > 0
    out = torch.zeros(2, H)
    native_executor(pool, isa, 1).run(x, work, out)
    assert _rel_err(out, ref) < TOL[torch.bfloat16], f"{isa} column {col}: relative error {_rel_err(out, ref):.2e}"


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_flush_to_zero_on_the_calling_thread_changes_nothing(isa):
    """``torch.set_flush_denormal(True)`` sets flush-to-zero and denormals-are-zero on the calling thread, which
    runs part of every step (all of it with one thread): the executor turns both off while it runs (FP8
    subnormal codes pass through float32 subnormals), so an FP8 pool of zero-exponent codes gives the same
    bits with the flag as without, with one thread and with two."""
    _skip_unsupported(isa, "fp8", torch.bfloat16)
    H, I = 352, 224
    pool = HostExpertPool(1, ExpertLayout.build(WeightFormat.FP8_BLOCK, H, I), torch.bfloat16)
    pool.fill_random(seed=3, std=0.05)
    g = torch.Generator().manual_seed(4)
    zero_exp = torch.tensor([s | m for s in (0, 0x80) for m in range(8)], dtype=torch.uint8)
    for name in ("w13", "w2"):
        codes = pool.layout.view(pool.bank, name).view(torch.uint8)
        codes.copy_(zero_exp[torch.randint(0, 16, codes.shape, generator=g)])
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(5))
    work = [(0, torch.tensor([0, 1, 2]), torch.tensor([0.5, 1.0, 0.25]))]
    outs = []
    for threads in (1, 2):
        ex = native_executor(pool, isa, threads)
        for flush in (False, True):
            out = torch.zeros(3, H)
            if flush and not torch.set_flush_denormal(True):
                pytest.skip("no flush-to-zero control on this CPU")
            try:
                ex.run(x, work, out)
            finally:
                torch.set_flush_denormal(False)
            outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert _rel_err(outs[0], reference(pool, x, work, round_weights=False)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_token_tiles_and_remainders(fmt, isa):
    """Token counts that hit every tile shape of the kernels (one token x 4 rows, 2-4 x 2, 5-8 x 1 at the
    lower ISA levels, several tiles with a remainder) and, for FP8, chunks whose row count is not a multiple of
    the row block or smaller than it (FP4 rows come in whole chunks of 16): each token gets the bits it gets
    alone, and the reference's numbers."""
    _skip_unsupported(isa, fmt, torch.bfloat16)
    pool = _pool(fmt, "row-tails" if "row-tails" in SHAPES[fmt] else "odd", torch.bfloat16)
    ex = native_executor(pool, isa, 2)
    x = torch.randn(19, pool.hidden, generator=torch.Generator().manual_seed(19))
    wt = torch.rand(19, generator=torch.Generator().manual_seed(20)) + 0.1
    alone = torch.zeros(19, pool.hidden)
    for t in range(19):
        ex.run(x, [(2, torch.tensor([t]), wt[t:t + 1])], alone)
    for n in (2, 4, 5, 7, 8, 12, 19):
        toks = torch.arange(n)
        out = torch.zeros(19, pool.hidden)
        ex.run(x, [(2, toks, wt[:n])], out)
        assert torch.equal(out[:n], alone[:n]), f"{fmt}: {n} tokens on one expert"
        ref = reference(pool, x[:n], [(2, toks, wt[:n])], round_weights=False)
        assert _rel_err(out[:n], ref) < TOL[torch.bfloat16]


def test_fp4_integer_kernels_need_vnni():
    """The FP4 kernels of the avx512bf16 level multiply with `vpdpbusd`: without AVX-512 VNNI the level is
    skipped for MXFP4 and NVFP4 (FP8 keeps it). A CPU with AVX-VNNI but no AVX-512 runs them at avx2vnni, one with
    AVX2 only at avx2int (the same products from AVX2's byte multiply-adds), in bf16 only; every other format
    falls through those levels to avx2."""
    feats = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"]
    for fmt in ("mxfp4", "nvfp4"):
        assert native.select_isa(feats, None, FORMATS[fmt], torch.bfloat16) == "avx512"
        assert native.select_isa(feats + ["avx512_vnni"], None, FORMATS[fmt], torch.bfloat16) == "avx512bf16"
    assert native.select_isa(feats, None, FORMATS["fp8"], torch.bfloat16) == "avx512bf16"
    client = ["avx2", "fma", "avx_vnni"]  # AVX-VNNI without AVX-512 (Intel client cores since Alder Lake)
    for fmt in ("mxfp4", "nvfp4"):
        assert native.select_isa(client, None, FORMATS[fmt], torch.bfloat16) == "avx2vnni"
        assert native.select_isa(client, None, FORMATS[fmt], torch.float32) == "avx2"  # integer kernels: bf16 only
        assert native.select_isa(client, "avx2", FORMATS[fmt], torch.bfloat16) == "avx2"
        assert native.select_isa(client, "avx2int", FORMATS[fmt], torch.bfloat16) == "avx2int"
        assert native.select_isa(["avx2", "fma"], None, FORMATS[fmt], torch.bfloat16) == "avx2int"
        assert native.select_isa(["avx2", "fma"], None, FORMATS[fmt], torch.float32) == "avx2"
        assert native.select_isa(["avx2"], None, FORMATS[fmt], torch.bfloat16) == "scalar"  # AVX2 without FMA
    assert native.select_isa(client, None, FORMATS["fp8"], torch.bfloat16) == "avx2"
    assert native.select_isa(client, None, torch.bfloat16) == "avx2"


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_fp4_activation_lanes_at_the_edges(isa):
    """Activations whose lanes of 8 hold zeros only; a largest element with a full mantissa beside elements below
    2^-6 of it that the integer kernels round (two ties among them, rounded to even); bf16 subnormals beside normals,
    all exact; subnormals only (x near 2^-120, weights scaled by 2^120 so that the products stay normal): every
    level gives the reference's numbers, the integer kernels those of the reference that rounds the lanes as
    documented."""
    _skip_unsupported(isa, "mxfp4", torch.bfloat16)
    H, I = 256, 128
    pool = HostExpertPool(2, ExpertLayout.build(WeightFormat.MXFP4, H, I), torch.bfloat16)
    pool.fill_random(seed=9, std=0.05)
    pool.layout.view(pool.bank, "w13_scale").fill_(247)  # 2^120
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, H, generator=g) * 2.0**-120
    x[:, 0:8] = 0.0
    # largest 1.9921875 * 2^-118, unit 2^-131: 3.5 and -1.5 units are ties (to 4 and -2), 1.25 units -> 1
    x[:, 8:16] = torch.tensor([1.9921875, 2.0**-7, 1.75 * 2.0**-12, 1.25 * 2.0**-13, -1.5 * 2.0**-13,
                               1.0078125 * 2.0**-8, -1.5, 0.0]) * 2.0**-118
    # largest 2^-120, unit 2^-133 (the bf16 subnormal step): normals and subnormals, every one exact
    x[:, 16:24] = torch.tensor([1.0, -3 * 2.0**-10, 5 * 2.0**-13, 1.5 * 2.0**-1, 127 * 2.0**-13, 0.0, -(2.0**-6),
                                7 * 2.0**-11]) * 2.0**-120
    x[0, 24:32] = torch.tensor([1, -3, 5, 7, 0, 127, -64, 2]) * 2.0**-133  # subnormals only
    x[1, 32:40] *= 2.0**-9
    xb = x.to(torch.bfloat16).double()
    assert torch.equal(xb[:, 8:24], x[:, 8:24].double())  # the crafted lanes are bf16 values
    q = q15_lanes(xb)
    units = torch.tensor([16320.0, 64, 4, 1, -2, 32, -12288, 0], dtype=torch.float64)
    assert torch.equal(q[0, 8:16] / 2.0**-131, units)
    assert torch.equal(q[:, 16:40], xb[:, 16:40])  # exact lanes
    work = [(0, torch.tensor([0, 1]), torch.tensor([0.5, 1.0])), (1, torch.tensor([1]), torch.tensor([0.75]))]
    ref = reference(pool, x, work, round_weights=False, q15=_takes_q15(isa, "mxfp4", torch.bfloat16))
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-3
    out = torch.zeros(2, H)
    native_executor(pool, isa, 1).run(x, work, out)
    assert _rel_err(out, ref) < TOL[torch.bfloat16], f"{isa}: relative error {_rel_err(out, ref):.2e}"
    assert _differing(out, ref) < 0.005, f"{isa}: {_differing(out, ref):.1%} of outputs differ"


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("isa", native.ISA_LEVELS)
def test_a_non_finite_activation_reaches_the_output(isa, fmt, bad):
    """An infinity or NaN in a token's activation makes that token's output non-finite at every level (the integer
    kernels give its lane a NaN scale), and leaves the other tokens finite."""
    _skip_unsupported(isa, fmt, torch.bfloat16)
    H, I = 256, 128
    pool = HostExpertPool(2, ExpertLayout.build(FORMATS[fmt], H, I), torch.bfloat16)
    pool.fill_random(seed=9, std=0.05)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(1))
    x[0, 37] = bad
    out = torch.zeros(2, H)
    native_executor(pool, isa, 1).run(x, [(0, torch.tensor([0, 1]), torch.tensor([0.5, 1.0]))], out)
    assert not torch.isfinite(out[0]).any() and torch.isfinite(out[1]).all()


# ---------------------------------------------------------------------------- chunking
# How the executor cuts a call into chunks never changes its result: a call's two phases (gate/up rows per expert,
# then down rows of every expert) are cut into chunks that the pool's threads take in turn, four per thread by rows,
# or fewer where chunks would read less than ``min_chunk_bytes``. Shapes whose chunks are not multiples of 16 rows
# of themselves (the rule rounds them up), calls of 1-5 experts with every second one routed no token, floors that
# leave four chunks per thread, fewer, or one: 2 and 3 threads give bit for bit what 1 thread gives.

CHUNK_FORMATS = {"bf16": None, **FORMATS}  # the dense rows too
CHUNK_SHAPES = [(224, 800), (1056, 352)]  # (H, I): 4 chunks a thread of either phase is not a whole number of 16 rows
CHUNK_FLOORS = [0, 8 * 1024, native.DEFAULT_MIN_CHUNK_BYTES]  # by rows only; fewer chunks a thread; one chunk a thread


def _chunk_pool(fmt: str, H: int, I: int, compute: torch.dtype) -> HostExpertPool:
    if CHUNK_FORMATS[fmt] is None:
        pool = HostExpertPool.dense(6, H, I, torch.bfloat16)
    else:
        pool = HostExpertPool(6, ExpertLayout.build(CHUNK_FORMATS[fmt], H, I), compute)
    pool.fill_random(seed=5, std=0.05)
    return pool


@pytest.mark.parametrize("floor", CHUNK_FLOORS)
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", list(CHUNK_FORMATS))
@pytest.mark.parametrize("shape", CHUNK_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_chunking_gives_the_one_thread_result(fmt, shape, compute, floor):
    compute = getattr(torch, compute)
    if CHUNK_FORMATS[fmt] is None and compute == torch.float32:
        pytest.skip("a dense bf16 pool computes in bfloat16")
    H, I = shape
    pool = _chunk_pool(fmt, H, I, compute)
    fmt_or_dtype = CHUNK_FORMATS[fmt] or torch.bfloat16
    isas = native.supported_isas(fmt_or_dtype, compute)
    g = torch.Generator().manual_seed(1)
    for isa in isas:
        for T in (1, 3):
            x = torch.randn(T, H, generator=g)  # [T, H] float32
            for n_experts in (1, 3, 5):
                work = [(e, torch.arange(0 if e % 2 else T), torch.rand(0 if e % 2 else T, generator=g) + 0.1)
                        for e in range(n_experts)]  # every second expert routed no token
                outs = []
                for threads in (1, 2, 3):
                    out = torch.zeros(T, H)
                    native_executor(pool, isa, threads, floor).run(x, work, out)
                    outs.append(out)
                for threads, out in zip((2, 3), outs[1:]):
                    assert torch.equal(outs[0], out), (isa, T, n_experts, threads)


def _bf16_cases(n: int) -> torch.Tensor:
    """``[cases, n]`` bf16 bit patterns (as int16) that reach every branch of the Q15_LANES rounding: normal lanes of
    mixed binades (elements far below the largest round to zero, or exactly on a half), ties, negative zeros,
    subnormals beside normals, lanes of subnormals only, zeros, infinities and NaNs, exponents at both ends."""
    g = torch.Generator().manual_seed(11)
    rows = [torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())]
    rows.append(torch.randn(n, generator=g))  # one binade or two per lane
    bits = [r.to(torch.bfloat16).view(torch.int16) for r in rows]
    raw = torch.randint(-32768, 32768, (4, n), generator=g, dtype=torch.int32).to(torch.int16)  # any pattern
    bits += list(raw)
    sub = torch.randint(0, 128, (n,), generator=g, dtype=torch.int16) | (torch.randint(0, 2, (n,), generator=g,
                                                                                         dtype=torch.int16) << 15)
    bits.append(sub)  # subnormals and zeros of both signs only
    mixed = bits[0].clone()
    mixed[::3] = sub[::3]  # subnormals beside normals
    mixed[5::16] = 0x7f80  # +inf in some lanes
    mixed[9::64] = 0x7fc1  # NaN
    mixed[2::32] = -32768  # -0
    bits.append(mixed)
    ties = (torch.full((n,), 0x4000, dtype=torch.int16) | torch.randint(0, 128, (n,), generator=g,
                                                                           dtype=torch.int16))  # [2, 4)
    ties[::8] = 0x4700  # 2^15: the lane's largest, the others 13-15 binades below, on and off halves
    bits.append(ties)
    ends = torch.randint(0, 128, (n,), generator=g, dtype=torch.int16) | (0xfe << 7)  # the largest binade
    ends[1::2] = torch.randint(0x80, 0x100, (n // 2,), generator=g, dtype=torch.int16)  # the smallest normals
    bits.append(ends)
    return torch.stack(bits)


@pytest.mark.parametrize("n", [2048, 768, 2880, 136])
def test_each_levels_q15_store_writes_the_scalar_bytes(n):
    """The vectorized Q15_LANES stores (the avx512bf16 level's, and the one of the avx2vnni and avx2int levels) equal
    the scalar one byte for byte, whole rows and pieces starting at any multiple of 16 (as phase 1 stores its
    chunks), on every case of :func:`_bf16_cases`."""
    ext = native.load_extension()
    isas = native.supported_isas(WeightFormat.MXFP4)
    levels = [native.ISA_LEVELS.index(i) for i in isas]
    own = dict.fromkeys(levels, 0)
    nbytes = -(-n // 128) * 384
    for x in _bf16_cases(n):
        x = x.contiguous()
        pieces = [(0, n)] + [(k, min(n - k, 16 * (1 + k % 7))) for k in range(16, n, 176)]
        for k0, cnt in pieces:
            want = torch.full((nbytes,), 0x5a, dtype=torch.uint8)
            ext.q15_lanes_store(0, 4, want.data_ptr(), k0, x.data_ptr() + 2 * k0, cnt)
            for level in levels:
                got = torch.full((nbytes,), 0x5a, dtype=torch.uint8)
                own[level] += ext.q15_lanes_store(level, 4, got.data_ptr(), k0, x.data_ptr() + 2 * k0, cnt)
                assert torch.equal(got, want), (native.ISA_LEVELS[level], k0, cnt)
    for isa in {"avx512bf16", "avx2vnni", "avx2int"} & set(isas):
        assert own[native.ISA_LEVELS.index(isa)] > 0, isa  # the level's vector store ran
