"""The llama.cpp comparison's checkpoint pair (benchmarks/peers/checkpoint.py) on a tiny geometry.

The GGUF written from the safetensors shards must be the file llama.cpp's own
``convert_hf_to_gguf.py --outtype bf16`` writes from the same checkpoint (byte for byte: metadata,
tensor names, shapes, dtypes, order and data), and edgemoe must load the checkpoint strictly.
Needs the stripped llama.cpp tree (``benchmarks/peers/fetch_llama_cpp.sh``) and the real Qwen3
tokenizer fixture (the converter only accepts pre-tokenizers it knows); skipped without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import QWEN3_TOKENIZER_DIR, ROOT

LLAMA_CPP = ROOT / ".peers" / "llama.cpp"
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

pytestmark = [
    pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                       reason="no vendored llama.cpp tree (run benchmarks/peers/fetch_llama_cpp.sh)"),
    pytest.mark.skipif(not (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file(), reason="no Qwen3 tokenizer fixture"),
]

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import checkpoint

    d = tmp_path_factory.mktemp("peers")
    hf = checkpoint.write_hf(d / "hf", 2, QWEN3_TOKENIZER_DIR, token_routing=True, device="cpu", overrides=TINY)
    ours = checkpoint.write_gguf(hf, d / "ours.gguf", LLAMA_CPP)
    ref = d / "ref.gguf"
    subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                    "--outfile", str(ref)], check=True, capture_output=True)
    return hf, ours, ref


def _describe(path: Path) -> tuple[dict, dict]:
    sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
    import gguf

    r = gguf.GGUFReader(path)
    kv = {k: (f.types, f.contents()) for k, f in r.fields.items()}
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape), bytes(t.data.tobytes())) for t in r.tensors}
    return kv, tensors


def test_gguf_equals_convert_hf_to_gguf(pair):
    _, ours, ref = pair
    kv_o, t_o = _describe(ours)
    kv_r, t_r = _describe(ref)
    assert kv_o.keys() == kv_r.keys()
    assert [k for k in kv_r if kv_o[k] != kv_r[k]] == []
    assert kv_o["general.architecture"][1] == "qwen3moe"
    assert kv_o["qwen3moe.expert_count"][1] == 8 and kv_o["qwen3moe.block_count"][1] == 2
    assert list(t_o) == list(t_r)  # names in the converter's order
    for name in t_r:
        assert t_o[name][:2] == t_r[name][:2], name  # dtype, shape
        assert t_o[name][2] == t_r[name][2], name  # bytes
    assert t_o["blk.1.ffn_gate_exps.weight"][:2] == ("BF16", (64, 32, 8))  # ggml order: ne0 = hidden
    assert t_o["blk.0.ffn_gate_inp.weight"][0] == "F32"
    assert ours.read_bytes() == ref.read_bytes()


def test_hf_checkpoint_loads_strictly_and_routes_by_token(pair):
    from safetensors import safe_open

    from edgemoe.config import EngineConfig
    from edgemoe.engine.model_runner import ModelRunner

    hf, _, _ = pair
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(hf / index["model.layers.0.self_attn.o_proj.weight"]), framework="pt") as f:
        o = f.get_tensor("model.layers.0.self_attn.o_proj.weight").float()
    with safe_open(str(hf / index["model.layers.0.self_attn.q_proj.weight"]), framework="pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight").float()
    assert o.std().item() == pytest.approx(2e-4, rel=0.05) and q.std().item() == pytest.approx(0.02, rel=0.05)
    runner = ModelRunner(str(hf), EngineConfig(device="cpu", load_format="auto", expert_cache_slots=0,
                                               expert_policy="cpu-all", bandwidth_cpu_gbps=10.0))
    assert runner.pool.num_ids == 2 * 8
    with safe_open(str(hf / index["model.layers.1.mlp.experts.5.up_proj.weight"]), framework="pt") as f:
        up = f.get_tensor("model.layers.1.mlp.experts.5.up_proj.weight")
    assert torch.equal(runner.pool.w13[8 + 5, 32:], up)  # w13 = [gate; up] rows of expert (layer 1, 5)
