"""Prefix caching end to end on the tiny random-weight model (CPU): the engine reuses cached KV pages
of a shared prompt prefix and computes only the rest, with the same greedy tokens as an engine without
the cache (and logits equal to float32 tolerance); usage and /metrics report the reuse."""

from __future__ import annotations

import httpx
import pytest
import torch

from edgemoe import SamplingParams
from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.async_engine import AsyncLLM
from edgemoe.engine.llm import render_chat
from edgemoe.engine.llm_engine import LLMEngine
from edgemoe.engine.model_runner import StepInput

from conftest import run_requests, running_server

GREEDY = dict(temperature=0.0, ignore_eos=True)
PARAMS = SamplingParams(max_tokens=12, **GREEDY)
PS = 16  # EngineConfig's default page size


def make_engine(model_dir, **options) -> LLMEngine:
    return LLMEngine.from_model_dir(str(model_dir), EngineConfig(device="cpu", **options), progress=False)


def run(engine: LLMEngine, prompts, params=PARAMS) -> list:
    return run_requests(engine, prompts, params)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def counters(engine: LLMEngine) -> tuple[float, float]:
    m = engine.metrics
    return m.prefix_cache_hit_tokens._value.get(), m.prompt_tokens_computed._value.get()


def assert_pool_clean(engine: LLMEngine) -> None:
    """Idle engine: no sequence holds pages or references; every page is unused or cached."""
    kv = engine.runner.kv
    assert kv._pages == {} and kv._borrowed == {} and kv._prefix_node == {}
    nodes = kv.prefix_cache._nodes()
    assert all(n.ref == 0 for n in nodes)
    assert sorted(kv._free + [p for n in nodes for p in n.pages]) == list(range(kv.num_pages))
    assert engine.runner.kv_free_tokens() == engine.runner.kv_capacity_tokens


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> LLMEngine:
    """The reference: the same model without prefix caching."""
    return make_engine(tiny_model_dir, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    """Ten prompts sharing a 3-page system prompt, then different questions."""
    tok = plain.tokenizer
    system = tok.encode("System: you are a careful assistant who answers questions about numbers. " * 2)
    assert len(system) > 3 * PS
    return [system + tok.encode(f"Question {i}: what is {i} times {i + 3}? " + "Think. " * i) for i in range(10)]


@pytest.fixture(scope="module")
def alone(plain, prompts) -> list[list[int]]:
    """Greedy outputs of each prompt run by itself without the cache."""
    outs = [run(plain, [p])[0] for p in prompts]
    assert all(o.cached_tokens == 0 for o in outs) and counters(plain)[0] == 0
    return [o.outputs[0].token_ids for o in outs]


def test_shared_prefix_computes_only_the_suffix(tiny_model_dir, plain, prompts, alone):
    engine = make_engine(tiny_model_dir)
    first = run(engine, [prompts[0]])[0]
    assert first.cached_tokens == 0 and first.outputs[0].token_ids == alone[0]
    assert counters(engine) == (0, len(prompts[0]))

    second = run(engine, [prompts[1]])[0]
    reuse = min(common_prefix(prompts[0], prompts[1]), len(prompts[1]) - 1) // PS * PS
    assert reuse >= 3 * PS and second.cached_tokens == reuse
    assert second.outputs[0].token_ids == alone[1]
    assert counters(engine) == (reuse, len(prompts[0]) + len(prompts[1]) - reuse)

    # The same prompt again: everything but the last token's page is reused.
    again = run(engine, [prompts[1]])[0]
    assert again.cached_tokens == (len(prompts[1]) - 1) // PS * PS and again.outputs[0].token_ids == alone[1]

    # The next turn of a conversation reuses the previous turn's prompt and its output's KV too
    # (every token but the last sampled one, whose KV was never computed).
    turn = prompts[1] + second.outputs[0].token_ids + engine.tokenizer.encode(" And then?")
    out = run(engine, [turn])[0]
    held = len(prompts[1]) + len(second.outputs[0].token_ids) - 1
    assert out.cached_tokens == held // PS * PS
    assert out.outputs[0].token_ids == run(plain, [turn])[0].outputs[0].token_ids
    assert_pool_clean(engine)


def test_cached_prefill_logits_match_full_prefill(tiny_model_dir, prompts):
    """Runner level: a suffix prefilled over cached pages gives the logits of a full prefill."""
    engine = make_engine(tiny_model_dir)
    runner = engine.runner
    a, b = prompts[2], prompts[3]
    runner.execute([StepInput(1, a, 0)], Phase.PREFILL)
    runner.cache_prefix(1, a)
    runner.free(1)
    n = runner.attach_prefix(2, b)
    assert n == common_prefix(a, b) // PS * PS and n > 0
    cached = runner.execute([StepInput(2, b[n:], n)], Phase.PREFILL)  # [1, V]
    full = runner.execute([StepInput(3, b, 0)], Phase.PREFILL)  # [1, V]
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-4)
    assert cached.argmax(-1).item() == full.argmax(-1).item()
    # and the next decode step over the shared pages agrees too
    tok = int(full.argmax(-1))
    d_cached = runner.execute([StepInput(2, [tok], len(b))], Phase.DECODE)
    d_full = runner.execute([StepInput(3, [tok], len(b))], Phase.DECODE)
    torch.testing.assert_close(d_cached, d_full, rtol=0, atol=1e-4)
    runner.free(2), runner.free(3)
    assert_pool_clean(engine)


def test_concurrent_requests_share_pages(tiny_model_dir, prompts, alone):
    engine = make_engine(tiny_model_dir)
    run(engine, [prompts[0]])  # warms the cache with the system prompt
    outs = run(engine, prompts)  # 10 requests, 8 in flight at once
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(o.cached_tokens >= 3 * PS for o in outs)
    assert_pool_clean(engine)


def test_eviction_under_kv_pressure_serves_everything(tiny_model_dir, prompts, alone, monkeypatch):
    # 10 pages cannot keep every prompt's pages cached: admissions evict (LRU) unreferenced pages.
    engine = make_engine(tiny_model_dir, kv_cache_tokens=10 * PS, max_model_len=10 * PS)
    tree = engine.runner.kv.prefix_cache
    evicted = []
    real_evict = tree.evict
    monkeypatch.setattr(tree, "evict", lambda n: evicted.append(real_evict(n)) or evicted[-1])
    outs = [run(engine, [p])[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert sum(evicted) > 0 and tree.num_pages <= 10
    assert sum(o.cached_tokens > 0 for o in outs) >= 5  # the system prompt survives: it is used most recently
    assert_pool_clean(engine)


def test_preemption_with_shared_pages(tiny_model_dir, plain, prompts, alone):
    # 16 pages for 8 concurrent requests of ~60 + 40 tokens: requests are preempted and recomputed
    # while others borrow the same cached system-prompt pages; 16-token chunks split every prompt.
    params = SamplingParams(max_tokens=40, **GREEDY)
    reference = [run(plain, [p], params)[0].outputs[0].token_ids for p in prompts]
    assert [r[:len(a)] for r, a in zip(reference, alone)] == alone
    engine = make_engine(tiny_model_dir, prefill_chunk_tokens=16, kv_cache_tokens=16 * PS, max_model_len=256)
    outs = run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert engine.metrics.preemptions._value.get() > 0
    hits, computed = counters(engine)
    assert hits > 0 and computed + hits >= sum(map(len, prompts))
    assert_pool_clean(engine)


def test_abort_releases_references(tiny_model_dir, prompts, alone):
    engine = make_engine(tiny_model_dir)
    run(engine, [prompts[0]])
    a = engine.add_request("a", prompts[4], SamplingParams(max_tokens=1000, **GREEDY))
    b = engine.add_request("b", prompts[5], PARAMS)
    for _ in range(4):
        engine.step()
    shared = engine.runner.kv.prefix_cache.match_prefix(prompts[0][:3 * PS]).node
    assert shared.ref == 2  # both running requests lock the system prompt's pages
    assert engine.abort(a).outputs[0].finish_reason == "abort"
    assert shared.ref == 1
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done[b].outputs[0].token_ids == alone[5]
    assert_pool_clean(engine)


def test_prefix_caching_can_be_turned_off(plain, prompts, tmp_path):
    from edgemoe.cli import build_parser, engine_config_from_args

    assert plain.runner.kv.prefix_cache is None
    outs = run(plain, [prompts[0], prompts[0]])
    assert [o.cached_tokens for o in outs] == [0, 0] and counters(plain)[0] == 0
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["serve", str(tmp_path)])).enable_prefix_caching is True
    config = engine_config_from_args(parse(["serve", str(tmp_path), "--no-prefix-caching"]))
    assert config.enable_prefix_caching is False


# ---------------------------------------------------------------- the APIs


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), EngineConfig(device="cpu", max_model_len=2048), progress=False)
    assert llm.wait_ready(120)
    try:
        with running_server(llm, "tiny") as base:
            yield llm, base
    finally:
        llm.shutdown()


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_apis_report_cached_tokens(server):
    import anthropic
    import openai

    llm, base = server
    tok = llm.tokenizer
    system = "You are the assistant of a very long-winded system prompt. " * 4
    chat = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    greedy = dict(model="tiny", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})

    def messages(q):
        return [{"role": "system", "content": system}, {"role": "user", "content": q}]

    r1 = chat.chat.completions.create(messages=messages("What is one?"), **greedy)
    r2 = chat.chat.completions.create(messages=messages("And what is two?"), **greedy)
    p1, p2 = render_chat(tok, messages("What is one?"))[1], render_chat(tok, messages("And what is two?"))[1]
    reuse = common_prefix(p1, p2) // PS * PS
    assert reuse >= 2 * PS
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == reuse and r2.usage.prompt_tokens == len(p2)

    stream = chat.chat.completions.create(messages=messages("What is three?"), stream=True,
                                          stream_options={"include_usage": True}, **greedy)
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= reuse

    text = system + " Count: 1 2 3"
    c1 = chat.completions.create(prompt=text, **greedy)
    c2 = chat.completions.create(prompt=text, **greedy)
    n = len(tok.encode(text))
    assert c1.usage.prompt_tokens == c2.usage.prompt_tokens == n
    assert c2.usage.prompt_tokens_details.cached_tokens == (n - 1) // PS * PS

    resp = chat.responses.create(model="tiny", instructions=system, input="What is four?", max_output_tokens=3,
                                 temperature=0)
    assert resp.usage.input_tokens_details.cached_tokens >= reuse

    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    ask = dict(model="tiny", max_tokens=3, system=system, messages=[{"role": "user", "content": "What is five?"}])
    total = claude.messages.count_tokens(model="tiny", system=system, messages=ask["messages"]).input_tokens
    msg = claude.messages.create(**ask)
    assert msg.usage.cache_read_input_tokens >= reuse
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == total
    with claude.messages.stream(**ask) as s:
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens == (total - 1) // PS * PS  # the same prompt again
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total

    cached = [r2.usage.prompt_tokens_details.cached_tokens, usage[0].prompt_tokens_details.cached_tokens,
              c2.usage.prompt_tokens_details.cached_tokens, resp.usage.input_tokens_details.cached_tokens,
              msg.usage.cache_read_input_tokens, final.usage.cache_read_input_tokens]
    assert metric(base, "edgemoe_prefix_cache_hit_tokens_total") == sum(cached)
    prompt_total = metric(base, "edgemoe_prompt_tokens_total")
    assert metric(base, "edgemoe_prompt_tokens_computed_total") == prompt_total - sum(cached)
    assert metric(base, "edgemoe_prefix_cache_pages") > 0
