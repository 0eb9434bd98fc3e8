"""The llama.cpp comparison's checkpoint pair (benchmarks/peers/checkpoint.py) on a tiny geometry.

The GGUF written from the safetensors shards must be the file llama.cpp's own
``convert_hf_to_gguf.py --outtype bf16`` writes from the same checkpoint (byte for byte: metadata,
tensor names, shapes, dtypes, order and data) and run in llama-bench (where a build is present), and
edgemoe must load the checkpoint strictly.
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
LLAMA_BENCH = ROOT / ".peers" / "bin" / "llama-bench-cpu"
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


def _gguf_diff(ours: Path, ref: Path) -> str:
    """What differs between two GGUF files (metadata keys, tensor names / dtypes / shapes / bytes); slow
    (GGUFReader parses every vocabulary string), so only built when the files differ."""
    sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
    import gguf

    o, r = gguf.GGUFReader(ours), gguf.GGUFReader(ref)
    kv_o = {k: f.contents() for k, f in o.fields.items()}
    kv_r = {k: f.contents() for k, f in r.fields.items()}
    t_o = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape), t.data.tobytes()) for t in o.tensors}
    t_r = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape), t.data.tobytes()) for t in r.tensors}
    return (f"metadata keys only in ours {sorted(kv_o.keys() - kv_r.keys())}, only in the converter's "
            f"{sorted(kv_r.keys() - kv_o.keys())}, different values {[k for k in kv_r if k in kv_o and kv_o[k] != kv_r[k]]}; "
            f"tensor order equal {list(t_o) == list(t_r)}, tensors that differ "
            f"{[(k, t_o.get(k, (None, None))[:2], v[:2]) for k, v in t_r.items() if t_o.get(k) != v]}")


def test_gguf_equals_convert_hf_to_gguf(pair):
    _, ours, ref = pair
    assert ours.read_bytes() == ref.read_bytes(), _gguf_diff(ours, ref)


@pytest.mark.skipif(not LLAMA_BENCH.is_file(), reason="no llama-bench build (benchmarks/peers/build_llama_bench.sh cpu)")
def test_llama_cpp_runs_the_gguf(pair):
    _, ours, _ = pair
    p = subprocess.run([str(LLAMA_BENCH), "-m", str(ours), "-p", "0", "-n", "4", "-r", "1", "-t", "1", "-o", "jsonl"],
                       capture_output=True, text=True, check=False, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.splitlines()[-1])
    assert r["n_gen"] == 4 and r["avg_ts"] > 0 and r["model_n_params"] > 0


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
                                               expert_policy="cpu-all", bandwidth_cpu_gbps=10.0,
                                               bandwidth_pcie_gbps=10.0, max_model_len=256))
    assert runner.pool.num_ids == 2 * 8
    with safe_open(str(hf / index["model.layers.1.mlp.experts.5.up_proj.weight"]), framework="pt") as f:
        up = f.get_tensor("model.layers.1.mlp.experts.5.up_proj.weight")
    assert torch.equal(runner.pool.w13[8 + 5, 32:], up)  # w13 = [gate; up] rows of expert (layer 1, 5)
