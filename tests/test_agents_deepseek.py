"""DeepSeek-V3 tool calls end to end on the ``deepseek_v3`` architecture (tiny, random weights): the real
DeepSeek-V3 tokenizer and chat template, recorded outputs written with its tool-call tokens replayed
through the engine (latent KV cache, prefix cache across turns), multi-turn conversations through the
OpenAI chat completions, Anthropic Messages and OpenAI Responses APIs with the official SDKs as clients."""

from __future__ import annotations

import json

import pytest
from test_agents_openai import TOOLS

from edgemoe.engine.llm import render_chat

from conftest import start_agent_server

MODEL = "dsv3-tiny"
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
PARALLEL = (
    f"{B}{CB}function{SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{CE}\n"
    f"{CB}function{SEP}get_time\n```json\n{{\"timezone\": \"Europe/Paris\"}}\n```{CE}{E}"
)
SINGLE = f"{B}{CB}function{SEP}get_weather\n```json\n{{\"city\": \"Lyon\", \"unit\": \"celsius\"}}\n```{CE}{E}"
ANSWER = "Paris: 18 °C at 14:05; Lyon: 20 °C."


@pytest.fixture(scope="module")
def server(deepseek_tokenizer_model_dir):
    with start_agent_server(deepseek_tokenizer_model_dir, MODEL) as srv:
        assert srv.llm.tokenizer.convert_tokens_to_ids(B) == 128806
        assert srv.llm.engine.runner.model_config.architecture == "DeepseekV3ForCausalLM"
        assert srv.llm.engine.runner.kv.spec.is_latent
        yield srv
        srv.scripts.queue.clear()


def test_parsers_picked_from_the_tokenizer(server):
    from edgemoe.server.parsers import resolve_parsers

    cfg = resolve_parsers(None, None, server.llm.engine.runner.model_config.model_type, server.llm.tokenizer)
    assert cfg.tool == "deepseek_v3" and "tool▁calls▁begin" in cfg.why


def test_three_turn_parallel_tool_calls(server):
    client, tok = server.openai(), server.llm.tokenizer
    server.scripts.push(PARALLEL, SINGLE, ANSWER)
    messages = [{"role": "user", "content": "Weather and time in Paris, then Lyon's weather."}]
    r1 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    msg = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]
    messages += [msg.model_dump(exclude_none=True) | {"content": None}]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": out}
                 for c, out in zip(msg.tool_calls, ["18 C", "14:05"])]

    with client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Lyon", "unit": "celsius"}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "20 C"}]

    r3 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r3.choices[0].message.content == ANSWER and r3.choices[0].finish_reason == "stop"
    # each turn re-prefills only its new suffix: the previous turns' latent pages come from the prefix cache
    assert r3.usage.prompt_tokens_details.cached_tokens >= 32
    # The DeepSeek-V3 template does not render tools: the server describes them in a system prompt,
    # and the history carries the calls and outputs in the model's own tokens.
    from edgemoe.server.parsers.deepseek_v3 import DeepSeekV3ToolParser

    system = {"role": "system", "content": DeepSeekV3ToolParser.tools_system_prompt(TOOLS)}
    from test_agents_openai import chat_messages_for_template

    history = [
        {**m, "content": (m["content"] or "") + DeepSeekV3ToolParser.history_markup(m["tool_calls"])}
        if m.get("tool_calls") else m
        for m in chat_messages_for_template(messages)
    ]
    text, ids = render_chat(tok, [system, *[{k: v for k, v in m.items() if k != "tool_calls"} for m in history]],
                            tools=TOOLS)
    assert r3.usage.prompt_tokens == len(ids)
    # Past calls appear exactly as the model wrote them (the official template's tool branch cannot
    # render under transformers 5, which drops content=None).
    assert f"<｜Assistant｜>{PARALLEL}<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18 C" in text
    assert "<｜tool▁output▁begin｜>20 C<｜tool▁output▁end｜>" in text
    assert '"name": "get_weather"' in text.split("<｜User｜>")[0]  # tool schemas in the system prompt


def test_anthropic_streaming_tool_use(server):
    server.scripts.push(SINGLE)
    with server.anthropic().messages.stream(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Weather in Lyon?"}],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", {"city": "Lyon", "unit": "celsius"})]


def test_anthropic_multi_turn_tool_use(server):
    client = server.anthropic()
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    server.scripts.push(PARALLEL, SINGLE, ANSWER)
    messages = [{"role": "user", "content": "Weather and time in Paris, then Lyon's weather."}]
    first = client.messages.create(model=MODEL, max_tokens=200, system="You are a travel agent.", messages=messages,
                                   tools=tools)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"}),
                                                 ("get_time", {"timezone": "Europe/Paris"})]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C"},
                                              {"type": "tool_result", "tool_use_id": uses[1].id, "content": "14:05"}]}]
    with client.messages.stream(model=MODEL, max_tokens=200, system="You are a travel agent.", messages=messages,
                                tools=tools) as stream:
        second = stream.get_final_message()
    (use,) = [b for b in second.content if b.type == "tool_use"]
    assert second.stop_reason == "tool_use"
    assert (use.name, use.input) == ("get_weather", {"city": "Lyon", "unit": "celsius"})
    assert second.usage.cache_read_input_tokens >= 16  # the first turn's latent pages, reused
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "20 C"}]}]
    third = client.messages.create(model=MODEL, max_tokens=200, system="You are a travel agent.", messages=messages,
                                   tools=tools)
    assert third.stop_reason == "end_turn" and third.content[-1].text == ANSWER
    assert third.usage.cache_read_input_tokens >= second.usage.cache_read_input_tokens


def test_responses_multi_turn_function_calls(server):
    client = server.openai()
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    server.scripts.push(PARALLEL, ANSWER)
    question = "Weather and time in Paris?"
    r1 = client.responses.create(model=MODEL, input=question, tools=tools, temperature=0)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]
    history = [{"role": "user", "content": question}]
    history += [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                for c in calls]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": out}
                for c, out in zip(calls, ["18 C", "14:05"])]
    with client.responses.stream(model=MODEL, input=history, tools=tools, temperature=0) as stream:
        events = [e.type for e in stream]
        r2 = stream.get_final_response()
    assert "response.output_text.delta" in events and events[-1] == "response.completed"
    assert r2.output_text == ANSWER and r2.usage.input_tokens_details.cached_tokens >= 16
