"""CUDA checks of the fused q/k/v projection (``edgemoe.layers.attention.FusedQKV``): a bfloat16 model on
CUDA fuses at load, and decodes like the same model with three projections to bfloat16 rounding (cuBLAS
may pick another kernel for the fused GEMM: the bits are not promised); the GEMV at Qwen3-30B-A3B sizes,
fused against separate (equality measured and reported), and its time in a CUDA graph.

Measured numbers are printed (run with ``-s``) and, when ``$OUT`` is set, appended as JSON lines to
``$OUT/fused_qkv_gpu.jsonl``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from perf import capture, replay_us, report

from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.layers.attention import FusedQKV
from edgemoe.models.base import MoECausalLM
from edgemoe.synth import make_model

from conftest import greedy_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
PROMPT = list(range(5, 45))


def _report(name: str, **values) -> None:
    report("fused_qkv_gpu.jsonl", name, **values)


def _graph_us(fn, iters: int = 500) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph."""
    return replay_us(capture(fn)[0][0], iters)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_bf16_model_fuses_and_decodes_like_three_projections(tmp_path, monkeypatch, arch):
    d = make_model(tmp_path / arch, arch, "small" if arch == "qwen3_moe" else "tiny", seed=3, dtype="bfloat16")
    cfg = EngineConfig(device="cuda", expert_policy="fill-all", expert_cache_slots=10**6)
    fused = ModelRunner(d, cfg, progress=False)
    attns = [m for m in fused.model.modules() if isinstance(m, FusedQKV)]
    assert attns and all(a.qkv_weight is not None for a in attns)
    a = attns[0]
    assert a.q_proj.weight.untyped_storage().data_ptr() == a.qkv_weight.untyped_storage().data_ptr()
    got, toks = greedy_decode(fused, PROMPT, 12, free=True)
    del fused
    monkeypatch.setattr(MoECausalLM, "fuse_projections", lambda self: None)
    plain = ModelRunner(d, cfg, progress=False)
    assert all(m.qkv_weight is None for m in plain.model.modules() if isinstance(m, FusedQKV))
    ref, ref_toks = greedy_decode(plain, PROMPT, 12, free=True)
    diff = float((got.float() - ref.float()).abs().max())
    _report("fused_qkv_model", arch=arch, bitwise=bool(torch.equal(got, ref)), max_logit_diff=diff,
            same_tokens=toks == ref_toks)
    torch.testing.assert_close(got.float(), ref.float(), rtol=0.05, atol=0.1)


def test_qwen3_30b_qkv_gemv_fused_vs_separate():
    g = torch.Generator(device=CUDA).manual_seed(0)
    H, nq, nk = 2048, 32 * 128, 4 * 128
    ws = [(torch.randn(n, H, device=CUDA, generator=g) * 0.02).to(torch.bfloat16) for n in (nq, nk, nk)]
    fused = torch.cat(ws)
    for T in (1, 4, 64):
        x = torch.randn(T, H, device=CUDA, generator=g).to(torch.bfloat16)
        sep = torch.cat([F.linear(x, w) for w in ws], dim=-1)
        one = F.linear(x, fused)
        diff = float((sep.float() - one.float()).abs().max())
        _report("qkv_gemv_equality", T=T, bitwise=bool(torch.equal(sep, one)), max_abs_diff=diff)
        torch.testing.assert_close(one.float(), sep.float(), rtol=0.02, atol=0.02)

    x = torch.randn(1, H, device=CUDA, generator=g).to(torch.bfloat16)
    _report("qkv_gemv_graph_us", fused_us=_graph_us(lambda: F.linear(x, fused)),
            separate_us=_graph_us(lambda: [F.linear(x, w) for w in ws]))


@pytest.mark.parametrize("T", [1, 16])
def test_qk_norm_rope_kv_write_equals_the_six_launches_it_replaces(T):
    """Qwen3-30B-A3B's attention shapes (32 query heads, 4 KV heads, D 128): the fused launch's q and V
    writes are bitwise those of ``rms_norm`` x2, ``apply_rope`` x2 and ``index_copy_`` x2 (same tiles,
    same rounding points), its keys within a rounding of the head statistic; both timed in a CUDA graph."""
    from edgemoe.kernels.norm_rope import apply_rope, qk_norm_rope_kv_write, rms_norm

    g = torch.Generator(device=CUDA).manual_seed(1)
    Hq, Hk, D, S = 32, 4, 128, 4096
    bf = torch.bfloat16
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, device=CUDA, generator=g) * 2).to(bf)
    qw, kw = (torch.randn(D, device=CUDA, generator=g).to(bf) for _ in range(2))
    ang = torch.randn(T, D // 2, device=CUDA, generator=g) * 50
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(bf), emb.sin().to(bf)
    slots = torch.randperm(S, device=CUDA, generator=g)[:T]
    kc, vc = (torch.zeros(S, Hk, D, device=CUDA, dtype=bf) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()

    def separate():
        q, k, v = qkv.split((Hq * D, Hk * D, Hk * D), dim=-1)
        q = apply_rope(rms_norm(q.view(T, Hq, D), qw, 1e-6), cos, sin)
        k = apply_rope(rms_norm(k.view(T, Hk, D), kw, 1e-6), cos, sin)
        kc2.index_copy_(0, slots, k)
        vc2.index_copy_(0, slots, v.view(T, Hk, D))
        return q

    def fused():
        return qk_norm_rope_kv_write(qkv, qw, kw, 1e-6, cos, sin, slots, kc, vc)

    q_sep, q_one = separate(), fused()
    differ = {n: int((a != b).sum()) for n, a, b in (("q", q_sep, q_one), ("k", kc2, kc), ("v", vc2, vc))}

    # q and v are bitwise; a key head's statistic may differ from the separate norm launch's by a float32
    # ulp (measured on an H200: 2 of 4 heads at T = 1), which moves its elements by at most a bfloat16 ulp
    # or two of the head's largest magnitude
    k_sep, k_one = kc2[slots].float(), kc[slots].float()
    bound = k_sep.abs().amax(dim=-1, keepdim=True) * 2.0 ** -6  # two bfloat16 ulps of the head's max
    heads = int((k_sep != k_one).any(dim=-1).sum())
    _report("qk_norm_rope_kv", T=T, differing_q=differ["q"], differing_k=differ["k"], differing_v=differ["v"],
            k_heads_differing=heads, of_heads=T * Hk, max_abs_diff_k=float((k_sep - k_one).abs().max()),
            fused_us=_graph_us(fused), separate_us=_graph_us(separate))
    assert differ["q"] == 0 and differ["v"] == 0
    assert bool(((k_sep - k_one).abs() <= bound).all())


@pytest.mark.parametrize("float32_scale", [False, True])
def test_add_rms_norm_equals_the_add_and_the_norm_kernel(float32_scale):
    from edgemoe.kernels.norm_rope import add_rms_norm, rms_norm

    g = torch.Generator(device=CUDA).manual_seed(2)
    T, H = 4, 2048
    x, d = (torch.randn(T, H, device=CUDA, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(H, device=CUDA, generator=g).to(torch.bfloat16)
    r, h = add_rms_norm(x, d, w, 1e-6, float32_scale=float32_scale)
    assert torch.equal(r, x + d)
    ref = rms_norm(x + d, w, 1e-6, float32_scale=float32_scale)
    _report("add_rms_norm", float32_scale=float32_scale, bitwise=bool(torch.equal(h, ref)),
            fused_us=_graph_us(lambda: add_rms_norm(x, d, w, 1e-6, float32_scale=float32_scale)),
            separate_us=_graph_us(lambda: rms_norm(x + d, w, 1e-6, float32_scale=float32_scale)))
    assert torch.equal(h, ref)
