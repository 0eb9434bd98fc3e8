"""Thread count and pinning of the native CPU executor (``edgemoe.experts.native.plan_threads``).

- the plan never oversubscribes: the default is the cores minus the threads that run beside the
  pool (spare SMT siblings host those instead), a larger request is capped with a note, the pool
  takes the last cores; ``oversubscribe`` takes a request as given;
- the executor and the engine follow the plan (a CUDA device leaves one core); the doorbell server
  pins itself to worker 0's planned core; the count changes at run time (``set_cpu_threads``);
- a pool oversubscribed on purpose still computes the same step, and its workers notice that they
  lost their core (``preempted_waits``) instead of spinning on.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from native_helpers import needs_native

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts import native
from edgemoe.experts.pool import HostExpertPool
from edgemoe.synth import make_model

CORES16 = list(range(16))


def test_default_is_the_cores_minus_the_threads_alongside():
    p = native.plan_threads(None, alongside=1, cores=CORES16, logical=16)
    assert (p.threads, p.limit, p.reserved, p.note) == (15, 15, 1, None)
    assert p.cpus == tuple(range(1, 16))  # core 0 stays free for the Python and driver threads
    assert native.plan_threads(None, alongside=0, cores=CORES16, logical=16).threads == 16
    # SMT siblings beside the pinned cores host the threads alongside: every core computes
    assert native.plan_threads(None, alongside=1, cores=CORES16, logical=32).threads == 16
    assert native.plan_threads(None, alongside=3, cores=[0, 1], logical=2).threads == 1  # never below one


def test_requests_beyond_the_limit_are_capped_unless_oversubscribed():
    p = native.plan_threads(16, alongside=1, cores=CORES16, logical=16)
    assert p.threads == 15 and p.requested == 16 and "16 threads requested, 15 used" in p.note
    p = native.plan_threads(6, alongside=1, cores=CORES16, logical=16)
    assert p.threads == 6 and p.note is None and p.cpus == tuple(range(10, 16))
    p = native.plan_threads(20, cores=CORES16, logical=16, oversubscribe=True)
    assert p.threads == 20 and p.cpus == ()  # more threads than cores: not pinned
    assert native.plan_threads(4, cores=CORES16, logical=16, pin=False).cpus == ()
    with pytest.raises(ValueError, match="threads"):
        native.plan_threads(0)
    with pytest.raises(ValueError, match="alongside"):
        native.plan_threads(None, alongside=-1)


@needs_native
def test_executor_follows_the_plan_and_the_server_pins_itself():
    pool = HostExpertPool.dense(4, 64, 32, torch.bfloat16)
    pool.fill_random(seed=1)
    cores = native.physical_core_cpus()
    ex = native.NativeCpuExecutor(pool, len(cores) + 3)
    assert ex.threads == len(cores) == ex.plan.threads and ex.plan.note
    ex = native.NativeCpuExecutor(pool, None, alongside=1)
    assert ex.threads == max(1, len(cores) - 1)
    step = ex.make_step(2, 4, x_dtype=torch.bfloat16)
    bell = step.serve(pin_memory=False)
    try:
        step.x.normal_()
        step.set_work(step.x[:1], [(1, torch.tensor([0]), torch.tensor([1.0]))])
        bell[0] += 1
        deadline = time.monotonic() + 10
        while int(bell[8]) < int(bell[0]) and time.monotonic() < deadline:
            time.sleep(1e-4)
        assert step.served == 1 and step.failed == 0
        assert step.server_cpu == ex.plan.cpus[0]
    finally:
        step.close()


@needs_native
def test_oversubscribed_pool_is_correct_and_notices_preemption():
    pool = HostExpertPool.dense(16, 256, 128, torch.bfloat16)
    pool.fill_random(seed=2)
    cores = len(native.physical_core_cpus())
    n = 2 * cores + 1
    ex = native.NativeCpuExecutor(pool, n, oversubscribe=True, min_parallel_bytes=0, spin_us=100_000)
    ref = native.NativeCpuExecutor(pool, 1)
    x = torch.randn(2, 256)
    work = [(f, torch.tensor([0, 1]), torch.tensor([0.5, 0.25])) for f in range(16)]
    expect = torch.zeros(2, 256)
    ref.run(x, work, expect)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        for _ in range(30):
            out = torch.zeros(2, 256)
            ex.run(x, work, out)
            assert torch.equal(out, expect)
            time.sleep(0.002)  # workers spin between steps (100 ms budget) while the spinners want the cores
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert ex.preempted_waits > 0  # a long spin budget, cut short: the workers went to sleep instead


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-threads")
    make_model(out, "qwen3_moe", "tiny", seed=3, dtype="bfloat16")
    return out


@needs_native
def test_engine_changes_the_thread_count_at_run_time(tiny):
    runner = ModelRunner(tiny, EngineConfig(device="cpu", expert_policy="cpu-all", cpu_threads=1), progress=False)
    assert runner.experts.cpu_executor.threads == 1 and torch.get_num_threads() == 1

    def decode() -> list[int]:
        tok, toks = int(runner.execute([StepInput(0, [5, 6, 7, 8], 0)], Phase.PREFILL)[0].argmax()), []
        for s in range(5):
            tok = int(runner.execute([StepInput(0, [tok], 4 + s)], Phase.DECODE)[0].argmax())
            toks.append(tok)
        runner.free(0)
        return toks

    before = decode()
    cores = len(native.physical_core_cpus())
    runner.set_cpu_threads(cores)
    assert runner.experts.cpu_executor.threads == cores and torch.get_num_threads() == cores
    assert runner.experts.hybrid.cpu is runner.experts.cpu_executor
    assert decode() == before  # results do not depend on the thread count
    with pytest.raises(ValueError, match="cpu_threads"):
        runner.set_cpu_threads(0)


@needs_native
def test_the_call_trace_stamps_every_point_of_each_traced_call_in_order(load_benchmark):
    pool = HostExpertPool.dense(16, 256, 128, torch.bfloat16)
    pool.fill_random(seed=2)
    ex = native.NativeCpuExecutor(pool, 2, min_parallel_bytes=0)
    x, work = torch.randn(2, 256), [(f, torch.tensor([0, 1]), torch.tensor([0.5, 0.25])) for f in range(4)]
    ex.run(x, work, torch.zeros(2, 256))
    assert ex.traced().shape == (0, 3 + 4 * ex.threads)  # nothing recorded before trace_calls
    ex.trace_calls(3)
    for _ in range(5):  # two more calls than the record holds
        ex.run(x, work, torch.zeros(2, 256))
    rec = ex.traced()
    assert rec.shape == (3, 3 + 4 * ex.threads)
    entry, dispatch, ret = rec[:, 0], rec[:, 1], rec[:, 2]
    threads = rec[:, 3:].view(3, ex.threads, 4)
    assert bool((entry > 0).all() and (entry <= dispatch).all() and (dispatch <= ret).all())
    assert bool((threads > 0).all())  # both threads ran every call (a parallel call)
    assert bool((threads.diff(dim=2) >= 0).all())  # start <= phase-1 end <= barrier exit <= phase-2 end
    assert bool((threads[:, :, 0] >= dispatch[:, None]).all() and (threads[:, :, 3] <= ret[:, None]).all())
    assert bool((entry[1:] >= ret[:-1]).all())  # the first three calls, in order
    parts = load_benchmark("cpu_executor").call_breakdown(rec)
    assert set(parts) == {"total", "prep", "wake", "phase1", "barrier", "phase2", "join", "busy"}
    assert 0 < parts["busy"] <= 1 and parts["total"] >= parts["prep"] + parts["phase1"] - 1e-6
    ex.trace_calls(0)
    ex.run(x, work, torch.zeros(2, 256))
    assert ex.traced().shape[0] == 0  # stopped and dropped


def test_call_breakdown_of_a_known_record(load_benchmark):
    us = 1000  # ns
    # one call: entry 0, dispatch 5, return 100; thread 0 starts at 5, phase 1 to 50, barrier to 60, phase 2 to 95;
    # thread 1 starts at 15, phase 1 to 60, exits the barrier at 60, phase 2 to 90
    rec = torch.tensor([[1, 6, 101, 6, 51, 61, 96, 16, 61, 61, 91]], dtype=torch.int64) * us
    parts = load_benchmark("cpu_executor").call_breakdown(rec)
    assert parts == pytest.approx({"total": 100, "prep": 5, "wake": 10, "phase1": 55, "barrier": 5, "phase2": 35,
                                   "join": 5, "busy": (80 + 75) / 2 / 100})
    with pytest.raises(ValueError, match="no call"):
        load_benchmark("cpu_executor").call_breakdown(torch.zeros(0, 11, dtype=torch.int64))
