"""Prefill benchmark: time per chunk of the streamed (double-buffered) prefill against its PCIe bound.

Loads the model once (``--load-format dummy`` by default: the full geometry from config.json, random
weights, no disk), measures B_P on this machine (``edgemoe.experts.bandwidth.measure_copy`` over the
pool), then for each expert-cache budget rebuilds the cache cold and prefills one prompt of
``--chunks`` chunks of ``--chunk`` tokens (default 2 x 8192: an 8192-token chunk, and 16k as two
chunks), once with copies overlapping compute (``overlap``) and once serialized on one stream
(``serial``: each layer's copy, then its compute). Per chunk it reports the time, tokens/s, the
expert bytes transferred (fills x bytes per expert), the bytes of all routed experts and the ratio

    time / (bytes of all routed experts / B_P)       (issue target: <= 1.15 for an 8192-token chunk)

beside the same ratio against the bytes actually transferred (residents outside the staging regions
are not copied, so a larger cache transfers less). Writes ``prefill.json`` and ``prefill.md``.

    python benchmarks/prefill.py --out results/                       # GPU host, Qwen3-30B-A3B geometry
    python benchmarks/prefill.py --preset tiny --device cpu --slots 32,40 --chunk 32 --out /tmp/p  # smoke

Routing is uniform by default (each token draws k distinct experts per layer): random-weight routers
send nearly every token to the same few experts, which would not touch every expert as a real
8192-token chunk does.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import add_model_args, model_dir, route_uniformly

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts.bandwidth import measure_copy

TARGET_RATIO = 1.15


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_prompt(runner: ModelRunner, slots: int, policy: str, mode: str, prompt: list[int], chunk: int,
               b_p_gbps: float) -> list[dict]:
    """Rebuild the expert cache (cold, ``slots`` slots), prefill ``prompt`` in chunks; one record per chunk."""
    runner.set_expert_cache(slots, policy)
    runner.experts.hybrid.prefill.mode = mode
    dev, row, k = runner.device, runner.pool.row_bytes, runner.model_config.top_k
    rows = []
    for c, start in enumerate(range(0, len(prompt), chunk)):
        tokens = prompt[start:start + chunk]
        streamed = runner.experts.hybrid.prefill.can_stream(len(tokens) * k)
        before = dict(runner.experts.stats()["prefill"])
        _sync(dev)
        t0 = time.perf_counter()
        runner.execute([StepInput(0, tokens, start)], Phase.PREFILL)
        _sync(dev)
        dt = time.perf_counter() - t0
        d = {key: v - before[key] for key, v in runner.experts.stats()["prefill"].items()}
        routed_b, moved_b = (d["hits"] + d["misses"]) * row, d["fills"] * row
        rows.append({
            "slots": slots, "cache_gb": slots * row / 1e9, "policy": policy, "mode": mode, "streamed": streamed,
            "chunk_index": c, "tokens": len(tokens), "context_end": start + len(tokens),
            "seconds": dt, "tokens_per_s": len(tokens) / dt, **d,
            "routed_bytes": routed_b, "transferred_bytes": moved_b,
            "routed_bound_s": routed_b / (b_p_gbps * 1e9), "transfer_bound_s": moved_b / (b_p_gbps * 1e9),
            "ratio_to_routed_bound": dt / (routed_b / (b_p_gbps * 1e9)) if routed_b else None,
            "ratio_to_transfer_bound": dt / (moved_b / (b_p_gbps * 1e9)) if moved_b else None,
            "effective_gbps": moved_b / dt / 1e9,
        })
    runner.free(0)
    return rows


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def device_timeline(events, bulk_ms: float = 0.5) -> str:
    """Where a profiled prompt's device time went (ms): the span from the first to the last device event, the
    time the expert copies (host-to-device copies of at least ``bulk_ms``) and the kernels kept the GPU busy, both
    at once and neither, busy time per stream, and the longest idle gaps between expert copies with the kernels
    that ran inside each (a gap the compute fills means the next copy waited for compute)."""
    copies, kernels, per_stream = [], [], {}
    for e in events:
        if e.device_type.name != "CUDA" or e.time_range.end <= e.time_range.start:
            continue
        a, b = e.time_range.start / 1e3, e.time_range.end / 1e3
        per_stream.setdefault(getattr(e, "device_resource_id", None), []).append((a, b))
        if e.name.startswith("Memcpy HtoD") and b - a >= bulk_ms:
            copies.append((a, b, e.name))
        elif not e.name.startswith("Memcpy"):
            kernels.append((a, b, e.name))
    if not copies or not kernels:
        return "== device timeline: no expert copies or kernels recorded"
    cu = _union([(a, b) for a, b, _ in copies])
    ku = _union([(a, b) for a, b, _ in kernels])
    t0 = min(cu[0][0], ku[0][0])
    t1 = max(cu[-1][1], ku[-1][1])
    busy = _length(_union(cu + ku))
    gaps = sorted(((b0, a1 - b0) for (_, b0), (a1, _) in pairwise(cu)), key=lambda g: -g[1])
    big = [d for _, d in gaps if d >= 0.5]
    lines = [f"== device timeline (ms): span {t1 - t0:.1f}, expert copies busy {_length(cu):.1f}, kernels busy "
             f"{_length(ku):.1f}, both {_length(cu) + _length(ku) - busy:.1f}, neither {t1 - t0 - busy:.1f}; "
             f"before the first copy {cu[0][0] - t0:.1f}, after the last {t1 - cu[-1][1]:.1f}; gaps between "
             f"copies >= 0.5 ms: {len(big)} totalling {sum(big):.1f}",
             "   busy per stream: " + ", ".join(f"{sid}: {_length(_union(v)):.1f}" for sid, v in per_stream.items())]
    for start, d in gaps[:8]:
        inside = [(min(b, start + d) - max(a, start), n) for a, b, n in kernels if a < start + d and b > start]
        names = sorted({n[:40] for _, n in inside})[:3]
        lines.append(f"   gap {d:.2f} at {start - t0:.1f}: {len(inside)} kernels, {sum(t for t, _ in inside):.2f} "
                     f"busy ({'; '.join(names) or 'none'})")
    return "\n".join(lines)


def profile_prompt(runner: ModelRunner, slots: int, policy: str, mode: str, prompt: list[int], chunk: int,
                   b_p: float, out: Path) -> int:
    """Profile one prompt (torch.profiler, CPU and CUDA activity): top operators by device and host time, on CUDA
    the device timeline (:func:`device_timeline`), and the Chrome trace (prefill-trace.json.gz)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=acts) as prof:
        rows = run_prompt(runner, slots, policy, mode, prompt, chunk, b_p)
    prof.export_chrome_trace(str(out / "prefill-trace.json.gz"))  # torch gzips a path ending in .gz
    ka = prof.key_averages()
    sort_dev = "device_time_total" if runner.device.type == "cuda" else "cpu_time_total"
    text = "\n".join([
        "chunks: " + ", ".join(f"{r['seconds']:.3f} s" for r in rows),
        *([device_timeline(prof.events())] if runner.device.type == "cuda" else []),
        f"== by device time ({sort_dev})", ka.table(sort_by=sort_dev, row_limit=40, max_name_column_width=70),
        "== by host self time", ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)])
    (out / "prefill-profile.txt").write_text(text)
    print(text[:12000])
    return 0


def table(results: list[dict]) -> str:
    """Markdown: one row per (cache, chunk), the overlapped run beside the serialized one."""
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    by = {(r["slots"], r["chunk_index"], r["mode"]): r for r in results}
    lines = [
        "| cache (GB) | slots | chunk | tokens | streamed | time (s) | tokens/s | GB moved | GB routed "
        "| routed GB / B_P (s) "
        "| ratio (≤ 1.15) | moved GB / B_P (s) | ratio to moved | serial time (s) | serial ratio | overlap speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (slots, c, mode), r in by.items():
        if mode != "overlap":
            continue
        s = by.get((slots, c, "serial"))
        lines.append(
            f"| {r['cache_gb']:.1f} | {slots} | {c} | {r['tokens']} | {'yes' if r['streamed'] else 'no (waves)'} "
            f"| {f(r['seconds'], 3)} | {r['tokens_per_s']:.0f} | {r['transferred_bytes'] / 1e9:.2f} "
            f"| {r['routed_bytes'] / 1e9:.2f} | {f(r['routed_bound_s'], 3)} | {f(r['ratio_to_routed_bound'])} "
            f"| {f(r['transfer_bound_s'], 3)} | {f(r['ratio_to_transfer_bound'])} "
            f"| {f(s and s['seconds'], 3)} | {f(s and s['ratio_to_routed_bound'])} "
            f"| {f(s and s['seconds'] / r['seconds'])} |")
    return "\n".join(lines)


def prompt_totals(results: list[dict]) -> list[dict]:
    """Whole-prompt figures per (cache, mode): the chunks' times summed (e.g. 16k tokens as two chunks)."""
    totals: dict[tuple[int, str], dict] = {}
    for r in results:
        t = totals.setdefault((r["slots"], r["mode"]), {"slots": r["slots"], "cache_gb": r["cache_gb"],
                                                        "mode": r["mode"], "tokens": 0, "seconds": 0.0,
                                                        "transferred_bytes": 0})
        t["tokens"] += r["tokens"]
        t["seconds"] += r["seconds"]
        t["transferred_bytes"] += r["transferred_bytes"]
    for t in totals.values():
        t["tokens_per_s"] = t["tokens"] / t["seconds"]
    return list(totals.values())


def totals_table(totals: list[dict]) -> str:
    lines = ["| cache (GB) | slots | mode | prompt tokens | time (s) | tokens/s | GB moved |",
             "|---|---|---|---|---|---|---|"]
    for t in totals:
        lines.append(f"| {t['cache_gb']:.1f} | {t['slots']} | {t['mode']} | {t['tokens']} | {t['seconds']:.3f} "
                     f"| {t['tokens_per_s']:.0f} | {t['transferred_bytes'] / 1e9:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--budgets", default="8,16,32", help="expert-cache budgets in GB")
    ap.add_argument("--slots", help="expert-cache sizes in slots (replaces --budgets; for small models)")
    ap.add_argument("--policy", default="fill-all", help="expert policy (prefill streams under qstar and fill-all)")
    ap.add_argument("--modes", default="overlap,serial")
    ap.add_argument("--cpu-executor", default="torch", help="CPU executor (unused by streamed prefill; torch "
                    "skips building the native one)")
    ap.add_argument("--chunk", type=int, default=8192, help="tokens per prefill chunk")
    ap.add_argument("--chunks", type=int, default=2, help="chunks of one prompt (2 x 8192 = a 16k prompt)")
    ap.add_argument("--bp-seconds", type=float, default=1.0, help="seconds of the B_P measurement")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up prompt")
    ap.add_argument("--routing", default="uniform", choices=["uniform", "model"])
    ap.add_argument("--out", default=".", help="folder for prefill.json and prefill.md")
    ap.add_argument("--profile", action="store_true", help="instead of the timings, profile one prompt at the "
                    "first budget (torch.profiler) and write the top operators and the device timeline to "
                    "prefill-profile.txt, the trace to prefill-trace.json.gz")
    ap.add_argument("--dequant-scratch", type=int,
                    help="FP4 experts: the dequantizing path's scratch in activation scratches (the kernels' "
                         "DEQUANT_SCRATCH_ACTIVATIONS, which sets the experts per chunk; default: the kernels' own)")
    a = ap.parse_args(argv)
    if a.dequant_scratch is not None:
        import edgemoe.kernels.grouped_gemm as gg

        if a.dequant_scratch < 1:
            ap.error("--dequant-scratch must be >= 1")
        gg.DEQUANT_SCRATCH_ACTIVATIONS = a.dequant_scratch

    model = model_dir(a)
    total = a.chunk * a.chunks
    cfg = EngineConfig(device=a.device, dtype=a.dtype, load_format=a.load_format, expert_cache_slots=0,
                       expert_policy="cpu-all", cpu_executor=a.cpu_executor, max_model_len=total,
                       kv_cache_tokens=total)
    t0 = time.perf_counter()
    runner = ModelRunner(model, cfg, progress=False)
    load_s = time.perf_counter() - t0
    measure_copy(runner.pool, runner.device, 0.05)  # warm-up
    b_p = measure_copy(runner.pool, runner.device, a.bp_seconds)
    if a.routing == "uniform":
        route_uniformly(runner, seed=1)
    print(runner.summary(), flush=True)
    print(f"B_P {b_p:.1f} GB/s (measure_copy over the pool, {a.bp_seconds} s); load {load_s:.1f} s", flush=True)

    row = runner.pool.row_bytes
    sizes = ([int(s) for s in a.slots.split(",") if s] if a.slots
             else [int(float(gb) * 1e9 // row) for gb in a.budgets.split(",") if gb])
    modes = [m for m in a.modes.split(",") if m]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.model_config.vocab_size, (total,), generator=g).tolist()
    if not a.no_warmup:  # first-call costs (kernel selection, allocator growth) out of the timings
        run_prompt(runner, sizes[0], a.policy, modes[0], prompt[:a.chunk], a.chunk, b_p)
    if a.profile:
        return profile_prompt(runner, sizes[0], a.policy, modes[0], prompt, a.chunk, b_p, Path(a.out))
    results = []
    for slots in sizes:
        for mode in modes:
            for r in run_prompt(runner, slots, a.policy, mode, prompt, a.chunk, b_p):
                results.append(r)
                print(f"cache {r['cache_gb']:.1f} GB ({slots} slots) {mode:8s} chunk {r['chunk_index']}: "
                      f"{r['seconds']:.3f} s, {r['tokens_per_s']:.0f} tok/s, "
                      f"{r['transferred_bytes'] / 1e9:.2f} GB moved, "
                      f"ratio {r['ratio_to_routed_bound'] or 0:.3f}", flush=True)
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(),
                    "gpu": torch.cuda.get_device_name() if runner.device.type == "cuda" else None,
                    "torch": torch.__version__},
        "model": runner.model_config.architecture, "preset": a.preset if a.model is None else a.model,
        "moe_layers": runner.model_config.num_moe_layers, "experts_per_layer": runner.model_config.num_experts,
        "top_k": runner.model_config.top_k, "expert_bytes": row, "pool_gb": runner.pool.nbytes / 1e9,
        "pinned": runner.pinned, "load_s": load_s, "b_p_gbps": b_p, "b_p_applies": runner.device.type == "cuda",
        "policy": a.policy, "chunk": a.chunk, "chunks": a.chunks, "routing": a.routing, "target_ratio": TARGET_RATIO,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    totals = prompt_totals(results)
    (out / "prefill.json").write_text(json.dumps({"meta": meta, "results": results, "prompts": totals}, indent=2))
    md = (f"B_P = {b_p:.1f} GB/s (measured in this run); expert {row / 1e6:.2f} MB; "
          f"pool {runner.pool.nbytes / 1e9:.2f} GB; "
          f"chunk {a.chunk} tokens x {a.chunks}; policy {a.policy}; routing {a.routing}\n\n{table(results)}\n\n"
          f"Whole prompts ({a.chunks} chunks, cold cache at the start):\n\n{totals_table(totals)}\n")
    (out / "prefill.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
