"""Measurement helpers of the CUDA tests: JSON-line reports under ``$OUT`` and CUDA-graph timings.

Imported by the test modules of this folder (``from perf import ...``); nothing here runs without CUDA
except :func:`report`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch


def report(jsonl: str, name: str, **values) -> None:
    """Print ``name`` and ``values`` (run pytest with ``-s`` to see them) and, when ``$OUT`` is set, append
    them as one JSON line ``{"test": name, **values}`` to ``$OUT/<jsonl>``."""
    print(f"[{name}] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, jsonl), "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


def capture(*fns: Callable[[], object], repeat: int = 1) -> tuple[list[torch.cuda.CUDAGraph], list[object]]:
    """One CUDA graph per function, each calling it ``repeat`` times, after three warm-up calls of each
    on a side stream (Triton compiles and cuBLAS picks its kernels outside the capture).

    Returns:
        ``(graphs, outputs)``: the graphs, and what each function returned at its last call inside its
        capture (tensors a replay rewrites).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graphs, outputs = [], []
    for fn in fns:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeat):
                out = fn()
        graphs.append(graph)
        outputs.append(out)
    return graphs, outputs


def replay_us(graph: torch.cuda.CUDAGraph, iters: int = 200, per: int = 1) -> float:
    """Mean µs of one replay of ``graph`` over ``iters`` back-to-back replays (CUDA events), divided by
    ``per`` (the calls a replay holds)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters / per
