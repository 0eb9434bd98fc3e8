"""OpenAI chat completions and Responses as coding agents use them, through the official ``openai``
SDK against a real server with the real Qwen3 tokenizer and chat template.

The test model has random weights, so the assistant turns are recorded Qwen3 outputs replayed token
by token through the real engine (``ScriptedOutputs`` in conftest.py): request → chat template →
tokens → prefill/decode → detokenizer → parser → API response.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from edgemoe.engine.llm import render_chat

MODEL = "qwen3-tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"},
                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a time zone.",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
        },
    },
]
TURN1 = (
    "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
    "I'll look that up.\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)
TURN2 = (
    "<think>\nIt is 18 degrees. Now the time.\n</think>\n\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
)
TURN3 = "<think>\nI have both answers.\n</think>\n\nIn Paris it is 18 °C and the local time is 14:05."
PARALLEL = (
    "<think>\nTwo independent lookups.\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>'
)
USER = {"role": "user", "content": "What's the weather in Paris, and what time is it there?"}


@pytest.fixture
def server(qwen_agent_server):
    yield qwen_agent_server
    qwen_agent_server.scripts.queue.clear()
    qwen_agent_server.wait_idle()


def test_three_turn_tool_conversation(server):
    client, tok = server.openai(), server.llm.tokenizer
    server.scripts.push(TURN1, TURN2, TURN3)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, USER]

    r1 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    m1 = r1.choices[0]
    assert m1.finish_reason == "tool_calls"
    assert m1.message.content == "I'll look that up."
    assert m1.message.model_extra["reasoning_content"] == ("The user wants the weather in Paris. "
                                                           "I should call get_weather.")
    (call1,) = m1.message.tool_calls
    assert call1.id.startswith("call_") and call1.type == "function"
    assert call1.function.name == "get_weather"
    assert json.loads(call1.function.arguments) == {"city": "Paris", "unit": "celsius"}
    # The prompt the server built is exactly the template's rendering with the tools.
    assert r1.usage.prompt_tokens == len(render_chat(tok, messages, tools=TOOLS)[1])

    # Turn 2: the agent sends the history back (assistant with tool_calls and content, tool result).
    messages += [
        m1.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call1.id, "content": '{"temperature": 18, "unit": "celsius"}'},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    (call2,) = r2.choices[0].message.tool_calls
    assert r2.choices[0].message.content is None
    assert call2.function.name == "get_time" and json.loads(call2.function.arguments) == {"timezone": "Europe/Paris"}
    assert call2.id != call1.id
    text, ids = render_chat(tok, chat_messages_for_template(messages), tools=TOOLS)
    assert r2.usage.prompt_tokens == len(ids)
    # The history was rendered the Qwen3 way: the call, the tool response, the reasoning kept.
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>') in text
    assert '<tool_response>\n{"temperature": 18, "unit": "celsius"}\n</tool_response>' in text
    assert "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>" in text

    # Turn 3: the final answer, no tool call.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call2.model_dump()],
         "reasoning_content": r2.choices[0].message.model_extra["reasoning_content"]},
        {"role": "tool", "tool_call_id": call2.id, "content": "14:05"},
    ]
    r3 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    assert r3.choices[0].finish_reason == "stop" and r3.choices[0].message.tool_calls is None
    assert r3.choices[0].message.content == "In Paris it is 18 °C and the local time is 14:05."
    assert r3.usage.prompt_tokens == len(render_chat(tok, chat_messages_for_template(messages), tools=TOOLS)[1])


def chat_messages_for_template(messages: list[dict]) -> list[dict]:
    """What the server hands the template: OpenAI messages with extra SDK fields dropped."""
    from edgemoe.server.openai_api import chat_messages
    from edgemoe.server.protocol import ChatMessageParam

    return chat_messages([ChatMessageParam.model_validate(m) for m in messages])


def test_streamed_tool_call_deltas_reassembled_by_sdk(server):
    client = server.openai()
    server.scripts.push(TURN1, TURN1)
    kw = dict(model=MODEL, messages=[USER], tools=TOOLS, temperature=0)
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert msg.content == "I'll look that up."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    # The raw chunks: arguments arrive in several deltas, the id and name only on the first one.
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 3
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert all(d.index == 0 for d in deltas)
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Paris", "unit": "celsius"}'
    reasoning = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for ch in chunks if ch.choices)
    assert reasoning == "The user wants the weather in Paris. I should call get_weather."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls(server):
    client = server.openai()
    server.scripts.push(PARALLEL, PARALLEL)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather and time in Tokyo?"}], tools=TOOLS,
              temperature=0)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in msg.tool_calls}) == 2 and msg.content is None
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.tool_calls] == [
        ("get_weather", {"city": "Tokyo"}),
        ("get_time", {"timezone": "Asia/Tokyo"}),
    ]


def test_parallel_tool_calls_false_keeps_only_the_first_call(server):
    """``parallel_tool_calls: false`` (Anthropic: ``disable_parallel_tool_use``) asks for at most one call: a
    model that writes two gets only its first returned, whole and streamed, in all three APIs."""
    client = server.openai()
    messages = [{"role": "user", "content": "Weather and time in Tokyo?"}]
    server.scripts.push(*[PARALLEL] * 6)
    kw = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.tool_calls] == [
        ("get_weather", {"city": "Tokyo"})]
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    rkw = dict(model=MODEL, input="Weather and time in Tokyo?", tools=tools, temperature=0, parallel_tool_calls=False)
    resp = client.responses.create(**rkw)
    assert [o.name for o in resp.output if o.type == "function_call"] == ["get_weather"]
    with client.responses.stream(**rkw) as s:
        final_resp = s.get_final_response()
    assert [o.name for o in final_resp.output if o.type == "function_call"] == ["get_weather"]
    a_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    akw = dict(model=MODEL, max_tokens=400, messages=messages, tools=a_tools,
               tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    msg = server.anthropic().messages.create(**akw)
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["get_weather"] and msg.stop_reason == "tool_use"
    with server.anthropic().messages.stream(**akw) as s:
        final_msg = s.get_final_message()
    assert [b.name for b in final_msg.content if b.type == "tool_use"] == ["get_weather"]


def test_tool_choice_none_returns_markup_as_text(server):
    client = server.openai()
    server.scripts.push(TURN1)
    r = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, tool_choice="none", temperature=0)
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "<tool_call>" in msg.content  # not parsed: the model was told no tools


def test_tool_choice_required_and_named_are_guided(server):
    """No script: the random-weight model's own logits, constrained to a well-formed call."""
    client = server.openai()
    messages = [{"role": "user", "content": "Use a tool."}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40, temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments), dict)
    assert r.choices[0].finish_reason == "tool_calls"
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=40, temperature=0.8, seed=3)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.param == "tool_choice"


def test_json_mode_is_guided(server):
    client = server.openai()
    for seed in (0, 1):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
            response_format={"type": "json_object"}, max_tokens=30, temperature=1.0, seed=seed,
        )
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        assert r.choices[0].finish_reason == "stop"


def test_reasoning_content_in_history_and_generation_defaults(server, qwen3_tokenizer_model_dir):
    client, tok = server.openai(), server.llm.tokenizer
    server.scripts.push(TURN3)
    messages = [USER, {"role": "assistant", "content": "Checking.", "reasoning_content": "Think about Paris."},
                {"role": "user", "content": "And now?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert r.usage.prompt_tokens == len(render_chat(tok, messages)[1])
    # A later turn than the last user query keeps its reasoning in the template: vLLM's `reasoning` too.
    hist = [USER, {"role": "assistant", "content": "Checking.", "reasoning": "Think about Paris."}]
    text = render_chat(tok, chat_messages_for_template(hist))[0]
    assert "<think>\nThink about Paris.\n</think>" in text


def test_wrong_types_name_the_field(server):
    url = server.base + "/v1/chat/completions"
    r = httpx.post(url, json={"model": MODEL, "messages": [USER],
                              "tools": [{"type": "function", "function": {"name": 3}}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools[0].function.name")
    r = httpx.post(url, json={"model": MODEL, "messages": [USER], "tool_choice": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]})
    assert r.status_code == 400 and "messages[0].tool_calls[0].function.name" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/v1/responses",
                   json={"model": MODEL, "input": [{"type": "function_call", "name": "x"}]})
    assert r.status_code == 400 and "input[0].call_id" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


# ---------------------------------------------------------------- Responses API


def test_responses_function_calls_and_reasoning(server):
    client = server.openai()
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    server.scripts.push(TURN1, TURN1, TURN3)
    r = client.responses.create(model=MODEL, input="What's the weather in Paris?", tools=tools, temperature=0)
    assert r.status == "completed"
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "The user wants the weather in Paris. I should call get_weather."
    assert r.output_text == "I'll look that up."
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}

    with client.responses.stream(model=MODEL, input="What's the weather in Paris?", tools=tools, temperature=0) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    for t in ("response.reasoning_text.delta", "response.output_text.delta", "response.function_call_arguments.delta",
              "response.function_call_arguments.done", "response.output_item.done"):
        assert t in types
    assert [o.type for o in final.output] == kinds
    assert final.output[2].arguments == call.arguments and final.output_text == r.output_text

    # Turn 2 (Codex style, stateless): the whole history with the call and its output.
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "reasoning", "id": r.output[0].id, "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    r2 = client.responses.create(model=MODEL, input=history, tools=tools, instructions="Be brief.", temperature=0)
    assert r2.output_text == "In Paris it is 18 °C and the local time is 14:05."
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_x")
    assert info.value.param == "previous_response_id"


def test_responses_incomplete_and_json(server):
    client = server.openai()
    server.scripts.push(TURN3)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    r = client.responses.create(model=MODEL, input="JSON please", text={"format": {"type": "json_object"}},
                                max_output_tokens=30, temperature=0)
    assert isinstance(json.loads(r.output_text), dict)
