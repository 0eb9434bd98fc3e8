"""GLM-4.5 tool calls: the ``glm45`` parser (every streaming split), its automatic choice, and multi-turn
tool-calling conversations through the three HTTP APIs (OpenAI chat completions, Responses, Anthropic
Messages) with the official SDKs against a real server.

The server runs the tiny ``glm4_moe`` preset with the tokenizer make-model builds for GLM (GLM-4.5's
role, reasoning and tool-call tokens and the chat template released with GLM-4.5). The model has random
weights, so the assistant turns are recorded outputs in GLM's markup replayed token by token through
the real engine (``ScriptedOutputs`` in conftest.py).
"""

from __future__ import annotations

import json

import pytest
from test_agents_openai import chat_messages_for_template
from test_agents_parsers import _feed, parse_all_ways

from edgemoe.engine.llm import render_chat
from edgemoe.server.parsers import ParserConfig, ToolCall, detect_parsers
from edgemoe.server.parsers.glm45 import Glm45ToolParser

from conftest import start_agent_server

MODEL = "glm-tiny"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a time zone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
    {"type": "function", "function": {
        "name": "run", "parameters": {"type": "object", "properties": {
            "cmd": {"type": "string"}, "timeout": {"type": "integer"}, "dry": {"type": "boolean"},
            "env": {"type": "object"}, "args": {"type": "array"}, "note": {"type": ["string", "null"]}}}}},
]
PROMPT = "[gMASK]<sop><|user|>\nhi<|assistant|>"  # GLM's generation prompt leaves no think block open


def glm(tools=TOOLS, reasoning="think"):
    cfg = ParserConfig("glm45", reasoning)
    return lambda: cfg.build(PROMPT, tools)


# ---------------------------------------------------------------- the parser


def test_glm45_calls_with_reasoning_typed_by_schema():
    text = (
        "\n<think>Two calls are needed.</think>\nChecking both.\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Saint-\"Étienne\"\n<east></arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
        "<tool_call>run\n<arg_key>cmd</arg_key>\n<arg_value>ls -la | grep '{x}'</arg_value>\n"
        "<arg_key>timeout</arg_key>\n<arg_value>30</arg_value>\n<arg_key>dry</arg_key>\n<arg_value>false</arg_value>\n"
        "<arg_key>env</arg_key>\n<arg_value>{\"A\": \"1\"}</arg_value>\n<arg_key>args</arg_key>\n<arg_value>[1, \"b\"]"
        "</arg_value>\n<arg_key>note</arg_key>\n<arg_value>42</arg_value>\n<arg_key>extra</arg_key>\n"
        "<arg_value>7</arg_value>\n<arg_key>other</arg_key>\n<arg_value>plain words</arg_value>\n</tool_call>"
    )
    out = parse_all_ways(glm(), text)
    assert out.reasoning == "Two calls are needed." and out.content == "Checking both."
    assert [c.name for c in out.tool_calls] == ["get_weather", "run"]
    assert json.loads(out.tool_calls[0].arguments) == {"city": 'Saint-"Étienne"\n<east>', "days": 3}
    # declared strings stay strings ("42" for a string-or-null), the rest is JSON where it parses
    assert json.loads(out.tool_calls[1].arguments) == {
        "cmd": "ls -la | grep '{x}'", "timeout": 30, "dry": False, "env": {"A": "1"}, "args": [1, "b"],
        "note": "42", "extra": 7, "other": "plain words"}


def test_glm47_compact_markup_and_calls_without_arguments():
    text = ("<tool_call>get_time<arg_key>timezone</arg_key><arg_value>Asia/Tokyo</arg_value></tool_call>"
            "<tool_call>list_files</tool_call>\n\n<tool_call>get_weather\n</tool_call>")
    out = parse_all_ways(glm(), text)
    assert out.content is None
    assert out.tool_calls == [ToolCall(0, "get_time", '{"timezone": "Asia/Tokyo"}'), ToolCall(1, "list_files", "{}"),
                              ToolCall(2, "get_weather", "{}")]


def test_string_values_stream_in_pieces():
    text = "<tool_call>run<arg_key>cmd</arg_key><arg_value>echo a long command line</arg_value></tool_call>"
    _, events = _feed(glm(), list(text))
    calls = [e for e in events if e.kind == "tool_call"]
    assert calls[0].name == "run" and len(calls) > 10  # the value arrives while it is written
    assert "".join(e.text for e in calls) == '{"cmd": "echo a long command line"}'
    assert json.loads("".join(e.text for e in calls))


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("a <tool_c", "a <tool_c", []),  # half a tag at the end is text
        ("<tool_call>not a call at all", "<tool_call>not a call at all", []),
        ("x <tool_call>f\n<oops>", "x <tool_call>f\n<oops>", []),  # a name, then neither a key nor the end
        ("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value> tail", " tail", [ToolCall(0, "f", '{"a": 1}')]),
        ("<tool_call>f<arg_key>a</arg_key>oops</tool_call>", "<arg_key>a</arg_key>oops</tool_call>",
         [ToolCall(0, "f", "{}")]),  # a key without its value: the call ends, the markup is text
        ("<tool_call>get_time<arg_key>timezone</arg_key><arg_value>UTC</tool_call>ok", "ok",
         [ToolCall(0, "get_time", '{"timezone": "UTC"}')]),  # </arg_value> missing
        ("<tool_call>get_time<arg_key>timezone</arg_key><arg_value>Europe/Pa", None,
         [ToolCall(0, "get_time", '{"timezone": "Europe/Pa"}')]),  # cut by max_tokens inside a value
        ("<tool_call>run<arg_key>timeout</arg_key><arg_value>1", None, [ToolCall(0, "run", '{"timeout": 1}')]),
        ("<tool_call>run<arg_key>timeout</arg_key><arg_value>soon</arg_value></tool_call>", None,
         [ToolCall(0, "run", '{"timeout": "soon"}')]),  # not JSON: the raw text
        ("<tool_call>get_time\n<arg_key>timez", None, [ToolCall(0, "get_time", "{}")]),  # cut inside a key
    ],
)
def test_malformed_markup_is_text(text, content, calls):
    out = parse_all_ways(glm(), text)
    assert out.content == content and out.tool_calls == calls
    assert all(isinstance(json.loads(c.arguments), dict) for c in out.tool_calls)


def test_calls_inside_reasoning_are_reasoning_and_no_tools_means_text():
    out = parse_all_ways(glm(), "<think>maybe <tool_call>f</tool_call> later</think>Fine.")
    assert out.reasoning == "maybe <tool_call>f</tool_call> later" and out.content == "Fine." and not out.tool_calls
    text = "<tool_call>get_time<arg_key>timezone</arg_key><arg_value>UTC</arg_value></tool_call>"
    out = parse_all_ways(glm(tools=None), text)  # tool_choice "none" / no tools: not parsed
    assert out.content == text and not out.tool_calls


def test_parser_is_picked_for_glm_checkpoints(glm_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(glm_model_dir))
    tool, reasoning, why = detect_parsers("glm4_moe", tok)
    assert (tool, reasoning) == ("glm45", "think") and "<arg_key>" in why
    assert ParserConfig(tool, reasoning).tool_parser is Glm45ToolParser
    assert not ParserConfig(tool, reasoning).skip_special_tokens  # the markup survives detokenization
    assert Glm45ToolParser.forced_call("f") is None  # key/value markup: tool_choice is prompted, not guided


# ---------------------------------------------------------------- the APIs

TURN1 = ("\n<think>The user wants the weather in Paris. I should call get_weather.</think>\nI'll look that up.\n"
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
TURN2 = ("\n<think>18 degrees. Now the time.</think>\n<tool_call>get_time\n<arg_key>timezone</arg_key>\n"
         "<arg_value>Europe/Paris</arg_value>\n</tool_call>")
TURN3 = "\n<think>I have both answers.</think>\nIn Paris it is 18 °C and the local time is 14:05."
PARALLEL = ("\n<think>Two lookups.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Tokyo"
            "</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>timezone</arg_key>\n<arg_value>Asia/Tokyo"
            "</arg_value>\n</tool_call>")
USER = {"role": "user", "content": "What's the weather in Paris, and what time is it there?"}


@pytest.fixture(scope="module")
def glm_server(glm_model_dir):
    with start_agent_server(glm_model_dir, MODEL) as server:
        yield server


@pytest.fixture
def server(glm_server):
    yield glm_server
    glm_server.scripts.queue.clear()
    glm_server.wait_idle()


def test_openai_chat_three_turn_tool_conversation(server):
    client, tok = server.openai(), server.llm.tokenizer
    server.scripts.push(TURN1, TURN2, TURN3)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, USER]

    r1 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    m1 = r1.choices[0]
    assert m1.finish_reason == "tool_calls" and m1.message.content == "I'll look that up."
    reasoning = m1.message.model_extra["reasoning_content"]
    assert reasoning == "The user wants the weather in Paris. I should call get_weather."
    (call1,) = m1.message.tool_calls
    assert call1.function.name == "get_weather" and json.loads(call1.function.arguments) == {"city": "Paris", "days": 2}
    prompt1 = render_chat(tok, messages, tools=TOOLS)[1]
    assert r1.usage.prompt_tokens == len(prompt1)

    messages += [m1.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call1.id, "content": '{"temperature": 18}'}]
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                        stream_options={"include_usage": True}) as stream:
        r2 = stream.get_final_completion()
    (call2,) = r2.choices[0].message.tool_calls
    assert not r2.choices[0].message.content and r2.choices[0].finish_reason == "tool_calls"
    assert call2.function.name == "get_time" and json.loads(call2.function.arguments) == {"timezone": "Europe/Paris"}
    text, ids = render_chat(tok, chat_messages_for_template(messages), tools=TOOLS)
    assert r2.usage.prompt_tokens == len(ids)
    # The history in GLM's own markup, exactly as the model wrote it: the prefix cache reuses the first
    # turn's prompt and output.
    assert TURN1 + "<|observation|>\n<tool_response>\n{\"temperature\": 18}\n</tool_response><|assistant|>" in text
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(prompt1) // 16 * 16 > 0

    messages += [{"role": "assistant", "content": None, "tool_calls": [call2.model_dump()],
                  "reasoning_content": r2.choices[0].message.model_extra["reasoning_content"]},
                 {"role": "tool", "tool_call_id": call2.id, "content": "14:05"}]
    r3 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    assert r3.choices[0].finish_reason == "stop" and r3.choices[0].message.tool_calls is None
    assert r3.choices[0].message.content == "In Paris it is 18 °C and the local time is 14:05."
    text, ids = render_chat(tok, chat_messages_for_template(messages), tools=TOOLS)
    assert r3.usage.prompt_tokens == len(ids) and TURN2 + "<|observation|>\n<tool_response>\n14:05" in text


def test_openai_streamed_parallel_calls(server):
    client = server.openai()
    server.scripts.push(PARALLEL)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, temperature=0,
                                                 stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather", "get_time"]
    args = {i: "".join(d.function.arguments or "" for d in deltas if d.index == i) for i in (0, 1)}
    assert [json.loads(a) for a in args.values()] == [{"city": "Tokyo"}, {"timezone": "Asia/Tokyo"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_two_turn_function_calls(server):
    client = server.openai()
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    server.scripts.push(TURN1, TURN3)
    with client.responses.stream(model=MODEL, input="What's the weather in Paris?", tools=tools, temperature=0) as s:
        types = [e.type for e in s]
        r = s.get_final_response()
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert "response.function_call_arguments.delta" in types and r.output_text == "I'll look that up."
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    r2 = client.responses.create(model=MODEL, input=history, tools=tools, temperature=0)
    assert r2.status == "completed" and r2.output_text == "In Paris it is 18 °C and the local time is 14:05."
    assert [o.type for o in r2.output] == ["reasoning", "message"]


def test_anthropic_messages_three_turn_tool_use(server):
    client = server.anthropic()
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    server.scripts.push(TURN1, PARALLEL, TURN3)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]
    first = client.messages.create(model=MODEL, max_tokens=300, messages=messages, tools=tools)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    use = first.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 2}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
    with client.messages.stream(model=MODEL, max_tokens=300, messages=messages, tools=tools) as stream:
        second = stream.get_final_message()
    assert second.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in second.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})]
    assert second.usage.cache_read_input_tokens > 0  # the first turn's pages
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "ok"}
                                              for b in second.content if b.type == "tool_use"]}]
    third = client.messages.create(model=MODEL, max_tokens=300, messages=messages, tools=tools)
    assert third.stop_reason == "end_turn"
    assert [b.type for b in third.content] == ["thinking", "text"]
    assert third.content[1].text == "In Paris it is 18 °C and the local time is 14:05."
