"""The device decode path (``DeviceDecode``: route control + fused gather + grouped GEMV + CPU branch)
against the eager hybrid path, on the CPU with the Triton kernels in the interpreter: equal outputs,
identical residency tables and counters, step after step, for every policy."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from edgemoe.core import Phase  # noqa: E402
from edgemoe.experts.cache import ExpertCache  # noqa: E402
from edgemoe.experts.cpu_executor import TorchCpuExecutor  # noqa: E402
from edgemoe.experts.device_decode import DeviceDecode  # noqa: E402
from edgemoe.experts.hybrid import HybridExperts  # noqa: E402
from edgemoe.experts.policy import Bandwidths, make_policy  # noqa: E402
from edgemoe.experts.pool import HostExpertPool  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (interpreter) variant; tests/gpu covers CUDA")

E, K, H, I, LAYERS = 12, 4, 32, 16, 3


def _pool() -> HostExpertPool:
    pool = HostExpertPool(LAYERS * E, H, I, torch.float32)
    g = torch.Generator().manual_seed(0)
    pool.w13.copy_(torch.randn(pool.w13.shape, generator=g) * 0.2)
    pool.w2.copy_(torch.randn(pool.w2.shape, generator=g) * 0.2)
    return pool


def _pair(pool, slots, policy_name):
    policy = make_policy(policy_name, Bandwidths(10.0, 25.0, "test"))
    out = []
    for _ in range(2):
        cache = ExpertCache(slots, pool.num_ids, [tuple(pool.w13.shape[1:]), tuple(pool.w2.shape[1:])],
                            torch.float32, torch.device("cpu"))
        out.append(HybridExperts(pool, cache, policy, TorchCpuExecutor(pool), E, torch.device("cpu")))
    eager, dev = out
    dev.device_decode = DeviceDecode(pool, dev.cache, policy, dev.cpu, E, K, max_tokens=4)
    return eager, dev


@pytest.mark.parametrize("policy,slots", [("qstar", 6), ("fill-all", 5), ("fill-all", 30), ("cpu-all", 7),
                                          ("static", 13)])
def test_device_path_equals_eager_path(policy, slots):
    pool = _pool()
    eager, dev = _pair(pool, slots, policy)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        T = 1 + step % 3
        for c in (eager.cache, dev.cache):
            c.clock.fill_(step)
        for layer in range(LAYERS):
            x = torch.randn(T, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, k]
            if T > 1:
                ids[1, :2] = ids[0, :2]  # shared experts between tokens
            w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
            a = eager.forward(layer, x, ids, w, Phase.DECODE, step)
            b = dev.forward(layer, x, ids, w, Phase.DECODE, step)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            for name in ("slot_of", "owner_of", "last_used"):
                assert torch.equal(getattr(dev.cache, name), getattr(eager.cache, name)), (name, step, layer)
        dev.cache.check_invariants()
    assert dev.stats()["decode"] == eager.stats()["decode"]
