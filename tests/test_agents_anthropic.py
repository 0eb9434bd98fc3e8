"""The Anthropic Messages API as Claude Code uses it, through the official ``anthropic`` SDK against
a real server (real Qwen3 tokenizer and template; recorded outputs replayed through the engine, see
``ScriptedOutputs`` in conftest.py), plus API-key checks for every API."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from test_agents_openai import PARALLEL, TURN1, TURN3

from edgemoe.engine.llm import render_chat

from conftest import start_agent_server

MODEL = "qwen3-tiny"
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
    },
    {
        "name": "get_time",
        "description": "Local time in a time zone.",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    },
]
SYSTEM = [{"type": "text", "text": "You are Claude Code, a coding agent."},
          {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}]
USER = {"role": "user", "content": [{"type": "text", "text": "What's the weather in Paris?"}]}


@pytest.fixture
def server(qwen_agent_server):
    yield qwen_agent_server
    qwen_agent_server.scripts.queue.clear()
    qwen_agent_server.wait_idle()


def _events(server, body: dict) -> list[tuple[str, dict]]:
    """The raw SSE events (name, data) of a streamed /v1/messages call."""
    events = []
    with httpx.stream("POST", server.base + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_tool_use_with_thinking(server):
    client = server.anthropic()
    server.scripts.push(TURN1)
    msg = client.messages.create(model=MODEL, max_tokens=300, system=SYSTEM, messages=[USER], tools=TOOLS,
                                 metadata={"user_id": "u1"})
    assert msg.stop_reason == "tool_use" and msg.role == "assistant" and msg.type == "message"
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "The user wants the weather in Paris. I should call get_weather."
    assert msg.content[1].text == "I'll look that up."
    use = msg.content[2]
    assert (use.id.startswith("toolu_") and use.name == "get_weather"
            and use.input == {"city": "Paris", "unit": "celsius"})
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens == len(server.llm.tokenizer.encode(TURN1)) + 1


def test_streaming_thinking_and_tool_use_event_sequence(server):
    server.scripts.push(TURN1, TURN1)
    body = dict(model=MODEL, max_tokens=300, system=SYSTEM, messages=[USER], tools=TOOLS)
    events = _events(server, body)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    # Each block: start, its deltas (of the block's kind, same index), stop — never interleaved.
    expected_delta = {"thinking": "thinking_delta", "text": "text_delta", "tool_use": "input_json_delta"}
    i = 1
    for s in starts:
        assert events[i] == ("content_block_start", s)
        i += 1
        n_deltas = 0
        while events[i][0] == "content_block_delta":
            assert events[i][1]["index"] == s["index"]
            assert events[i][1]["delta"]["type"] == expected_delta[s["content_block"]["type"]]
            n_deltas += 1
            i += 1
        assert n_deltas >= 1
        assert events[i] == ("content_block_stop", {"type": "content_block_stop", "index": s["index"]})
        i += 1
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0
    assert starts[2]["content_block"]["name"] == "get_weather"
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta" and d["index"] == 2)
    assert json.loads(partial) == {"city": "Paris", "unit": "celsius"}

    # The SDK's own stream accumulator rebuilds the same message.
    with server.anthropic().messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "I'll look that up."
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris", "unit": "celsius"} and final.stop_reason == "tool_use"


def test_three_turn_conversation_with_tool_results_and_thinking(server):
    client, tok = server.anthropic(), server.llm.tokenizer
    server.scripts.push(TURN1, PARALLEL, TURN3)
    messages = [USER]
    first = client.messages.create(model=MODEL, max_tokens=300, system=SYSTEM, messages=messages, tools=TOOLS)
    use = first.content[2]
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]},
    ]
    second = client.messages.create(model=MODEL, max_tokens=300, system=SYSTEM, messages=messages, tools=TOOLS)
    uses = [b for b in second.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather", "get_time"] and second.stop_reason == "tool_use"
    assert uses[1].input == {"timezone": "Asia/Tokyo"} and uses[0].id != uses[1].id
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0].id, "content": [{"type": "text", "text": "22 C"}]},
            {"type": "tool_result", "tool_use_id": uses[1].id, "content": "boom", "is_error": True},
            {"type": "text", "text": "Thanks!"},
        ]},
    ]
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages, tools=TOOLS)
    third = client.messages.create(model=MODEL, max_tokens=300, system=SYSTEM, messages=messages, tools=TOOLS)
    assert third.stop_reason == "end_turn"
    assert third.content[-1].text == "In Paris it is 18 °C and the local time is 14:05."
    assert count.input_tokens == third.usage.input_tokens + third.usage.cache_read_input_tokens
    # The same conversation in OpenAI form renders to exactly these tokens.
    openai_messages = [
        {"role": "system", "content": "You are Claude Code, a coding agent.\n\nBe terse."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "I'll look that up.", "reasoning_content": first.content[0].thinking,
         "tool_calls": [{"id": use.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C, sunny"},
        {"role": "assistant", "content": None, "reasoning_content": second.content[0].thinking,
         "tool_calls": [{"id": u.id, "type": "function",
                         "function": {"name": u.name, "arguments": json.dumps(u.input)}} for u in uses]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "22 C"},
        {"role": "tool", "tool_call_id": uses[1].id, "content": "Error: boom"},
        {"role": "user", "content": "Thanks!"},
    ]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    text, ids = render_chat(tok, openai_messages, tools=tools)
    assert third.usage.input_tokens + third.usage.cache_read_input_tokens == len(ids)
    assert '<tool_response>\n22 C\n</tool_response>\n<tool_response>\nError: boom\n</tool_response>' in text


def test_stop_sequences_max_tokens_and_thinking_switch(server):
    client = server.anthropic()
    server.scripts.push(TURN3, TURN3)
    msg = client.messages.create(model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "hi"}],
                                 stop_sequences=["local time"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "local time"
    assert msg.content[-1].text == "In Paris it is 18 °C and the "
    msg = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                 thinking={"type": "disabled"})
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    with_think = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    without = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           thinking={"type": "disabled"})
    assert without.input_tokens == with_think.input_tokens + len(server.llm.tokenizer.encode("<think>\n\n</think>\n\n"))


def test_structured_output_is_guided_json(server):
    msg = server.anthropic().messages.create(
        model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "JSON"}],
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
    )
    assert isinstance(json.loads(msg.content[0].text), dict) and msg.stop_reason == "end_turn"


def test_errors_in_anthropic_shape(server):
    url = server.base + "/v1/messages"
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error",
                        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(url, json={"model": MODEL, "max_tokens": 5,
                              "messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].content[0].text")
    r = httpx.post(url, json={"model": MODEL, "max_tokens": 5,
                              "messages": [{"role": "user", "content": [{"type": "server_tool_use"}]}]})
    assert r.status_code == 400 and "messages[0].content[0]: 'server_tool_use' blocks" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": MODEL, "max_tokens": 5,
                              "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].content[0].source.type")
    r = httpx.post(url, json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                              "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("temperature")
    with pytest.raises(anthropic.NotFoundError) as info:
        server.anthropic().messages.create(model="claude-opus-4", max_tokens=5,
                                           messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    # Unknown top-level fields are accepted, as the real API does for e.g. `metadata`, `service_tier`.
    server.scripts.push(TURN3)
    ok = httpx.post(url, json={"model": MODEL, "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}],
                               "service_tier": "auto", "container": None, "some_future_field": {"x": 1}})
    assert ok.status_code == 200 and ok.json()["stop_reason"] == "end_turn"


def test_api_key_on_every_api(qwen3_tokenizer_model_dir):
    with start_agent_server(qwen3_tokenizer_model_dir, MODEL, api_key="sekret") as srv:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(srv.base + path, json={}, headers={"x-api-key": "wrong"})
            assert r.status_code == 401 and r.json() == {
                "type": "error", "error": {"type": "authentication_error", "message": "Invalid API key"}}
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/completions"):
            r = httpx.post(srv.base + path, json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.base + "/v1/models").status_code == 401
        assert httpx.get(srv.base + "/health").status_code == 200  # monitoring stays open
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base + "/v1", api_key="nope", max_retries=0).models.list()
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=srv.base, api_key="nope", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        # The right key works through both SDKs (Authorization: Bearer / x-api-key).
        assert srv.openai().models.list().data[0].id == MODEL
        counted = srv.anthropic().messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert counted.input_tokens > 0
