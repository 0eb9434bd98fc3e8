"""CUDA-only: the start-up warm-up a runner runs on a GPU (``EngineConfig.warmup``, on by default) compiles the
decode kernels before the first request and leaves no other trace: the same cache state and counts as a runner
built with ``warmup=False``, the same tokens and logits bit for bit for the same request (``fill-all``, and
``qstar`` at fixed bandwidths, whose split does not depend on time), the same hits, misses and fills. Prints the
first decode step's time of both runners (the one without the warm-up built first, so it also pays the kernels'
compilation or their load from Triton's disk cache)."""

from __future__ import annotations

import time

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.synth import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-bf16-warmup")
    make_model(out, "qwen3_moe", "small", seed=5, dtype="bfloat16")
    return out


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
    kw = dict(device="cuda", expert_policy=policy, expert_cache_slots=24, bandwidth_pcie_gbps=20.0,
              bandwidth_cpu_gbps=20.0)
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
    print(f"\nwarm-up ({policy}): {warmed.warmup_seconds:.3f} s; first decode step without it {1e3 * a_first:.1f} ms "
          f"(built first), after it {1e3 * b_first:.1f} ms")
