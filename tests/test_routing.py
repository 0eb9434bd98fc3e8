"""Routing traces: recorder/reader round trip, the cache simulator on traces with known answers,
Belady as the optimum (exhaustive search), and the simulated global LRU against the engine's counters."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest
import torch

from edgemoe.bench.replay import DEFAULT_POLICIES, Workload, build_workload, load_workload, main_replay, simulate
from edgemoe.bench.trace import RouteRecord, RoutingRecorder, TraceFormatError, TraceInfo, read_traces
from edgemoe.cli import build_parser
from edgemoe.core import ForwardBatch, Phase, SeqSlice

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "fixtures" / "routing_traces"
MIXTRAL = sorted(TRACES.glob("mixtral8x7b_*_routing.jsonl")) if TRACES.is_dir() else []


def workload(steps, L: int, E: int, phases=None) -> Workload:
    """``steps[t][layer]`` = experts of one token (or of a prompt, for a prefill step)."""
    recs = []
    for t, st in enumerate(steps):
        ph = phases[t] if phases else "decode"
        for layer, ex in enumerate(st):
            recs.append(RouteRecord("mem", 0, "r", ph, t + 1, layer, [t], [list(ex)], None))
    return build_workload(recs)


def misses(wl: Workload, policy: str, slots: int) -> int:
    return simulate(wl, policy, slots).misses


# ---------------------------------------------------------------------- known answers


def test_cyclic_access_of_c_plus_1_ids_defeats_lru():
    C = 4
    wl = workload([[[t % (C + 1)]] for t in range(10 * (C + 1))], L=1, E=C + 1)
    for p in ("lru", "layer-lru"):
        r = simulate(wl, p, C)
        assert (r.hits, r.miss_rate) == (0, 1.0), p
    # MIN: C compulsory misses, then each miss is followed by C - 1 hits
    T = len(wl.accesses)
    assert misses(wl, "belady", C) == C + -(-(T - C) // C)


def test_a_steps_experts_cannot_evict_each_other():
    # 3 layers x 2 experts, top-2: every token needs 6 ids. Per-layer shares of 5 slots are 2, 2, 1:
    # layers 0-1 hit after warm-up; layer 2 holds 1 of its 2 ids and the step's other id cannot
    # evict it, so layer 2 has one hit and one miss per token after warm-up
    steps = [[[0, 1], [0, 1], [0, 1]]] * 20
    wl = workload(steps, L=3, E=2)
    r = simulate(wl, "layer-lru", 5)
    assert r.decode_misses == [2, 2, 21] and r.decode_hits == [38, 38, 19]


def test_hot_set_that_fits_only_compulsory_misses():
    rng = random.Random(0)
    L, E, k = 4, 16, 2
    hot = {l: rng.sample(range(E), 3) for l in range(L)}  # 12 ids
    steps = [[rng.sample(hot[l], k) for l in range(L)] for _ in range(200)]
    wl = workload(steps, L, E)
    distinct = len({(l, e) for st in steps for l, ex in enumerate(st) for e in ex})
    for p in ("lru", "layer-lru", "lfu", "belady"):
        assert misses(wl, p, 16) == distinct, p
    assert misses(wl, "static-oracle", 12) == 0  # the placement is loaded before the first access


def test_static_and_prefill_updated_placements():
    E = 4
    pre = [[[0, 1, 2]]]  # a prompt touching experts 0, 1, 2 of the single layer
    dec = [[[0]], [[1]], [[3]], [[0]]]
    wl = workload(pre + dec, L=1, E=E, phases=["prefill"] + ["decode"] * 4)
    # prefill-updated keeps the prompt's 2 hottest (ties: smaller id) = {0, 1}: decode 0,1,0 hit, 3 misses
    r = simulate(wl, "prefill-updated", 2)
    assert (r.hits, r.misses) == (3, 1)
    assert simulate(wl, "static-layers", 2).misses == 1  # experts 0-1 of the last (only) layer
    assert simulate(wl, "static-oracle", 1).misses == 2  # decode-hottest id 0 placed
    assert wl.decode_tokens == 4 and wl.prefill_tokens == 1


def test_prefill_tokens_turns_a_decode_trace_prefix_into_a_prompt(tmp_path):
    lines = [{"problem_id": 0, "layer": l, "token_idx": t, "experts": [t % 4, 4 + l], "gating_probs": [0.6, 0.4]}
             for l in range(2) for t in range(6)]  # layer-major, as in the Mixtral files
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in lines) + "\n")
    wl = load_workload([path])
    assert (wl.num_layers, wl.num_experts, wl.top_k, wl.decode_tokens, wl.requests) == (2, 6, 2, 6, 1)
    assert [(a.step, a.layer) for a in wl.accesses[:4]] == [(1, 0), (1, 1), (2, 0), (2, 1)]  # token-major
    assert wl.accesses[0].ids == [0, 4] and wl.accesses[1].ids == [6, 11]
    wl2 = load_workload([path], prefill_tokens=2)
    assert (wl2.decode_tokens, wl2.prefill_tokens) == (4, 2)
    assert wl2.accesses[0].phase == "prefill" and wl2.accesses[0].ids == [0, 1, 4]


# ---------------------------------------------------------------------- Belady


def _optimum(wl: Workload, C: int) -> int:
    """Exhaustive search over every victim choice (fill on miss, a step's ids are not victims)."""
    states = {frozenset(): 0}
    for a in wl.accesses:
        G, new = set(a.ids), {}
        for S, cost in states.items():
            M = G - S
            others = sorted(S - G)
            need = min(max(0, len(S) + len(M) - C), len(others))
            room = C - (len(S) - need)
            for V in itertools.combinations(others, need):
                for A in itertools.combinations(sorted(M), min(room, len(M))):
                    T = (S - set(V)) | set(A)
                    new[T] = min(new.get(T, 1 << 30), cost + len(M))
        states = new
    return min(states.values())


def test_belady_is_the_optimum_on_small_traces():
    rng = random.Random(1)
    for _ in range(120):
        L, E, k = rng.choice([1, 2]), rng.choice([3, 4]), rng.choice([1, 2])
        C = rng.randint(k, min(5, L * E))
        wl = workload([[rng.sample(range(E), k) for _ in range(L)] for _ in range(rng.randint(3, 8))], L, E)
        assert misses(wl, "belady", C) == _optimum(wl, C)


@pytest.mark.parametrize("seed", range(4))
def test_belady_lower_bounds_fill_on_miss_policies(seed):
    rng = random.Random(seed)
    for _ in range(25):
        L, E, k = rng.choice([1, 2, 3]), rng.choice([4, 8]), rng.choice([1, 2])
        phases = ["prefill" if rng.random() < 0.1 else "decode" for _ in range(rng.randint(20, 80))]
        steps = [[rng.sample(range(E), rng.randint(k, E) if ph == "prefill" else k) for _ in range(L)]
                 for ph in phases]
        wl = workload(steps, L, E, phases)
        C = rng.randint(L * k, L * E)  # every layer's share holds a step (no policy is forced to skip fills)
        b = simulate(wl, "belady", C)
        for p in ("lru", "layer-lru", "lfu"):
            r = simulate(wl, p, C)
            assert b.misses <= r.misses and b.misses + b.prefill_misses <= r.misses + r.prefill_misses, p


def test_a_static_split_can_beat_fill_on_miss_belady():
    # documented limit of the bound: A B A B ... with one slot; static keeps A, every fill policy thrashes
    wl = workload([[[t % 2]] for t in range(20)], L=1, E=2)
    assert misses(wl, "belady", 1) == 20 and misses(wl, "static-oracle", 1) == 10


# ---------------------------------------------------------------------- recorder and reader


def _batch(step, phase, seqs, positions):
    q, sl = 0, []
    for sid, n in seqs:
        sl.append(SeqSlice(sid, q, n, 0, torch.zeros(0, dtype=torch.int64)))
        q += n
    T = torch.tensor(positions, dtype=torch.int64)
    return ForwardBatch(phase, T, T, T, sl, T[:1], step=step)


def test_recorder_round_trip(tmp_path):
    path = tmp_path / "trace.jsonl"
    g = torch.Generator().manual_seed(0)
    rec = RoutingRecorder(path)
    rec.write_header(num_moe_layers=2, num_experts=8, top_k=2)
    rec.name_sequence(7, "req-a")
    written = []
    plan = [(1, Phase.PREFILL, [(7, 3)], [0, 1, 2]), (2, Phase.DECODE, [(7, 1), (9, 1)], [3, 5])]
    for step, phase, seqs, pos in plan:
        b = _batch(step, phase, seqs, pos)
        for layer in range(2):
            ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in pos])  # [T, 2]
            w = torch.softmax(torch.randn(len(pos), 2, generator=g), -1).to(torch.bfloat16)  # [T, 2]
            rec(b, layer, ids, w)
            for sid, q0, n in [(s.seq_id, s.q_start, s.q_len) for s in b.seqs]:
                written.append((step, phase.value, sid, layer, pos[q0:q0 + n], ids[q0:q0 + n].tolist(),
                                w[q0:q0 + n].float().tolist()))
    rec.close()
    records, info = read_traces([path])
    assert info.get("num_experts") == 8 and info.headers[0]["format"] == "edgemoe-routing"
    assert len(records) == len(written)
    for r, (step, phase, sid, layer, pos, ids, w) in zip(records, written):
        assert (r.step, r.phase, r.seq_id, r.layer, r.positions, r.experts) == (step, phase, sid, layer, pos, ids)
        assert r.request == ("req-a" if sid == 7 else f"{path.name}#0:seq9")
        assert torch.allclose(torch.tensor(r.weights), torch.tensor(w), atol=1e-6)
    wl = build_workload(records, info)
    assert (wl.decode_tokens, wl.prefill_tokens, len(wl.accesses)) == (2, 3, 4)
    assert wl.accesses[2].counts and sum(wl.accesses[2].counts) == 4  # both sequences in one decode access


def test_reader_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "header"}\n{"foo": 1}\n')
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:2"):
        read_traces([bad])
    bad.write_text("not json\n")
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:1: not JSON"):
        read_traces([bad])


# ---------------------------------------------------------------------- against the engine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from edgemoe.synth import make_model

    return make_model(tmp_path_factory.mktemp("routing") / "tiny", "qwen3_moe", "tiny", seed=0, dtype="float32")


@pytest.mark.parametrize("slots,eviction,replayed", [(3, "global-lru", "lru"), (10, "global-lru", "lru"),
                                                     (20, "global-lru", "lru"), (12, "layer-lru", "layer-lru-engine"),
                                                     (20, "layer-lru", "layer-lru-engine")])
def test_replayed_lru_equals_engine_counters(tiny_dir, tmp_path, slots, eviction, replayed):
    from edgemoe.config import EngineConfig
    from edgemoe.engine.model_runner import ModelRunner, StepInput

    runner = ModelRunner(tiny_dir, EngineConfig(device="cpu", dtype="float32", expert_policy="fill-all",
                                                expert_cache_slots=slots, expert_eviction=eviction), progress=False)
    path = tmp_path / "engine.jsonl"
    rec = RoutingRecorder(path).attach(runner)
    toks = {0: list(range(5, 25)), 1: list(range(40, 52))}
    for sid in toks:
        rec.name_sequence(sid, f"req{sid}")
        toks[sid].append(int(runner.execute([StepInput(sid, toks[sid], 0)], Phase.PREFILL)[0].argmax()))
    for _ in range(12):  # both sequences decode together
        logits = runner.execute([StepInput(s, [toks[s][-1]], len(toks[s]) - 1) for s in toks], Phase.DECODE)
        for j, s in enumerate(toks):
            toks[s].append(int(logits[j].argmax()))
    rec.close()
    wl = load_workload([path])
    assert (wl.num_experts, wl.expert_bytes, wl.decode_tokens, wl.requests) == (16, 3 * 64 * 64 * 4, 24, 2)
    r = simulate(wl, replayed, slots)
    stats = runner.experts.stats()
    assert (r.hits, r.misses) == (stats["decode"]["hits"], stats["decode"]["misses"])
    assert (r.prefill_hits, r.prefill_misses) == (stats["prefill"]["hits"], stats["prefill"]["misses"])


# ---------------------------------------------------------------------- CLI and the Mixtral fixture


def _parse(argv):
    return build_parser().parse_args(["replay-routing", *argv])


def test_cli_table_plot_and_json(tmp_path, capsys):
    steps = [[[t % 3, 3 + t % 2]] for t in range(30)]
    recs = [RouteRecord("x", 0, "r", "decode", t + 1, 0, [t], [s[0]], None) for t, s in enumerate(steps)]
    path = tmp_path / "t.jsonl"
    with RoutingRecorder(path) as rec:
        for r in recs:
            rec(_batch(r.step, Phase.DECODE, [(0, 1)], r.positions), 0, torch.tensor(r.experts),
                torch.full((1, 2), 0.5))
    png, js = tmp_path / "p.png", tmp_path / "r.json"
    assert main_replay(_parse([str(path), "--capacity-slots", "1,2,4", "--plot", str(png), "--json", str(js)])) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "n/a (give --expert-bytes" in out
    assert png.stat().st_size > 1000 and len(json.loads(js.read_text())["results"]) == 3 * (len(DEFAULT_POLICIES) - 2)
    main_replay(_parse([str(path), "--capacity", "0.5", "--policy", "lru", "--expert-bytes", "1000000", "--no-plot"]))
    assert "MB" in capsys.readouterr().out


@pytest.mark.skipif(not MIXTRAL, reason=f"Mixtral routing-trace fixture not found in {TRACES}")
def test_mixtral_traces():
    wl = load_workload(MIXTRAL)
    assert (wl.num_layers, wl.num_experts, wl.top_k, wl.requests, wl.decode_tokens) == (32, 8, 2, 4, 585)
    rates = {(p, s): simulate(wl, p, s).miss_rate for p in ("lru", "layer-lru", "belady") for s in (26, 95)}
    assert rates["belady", 95] < rates["belady", 26] < rates["lru", 26]
    assert rates["belady", 95] < rates["lru", 95] < rates["lru", 26]
    # the engine's eviction rule is per-layer LRU because it misses less here (docs/benchmarks/policy.md)
    assert rates["layer-lru", 95] < rates["lru", 95] - 0.05 and rates["layer-lru", 26] < rates["lru", 26]


def test_generate_cli_records_routing_per_request(tiny_dir, tmp_path):
    """``edgemoe generate --record-routing``: every record names its request; replay reads it back."""
    from edgemoe.cli import main

    path = tmp_path / "cli.jsonl"
    assert main(["generate", str(tiny_dir), "--prompt", "hello world", "--max-tokens", "5", "--device", "cpu",
                 "--record-routing", str(path), "--json"]) == 0
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    routes = [r for r in recs if r["type"] == "route"]
    assert {r["phase"] for r in routes} == {"prefill", "decode"}
    assert all(r["request_id"] == "llm-0" for r in routes)
    wl = load_workload([path])
    assert wl.decode_tokens == 4 and wl.requests == 1  # 5 tokens: the first comes from prefill


def test_cli_prefetch_and_step_time(tmp_path, capsys):
    """replay-routing --prefetch replays traces recorded with predictions, --step-time adds the simulated
    tokens/s of every miss policy; --prefetch without predictions is an error."""
    L, E = 2, 8
    recs = []
    for t in range(40):
        for layer in range(L):
            ids = [(t + layer) % E, (t // 3 + 1) % E]
            recs.append(RouteRecord("x", 0, "r", "decode", t + 1, layer, [t], [ids], None,
                                    predicted=[[(t + layer) % E, (t + 5) % E]] if layer else None))
    info = TraceInfo([{"num_moe_layers": L, "num_experts": E, "top_k": 2}])
    wl = build_workload(recs, info)
    assert wl.accesses[1].predicted is not None and wl.accesses[0].predicted is None
    plain = simulate(wl, "layer-lru", 6)
    pre = simulate(wl, "layer-lru", 6, prefetch=True)
    assert pre.policy == "layer-lru+prefetch" and pre.decode_misses[1] < plain.decode_misses[1]
    assert pre.decode_misses[0] == plain.decode_misses[0]  # layer 0 has no prediction (its ids are protected)
    path = tmp_path / "p.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"type": "header", "num_moe_layers": L, "num_experts": E, "top_k": 2}) + "\n")
        for r in recs:
            line = {"type": "route", "seq_id": 0, "phase": "decode", "step": r.step, "layer": r.layer,
                    "pos": r.positions, "experts": r.experts}
            if r.predicted is not None:
                line["predicted"] = r.predicted
            f.write(json.dumps(line) + "\n")
    assert main_replay(_parse([str(path), "--capacity-slots", "4,6", "--policy", "lru,layer-lru", "--prefetch",
                               "--step-time", "h200", "--no-plot"])) == 0
    out = capsys.readouterr().out
    assert "layer-lru+prefetch" in out and "auto / best fixed" in out and "qstar+prefetch" in out
    plain_path = tmp_path / "q.jsonl"
    plain_path.write_text("".join(ln for ln in path.read_text().splitlines(True) if "predicted" not in ln))
    with pytest.raises(ValueError, match="predicted experts"):
        main_replay(_parse([str(plain_path), "--capacity-slots", "4", "--prefetch", "--no-plot"]))


@pytest.mark.parametrize("flags, message", [
    (["--prefill-tokens", "-5"], "--prefill-tokens must be >= 0, got -5"),
    (["--expert-bytes", "0"], "--expert-bytes must be >= 1, got 0"),
    (["--expert-bytes", "-1"], "--expert-bytes must be >= 1, got -1"),
    (["--layer-table-slots", "-1"], "--layer-table-slots must be >= 0, got -1"),
    (["--eviction", "global-lru"], "--eviction is the rule of the --step-time simulation"),
])
def test_cli_bad_counts_and_an_unused_eviction_are_refused(tmp_path, flags, message):
    """Each was accepted: the negative counts replayed as if absent (or printed negative bytes), and
    ``--eviction`` (even an unknown name) was ignored without ``--step-time``; refused before the trace is
    read (here it does not exist)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        main_replay(_parse([str(tmp_path / "never-read.jsonl"), "--no-plot", *flags]))
