"""Gated delta rule Triton kernels (``edgemoe/kernels/gated_delta.py``) against transformers' torch
reference functions, in the Triton interpreter on CPU (small shapes: the interpreter is slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")
from gated_delta_reference import ref_chunk, ref_conv_update, ref_recurrent

from edgemoe.kernels.gated_delta import (
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _interpreter_loop_bounds():
    """Triton 3.6's interpreter converts a runtime loop bound with ``int()`` of a 1-element array, which
    numpy >= 2.4 refuses (triton-lang/triton#9171); convert through a 0-d array instead."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patch)
        yield


# Dk != Dv and Dv not a power of two exercise the padded tiles; Hv = 2 Hk the grouped heads.
B, HK, HV, DK, DV = 1, 2, 4, 32, 24


def make_inputs(T: int, *, l2norm: bool, seed: int = 0, dtype=torch.float32, b: int = B):
    """q, k ``[b, T, HK, DK]``, v ``[b, T, HV, DV]``, g, beta ``[b, T, HV]`` shaped like the model's (g from
    ``-exp(A_log) * softplus(a + dt_bias)``, beta a sigmoid). Without in-kernel l2norm the keys are given
    unit norm, as the delta rule needs ``|k| <= 1`` to stay stable."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, T, HK, DK, generator=gen)
    k = torch.randn(b, T, HK, DK, generator=gen)
    if not l2norm:
        k = torch.nn.functional.normalize(k, dim=-1)
        q = torch.nn.functional.normalize(q, dim=-1)
    v = torch.randn(b, T, HV, DV, generator=gen)
    a = torch.randn(b, T, HV, generator=gen)
    g = -torch.rand(HV, generator=gen).add(0.05) * torch.nn.functional.softplus(a - 1.0)
    beta = torch.rand(b, T, HV, generator=gen).mul(4).sub(2).sigmoid()
    return [x.to(DEV) for x in (q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype))]


def make_state(seed: int = 1, b: int = B) -> torch.Tensor:
    return torch.randn(b, HV, DK, DV, generator=torch.Generator().manual_seed(seed)).mul(0.3).to(DEV)


def close(actual, expected, tol):
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "T, l2norm, with_state, b",
    [(1, True, False, 2), (37, False, True, 1), (64, True, True, 2), (129, True, True, 1), (150, False, False, 1)],
)
def test_chunk_matches_reference(T, l2norm, with_state, b):
    q, k, v, g, beta = make_inputs(T, l2norm=l2norm, seed=T, b=b)
    h0 = make_state(b=b) if with_state else None
    h0_copy = h0.clone() if with_state else None
    out, ht = chunk_gated_delta_rule(q, k, v, g, beta, h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    ref_out, ref_ht = ref_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=l2norm)
    assert out.shape == (b, T, HV, DV) and out.dtype == q.dtype
    assert ht.shape == (b, HV, DK, DV) and ht.dtype == torch.float32
    close(out, ref_out, 2e-4)
    close(ht, ref_ht, 2e-4)
    if with_state:
        assert torch.equal(h0, h0_copy)  # the prefill does not modify its initial state


def test_chunk_without_final_state_and_repeated_heads():
    """``output_final_state=False`` returns None; q/k already repeated to Hv heads (Hk == Hv) give the
    same result as the grouped call."""
    q, k, v, g, beta = make_inputs(70, l2norm=True, seed=5)
    out, ht = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert ht is None
    rep = HV // HK
    out_rep, _ = chunk_gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
                                        use_qk_l2norm_in_kernel=True)
    close(out_rep, out, 1e-6)
    ref_out, _ = ref_chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    close(out, ref_out, 2e-4)


def test_chunk_identical_keys_is_stable():
    """A run of identical keys with beta ~ 1 and no decay (a repeated token) makes the in-chunk
    triangular system as ill-conditioned as it gets; the block substitution must stay accurate."""
    T = 64
    q, _, v, _, _ = make_inputs(T, l2norm=True, seed=7)
    k = torch.nn.functional.normalize(torch.randn(1, 1, 1, DK), dim=-1).expand(B, T, HK, DK).contiguous().to(DEV)
    g = torch.zeros(B, T, HV, device=DEV)
    beta = torch.full((B, T, HV), 0.999, device=DEV)
    out, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_ht = ref_recurrent(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(out, ref_out, 2e-4)
    close(ht, ref_ht, 2e-4)


def test_chunk_strided_inputs_from_fused_projection():
    """q, k, v as the model makes them: splits of the conv output ``[B, C, T]`` transposed to ``[B, T, C]``
    (last dim not contiguous); g and beta as column views."""
    T = 40
    q, k, v, g, beta = make_inputs(T, l2norm=True, seed=11)
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1).transpose(1, 2).contiguous().transpose(1, 2)
    qs, ks, vs = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    qs, ks, vs = qs.view(B, T, HK, DK), ks.view(B, T, HK, DK), vs.view(B, T, HV, DV)
    gb = torch.stack([g, beta], -1)
    assert not qs.is_contiguous() and qs.stride(-1) == T
    out, ht = chunk_gated_delta_rule(qs, ks, vs, gb[..., 0], gb[..., 1], output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
    ref_out, ref_ht = ref_chunk(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(out, ref_out, 2e-4)
    close(ht, ref_ht, 2e-4)
    rout, _ = fused_recurrent_gated_delta_rule(qs[:, :3], ks[:, :3], vs[:, :3], gb[:, :3, :, 0], gb[:, :3, :, 1],
                                               None, use_qk_l2norm_in_kernel=True)
    close(rout, ref_out[:, :3], 2e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_chunk_low_precision_inputs(dtype, tol):
    q, k, v, g, beta = make_inputs(100, l2norm=True, seed=3, dtype=dtype)
    h0 = make_state()
    out, ht = chunk_gated_delta_rule(q, k, v, g, beta, h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_ht = ref_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    assert out.dtype == dtype and ht.dtype == torch.float32
    close(out, ref_out, tol)
    close(ht, ref_ht, tol)


@pytest.mark.parametrize("T, l2norm, with_state", [(1, True, True), (1, False, False), (3, True, True)])
def test_recurrent_matches_reference_and_updates_in_place(T, l2norm, with_state):
    q, k, v, g, beta = make_inputs(T, l2norm=l2norm, seed=20 + T, b=3)
    h0 = make_state(b=3) if with_state else None
    ref_out, ref_ht = ref_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=l2norm)
    out, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, h0, use_qk_l2norm_in_kernel=l2norm)
    close(out, ref_out, 1e-5)
    close(ht, ref_ht, 1e-5)
    if with_state:
        assert ht is h0  # in place


def test_recurrent_without_final_state_leaves_state_untouched():
    q, k, v, g, beta = make_inputs(1, l2norm=True, seed=4)
    h0 = make_state()
    before = h0.clone()
    out, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, h0, output_final_state=False,
                                               use_qk_l2norm_in_kernel=True)
    assert ht is None and torch.equal(h0, before)
    ref_out, _ = ref_recurrent(q, k, v, g, beta, initial_state=before, use_qk_l2norm_in_kernel=True)
    close(out, ref_out, 1e-5)


def test_recurrent_state_pool_with_indices():
    """Sequences read and update their own rows of a state pool; the other rows stay as they were."""
    q, k, v, g, beta = make_inputs(1, l2norm=True, seed=9, b=2)
    pool = make_state(seed=2, b=5)
    before = pool.clone()
    idx = torch.tensor([3, 1], device=DEV)
    out, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, use_qk_l2norm_in_kernel=True,
                                               state_indices=idx)
    ref_out, ref_ht = ref_recurrent(q, k, v, g, beta, initial_state=before[idx], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
    assert ht is pool
    close(out, ref_out, 1e-5)
    close(pool[idx], ref_ht, 1e-5)
    for r in (0, 2, 4):
        assert torch.equal(pool[r], before[r])


def test_decode_steps_after_prefill_equal_one_long_prefill():
    """Chunked prefill of 70 tokens, then 5 single-token decode steps on its state, equals one chunked
    prefill of all 75 tokens (outputs and final state), and the transformers reference."""
    T0, steps = 70, 5
    q, k, v, g, beta = make_inputs(T0 + steps, l2norm=True, seed=13)
    h0 = make_state()
    full_out, full_ht = chunk_gated_delta_rule(q, k, v, g, beta, h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    ref_out, ref_ht = ref_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    close(full_out, ref_out, 2e-4)
    close(full_ht, ref_ht, 2e-4)

    pre_out, state = chunk_gated_delta_rule(q[:, :T0], k[:, :T0], v[:, :T0], g[:, :T0], beta[:, :T0], h0,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    outs = [pre_out]
    for t in range(T0, T0 + steps):
        sl = slice(t, t + 1)
        o, state = fused_recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state,
                                                    use_qk_l2norm_in_kernel=True)
        outs.append(o)
    close(torch.cat(outs, 1), full_out, 2e-4)
    close(state, full_ht, 2e-4)


@pytest.mark.parametrize("T, S, with_bias, act", [(1, 4, True, "silu"), (1, 3, False, None), (2, 4, True, "silu")])
def test_conv_update_matches_reference(T, S, with_bias, act):
    gen = torch.Generator().manual_seed(T * 10 + S)
    Bc, C, K = 2, 300, 4  # C over one 256-channel block
    x = torch.randn(Bc, C, T, generator=gen).to(DEV)
    state = torch.randn(Bc, C, S, generator=gen).to(DEV)
    weight = torch.randn(C, K, generator=gen).to(DEV)
    bias = torch.randn(C, generator=gen).to(DEV) if with_bias else None
    ref_state = state.clone()
    ref = ref_conv_update(x, ref_state, weight, bias, act)
    out = causal_conv1d_update(x, state, weight, bias, act)
    close(out, ref, 1e-5)
    close(state, ref_state, 0)


def test_invalid_arguments_raise():
    q, k, v, g, beta = make_inputs(4, l2norm=True)
    with pytest.raises(ValueError, match="Hv % Hk"):
        chunk_gated_delta_rule(q.expand(-1, -1, 2, -1), k.expand(-1, -1, 2, -1), v[:, :, :1], g[:, :, :1],
                               beta[:, :, :1])
    with pytest.raises(ValueError, match="g and beta"):
        chunk_gated_delta_rule(q, k, v, g[:, :3], beta)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, make_state()[:, :, :, :8])
    with pytest.raises(ValueError, match="float32"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, make_state().double())
    with pytest.raises(ValueError, match="state_indices needs"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, None, state_indices=torch.zeros(B, dtype=torch.long))


AOT_SCRIPT = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import edgemoe.kernels.gated_delta as gd

def build(fn, ptrs, consts, num_warps):
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a == "scale" else "i32") for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

for dt, tdt, prec in (("bf16", tl.bfloat16, "tf32"),):
    P, dot = "*" + dt, dict(DOT_DT=tdt, PREC=prec)
    build(gd._chunk_kkt_kernel, dict(k_ptr=P, g_ptr="*fp32", beta_ptr=P, a_ptr="*fp32"),
          dict(BK=128, L2NORM=True, **dot), 4)
    build(gd._chunk_inverse_kernel, dict(a_ptr="*fp32", tm_ptr=P), {}, 4)
    build(gd._chunk_wu_kernel, dict(k_ptr=P, v_ptr=P, g_ptr="*fp32", beta_ptr=P, tm_ptr=P, w_ptr=P, u_ptr=P),
          dict(BK=128, BV=128, L2NORM=True, **dot), 8)
    build(gd._chunk_state_kernel, dict(k_ptr=P, g_ptr="*fp32", w_ptr=P, u_ptr=P, h0_ptr="*fp32", hc_ptr=P,
          vnew_ptr=P, ht_ptr="*fp32"), dict(BK=128, BV=32, L2NORM=True, HAS_H0=True, STORE_HT=True, **dot), 8)
    build(gd._chunk_output_kernel, dict(q_ptr=P, k_ptr=P, g_ptr="*fp32", hc_ptr=P, vnew_ptr=P, o_ptr=P),
          dict(BK=128, BV=64, L2NORM=True, **dot), 8)
build(gd._recurrent_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr="*fp32", beta_ptr="*bf16",
      h0_ptr="*fp32", ht_ptr="*fp32", o_ptr="*bf16", idx_ptr="*i64"),
      dict(BK=128, BV=16, L2NORM=True, HAS_H0=True, STORE_HT=True, HAS_IDX=True), 2)
build(gd._conv_update_kernel, dict(x_ptr="*bf16", state_ptr="*bf16", w_ptr="*bf16", o_ptr="*bf16"),
      dict(bias_ptr=None, K=4, BC=256, BT=1, BS=4, HAS_BIAS=False, SILU=True), 4)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_kernels_compile_for_hopper():
    """The interpreter does not run Triton's compiler: compile every kernel ahead of time for sm_90 (bf16
    and fp32 prefill, bf16 decode) in a process without ``TRITON_INTERPRET``; no GPU needed."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
