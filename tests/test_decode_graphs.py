"""``DecodeGraphs._capture`` without a GPU: the capture runs with Python's cyclic collector off (a finalizer
that calls into CUDA, e.g. ``cudaHostUnregister`` of a released host pool, must not run inside a stream
capture) and none is forced (a full collection of an engine process costs ~0.1 s). ``torch.cuda``'s graph API
is replaced by recorders; the GPU test ``tests/gpu/test_cuda_paths.py`` checks the same on a real capture."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from edgemoe.engine.cuda_graphs import DecodeGraphs


@pytest.fixture(autouse=True)
def _collector_back_on():
    """Whatever a test below leaves, the collector is on for the rest of the session."""
    yield
    gc.enable()


def _fake_cuda(monkeypatch, seen: list):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    @contextmanager
    def graph(g, pool=None):
        seen.append(("enter", gc.isenabled()))
        yield
        seen.append(("exit", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", graph)


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
    assert seen[:2] == [("enter", False), ("forward", False)]
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
