"""Strict checkpoint loading: every error names the file and the tensor; sharded and fused layouts load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.models import load_config
from edgemoe.synth import make_model
from edgemoe.weights.index import CheckpointError

CFG = EngineConfig(device="cpu", dtype="float32", expert_policy="cpu-all")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-loader")
    make_model(out, "qwen3_moe", "tiny", seed=1, dtype="float32")
    return out


def _variant(tiny, tmp_path, edit):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny, d)
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors")
    return d


def _logits(path) -> torch.Tensor:
    r = ModelRunner(path, CFG, progress=False)
    return r.execute([StepInput(0, [1, 2, 3, 4], 0)], Phase.PREFILL)


def test_missing_tensor_is_named(tiny, tmp_path):
    d = _variant(tiny, tmp_path, lambda sd: sd.pop("model.layers.0.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight"):
        ModelRunner(d, CFG, progress=False)


def test_missing_expert_is_named(tiny, tmp_path):
    d = _variant(tiny, tmp_path, lambda sd: sd.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"expert 5 up_proj"):
        ModelRunner(d, CFG, progress=False)


def test_unexpected_tensor_names_file_and_tensor(tiny, tmp_path):
    d = _variant(tiny, tmp_path, lambda sd: sd.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor model\.layers\.0\.extra\.weight"):
        ModelRunner(d, CFG, progress=False)


def test_misshaped_tensor_reports_both_shapes(tiny, tmp_path):
    def edit(sd):
        sd["model.layers.3.mlp.experts.0.down_proj.weight"] = torch.zeros(3, 3)

    d = _variant(tiny, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.3\.mlp\.experts\.0\."
                                              r"down_proj\.weight has shape \[3, 3\], expected \[64, 64\]"):
        ModelRunner(d, CFG, progress=False)


def test_integer_tensor_is_a_dtype_error(tiny, tmp_path):
    def edit(sd):
        sd["model.norm.weight"] = torch.ones(64, dtype=torch.int32)

    d = _variant(tiny, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has dtype torch\.int32"):
        ModelRunner(d, CFG, progress=False)


def test_sharded_checkpoint_with_index_loads_identically(tiny, tmp_path):
    d = tmp_path / "sharded"
    make_model(d, "qwen3_moe", "tiny", seed=1, dtype="float32", max_shard_size="300KB")
    assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("*.safetensors"))) > 1
    torch.testing.assert_close(_logits(d), _logits(tiny), rtol=0, atol=0)


def test_index_naming_a_missing_shard(tiny, tmp_path):
    d = tmp_path / "sharded"
    make_model(d, "qwen3_moe", "tiny", seed=1, dtype="float32", max_shard_size="300KB")
    victim = sorted(d.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        ModelRunner(d, CFG, progress=False)


def test_fused_expert_layout_loads_identically(tiny, tmp_path):
    """transformers-5 in-memory layout (``experts.gate_up_proj [E, 2I, H]``) is accepted too."""
    cfg = load_config(tiny)

    def fuse(sd):
        for layer in cfg.moe_layers:
            pre = f"model.layers.{layer}.mlp.experts"
            gu, dn = [], []
            for e in range(cfg.num_experts):
                gu.append(torch.cat([sd.pop(f"{pre}.{e}.gate_proj.weight"), sd.pop(f"{pre}.{e}.up_proj.weight")]))
                dn.append(sd.pop(f"{pre}.{e}.down_proj.weight"))
            sd[f"{pre}.gate_up_proj"] = torch.stack(gu)
            sd[f"{pre}.down_proj"] = torch.stack(dn)

    d = _variant(tiny, tmp_path, fuse)
    torch.testing.assert_close(_logits(d), _logits(tiny), rtol=0, atol=0)


def test_unsupported_architecture_is_rejected(tiny, tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture LlamaForCausalLM"):
        ModelRunner(d, CFG, progress=False)


def test_dummy_load_needs_no_weights(tiny, tmp_path):
    d = tmp_path / "config-only"
    d.mkdir()
    for f in tiny.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, d / f.name)
    r = ModelRunner(d, EngineConfig(device="cpu", load_format="dummy", expert_policy="cpu-all"), progress=False)
    out = r.execute([StepInput(0, [1, 2, 3], 0)], Phase.PREFILL)
    assert out.shape == (1, r.model_config.vocab_size) and torch.isfinite(out).all()
    assert r.pool.view("w13").std() > 0 and r.pool.view("w2").std() > 0
