"""The doorbell's two waits without a GPU: the ``doorbell_wait`` option and its resolution, the ctypes
binding of the driver's stream memory operations where there is no driver, and the release-word
protocol of the native step server that the ``stream-op`` wait relies on (the server posts the
release word; its watchdog gives up a request left unanswered and answers every later one at
once; stopping it gives up a pending request), with the ring kernel in the Triton interpreter."""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from edgemoe.config import EngineConfig
from edgemoe.experts.device_decode import AUTO_DOORBELL_WAIT, resolve_doorbell_wait
from edgemoe.experts.pool import HostExpertPool
from edgemoe.kernels import cuda_driver

RELEASE, GAVE_UP, DONE = 16, 1, 8


def _native():
    from edgemoe.experts import native

    try:
        native.load_extension()
    except native.NativeUnavailable as e:
        pytest.skip(f"native executor unavailable: {e}")
    return native


def _until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True


def _release(bell: torch.Tensor) -> int:
    return int(bell.view(torch.int32)[2 * RELEASE])


def test_option_parses_and_validates():
    from edgemoe.cli import add_config_args

    assert EngineConfig().doorbell_wait == "auto"
    assert EngineConfig(doorbell_wait="stream-op").doorbell_wait == "stream-op"
    with pytest.raises(ValueError, match="doorbell_wait 'poll'"):
        EngineConfig(doorbell_wait="poll")
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig, "engine")
    assert parser.parse_args(["--doorbell-wait", "kernel"]).doorbell_wait == "kernel"
    with pytest.raises(SystemExit):
        parser.parse_args(["--doorbell-wait", "spin"])


def test_auto_resolves_to_the_kernel_and_stream_op_needs_cuda():
    assert AUTO_DOORBELL_WAIT == "kernel"
    assert resolve_doorbell_wait("auto", torch.device("cpu")) == ("kernel", "kernel (auto)")
    assert resolve_doorbell_wait("kernel", torch.device("cpu")) == ("kernel", "kernel")
    with pytest.raises(ValueError, match="doorbell_wait stream-op: stream memory operations need a CUDA device"):
        resolve_doorbell_wait("stream-op", torch.device("cpu"))
    with pytest.raises(ValueError, match="choose one of auto, kernel, stream-op"):
        resolve_doorbell_wait("spin", torch.device("cpu"))


def test_driver_binding_without_a_driver(monkeypatch):
    missing = "libcuda-not-here.so.1"
    why = cuda_driver.unavailable_reason("cuda", library=missing)
    assert why is not None and missing in why and "does not load" in why
    assert "CUDA device" in cuda_driver.unavailable_reason("cpu")
    monkeypatch.setattr(cuda_driver, "LIBRARY", missing)
    with pytest.raises(cuda_driver.DriverError, match="does not load"):
        cuda_driver.wait_value32(0, 0, 1)
    with pytest.raises(cuda_driver.DriverError, match="does not load"):
        cuda_driver.write_value32(0, 0, 0)
    with pytest.raises(ValueError, match="pinned CPU tensor"):
        cuda_driver.host_device_pointer(torch.zeros(4, dtype=torch.int32), "cuda")


def test_device_decode_refuses_a_wait_mode_it_cannot_run():
    pytest.importorskip("triton")
    from edgemoe.experts.cache import ExpertCache
    from edgemoe.experts.cpu_executor import TorchCpuExecutor
    from edgemoe.experts.device_decode import DeviceDecode
    from edgemoe.experts.policy import Bandwidths, make_policy

    pool = HostExpertPool.dense(8, 32, 16, torch.float32)
    cache = ExpertCache(4, pool.num_ids, pool.layout, pool.compute_dtype, torch.device("cpu"), num_experts=4)
    policy = make_policy("qstar", Bandwidths(10.0, 25.0, "test"), num_layers=2, max_misses=4,
                         expert_bytes=pool.row_bytes)
    args = (pool, cache, policy, TorchCpuExecutor(pool), 4, 2, 2)
    with pytest.raises(ValueError, match="wait_mode stream-op: stream memory operations need a CUDA device"):
        DeviceDecode(*args, wait_mode="stream-op")
    with pytest.raises(ValueError, match="wait_mode 'spin'"):
        DeviceDecode(*args, wait_mode="spin")
    assert DeviceDecode(*args).wait_mode == "kernel"
    with pytest.raises(ValueError, match="graded lateness needs a CUDA device"):
        DeviceDecode(*args, lateness="graded")
    with pytest.raises(ValueError, match="lateness 'signed'"):
        DeviceDecode(*args, lateness="signed")
    dd = DeviceDecode(*args)
    assert dd.lateness == "yes-no" and dd.late_unit == 1 and dd.join_limits is None


def test_join_lateness_option_is_a_cuda_option():
    """``join_lateness``: validated, parsed, and refused on a device that is not a GPU (not ignored)."""
    from edgemoe.cli import add_config_args

    assert EngineConfig().join_lateness == "yes-no"
    with pytest.raises(ValueError, match="join_lateness 'signed'"):
        EngineConfig(join_lateness="signed")
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig, "engine")
    assert parser.parse_args(["--join-lateness", "graded"]).join_lateness == "graded"


def test_switching_the_join_count_between_steps_is_checked_like_the_option(tmp_path):
    """``ModelRunner.set_join_lateness`` (benchmarks compare the counts in one process): an unknown count and,
    off a GPU, the graded one are refused, and the runner keeps its count; the same count rebuilds the cache."""
    from edgemoe.engine.expert_runtime import NoGpuError
    from edgemoe.engine.model_runner import ModelRunner
    from edgemoe.synth import write_config_only

    model = write_config_only(tmp_path / "tiny", "qwen3_moe", "tiny")
    runner = ModelRunner(model, EngineConfig(device="cpu", load_format="dummy", expert_cache_slots=4,
                                             expert_policy="qstar"), progress=False)
    with pytest.raises(ValueError, match="join_lateness 'signed'"):
        runner.set_join_lateness("signed")
    with pytest.raises(NoGpuError, match="join_lateness graded is a CUDA option"):
        runner.set_join_lateness("graded")
    assert runner.engine_config.join_lateness == runner.experts.config.join_lateness == "yes-no"
    cache = runner.experts.cache
    runner.set_join_lateness("yes-no")
    assert runner.experts.cache is not cache and runner.experts.cache.num_slots == 4
    assert runner.experts.policy.name == "qstar"
    # a rebuild that fails (here the first one, as an out-of-memory would; the device made to look like a GPU so
    # the graded count gets that far): the error is raised, the runner counts as before on a cache rebuilt cold
    from edgemoe.engine.expert_runtime import ExpertRuntime

    real, calls = ExpertRuntime.set_cache, []

    def failing_once(self, slots, policy, inherit=False):
        calls.append(self.config.join_lateness)
        if len(calls) == 1:
            raise RuntimeError("out of memory (test)")
        return real(self, slots, policy, inherit)

    cpu = runner.device
    try:
        ExpertRuntime.set_cache, runner.device = failing_once, torch.device("cuda")
        with pytest.raises(RuntimeError, match="out of memory"):
            runner.set_join_lateness("graded")
    finally:
        ExpertRuntime.set_cache, runner.device = real, cpu
    assert calls == ["graded", "yes-no"]
    assert runner.engine_config.join_lateness == runner.experts.config.join_lateness == "yes-no"
    assert runner.experts.cache.num_slots == 4 and runner.experts.policy.name == "qstar"


def test_auto_policy_prices_one_expert_on_each_side_of_a_join():
    """``join_limits``: the graded join's two limits are one fill and one CPU expert as the policy's model prices
    them now (the balance level scales the CPU's); a fixed policy reads no lateness."""
    from edgemoe.experts.policy import AutoPolicy, Bandwidths, QStarPolicy

    auto = AutoPolicy.from_bandwidths(Bandwidths(50.0, 100.0), 9_437_184, num_layers=2, max_misses=16)
    fill_s, cpu_s = auto.join_limits()
    c = auto.effective_costs()
    assert (fill_s, cpu_s) == (c.fill_conc_s, c.cpu_conc_s) and 100e-6 < fill_s < 300e-6
    auto.cpu_level = 8  # the CPU priced at twice the model's
    assert auto.join_limits()[1] == pytest.approx(2 * cpu_s) and auto.join_limits()[0] == fill_s
    assert QStarPolicy(Bandwidths(50.0, 100.0)).join_limits() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the ring kernel in the interpreter; tests/gpu covers CUDA")
def test_release_word_protocol_with_the_ring_kernel():
    """Ring (interpreter) -> server runs the step, stores done then the release word; the device side's
    reset (here by hand, as the write operation does) re-arms it; a ring without CPU work stores the
    release word itself and leaves the request alone."""
    pytest.importorskip("triton")
    from edgemoe.kernels import doorbell

    native = _native()
    pool = HostExpertPool.dense(4, 64, 32, torch.float32)
    pool.fill_random(seed=3)
    ex = native.NativeCpuExecutor(pool, threads=1, pin=False)
    step = ex.make_step(2, 4, x_dtype=torch.float32, zero_out=True)
    bell = step.serve(pin_memory=False, release_timeout_s=10.0)
    with pytest.raises(ValueError, match="other doorbell protocol"):
        step.serve(pin_memory=False)
    try:
        assert bell.numel() == doorbell.BELL_WORDS and _release(bell) == 0
        seq = torch.zeros(1, dtype=torch.int64)
        x = torch.randn(1, 64)
        step.set_work(x, [(2, torch.tensor([0]), torch.tensor([0.5]))])
        expect = torch.zeros(1, 64)
        ex.run(x, [(2, torch.tensor([0]), torch.tensor([0.5]))], expect)
        for n in range(1, 4):
            doorbell.ring(seq, bell, work=torch.tensor([1], dtype=torch.int32), release=True)
            assert int(bell[0]) == n
            assert _until(lambda: _release(bell) == 1)
            assert int(bell[DONE]) == n and step.served == n and int(bell[GAVE_UP]) == 0
            torch.testing.assert_close(step.out[:1], expect)
            doorbell.release_word(bell).zero_()  # the wait's write operation
        doorbell.ring(seq, bell, work=torch.tensor([0], dtype=torch.int32), release=True)
        assert int(bell[0]) == 3 and _release(bell) == 1 and int(seq[0]) == 3  # released by the ring itself
        assert 0 < int(bell[doorbell.CPU_NS]) < 10**9  # the server's step time (ns), beside done
        doorbell.release_word(bell).zero_()
        doorbell.ring(seq, bell, work=torch.tensor([0], dtype=torch.int32))  # kernel mode: no release store
        assert _release(bell) == 0
    finally:
        step.close()


def _slow_step(native, timeout_s: float | None, min_s: float):
    """A step served with the release word whose one call takes at least ``min_s`` seconds here
    (16 experts x 16 tokens on one thread; skipped on a machine fast enough to beat it), with a
    watchdog of ``timeout_s`` (``None``: a fifth of the step's time)."""
    pool = HostExpertPool.dense(16, 512, 1024, torch.float32)
    pool.fill_random(seed=4, std=0.02)
    ex = native.NativeCpuExecutor(pool, threads=1, pin=False)
    step = ex.make_step(16, 16, x_dtype=torch.float32, zero_out=True)
    x = torch.randn(16, 512)
    step.set_work(x, [(f, torch.arange(16), torch.full((16,), 0.1)) for f in range(16)])
    t0 = time.perf_counter()
    step()
    took = time.perf_counter() - t0
    if took < min_s:
        step.close()
        pytest.skip(f"a step takes {took * 1e3:.1f} ms here, less than the {min_s * 1e3:.0f} ms this test needs")
    bell = step.serve(pin_memory=False, release_timeout_s=took / 5 if timeout_s is None else timeout_s)
    time.sleep(0.05)  # the server thread is up (the watchdog counts from a request it sees unanswered)
    dims = step.dims.clone()
    step.dims[1] = 0  # an empty request first: the server is spinning when the slow one comes
    bell[0] = 1
    assert _until(lambda: _release(bell) == 1) and step.served == 1 and int(bell[GAVE_UP]) == 0
    step.dims.copy_(dims)
    bell.view(torch.int32)[2 * RELEASE] = 0
    return step, bell


def test_watchdog_gives_up_an_unanswered_request_and_answers_later_ones():
    native = _native()
    step, bell = _slow_step(native, timeout_s=None, min_s=0.005)
    try:
        bell[0] = 2  # rung; the server takes longer than the watchdog allows
        assert _until(lambda: int(bell[GAVE_UP]) == 1)
        assert _release(bell) == 1
        assert _until(lambda: step.calls == 3)  # the step finishes: its late answer is not posted
        time.sleep(0.01)
        assert step.served == 1 and int(bell[DONE]) == 1 and int(bell[GAVE_UP]) == 1
        bell.view(torch.int32)[2 * RELEASE] = 0  # the device's reset
        bell[0] = 3  # the server is given up: the watchdog answers at once
        assert _until(lambda: _release(bell) == 1, timeout=1.0)
        assert int(bell[GAVE_UP]) == 2 and step.served == 1 and step.calls == 3  # not run
    finally:
        step.close()


def test_stopping_the_server_gives_up_a_pending_request():
    native = _native()
    step, bell = _slow_step(native, timeout_s=60.0, min_s=0.005)
    step.out.fill_(float("nan"))
    bell[0] = 2
    assert _until(lambda: not torch.isnan(step.out[0, 0]))  # the server is computing request 2 (out zeroed)
    bell[0] = 3  # rung while request 2 runs: once the server stops nobody serves it
    step.close()  # joins the server after request 2, then gives request 3 up
    assert int(bell[DONE]) == 2 and int(bell[GAVE_UP]) == 1 and _release(bell) == 1
