"""CUDA-only checks of the doorbell's ``stream-op`` wait (``cuStreamWaitValue32`` / ``cuStreamWriteValue32``
through ctypes): the wait holds the stream until the host stores the word and the write lands; ring ->
wait captured in a CUDA graph replays against the native executor's real server thread; a server that
does not answer in time is given up by its watchdog instead of hanging the GPU; and the device decode
path of a small model gives the same tokens and logits with either wait."""

from __future__ import annotations

import time

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts.policy import Bandwidths
from edgemoe.experts.pool import HostExpertPool
from edgemoe.synth import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-bf16-streamop")
    make_model(out, "qwen3_moe", "small", seed=5, dtype="bfloat16")
    return out


def _driver():
    from edgemoe.kernels import cuda_driver

    if (why := cuda_driver.unavailable_reason("cuda")) is not None:
        pytest.skip(why)
    return cuda_driver


def _native():
    from edgemoe.experts import native

    try:
        native.load_extension()
    except native.NativeUnavailable as e:
        pytest.skip(f"native executor unavailable: {e}")
    return native


def test_wait_value_holds_the_stream_until_the_host_stores_the_word():
    drv = _driver()
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    addr = drv.host_device_pointer(word, "cuda")
    out = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    done = torch.cuda.Event()
    with torch.cuda.stream(s):
        drv.wait_value32(s.cuda_stream, addr, 1)
        out.fill_(7.0)
        drv.write_value32(s.cuda_stream, addr, 5)
        done.record()
    time.sleep(0.2)
    assert not done.query() and int(word[0]) == 0  # still waiting: no SM involved, nothing ran past it
    word[0] = 1
    done.synchronize()
    assert float(out[0]) == 7.0 and int(word[0]) == 5


def test_captured_ring_and_wait_replay_against_the_server():
    """ring -> wait_stream_op -> a marker kernel, captured once and replayed: every replay with CPU work
    is served by the executor's server thread (request and done advance, the release word is reset
    after each wait); a replay without CPU work does not ring and is released by the ring itself."""
    drv = _driver()
    native = _native()
    from edgemoe.kernels import doorbell

    pool = HostExpertPool.dense(4, 64, 32, torch.float32)
    pool.fill_random(seed=3)
    ex = native.NativeCpuExecutor(pool, threads=2, pin=False)
    step = ex.make_step(2, 4, x_dtype=torch.float32, zero_out=True, pin_memory=True)
    bell = step.serve(pin_memory=True, release_timeout_s=doorbell.RELEASE_TIMEOUT_S)
    try:
        x = torch.randn(1, 64)
        work_list = [(2, torch.tensor([0]), torch.tensor([0.5]))]
        step.set_work(x, work_list)
        expect = torch.zeros(1, 64)
        ex.run(x, work_list, expect)
        addr = drv.host_device_pointer(doorbell.release_word(bell), "cuda")
        seq = torch.zeros(1, dtype=torch.int64, device="cuda")
        work = torch.ones(1, dtype=torch.int32, device="cuda")
        marker = torch.zeros(1, dtype=torch.int64, device="cuda")
        got = torch.zeros(1, 64, device="cuda")

        def body():
            doorbell.ring(seq, bell, work=work, release=True)
            doorbell.wait_stream_op(addr, torch.cuda.current_stream().cuda_stream)
            got.copy_(step.out[:1], non_blocking=True)
            marker.add_(1)

        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            body()  # compiles the ring kernel outside the capture
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            body()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        assert int(marker[0]) == 6 and int(seq[0]) == 6 and int(bell[0]) == 6
        assert step.served == 6 and int(bell[8]) == 6 and int(bell[1]) == 0
        assert int(doorbell.release_word(bell)[0]) == 0  # reset by the write after each wait
        torch.testing.assert_close(got.cpu(), expect)
        work.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert int(marker[0]) == 7 and int(seq[0]) == 6 and step.served == 6  # not rung, released by the ring
    finally:
        step.close()


def test_watchdog_releases_a_wait_the_server_does_not_answer_in_time():
    drv = _driver()
    native = _native()
    from edgemoe.kernels import doorbell

    pool = HostExpertPool.dense(16, 512, 1024, torch.float32)
    pool.fill_random(seed=4, std=0.02)
    ex = native.NativeCpuExecutor(pool, threads=1, pin=False)
    step = ex.make_step(16, 16, x_dtype=torch.float32, zero_out=True, pin_memory=True)
    x = torch.randn(16, 512)
    step.set_work(x, [(f, torch.arange(16), torch.full((16,), 0.1)) for f in range(16)])
    t0 = time.perf_counter()
    step()
    took = time.perf_counter() - t0
    if took < 0.005:
        step.close()
        pytest.skip(f"a step takes {took * 1e3:.1f} ms here: too fast to outlast a 1 ms watchdog")
    bell = step.serve(pin_memory=True, release_timeout_s=took / 5)
    try:
        time.sleep(0.05)
        addr = drv.host_device_pointer(doorbell.release_word(bell), "cuda")
        seq = torch.zeros(1, dtype=torch.int64, device="cuda")
        for _ in range(3):  # the first is given up mid-step; the server is then gone and the rest answered at once
            doorbell.ring(seq, bell)
            doorbell.wait_stream_op(addr, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()  # returns: no wait hangs
        assert int(bell[1]) == 3 and step.served == 0
    finally:
        step.close()


def _decode(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    toks = [int(runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)[0].argmax())]
    out = []
    for s in range(steps):
        logits = runner.execute([StepInput(0, [toks[-1]], len(prompt) + s)], Phase.DECODE)
        out.append(logits.float().cpu())
        toks.append(int(logits[0].argmax()))
    runner.free(0)
    return torch.stack(out), toks


@pytest.mark.parametrize("eager", [False, True])
def test_device_decode_gives_the_same_tokens_with_either_wait(small, eager):
    _driver()
    prompt = list(range(5, 45))
    results = {}
    for mode in ("kernel", "stream-op"):
        runner = ModelRunner(small, EngineConfig(device="cuda", dtype="float32", expert_policy="fill-all",
                                                 expert_cache_slots=10**6, doorbell_wait=mode, enforce_eager=eager),
                             progress=False)
        runner.experts.bandwidths = Bandwidths(10.0, 25.0, "test")
        runner.set_expert_cache(20, "qstar")
        dd = runner.experts.device_decode
        assert dd.cpu_branch and dd.step is not None and dd.wait_mode == mode
        assert runner.experts.decode_path == ("device" if eager else "device + CUDA graphs")
        assert f"wait {mode}" in runner.summary()
        results[mode] = _decode(runner, prompt, steps=12)
        st = runner.experts.stats()["decode"]
        assert st["cpu"] > 0 and st["fills"] > 0
        assert int(dd.bell[1]) == 0 and dd.step.failed == 0
        runner.experts.cache.check_invariants()
    (a, ta), (b, tb) = results["kernel"], results["stream-op"]
    assert ta == tb and torch.equal(a, b)
