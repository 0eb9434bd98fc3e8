"""The expert-policy study's benchmark plumbing on CPU at tiny scale: ``benchmarks/decode.py --routing
trace`` (recorded routing replayed per layer) and ``benchmarks/policy_summary.py`` (the table the
GPU host's ``scripts/gpu_check.sh policy`` stage prints)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TRACES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "routing_traces"
MIXTRAL = sorted(TRACES.glob("mixtral*.jsonl")) if TRACES.is_dir() else []


@pytest.mark.skipif(not MIXTRAL, reason=f"Mixtral routing-trace fixture not found in {TRACES}")
def test_decode_benchmark_replays_traces_and_summary_table(tmp_path, load_benchmark):
    bench = load_benchmark("decode")
    run = tmp_path / "policy" / "realistic"
    traces = ",".join(map(str, MIXTRAL))
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--budgets", "0.0005",
                       "--policies", "qstar,auto,fill-all",
                       "--routing", "trace", "--trace", traces, "--tokens", "4", "--warmup", "1",
                       "--profile-seconds", "0.05", "--rotate-gb", "0.05", "--no-resident", "--cpu-threads", "1",
                       "--step-log", "--out", str(run)]) == 0
    data = json.loads((run / "decode.json").read_text())
    assert data["meta"]["routing"] == "trace" and data["meta"]["trace_steps"] > 100
    assert data["meta"]["eviction"] == "layer-lru"
    res = {r["policy"]: r for r in data["results"]}
    assert set(res) == {"qstar", "auto", "fill-all"}
    for r in res.values():  # the step log: warm-up and timed steps, their counters summing to the timed totals
        steps = r["steps"]
        assert [s["step"] for s in steps] == list(range(5))
        assert sum(s["fills"] for s in steps[1:]) == pytest.approx(r["fills_per_token"] * 4)
        assert sum(s["cpu"] for s in steps[1:]) == pytest.approx(r["cpu_per_token"] * 4)
    assert {"fills_every_miss", "cpu_level", "late_fraction"} <= set(res["auto"]["steps"][-1])
    assert res["fill-all"]["hit_rate"] > 0  # the replayed trace repeats experts across steps
    summary = load_benchmark("policy_summary")
    assert summary.main([str(tmp_path / "policy")]) == 0
    rows = json.loads((tmp_path / "policy" / "summary.json").read_text())
    assert len(rows) == 1 and rows[0]["regime"] == "realistic" and rows[0]["threads"] == 1
    best = rows[0]["best_fixed"]
    assert best in ("qstar", "fill-all")
    assert rows[0]["auto_ratio"] == pytest.approx(res["auto"]["tokens_per_s"] / res[best]["tokens_per_s"])
    assert "| realistic | 1 | 0.0005 |" in (tmp_path / "policy" / "summary.md").read_text()


def test_repeats_alternate_and_the_summary_takes_medians(tmp_path, load_benchmark, capsys):
    """``decode.py --repeats 2`` runs the policies in turn twice per budget, the second time starting one policy
    further into the list (results carry the repeat index);
    the summary counts each policy by its median and reports the spread of the repeats."""
    run = tmp_path / "policy" / "no-locality"
    assert load_benchmark("decode").main([
        "--preset", "tiny", "--device", "cpu", "--budgets", "0.0005", "--policies", "qstar,fill-all",
        "--routing", "uniform", "--tokens", "2", "--warmup", "1", "--profile-seconds", "0.05", "--rotate-gb", "0.05",
        "--no-resident", "--cpu-threads", "1", "--repeats", "2", "--step-log", "--step-markers",
        "--out", str(run)]) == 0
    data = json.loads((run / "decode.json").read_text())
    assert [(r["policy"], r["repeat"]) for r in data["results"]] == [  # each repeat starts one policy further
        ("qstar", 0), ("fill-all", 0), ("fill-all", 1), ("qstar", 1)]
    # an untimed auto run before the first timed one compiles every policy's kernels; it is not a result
    assert data["meta"]["kernel_warmup"] and "kernel warm-up (auto, 0.0005 GB)" in capsys.readouterr().out
    for r in data["results"]:  # --step-markers: each step's forward time and the idle time before it
        steps = r["steps"]
        assert len(steps) == 3 and steps[0]["gap_ms"] is None
        assert all(0 < s["gpu_ms"] < s["ms"] for s in steps) and all(s["gap_ms"] >= 0 for s in steps[1:])
    with pytest.raises(SystemExit):  # the markers add to the step log, which was not asked for
        load_benchmark("decode").main(["--preset", "tiny", "--device", "cpu", "--step-markers", "--out", str(run)])
    # --reuse-priors: auto once per prior, each its own place in the rotation, its prior set on the new cache's policy
    ab = tmp_path / "prior"
    assert load_benchmark("decode").main([
        "--preset", "tiny", "--device", "cpu", "--budgets", "0.0005", "--policies", "qstar,auto",
        "--reuse-priors", "4,0", "--routing", "uniform", "--tokens", "2", "--warmup", "1", "--profile-seconds", "0.05",
        "--rotate-gb", "0.05", "--no-resident", "--cpu-threads", "1", "--out", str(ab)]) == 0
    res = json.loads((ab / "decode.json").read_text())["results"]
    assert [(r["policy"], r.get("reuse_prior")) for r in res] == [
        ("qstar", None), ("auto/prior 4", 4.0), ("auto/prior 0", 0.0)]
    with pytest.raises(SystemExit):  # a prior without auto to run it
        load_benchmark("decode").main(["--preset", "tiny", "--device", "cpu", "--policies", "qstar",
                                       "--reuse-priors", "4", "--out", str(ab)])
    # the summary over made-up figures: medians of three repeats, the spread of the noisiest policy
    results = [{"policy": p, "threads": 6, "budget_gb": 2, "tokens_per_s": v}
               for p, vs in (("qstar", (90.0, 100.0, 120.0)), ("auto", (99.0, 97.0, 98.0)),
                             ("fill-all", (50.0, 50.0, 50.0))) for v in vs]
    (run / "decode.json").write_text(json.dumps({"meta": {}, "results": results}))
    summary = load_benchmark("policy_summary")
    assert summary.main([str(tmp_path / "policy")]) == 0
    row, = json.loads((tmp_path / "policy" / "summary.json").read_text())
    assert row["tokens_per_s"] == {"qstar": 100.0, "auto": 98.0, "fill-all": 50.0}
    assert row["best_fixed"] == "qstar" and row["auto_ratio"] == pytest.approx(0.98)
    assert row["repeats"] == 3 and row["spread"] == pytest.approx(0.3)
    assert "| no-locality | 6 | 2 | 100.0 | 98.0 | 50.0 | qstar | 0.980 | 3 | 0.300 |" in (
        tmp_path / "policy" / "summary.md").read_text()
    # a variant of auto (decode.py --join-lateness yes-no,graded): its own column and ratio, after auto's
    results += [{"policy": "auto/graded", "threads": 6, "budget_gb": 2, "tokens_per_s": 101.0}]
    (run / "decode.json").write_text(json.dumps({"meta": {}, "results": results}))
    assert summary.main([str(tmp_path / "policy")]) == 0
    row, = json.loads((tmp_path / "policy" / "summary.json").read_text())
    assert row["ratios"] == pytest.approx({"auto": 0.98, "auto/graded": 1.01})
    table = (tmp_path / "policy" / "summary.md").read_text()
    assert "| auto/graded | fill-all | best fixed | auto / best fixed | auto/graded / best fixed |" in table
    assert "| no-locality | 6 | 2 | 100.0 | 98.0 | 101.0 | 50.0 | qstar | 0.980 | 1.010 | 3 | 0.300 |" in table
    for bad in ("yes-no,signed", "yes-no,yes-no"):  # a count the engine does not have, or one twice
        with pytest.raises(SystemExit):
            load_benchmark("decode").main(["--preset", "tiny", "--device", "cpu", "--join-lateness", bad,
                                           "--out", str(tmp_path / "bad")])


def test_fixed_fill_shares_run_qstar_at_each_share_after_the_policies(tmp_path, load_benchmark):
    """``decode.py --fill-shares``: after the policies of each budget and repeat, ``qstar`` at each fixed share of
    the misses filled (``share S``; its rule fills ``round(m * S)``), the measured bandwidths back in place after."""
    out = tmp_path / "shares"
    bench = load_benchmark("decode")
    assert bench.main([
        "--preset", "tiny", "--device", "cpu", "--budgets", "0.0005", "--policies", "qstar",
        "--routing", "uniform", "--tokens", "2", "--warmup", "1", "--profile-seconds", "0.05", "--rotate-gb", "0.05",
        "--no-resident", "--cpu-threads", "1", "--fill-shares", "0.25,1", "--out", str(out)]) == 0
    data = json.loads((out / "decode.json").read_text())
    res = data["results"]
    assert data["meta"]["bandwidths_used"]["source"].startswith("measured")  # the profile's, put back after
    assert [r["policy"] for r in res] == ["qstar", "share 0.25", "share 1"]
    assert [r.get("fill_share") for r in res] == [None, 0.25, 1.0]
    assert res[1]["q_ratio_policy"] == pytest.approx(0.25) and res[2]["q_ratio_policy"] == 1.0
    assert res[0]["q_ratio_policy"] != pytest.approx(0.25)  # qstar's own split, from the measured bandwidths
    for bad in ("0", "0.5,0.5"):
        with pytest.raises(SystemExit):
            bench.main(["--preset", "tiny", "--device", "cpu", "--fill-shares", bad, "--out", str(tmp_path / "bad")])
    # the summary gives the shares columns of their own, after the policies
    (tmp_path / "p" / "realistic").mkdir(parents=True)
    (out / "decode.json").rename(tmp_path / "p" / "realistic" / "decode.json")
    assert load_benchmark("policy_summary").main([str(tmp_path / "p")]) == 0
    row, = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert set(row["tokens_per_s"]) == {"qstar", "share 0.25", "share 1"} and row["best_fixed"] == "qstar"
    header = (tmp_path / "p" / "summary.md").read_text().splitlines()[0]
    assert header == "| regime | threads | budget (GB) | qstar | share 0.25 | share 1 | best fixed | repeats | spread |"


@pytest.mark.skipif(not MIXTRAL, reason=f"Mixtral routing-trace fixture not found in {TRACES}")
def test_requests_share_one_cache_and_replay_later_stretches_of_the_trace(tmp_path, load_benchmark):
    """``decode.py --requests 3``: three requests per run on one cache and policy, each after its own prefill;
    the timed steps add up over the requests (the first request's warm-up untimed), the first request is the
    single-request run's, and a prefill restarts the trace replay where ``route_from_trace``'s ``start`` says."""
    bench = load_benchmark("decode")
    traces = ",".join(map(str, MIXTRAL))
    common = ["--preset", "tiny", "--device", "cpu", "--budgets", "0.0005", "--policies", "fill-all",
              "--routing", "trace", "--trace", traces, "--tokens", "3", "--warmup", "1", "--profile-seconds", "0.05",
              "--rotate-gb", "0.05", "--no-resident", "--cpu-threads", "1", "--step-log"]
    assert bench.main([*common, "--requests", "3", "--out", str(tmp_path / "r3")]) == 0
    r3, = json.loads((tmp_path / "r3" / "decode.json").read_text())["results"]
    assert r3["requests"] == 3 and len(r3["request_tokens_per_s"]) == 3
    assert [s["step"] for s in r3["steps"]] == list(range(1 + 3 * 3))
    timed = r3["steps"][1:]
    assert sum(s["fills"] for s in timed) == pytest.approx(r3["fills_per_token"] * 9)
    assert r3["tokens_per_s"] == pytest.approx(9 / sum(3 / t for t in r3["request_tokens_per_s"]))
    assert bench.main([*common, "--out", str(tmp_path / "r1")]) == 0
    r1, = json.loads((tmp_path / "r1" / "decode.json").read_text())["results"]
    assert "requests" not in r1 and [s["step"] for s in r1["steps"]] == list(range(4))
    assert [s["misses"] for s in r3["steps"][:4]] == [s["misses"] for s in r1["steps"]]
    # request r starts past every row the requests before it read: each sequence's prefill restarts at the
    # request's start and reads P rows, each decode step reads one row per sequence
    P, W, T = 32, 1, 3
    for b in (1, 2, 5):
        read = []
        for r in range(3):
            start = bench.trace_offset(r, P, W, T, b)
            steps = W + T if r == 0 else T
            read.append(set(range(start, start + P + b * steps)))
        assert not read[0] & read[1] and not read[1] & read[2] and not read[0] & read[2]
    with pytest.raises(SystemExit):
        bench.main([*common, "--requests", "0", "--out", str(tmp_path / "r0")])
    # the replay's start: a prefill (>= reset_tokens tokens) reads the trace's rows from start[0] on
    from edgemoe.config import EngineConfig
    from edgemoe.engine.model_runner import ModelRunner
    from edgemoe.synth import write_config_only

    model = write_config_only(tmp_path / "tiny", "qwen3_moe", "tiny")
    runner = ModelRunner(model, EngineConfig(device="cpu", load_format="dummy", expert_cache_slots=0,
                                             expert_policy="cpu-all"), progress=False)
    start = [0]
    assert bench.route_from_trace(runner, MIXTRAL, reset_tokens=6, start=start) > 100
    block = next(iter(runner.model.moe_blocks()))
    x = torch.zeros(6, runner.model_config.hidden_size, dtype=runner.dtype)
    from_0 = block.route(x)[0]  # rows 0-5 of the replay table (expert ids [6, k])
    start[0] = 3
    from_3 = block.route(x)[0]  # rows 3-8
    assert torch.equal(from_3[:3], from_0[3:]) and not torch.equal(from_3, from_0)
    step = block.route(x[:1])[0]  # a decode step reads on: row 9
    start[0] = 4
    assert torch.equal(block.route(x)[0][-1:], step)  # rows 4-9


def test_policy_summary_without_runs(tmp_path, load_benchmark, capsys):
    assert load_benchmark("policy_summary").main([str(tmp_path)]) == 1
    assert "no */decode.json" in capsys.readouterr().err


def test_policy_sim_rows(tmp_path, load_benchmark):
    """``benchmarks/policy_sim.py``: the step-time simulation of the study (small, no traces)."""
    sim = load_benchmark("policy_sim")
    out = tmp_path / "sim.json"
    assert sim.main(["--tokens", "24", "--budgets", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["regime"] for r in rows] == ["no-locality", "degenerate"]
    for r in rows:
        assert r["best_fixed"] in ("fill-all", "cpu-all", "static", "qstar") and r["auto_ratio"] > 0.5
    assert rows[1]["tokens_per_s"]["fill-all"] > rows[0]["tokens_per_s"]["fill-all"]  # locality pays


def test_policy_sim_contention_auto_follows_a_stalled_cpu(load_benchmark, capsys):
    """``policy_sim.py --contention``: with the CPU side 15x slower mid-run (another process on the
    executor's cores), ``auto`` moves its misses to the fills within the slowdown (far above ``qstar``,
    near ``fill-all``) and returns to its own rate after it."""
    assert load_benchmark("policy_sim").main(["--contention", "15", "--layers", "8"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] in ("auto", "qstar", "fill-all", "cpu-all"):
            rows[cells[0]] = [float(c) for c in cells[1:]]
    before, _, during, _, after = range(5)
    auto, qstar, fill = rows["auto"], rows["qstar"], rows["fill-all"]
    assert auto[during] > 3 * qstar[during] and auto[during] > 0.85 * fill[during]
    assert auto[after] > 0.95 * auto[before] and auto[before] > fill[before]


def test_policy_sim_graded_lateness_keeps_the_split_no_single_move_improves(tmp_path, load_benchmark):
    """``policy_sim.py --lateness graded``: on a machine whose CPU reads about as fast as PCIe (preset ``h100-a6``),
    no locality, 2 GB, the split of 4 of 8 misses leaves the CPU branch slightly longer; counted yes/no, every
    hand-off is late and the controller moves to a slower split for a window; counted by how late (more than one
    fill's time, or early by more than one CPU expert's), no single move pays and ``auto`` runs level with ``qstar``."""
    sim = load_benchmark("policy_sim")
    ratio = {}
    for lateness in ("yes-no", "graded"):
        out = tmp_path / f"{lateness}.json"
        assert sim.main(["--preset", "h100-a6", "--budgets", "2", "--tokens", "48", "--lateness", lateness,
                         "--json", str(out)]) == 0
        row = next(r for r in json.loads(out.read_text())["rows"] if r["regime"] == "no-locality")
        ratio[lateness] = row["tokens_per_s"]["auto"] / row["tokens_per_s"]["qstar"]
    assert ratio["graded"] > 0.99 and ratio["graded"] > ratio["yes-no"] + 0.01
    from edgemoe.bench import replay, steptime

    with pytest.raises(ValueError, match="lateness"):
        steptime.simulate_time(replay.uniform_workload(2, 8, 2, 4), "auto", 4, steptime.COST_PRESETS["h100"],
                               lateness="signed")


def test_policy_sim_fill_ratios_marginal_value(load_benchmark, capsys):
    """``policy_sim.py --fill-ratios``: a fixed share of the misses filled; without locality one more fill buys no
    hit (marginal hits per fill near 0), and filling every miss is slower than a split; ``auto``'s measured net
    reuse per fill is printed beside it, near 0 there too."""
    assert load_benchmark("policy_sim").main(["--tokens", "24", "--budgets", "6", "--fill-ratios", "0.4,0.7,1.0"]) == 0
    rows: dict[tuple[str, str], list[str]] = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] in ("no-locality", "degenerate"):
            rows[(cells[0], cells[2])] = cells
    split, every = rows[("no-locality", "0.40")], rows[("no-locality", "1.00")]
    assert float(split[3]) > float(every[3])  # tokens/s: the CPU's share pays without locality
    assert float(every[5]) > float(split[5])  # fills per token rise with the ratio
    assert abs(float(rows[("no-locality", "0.70")][6])) < 0.1 and abs(float(every[6])) < 0.1
    measured = rows[("no-locality", "auto's measured net reuse per fill, by window")][3]
    assert measured and all(abs(float(x)) < 0.2 for x in measured.split(","))


def test_a_trees_auto_only_folder_takes_its_regimes_fixed_policies(tmp_path, load_benchmark):
    """A before/after folder ``REGIME@TREE`` that ran only ``auto`` is compared with the best fixed policy of
    folder ``REGIME`` at the same threads and budget (``fill-all`` from its one thread count)."""
    def write(name, results):
        (tmp_path / name).mkdir()
        (tmp_path / name / "decode.json").write_text(json.dumps({"meta": {}, "results": [
            {"policy": p, "threads": t, "budget_gb": 2, "tokens_per_s": v} for p, t, v in results]}))

    write("realistic", [("qstar", 6, 50.0), ("auto", 6, 49.0), ("fill-all", 6, 60.0),
                        ("qstar", 15, 70.0), ("auto", 15, 68.0)])
    write("realistic@p4", [("auto", 6, 66.0), ("auto", 15, 63.0)])
    write("degenerate@p4", [("auto", 6, 10.0)])  # no home folder: no ratio
    rows, table = load_benchmark("policy_summary").summarize(tmp_path)
    got = {(r["regime"], r["threads"]): (r["best_fixed"], r["auto_ratio"]) for r in rows}
    assert got[("realistic", 6)] == ("fill-all", pytest.approx(49 / 60))
    assert got[("realistic@p4", 6)] == ("fill-all", pytest.approx(66 / 60))
    assert got[("realistic@p4", 15)] == ("qstar", pytest.approx(63 / 70))
    assert got[("degenerate@p4", 6)] == (None, None)
    assert "| realistic@p4 | 15 | 2 | - | 63.0 | - | qstar | 0.900 |" in table


@pytest.mark.skipif(not MIXTRAL, reason=f"Mixtral routing-trace fixture not found in {TRACES}")
def test_prefill_residency_benchmark_keeps_the_prompts_experts_for_decode(load_benchmark):
    """``benchmarks/prefill_residency.py`` at 12 layers: a cache of 50 slots a layer (256 of them the prefill's two
    staging regions) keeps every layer's routed prompt experts through a streamed prefill, so decode's first step hits
    most of its experts (staging into the free slots in layer order left the first layers' experts: 34 hits)."""
    bench = load_benchmark("prefill_residency")
    rows = bench.trace_rows([str(p) for p in MIXTRAL], 12, 128, 8)
    hits = bench.decode_hits(rows, 12 * 50, 32, 4, 128, partition=True)
    assert len(hits) == 4 and hits[0] >= 0.8 * 12 * 8
