"""A bounded soak (``benchmarks/soak.py``): 8 concurrent multi-turn tool-calling sessions over the three
APIs for ~20 s against a real loopback server, zero errors, a clean KV audit and a resident-memory
ceiling. The 10-minute record is in docs/benchmarks/soak.md."""

from __future__ import annotations

import json


def test_soak_20s(tmp_path, load_benchmark):
    soak = load_benchmark("soak")
    assert soak.main(["--duration-s", "20", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["errors"] == 0 and result["kv_audit_ok"] and result["sessions"] == 8
    assert all(n > 0 for n in result["requests"].values()) and result["tool_calls"] > 0
    assert result["kv_after"]["free_pages"] == result["kv_before"]["free_pages"]
    assert result["rss_mb"]["peak"] <= result["rss_mb"]["ceiling"]
