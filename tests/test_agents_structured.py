"""Structured output through the grammar engine, with the random-weight model's own logits (no script):
the grammar alone must make the output valid. Real Qwen3 tokenizer and template, real SDKs, ``parse()``
included."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from test_agents_openai import MODEL, TOOLS


class Address(BaseModel):
    city: str
    zip_code: str


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int
    role: Literal["admin", "user", "guest"]
    tags: list[str] = Field(max_length=3)
    address: Address


@pytest.fixture
def server(qwen_agent_server):
    yield qwen_agent_server
    qwen_agent_server.scripts.queue.clear()
    qwen_agent_server.wait_idle()


def _schema_of(tools: list[dict], name: str) -> dict:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chat_completions_parse_succeeds(server, seed):
    client = server.openai()
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                      response_format=Person, max_tokens=160, temperature=1.0, seed=seed)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.role in ("admin", "user", "guest")
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 160


def test_json_object_mode_and_streaming(server):
    client = server.openai()
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "JSON"}], "response_format": {"type": "json_object"},
              "max_tokens": 40, "temperature": 1.0, "seed": 5}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    assert isinstance(json.loads(whole), dict)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == whole  # same seed, same constrained tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_responses_parse_succeeds(server, seed):
    r = server.openai().responses.parse(model=MODEL, input="Describe a person.", text_format=Person,
                                        max_output_tokens=160, temperature=1.0, extra_body={"seed": seed})
    assert isinstance(r.output_parsed, Person) and r.status == "completed"


def test_anthropic_output_config_follows_the_schema(server):
    msg = server.anthropic().messages.create(
        model=MODEL, max_tokens=160, messages=[{"role": "user", "content": "A person, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": Person.model_json_schema()}})
    assert msg.stop_reason == "end_turn"
    Person.model_validate_json(msg.content[0].text)


@pytest.mark.parametrize("seed", range(3))
def test_forced_tool_calls_follow_parameters(server, seed):
    client = server.openai()
    messages = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=1.0, seed=seed)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    schema = _schema_of(TOOLS, call.function.name)
    assert set(schema["required"]) <= set(args) and set(args) <= set(schema["properties"])
    if "unit" in args:
        assert args["unit"] in ("celsius", "fahrenheit")
    assert r.choices[0].finish_reason == "tool_calls"
    # Anthropic's forced tool_choice, with the same guarantee.
    atools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    msg = server.anthropic().messages.create(model=MODEL, max_tokens=80, messages=messages, tools=atools,
                                             tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and "city" in use.input and msg.stop_reason == "tool_use"


def test_strict_tool_under_auto_constrains_only_the_call(server):
    """The recorded output starts a call with an argument the strict schema forbids: the text before
    the call is the model's, the call itself follows ``parameters``."""
    client = server.openai()
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True,
                                               "parameters": {**TOOLS[0]["function"]["parameters"],
                                                              "additionalProperties": False}}}]
    server.scripts.push('I will check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n'
                        '</tool_call>')
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=tools, max_tokens=120, temperature=0, extra_body={
                                           "chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert msg.content == "I will check."
    (call,) = msg.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and "city" in args and "town" not in args
    assert set(args) <= {"city", "unit"}


def test_a_budget_too_small_for_the_grammar_is_400(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=5)
    assert info.value.param == "max_tokens" and "forced tool call" in info.value.message
    r = httpx.post(server.base + "/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 4,
                                                        "text": {"format": {"type": "json_schema", "name": "p",
                                                                            "schema": Person.model_json_schema()}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_a_schema_the_engine_cannot_compile_is_400(server):
    r = httpx.post(server.base + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
