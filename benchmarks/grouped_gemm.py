"""Grouped expert GEMM benchmark: the Triton kernel pair vs the per-expert torch loop.

One MoE layer's routed-expert compute at Qwen3-30B-A3B geometry (H=2048, I=768, E=128, top-8, bf16),
every expert resident in a cache slot, uniform random routing, for prefill chunks of ``--tokens``
tokens: ``grouped_swiglu`` (eager, and replayed from a CUDA graph: no host launch overhead) against
``run_experts_loop`` (a sort, a host read of the counts, then one matmul pair per expert: the path it
replaces). Times are medians over ``--iters`` calls, each timed with CUDA events after ``--warmup``
calls. Reports TFLOP/s (``6·T·k·H·I`` flops) and GB/s of expert weight bytes (each routed expert's
``w13`` and ``w2`` read once), and the largest difference between the two outputs.

    python benchmarks/grouped_gemm.py --out results/
    python benchmarks/grouped_gemm.py --tokens 8192 --iters 50

``--device cpu`` runs the kernels in Triton's interpreter, tiny shapes only: the test suite's smoke test
of this script (``tests/test_grouped_gemm.py``, which patches the interpreter's bugs), not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.config import parse_dtype
from edgemoe.experts.compute import run_experts_loop
from edgemoe.kernels.grouped_gemm import choose_config, grouped_swiglu


def median_seconds(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds of ``fn()``: CUDA events around each call on CUDA, wall time elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_tokens(T: int, a: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor, dev: torch.device) -> dict:
    """One row of results for a chunk of ``T`` tokens."""
    E, k, H, I = a.experts, a.top_k, a.hidden, a.inter
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(dev, w13.dtype)  # [T, H]
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].to(dev)  # [T, k] distinct experts per token
    w = torch.rand(T, k, generator=g).to(dev)  # [T, k]
    slots = torch.arange(E, device=dev)  # [E] every expert resident
    out = torch.empty(T, k, H, dtype=w13.dtype, device=dev)  # [T, k, H]
    ref = torch.empty_like(out)

    def grouped():
        grouped_swiglu(x, ids, w, slots, w13, w2, out)

    def loop():
        run_experts_loop(x, ids, w, slots, w13, w2, ref)

    row = {"tokens": T, "routes": T * k, "config": dataclasses.asdict(choose_config(T * k, E, H, I, w13.dtype))}
    row["grouped_s"] = median_seconds(grouped, a.iters, a.warmup, dev)
    if dev.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            grouped()
        row["grouped_graph_s"] = median_seconds(graph.replay, a.iters, a.warmup, dev)
    if not a.no_loop:
        row["loop_s"] = median_seconds(loop, a.iters, a.warmup, dev)
        row["speedup"] = row["loop_s"] / row["grouped_s"]
        grouped()
        diff = (out.float() - ref.float()).abs()
        row["max_abs_diff"] = diff.max().item()
        row["max_rel_diff"] = row["max_abs_diff"] / max(ref.float().abs().max().item(), 1e-30)
        row["mismatch_frac"] = (out != ref).float().mean().item()
    flops = 6 * T * k * H * I
    weight_bytes = int(torch.unique(ids).numel()) * 3 * H * I * w13.element_size()
    for key in ("grouped_s", "grouped_graph_s", "loop_s"):
        if key in row:
            name = key[:-2]
            row[f"{name}_tflops"] = flops / row[key] / 1e12
            row[f"{name}_weight_gbps"] = weight_bytes / row[key] / 1e9
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,2048,8192", help="prefill chunk sizes T")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="expert intermediate size I")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer E (all resident)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-loop", action="store_true", help="time the grouped kernels only")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="folder for grouped_gemm.json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dtype = parse_dtype(a.dtype)
    E, H, I = a.experts, a.hidden, a.inter
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dev, dtype)  # [S, 2I, H], S = E
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dev, dtype)  # [S, H, I]
    rows = [bench_tokens(int(t), a, w13, w2, dev) for t in a.tokens.split(",")]
    print(f"{'T':>6} {'grouped ms':>10} {'graph ms':>9} {'loop ms':>8} {'speedup':>7} {'TFLOP/s':>8} "
          f"{'weight GB/s':>11} {'max rel diff':>12}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['grouped_s'] * 1e3:>10.3f} {r.get('grouped_graph_s', float('nan')) * 1e3:>9.3f} "
              f"{r.get('loop_s', float('nan')) * 1e3:>8.2f} {r.get('speedup', float('nan')):>7.1f} "
              f"{r['grouped_tflops']:>8.1f} {r['grouped_weight_gbps']:>11.0f} "
              f"{r.get('max_rel_diff', float('nan')):>12.2e}")
    if a.out:
        meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": a.dtype,
                "hidden": H, "inter": I, "experts": E, "top_k": a.top_k, "iters": a.iters, "torch": torch.__version__}
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grouped_gemm.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
