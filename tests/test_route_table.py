"""The benchmarks' table routing (``edgemoe.bench.route_table``): one Triton launch gives the rows the torch ops
give, advances the device-side counter alike, wraps around the table, and takes any top-k."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernel runs in the interpreter on CPU hosts

import pytest

triton = pytest.importorskip("triton")

from edgemoe.bench import route_table  # noqa: E402  (after TRITON_INTERPRET)


def _torch_rows(table: torch.Tensor, counter: torch.Tensor, T: int) -> torch.Tensor:
    idx = (counter + torch.arange(T, device=table.device)) % table.shape[0]
    counter.add_(T)
    return table.index_select(0, idx)


@pytest.mark.parametrize("k", [8, 6, 1])
def test_one_launch_reads_the_rows_the_torch_ops_read(k, monkeypatch):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not route_table._INTERPRETED:
        pytest.skip("Triton imported without its interpreter on a CPU host")
    launches = []
    kernel = route_table._table_rows_kernel

    class Counted:  # the kernel, counting its launches
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(route_table, "_table_rows_kernel", Counted())
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 128, (37, k), generator=g).to(dev)  # 37 rows: the steps below wrap around
    start = (1 << 31) - 40  # a counter past int32's range after a few steps: the kernel keeps it in int64
    counters = torch.tensor([0, start, 0], dtype=torch.int64, device=dev)  # the kernel's counter is a view
    ref = torch.tensor([start], dtype=torch.int64, device=dev)
    steps = (1, 3, 64, 5, 1, 30, 64)
    for T in steps:
        got = route_table.table_rows(table, counters[1:2], T)
        want = _torch_rows(table, ref, T)
        assert got.shape == (T, k) and got.dtype == table.dtype
        assert torch.equal(got, want), T
        assert counters[1].item() == ref.item()
    assert len(launches) == len(steps)  # one launch a step: the torch ops did not stand in
    assert counters[1].item() == start + sum(steps) > 1 << 31
    assert counters[0].item() == 0 and counters[2].item() == 0  # only its own counter moves


def test_long_steps_take_the_torch_ops_and_bad_shapes_are_refused():
    table = torch.arange(40, dtype=torch.int64).view(10, 4)
    counter = torch.tensor([7], dtype=torch.int64)
    rows = route_table.table_rows(table, counter, route_table.MAX_TOKENS + 1)  # a prefill-sized step
    assert torch.equal(rows[0], table[7]) and torch.equal(rows[3], table[0])
    assert counter.item() == 7 + route_table.MAX_TOKENS + 1
    with pytest.raises(ValueError, match="contiguous"):
        route_table.table_rows(table.t(), counter, 1)
    with pytest.raises(ValueError, match="int64"):
        route_table.table_rows(table, counter.to(torch.int32), 1)
