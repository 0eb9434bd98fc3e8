"""CPU smoke run of ``benchmarks/laptop.py`` end to end: the server child (edgemoe's app on uvicorn, tiny
qwen3.5-moe preset, NVFP4 dummy experts), streamed completions from the parent, the expert-cache resize
through ``/admin/memory``, the all-resident reference and the report. Checks the shape of the results, not
the times."""

from __future__ import annotations

import json


def test_laptop_smoke(tmp_path, load_benchmark):
    laptop = load_benchmark("laptop")
    argv = ["--preset", "qwen3.5-moe-tiny", "--device", "cpu", "--dtype", "float32", "--cpu-executor", "torch",
            "--cpu-threads", "1", "--policy", "qstar", "--bandwidth-pcie-gbps", "1", "--bandwidth-cpu-gbps", "3",
            "--prompt-tokens", "96", "--decode-tokens", "6", "--decode-warmup", "2", "--max-model-len", "256",
            "--cpu-cache-slots", "16", "--out", str(tmp_path)]
    assert laptop.main(argv) == 0
    data = json.loads((tmp_path / "laptop.json").read_text())
    s, phases = data["summary"], data["phases"]
    assert s["pool_format"] == "nvfp4" and s["host_pool_under_24gb"] and s["expert_cache_slots"] == 16
    assert s["gpu"] is None  # no GPU: no budget, no cap
    for name in ("first_request", "request_1", "request_2", "resident"):
        p = phases[name]
        # 1 + warmup + timed tokens, each streamed as its own one-character event
        assert p["tokens"] == p["completion_tokens"] == p["events"] == 9, (name, p)
        assert p["prompt_tokens"] == 96 and p["cached_tokens"] == 0  # different prompts: nothing reused
        assert p["ttft_s"] > 0 and p["decode_tokens_timed"] == 6 and p["decode_tokens_per_s"] > 0
    ex = phases["request_1"]["experts"]
    assert ex["decode_steps"] == 8 and 0 <= ex["hit_rate"] <= 1
    assert ex["misses_per_token"] > 0 and ex["cpu_per_token"] > 0  # q* = 1/3 of the misses fill, the rest on the CPU
    b = data["bounds"]["request_2"]
    assert b["t_resident_s"] > 0 and b["bound_s_balanced"] >= b["t_resident_s"]
    assert set(b["laptop_tokens_per_s"]) == {"b_h_concurrent", "b_h_isolated"}
    assert data["stats"]["measured"]["memory"]["resizes"].get("out-of-memory", 0) == 0
    md = (tmp_path / "laptop.md").read_text()
    assert "t_token = t_resident + M * r / (B_P + B_H)" in md and "| TTFT, a second, different 96-token prompt |" in md
    assert (tmp_path / "laptop-server.log").stat().st_size > 0
