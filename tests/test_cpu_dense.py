"""Dense linear layers on the native CPU executor (``NativeCpuExecutor.linear``, ``DenseKernels.linear``).

- ``linear`` matches a float64 reference at every ISA level this CPU has (bf16 and float32 weights,
  row/column tails, 1-17 rows, strided input, float32 and bf16 output) and does not depend on the
  thread count (bit-identical);
- ``edgemoe.layers.linear`` with the kernels bound runs a bf16 product with few rows natively (bias
  included), anything else (float32, many rows, nothing bound) is torch's own result; the executor's
  ``forward_threads`` sets torch's intra-op threads for a decode step and restores them;
- a CPU-only engine with the native executor decodes a bf16 model to the torch executor's logits
  within bf16 tolerance, and its forward runs the dense GEMVs, norms and decode attention natively;
  in a CPU-only decode step of every model family no bf16 product of few rows is left to torch;
- ``DenseKernels``: RMSNorm equals the torch module's bits but for norm statistics a float32 ulp apart
  (at most one bf16 ulp, in few elements); decode attention (q/k norm, RoPE, the K/V write, attention
  over paged KV) against the torch ops it replaces: the written values bitwise, keys within a bf16 ulp,
  the output within bf16 tolerance, for several sequences (one with no cached token), GQA and partial
  rotary;
- the one-call layers against the calls they replace: the attention layer (q/k/v GEMV, attention, o GEMV) and
  the residual add + norm bit for bit; the MoE layer with its softmax top-k router (ids equal, weights within a
  bf16 ulp of torch's, the output bit for bit over the same routes, ties to the lower expert, refusals) and with
  given routes (bit for bit); every family's CPU-only decode gives the same tokens, logits, counters and recorded
  routes with them as without; a route replaced on the block is honoured and a cache keeps its own path.

Skipped as a whole when the extension cannot be built here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from native_helpers import needs_native
from torch.overrides import TorchFunctionMode

from edgemoe.config import EngineConfig
from edgemoe.core import Phase, SeqSlice
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts import native
from edgemoe.experts.pool import HostExpertPool
from edgemoe.kvcache.pool import KVSpec, PagedKVPool
from edgemoe.layers.attention import write_and_attend
from edgemoe.layers.linear import Linear, linear
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models import FAMILIES
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat
from edgemoe.synth import make_model
from edgemoe.synth.archs import ARCHS

pytestmark = needs_native

_execs: dict = {}


def _executor(isa: str | None = None, threads: int = 2) -> native.NativeCpuExecutor:
    key = (isa, threads)
    if key not in _execs:
        pool = HostExpertPool(1, ExpertLayout.build(WeightFormat.BF16, 16, 16), torch.bfloat16)
        _execs[key] = native.NativeCpuExecutor(pool, threads, isa=isa, min_parallel_bytes=0, oversubscribe=True)
    return _execs[key]


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xr = x.to(torch.bfloat16) if w.dtype == torch.bfloat16 else x  # bf16 weights compute with bf16 x
    return xr.double() @ w.double().T


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K,M", [(37, 23, 1), (100, 80, 3), (4100, 2048, 1), (64, 96, 17)])
def test_linear_matches_float64_reference(isa, wdtype, N, K, M):
    if native.select_isa(native.load_extension().cpu_features(), isa, wdtype) != isa:
        pytest.skip(f"no {isa} kernel for {wdtype} on this CPU")
    g = torch.Generator().manual_seed(N + K + M)
    w = (torch.randn(N, K, generator=g) * 0.05).to(wdtype)
    x = torch.randn(M, K, generator=g).to(wdtype)
    ex = _executor(isa, 3)
    y = ex.linear(x, w)
    assert y.dtype == wdtype and y.shape == (M, N)
    ref = _ref(x, w)
    tol = 8e-3 if wdtype == torch.bfloat16 else 1e-5  # bf16 output: one rounding
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("isa", native.ISA_LEVELS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K", [(37, 23), (130, 2048), (64, 768)])
def test_a_token_alone_equals_its_row_in_a_batch(isa, wdtype, N, K):
    """One token's GEMV (rows read one after another where the kernel does so) gives the bits that token gets
    in a batch of 2-6 (rows read in blocks): the same operations per (row, token)."""
    if native.select_isa(native.load_extension().cpu_features(), isa, wdtype) != isa:
        pytest.skip(f"no {isa} kernel for {wdtype} on this CPU")
    g = torch.Generator().manual_seed(N * K)
    w = (torch.randn(N, K, generator=g) * 0.05).to(wdtype)
    x = torch.randn(6, K, generator=g).to(wdtype)
    ex = _executor(isa, 2)
    for m in (2, 3, 5, 6):
        batch = ex.linear(x[:m], w, out=torch.empty(m, N))
        for j in (0, m - 1):
            assert torch.equal(ex.linear(x[j:j + 1], w, out=torch.empty(1, N)), batch[j:j + 1])


def test_linear_output_formats_strides_and_thread_independence():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 130, generator=g) * 0.05).bfloat16()
    x_full = torch.randn(4, 200, generator=g)
    x = x_full[:, 10:140]  # rows 200 apart: a strided view
    ref = _ref(x, w)
    y32 = _executor(None, 1).linear(x, w, out=torch.empty(4, 300))
    assert (y32.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for threads in (2, 3):
        assert torch.equal(_executor(None, threads).linear(x, w, out=torch.empty(4, 300)), y32)
    y16 = _executor(None, 2).linear(x.bfloat16(), w)
    assert torch.equal(y16, y32.bfloat16())  # rounded once from the same float32 sums
    y3d = _executor(None, 2).linear(x.bfloat16().view(2, 2, 130), w)
    assert torch.equal(y3d.view(4, 300), y16)


def test_linear_rejects_bad_arguments():
    ex = _executor()
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        ex.linear(torch.zeros(2, 15, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="rows contiguous"):
        ex.linear(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16).T)
    with pytest.raises(TypeError, match="float32 and bfloat16"):
        ex.linear(torch.zeros(2, 16, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="out"):
        ex.linear(torch.zeros(2, 16, dtype=torch.bfloat16), w, out=torch.empty(2, 7))


def test_bound_linears_run_bf16_gemvs_natively_and_leave_the_rest_to_torch():
    ex = _executor()
    dense = native.DenseKernels(ex)
    assert dense.max_linear_rows == ex.max_tokens_per_expert == 16
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(3, 64, generator=g).bfloat16()
    many = torch.randn(40, 64, generator=g).bfloat16()
    w32, x32 = w.float(), x.float()
    y = linear(x, w, None, dense)
    yb = linear(x, w, b, dense)
    y_many = linear(many, w, None, dense)
    y32 = linear(x32, w32, None, dense)
    lin = Linear(64, 96, bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    y_torch = lin(x)  # nothing bound: torch
    lin.cpu_dense = dense
    y_mod = lin(x)
    assert torch.equal(y, ex.linear(x, w)) and torch.equal(y_mod, y) and torch.equal(y_torch, F.linear(x, w))
    assert torch.equal(yb, (ex.linear(x, w, out=torch.empty(3, 96)) + b).bfloat16())
    assert torch.equal(y_many, F.linear(many, w)) and torch.equal(y32, F.linear(x32, w32))
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    assert dense.takes_linear(x, w, None) and not dense.takes_linear(many, w, None)
    assert not dense.takes_linear(x32, w32, None) and not native.DenseKernels().takes_linear(x, w, None)
    with pytest.raises(ValueError, match="at most 16 rows"):
        dense.linear(many, w)
    threads = torch.get_num_threads()
    with ex.forward_threads(1):
        assert torch.get_num_threads() == ex.plan.torch_threads
    assert torch.get_num_threads() == threads
    with ex.forward_threads(40):  # a prefill chunk: torch's threads unchanged
        assert torch.get_num_threads() == threads


@pytest.fixture(scope="module")
def small_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-bf16-cpu")
    make_model(out, "qwen3_moe", "small", seed=7, dtype="bfloat16")
    return out


def _decode(runner: ModelRunner, prompt: list[int], steps: int) -> torch.Tensor:
    tok = int(runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)[0].argmax())
    out = []
    for s in range(steps):
        logits = runner.execute([StepInput(0, [tok], len(prompt) + s)], Phase.DECODE)
        out.append(logits[0].float())
        tok = int(logits[0].argmax())
    runner.free(0)
    return torch.stack(out)


def test_cpu_engine_runs_dense_gemvs_natively_and_matches_torch(small_bf16, monkeypatch):
    cfg = dict(device="cpu", expert_policy="cpu-all", cpu_threads=2)
    nat = ModelRunner(small_bf16, EngineConfig(cpu_executor="native", **cfg), progress=False)
    ref = ModelRunner(small_bf16, EngineConfig(cpu_executor="torch", **cfg), progress=False)
    assert nat.experts.cpu_executor.name.startswith("native")
    calls = []
    linear = native.NativeCpuExecutor._linear_checked  # what every native GEMV of a step goes through

    def counting(self, x, weight, out):
        calls.append((tuple(weight.shape), x.numel() // x.shape[-1]))
        return linear(self, x, weight, out)

    monkeypatch.setattr(native.NativeCpuExecutor, "_linear_checked", counting)
    attn_calls = []
    attention_layer = native.DenseKernels.try_attention_layer

    def counting_attention(self, x, *args, **kw):
        y = attention_layer(self, x, *args, **kw)
        attn_calls.append(None if y is None else x.shape[0])
        return y

    monkeypatch.setattr(native.DenseKernels, "try_attention_layer", counting_attention)
    moe_calls = []
    moe_decode = native.DenseKernels.try_moe_decode

    def counting_moe(self, x, router_weight, top_k, norm_topk_prob, id_base, residual=None):
        got = moe_decode(self, x, router_weight, top_k, norm_topk_prob, id_base, residual)
        moe_calls.append(got is not None and residual is not None)
        return got

    monkeypatch.setattr(native.DenseKernels, "try_moe_decode", counting_moe)
    prompt = list(range(5, 30))
    a = _decode(nat, prompt, 6)
    cfgm = nat.model_config
    shapes = {shape for shape, _ in calls}
    assert (cfgm.vocab_size, cfgm.hidden_size) in shapes  # the LM head
    # the attention projections and the router: inside the layer's one call each (attention, MoE)
    assert ((cfgm.num_heads + 2 * cfgm.num_kv_heads) * cfgm.head_dim, cfgm.hidden_size) not in shapes  # fused q/k/v
    assert (cfgm.num_experts, cfgm.hidden_size) not in shapes
    # every decode step's MoE layers ran as one native call each (router, experts and the residual add)
    assert moe_calls == [True] * (6 * len(cfgm.moe_layers))
    # the 25-row prefill's projections stayed with torch (a GEMM); its LM head row (1) did not
    assert max(rows for _, rows in calls) == 1
    assert attn_calls == [1] * (6 * cfgm.num_layers)  # every decode step's attention layer as one call
    assert ref.experts.cpu_executor.dense is None
    b = _decode(ref, prompt, 6)
    # same greedy path for the first steps, logits within bf16 tolerance of the torch ops
    assert a[0].argmax() == b[0].argmax()
    torch.testing.assert_close(a[0], b[0], rtol=0.05, atol=0.05 * float(b[0].abs().max()))


class _TorchLinears(TorchFunctionMode):
    """Records the ``F.linear`` calls that reach torch (a product the native kernels took never calls it)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.calls.append((args[0].dtype, tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c.model_types[0])
def test_cpu_decode_step_leaves_no_bf16_gemv_to_torch(family, tmp_path):
    """Every dense product of a CPU-only decode step (projections, routers, shared experts, the LM head) runs on
    the native kernels, in every family: a linear layer that the runner does not bind would fall back to torch's
    bf16 GEMV, a fraction of the read bandwidth, with no other symptom."""
    arch = family.model_types[0]
    preset = next(p for p in ARCHS[arch].presets if "tiny" in p)
    path = make_model(tmp_path / "m", arch, preset, seed=3, dtype="bfloat16")
    runner = ModelRunner(path, EngineConfig(device="cpu", expert_policy="cpu-all", cpu_threads=2,
                                            cpu_executor="native"), progress=False)
    prompt = list(range(5, 25))
    tok = int(runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)[0].argmax())
    with _TorchLinears() as seen:
        runner.execute([StepInput(0, [tok], len(prompt))], Phase.DECODE)
    rows = runner.experts.cpu_executor.max_tokens_per_expert
    left = [c for c in seen.calls if c[0] == torch.bfloat16 and math.prod(c[1][:-1]) <= rows]
    assert not left, f"bf16 GEMVs left to torch in a {family.__name__} decode step: {left}"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("float32_scale", [False, True])
@pytest.mark.parametrize("rows,n", [(1, 2048), (7, 128), (64, 96), (3, 37)])
def test_dense_rms_norm_matches_the_torch_module(float32_scale, rows, n):
    dense = native.DenseKernels()
    g = torch.Generator().manual_seed(rows * n)
    norm = RMSNorm(n, 1e-6, float32_scale=float32_scale)
    norm.weight.data = (torch.randn(n, generator=g) * 0.5 + 1).bfloat16()
    x = (torch.randn(rows, n, generator=g) * 3).bfloat16()
    want = norm(x)
    got = dense.rms_norm(x, norm.weight, norm.eps, float32_scale)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert int(_ulps(got, want).max()) <= 1 and float((got != want).float().mean()) < 0.02
    assert torch.equal(dense.rms_norm(x[:, None, :], norm.weight, norm.eps, float32_scale)[:, 0], got)  # [..., D]
    assert dense.takes_norm(x, norm.weight) and not dense.takes_norm(x.float(), norm.weight)
    assert not dense.takes_norm(torch.zeros(65, n, dtype=torch.bfloat16), norm.weight)  # a prefill: torch's threads
    with pytest.raises(ValueError, match="bf16 CPU tensors"):
        dense.rms_norm(x.float(), norm.weight, norm.eps)


@pytest.mark.parametrize("float32_scale", [False, True])
@pytest.mark.parametrize("rows,n", [(1, 2048), (5, 96), (2, 37)])
def test_dense_add_rms_norm_is_the_residual_add_then_the_norm(float32_scale, rows, n):
    """``RMSNorm.add_forward`` with the kernels bound (one native call): the residual sum bit for bit torch's bf16
    add, the normalized value as :meth:`DenseKernels.rms_norm` of that sum (itself within a bf16 ulp of torch)."""
    dense = native.DenseKernels()
    g = torch.Generator().manual_seed(rows * n)
    norm = RMSNorm(n, 1e-6, float32_scale=float32_scale)
    norm.weight.data = (torch.randn(n, generator=g) * 0.5 + 1).bfloat16()
    x = (torch.randn(rows, n, generator=g) * 3).bfloat16()
    delta = (torch.randn(rows, n, generator=g) * 2).bfloat16()
    r_ref, y_ref = norm.add_forward(x, delta)  # nothing bound: torch's add and norm
    norm.cpu_dense = dense
    r, y = norm.add_forward(x, delta)
    assert torch.equal(r, x + delta) and torch.equal(r, r_ref)
    assert torch.equal(y, dense.rms_norm(r, norm.weight, norm.eps, float32_scale))
    assert int(_ulps(y, y_ref).max()) <= 1
    assert dense.try_add_rms_norm(x.float(), delta.float(), norm.weight, norm.eps) is None  # float32: torch's
    assert dense.try_add_rms_norm(x, delta[:, :-1].contiguous(), norm.weight, norm.eps) is None


def _rotary(head_dim: int, partial: float) -> RotaryEmbedding:
    cfg = SimpleNamespace(head_dim=head_dim, partial_rotary_factor=partial, rope_parameters={"rope_theta": 10000.0})
    return RotaryEmbedding(cfg)


def _paged_decode(hk: int, d: int, lens: list[int], ps: int, g: torch.Generator):
    """A paged KV pool of random bf16 keys / values holding sequences of ``lens`` tokens (the last one the new
    token of a decode step), and that step's pieces: ``(kv, tables, pos, slots, seqs, batch)``, ``batch()`` a fresh
    ``ForwardBatch``-like namespace (its own step cache)."""
    T = len(lens)
    kv = PagedKVPool(KVSpec.heads(1, hk, d), sum(-(-n // ps) for n in lens), ps, torch.bfloat16, torch.device("cpu"))
    for i, n in enumerate(lens):
        kv.allocate(i, n)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).bfloat16())
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).bfloat16())
    tables = [kv.page_table(i) for i in range(T)]
    pos = torch.tensor([n - 1 for n in lens])
    slots = torch.stack([tables[i][pos[i] // ps] * ps + pos[i] % ps for i in range(T)])
    seqs = [SeqSlice(seq_id=i, q_start=i, q_len=1, kv_len=n, page_table=tables[i]) for i, n in enumerate(lens)]

    def batch():
        return SimpleNamespace(seqs=seqs, kv_slots=slots, positions=pos, decode=None, step_cache={})

    return kv, tables, pos, slots, seqs, batch


@pytest.mark.parametrize("hq,hk,d,partial,lens", [
    (8, 2, 64, 1.0, [9, 1, 22]),  # the second sequence's only token is the new one
    (4, 4, 32, 0.5, [9, 1, 22]),
    (6, 1, 48, 1.0, [9, 1, 22]),
    (16, 2, 128, 1.0, [300, 129, 128]),  # sequences of several key chunks (kAttnChunk = 128), merged
    (12, 1, 256, 1.0, [257, 5]),
])
def test_dense_decode_attention_matches_the_torch_ops(hq, hk, d, partial, lens):
    dense = native.DenseKernels()
    g = torch.Generator().manual_seed(hq * 100 + d)
    ps, T = 4, len(lens)
    kv_ref, tables, pos, slots, seqs, batch = _paged_decode(hk, d, lens, ps, g)
    kv_nat = PagedKVPool(KVSpec.heads(1, hk, d), kv_ref.num_pages, ps, torch.bfloat16, torch.device("cpu"))
    kv_nat.k.copy_(kv_ref.k)
    kv_nat.v.copy_(kv_ref.v)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 2).bfloat16()
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)  # strided views, as a fused projection gives
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    q_norm.weight.data = (torch.randn(d, generator=g) * 0.3 + 1).bfloat16()
    k_norm.weight.data = (torch.randn(d, generator=g) * 0.3 + 1).bfloat16()
    rot, scale = _rotary(d, partial), d ** -0.5
    b = batch()
    qr, kr = rot(q_norm(q.reshape(T, hq, d)), k_norm(k.reshape(T, hk, d)), pos, b.step_cache)
    want = write_and_attend(qr, kr, v.reshape(T, hk, d), kv_ref, 0, b, scale)
    b = batch()
    cos, sin = rot.step_tables(pos, torch.bfloat16, b.step_cache)
    assert dense.takes_decode_attention(q, kv_nat.k[0], b)
    got = dense.decode_attention(q, k, v, q_norm=q_norm.weight, k_norm=k_norm.weight, eps=1e-6, float32_scale=False,
                                 cos=cos, sin=sin, k_cache=kv_nat.k[0], v_cache=kv_nat.v[0], batch=b, page_size=ps,
                                 scale=scale)
    assert got.shape == (T, hq, d) and got.dtype == torch.bfloat16
    assert torch.equal(kv_nat.v, kv_ref.v)
    assert int(_ulps(kv_nat.k, kv_ref.k).max()) <= 1
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for threads in (1, 2, 3):  # on an executor's pool: chunks and merges shared, the same result bit for bit
        k_cache, v_cache = kv_nat.k[0].clone(), kv_nat.v[0].clone()
        b = batch()
        on_pool = native.DenseKernels(_executor(None, threads)).decode_attention(
            q, k, v, q_norm=q_norm.weight, k_norm=k_norm.weight, eps=1e-6, float32_scale=False, cos=cos, sin=sin,
            k_cache=k_cache, v_cache=v_cache, batch=b, page_size=ps, scale=scale)
        assert torch.equal(on_pool, got) and torch.equal(k_cache, kv_nat.k[0]) and torch.equal(v_cache, kv_nat.v[0])
    for bad, match in ((dict(kv_slots=slots[:-1]), "KV slots for"), (dict(kv_slots=slots + 10_000), "for a cache of"),
                       (dict(seqs=[SeqSlice(seq_id=0, q_start=0, q_len=1, kv_len=9, page_table=tables[0][:1]),
                                   *seqs[1:]]), "pages for")):
        b = batch()
        for name, value in bad.items():
            setattr(b, name, value)
        with pytest.raises(ValueError, match=match):
            dense.decode_attention(q, k, v, q_norm=None, k_norm=None, eps=1e-6, float32_scale=False, cos=None,
                                   sin=None, k_cache=kv_nat.k[0], v_cache=kv_nat.v[0], batch=b, page_size=ps,
                                   scale=scale)
    assert not dense.takes_decode_attention(q[:0], kv_nat.k[0], SimpleNamespace(seqs=[], decode=None))
    long = [SeqSlice(seq_id=i, q_start=i, q_len=1, kv_len=200_000, page_table=tables[i]) for i in range(T)]
    assert dense.takes_decode_attention(q, kv_nat.k[0], SimpleNamespace(seqs=long, decode=None))  # any length
    prefill = SimpleNamespace(seqs=[SeqSlice(seq_id=0, q_start=0, q_len=3, kv_len=9, page_table=tables[0])],
                              decode=None, step_cache={})
    assert not dense.takes_decode_attention(q[:3], kv_nat.k[0], prefill)
    with pytest.raises(ValueError, match="one token per sequence"):
        dense.decode_attention(q[:3], k[:3], v[:3], q_norm=None, k_norm=None, eps=1e-6, float32_scale=False,
                               cos=None, sin=None, k_cache=kv_nat.k[0], v_cache=kv_nat.v[0], batch=prefill,
                               page_size=ps, scale=scale)


def test_dense_kernels_do_not_keep_a_replaced_executor_alive():
    """The executor caches its ``DenseKernels``, which holds it weakly: dropping the executor (a thread-count
    change replaces it) frees it and its pool at once, without waiting for the cycle collector."""
    import gc
    import weakref

    pool = HostExpertPool(1, ExpertLayout.build(WeightFormat.BF16, 16, 16), torch.bfloat16)
    ex = native.NativeCpuExecutor(pool, 1, min_parallel_bytes=0)
    dense = ex.dense
    x, w = torch.ones(1, 16, dtype=torch.bfloat16), torch.ones(4, 16, dtype=torch.bfloat16)
    assert torch.equal(dense.linear(x, w), torch.full((1, 4), 16.0, dtype=torch.bfloat16))
    alive = weakref.ref(ex)
    gc.disable()
    try:
        del ex
        assert alive() is None
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="closed"):
        dense.linear(x, w)


def test_dense_decode_attention_skips_a_chunk_of_minus_infinite_scores():
    """Keys whose every score is -inf hold no weight: a 128-key chunk of them leaves the other chunk's softmax
    (torch's softmax gives them weight 0), on one thread and on a pool."""
    hq, hk, d, ps, n = 4, 1, 32, 16, 256
    g = torch.Generator().manual_seed(5)
    kv = PagedKVPool(KVSpec.heads(1, hk, d), n // ps, ps, torch.bfloat16, torch.device("cpu"))
    kv.allocate(0, n)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).bfloat16())
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).bfloat16())
    table = kv.page_table(0)
    slots_of = (table.repeat_interleave(ps) * ps + torch.arange(n) % ps)  # position -> slot
    kv.k[0][slots_of[:128]] = float("-inf")  # the first chunk: every score -inf against a positive query
    q = torch.rand(1, hq * d, generator=g).bfloat16() + 0.5
    k, v = kv.k[0][slots_of[-1]].reshape(1, -1).clone(), kv.v[0][slots_of[-1]].reshape(1, -1).clone()
    pos = torch.tensor([n - 1])
    seqs = [SeqSlice(seq_id=0, q_start=0, q_len=1, kv_len=n, page_table=table)]
    ks, vs = kv.k[0][slots_of].float(), kv.v[0][slots_of].float()  # [n, 1, d]
    p = torch.softmax((ks[:, 0] @ q.view(hq, d).float().T) * d ** -0.5, dim=0)  # [n, hq]
    want = (p.T @ vs[:, 0]).view(1, hq, d)
    for dense in (native.DenseKernels(), native.DenseKernels(_executor(None, 2))):
        b = SimpleNamespace(seqs=seqs, kv_slots=slots_of[-1:], positions=pos, decode=None, step_cache={})
        got = dense.decode_attention(q, k, v, q_norm=None, k_norm=None, eps=1e-6, float32_scale=False, cos=None,
                                     sin=None, k_cache=kv.k[0], v_cache=kv.v[0], batch=b, page_size=ps,
                                     scale=d ** -0.5)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _routing_reference(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax top-k router's torch ops (``TopKRouter``) with the documented tie rule (equal probabilities:
    the lower expert first): ``(ids [T, k], weights [T, k] bf16)``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    order = torch.sort(-probs, dim=-1, stable=True).indices[:, :k]
    w = probs.gather(1, order)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return order, w.to(logits.dtype)


@pytest.mark.parametrize("T,k,norm,with_residual,threads", [
    (1, 8, True, True, 1), (1, 8, True, False, 3), (3, 2, False, True, 2), (8, 4, True, True, 3),
    (5, 1, True, False, 2)])
def test_moe_decode_matches_router_experts_and_residual_of_the_python_path(T, k, norm, with_residual, threads):
    """``DenseKernels.try_moe_decode`` (one native call) against the ops it replaces: the router's bf16 logits
    (``linear``) through torch's softmax / top-k, the routes grouped by expert through ``run_grouped`` into a
    float32 sum, ``.to(bfloat16)`` and the residual add. Ids equal, weights within a bf16 ulp of torch's, and
    the output bit for bit the Python path's over the same routes and weights."""
    E, H, I, layers = 16, 64, 32, 3
    pool = HostExpertPool.dense(layers * E, H, I, torch.bfloat16)
    pool.fill_random(seed=T + k, std=0.1)
    ex = native.NativeCpuExecutor(pool, threads, min_parallel_bytes=0, oversubscribe=True)
    dense = ex.dense
    g = torch.Generator().manual_seed(100 * T + k)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    router = (torch.randn(E, H, generator=g) * 0.3).to(torch.bfloat16)
    residual = torch.randn(T, H, generator=g).to(torch.bfloat16) if with_residual else None
    layer = 2
    out, ids, weights, n = dense.try_moe_decode(x, router, k, norm, layer * E, residual)
    logits = dense.linear(x, router)
    ref_ids, ref_w = _routing_reference(logits, k, norm)
    assert torch.equal(ids, ref_ids)
    assert int(_ulps(weights, ref_w).max()) <= 1
    assert n == len(set((ids + layer * E).flatten().tolist()))
    flat = ids + layer * E
    order = flat.reshape(-1).argsort(stable=True)
    fids, counts = torch.unique(flat, return_counts=True)
    acc = torch.zeros(T, H)
    ex.run_grouped(x, fids.tolist(), counts.tolist(), order // k, weights.reshape(-1)[order].float(), acc)
    expect = acc.to(torch.bfloat16)
    if residual is not None:
        expect = residual + expect
    assert torch.equal(out, expect)


def test_moe_decode_breaks_ties_at_the_kth_place_toward_the_lower_expert():
    E, H = 8, 32
    pool = HostExpertPool.dense(E, H, 32, torch.bfloat16)
    pool.fill_random(seed=1, std=0.1)
    ex = native.NativeCpuExecutor(pool, 1, min_parallel_bytes=0)
    dense = ex.dense
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    router = torch.zeros(E, H, dtype=torch.bfloat16)
    router[:, 0] = torch.tensor([0.5, 2.0, 1.0, 1.0, 2.0, 1.0, 0.0, 1.0])  # logits, ties at the 3rd place
    _, ids, weights, _ = dense.try_moe_decode(x, router, 3, False, 0)
    assert ids.tolist() == [[1, 4, 2]]
    assert weights[0, 0] == weights[0, 1] and weights[0, 1] > weights[0, 2]


def test_moe_decode_refuses_what_it_does_not_take():
    pool = HostExpertPool.dense(8, 32, 32, torch.bfloat16)
    pool.fill_random(seed=2, std=0.1)
    ex = native.NativeCpuExecutor(pool, 1, min_parallel_bytes=0)
    x = torch.randn(2, 32).to(torch.bfloat16)
    router = torch.randn(8, 32).to(torch.bfloat16)
    dense = ex.dense
    assert dense.try_moe_decode(x.float(), router, 2, True, 0) is None  # float32 activations
    assert dense.try_moe_decode(x, router[:, :16], 2, True, 0) is None  # router width != hidden
    assert dense.try_moe_decode(x, router, 9, True, 0) is None  # k > E
    assert dense.try_moe_decode(x, router, 2, True, 0, residual=x[:1]) is None  # residual shape
    with pytest.raises(IndexError):
        dense.try_moe_decode(x, router, 2, True, 8)  # experts 8.. are not in the pool


@pytest.mark.parametrize("hq,hk,d,lens,threads", [(8, 2, 64, [9, 1, 22], 2), (16, 4, 128, [300, 129], 3),
                                                  (4, 4, 32, [5], 1)])
def test_attention_layer_is_the_qkv_gemv_attention_and_o_gemv_bit_for_bit(hq, hk, d, lens, threads):
    """``DenseKernels.try_attention_layer`` (one native call) against the three calls it replaces on the same
    executor: the fused q/k/v GEMV (``linear``), ``decode_attention`` over its columns and the o GEMV: the output
    and the K/V written into the cache bit for bit."""
    g = torch.Generator().manual_seed(hq + d)
    H, ps, T = 96, 4, len(lens)
    dense = native.DenseKernels(_executor(None, threads))
    kv_a, _, pos, _, _, batch = _paged_decode(hk, d, lens, ps, g)
    k_b, v_b = kv_a.k[0].clone(), kv_a.v[0].clone()
    x = torch.randn(T, H, generator=g).bfloat16()
    w_qkv = (torch.randn((hq + 2 * hk) * d, H, generator=g) * 0.1).bfloat16()
    w_o = (torch.randn(H, hq * d, generator=g) * 0.1).bfloat16()
    q_norm = (torch.randn(d, generator=g) * 0.3 + 1).bfloat16()
    cos, sin = _rotary(d, 1.0).tables(pos, torch.bfloat16)
    common = dict(q_norm=q_norm, k_norm=q_norm, eps=1e-6, float32_scale=False, cos=cos, sin=sin, page_size=ps,
                  scale=d ** -0.5)
    got = dense.try_attention_layer(x, w_qkv, w_o, k_cache=kv_a.k[0], v_cache=kv_a.v[0], batch=batch(), **common)
    q, k, v = dense.linear(x, w_qkv).split([hq * d, hk * d, hk * d], dim=-1)
    o = dense.decode_attention(q, k, v, k_cache=k_b, v_cache=v_b, batch=batch(), **common)
    want = dense.linear(o.reshape(T, hq * d), w_o)
    assert got.shape == (T, H) and torch.equal(got, want)
    assert torch.equal(kv_a.k[0], k_b) and torch.equal(kv_a.v[0], v_b)
    # what it does not take: a bias-less fused matrix of another width, float32 input, no executor
    assert dense.try_attention_layer(x, w_qkv[:-d], w_o, k_cache=k_b, v_cache=v_b, batch=batch(), **common) is None
    assert dense.try_attention_layer(x.float(), w_qkv, w_o, k_cache=k_b, v_cache=v_b, batch=batch(), **common) is None
    assert native.DenseKernels().try_attention_layer(x, w_qkv, w_o, k_cache=k_b, v_cache=v_b, batch=batch(),
                                                     **common) is None


@pytest.mark.parametrize("T,k,wdtype", [(1, 8, torch.float32), (4, 3, torch.bfloat16), (9, 2, torch.float32)])
def test_moe_routes_equal_the_grouped_python_path(T, k, wdtype):
    """``DenseKernels.try_moe_routes`` (routes any router computed: one native call from the grouping to the bf16
    rounding) against ``group_routes`` + ``run_grouped`` + ``.to(bfloat16)``, bit for bit; ids outside the layer
    raise."""
    from edgemoe.experts.hybrid import group_routes

    E, H, I = 16, 64, 32
    pool = HostExpertPool.dense(2 * E, H, I, torch.bfloat16)
    pool.fill_random(seed=T * k, std=0.1)
    ex = native.NativeCpuExecutor(pool, 2, min_parallel_bytes=0, oversubscribe=True)
    g = torch.Generator().manual_seed(T + 10 * k)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
    weights = torch.rand(T, k, generator=g).to(wdtype)
    out, n = ex.dense.try_moe_routes(x, ids, weights, E, E)
    fids, counts, order = group_routes(ids + E)
    acc = torch.zeros(T, H)
    ex.run_grouped(x, fids, counts, order // k, weights.reshape(-1)[order].float(), acc)
    assert torch.equal(out, acc.to(torch.bfloat16)) and n == len(fids)
    with pytest.raises(IndexError):
        ex.dense.try_moe_routes(x, ids + E, weights, E, 0)  # ids beyond the layer's experts
    with pytest.raises(IndexError):
        ex.dense.try_moe_routes(x, ids, weights, E, 2 * E)  # a layer beyond the pool
    assert ex.dense.try_moe_routes(x.float(), ids, weights, E, 0) is None


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c.model_types[0])
def test_one_call_layers_change_nothing_but_speed(family, tmp_path, monkeypatch):
    """A CPU-only engine of every family decodes the same tokens, logits and expert counters with the one-call
    layers (attention layer, add + norm, MoE layer with its router or with given routes) as with each of them
    refused (the separate native calls and torch operations they replace): bit for bit but for the softmax
    router's float32 rounding (weights within a bf16 ulp)."""
    arch = family.model_types[0]
    preset = next(p for p in ARCHS[arch].presets if "tiny" in p)
    path = make_model(tmp_path / "m", arch, preset, seed=5, dtype="bfloat16")
    cfg = EngineConfig(device="cpu", expert_policy="cpu-all", cpu_threads=2, cpu_executor="native")
    prompt = list(range(3, 20))
    taken = []

    def run():
        runner = ModelRunner(path, cfg, progress=False)
        trace = []
        runner.record = lambda batch, layer, ids, weights: trace.append(
            (batch.phase.value, layer, ids.tolist(), weights.float().tolist()))
        logits = _decode(runner, prompt, 4)
        return logits, (runner.experts.stats()["decode"], trace)

    for name in ("try_moe_decode", "try_moe_routes", "try_attention_layer", "try_add_rms_norm"):
        method = getattr(native.DenseKernels, name)

        def counting(self, *a, _m=method, _n=name, **kw):
            got = _m(self, *a, **kw)
            taken.append(_n if got is not None else None)
            return got

        monkeypatch.setattr(native.DenseKernels, name, counting)
    fused, fused_stats = run()
    assert {n for n in taken if n} & {"try_moe_decode", "try_moe_routes"}  # some MoE layer took one call
    for name in ("try_moe_decode", "try_moe_routes", "try_attention_layer", "try_add_rms_norm"):
        monkeypatch.setattr(native.DenseKernels, name, lambda self, *a, **kw: None)
    plain, plain_stats = run()
    assert fused_stats[0] == plain_stats[0]  # expert counters
    f_trace, p_trace = fused_stats[1], plain_stats[1]  # the recorded routes: same ids in the same order
    assert [t[:3] for t in f_trace] == [t[:3] for t in p_trace] and len(f_trace) > 0
    if "try_moe_decode" not in taken:  # routers in the family's own code: the same numbers throughout
        assert torch.equal(fused, plain) and f_trace == p_trace
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    torch.testing.assert_close(fused, plain, rtol=0.02, atol=0.02 * float(plain.abs().max()))


def test_cpu_decode_keeps_a_replaced_route_and_a_cache_off_the_one_call_router(small_bf16, monkeypatch):
    """The MoE layer's one native call computes the block's own router only: a ``route`` replaced on the block
    (the decode benchmark's uniform or trace routing) is what the experts get, through the given-routes call; and
    a CPU engine with expert cache slots keeps the cache path (hits and fills), not the one call."""
    prompt = list(range(4, 20))
    runner = ModelRunner(small_bf16, EngineConfig(device="cpu", expert_policy="cpu-all", cpu_threads=2,
                                                  cpu_executor="native"), progress=False)
    blocks = runner.model.moe_blocks()
    E, k = runner.model_config.num_experts, runner.model_config.top_k
    calls = []
    for blk in blocks:
        def fixed(x, valid=None, _blk=blk):
            calls.append(_blk.moe_layer)
            ids = torch.arange(k).repeat(x.shape[0], 1) + _blk.moe_layer % (E - k)  # [T, k]
            return ids, torch.full(ids.shape, 1.0 / k, dtype=x.dtype)
        blk.route = fixed
    seen = []
    runner.record = lambda batch, layer, ids, weights: seen.append((batch.phase.value, layer, ids[0].tolist()))
    _decode(runner, prompt, 3)
    assert len(calls) == 4 * len(blocks)  # the prefill's and every decode step's MoE layers
    decode = [(layer, ids) for phase, layer, ids in seen if phase == "decode"]
    assert decode and all(ids == [i + layer % (E - k) for i in range(k)] for layer, ids in decode)

    cached = ModelRunner(small_bf16, EngineConfig(device="cpu", expert_policy="fill-all", cpu_threads=2,
                                                  cpu_executor="native", expert_cache_slots=8), progress=False)
    took = []
    moe_decode = native.DenseKernels.try_moe_decode

    def counting(self, *a, **kw):
        took.append(True)
        return moe_decode(self, *a, **kw)

    monkeypatch.setattr(native.DenseKernels, "try_moe_decode", counting)
    _decode(cached, prompt, 3)
    assert not took and cached.experts.stats()["decode"]["hits"] + cached.experts.stats()["decode"]["fills"] > 0
