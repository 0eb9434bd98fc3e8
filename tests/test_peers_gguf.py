"""The llama.cpp comparison (benchmarks/peers/): its checkpoint pair on a tiny geometry, and run.py's
table, salvage of stopped runs and run plan.

The GGUF written from the safetensors shards must be the file llama.cpp's own
``convert_hf_to_gguf.py --outtype bf16`` writes from the same checkpoint (byte for byte: metadata,
tensor names, shapes, dtypes, order and data) and run in llama-bench (where a build is present), and
edgemoe must load the checkpoint strictly. Those tests need the stripped llama.cpp tree
(``benchmarks/peers/fetch_llama_cpp.sh``) and the real Qwen3 tokenizer fixture (the converter only
accepts pre-tokenizers it knows) and are skipped without them; the run.py tests need neither.
"""

from __future__ import annotations

import importlib.util
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

needs_llama_cpp = pytest.mark.skipif(
    not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file() or not (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file(),
    reason="needs the vendored llama.cpp tree (benchmarks/peers/fetch_llama_cpp.sh) and the Qwen3 tokenizer fixture")

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
            f"{sorted(kv_r.keys() - kv_o.keys())}, different values "
            f"{[k for k in kv_r if k in kv_o and kv_o[k] != kv_r[k]]}; "
            f"tensor order equal {list(t_o) == list(t_r)}, tensors that differ "
            f"{[(k, t_o.get(k, (None, None))[:2], v[:2]) for k, v in t_r.items() if t_o.get(k) != v]}")


@needs_llama_cpp
def test_gguf_equals_convert_hf_to_gguf(pair):
    _, ours, ref = pair
    assert ours.read_bytes() == ref.read_bytes(), _gguf_diff(ours, ref)


@needs_llama_cpp
@pytest.mark.skipif(not LLAMA_BENCH.is_file(),
                    reason="no llama-bench build (benchmarks/peers/build_llama_bench.sh cpu)")
def test_llama_cpp_runs_the_gguf(pair):
    _, ours, _ = pair
    p = subprocess.run([str(LLAMA_BENCH), "-m", str(ours), "-p", "0", "-n", "4", "-r", "1", "-t", "1", "-o", "jsonl"],
                       capture_output=True, text=True, check=False, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.splitlines()[-1])
    assert r["n_gen"] == 4 and r["avg_ts"] > 0 and r["model_n_params"] > 0


@needs_llama_cpp
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
    assert torch.equal(runner.pool.view("w13")[8 + 5, 32:], up)  # w13 = [gate; up] rows of expert (layer 1, 5)


# ------------------------------------------------------------------------------------------------ run.py


def _run_module():
    spec = importlib.util.spec_from_file_location("peers_run", ROOT / "benchmarks" / "peers" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ROW = 3 * 2048 * 768 * 2  # bytes of one Qwen3-30B-A3B expert in bf16


def _llama_line(threads: int, ngl: int, ncmoe: int, ts: float) -> str:
    return json.dumps({"build_commit": "0c1e57098", "cpu_info": "Xeon", "gpu_info": "H200", "backends": "CUDA",
                       "n_threads": threads, "n_gpu_layers": ngl, "n_cpu_moe": ncmoe, "devices": "auto",
                       "n_gen": 64, "avg_ts": ts, "stddev_ts": 0.5})


def _edge_result(policy: str, slots: int, ts: float, bound_ms: float | None = None, resident: bool = False) -> dict:
    r = {"policy": policy, "slots": slots, "tokens_per_s": ts, "hit_rate": slots / 2048, "q_over_m_observed": None,
         "budget_gb": "all (resident)" if resident else round(slots * ROW / 1e9, 3)}
    if bound_ms is not None:
        r["bound_ms"] = bound_ms
    return r


def test_table_ratios_and_bytes_bounds(tmp_path):
    run = _run_module()
    res = tmp_path / "results"
    (res / "llama").mkdir(parents=True)
    (res / "llama" / "gpu-ncmoe14.jsonl").write_text(_llama_line(6, 99, 14, 40.0) + "\n")
    (res / "llama" / "gpu-ncmoe0.jsonl").write_text(_llama_line(6, 99, 0, 400.0) + "\n")
    (res / "llama" / "cpu.jsonl").write_text(_llama_line(16, 0, 0, 50.0) + "\n")
    for name, b_h, pool, results in [
        ("gpu-t6", 50.0, 6, [_edge_result("static", 2048, 420.0, resident=True), _edge_result("qstar", 256, 80.0, 10.0),
                          _edge_result("cpu-all", 256, 45.0, 25.0), _edge_result("static", 256, 46.0, 24.0)]),
        ("cpu-t16", 60.0, 15, [_edge_result("cpu-all", 0, 40.0)]),  # a pool capped below the request
    ]:
        (res / "edgemoe" / name).mkdir(parents=True)
        prof = {"isolated": {"b_p_gbps": 50.0, "b_h_gbps": b_h}, "concurrent": {"b_p_gbps": 40.0, "b_h_gbps": b_h}}
        meta = {"profile": prof, "machine": {"cpu_threads": pool}}
        (res / "edgemoe" / name / "decode.json").write_text(json.dumps({"meta": meta, "results": results}))
    a = type("Args", (), {"results": str(res), "ncmoe_levels": [14], "thread_list": [6], "cpu_thread_list": [16],
                          "cpu_only": False, "tokens": 64, "reps": 3,
                          "policy_list": ["qstar", "cpu-all", "static"]})()
    geo = run.geometry(run.model_config(16, {}))
    assert geo["expert_bytes"] == ROW
    md = run.build_table(a, geo)
    rows = json.loads((res / "peers.json").read_text())["rows"]
    gpu = next(r for r in rows if r["kind"] == "gpu")
    llama_ms = 1e3 / 400.0 + 14 * 8 * ROW / 50e9 * 1e3  # resident step + 14 layers x top-8 experts over B_H
    assert gpu["slots"] == 256 and gpu["llama_bound"] == pytest.approx(1e3 / llama_ms)
    assert gpu["qstar"] == 80.0 and gpu["qstar_bound"] == pytest.approx(100.0) and gpu["qstar_hit_rate"] == 0.125
    assert "| 2.42 GB (-ncmoe 14) | 6 | 40.0 (42) | 80.0 (100) | 2.00× | 45.0 (40) | 1.12× | 46.0 (42) | 1.15× |" in md
    assert "| all resident (19.3 GB, -ncmoe 0) | 6 | 400.0 | 420.0 | 1.05× |" in md
    cpu = next(r for r in rows if r["kind"] == "cpu-only")
    gb = (geo["dense_bytes_per_token"] + 16 * 8 * ROW) / 1e9
    assert cpu["bound"] == pytest.approx(60.0 / gb)
    assert f"| 16 (edgemoe pool 15) | 50.0 | 40.0 ({60.0 / gb:.0f}) | 0.80× |" in md


def test_stopped_runs_keep_what_they_printed():
    run = _run_module()
    prof = {"b_p_gbps": 51.2, "b_h_gbps": 88.0}
    from edgemoe.engine.expert_runtime import DecodePath

    done = {**_edge_result("qstar", 256, 80.0, 10.0), "decode_path": DecodePath.EAGER}  # printed as its repr
    text = (f"summary\nprofile: isolated {prof}, concurrent {prof}\n{done}\n{_edge_result('static', 256, 1.0)}\n"
            f"{str(done)[:40]}")  # the last line cut by the stop
    part = run.salvage_decode(text)
    assert part["meta"]["profile"]["isolated"] == prof and len(part["results"]) == 2
    assert part["results"][0] == {**done, "decode_path": "eager"}
    assert run.salvage_decode("profile: isolated {}, concurrent {}\n") is None
    lines = _llama_line(6, 99, 14, 40.0) + "\n" + _llama_line(16, 99, 14, 60.0)
    assert run.salvage_jsonl(lines + "\n" + lines[:50]) == lines + "\n"


def test_dry_run_plans_matched_levels_in_order(tmp_path, capsys):
    run = _run_module()
    assert run.main(["--dry-run", "--work", str(tmp_path / "ckpt"), "--results", str(tmp_path / "res")]) == 0
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("llama ", "edgemoe "))]
    assert [ln.split(":")[0] for ln in out] == [
        "llama gpu-ncmoe14", "llama gpu-ncmoe11", "llama gpu-ncmoe0", "llama cpu",
        "edgemoe gpu-t6", "edgemoe gpu-t16", "edgemoe cpu-t16", "edgemoe gpu-t15"]
    assert "-t 6,16,15 -ngl 99 -ncmoe 14 -o jsonl" in out[0] and "-t 16 -ngl 0 -dev none" in out[3]
    args = out[4].split()
    budgets = [float(b) for b in args[args.index("--budgets") + 1].split(",")]
    assert [int(b * 1e9 // ROW) for b in budgets] == [2 * 128, 5 * 128]  # decode.py's slots = the -ncmoe levels' VRAM
    assert args[args.index("--cpu-threads") + 1] == "6" and "--no-resident" not in args


def test_rounds_and_builds_take_medians_and_list_every_round(tmp_path):
    run = _run_module()
    assert run.parse_run_name(run.run_name("cpu", "llama-bench-cpu", 3)) == ("cpu", "llama-bench-cpu", 3)
    assert run.parse_run_name(run.run_name("cpu-t6")) == ("cpu-t6", "", 1)
    res = tmp_path / "results"
    (res / "llama").mkdir(parents=True)
    # two builds over three rounds: cpu build 20 / 24 / 22 (median 22), cuda build 21 / 18 / 19 (median 19)
    for rnd, (cpu_ts, cuda_ts) in enumerate([(20.0, 21.0), (24.0, 18.0), (22.0, 19.0)], start=1):
        for build, ts in (("llama-bench-cpu", cpu_ts), ("llama-bench-cuda", cuda_ts)):
            (res / "llama" / f"{run.run_name('cpu', build, rnd)}.jsonl").write_text(_llama_line(6, 0, 0, ts) + "\n")
        d = res / "edgemoe" / run.run_name("cpu-t6", "", rnd)
        d.mkdir(parents=True)
        prof = {"isolated": {"b_p_gbps": 0.0, "b_h_gbps": 50.0 + rnd},
                "concurrent": {"b_p_gbps": 0.0, "b_h_gbps": 50.0}}
        result = _edge_result("cpu-all", 0, [30.0, 33.0, 27.0][rnd - 1])
        (d / "decode.json").write_text(json.dumps({"meta": {"profile": prof, "machine": {"cpu_threads": 6}},
                                                   "results": [result]}))
    a = type("Args", (), {"results": str(res), "ncmoe_levels": [14], "thread_list": [], "cpu_thread_list": [6],
                          "cpu_only": True, "tokens": 64, "reps": 3, "policy_list": ["cpu-all"]})()
    geo = run.geometry(run.model_config(16, {}))
    md = run.build_table(a, geo)
    cpu = next(r for r in json.loads((res / "peers.json").read_text())["rows"] if r["kind"] == "cpu-only")
    assert cpu["llama"] == 22.0 and cpu["cpu-all"] == 30.0  # medians; the better build's
    gb = (geo["dense_bytes_per_token"] + 16 * 8 * ROW) / 1e9
    assert cpu["bound"] == pytest.approx(52.0 / gb)  # the median B_H
    assert f"| 6 | 22.0 | 30.0 ({52.0 / gb:.0f}) | 1.36× |" in md
    # each round against the faster build of that round
    assert "| setting | threads | round | llama.cpp llama-bench-cpu | llama.cpp llama-bench-cuda |" in md
    assert "| CPU-only | 6 | 1 | 20.0 | 21.0 | 30.0 | 1.43× |" in md
    assert "| CPU-only | 6 | 2 | 24.0 | 18.0 | 33.0 | 1.38× |" in md
    assert "| CPU-only | 6 | 3 | 22.0 | 19.0 | 27.0 | 1.23× |" in md


def test_dry_run_alternates_rounds_and_builds(tmp_path, capsys):
    run = _run_module()
    assert run.main(["--dry-run", "--cpu-only", "--cpu-threads", "6", "--rounds", "2", "--llama-bench",
                     "/bin/true,/bin/false", "--work", str(tmp_path / "ckpt"), "--results", str(tmp_path / "res")]) == 0
    out = [ln.split(":")[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith(("llama ", "edgemoe "))]
    assert out == ["llama cpu.true", "llama cpu.false", "edgemoe cpu-t6",
                   "llama cpu.true@r2", "llama cpu.false@r2", "edgemoe cpu-t6@r2"]
