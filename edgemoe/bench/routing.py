"""Routing traces: record them from the engine, replay them through expert-cache policies.

The entry points the engine and the CLI use; the code lives in :mod:`edgemoe.bench.trace` (the JSONL
trace format, documented there, the :class:`RoutingRecorder` and the reader) and
:mod:`edgemoe.bench.replay` (the cache simulator, its policies, the report, the plot and the
``replay-routing`` subcommand). Results and how to reproduce them: ``docs/benchmarks/routing.md``.
"""

from edgemoe.bench.replay import (ALL_POLICIES, DEFAULT_CAPACITIES, DEFAULT_POLICIES, ReplayResult, Workload,
                                  build_workload, load_workload, main_replay, register_cli, replay, simulate)
from edgemoe.bench.trace import RouteRecord, RoutingRecorder, TraceFormatError, iter_trace, read_traces

__all__ = [
    "ALL_POLICIES", "DEFAULT_CAPACITIES", "DEFAULT_POLICIES", "ReplayResult", "RouteRecord", "RoutingRecorder",
    "TraceFormatError", "Workload", "build_workload", "iter_trace", "load_workload", "main_replay", "read_traces",
    "register_cli", "replay", "simulate",
]
