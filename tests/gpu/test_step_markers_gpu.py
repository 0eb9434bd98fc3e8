"""Step markers on CUDA: the device-clock stamps of a forward captured in a CUDA graph are taken at every replay,
in order, and a forward that waits longer on the device reads longer."""

from __future__ import annotations

import pytest
import torch

from edgemoe.bench.step_markers import StepMarkers, step_times

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _Matmuls(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        for _ in range(self.n):
            x = torch.tanh(x @ x)
        return x


@pytest.mark.parametrize("graph", [False, True])
def test_stamps_of_replays_are_ordered_and_scale_with_the_work(graph):
    x = torch.randn(1024, 1024, device="cuda") / 32
    out = {}
    for n in (2, 40):
        model, mk = _Matmuls(n), StepMarkers(torch.device("cuda"))
        with mk.wrap(model):
            model(x)  # warm-up (and, for the graph, the eager step before a capture)
            torch.cuda.synchronize()
            if graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    model(x)
            mk.reset()
            for _ in range(5):
                g.replay() if graph else model(x)
            torch.cuda.synchronize()
        stamps = mk.read()
        assert len(stamps) == 5
        out[n] = step_times(stamps)  # raises on stamps out of order
    assert out[40]["forward_median_ms"] > 5 * out[2]["forward_median_ms"] > 0
