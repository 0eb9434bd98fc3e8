"""``DecodeGraphs._capture`` without a GPU: the capture runs with Python's cyclic collector off (a finalizer
that calls into CUDA, e.g. ``cudaHostUnregister`` of a released host pool, must not run inside a stream
capture) and none is forced (a full collection of an engine process costs ~0.1 s). ``torch.cuda``'s graph API
is replaced by recorders; the GPU test ``tests/gpu/test_cuda_paths.py`` checks the same on a real capture."""

from __future__ import annotations

import gc
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from edgemoe.engine.cuda_graphs import DecodeGraphs, segment_starts


@pytest.fixture(autouse=True)
def _collector_back_on():
    """Whatever a test below leaves, the collector is on for the rest of the session."""
    yield
    gc.enable()


def _fake_cuda(monkeypatch, seen: list, fail_end: int | None = None):
    """``torch.cuda``'s capture API replaced by recorders: ``("begin" | "end", collector on)`` per call; the
    ``fail_end``-th ``capture_end`` (0-based) raises, as CUDA does for a capture it invalidated."""
    ends = [0]

    class Graph:
        def capture_begin(self, pool=None):
            seen.append(("begin", gc.isenabled()))

        def capture_end(self):
            seen.append(("end", gc.isenabled()))
            ends[0] += 1
            if fail_end is not None and ends[0] == fail_end + 1:
                raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


@pytest.mark.parametrize("fails", [False, True])
def test_capture_runs_with_the_collector_off_and_restores_it(monkeypatch, fails):
    seen: list = []
    _fake_cuda(monkeypatch, seen)
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(len(seen)) or 0)
    graphs = DecodeGraphs(SimpleNamespace(), torch.device("cpu"))

    def model(batch):
        seen.append(("forward", gc.isenabled()))
        if fails:
            raise RuntimeError("capture failed")
        return torch.zeros(1, 4)

    batch = SimpleNamespace(step_cache={"derived": 1})
    assert gc.isenabled()
    if fails:
        with pytest.raises(RuntimeError, match="capture failed"):
            graphs._capture(model, (1, False), batch)
    else:
        graphs._capture(model, (1, False), batch)
        assert graphs.captured_sizes() == {1}
    assert collected == []  # none forced
    assert seen[:2] == [("begin", False), ("forward", False)]
    assert seen[-1] == ("end", False)  # the capture ended (before the collector came back), also on failure
    assert gc.isenabled()  # back on after the capture, also when it failed
    assert batch.step_cache == {}


def test_capture_leaves_a_disabled_collector_disabled(monkeypatch):
    _fake_cuda(monkeypatch, [])
    graphs = DecodeGraphs(SimpleNamespace(), torch.device("cpu"))
    gc.disable()
    try:
        graphs._capture(lambda batch: torch.zeros(1), (2, True), SimpleNamespace(step_cache={}))
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Layer(torch.nn.Module):
    def __init__(self, i: int, seen: list):
        super().__init__()
        self.i, self.seen = i, seen

    def forward(self, x):
        self.seen.append(("layer", self.i))
        return x


class _Layers(torch.nn.Module):
    """A model of ``n`` decoder layers (``decoder.layers``, the contract's stack) that records each layer it runs."""

    def __init__(self, n: int, seen: list):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(_Layer(i, seen) for i in range(n))

    def forward(self, batch):
        x = torch.zeros(1, 4)
        for layer in self.decoder.layers:
            x = layer(x) + 1
        return x


@pytest.mark.parametrize("layers, segments", [(8, 3), (48, 4), (2, 6), (5, 1)])
def test_capture_cuts_the_step_into_graphs_at_layer_boundaries(monkeypatch, layers, segments):
    seen: list = []
    _fake_cuda(monkeypatch, seen)
    graphs = DecodeGraphs(SimpleNamespace(), torch.device("cpu"), segments=segments)
    model = _Layers(layers, seen)
    graphs._capture(model, (1, True), SimpleNamespace(step_cache={}))
    starts = segment_starts(layers, segments)
    expect = [("begin", False)]
    for i in range(layers):
        if i in starts:  # the cut's hook runs before the layer's own
            expect += [("end", False), ("begin", False)]
        expect.append(("layer", i))
    assert seen == [*expect, ("end", False)]
    captured, logits, crossing = graphs.graphs[(1, True)]
    assert len(captured) == len(starts) + 1 and len(crossing) == len(starts)
    assert torch.equal(logits, torch.full((1, 4), float(layers)))
    assert [x[0][0, 0].item() for x in crossing] == starts  # each cut keeps its layer's input alive
    assert not any(layer._forward_pre_hooks for layer in model.decoder.layers)  # the cuts' hooks are gone


def test_segment_starts_are_increasing_inside_the_stack_and_short_first():
    for layers in (1, 2, 3, 7, 16, 48, 61, 94):
        for segments in range(1, 9):
            s = segment_starts(layers, segments)
            assert len(s) == min(segments, layers) - 1
            assert all(0 < a < b <= layers for a, b in zip(s, [*s[1:], layers]))
            sizes = [b - a for a, b in zip([0, *s], [*s, layers])]
            assert sizes[0] == min(sizes)
    with pytest.raises(ValueError, match="segments must be >= 1"):
        segment_starts(8, 0)


def test_a_cut_capture_that_fails_is_captured_whole_from_then_on(monkeypatch):
    """A step that cannot be cut (CUDA refuses to end a capture with a stream still forked into the next
    layer) is captured as one graph, and later captures do not try the cut again."""
    seen: list = []
    _fake_cuda(monkeypatch, seen, fail_end=0)
    graphs = DecodeGraphs(SimpleNamespace(), torch.device("cpu"), segments=3)
    model = _Layers(8, seen)
    graphs._capture(model, (1, True), SimpleNamespace(step_cache={}))
    assert graphs.segments == 1
    captured, _, crossing = graphs.graphs[(1, True)]
    assert len(captured) == 1 and crossing == []
    assert seen[-10:] == [("begin", False), *[("layer", i) for i in range(8)], ("end", False)]
    assert not any(layer._forward_pre_hooks for layer in model.decoder.layers)  # the cuts' hooks are gone
