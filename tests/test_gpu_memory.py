"""Elastic device memory on the CPU: the KV pool resizes with its pages intact, the budget controller
follows a fake memory probe (shrink at once, grow back only past the dead band, floors and caps
respected, a failed resize keeps the old state), resizes in flight keep greedy outputs exact, the KV
cache borrows from the expert cache instead of preempting and gives the memory back, and
``/admin/memory`` over real HTTP (API key, the CPU's 400, metrics)."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from edgemoe import SamplingParams
from edgemoe.config import EngineConfig
from edgemoe.engine.async_engine import AsyncLLM
from edgemoe.engine.gpu_memory import BudgetController, GpuMemory, MemorySample, ResizeError, Tuning
from edgemoe.engine.llm_engine import LLMEngine
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.kvcache.pool import KVSpec, PagedKVPool

from conftest import running_server

GREEDY = dict(temperature=0.0, ignore_eos=True)
MB = 1 << 20  # the controller's unit tests count in MB


def _config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", cpu_executor="torch", expert_policy="fill-all", max_model_len=512)
    return EngineConfig(**{**base, **kw})


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, between=None) -> list[list[int]]:
    """Greedy outputs of ``prompts`` run together; ``between(step_index)`` runs between steps."""
    ids = [engine.add_request(None, p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in prompts]
    done, step = {}, 0
    while engine.has_unfinished_requests():
        if between is not None:
            between(step)
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [done[i] for i in ids]


# ---------------------------------------------------------------------- the KV pool


def test_kv_pool_grows_and_shrinks_with_its_pages_intact():
    pool = PagedKVPool(KVSpec.heads(2, 2, 4), 4, 4, torch.float32, torch.device("cpu"), prefix_caching=True)
    pool.allocate(1, 10)  # 3 pages: the lowest ids first
    assert pool.pages_of(1) == [0, 1, 2]
    slots = pool.slots(1, 0, 10)
    pool.k[:, slots] = torch.arange(10, dtype=torch.float32)[None, :, None, None]
    pool.resize(9)
    assert pool.num_pages == 9 and pool.free_pages == 6 and pool.k.shape[1] == 36
    assert torch.equal(pool.k[0, slots, 0, 0], torch.arange(10, dtype=torch.float32))  # copied over
    pool.allocate(2, 24)  # 6 pages: the rest of the old pool, then the new ones
    assert pool.pages_of(2) == [3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="page 8 is in use"):
        pool.resize(5)
    assert pool.num_pages == 9
    pool.cache_prefix(2, list(range(24)))  # the tree takes seq 2's pages; freeing it leaves them cached
    pool.free(2)
    assert pool.cached_pages == 6 and pool.min_pages() == 3
    pool.resize(5)  # the cached node holding pages at and above 5 is dropped (whole: its pages 3 and 4 are free)
    assert pool.num_pages == 5 and pool.k.shape[1] == 20 and pool.free_pages == 2 and pool.cached_pages == 0
    assert torch.equal(pool.k[0, slots, 0, 0], torch.arange(10, dtype=torch.float32))
    pool.resize(8, stage_on_host=True)
    assert pool.free_pages == 5 and torch.equal(pool.k[0, slots, 0, 0], torch.arange(10, dtype=torch.float32))


# ---------------------------------------------------------------------- the controller


def test_controller_shrinks_at_once_and_grows_back_only_past_the_dead_band():
    tune = Tuning(period_s=0.25, hysteresis_bytes=100 * MB, grow_hold_s=2.0)
    ctl = BudgetController(tune)
    row, head = 10 * MB, 200 * MB
    # 150 MB free < 200 MB headroom: shrink to the band's middle (250 MB free): 100 MB = 10 slots
    assert ctl.decide(0.0, 150 * MB, head, 50, row, 0, 60) == (40, "pressure")
    assert ctl.decide(0.0, 150 * MB, head, 50, row, 45, 60) == (45, "pressure")  # not below the floor
    assert ctl.decide(0.0, 150 * MB, head, 40, row, 45, 60) is None  # below the floor already: kept
    # inside the band [200, 300] MB: nothing, however long
    assert all(ctl.decide(t, 290 * MB, head, 40, row, 0, 60) is None for t in range(20))
    # above the band: grow only after the hold, to the middle of the band, at most to the cap
    assert ctl.decide(10.0, 400 * MB, head, 40, row, 0, 60) is None
    assert ctl.decide(11.9, 400 * MB, head, 40, row, 0, 60) is None
    assert ctl.decide(12.0, 400 * MB, head, 40, row, 0, 60) == (55, "returned")
    assert ctl.decide(20.0, 900 * MB, head, 55, row, 0, 60) is None  # the hold starts again after a change
    assert ctl.decide(22.0, 900 * MB, head, 55, row, 0, 60) == (60, "returned")  # capped
    # a dip below the band resets the hold
    ctl.decide(30.0, 400 * MB, head, 40, row, 0, 60)
    ctl.decide(31.0, 250 * MB, head, 40, row, 0, 60)
    assert ctl.decide(32.5, 400 * MB, head, 40, row, 0, 60) is None


class FakeProbe:
    """Device memory set by the test: ``free`` bytes, minus whatever the runner's caches hold beyond
    what they held when the probe was made (so the runner's own resizes show, as on a device)."""

    source = "fake"

    def __init__(self, runner: ModelRunner, free: int):
        self.runner, self.free = runner, free
        self.calls = 0
        self._held = self._holding()

    def _holding(self) -> int:
        return self.runner.experts.cache.nbytes + self.runner.kv.nbytes

    def sample(self) -> MemorySample:
        self.calls += 1
        return MemorySample(self.free - (self._holding() - self._held), 1 << 40)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def probed(tiny_model_dir):
    """A CPU runner whose 40-slot expert cache follows a fake device: headroom 10 rows (expert-cache
    slots), dead band 8 rows, one sample per 0.25 s, 1 s holds."""
    config = _config(expert_cache_slots=40)
    runner = ModelRunner(str(tiny_model_dir), config, progress=False)
    row = runner.pool.row_bytes
    probe, clock = FakeProbe(runner, 30 * row), Clock()
    tune = Tuning(period_s=0.25, hysteresis_bytes=8 * row, grow_hold_s=1.0, return_hold_s=1.0)
    runner.memory = GpuMemory(runner.experts, runner.kv, config, max_kv_pages=64, rebind=runner._bind, probe=probe,
                              tuning=tune, clock=clock)
    runner.memory.headroom_bytes = 10 * row
    return runner, probe, clock


def _ticks(mem: GpuMemory, clock: Clock, n: int, dt: float = 0.25) -> None:
    for _ in range(n):
        clock.now += dt
        mem.tick()


def test_memory_follows_the_probe_at_a_bounded_rate(probed):
    runner, probe, clock = probed
    mem, row = runner.memory, runner.pool.row_bytes
    assert mem.auto and mem.cap_slots == 40 and runner.experts.cache.num_slots == 40
    mem.tick()
    calls = probe.calls
    for _ in range(50):  # within one period: no further sample, however many steps
        mem.tick()
    assert probe.calls == calls
    probe.free = 7 * row  # another process takes memory: below the headroom of 10 rows
    _ticks(mem, clock, 1)  # reacts at the next period: shrinks to the band's middle (14 rows free)
    assert runner.experts.cache.num_slots == 33 and mem.resizes["pressure"] == 1
    assert probe.sample().free_bytes == 14 * row
    _ticks(mem, clock, 40)  # inside the band [10, 18] rows: no oscillation
    assert runner.experts.cache.num_slots == 33 and "returned" not in mem.resizes
    probe.free = 30 * row  # given back: 37 rows free, above the band; grows after the 1 s hold, to the cap
    _ticks(mem, clock, 3)
    assert runner.experts.cache.num_slots == 33
    _ticks(mem, clock, 2)
    assert runner.experts.cache.num_slots == 40 and mem.resizes["returned"] == 1
    stats = mem.stats()
    assert stats["expert_cache_bytes"] == 40 * row and stats["free_bytes"] == 30 * row
    assert stats["budget_bytes"] == 40 * row + runner.kv.nbytes + 20 * row
    assert [h["reason"] for h in stats["history"]] == ["start", "pressure", "returned"]
    probe.free = -100 * row  # pressure beyond the whole cache: down to 0 slots (the KV floor is not for this)
    _ticks(mem, clock, 1)
    assert runner.experts.cache.num_slots == 0


def test_a_failed_resize_keeps_the_old_state(probed, monkeypatch):
    runner, probe, clock = probed
    mem, cache = runner.memory, runner.experts.cache
    import edgemoe.engine.expert_runtime as er

    real = er.ExpertCache

    def tight(slots, *a, **kw):
        if 0 < slots < 40:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(slots, *a, **kw)

    monkeypatch.setattr(er, "ExpertCache", tight)
    probe.free = 2 * runner.pool.row_bytes
    _ticks(mem, clock, 1)
    assert runner.experts.cache.num_slots == 40 and runner.experts.policy.name == "fill-all"
    assert "out of memory" in mem.last_error and not mem.resizes
    with pytest.raises(ResizeError, match="kept 40 slots"):
        mem.configure(expert_slots=20)
    assert runner.experts.cache.num_slots == 40 and cache is not runner.experts.cache  # rebuilt at the old size
    with pytest.raises(ValueError, match="budget_gb"):
        mem.configure(budget_gb=1e-6)  # less than the KV cache: refused before anything changes
    assert mem.auto and runner.experts.cache.num_slots == 40


def test_a_step_out_of_device_memory_shrinks_the_cache_and_runs_again(probed, tiny_model_dir, monkeypatch):
    runner = probed[0]
    want = _run(LLMEngine(ModelRunner(str(tiny_model_dir), _config(expert_cache_slots=40), progress=False)),
                [[5, 6, 7, 8, 9]], 12)
    engine, real, failures = LLMEngine(runner), runner._forward, []

    def flaky(batch):
        if len(failures) < 1 and batch.phase.value == "decode":
            failures.append(batch.step)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: another process took it)")
        return real(batch)

    monkeypatch.setattr(runner, "_forward", flaky)
    assert _run(engine, [[5, 6, 7, 8, 9]], 12) == want  # no failed request
    assert failures and runner.memory.resizes["out-of-memory"] == 1
    assert runner.experts.cache.num_slots <= 40 - 8  # at least the dead band (8 rows)


# ---------------------------------------------------------------------- resizes in flight


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return [tok.encode(f"Session {i}: explain caches and " + "memory " * (3 * i)) for i in range(3)]


def test_resizes_in_flight_keep_greedy_outputs(tiny_model_dir, prompts):
    plain = LLMEngine(ModelRunner(str(tiny_model_dir), _config(expert_cache_slots=40), progress=False))
    want = _run(plain, prompts, 24)
    engine = LLMEngine(ModelRunner(str(tiny_model_dir), _config(expert_cache_slots=40), progress=False))
    mem = engine.runner.memory
    sizes = {3: 7, 6: 0, 9: 25, 12: 48}  # steps at which the expert cache is resized, requests in flight

    def resize(step):
        if step in sizes:
            mem.configure(expert_slots=sizes[step])

    assert _run(engine, prompts, 24, resize) == want
    assert engine.runner.experts.cache.num_slots == 48 and mem.resizes["admin"] == 4


def test_kv_cache_borrows_from_the_experts_instead_of_preempting(tiny_model_dir, prompts):
    """Two multi-turn sessions whose KV outgrows the start-up pool (64 tokens): the KV cache takes
    expert-cache slots (down to the floor) and no request is preempted; once the sessions end the
    memory goes back to the expert cache. With the floor at the start-up size, they preempt."""
    def sessions(engine: LLMEngine) -> list[list[int]]:
        history = [list(p) for p in prompts[:2]]
        for _ in range(3):
            outs = _run(engine, history, 16)
            history = [h + o + [7, 8, 9] for h, o in zip(history, outs)]  # the next user turn
        return history

    roomy = LLMEngine(ModelRunner(str(tiny_model_dir), _config(expert_cache_slots=40, kv_cache_tokens=1024),
                                  progress=False))
    want = sessions(roomy)
    assert roomy.metrics.preemptions._value.get() == 0
    tight = LLMEngine(ModelRunner(str(tiny_model_dir), _config(expert_cache_slots=40, kv_cache_tokens=64,
                                                               min_expert_cache_slots=8), progress=False))
    mem = tight.runner.memory
    mem.tuning = replace(mem.tuning, period_s=0.0, return_hold_s=0.0)
    assert tight.runner.kv_capacity_tokens == 64 and sum(len(h) for h in want) > 64
    assert sessions(tight) == want
    assert tight.metrics.preemptions._value.get() == 0
    assert mem.resizes["kv-borrowed"] >= 1 and tight.runner.experts.cache.num_slots >= 8
    mem.tick()  # the sessions ended: the pages in use fit the start-up pool again
    assert mem.borrowed_pages == 0 and tight.runner.kv.num_pages == mem.base_kv_pages
    assert tight.runner.experts.cache.num_slots == 40 and mem.resizes["kv-returned"] >= 1

    fixed = LLMEngine(ModelRunner(str(tiny_model_dir), _config(expert_cache_slots=40, kv_cache_tokens=96,
                                                               min_expert_cache_slots=40), progress=False))
    assert sessions(fixed) == want
    assert fixed.metrics.preemptions._value.get() > 0 and fixed.runner.kv.num_pages == fixed.runner.memory.base_kv_pages


# ---------------------------------------------------------------------- the admin API


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), _config(expert_cache_slots=10, kv_cache_tokens=128), progress=False)
    assert llm.wait_ready(120)
    try:
        with running_server(llm, "tiny", api_key="k") as base:
            yield base, {"x-api-key": "k"}
    finally:
        llm.shutdown()


def test_admin_memory_route(served):
    base, key = served
    assert httpx.get(base + "/admin/memory").status_code == 401
    state = httpx.get(base + "/admin/memory", headers=key).json()
    assert state["device"] == "cpu" and state["auto"] is False and state["budget_bytes"] is None
    assert state["expert_cache_slots"] == 10 and state["kv_pages"] == 8 and state["history"][0]["reason"] == "start"
    row = state["expert_cache_bytes"] // 10
    r = httpx.post(base + "/admin/memory", json={"expert_slots": 14, "min_expert_slots": 3}, headers=key, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["expert_cache_bytes"] == 14 * row and r.json()["min_expert_cache_slots"] == 3
    assert httpx.get(base + "/admin/expert-cache", headers=key).json()["slots"] == 14  # the alias sees it
    metrics = httpx.get(base + "/metrics").text
    assert f"edgemoe_expert_cache_bytes {float(14 * row)}" in metrics
    assert "edgemoe_kv_cache_bytes" in metrics and 'edgemoe_memory_resizes_total{reason="admin"} 1.0' in metrics


@pytest.mark.parametrize("body", [{"budget_gb": 6}, {"auto": True}, {"headroom_gb": 1}, {"expert_gb": 6}])
def test_admin_memory_gpu_settings_on_the_cpu_are_400(served, body):
    base, key = served
    before = httpx.get(base + "/admin/memory", headers=key).json()
    r = httpx.post(base + "/admin/memory", json=body, headers=key, timeout=60)
    assert r.status_code == 400, r.text
    assert "not a GPU" in r.json()["error"]["message"] and r.json()["error"]["param"] == next(iter(body))
    after = httpx.get(base + "/admin/memory", headers=key).json()
    assert after["expert_cache_slots"] == before["expert_cache_slots"] and after["auto"] is False


@pytest.mark.parametrize("body", [{}, {"expert_slots": -1}, {"expert_slots": 2, "expert_gb": 1}, {"budget": 3},
                                  {"policy": "fastest"}])
def test_admin_memory_bad_bodies_are_400(served, body):
    base, key = served
    r = httpx.post(base + "/admin/memory", json=body, headers=key, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_a_gpu_budget_for_a_cpu_runner_is_refused_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match="not a GPU"):
        ModelRunner(str(tiny_model_dir), _config(gpu_budget="6"), progress=False)
    with pytest.raises(ValueError, match="not a GPU"):
        ModelRunner(str(tiny_model_dir), _config(expert_cache_gb=6), progress=False)
