"""The start-up warm-up (``ModelRunner.warm_up``): it runs a prefill and two decode steps, then leaves the runner
as a fresh one finds it: the expert cache empty, every count at zero, the policy at its prior, no KV page or
recurrent-state slot held, nothing in the prefix cache; a request after it gives what it gives on a fresh runner,
token for token and count for count. On CPU the runner does not warm up by itself (nothing compiles there), so
these tests call it; ``tests/gpu/test_cuda_paths.py`` checks the warm-up a CUDA runner runs at start-up."""

from __future__ import annotations

import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import WARMUP_SEQ, ModelRunner, WarmUpError
from edgemoe.synth import make_model

from conftest import greedy_decode

PROMPT = list(range(3, 40))


def _counts(runner: ModelRunner) -> dict:
    """The expert counters and cache state a fresh start reports (the measured bandwidths left out)."""
    stats = runner.expert_stats()
    return {key: stats[key] for key in ("policy", "slots", "slots_used", "q_ratio", "policy_active", "prefill",
                                        "decode")} | {"prefetch": stats.get("prefetch")}


def _plain(value):
    """``value`` as comparable data: tensors as lists, objects as their attributes, recursively."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {k: _plain(v) for k, v in vars(value).items()}
    return value


def _fresh_state(runner: ModelRunner) -> dict:
    """What a fresh runner starts from: clocks, pools, the cache's tables and counters, the policy's whole state and
    the runtime's window bookkeeping (its time stamps of the last decode step included)."""
    rt, ck = runner.experts, runner.prefix.checkpoints
    return {"step": runner._step, "free_pages": runner.kv.free_pages, "cached_pages": runner.kv.cached_pages,
            "state_slots": None if runner.state is None else runner.state.free_slots,
            "checkpoints": None if ck is None else (ck.positions(), ck.saved, ck.evicted, ck._clock),
            "captured": None if runner.graphs is None else runner.graphs.captured_sizes(),
            "cache": {name: getattr(rt.cache, name).tolist() for name in ("slot_of", "owner_of", "last_used", "reuse",
                                                                         "ghost_slot", "slot_ghost", "clock")},
            "policy": _plain(rt.policy),
            "windows": (rt._last_decode, rt._decode_steps, rt._reuse_seen, rt._probe_next, rt._window_decode_s,
                        rt._window_free_fills),
            "counts": _counts(runner)}


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny qwen3_5_moe checkpoint (linear-attention layers with recurrent state)."""
    out = tmp_path_factory.mktemp("warm-q35") / "tiny"
    return make_model(out, "qwen3_5_moe", "qwen3.5-moe-tiny", seed=3, dtype="float32")


@pytest.mark.parametrize("policy", ["auto", "qstar"])
@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_5_moe"])
def test_warm_up_leaves_the_runner_as_a_fresh_one_finds_it(tiny_model_dir, hybrid_dir, model, policy, monkeypatch):
    path = tiny_model_dir if model == "qwen3_moe" else hybrid_dir
    config = EngineConfig(device="cpu", dtype="float32", expert_policy=policy, expert_cache_slots=6,
                          bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, cpu_executor="torch")
    fresh = ModelRunner(path, config, progress=False)
    warmed = ModelRunner(path, config, progress=False)
    assert warmed.warmup_seconds is None  # a CPU runner does not warm up by itself
    start = _fresh_state(fresh)
    assert _fresh_state(warmed) == start

    steps, execute = [], warmed.execute
    seen = {}

    def spy(inputs, phase):
        steps.append((phase, [(i.seq_id, len(i.token_ids), i.start_pos) for i in inputs]))
        out = execute(inputs, phase)
        seen.update(_counts(warmed))
        if policy == "auto":  # as the device path's timings teach it the machine: a resize would keep these
            warmed.experts.policy.fill_fit.add(4, 1e-3)
            warmed.experts.policy.cpu_fit.add(4, 1e-3)
        return out

    monkeypatch.setattr(warmed, "execute", spy)
    from edgemoe.engine import expert_runtime

    # a window read at the second decode step, as a slow first step (kernels compiling) makes on a GPU: the policy
    # learns from the warm-up, and the reset must forget it
    monkeypatch.setattr(expert_runtime, "REUSE_READ_SECONDS", 0.0)
    observed = []
    monkeypatch.setattr(warmed.experts.policy, "observe_layers",
                        lambda obs, f=warmed.experts.policy.observe_layers: (observed.append(obs), f(obs))[1])
    assert warmed.warm_up() > 0
    assert observed or policy != "auto"  # auto read a window during the warm-up
    monkeypatch.undo()
    assert [phase for phase, _ in steps] == [Phase.PREFILL, Phase.DECODE, Phase.DECODE]
    assert all(seq == WARMUP_SEQ for _, batch in steps for seq, _, _ in batch)
    assert seen["slots_used"] > 0 and seen["decode"]["hits"] + seen["decode"]["misses"] > 0  # it ran experts
    assert _fresh_state(warmed) == start  # and left no trace of them
    warmed.experts.cache.clock.fill_(0)  # the rebuilt cache's tensors take writes outside inference mode too

    a_logits, a_toks = greedy_decode(fresh, PROMPT, 8, free=True)
    b_logits, b_toks = greedy_decode(warmed, PROMPT, 8, free=True)
    assert a_toks == b_toks and torch.equal(a_logits, b_logits)
    assert _counts(warmed) == _counts(fresh)  # the same request made the same hits, misses and fills
    assert warmed.experts.cache.reuse.tolist() == fresh.experts.cache.reuse.tolist()


def test_warm_up_leaves_the_prefix_cache_empty_and_the_option_is_on_by_default(tiny_model_dir):
    assert EngineConfig().warmup is True and EngineConfig(warmup=False).warmup is False
    runner = ModelRunner(tiny_model_dir, EngineConfig(device="cpu", dtype="float32", enable_prefix_caching=True),
                         progress=False)
    runner.warm_up()
    assert runner.kv.cached_pages == 0 and runner.attach_prefix(0, list(range(8)) * 4) == 0


def test_no_state_checkpoint_is_taken_however_short_the_interval(hybrid_dir):
    config = EngineConfig(device="cpu", dtype="float32", expert_cache_slots=6, cpu_executor="torch",
                          bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, state_checkpoint_interval=4)
    fresh = ModelRunner(hybrid_dir, config, progress=False)
    warmed = ModelRunner(hybrid_dir, config, progress=False)
    warmed.warm_up()
    assert warmed.prefix.checkpoints.positions() == [] and warmed.prefix.checkpoints.saved == 0
    assert _fresh_state(warmed) == _fresh_state(fresh)
    greedy_decode(warmed, PROMPT, 2, free=True)
    assert warmed.prefix.checkpoints.saved > 0  # the store is back for real requests


@pytest.mark.parametrize("max_model_len, runs", [(9, True), (2, False)])
def test_a_short_context_shortens_or_skips_the_warm_up(tiny_model_dir, max_model_len, runs):
    runner = ModelRunner(tiny_model_dir, EngineConfig(device="cpu", dtype="float32", max_model_len=max_model_len),
                         progress=False)
    seconds = runner.warm_up()
    assert (seconds is not None) == runs
    assert runner.kv.free_pages == runner.kv.num_pages and runner._step == 0


@pytest.mark.parametrize("where", ["step", "forward"])
def test_a_failed_warm_up_step_still_leaves_a_fresh_usable_runner(tiny_model_dir, where, monkeypatch):
    """A decode step of the warm-up that raises, before it runs (``step``) or half-way through its layers
    (``forward``, layer 1's experts): the reset still runs, the error names the fault, the runner serves as new."""
    from edgemoe.experts.hybrid import HybridExperts

    config = EngineConfig(device="cpu", dtype="float32", expert_policy="qstar", expert_cache_slots=6,
                          bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, cpu_executor="torch")
    fresh = ModelRunner(tiny_model_dir, config, progress=False)
    runner = ModelRunner(tiny_model_dir, config, progress=False)
    if where == "step":
        execute = runner.execute

        def decode_fails(inputs, phase):
            if phase is Phase.DECODE:
                raise RuntimeError("simulated fault in a step")
            return execute(inputs, phase)

        monkeypatch.setattr(runner, "execute", decode_fails)
    else:
        forward = HybridExperts.forward

        def layer_1_fails(self, moe_layer, x, topk_ids, topk_weights, phase, step):
            if phase is Phase.DECODE and moe_layer == 1:
                raise RuntimeError("simulated fault in a step")
            return forward(self, moe_layer, x, topk_ids, topk_weights, phase, step)

        monkeypatch.setattr(HybridExperts, "forward", layer_1_fails)
    with pytest.raises(WarmUpError, match="simulated fault in a step"):
        runner.warm_up()
    monkeypatch.undo()
    assert _fresh_state(runner) == _fresh_state(fresh)
    assert greedy_decode(runner, PROMPT, 4, free=True)[1] == greedy_decode(fresh, PROMPT, 4, free=True)[1]
