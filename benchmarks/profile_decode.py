"""Where a device-path decode step's time goes: host work, kernels, and the gaps between them.

Loads a model on CUDA (a preset's geometry with dummy weights by default), places every expert in the
cache (all hits: the resident step) or gives it ``--budget-gb`` of cache under ``--policy``, prefills a
random prompt and decodes random tokens (the llama.cpp comparison's protocol, ``--routing model``: the
checkpoint's own routers), then:

- times ``--tokens`` steps the way ``benchmarks/decode.py`` does (tokens/s, ms per step);
- runs ``--profile-steps`` more under ``torch.profiler`` (CPU and CUDA activity; kernels replayed from a
  CUDA graph are recorded one by one) and prints, per step: the wall time, the kernel time summed, the
  GPU's busy span (first kernel start to last kernel end, gaps included), the host time before the first
  kernel and after the last, and a table of kernels by total time (calls per step, µs per step, mean µs);
- with ``--eager`` the same step without CUDA graphs, so each kernel's launch cost shows.

    python benchmarks/profile_decode.py --preset qwen3-30b-a3b --layers 16 --out results/profile
    python benchmarks/profile_decode.py --preset qwen3-30b-a3b --layers 16 --eager

Writes ``profile_decode.json`` (the numbers above) and ``trace.json`` (Chrome trace) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from benchmarks.decode import add_model_args, model_dir, route_uniformly
from edgemoe.bench.step_markers import StepMarkers, step_times
from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput


def kernel_events(prof: torch.profiler.profile) -> list:
    """The profile's device-side kernel events (``DeviceType.CUDA``; memcpy/memset included)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "decode_step"]


def step_windows(prof: torch.profiler.profile, label: str) -> list[tuple[float, float]]:
    """(start, end) in µs of each ``record_function(label)`` range on the host."""
    return sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.name == label and e.device_type == torch.autograd.DeviceType.CPU)  # not its GPU-side twin


def marked_steps(runner: ModelRunner, step, sync, n: int, warmup: int, n_feed: int, key) -> dict:
    """``n`` decode steps (``step(i)``; ``sync()`` waits for the device) with the model's forward stamped on the
    device clock, the decode graphs captured again with the stamps (and dropped after), then the step's graph
    replayed ``n`` times back to back; :func:`~edgemoe.bench.step_markers.step_times` of both, in ms
    (``replay_*``: medians), and the steps' wall time."""
    mk = StepMarkers(runner.device, capacity=2 * n + 2 * warmup + 8)
    with mk.wrap(runner.model):
        if runner.graphs is not None:
            runner.graphs.invalidate()
        for i in range(warmup):
            step(i % n_feed)
        sync()
        mk.reset()
        t0 = time.perf_counter()
        for i in range(n):
            step((warmup + i) % n_feed)
        sync()
        wall_ms = 1e3 * (time.perf_counter() - t0) / n
        steps = step_times(mk.read())
        replay = {"forward_median_ms": None, "gap_median_ms": None}
        if runner.graphs is not None and key in runner.graphs.graphs:
            graph = runner.graphs.graphs[key][0]
            mk.reset()
            for _ in range(n):
                graph.replay()
            sync()
            replay = step_times(mk.read())
    if runner.graphs is not None:
        runner.graphs.invalidate()  # the stamped graphs go; the next step captures plain ones
    return {**steps, "wall_ms": wall_ms, "replay_forward_ms": replay["forward_median_ms"],
            "replay_gap_ms": replay["gap_median_ms"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--budget-gb", type=float, help="expert cache in GB (default: every expert resident)")
    ap.add_argument("--policy", default="static", help="the policy of a --budget-gb run")
    ap.add_argument("--routing", default="model", choices=["model", "uniform"])
    ap.add_argument("--cpu-threads", type=int)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (each kernel launched by the host)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also run N steps under cProfile and print the host functions by own time")
    ap.add_argument("--markers", type=int, default=0, metavar="N",
                    help="also decode N steps with device-clock stamps at each forward's start and end, unprofiled "
                         "(edgemoe.bench.step_markers): the forward's GPU time and the GPU's idle time between steps, "
                         "then the same graph replayed back to back")
    ap.add_argument("--top", type=int, default=30, help="kernels in the table")
    ap.add_argument("--out", default="", help="folder for profile_decode.json and trace.json")
    a = ap.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"

    model = model_dir(a)
    cfg = EngineConfig(device=a.device, dtype=a.dtype, load_format=a.load_format, expert_cache_slots=0,
                       expert_policy="cpu-all", cpu_threads=a.cpu_threads, enforce_eager=a.eager, max_model_len=4096)
    runner = ModelRunner(model, cfg)
    if a.routing == "uniform":
        route_uniformly(runner, seed=1)
    print(runner.summary(), flush=True)
    pool = runner.pool
    slots = pool.num_ids if a.budget_gb is None else int(a.budget_gb * 1e9 // pool.row_bytes)
    policy = "static" if a.budget_gb is None else a.policy
    runner.set_expert_cache(slots, policy)

    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    n_feed = a.warmup + a.tokens + a.profile_steps
    prompt = torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist()
    feed = torch.randint(0, vocab, (n_feed,), generator=g).tolist()
    runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)
    pos = len(prompt)

    def sync() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    def step(i: int) -> None:
        nonlocal pos
        runner.execute([StepInput(0, [feed[i]], pos)], Phase.DECODE).argmax(dim=-1).tolist()
        pos += 1

    for i in range(a.warmup):
        step(i)
    sync()
    t0 = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.tokens):
        step(i)
    sync()
    dt = time.perf_counter() - t0
    tps, ms = a.tokens / dt, 1e3 * dt / a.tokens
    print(f"{'eager' if a.eager else 'CUDA graphs'}, {runner.experts.decode_path}: {tps:.1f} tokens/s, "
          f"{ms:.3f} ms/step", flush=True)

    replay_ms = None
    dd = runner.experts.device_decode
    key = (1, bool(dd is not None and dd.armed))  # the graph the timed steps replayed
    if runner.graphs is not None and key in runner.graphs.graphs and not a.eager:
        # the step's GPU time alone: the captured graph replayed back to back, no host work between replays
        graph, _ = runner.graphs.graphs[key]
        sync()
        r0 = time.perf_counter()
        for _ in range(a.tokens):
            graph.replay()
        sync()
        replay_ms = 1e3 * (time.perf_counter() - r0) / a.tokens
        print(f"graph replay alone: {replay_ms:.3f} ms/step; host work per step {ms - replay_ms:.3f} ms", flush=True)
    markers = None
    if a.markers:
        markers = marked_steps(runner, step, sync, a.markers, a.warmup, n_feed, key)
        print("stamped steps: forward {forward_median_ms:.3f} ms, GPU idle before it {gap_median_ms:.3f} ms "
              "(medians of {steps}); replayed back to back: forward {replay_forward_ms}, idle {replay_gap_ms} ms; "
              "wall {wall_ms:.3f} ms a step".format(**markers), flush=True)
    host_top = ""
    if a.host_profile:
        import cProfile
        import io
        import pstats

        hp = cProfile.Profile()
        hp.enable()
        for i in range(a.host_profile):
            step(i % n_feed)
        sync()
        hp.disable()
        buf = io.StringIO()
        pstats.Stats(hp, stream=buf).sort_stats("tottime").print_stats(a.top)
        host_top = buf.getvalue()
        print(f"host functions over {a.host_profile} steps (cProfile, own time):\n{host_top}", flush=True)

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for i in range(a.warmup + a.tokens, n_feed):
            with torch.profiler.record_function("decode_step"):
                step(i)
        sync()
    kernels = kernel_events(prof)
    windows = step_windows(prof, "decode_step")
    per_step = []
    for s, e in windows:
        ks = [k for k in kernels if s <= k.time_range.start <= e]
        if not ks:
            continue
        first = min(k.time_range.start for k in ks)
        last = max(k.time_range.end for k in ks)
        per_step.append({"wall_us": e - s, "kernel_us": sum(k.time_range.elapsed_us() for k in ks),
                         "gpu_span_us": last - first, "host_before_us": first - s, "host_after_us": e - last,
                         "kernels": len(ks)})
    n = max(len(per_step), 1)
    mean = {k: sum(r[k] for r in per_step) / n for k in per_step[0]} if per_step else {}
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k.name].append(k.time_range.elapsed_us())
    rows = sorted(({"kernel": name, "calls_per_step": len(v) / n, "us_per_step": sum(v) / n,
                    "mean_us": sum(v) / len(v)} for name, v in by_name.items()), key=lambda r: -r["us_per_step"])
    print(f"per step (mean of {len(per_step)}): " + ", ".join(f"{k} {v:.1f}" for k, v in mean.items()))
    print(f"{'kernel':<70} {'calls':>6} {'us/step':>9} {'mean us':>8}")
    for r in rows[:a.top]:
        print(f"{r['kernel'][:70]:<70} {r['calls_per_step']:6.1f} {r['us_per_step']:9.1f} {r['mean_us']:8.2f}")
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50)
    print(cpu_table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / "trace.json"))
        (out / "profile_decode.json").write_text(json.dumps({
            "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "eager": a.eager,
            "decode_path": runner.experts.decode_path, "slots": slots, "policy": policy,
            "tokens_per_s": tps, "ms_per_step": ms, "graph_replay_ms": replay_ms, "markers": markers,
            "host_profile": host_top,
            "per_step_mean": mean, "steps": per_step, "kernels": rows,
            "cpu_ops": cpu_table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
