"""Routing traces: the JSONL format, the engine-side recorder and a reader for several formats.

A routing trace lists, for every MoE layer of every model step, which experts each token selected and
with which router weight. ``edgemoe replay-routing`` (:mod:`edgemoe.bench.replay`) feeds traces to
expert-cache policies without running the model.

Format ``edgemoe-routing`` v1 (written by :class:`RoutingRecorder`): UTF-8 JSON Lines, one object per
line, appended (several recording sessions may share a file; each starts with a header). Kinds:

``{"type": "header", "format": "edgemoe-routing", "version": 1, "created": ISO-8601 UTC,
"model": str, "architecture": str, "num_moe_layers": L, "num_experts": E, "top_k": k,
"moe_layers": [decoder layer of each MoE ordinal], "dtype": str, "expert_bytes": bytes}``
    Starts a recording session (a *segment*: step numbers and seq ids are scoped to it). Model fields
    are present when the recorder was attached to a runner.
``{"type": "request", "seq_id": int, "request_id": str}``
    The engine admitted request ``request_id`` as sequence ``seq_id`` (seq ids may be reused later).
``{"type": "route", "step": int, "phase": "prefill"|"decode", "seq_id": int, "request_id": str,
"layer": j, "dlayer": int, "pos": [T], "experts": [[k ints]] * T, "weights": [[k floats]] * T}``
    One MoE layer of one model step for one sequence: ``pos`` are the absolute token positions of the
    sequence's ``T`` tokens in this step (a prompt chunk in prefill, one token in decode), ``experts``
    the top-k expert indices within the layer (``0 <= e < E``) in router order, ``weights`` the router
    weights the experts receive (after ``norm_topk_prob``; rounded to 6 decimals). ``layer`` is the
    MoE-layer ordinal ``j`` (flat expert id ``j * E + e``), ``dlayer`` the decoder layer index
    (omitted when unknown), ``request_id`` omitted until the engine names the sequence. ``step`` is
    the runner's model-step counter: sequences batched in one step share it, and its order is the
    order in which the expert cache saw the accesses.

Also read (auto-detected per line): per-token lines ``{"problem_id", "layer", "token_idx",
"experts": [k], "gating_probs": [k], "dataset"?}`` (the Mixtral-8x7B decode traces of
Mario928/speculative-moe, ``routing_data_collected/``): every problem is one request, every line is
a decode token of one layer; these lines carry no step, so the replay orders them by
(problem in order of first appearance, ``token_idx``, ``layer``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

__all__ = ["FORMAT", "VERSION", "RouteRecord", "RoutingRecorder", "TraceFormatError", "iter_trace", "read_traces"]

FORMAT = "edgemoe-routing"
VERSION = 1
WEIGHT_DECIMALS = 6


class TraceFormatError(ValueError):
    """A trace line that is not JSON or matches no known format (message names file and line)."""


@dataclass
class RouteRecord:
    """One MoE layer's routing for one request's tokens in one step (a ``route`` line, normalized).

    Attributes:
        source: trace file the record came from.
        segment: recording-session index, unique across the files of one :func:`read_traces` call.
        request: request key: ``request_id`` when known, else ``"<file>#<segment>:seq<seq_id>"``; for
            the Mixtral format ``"<file stem>:<dataset>/<problem_id>"``.
        phase: ``"prefill"`` or ``"decode"``.
        step: model-step counter within the segment; ``None`` for formats without steps.
        layer: MoE-layer ordinal.
        positions: ``[T]`` absolute token positions.
        experts: ``[T][k]`` expert indices within the layer.
        weights: ``[T][k]`` router weights, or ``None`` when the trace has none.
        seq_id, request_id, dlayer: as in the line, when present.
    """

    source: str
    segment: int
    request: str
    phase: str
    step: int | None
    layer: int
    positions: list[int]
    experts: list[list[int]]
    weights: list[list[float]] | None
    seq_id: int | None = None
    request_id: str | None = None
    dlayer: int | None = None


@dataclass
class TraceInfo:
    """What the headers of the traces read so far say (the last header wins for model fields)."""

    headers: list[dict] = field(default_factory=list)
    segments: int = 0

    def get(self, key: str):
        for h in reversed(self.headers):
            if h.get(key) is not None:
                return h[key]
        return None


class RoutingRecorder:
    """Appends the engine's routing decisions to a JSONL trace (format in the module docstring).

    Use: ``rec = RoutingRecorder(path).attach(runner)`` (sets ``runner.record`` and writes a header
    with the model geometry), ``rec.name_sequence(seq_id, request_id)`` when a request is admitted,
    ``rec.close()`` at shutdown. The recorder is the ``ForwardBatch.record`` callback itself.

    Cost when on: one device→host copy of ``[T, k]`` ids and weights per MoE layer per step (a sync
    on CUDA; recording is incompatible with CUDA-graph replay, whose captured steps would not call
    back) plus one JSON line per (layer, sequence). When off the engine only tests ``record is None``.

    Thread safety: ``name_sequence`` may be called from another thread than the step thread.

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str | Path, *, buffer_bytes: int = 1 << 20):
        self.path = Path(path)
        self._f = open(self.path, "a", encoding="utf-8", buffering=buffer_bytes)
        self._lock = threading.Lock()
        self._names: dict[int, str] = {}
        self._moe_layers: tuple[int, ...] | None = None
        self._header_written = False
        self._batch = None
        self._pos: list[int] = []

    # ------------------------------------------------------------------ setup
    def attach(self, runner) -> "RoutingRecorder":
        """Record ``runner``'s steps: sets ``runner.record = self`` and writes a header from its config."""
        cfg = runner.model_config
        self._moe_layers = tuple(cfg.moe_layers)
        elt = torch.empty((), dtype=runner.dtype).element_size()
        self.write_header(model=str(runner.model_dir), architecture=cfg.architecture,
                          num_moe_layers=cfg.num_moe_layers, num_experts=cfg.num_experts, top_k=cfg.top_k,
                          moe_layers=list(cfg.moe_layers), dtype=str(runner.dtype).replace("torch.", ""),
                          expert_bytes=cfg.expert_numel() * elt)
        runner.record = self
        return self

    def write_header(self, **meta) -> None:
        """Start a recording session (segment); ``meta`` adds fields (model geometry, notes)."""
        created = datetime.now(UTC).isoformat(timespec="seconds")
        self._write({"type": "header", "format": FORMAT, "version": VERSION, "created": created, **meta})
        self._header_written = True

    def name_sequence(self, seq_id: int, request_id: str) -> None:
        """Sequence ``seq_id`` now serves request ``request_id`` (written to later records)."""
        with self._lock:
            self._names[int(seq_id)] = str(request_id)
        self._write({"type": "request", "seq_id": int(seq_id), "request_id": str(request_id)})

    # ------------------------------------------------------------------ the callback
    def __call__(self, batch, moe_layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """``ForwardBatch.record``: ``topk_ids [T, k]`` int64, ``topk_weights [T, k]`` (any float dtype)."""
        if not self._header_written:
            self.write_header()
        if batch is not self._batch:  # positions are shared by all layers of a step
            self._batch, self._pos = batch, batch.positions.to("cpu").numpy().tolist()
        ids = topk_ids.detach().to("cpu").numpy().tolist()  # numpy's tolist is ~6x faster than torch's
        w = np.round(topk_weights.detach().to("cpu", torch.float32).numpy().astype(np.float64),
                     WEIGHT_DECIMALS).tolist()
        phase = getattr(batch.phase, "value", batch.phase)
        dlayer = self._moe_layers[moe_layer] if self._moe_layers is not None else None
        lines = []
        for s in batch.seqs:
            a, b = s.q_start, s.q_start + s.q_len
            rec = {"type": "route", "step": int(batch.step), "phase": phase, "seq_id": s.seq_id}
            name = self._names.get(s.seq_id)
            if name is not None:
                rec["request_id"] = name
            rec["layer"] = int(moe_layer)
            if dlayer is not None:
                rec["dlayer"] = dlayer
            rec.update(pos=self._pos[a:b], experts=ids[a:b], weights=w[a:b])
            lines.append(json.dumps(rec, separators=(",", ":")))
        with self._lock:
            self._f.write("\n".join(lines) + "\n")

    def _write(self, obj: dict) -> None:
        with self._lock:
            self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        with self._lock:
            self._f.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        with self._lock:
            if not self._f.closed:
                self._f.close()

    def __enter__(self) -> "RoutingRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------- reading


def iter_trace(path: str | Path, info: TraceInfo | None = None) -> Iterator[RouteRecord]:
    """Yield the route records of one trace file, in file order, auto-detecting the format per line.

    Blank lines are skipped. Header lines are appended to ``info.headers`` and start a new segment.

    Raises:
        FileNotFoundError: no such file.
        TraceFormatError: a line that is not JSON or not a known record (file:line in the message).
    """
    path = Path(path)
    info = info if info is not None else TraceInfo()
    info.segments += 1
    seg = info.segments - 1
    names: dict[int, str] = {}
    fresh = True  # nothing read yet in this segment
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(o, dict):
                raise TraceFormatError(f"{path}:{lineno}: expected a JSON object")
            kind = o.get("type")
            try:
                if kind == "route":
                    sid = o.get("seq_id")
                    rid = o.get("request_id") or names.get(sid)
                    yield RouteRecord(str(path), seg, rid if rid else f"{path.name}#{seg}:seq{sid}", o["phase"],
                                      int(o["step"]), int(o["layer"]), [int(p) for p in o["pos"]],
                                      [[int(e) for e in row] for row in o["experts"]], o.get("weights"),
                                      sid, rid, o.get("dlayer"))
                elif kind == "header":
                    if not fresh:
                        info.segments += 1
                        seg, names = info.segments - 1, {}
                    info.headers.append(o)
                elif kind == "request":
                    names[int(o["seq_id"])] = str(o["request_id"])
                elif kind is None and "experts" in o and "token_idx" in o and "layer" in o:
                    req = f"{path.stem}:{o.get('dataset', '')}/{o.get('problem_id', 0)}"
                    probs = o.get("gating_probs")
                    yield RouteRecord(str(path), seg, req, "decode", None, int(o["layer"]), [int(o["token_idx"])],
                                      [[int(e) for e in o["experts"]]], [list(probs)] if probs is not None else None)
                else:
                    raise TraceFormatError(f"{path}:{lineno}: unknown record (keys {sorted(o)[:8]})")
                fresh = False
            except (KeyError, TypeError, ValueError) as exc:
                if isinstance(exc, TraceFormatError):
                    raise
                raise TraceFormatError(f"{path}:{lineno}: malformed {kind or 'routing'} record ({exc!r})") from None


def read_traces(paths: list[str | Path]) -> tuple[list[RouteRecord], TraceInfo]:
    """All route records of ``paths`` (in order) and the headers seen.

    Raises:
        FileNotFoundError, TraceFormatError: as :func:`iter_trace`.
    """
    info = TraceInfo()
    records: list[RouteRecord] = []
    for p in paths:
        records.extend(iter_trace(p, info))
    return records, info
