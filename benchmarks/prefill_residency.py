"""Which experts a streamed prefill leaves in the cache: decode's hits per step right after it.

Replays recorded routing through the engine's own expert cache and prefill streamer (``HybridExperts`` on the CPU,
``fill-all``, tiny expert rows: only placement is measured): a prompt of ``--prompt`` trace rows as one prefill step,
then ``--steps`` decode steps of one token, each MoE layer routed as ``benchmarks/decode.py --routing trace`` routes
it (the traces mapped onto ``--layers`` x ``--experts``, top-``--top-k``). Prints each cache size's hits per decode
step and their sum over the first ten steps. With the Qwen3-30B-A3B geometry (the defaults), 1,695 slots are a 16 GB
cache of its bf16 experts and 636 slots 6 GB:

    python benchmarks/prefill_residency.py --traces ../shared/fixtures/routing_traces/*.jsonl --slots 1695,636

A streamed step needs two regions of ``E`` slots (``--slots`` at least ``2E``) and ``prompt·k >= 2E`` routes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from edgemoe.bench.replay import load_workload, remap_workload
from edgemoe.core import Phase
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.cpu_executor import TorchCpuExecutor
from edgemoe.experts.hybrid import HybridExperts
from edgemoe.experts.policy import FillAllPolicy
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

ROW = 16  # hidden and intermediate size of the tiny expert rows


def trace_rows(paths: list[str], layers: int, experts: int, top_k: int) -> list[list[list[int]]]:
    """Per MoE layer, the decode rows of the traces mapped onto the geometry (expert indices within the layer)."""
    wl = remap_workload(load_workload(paths), layers, experts, top_k, seed=0)
    rows: list[list[list[int]]] = [[] for _ in range(layers)]
    for a in wl.accesses:
        if a.phase == "decode" and len(a.ids) == top_k:
            rows[a.layer].append([f - a.layer * experts for f in a.ids])
    return rows


def decode_hits(rows: list[list[list[int]]], slots: int, prompt: int, steps: int, experts: int,
                partition: bool) -> list[int]:
    """Hits of each decode step (all layers) after a prefill of the first ``prompt`` rows, on a cold cache."""
    layers, top_k = len(rows), len(rows[0][0])
    pool = HostExpertPool(layers * experts, ExpertLayout.build(WeightFormat.FP32, ROW, ROW), torch.float32)
    pool.fill_random(0, std=1.0)
    cache = ExpertCache(slots, layers * experts, pool.layout, torch.float32, torch.device("cpu"), num_experts=experts,
                        partition_layers=partition)
    hy = HybridExperts(pool, cache, FillAllPolicy(), TorchCpuExecutor(pool), experts, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        ids = torch.tensor(rows[layer][:prompt])
        hy.forward(layer, torch.randn(prompt, ROW, generator=g), ids, torch.rand(prompt, top_k, generator=g),
                   Phase.PREFILL, 1)
    hits = []
    for step in range(steps):
        before = cache.counters["decode"].hits
        for layer in range(layers):
            ids = torch.tensor([rows[layer][prompt + step]])
            hy.forward(layer, torch.randn(1, ROW, generator=g), ids, torch.rand(1, top_k, generator=g),
                       Phase.DECODE, 2 + step)
        hits.append(cache.counters["decode"].hits - before)
    return hits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="+", required=True, help="routing traces (JSONL)")
    ap.add_argument("--slots", default="1695,636", help="cache sizes in slots, comma-separated")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="trace rows of the prefill step")
    ap.add_argument("--steps", type=int, default=24, help="decode steps")
    ap.add_argument("--eviction", default="layer-lru", choices=["layer-lru", "global-lru"])
    a = ap.parse_args(argv)
    rows = trace_rows(a.traces, a.layers, a.experts, a.top_k)
    if min(len(r) for r in rows) < a.prompt + a.steps:
        ap.error(f"the traces have {min(len(r) for r in rows)} decode rows per layer, fewer than prompt + steps")
    for slots in (int(s) for s in a.slots.split(",") if s):
        hits = decode_hits(rows, slots, a.prompt, a.steps, a.experts, a.eviction == "layer-lru")
        print(f"{slots} slots: hits per decode step (of {a.layers * a.top_k}) {hits}; first ten steps {sum(hits[:10])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
