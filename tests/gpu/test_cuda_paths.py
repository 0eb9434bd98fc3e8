"""CUDA-only checks of the offload paths (skipped without a GPU): pinned pool, bit-identity of
offloaded ``fill-all`` with the all-resident run, concurrent CPU + GPU branches under ``qstar``, and a
decode-step capture that a garbage collection cannot break, and the start-up warm-up (``EngineConfig.warmup``, on
by default), which compiles the decode kernels and leaves no other trace: the same cache state and counts as a runner
built without it, and for the same request the same tokens and logits bit for bit (``fill-all``, and ``qstar`` at
fixed bandwidths, whose split does not depend on time) and the same hits, misses and fills. The warm-up test prints
the first decode step's time of both runners (the one without the warm-up built first, so it also pays the
kernels' compilation or their load from Triton's disk cache)."""

from __future__ import annotations

import time

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts.policy import Bandwidths
from edgemoe.synth import make_model

from conftest import greedy_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-bf16")
    make_model(out, "qwen3_moe", "small", seed=3, dtype="bfloat16")
    return out


def test_pool_is_pinned_and_fill_all_is_bit_identical_to_resident(small):
    runner = ModelRunner(small, EngineConfig(device="cuda", expert_policy="fill-all", expert_cache_slots=10**6),
                         progress=False)
    assert runner.pinned
    resident, rt = greedy_decode(runner, PROMPT, 12, free=True)
    runner.set_expert_cache(12, "fill-all")  # < one layer (32 experts), >= a step's top-8
    offloaded, ot = greedy_decode(runner, PROMPT, 12, free=True)
    assert ot == rt
    assert torch.equal(offloaded, resident)
    assert runner.experts.stats()["decode"]["fills"] > 0


def test_qstar_on_cuda_matches_resident_tokens(small):
    runner = ModelRunner(small, EngineConfig(device="cuda", dtype="float32", expert_policy="fill-all",
                                             expert_cache_slots=10**6), progress=False)
    resident, rt = greedy_decode(runner, PROMPT, 12, free=True)
    runner.experts.bandwidths = Bandwidths(10.0, 25.0, "test")
    runner.set_expert_cache(20, "qstar")
    hybrid, ht = greedy_decode(runner, PROMPT, 12, free=True)
    st = runner.experts.stats()["decode"]
    assert st["fills"] > 0 and st["cpu"] > 0
    assert ht == rt
    torch.testing.assert_close(hybrid, resident, rtol=1e-4, atol=1e-4)


class _UnregistersWhenCollected:
    """Garbage in a reference cycle whose finalizer unregisters page-locked host memory, as a released
    ``HostExpertPool``'s or ``HostEmbedding``'s does (``cudaHostUnregister``: forbidden while a stream captures)."""

    def __init__(self, registration, done: list):
        self.registration, self.done, self.cycle = registration, done, self

    def __del__(self):
        self.registration.unregister()
        self.done.append(True)


def test_a_collection_during_a_capture_cannot_break_it(small):
    """Decode-step captures run with Python's collector off: garbage whose finalizer calls into CUDA, made inside
    the capture and followed by enough allocations to start a collection, is finalized after it, and the step's
    graph is captured (before, such a collection failed the capture at random and left that batch size eager)."""
    import gc

    from edgemoe.experts.pool import HostRegistration

    runner = ModelRunner(small, EngineConfig(device="cuda", expert_policy="fill-all", expert_cache_slots=10**6),
                         progress=False)
    assert runner.graphs is not None
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    registration = HostRegistration()
    assert int(registration.register(buf.data_ptr(), buf.numel())) == 0
    pending, done, fired = [registration], [], []

    def make_garbage_while_capturing(module, args):
        if torch.cuda.is_current_stream_capturing() and pending:
            _UnregistersWhenCollected(pending.pop(), done)  # unreachable at once, kept by its own cycle
            junk = [[] for _ in range(3 * gc.get_threshold()[0])]  # past generation 0's threshold
            fired.append(gc.isenabled())
            del junk

    handle = runner.model.register_forward_pre_hook(make_garbage_while_capturing)
    try:
        greedy_decode(runner, PROMPT, 4, free=True)
        assert fired == [False]  # the garbage was made inside a capture, with the collector off
        assert 1 in runner.graphs.captured_sizes() and 1 not in runner.graphs.failed
        gc.collect()
        assert done == [True] and not registration.registered  # finalized after the capture
    finally:
        handle.remove()
        registration.unregister()  # nothing when the finalizer did it


def _state(runner: ModelRunner) -> dict:
    stats = runner.expert_stats()
    return {"step": runner._step, "free_pages": runner.kv.free_pages, "cached_pages": runner.kv.cached_pages,
            "captured": runner.graphs.captured_sizes(), "reuse": runner.experts.cache.reuse.tolist(),
            **{key: stats[key] for key in ("policy", "slots", "slots_used", "prefill", "decode")}}


def _request(runner: ModelRunner, steps: int = 12) -> tuple[torch.Tensor, list[int], float]:
    """Greedy prefill + ``steps`` decode steps of PROMPT: (logits, tokens, seconds of the first decode step)."""
    tok = int(runner.execute([StepInput(0, PROMPT, 0)], Phase.PREFILL)[0].argmax())
    toks, out, first = [tok], [], 0.0
    for s in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = runner.execute([StepInput(0, [toks[-1]], len(PROMPT) + s)], Phase.DECODE)
        torch.cuda.synchronize()
        first = first or time.perf_counter() - t0
        out.append(logits[0].float().cpu())
        toks.append(int(logits[0].argmax()))
    runner.free(0)
    return torch.stack(out), toks, first


@pytest.mark.parametrize("policy", ["fill-all", "qstar"])
def test_warm_up_compiles_and_leaves_the_runner_as_a_fresh_one(small, policy):
    kw = dict(device="cuda", expert_policy=policy, expert_cache_slots=24, bandwidth_pcie_gbps=10.0,
              bandwidth_cpu_gbps=25.0)  # qstar sends most misses to the CPU branch
    cold = ModelRunner(small, EngineConfig(warmup=False, **kw), progress=False)
    assert cold.warmup_seconds is None
    cold_start = _state(cold)
    a_logits, a_toks, a_first = _request(cold)
    warmed = ModelRunner(small, EngineConfig(**kw), progress=False)
    assert warmed.warmup_seconds is not None and warmed.experts.decode_path == "device + CUDA graphs"
    assert _state(warmed) == cold_start
    b_logits, b_toks, b_first = _request(warmed)
    assert a_toks == b_toks and torch.equal(a_logits, b_logits)
    assert _state(warmed) == _state(cold)
    assert (warmed.expert_stats()["decode"]["cpu"] > 0) == (policy == "qstar")
    print(f"\nwarm-up ({policy}): {warmed.warmup_seconds:.3f} s; first decode step without it {1e3 * a_first:.1f} ms "
          f"(built first), after it {1e3 * b_first:.1f} ms")
