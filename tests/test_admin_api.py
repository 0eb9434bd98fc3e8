"""Elastic expert-cache budget over HTTP (``/admin/expert-cache``): the cache is resized between steps
of a running server, requests keep their exact results, bad bodies (and a GPU size on the CPU) are
400s, the API key guards it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from edgemoe.config import EngineConfig
from edgemoe.engine.async_engine import AsyncLLM

from conftest import running_server

MESSAGES = [{"role": "user", "content": "Tell me about caches."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), EngineConfig(device="cpu", dtype="float32", expert_cache_slots=4,
                                                     expert_policy="fill-all", cpu_executor="torch",
                                                     max_model_len=1024), progress=False)
    assert llm.wait_ready(120)
    try:
        with running_server(llm, "tiny") as base:
            yield base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        llm.shutdown()


def _greedy(client) -> str:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    return r.choices[0].message.content


def test_resize_between_requests_keeps_results(served):
    base, client = served
    state = httpx.get(base + "/admin/expert-cache").json()
    assert state["slots"] == 4 and state["policy"] == "fill-all"
    before = _greedy(client)
    r = httpx.post(base + "/admin/expert-cache", json={"slots": 9, "policy": "qstar"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["slots"] == 9 and r.json()["policy"] == "qstar"
    assert _greedy(client) == before  # the cache only changes speed
    row = r.json()["experts_total"]
    r = httpx.post(base + "/admin/expert-cache", json={"slots": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["slots"] == 0 and r.json()["policy"] == "qstar"
    assert _greedy(client) == before  # every expert on the CPU executor now
    r = httpx.post(base + "/admin/expert-cache", json={"slots": row * 10}, timeout=60)
    assert r.json()["slots"] == row  # capped at the number of experts: all resident
    assert _greedy(client) == before


@pytest.mark.parametrize("body", [{"gb": 6}, {"gb": 0}])
def test_a_gpu_budget_on_the_cpu_is_400(served, body):
    base, _ = served
    before = httpx.get(base + "/admin/expert-cache").json()["slots"]
    r = httpx.post(base + "/admin/expert-cache", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "not a GPU" in r.json()["error"]["message"] and r.json()["error"]["param"] == "gb"
    assert httpx.get(base + "/admin/expert-cache").json()["slots"] == before


@pytest.mark.parametrize("body", [{}, {"slots": -1}, {"gb": 1, "slots": 2}, {"policy": "fastest"}, {"size": 3},
                                  '{"gb": NaN}', {"slots": True}, {"slots": "2"}])  # the last two were 1 and 2 slots
def test_bad_resize_requests_are_400_and_change_nothing(served, body):
    base, _ = served
    before = httpx.get(base + "/admin/expert-cache").json()["slots"]
    raw = body if isinstance(body, str) else json.dumps(body)  # NaN: not JSON, but Python's parser takes it
    r = httpx.post(base + "/admin/expert-cache", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert httpx.get(base + "/admin/expert-cache").json()["slots"] == before


def test_admin_routes_need_the_api_key(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), EngineConfig(device="cpu", cpu_executor="torch", max_model_len=512),
                   progress=False)
    assert llm.wait_ready(120)
    try:
        with running_server(llm, "tiny", api_key="s3cret") as base:
            assert httpx.get(base + "/admin/expert-cache").status_code == 401
            r = httpx.post(base + "/admin/expert-cache", json={"slots": 2}, headers={"x-api-key": "s3cret"}, timeout=60)
            assert r.status_code == 200 and r.json()["slots"] == 2
    finally:
        llm.shutdown()


def test_resize_rejects_an_unknown_policy_before_touching_the_cache(tiny_model_dir):
    from edgemoe.engine.model_runner import ModelRunner

    runner = ModelRunner(str(tiny_model_dir), EngineConfig(device="cpu", cpu_executor="torch", expert_cache_slots=3),
                         progress=False)
    cache = runner.experts.cache
    with pytest.raises(ValueError, match="unknown expert policy"):
        runner.resize_expert_cache(slots=5, policy="fastest")
    assert runner.experts.cache is cache and runner.experts.cache is cache
