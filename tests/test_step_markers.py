"""Step markers (``edgemoe.bench.step_markers``) on the CPU: the wrapped forward is stamped at its start and end,
the wrapper goes on exit, and the summary's durations and gaps follow from the stamps."""

from __future__ import annotations

import pytest
import torch

from edgemoe.bench.step_markers import StepMarkers, step_times


class _Slow(torch.nn.Module):
    def forward(self, x):
        return (x @ x.T).sum()


def test_wrapped_forwards_are_stamped_in_order_and_the_wrapper_goes():
    model, mk = _Slow(), StepMarkers(torch.device("cpu"), capacity=2)
    x = torch.randn(64, 64)
    with mk.wrap(model):
        for _ in range(3):
            model(x)
    model(x)  # unwrapped: not stamped
    assert "forward" not in model.__dict__ and int(mk.counter) == 3
    stamps = mk.read()
    assert len(stamps) == 2  # the capacity: the third forward ran but was not stored
    t = step_times(stamps)
    assert t["steps"] == 2 and len(t["forward_ms"]) == 2 and len(t["gap_ms"]) == 1
    assert all(f > 0 for f in t["forward_ms"]) and t["gap_ms"][0] >= 0
    mk.reset()
    assert mk.read() == [] and step_times([])["forward_median_ms"] is None


def test_a_shadowing_forward_is_restored():
    model, mk = _Slow(), StepMarkers(torch.device("cpu"))
    own = lambda x: x  # noqa: E731 - an instance attribute that shadows the class's forward
    model.forward = own
    with mk.wrap(model):
        model(torch.zeros(2))
    assert model.forward is own and int(mk.counter) == 1


def test_step_times_from_known_stamps():
    t = step_times([(0, 2_000_000), (3_000_000, 4_500_000), (4_500_000, 7_000_000)])
    assert t["forward_ms"] == [2.0, 1.5, 2.5] and t["gap_ms"] == [1.0, 0.0]
    assert t["forward_median_ms"] == 2.0 and t["gap_mean_ms"] == 0.5
    with pytest.raises(ValueError, match="out of order"):
        step_times([(0, 2), (1, 3)])  # overlapping forwards
    with pytest.raises(ValueError, match="out of order"):
        step_times([(5, 2)])
