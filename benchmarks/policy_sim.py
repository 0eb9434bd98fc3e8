"""Step-time simulation of the miss policies in the three routing regimes of the expert-policy study
(``docs/benchmarks/policy.md``), Qwen3-30B-A3B geometry (48 MoE layers x 128 experts, top-8,
9.44 MB experts), budgets in GB of expert cache, on a machine model of ``edgemoe.bench.steptime``:

- ``no-locality``: every token draws 8 distinct experts uniformly per layer;
- ``degenerate``: every token routes the same 8 experts per layer (one of them replaced with
  probability 0.03 per layer step), the random model's own routing;
- ``realistic``: the Mixtral-8x7B decode traces mapped onto the geometry with their temporal
  structure kept (``edgemoe.bench.replay.remap_workload``).

    python benchmarks/policy_sim.py --traces ../shared/fixtures/routing_traces/*.jsonl

``--contention CPU_FACTOR``: instead, the no-locality regime (``--layers`` MoE layers) decoded for
20 simulated seconds at the first budget, with the CPU side ``CPU_FACTOR`` times slower from 4 s to
10 s (another process on the executor's cores, as the GPU host's contention benchmark found it):
tokens/s before, in the first second of the slowdown and after it, and in the first second after
and after that, per policy (the offline counterpart of ``benchmarks/contention.py``).

``--fill-ratios R1,R2,...``: instead, in each regime and budget, ``qstar`` with a fixed share ``R`` of each layer
step's misses filled: tokens/s, hit rate, fills per token, and the *marginal* hits per fill between consecutive
ratios (the extra hits per token over the extra fills per token), beside the net reuse per fill that the engine's
accounting measures for ``auto`` in the same run (``LayerObservation``): what one more fill actually buys against
what ``auto`` is told it buys.

    python benchmarks/policy_sim.py --traces T1 T2 --preset h100-cpu49 --prompt 32 --tokens 32 --budgets 6 \
        --fill-ratios 0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0

``--read-cost WINDOWS``: instead, the host time of ``auto``'s window read (``AutoPolicy.observe_layers``: the
estimates, the balance controller and the table rebuilt) at ``--layers`` MoE layers and a table of 128 miss counts
(the engine's at 16 sequences of top-8), over WINDOWS windows of random reuse counts at the preset's costs: the
time the decode loop spends on it between two steps, every 2-8 decode steps.

    python benchmarks/policy_sim.py --read-cost 200 --layers 48
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.bench import replay as R
from edgemoe.bench import steptime as S
from edgemoe.bench.trace import RouteRecord, TraceInfo

L, E, K = 48, 128, 8
FIXED = ("fill-all", "cpu-all", "static", "qstar")


def degenerate(tokens: int, seed: int = 0, change: float = 0.03, layers: int = L) -> R.Workload:
    """Every token routes the same ``K`` experts per layer; one is replaced with probability ``change``."""
    rng = random.Random(seed)
    base = [rng.sample(range(E), K) for _ in range(layers)]
    recs = []
    for t in range(tokens):
        for layer in range(layers):
            ids = list(base[layer])
            if rng.random() < change:
                ids[rng.randrange(K)] = rng.choice([e for e in range(E) if e not in ids])
            recs.append(RouteRecord("degenerate", 0, "d", "decode", t + 1, layer, [t], [ids], None))
    return R.build_workload(recs, TraceInfo([{"num_moe_layers": layers, "num_experts": E, "top_k": K}]))


def realistic(paths: list[str], tokens: int, prompt: int = 0, layers: int = L) -> R.Workload:
    """The traces mapped onto the geometry, their first ``tokens`` decode steps; with ``prompt > 0`` the first
    ``prompt`` steps are one prefill step instead (as ``benchmarks/decode.py --routing trace`` replays them: the
    prompt reads the traces' first rows, decode the rows after them)."""
    wl = R.remap_workload(R.load_workload(paths), layers, E, K)
    order = sorted({a.step for a in wl.accesses})
    pre, keep = set(order[:prompt]), set(order[prompt:prompt + tokens])
    accesses = []
    if pre:
        for layer in range(layers):
            cnt: dict[int, int] = {}
            for a in wl.accesses:
                if a.step in pre and a.layer == layer:
                    for f, n in zip(a.ids, a.counts):
                        cnt[f] = cnt.get(f, 0) + n
            ids = sorted(cnt)
            accesses.append(R.Access("prefill", order[0], layer, ids, [cnt[f] for f in ids], {"p": dict(cnt)}))
    accesses += [a for a in wl.accesses if a.step in keep]
    return R.Workload(accesses, layers, E, K, len(keep), prompt, 1)


def contention(a: argparse.Namespace, start_s: float = 4.0, end_s: float = 10.0, total_s: float = 20.0) -> int:
    """The ``--contention`` table (see the module docstring)."""
    costs = S.COST_PRESETS[a.preset]
    gb = float(a.budgets.split(",")[0])
    slots = int(gb * 1e9 // S.QWEN3_30B_EXPERT_BYTES)
    layers = a.layers or 16
    base = S.simulate_time(R.uniform_workload(layers, E, K, 64), "fill-all", slots, costs, token_base_s=1e-3)
    tokens = int(total_s * 2 * base.tokens_per_s) + 64  # enough steps for every policy to pass total_s
    wl = R.uniform_workload(layers, E, K, tokens)
    load = S.Contention(start_s, end_s, cpu_factor=a.contention)
    print(f"no-locality, {layers} layers, {gb:g} GB ({slots} slots), CPU x{a.contention:g} from {start_s:g} s "
          f"to {end_s:g} s, machine {a.preset}")
    print("| policy | before | load, 1st s | load, rest | after, 1st s | after, rest |")
    print("|---|---|---|---|---|---|")
    for pol in ("auto", "qstar", "fill-all", "cpu-all"):
        res = S.simulate_time(wl, pol, slots, costs, "lru", token_base_s=1e-3, contention=load, lateness=a.lateness)
        ends, t = [], 0.0
        for x in res.step_seconds:
            t += x
            ends.append(t)

        def rate(lo: float, hi: float, ends: list[float] = ends) -> float:
            return sum(1 for e in ends if lo <= e < hi) / (hi - lo)

        spans = [(0.5, start_s), (start_s, start_s + 1), (start_s + 1, end_s), (end_s, end_s + 1),
                 (end_s + 1, total_s)]
        print(f"| {pol} | " + " | ".join(f"{rate(lo, hi):.1f}" for lo, hi in spans) + " |", flush=True)
    return 0


def fill_ratios(a: argparse.Namespace, regimes: dict[str, R.Workload]) -> int:
    """The ``--fill-ratios`` table (see the module docstring)."""
    costs = S.COST_PRESETS[a.preset]
    ratios = [float(x) for x in a.fill_ratios.split(",") if x]
    print("| regime | budget (GB) | fill ratio | tokens/s | hit rate | fills / token | marginal hits / fill |")
    print("|---|---|---|---|---|---|---|")
    for name, wl in regimes.items():
        for gb in (float(x) for x in a.budgets.split(",") if x):
            slots = int(gb * 1e9 // S.QWEN3_30B_EXPERT_BYTES)
            ev = a.eviction if a.eviction != "engine" else "layer-lru" if slots >= wl.num_layers * K else "lru"
            prev = None
            for r in ratios:
                res = S.simulate_time(wl, "qstar", slots, costs, ev, token_base_s=1e-3, warmup=a.warmup, fill_ratio=r)
                n = max(1, wl.decode_tokens)
                hits, fills = res.hits / n, res.fills / n
                marginal = ("-" if prev is None or abs(fills - prev[1]) < 0.5  # too few extra fills to divide by
                            else f"{(hits - prev[0]) / (fills - prev[1]):.2f}")
                print(f"| {name} | {gb:g} | {r:.2f} | {res.tokens_per_s:.1f} | {res.hit_rate:.3f} | {fills:.1f} | "
                      f"{marginal} |", flush=True)
                prev = (hits, fills)
            auto = S.simulate_time(wl, "auto", slots, costs, ev, token_base_s=1e-3, warmup=a.warmup)
            print(f"| {name} | {gb:g} | auto's measured net reuse per fill, by window | "
                  + ", ".join(f"{x:.2f}" for x in auto.reuse_per_fill) + " | | | |", flush=True)
    return 0


def read_cost(a: argparse.Namespace) -> int:
    """``--read-cost``: median and 90th percentile milliseconds of one ``auto`` window read."""
    import time

    from edgemoe.experts.policy import AutoPolicy, LayerObservation

    layers, rnd = a.layers or L, random.Random(0)
    auto = AutoPolicy(S.COST_PRESETS[a.preset], num_layers=layers, max_misses=128, armed=False)
    auto.price_armed_branch(8e-6)
    times = []
    for _ in range(a.read_cost):
        obs = LayerObservation(reuse_net=[rnd.randint(0, 8) for _ in range(layers)],
                               fills=[rnd.randint(0, 6) for _ in range(layers)], handoffs=[0] * layers,
                               late=[0] * layers, misses_per_layer_step=rnd.choice([0.05, 0.5, 2.0, 6.0]), steps=8,
                               free_slot_fills=0)
        t0 = time.perf_counter()
        if auto.observe_layers(obs):
            auto.fill_table()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"auto window read, {layers} layers x miss counts 0-128, {len(times)} windows: median "
          f"{1e3 * times[len(times) // 2]:.3f} ms, p90 {1e3 * times[int(0.9 * len(times))]:.3f} ms")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="*", default=[], help="routing traces of the realistic regime")
    ap.add_argument("--tokens", type=int, default=300, help="decode steps per regime")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps not timed")
    ap.add_argument("--prompt", type=int, default=0,
                    help="realistic regime: the traces' first PROMPT steps as one prefill step before decode")
    ap.add_argument("--budgets", default="2,6,16", help="expert-cache budgets in GB")
    ap.add_argument("--eviction", default="engine",
                    help="a replay rule, or engine: layer-lru when every layer's share holds a token's top-k, else lru")
    ap.add_argument("--preset", default="h200", choices=sorted(S.COST_PRESETS))
    ap.add_argument("--lateness", default="yes-no", choices=S.LATENESS,
                    help="how the balance controller's joins are counted: yes-no (the engine's) or graded (by how "
                    "late or early against one expert's time; a design study, see edgemoe.bench.steptime)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--contention", type=float, default=None, metavar="CPU_FACTOR",
                    help="simulate a CPU slowdown by this factor from 4 s to 10 s instead (see above)")
    ap.add_argument("--layers", type=int, default=None,
                    help="MoE layers (default 48, the geometry's; 16 with --contention, the side-by-side checkpoint's)")
    ap.add_argument("--fill-ratios", default="", help="fixed fill shares for qstar instead of the policy table "
                    "(comma-separated; see above)")
    ap.add_argument("--read-cost", type=int, default=0, metavar="WINDOWS",
                    help="time auto's window read over this many windows instead (see above)")
    a = ap.parse_args(argv)
    if a.read_cost:
        return read_cost(a)
    if a.contention is not None:
        return contention(a)
    layers = a.layers or L
    regimes = {"no-locality": R.uniform_workload(layers, E, K, a.tokens),
               "degenerate": degenerate(a.tokens, layers=layers)}
    if a.traces:
        regimes["realistic"] = realistic(a.traces, a.tokens, a.prompt, layers=layers)
    if a.fill_ratios:
        return fill_ratios(a, regimes)
    costs = S.COST_PRESETS[a.preset]
    rows = []
    print(f"| regime | budget (GB) | {' | '.join(S.MISS_POLICIES)} | best fixed | auto / best fixed |")
    print("|---|---|" + "---|" * len(S.MISS_POLICIES) + "---|---|")
    for name, wl in regimes.items():
        for gb in (float(x) for x in a.budgets.split(",") if x):
            slots = int(gb * 1e9 // S.QWEN3_30B_EXPERT_BYTES)
            ev = a.eviction if a.eviction != "engine" else "layer-lru" if slots >= layers * K else "lru"
            tps = {p: S.simulate_time(wl, p, slots, costs, ev, token_base_s=1e-3, warmup=a.warmup,
                                      lateness=a.lateness).tokens_per_s
                   for p in S.MISS_POLICIES}
            best = max(FIXED, key=tps.get)
            rows.append({"regime": name, "budget_gb": gb, "slots": slots, "eviction": ev, "tokens_per_s": tps,
                         "best_fixed": best, "auto_ratio": tps["auto"] / tps[best]})
            print(f"| {name} | {gb:g} | " + " | ".join(f"{tps[p]:.1f}" for p in S.MISS_POLICIES)
                  + f" | {best} | {tps['auto'] / tps[best]:.3f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"preset": a.preset, "eviction": a.eviction, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
