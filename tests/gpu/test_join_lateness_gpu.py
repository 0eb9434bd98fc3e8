"""CUDA-only checks of the graded join lateness: the hand-off stores its ring's time on the GPU's clock, the join counts
in halves against two limits (2 when it waited longer than the wait limit or gave up, 0 when the CPU branch was done
earlier than the GPU by more than the slack limit, 1 otherwise), with the server's step time beside its done word;
and the device decode path of a small model gives the same tokens under ``auto`` with either count."""

from __future__ import annotations

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts.policy import Bandwidths
from edgemoe.synth import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BIG = 1 << 62  # a limit no wait or slack reaches


def _join(limits: list[int], done: bool, cpu_ns: int = 0, answer_after_s: float | None = None) -> tuple[int, int]:
    """One hand-off and its join by hand (no server): ``done`` answered before the join, or by a host thread
    ``answer_after_s`` seconds after the join was launched (the join waits for it), or never (the join gives up
    after its polls); returns the layer's ``(hand-offs, late halves)``."""
    import threading
    import time

    from edgemoe.kernels.cpu_handoff import collect, handoff
    from edgemoe.kernels.doorbell import BELL_WORDS, CPU_NS, DONE, MAX_POLLS

    dev = torch.device("cuda")
    T, H = 1, 64
    x, y = torch.randn(T, H, device=dev), torch.randn(T, H, device=dev)
    x_host = torch.zeros(T * H, dtype=torch.float32, pin_memory=True)
    pack, pack_host = torch.arange(4, dtype=torch.int64, device=dev), torch.zeros(4, dtype=torch.int64, pin_memory=True)
    cpu_out = torch.zeros(T * H, dtype=torch.float32, pin_memory=True)
    seq = torch.zeros(1, dtype=torch.int64, device=dev)
    bell = torch.zeros(BELL_WORDS, dtype=torch.int64, pin_memory=True)
    work = torch.ones(1, dtype=torch.int32, device=dev)
    ring_ns = torch.zeros(1, dtype=torch.int64, device=dev)
    stats = torch.zeros(1, 2, dtype=torch.int64, device=dev)
    lim = torch.tensor([limits], dtype=torch.int64, device=dev)
    handoff(x, x_host, pack, pack_host, work, seq, bell, ring_ns=ring_ns)
    torch.cuda.synchronize()
    assert int(bell[0]) == 1 and int(ring_ns[0]) > 0
    if done:
        bell[CPU_NS], bell[DONE] = cpu_ns, 1
    torch.cuda._sleep(1_000_000)  # the GPU's time between ring and join: about a millisecond
    answer = None
    if answer_after_s is not None:
        def late_answer():
            time.sleep(answer_after_s)
            bell[DONE] = 1
        answer = threading.Thread(target=late_answer)
        answer.start()
    collect(y, cpu_out, work, seq, bell, torch.float32, max_polls=2000 if answer is None else MAX_POLLS, stats=stats,
            layer=0, ring_ns=ring_ns, limits=lim)
    torch.cuda.synchronize()
    if answer is not None:
        answer.join()
    return tuple(stats[0].tolist())


def test_a_join_counts_in_halves_against_its_two_limits():
    assert _join([BIG, 0], done=True) == (1, 0)  # the CPU was done long before: early by more than the limit
    assert _join([BIG, BIG], done=True) == (1, 1)  # ... but not by more than this one
    assert _join([BIG, 0], done=True, cpu_ns=BIG) == (1, 1)  # the server's step took longer than the GPU's time
    assert _join([0, BIG], done=False, answer_after_s=0.05) == (1, 2)  # the join waits for the CPU past the limit
    assert _join([BIG, BIG], done=False, answer_after_s=0.05) == (1, 1)  # ... but not past this one
    assert _join([BIG, BIG], done=False) == (1, 2)  # nobody answers: a give-up is as late as a join gets


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-bf16-lateness")
    make_model(out, "qwen3_moe", "small", seed=5, dtype="bfloat16")
    return out


def test_device_decode_gives_the_same_tokens_with_either_count(small):
    """``qstar`` (a split from the first step: hand-offs in every step) decodes the same tokens with the joins
    graded (captured in the step's CUDA graph) as with yes/no; under ``auto`` the limits are the policy's."""
    prompt = list(range(5, 45))
    results = {}
    runner = ModelRunner(small, EngineConfig(device="cuda", dtype="float32", expert_policy="fill-all",
                                             expert_cache_slots=10**6), progress=False)
    runner.experts.bandwidths = Bandwidths(10.0, 25.0, "test")
    for lateness in ("yes-no", "graded"):  # one runner: the count switched between steps (set_join_lateness)
        runner.set_join_lateness(lateness)
        runner.set_expert_cache(20, "qstar")
        dd = runner.experts.device_decode
        assert dd.lateness == lateness and dd.late_unit == (2 if lateness == "graded" else 1)
        assert runner.experts.decode_path == "device + CUDA graphs"
        assert ("joins counted graded" in runner.summary()) == (lateness == "graded")
        toks = [int(runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)[0].argmax())]
        for s in range(12):
            logits = runner.execute([StepInput(0, [toks[-1]], len(prompt) + s)], Phase.DECODE)
            toks.append(int(logits[0].argmax()))
        runner.free(0)
        handoffs, late = dd.join_stats.sum(0).tolist()
        assert handoffs > 0 and 0 <= late <= dd.late_unit * handoffs
        assert int(dd.bell[1]) == 0 and dd.step.failed == 0
        results[lateness] = toks
        if lateness == "graded":
            runner.set_expert_cache(20, "auto")
            dd = runner.experts.device_decode
            fill_s, cpu_s = runner.experts.policy.join_limits()
            assert dd.join_limits[0].tolist() == [round(fill_s * 1e9), round(cpu_s * 1e9)]
    assert results["yes-no"] == results["graded"]
