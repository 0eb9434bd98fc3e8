"""Fused q/k/v projections (``edgemoe.layers.attention.FusedQKV``): one ``[Nq + 2·Nk, H]`` matrix whose
row blocks are the checkpoint's ``q_proj`` / ``k_proj`` / ``v_proj`` parameters (views), one GEMM.

On CUDA (16-bit dtypes) the models fuse at ``materialize``; here on the CPU they are fused explicitly
(or through a ``materialize`` that fuses, as on CUDA) and compared with the three separate projections: at these
tiny sizes the CPU GEMM is the same per output row, so decode logits are bitwise equal for every
family using the mixin (qwen3_moe, qwen3_5_moe, glm4_moe, gpt_oss), and a quantized checkpoint loads
(dequantized) straight into the fused views.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.layers.attention import FusedQKV, fuse_linears
from edgemoe.models.base import MoECausalLM

from conftest import greedy_decode

PROMPT = [5, 17, 230, 41, 99, 7, 12]


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_linears_rebinds_the_parameters_as_views(bias):
    g = torch.Generator().manual_seed(0)
    mods = [nn.Linear(48, n, bias=bias) for n in (64, 16, 16)]
    for m in mods:
        with torch.no_grad():
            m.weight.copy_(torch.randn(m.weight.shape, generator=g))
            if bias:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    params = [m.weight for m in mods]
    x = torch.randn(5, 48, generator=g)
    want = [m(x) for m in mods]
    weight, b, sizes = fuse_linears(mods)
    assert weight.shape == (96, 48) and sizes == (64, 16, 16) and (b is not None) == bias
    assert all(m.weight is p for m, p in zip(mods, params))  # the same Parameter objects, names unchanged
    base = weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == base for m in mods)
    got = F.linear(x, weight, b).split(sizes, dim=-1)
    assert all(torch.equal(a, w) for a, w in zip(got, want))
    with torch.no_grad():  # a loader copying into a module's parameter fills the fused matrix
        mods[1].weight.copy_(torch.ones(16, 48))
    assert torch.equal(weight[64:80], torch.ones(16, 48))
    with pytest.raises(ValueError):
        fuse_linears([nn.Linear(48, 8), nn.Linear(32, 8)])
    with pytest.raises(ValueError):
        fuse_linears([nn.Linear(48, 8), nn.Linear(48, 8, bias=False)])


def _family_dir(tmp_path_factory, arch: str):
    from edgemoe.synth import make_model

    preset = "qwen3.5-moe-tiny" if arch == "qwen3_5_moe" else "tiny"
    return make_model(tmp_path_factory.mktemp(arch) / arch, arch, preset, seed=3, dtype="float32")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "glm4_moe", "gpt_oss"])
def test_fused_qkv_decodes_bitwise_like_the_separate_projections(tmp_path_factory, arch):
    runner = ModelRunner(_family_dir(tmp_path_factory, arch), EngineConfig(device="cpu", dtype="float32"),
                         progress=False)
    attns = [m for m in runner.model.modules() if isinstance(m, FusedQKV)]
    assert attns and all(a.qkv_weight is None for a in attns)  # the CPU keeps them apart by default
    ref, ref_toks = greedy_decode(runner, PROMPT, 3, seq_id=0, free=True)
    runner.model.fuse_projections()
    assert all(a.qkv_weight is not None for a in attns)
    got, toks = greedy_decode(runner, PROMPT, 3, seq_id=1, free=True)
    assert toks == ref_toks and torch.equal(got, ref)


def test_a_quantized_checkpoint_loads_into_the_fused_views(tmp_path, monkeypatch):
    from quant_reference import quantized_checkpoint

    d = quantized_checkpoint(tmp_path / "fp8", "fp8")  # FP8 block: attention is quantized too
    cfg = EngineConfig(device="cpu", dtype="float32", expert_policy="cpu-all")
    plain = ModelRunner(d, cfg, progress=False)
    materialize = MoECausalLM.materialize

    def fusing_materialize(self, dtype, device):  # what materialize does on CUDA in bfloat16
        materialize(self, dtype, device)
        self.fuse_projections()

    monkeypatch.setattr(MoECausalLM, "materialize", fusing_materialize)
    fused = ModelRunner(d, cfg, progress=False)
    attn = fused.model.model.layers[1].self_attn
    assert attn.qkv_weight is not None
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    p_plain, p_fused = dict(plain.model.named_parameters()), dict(fused.model.named_parameters())
    assert p_plain.keys() == p_fused.keys() and all(torch.equal(p_plain[k], p_fused[k]) for k in p_plain)
    ref, ref_toks = greedy_decode(plain, PROMPT, 2)
    got, toks = greedy_decode(fused, PROMPT, 2)
    assert toks == ref_toks and torch.equal(got, ref)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "glm4_moe", "gpt_oss"])
def test_cpu_bf16_fuses_and_decodes_bitwise_like_the_separate_projections(tmp_path_factory, arch, monkeypatch):
    """bf16 on the CPU fuses at materialize; a decode step's q/k/v is then one native GEMV (the executor's
    rows computed one by one) and every other product (the prefill's GEMMs) runs per module: the logits
    of prefill and decode are those of the unfused model bit for bit."""
    from edgemoe.experts import native

    d = _family_dir(tmp_path_factory, arch)
    cfg = EngineConfig(device="cpu", dtype="bfloat16", expert_policy="cpu-all", cpu_threads=2)
    fused = ModelRunner(d, cfg, progress=False)
    if not fused.experts.cpu_executor.name.startswith("native"):
        pytest.skip("the native CPU executor does not build here")
    attns = [m for m in fused.model.modules() if isinstance(m, FusedQKV)]
    assert attns and all(a.qkv_weight is not None for a in attns)
    weights = []
    take = native.NativeCpuExecutor._linear_checked

    def recording(self, x, weight, out):
        weights.append((weight.data_ptr(), weight.shape[0]))
        return take(self, x, weight, out)

    monkeypatch.setattr(native.NativeCpuExecutor, "_linear_checked", recording)
    got, toks = greedy_decode(fused, PROMPT, 3)
    a = attns[0]
    assert (a.qkv_weight.data_ptr(), a.qkv_weight.shape[0]) in weights  # q/k/v as one GEMV
    assert (a.k_proj.weight.data_ptr(), a.k_proj.weight.shape[0]) not in weights  # never alone
    monkeypatch.setattr(MoECausalLM, "fuse_projections", lambda self: None)
    plain = ModelRunner(d, cfg, progress=False)
    assert all(m.qkv_weight is None for m in plain.model.modules() if isinstance(m, FusedQKV))
    ref, ref_toks = greedy_decode(plain, PROMPT, 3)
    assert toks == ref_toks and torch.equal(got, ref)
