"""Model names and shapes (aliases, ``GET /v1/models[/{id}]`` for both SDKs), the default output cap,
a template whose generation prompt opens a think block, and the gauges an inference gateway scrapes.
Real uvicorn server over the tiny model (built-in tokenizer), real ``openai`` / ``anthropic`` SDKs."""

from __future__ import annotations

import json
import shutil
import threading
import time

import anthropic
import httpx
import openai
import pytest

from edgemoe.config import EngineConfig
from edgemoe.engine.async_engine import AsyncLLM
from edgemoe.server.config import ServerConfig
from edgemoe.server.serving import DEFAULT_OUTPUT_CAP, Serving

from conftest import ScriptedOutputs, running_server

NAMES = ("tiny", "claude-sonnet-4-5", "claude-haiku-4-5")
MESSAGES = [{"role": "user", "content": "Hello there."}]


def _variant(tiny_model_dir, tmp_path_factory, name: str, generation: dict | None = None, template_tail: str = ""):
    """A copy of the tiny checkpoint with ``generation`` merged into generation_config.json and
    ``template_tail`` appended to the generation prompt of its chat template."""
    model = tmp_path_factory.mktemp(name) / "tiny"
    shutil.copytree(tiny_model_dir, model)
    if generation:
        gen = json.loads((model / "generation_config.json").read_text())
        (model / "generation_config.json").write_text(json.dumps({**gen, **generation}))
    if template_tail:
        path = model / "chat_template.jinja"
        text = path.read_text()
        head = "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}"
        assert text.count(head) == 1
        path.write_text(text.replace(head, head + "{{- '" + template_tail + "' }}"))
    return model


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """Three names; generation_config.json caps output at 6 tokens; the generation prompt opens a think block."""
    model = _variant(tiny_model_dir, tmp_path_factory, "models", {"max_new_tokens": 6}, "<think>\\n")
    llm = AsyncLLM(str(model), EngineConfig(device="cpu", max_model_len=1024), progress=False)
    assert llm.wait_ready(120)
    scripts = ScriptedOutputs(llm.tokenizer, min(llm.engine.eos_token_ids))
    llm.call_in_engine_thread(scripts.install, timeout=30)
    try:
        with running_server(llm, NAMES) as base:
            yield base, llm, scripts
    finally:
        llm.shutdown()


def _clients(base: str):
    return (openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60))


def test_aliases_are_accepted_and_the_first_is_reported(served):
    base, _, _ = served
    oai, ant = _clients(base)
    for name in NAMES:
        r = oai.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert r.model == "tiny"
        m = ant.messages.create(model=name, max_tokens=2, messages=MESSAGES)
        assert m.model == "tiny"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="claude-opus-4", messages=MESSAGES, max_tokens=2)


def test_models_in_both_shapes(served):
    base, llm, _ = served
    oai, ant = _clients(base)
    models = oai.models.list()
    assert [m.id for m in models.data] == list(NAMES) and all(m.object == "model" for m in models.data)
    assert models.data[0].model_extra["max_model_len"] == 1024
    assert models.data[0].model_extra["type"] == "model" and models.data[0].model_extra["display_name"] == "tiny"
    one = oai.models.retrieve("claude-haiku-4-5")
    assert one.id == "claude-haiku-4-5" and one.object == "model" and one.owned_by == "edgemoe"
    page = ant.models.list()
    assert [m.id for m in page.data] == list(NAMES) and page.has_more is False and page.first_id == "tiny"
    info = ant.models.retrieve("claude-sonnet-4-5")
    assert info.type == "model" and info.id == "claude-sonnet-4-5" and info.display_name == "claude-sonnet-4-5"
    assert info.created_at.year >= 2024
    raw = httpx.get(base + "/v1/models/claude-sonnet-4-5", headers={"anthropic-version": "2023-06-01"}).json()
    assert set(raw) == {"type", "id", "display_name", "created_at"}
    with pytest.raises(openai.NotFoundError) as oinfo:
        oai.models.retrieve("gpt-4o")
    assert oinfo.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as ainfo:
        ant.models.retrieve("claude-opus-4")
    assert ainfo.value.body["error"]["type"] == "not_found_error"
    assert oai.models.retrieve(str(llm.model_dir)).id == "tiny"  # the directory is accepted as a name too


def test_default_output_cap(served, tiny_model_dir):
    base, _, _ = served
    oai, _ = _clients(base)
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"  # generation_config.json
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=9, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 9  # the request wins
    r = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "hi", "ignore_eos": True}).json()
    assert r["usage"]["output_tokens"] <= 6 and r["status"] in ("incomplete", "completed")
    # --default-max-tokens wins over the checkpoint.
    llm = AsyncLLM(str(tiny_model_dir), EngineConfig(device="cpu", max_model_len=512), progress=False)
    try:
        assert llm.wait_ready(120)
        # Neither the flag nor generation_config.json (the tiny checkpoint's has no max_new_tokens): 8192.
        assert "max_new_tokens" not in llm.generation_config
        assert Serving(llm, ServerConfig()).default_max_tokens == DEFAULT_OUTPUT_CAP == 8192
        with running_server(llm, "tiny", default_max_tokens=4) as base2:
            r = _clients(base2)[0].chat.completions.create(model="tiny", messages=MESSAGES,
                                                           extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 4
    finally:
        llm.shutdown()


def test_a_generation_prompt_that_opens_a_think_block(served):
    """The template ends its generation prompt with ``<think>\\n`` (as thinking-only models' templates do):
    the output starts in reasoning, while a ``<think>`` the user typed elsewhere changes nothing."""
    base, _, scripts = served
    oai, _ = _clients(base)
    scripts.push("Let me see.\n</think>\n\nSure.")
    messages = [{"role": "user", "content": "Say </think> and then <think> please."}]
    r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=30)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Let me see." and msg.content == "Sure."


def _gauges(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_gateway_gauges(served):
    base, llm, _ = served
    g = _gauges(base)
    total = g["edgemoe_kv_cache_pages_total"]
    assert total == llm.engine.runner.kv_capacity_tokens // 16 and g["edgemoe_kv_cache_pages_used"] == 0
    assert g['vllm:num_requests_running{model_name="tiny"}'] == 0 == g['vllm:num_requests_waiting{model_name="tiny"}']
    assert g['vllm:kv_cache_usage_perc{model_name="tiny"}'] == 0 == g['vllm:gpu_cache_usage_perc{model_name="tiny"}']
    assert g[f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{int(total)}"}}'] == 1
    done = threading.Event()

    def long_request():
        oai, _ = _clients(base)
        oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, extra_body={"ignore_eos": True})
        done.set()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while not llm.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    g = _gauges(base)
    assert g['vllm:num_requests_running{model_name="tiny"}'] == 1 == g["edgemoe_num_requests_running"]
    used = g["edgemoe_kv_cache_pages_used"]
    assert used >= 1 and g['vllm:kv_cache_usage_perc{model_name="tiny"}'] == pytest.approx(used / total)
    t.join(60)
    assert done.is_set()
    assert _gauges(base)["edgemoe_kv_cache_pages_used"] == 0  # finished: its pages are cached, hence free
