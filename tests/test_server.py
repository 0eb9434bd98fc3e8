"""The OpenAI-compatible server, exercised through the official ``openai`` SDK against a real
uvicorn server on 127.0.0.1 (a free port, run in a background thread)."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.async_engine import AsyncLLM
from edgemoe.engine.llm import render_chat
from edgemoe.server.parsers.think import ReasoningSplitter, prompt_ends_in_reasoning, split_reasoning

from conftest import running_server

MESSAGES = [{"role": "user", "content": "Tell me a story about a brave little expert."}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
_HOLD_S = 10.0  # most seconds the disconnect test holds the engine waiting for the abort


@dataclass
class Served:
    base: str
    llm: AsyncLLM
    client: openai.OpenAI

    def engine_call(self, fn):
        return self.llm.call_in_engine_thread(fn, timeout=30)

    def metric(self, text: str) -> float:
        body = httpx.get(self.base + "/metrics").text
        for line in body.splitlines():
            if line.startswith(text + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_idle(self, timeout: float = 10.0) -> float:
        start = time.monotonic()
        while self.llm.num_unfinished:
            assert time.monotonic() - start < timeout, f"{self.llm.num_unfinished} requests still in the engine"
            time.sleep(0.02)
        return time.monotonic() - start


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    llm = AsyncLLM(str(tiny_model_dir), EngineConfig(device="cpu", max_model_len=2048), progress=False)
    assert llm.wait_ready(120)
    try:
        with running_server(llm, "tiny") as base:
            yield Served(base, llm, _client(base))
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- health / models / metrics


def test_health_503_while_loading_then_200(tiny_model_dir):
    from edgemoe.engine.model_runner import ModelRunner

    release = threading.Event()

    def slow_runner():
        release.wait(60)
        return ModelRunner(str(tiny_model_dir), EngineConfig(device="cpu"), progress=False)

    llm = AsyncLLM(str(tiny_model_dir), runner_factory=slow_runner)
    try:
        with running_server(llm) as base:
            r = httpx.get(base + "/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            with pytest.raises(openai.APIStatusError) as info:
                _client(base).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
            assert info.value.status_code == 503 and "loading" in info.value.message
            release.set()
            assert llm.wait_ready(60)
            assert httpx.get(base + "/health").status_code == 200
    finally:
        release.set()
        llm.shutdown()

    def broken():
        raise FileNotFoundError("no weights here")

    failed = AsyncLLM("/nowhere", runner_factory=broken)
    try:
        with pytest.raises(Exception, match="no weights here"):
            failed.wait_ready(30)
        with running_server(failed) as base:
            r = httpx.get(base + "/health")
            assert r.status_code == 503 and "no weights here" in r.json()["message"]
    finally:
        failed.shutdown()


def test_a_shutdown_during_the_load_skips_on_ready(tiny_model_dir):
    """Ctrl-C while the model loads (a first start compiles for a while): the load runs to its end in the engine
    thread, but ``on_ready`` (the CLI's summary and "serving on ...") is not called for a server already stopped."""
    from edgemoe.engine.model_runner import ModelRunner

    release, ready = threading.Event(), []

    def slow_runner():
        release.wait(60)
        return ModelRunner(str(tiny_model_dir), EngineConfig(device="cpu"), progress=False)

    llm = AsyncLLM(str(tiny_model_dir), runner_factory=slow_runner, on_ready=ready.append)
    llm.shutdown(timeout=0.1)  # the thread is still loading
    release.set()
    llm._thread.join(60)
    assert not llm._thread.is_alive() and ready == [] and not llm.is_ready


def test_models(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == 2048


def test_metrics_expose_engine_and_expert_counters(served):
    served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **GREEDY)
    r = httpx.get(served.base + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    body = r.text
    for name in (
        'edgemoe_expert_cache_hits_total{phase="decode"}',
        'edgemoe_expert_cache_misses_total{phase="prefill"}',
        'edgemoe_expert_cache_fills_total{phase="decode"}',
        'edgemoe_expert_cpu_executed_total{phase="decode"}',
        "edgemoe_expert_cache_slots ",
        "edgemoe_expert_q_ratio ",
        "edgemoe_expert_policy_info{",
        'edgemoe_requests_total{finish_reason="length"}',
        "edgemoe_prompt_tokens_total ",
        "edgemoe_generation_tokens_total ",
        "edgemoe_time_to_first_token_seconds_bucket",
        "edgemoe_time_per_output_token_seconds_bucket",
        "edgemoe_generation_tokens_per_second ",
        "edgemoe_num_requests_running ",
        "edgemoe_num_requests_waiting ",
    ):
        assert name in body, name
    # CPU device, no cache slots: every routed expert use ran on the CPU executor.
    assert served.metric('edgemoe_expert_cpu_executed_total{phase="decode"}') > 0


# ---------------------------------------------------------------- chat / completions


def test_chat_non_streaming_and_streaming_agree(served):
    c = served.client
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny"
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    _, prompt_ids = render_chat(served.llm.tokenizer, MESSAGES)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 16 and r.usage.total_tokens == len(prompt_ids) + 16

    stream = c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-") and chunks[0].id != r.id
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(
        (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks if ch.choices
    )
    assert content == (choice.message.content or "")
    assert reasoning == ((choice.message.model_extra or {}).get("reasoning_content") or "")
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == {
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": 16,
    }
    assert all(ch.usage is None for ch in chunks[:-1])
    # include_usage: every other chunk carries "usage": null; without it there is no usage key at all.
    url = served.base + "/v1/chat/completions"
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    for include, expect in ((True, '"usage":null'), (False, None)):
        with httpx.stream("POST", url, json={**body, "stream_options": {"include_usage": include}}) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: {")]
        assert all((expect in e) if expect else ('"usage"' not in e) for e in events[:-1])


def test_chat_options_stop_seed_max_completion_tokens(served):
    c = served.client
    full = c.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=24, **GREEDY)
    text = full.choices[0].message.content
    assert full.usage.completion_tokens == 24
    stop = text[10:13]
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text[: text.index(stop)]
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.9, seed=11)
    a = c.chat.completions.create(**kw, extra_body={"top_k": 40, "ignore_eos": True}).choices[0].message.content
    b = c.chat.completions.create(**kw, extra_body={"top_k": 40, "ignore_eos": True}).choices[0].message.content
    assert a == b
    # Unknown extra fields are accepted and ignored.
    r = c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"some_future_field": {"x": 1}}, presence_penalty=0.0
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def test_completions(served):
    c = served.client
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    ids = served.llm.tokenizer.encode("Once upon a time")
    assert r.usage.prompt_tokens == len(ids)
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == r.choices[0].text
    streamed = list(c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    batch = c.completions.create(model="tiny", prompt=["Once upon a time", "Hello"], max_tokens=4, **GREEDY)
    assert [ch.index for ch in batch.choices] == [0, 1] and batch.usage.completion_tokens == 8
    assert batch.choices[0].text == c.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=4, **GREEDY
    ).choices[0].text
    echo = c.completions.create(model="tiny", prompt="Hello", max_tokens=3, echo=True, **GREEDY)
    assert echo.choices[0].text.startswith("Hello")


def test_eight_concurrent_requests(served):
    prompts = [[{"role": "user", "content": f"Question number {i}: {'why ' * i}?"}] for i in range(8)]
    sequential = [
        served.client.chat.completions.create(model="tiny", messages=m, max_tokens=12, **GREEDY).choices[0].message
        for m in prompts
    ]

    async def main():
        client = openai.AsyncOpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(
                *(client.chat.completions.create(model="tiny", messages=m, max_tokens=12, **GREEDY) for m in prompts)
            )

    results = asyncio.run(main())
    assert [r.choices[0].message.content for r in results] == [m.content for m in sequential]
    assert all(r.usage.completion_tokens == 12 for r in results)
    assert len({r.id for r in results}) == 8
    served.wait_idle()


# ---------------------------------------------------------------- errors


def _error_body(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_malformed_json_and_bad_fields_are_400(served):
    url = served.base + "/v1/chat/completions"
    r = httpx.post(url, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in _error_body(r)["message"]
    r = httpx.post(url, json={"model": "tiny"})
    assert r.status_code == 400 and _error_body(r)["param"] == "messages"
    r = httpx.post(url, json={"model": "tiny", "messages": MESSAGES, "max_tokens": "many"})
    err = _error_body(r)
    assert r.status_code == 400 and err["param"] == "max_tokens" and "max_tokens" in err["message"]
    r = httpx.post(url, json={"model": "tiny", "messages": MESSAGES, "stream_options": {"include_usage": "maybe"}})
    err = _error_body(r)
    assert r.status_code == 400 and err["param"] == "stream_options"
    assert "stream_options.include_usage" in err["message"]
    r = httpx.post(served.base + "/v1/completions", json={"model": "tiny", "prompt": {"a": 1}})
    assert r.status_code == 400 and _error_body(r)["param"] == "prompt"

    c = served.client
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=MESSAGES, temperature="hot")
    assert info.value.status_code == 400 and info.value.param == "temperature" and "temperature" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=MESSAGES, top_p=3)
    assert info.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=[{"content": "no role"}])
    assert "messages[0]" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert info.value.code == "model_not_found"


def test_too_long_prompt_is_400_at_once(served):
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4
        )
    assert time.monotonic() - start < 5
    assert info.value.code == "context_length_exceeded" and "2048" in info.value.message
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model="tiny", prompt=list(range(5, 2100)), max_tokens=4, stream=True)
    assert served.llm.num_unfinished == 0


def test_injected_failure_is_500_and_server_keeps_serving(served):
    tok = served.llm.tokenizer
    marker = tok.convert_tokens_to_ids("<tool_response>")
    assert marker is not None and marker != tok.unk_token_id

    def install(engine):
        real = engine.runner.execute

        def flaky(inputs, phase):
            if phase is Phase.PREFILL and any(marker in i.token_ids for i in inputs):
                raise RuntimeError("injected model failure")
            return real(inputs, phase)

        engine.runner.execute = flaky

    bad = [{"role": "user", "content": "please <tool_response> fail"}]
    served.engine_call(install)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            served.client.chat.completions.create(model="tiny", messages=bad, max_tokens=4)
        assert info.value.status_code == 500 and "injected model failure" in info.value.message
        with pytest.raises(openai.APIError, match="injected model failure"):
            list(served.client.chat.completions.create(model="tiny", messages=bad, max_tokens=4, stream=True))
        ok = served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **GREEDY)
        assert ok.choices[0].finish_reason == "length"
    finally:
        served.engine_call(lambda e: delattr(e.runner, "execute"))
    served.wait_idle()


def test_exception_in_handler_is_500(served, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("template exploded")

    monkeypatch.setattr(served.llm.tokenizer, "apply_chat_template", boom)  # the server's own tokenizer
    r = httpx.post(served.base + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    assert r.status_code == 500 and "template exploded" in _error_body(r)["message"]
    monkeypatch.undo()
    assert served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices


def test_client_disconnect_mid_stream_frees_request(served, monkeypatch):
    """A client that leaves mid-stream gets its request aborted and its KV pages freed, and the server goes on.

    The engine decodes without waiting for the client (1500 tokens: ~2 s on the tiny model), so reading
    ``num_running`` at a moment the client picks would race it. Instead the engine is held at a decode step
    until the server aborts the request: it cannot finish while the client reads and leaves, and the abort
    (queued before the engine goes on) lands before its next step. A server that does not abort a request
    whose client left lets it run on after ``_HOLD_S`` to ``finish_reason="length"``, which fails below."""
    aborted = served.metric('edgemoe_requests_total{finish_reason="abort"}')
    let_go = threading.Event()
    abort = served.llm.abort

    def abort_then_let_go(request_id: str) -> None:
        abort(request_id)
        let_go.set()

    def hold(engine):
        real, steps = engine.runner.execute, itertools.count()

        def execute(inputs, phase):
            if phase is Phase.DECODE and next(steps) == 64:  # enough tokens for the client's first chunks
                let_go.wait(_HOLD_S)
            return real(inputs, phase)

        engine.runner.execute = execute

    monkeypatch.setattr(served.llm, "abort", abort_then_let_go)
    served.engine_call(hold)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", served.base + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                data = []
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        data.append(line)
                    if len(data) >= 5:
                        break
                # the role chunk and four deltas, no error event nor [DONE]: the request is being decoded
                assert len(data) == 5 and all(d.startswith('data: {"id"') for d in data), data
                assert served.llm.num_running == 1
        served.wait_idle(timeout=_HOLD_S + 10)
    finally:
        let_go.set()
        served.engine_call(lambda e: delattr(e.runner, "execute"))
        served.wait_idle(timeout=_HOLD_S + 10)  # a failure above leaves no request running into the next test
    assert served.metric('edgemoe_requests_total{finish_reason="abort"}') == aborted + 1
    assert served.engine_call(lambda e: e.runner.kv_free_tokens() == e.runner.kv_capacity_tokens)
    assert served.metric("edgemoe_num_requests_running") == 0
    ok = served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **GREEDY)
    assert ok.choices[0].finish_reason == "length"


def test_client_disconnect_non_streaming_frees_request(served):
    aborted = served.metric('edgemoe_requests_total{finish_reason="abort"}')
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base + "/v1/chat/completions", json=body, timeout=0.5)
    served.wait_idle(timeout=10)
    assert served.metric('edgemoe_requests_total{finish_reason="abort"}') == aborted + 1


# ---------------------------------------------------------------- reasoning / Qwen3 tokenizer


def test_reasoning_splitter_streaming_matches_whole():
    text = "<think>\nLet me think: 2+2 is\n\n4.\n</think>\n\nThe answer is 4. <think> stays"
    whole = split_reasoning(text)
    assert whole == ("Let me think: 2+2 is\n\n4.", "The answer is 4. <think> stays")
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 8))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = ReasoningSplitter()
        parts = [s.feed(p) for p in pieces] + [s.flush()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == whole
    assert split_reasoning("Plain answer.") == (None, "Plain answer.")
    assert split_reasoning("Still thinking\n</think>\nDone", start_in_reasoning=True) == ("Still thinking", "Done")
    assert split_reasoning("<think>cut off by max_tokens") == ("cut off by max_tokens", None)
    assert prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n")


SCRIPT = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is **4** — certainly."


def _scripted(runner, script_ids: list[int], eos: int):
    """Make ``runner`` emit ``script_ids`` then ``eos`` (it still computes the real step for KV)."""
    real = runner.execute
    prompt_len: dict[int, int] = {}

    def execute(inputs, phase):
        logits = real(inputs, phase)
        forced = torch.full_like(logits, float("-inf"))
        for row, inp in enumerate(inputs):
            if phase is Phase.PREFILL and inp.seq_id not in prompt_len:  # may start after a cached prefix
                prompt_len[inp.seq_id] = inp.start_pos + len(inp.token_ids)
            k = inp.start_pos + len(inp.token_ids) - prompt_len[inp.seq_id]
            forced[row, script_ids[k] if k < len(script_ids) else eos] = 0.0
        return forced

    runner.execute = execute
    return runner


@pytest.fixture(scope="module")
def qwen_served(qwen3_tokenizer_model_dir) -> Iterator[Served]:
    from transformers import AutoTokenizer

    from edgemoe.engine.model_runner import ModelRunner

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_model_dir))
    script = tok.encode(SCRIPT, add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def factory():
        runner = ModelRunner(str(qwen3_tokenizer_model_dir), EngineConfig(device="cpu", max_model_len=1024),
                             progress=False)
        assert eos in runner.eos_token_ids
        return _scripted(runner, script, eos)

    llm = AsyncLLM(str(qwen3_tokenizer_model_dir), runner_factory=factory)
    assert llm.wait_ready(120)
    try:
        with running_server(llm, "qwen3-tiny") as base:
            yield Served(base, llm, _client(base))
    finally:
        llm.shutdown()


def test_qwen3_chat_template_rendering(qwen_served):
    tok = qwen_served.llm.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text, ids = render_chat(tok, messages)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == text
    no_think, _ = render_chat(tok, messages, chat_template_kwargs={"enable_thinking": False})
    assert no_think == text + "<think>\n\n</think>\n\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    assert render_chat(tok, parts)[0].endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert "<tools>" in render_chat(tok, messages, tools=tools)[0]


def test_qwen3_reasoning_content(qwen_served):
    c = qwen_served.client
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = c.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=200, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert msg.model_extra["reasoning_content"] == "The user asks 2+2. That is 4."
    assert msg.content == "The answer is **4** — certainly."
    script_len = len(qwen_served.llm.tokenizer.encode(SCRIPT, add_special_tokens=False))
    assert r.usage.completion_tokens == script_len + 1  # + <|im_end|>

    chunks = list(c.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=200, temperature=0,
                                            stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == "The user asks 2+2. That is 4." and content == msg.content
    assert all("<think>" not in (d.content or "") for d in deltas)

    # With thinking disabled the template closes the block in the prompt; a model that then still
    # emits a think block gets it split all the same.
    r = c.chat.completions.create(
        model="qwen3-tiny", messages=messages, max_tokens=200, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].message.content == "The answer is **4** — certainly."
    # max_tokens inside the think block: everything is reasoning, content is null.
    r = c.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    assert r.choices[0].message.model_extra["reasoning_content"]


# ---------------------------------------------------------------- generation_config.json defaults


@pytest.fixture(scope="module")
def sampling_defaults_served(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    """The tiny model with temperature / top_p / top_k / repetition_penalty defaults in its generation_config.json."""
    import json
    import shutil

    model = tmp_path_factory.mktemp("gen_defaults") / "tiny"
    shutil.copytree(tiny_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                              "repetition_penalty": 2.0}))
    llm = AsyncLLM(str(model), EngineConfig(device="cpu", max_model_len=1024), progress=False)
    assert llm.wait_ready(120)
    try:
        with running_server(llm, "tiny") as base:
            yield Served(base, llm, _client(base))
    finally:
        llm.shutdown()


def test_generation_config_defaults_fill_omitted_fields(sampling_defaults_served):
    from edgemoe.server.protocol import sampling_kwargs

    c = sampling_defaults_served.client

    def text(**fields) -> str:
        r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, seed=7,
                                      extra_body={"ignore_eos": True, **fields.pop("extra", {})}, **fields)
        return r.choices[0].message.content

    omitted = text()
    # the checkpoint's defaults
    assert omitted == text(temperature=0.6, top_p=0.95, extra={"top_k": 20, "repetition_penalty": 2.0})
    assert omitted != text(temperature=1.0, top_p=1.0, extra={"top_k": 0})  # not OpenAI's
    assert omitted != text(extra={"repetition_penalty": 1.0})  # the repetition penalty is one of them
    # The request wins, then generation_config.json, then OpenAI's defaults.
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    no_penalties = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    assert sampling_kwargs(defaults, temperature=None, top_p=0.5, top_k=None, max_tokens=3) == {
        "temperature": 0.6, "top_p": 0.5, "top_k": 20, "max_tokens": 3, **no_penalties}
    assert sampling_kwargs({}, temperature=None, top_p=None, top_k=None) == {"temperature": 1.0, "top_p": 1.0,
                                                                             "top_k": 0, **no_penalties}
