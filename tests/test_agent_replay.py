"""CPU smoke run of ``benchmarks/agent_replay.py`` (tiny qwen3.5-moe preset, dummy weights, scaled-down
sessions): the reuse counts per turn, not the times. Its JSON (and markdown) land in the test's tmp dir."""

from __future__ import annotations

import json


def test_agent_replay_reuse_counts(tmp_path, load_benchmark):
    agent_replay = load_benchmark("agent_replay")
    assert agent_replay.main(["--preset", "qwen3.5-moe-tiny", "--device", "cpu", "--dtype", "float32",
                              "--cpu-executor", "torch", "--scale", "0.01", "--reply-scale", "0.1",
                              "--interval", "32", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "agent_replay.json").read_text())
    assert (tmp_path / "agent_replay.md").read_text().count("| all |") == 3
    results = data["results"]
    assert list(results) == ["w2", "w4", "cut"] and [len(results[s]["anchors"]["turns"]) for s in results] == [3, 13, 3]
    for name, res in results.items():
        anchors, interval, none = (res[m]["turns"] for m in ("anchors", "interval", "none"))
        for a, i, n in zip(anchors, interval, none):
            assert a["prompt_tokens"] == i["prompt_tokens"] == n["prompt_tokens"]  # the same prompts in every mode
            assert n["reused"] == 0  # a hybrid model without checkpoints reuses nothing
            # each mode reaches the deepest checkpoint position inside the shared prefix exactly
            assert a["reused"] == a["bound"] and i["reused"] == i["bound"], (name, a, i)
            assert a["shared_prefix"] >= a["reused"] >= i["reused"] >= 0
            assert a["reused"] + a["prefilled"] == a["prompt_tokens"] and a["ttft_s"] > 0
        assert anchors[0]["reused"] == 0 and all(t["reused"] > 0 for t in anchors[1:])
        assert res["anchors"]["reused"] > res["interval"]["reused"] > 0
    # the edits: W2's turn 3 truncates the first tool output, so it reuses less than its prompt's head
    w2 = results["w2"]["anchors"]["turns"]
    assert w2[2]["shared_prefix"] < w2[1]["prompt_tokens"]
    # the cut session's last turn resumes inside the cut log (after turn 1's prompt and reply), with
    # interval checkpoints only too
    first, last = results["cut"]["interval"]["turns"][0], results["cut"]["interval"]["turns"][2]
    assert last["reused"] % 32 == 0 and last["reused"] > first["prompt_tokens"] + first["output_tokens"]
