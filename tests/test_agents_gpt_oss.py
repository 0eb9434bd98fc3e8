"""gpt-oss's Harmony format through the server: the parser picked automatically, the history reshaped for the
released chat template, ``reasoning_effort`` from each API into the template's system message, and multi-turn
tool-calling conversations through the three HTTP APIs (OpenAI chat completions, Responses, Anthropic
Messages) with the official SDKs against a real server.

The server runs the tiny ``gpt_oss`` preset with the tokenizer make-model builds for gpt-oss (o200k_harmony's
special tokens and the chat template released with gpt-oss). The model has random weights, so the assistant
turns are recorded outputs in Harmony's markup replayed token by token through the real engine
(``ScriptedOutputs`` in conftest.py): analysis → reasoning, final (and a commentary preamble) → content,
commentary addressed ``to=functions.NAME`` → a tool call.
"""

from __future__ import annotations

import json

import pytest
from test_agents_openai import chat_messages_for_template

from edgemoe.engine.llm import render_chat
from edgemoe.server.parsers import ParserConfig, detect_parsers
from edgemoe.server.parsers.harmony import HarmonyParser, template_history

from conftest import start_agent_server

MODEL = "gpt-oss-tiny"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a time zone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
]
# Recorded gpt-oss outputs (the generation prompt ends with <|start|>assistant). <|call|> and <|return|> end
# generation (EOS tokens of the checkpoint).
TURN1 = ("<|channel|>analysis<|message|>The user wants the weather in Paris. I should call get_weather.<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>I'll look that up.<|end|>"
         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
         '{"city": "Paris", "days": 2}<|call|>')
TURN2 = ("<|channel|>analysis<|message|>18 degrees. Now the time.<|end|>"
         "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
         '{"timezone": "Europe/Paris"}<|call|>')
TURN3 = ("<|channel|>analysis<|message|>I have both answers.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>In Paris it is 18 °C and the local time is 14:05.<|return|>")
FINAL = "In Paris it is 18 °C and the local time is 14:05."
USER = {"role": "user", "content": "What's the weather in Paris, and what time is it there?"}


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    from edgemoe.synth import make_model

    return make_model(tmp_path_factory.mktemp("gptoss") / "gpt-oss-tiny", "gpt_oss", "tiny", dtype="float32")


@pytest.fixture(scope="module")
def gpt_oss_server(gpt_oss_dir):
    with start_agent_server(gpt_oss_dir, MODEL) as server:
        yield server


@pytest.fixture
def server(gpt_oss_server):
    yield gpt_oss_server
    gpt_oss_server.scripts.queue.clear()
    gpt_oss_server.wait_idle()


def _template(messages: list[dict]) -> list[dict]:
    """What the server hands gpt-oss's template for OpenAI ``messages``."""
    from edgemoe.engine.llm import arguments_as_objects

    msgs = chat_messages_for_template(messages)
    return template_history(arguments_as_objects(msgs) or msgs)


# ---------------------------------------------------------------- parser choice and history


def test_harmony_is_picked_for_gpt_oss_checkpoints(gpt_oss_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gpt_oss_dir))
    tool, reasoning, why = detect_parsers("gpt_oss", tok)
    assert (tool, reasoning) == ("harmony", "harmony") and "gpt_oss" in why
    assert detect_parsers(None, tok)[:2] == ("harmony", "harmony")  # from the <|channel|>/<|message|> tokens
    cfg = ParserConfig(tool, reasoning)
    assert cfg.harmony and not cfg.skip_special_tokens and isinstance(cfg.build("", TOOLS), HarmonyParser)


def test_template_history_splits_parallel_calls_and_keeps_reasoning():
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"timezone": "UTC"}}}]
    history = [USER, {"role": "assistant", "content": "Checking.", "reasoning_content": "Two lookups.",
                      "tool_calls": calls},
               {"role": "tool", "tool_call_id": "b", "content": "12:00"},
               {"role": "tool", "tool_call_id": "a", "content": "3 C"}]
    out = template_history(history)
    assert out == [USER,
                   {"role": "assistant", "content": None, "thinking": "Two lookups.", "tool_calls": [calls[0]]},
                   history[3],
                   {"role": "assistant", "tool_calls": [calls[1]]},
                   history[2]]
    assert history[1]["content"] == "Checking."  # not modified in place
    # results without ids keep their order; a message without calls passes through with its reasoning
    plain = [{"role": "assistant", "content": None, "tool_calls": calls}, {"role": "tool", "content": "r1"},
             {"role": "tool", "content": "r2"}, {"role": "assistant", "content": "Done.", "reasoning_content": "ok"}]
    out = template_history(plain)
    assert [m.get("content") for m in out] == [None, "r1", None, "r2", "Done."]
    assert out[-1] == {"role": "assistant", "content": "Done.", "thinking": "ok"}


def test_rendered_parallel_calls_name_each_result(server):
    """Two calls of one assistant turn render as Harmony's alternation of calls and results, each result
    addressed from its own function."""
    tok = server.llm.tokenizer
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}}]
    messages = [USER, {"role": "assistant", "content": None, "reasoning_content": "Two lookups.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "a", "content": "3 C"},
                {"role": "tool", "tool_call_id": "b", "content": "12:00"}]
    text = render_chat(tok, _template(messages), tools=TOOLS)[0]
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Two lookups.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"3 C"<|end|>'
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"timezone": "UTC"}<|call|>'
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"<|end|><|start|>assistant')


# ---------------------------------------------------------------- the APIs


def test_openai_chat_three_turn_tool_conversation(server):
    client, tok = server.openai(), server.llm.tokenizer
    server.scripts.push(TURN1, TURN2, TURN3)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, USER]

    r1 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                        reasoning_effort="high")
    m1 = r1.choices[0]
    assert m1.finish_reason == "tool_calls" and m1.message.content == "I'll look that up."
    reasoning = m1.message.model_extra["reasoning_content"]
    assert reasoning == "The user wants the weather in Paris. I should call get_weather."
    (call1,) = m1.message.tool_calls
    assert call1.function.name == "get_weather" and json.loads(call1.function.arguments) == {"city": "Paris", "days": 2}
    high = {"reasoning_effort": "high"}
    text1, prompt1 = render_chat(tok, _template(messages), tools=TOOLS, chat_template_kwargs=high)
    assert r1.usage.prompt_tokens == len(prompt1) and "\nReasoning: high\n" in text1
    assert "# Instructions\n\nYou are a helpful assistant." in text1 and "type get_weather = (_: {" in text1

    messages += [m1.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call1.id, "content": '{"temperature": 18}'}]
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                        reasoning_effort="high", stream_options={"include_usage": True}) as stream:
        events = [e.type for e in stream]
        r2 = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    (call2,) = r2.choices[0].message.tool_calls
    assert not r2.choices[0].message.content and r2.choices[0].finish_reason == "tool_calls"
    assert r2.choices[0].message.model_extra["reasoning_content"] == "18 degrees. Now the time."
    assert call2.function.name == "get_time" and json.loads(call2.function.arguments) == {"timezone": "Europe/Paris"}
    text, ids = render_chat(tok, _template(messages), tools=TOOLS, chat_template_kwargs=high)
    assert r2.usage.prompt_tokens == len(ids)
    # the first turn's reasoning is carried into the call (no final answer yet), its preamble dropped
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>The user wants the weather in Paris. I should call "
        "get_weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 2}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
        '<|message|>"{\\"temperature\\": 18}"<|end|><|start|>assistant')
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(prompt1) // 16 * 16 > 0

    messages += [{"role": "assistant", "content": None, "tool_calls": [call2.model_dump()],
                  "reasoning_content": r2.choices[0].message.model_extra["reasoning_content"]},
                 {"role": "tool", "tool_call_id": call2.id, "content": "14:05"}]
    r3 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    assert r3.choices[0].finish_reason == "stop" and r3.choices[0].message.tool_calls is None
    assert r3.choices[0].message.content == FINAL
    assert r3.choices[0].message.model_extra["reasoning_content"] == "I have both answers."
    text, ids = render_chat(tok, _template(messages), tools=TOOLS)
    assert r3.usage.prompt_tokens == len(ids) and "\nReasoning: medium\n" in text  # the template's default
    assert '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"14:05"<|end|>' in text


def test_openai_streamed_channels(server):
    client = server.openai()
    server.scripts.push(TURN3)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("I have both answers.", FINAL)
    assert sum(bool(d.content) for d in deltas) > 1  # streamed in pieces, not at the end
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any("<|" in (d.content or "") + (d.model_extra.get("reasoning_content") or "") for d in deltas)


def test_unknown_reasoning_effort_is_a_400(server):
    import openai

    with pytest.raises(openai.BadRequestError, match="reasoning_effort: unknown effort 'extreme'"):
        server.openai().chat.completions.create(model=MODEL, messages=[USER], reasoning_effort="extreme")


def test_responses_two_turn_function_calls(server):
    client, tok = server.openai(), server.llm.tokenizer
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    server.scripts.push(TURN1, TURN3)
    with client.responses.stream(model=MODEL, input="What's the weather in Paris?", tools=tools, temperature=0,
                                 reasoning={"effort": "low"}) as s:
        types = [e.type for e in s]
        r = s.get_final_response()
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert "response.function_call_arguments.delta" in types and "response.reasoning_text.delta" in types
    assert r.output_text == "I'll look that up."
    assert r.output[0].content[0].text == "The user wants the weather in Paris. I should call get_weather."
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    first = [{"role": "user", "content": "What's the weather in Paris?"}]
    text = render_chat(tok, _template(first), tools=TOOLS, chat_template_kwargs={"reasoning_effort": "low"})[0]
    assert r.usage.input_tokens == len(tok.encode(text, add_special_tokens=False)) and "\nReasoning: low\n" in text
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        r.output[0].model_dump(exclude_none=True),
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    r2 = client.responses.create(model=MODEL, input=history, tools=tools, temperature=0, reasoning={"effort": "low"})
    assert r2.status == "completed" and r2.output_text == FINAL
    assert [o.type for o in r2.output] == ["reasoning", "message"]
    assert r2.usage.input_tokens_details.cached_tokens > 0


def test_anthropic_messages_three_turn_tool_use(server):
    client = server.anthropic()
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    server.scripts.push(TURN1, TURN2, TURN3)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]
    first = client.messages.create(model=MODEL, max_tokens=300, messages=messages, tools=tools,
                                   thinking={"type": "enabled", "budget_tokens": 20000})
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking.startswith("The user wants") and first.content[1].text == "I'll look that up."
    use = first.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 2}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
    with client.messages.stream(model=MODEL, max_tokens=300, messages=messages, tools=tools,
                                thinking={"type": "enabled", "budget_tokens": 20000}) as stream:
        kinds = {e.delta.type for e in stream if e.type == "content_block_delta"}
        second = stream.get_final_message()
    assert {"thinking_delta", "input_json_delta"} <= kinds
    assert second.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in second.content if b.type == "tool_use"] == [
        ("get_time", {"timezone": "Europe/Paris"})]
    assert second.usage.cache_read_input_tokens > 0  # the first turn's pages
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "14:05"}
                                              for b in second.content if b.type == "tool_use"]}]
    third = client.messages.create(model=MODEL, max_tokens=300, messages=messages, tools=tools)
    assert third.stop_reason == "end_turn"
    assert [b.type for b in third.content] == ["thinking", "text"] and third.content[1].text == FINAL
    # the Messages API's effort reaches the template (thinking budget 20000 -> high)
    count = client.messages.count_tokens(model=MODEL, messages=messages[:1], tools=tools,
                                         thinking={"type": "enabled", "budget_tokens": 20000})
    text = render_chat(server.llm.tokenizer, [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                       chat_template_kwargs={"reasoning_effort": "high"})
    assert count.input_tokens == len(text[1]) and "\nReasoning: high\n" in text[0]
