"""Kimi-K2 served end to end: the ``kimi_k2`` tool-call parser (every streaming split, malformed markup), its
automatic choice, the ``functions.NAME:IDX`` tool-call ids and their round trip into Kimi's chat template, and
multi-turn tool-calling conversations through the OpenAI chat completions, Anthropic Messages and OpenAI
Responses APIs with the official SDKs against a real server; also the ``--trust-remote-code`` opt-in a
release's tokenizer (tiktoken code) needs.

The server runs the tiny ``deepseek_v3`` geometry in Kimi-K2's release layout (``model_type`` ``kimi_k2``,
``test_deepseek_v3.make_checkpoint``) with a fast tokenizer make-model builds in the ``kimi_k2`` flavour
(Kimi-K2's special and tool-call tokens, the chat template released with Kimi-K2-Instruct-0905). The model
has random weights, so the assistant turns are recorded outputs in Kimi's markup replayed token by token
through the real engine (``ScriptedOutputs`` in conftest.py); the prompts the engine receives are recorded
and decoded to check what the template rendered.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_agents_openai import TOOLS, chat_messages_for_template
from test_agents_parsers import _FakeTokenizer, _feed, parse_all_ways
from test_deepseek_v3 import VARIANTS, make_checkpoint

from edgemoe.engine.llm import render_chat
from edgemoe.server.parsers import ParserConfig, ToolCall, detect_parsers
from edgemoe.server.parsers.kimi_k2 import KimiK2ToolParser
from edgemoe.server.serving import CallIds
from edgemoe.synth.tokenizer import BUILT_VOCAB, TOKENIZERS, build_tokenizer

from conftest import start_agent_server

MODEL = "kimi-tiny"
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
PROMPT = "<|im_assistant|>assistant<|im_middle|>"  # Kimi's generation prompt: no think block left open


def call(call_id: str, args: str) -> str:
    return f"{CB}{call_id}{AB}{args}{CE}"


def kimi(tools=TOOLS, reasoning="none"):
    cfg = ParserConfig("kimi_k2", reasoning)
    return lambda: cfg.build(PROMPT, tools)


# ---------------------------------------------------------------- the parser


def test_single_call():
    text = SB + call("functions.get_weather:0", '{"city": "Paris"}') + SE
    out = parse_all_ways(kimi(), text)
    assert out.content is None and out.reasoning is None
    assert out.tool_calls == [ToolCall(0, "get_weather", '{"city": "Paris"}', "functions.get_weather:0")]


def test_several_calls_text_around_and_whitespace_between_tokens():
    # llama.cpp's and the tool-call guide's examples put newlines around the tokens; text before the section
    # is the answer, text after it too.
    text = ("I'll check both.\n\n" + SB + "\n" + CB + "\nfunctions.get_weather:0" + AB + '\n{"city": "Paris", '
            '"unit": "celsius"}\n' + CE + "\n" + call("functions.get_time:1", '{"timezone": "Europe/Paris"}') + "\n"
            + SE + "\n\nDone.")
    out = parse_all_ways(kimi(), text)
    assert out.content == "I'll check both.Done."
    assert out.tool_calls == [
        ToolCall(0, "get_weather", '{"city": "Paris", "unit": "celsius"}', "functions.get_weather:0"),
        ToolCall(1, "get_time", '{"timezone": "Europe/Paris"}', "functions.get_time:1"),
    ]


def test_ids_without_prefix_or_index_and_the_singular_section_tokens():
    text = ("<|tool_call_section_begin|>" + call("get_weather:7", '{"city": "Rome"}')
            + call("functions.mcp.search", "{}") + "<|tool_call_section_end|>")
    out = parse_all_ways(kimi(), text)
    assert out.content is None
    assert out.tool_calls == [ToolCall(0, "get_weather", '{"city": "Rome"}', "get_weather:7"),
                              ToolCall(1, "mcp.search", "{}", "functions.mcp.search")]


def test_arguments_stream_while_written():
    text = SB + call("functions.run:0", '{"cmd": "echo a fairly long command line"}') + SE
    _, events = _feed(kimi(), list(text))
    calls = [e for e in events if e.kind == "tool_call"]
    assert (calls[0].name, calls[0].call_id) == ("run", "functions.run:0") and len(calls) > 10
    assert all(e.name is None and e.call_id is None for e in calls[1:])
    assert json.loads("".join(e.text for e in calls)) == {"cmd": "echo a fairly long command line"}


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("a <|tool_calls_sec", "a <|tool_calls_sec", []),  # half a token at the end is text
        (SB + "not a call", SB + "not a call", []),  # no call in the section: text
        # an id, then no arguments token: the markup is text
        (SB + CB + "functions.f:0" + CE + SE, SB + CB + "functions.f:0" + CE + SE, []),
        # arguments that stop being JSON: the call keeps the valid prefix, the rest is text
        (SB + call("functions.f:0", '{"a": 1 x}'), 'x}' + CE, [ToolCall(0, "f", '{"a": 1 ', "functions.f:0")]),
        # no <|tool_call_end|> after the object: the call is complete, what follows is text
        (SB + CB + "functions.f:0" + AB + '{"a": 1} tail', " tail", [ToolCall(0, "f", '{"a": 1}', "functions.f:0")]),
        # cut by max_tokens inside the arguments: the call keeps what it has
        (SB + CB + "functions.f:0" + AB + '{"a": "Pa', None, [ToolCall(0, "f", '{"a": "Pa', "functions.f:0")]),
        # cut inside the id: markup that could still have become a call is dropped
        ("ok " + SB + CB + "functions.get_wea", "ok", []),
    ],
)
def test_malformed_markup(text, content, calls):
    out = parse_all_ways(kimi(), text)
    assert (out.content, out.tool_calls) == (content, calls)


def test_thinking_reasoning_then_calls_and_no_tools_means_text():
    text = "<think>Two cities.</think>Checking." + SB + call("functions.get_weather:0", '{"city": "Lyon"}') + SE
    out = parse_all_ways(kimi(reasoning="think"), text)
    assert (out.reasoning, out.content) == ("Two cities.", "Checking.")
    assert out.tool_calls == [ToolCall(0, "get_weather", '{"city": "Lyon"}', "functions.get_weather:0")]
    out = parse_all_ways(kimi(tools=None), text)  # tool_choice "none" / no tools: not parsed
    assert out.content == text and not out.tool_calls


def test_forced_call_parses_back():
    prefix, suffix = KimiK2ToolParser.forced_call("get_time")
    assert prefix.startswith(KimiK2ToolParser.call_trigger)
    out = parse_all_ways(kimi(), prefix + '{"timezone": "UTC"}' + suffix)
    assert out.tool_calls == [ToolCall(0, "get_time", '{"timezone": "UTC"}', "functions.get_time:0")]


# ---------------------------------------------------------------- ids


def test_api_ids_take_the_written_index_unless_taken():
    ids = CallIds(KimiK2ToolParser, "toolu", frozenset({"functions.get_weather:0", "functions.get_time:1"}), 2)
    assert ids.get(0, "get_weather", "functions.get_weather:0") == "functions.get_weather:2"  # :0 is taken
    assert ids.get(1, "get_time", "functions.get_time:9") == "functions.get_time:9"
    assert ids.get(2, "get_weather", "functions.get_weather:2") == "functions.get_weather:4"  # :2 went to call 0
    assert ids.get(0, "get_weather", None) == "functions.get_weather:2" and 0 in ids and len(ids) == 3  # fixed
    assert CallIds(KimiK2ToolParser).get(0, "f") == "functions.f:0"
    assert CallIds(None, "toolu").get(0, "f", "functions.f:0").startswith("toolu_")  # other families: random


def test_foreign_history_ids_are_renamed_for_the_template():
    history = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_01A", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_01A", "content": "18 C"},
        {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "14:05"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "functions.get_time:0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": "20 C"},
    ]
    out = KimiK2ToolParser.template_call_ids(history)
    assert [tc["id"] for tc in out[1]["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]
    assert [m["tool_call_id"] for m in out[2:4]] == ["functions.get_weather:0", "functions.get_time:1"]
    # a foreign id, and one of Kimi's form naming another function: both renamed from their position on
    assert [tc["id"] for tc in out[4]["tool_calls"]] == ["functions.get_weather:2", "functions.get_weather:3"]
    assert out[5]["tool_call_id"] == "functions.get_weather:2"
    assert history[2]["tool_call_id"] == "toolu_01A"  # the request's own messages are not changed


# ---------------------------------------------------------------- detection


def test_detection(tmp_path):
    instruct = build_tokenizer(tmp_path / "i", BUILT_VOCAB, TOKENIZERS["kimi_k2"])
    thinking = build_tokenizer(tmp_path / "t", BUILT_VOCAB, TOKENIZERS["kimi_k2_thinking"])
    tool, reasoning, why = detect_parsers("kimi_k2", instruct)
    assert (tool, reasoning) == ("kimi_k2", "none") and "<|tool_calls_section_begin|>" in why
    assert detect_parsers("kimi_k2", thinking)[:2] == ("kimi_k2", "think")
    # A tokenizer without the think tokens whose template writes them as text; the template alone
    assert detect_parsers(None, _FakeTokenizer([SB], thinking.chat_template))[:2] == ("kimi_k2", "think")
    assert detect_parsers(None, _FakeTokenizer([], instruct.chat_template))[:2] == ("kimi_k2", "none")
    cfg = ParserConfig("kimi_k2", "none")
    assert cfg.tool_parser is KimiK2ToolParser and not cfg.skip_special_tokens
    assert ParserConfig("kimi", "none").tool_parser is KimiK2ToolParser


# ---------------------------------------------------------------- the APIs

PARALLEL = ("Checking both." + SB + call("functions.get_weather:0", '{"city": "Paris"}')
            + call("functions.get_time:1", '{"timezone": "Europe/Paris"}') + SE)
# The second turn's call reuses index 0, as a model trained on per-turn indices writes it.
SINGLE = SB + call("functions.get_weather:0", '{"city": "Lyon", "unit": "celsius"}') + SE
ANSWER = "Paris: 18 °C at 14:05; Lyon: 20 °C."
IDS = ["functions.get_weather:0", "functions.get_time:1"]
SECOND = "functions.get_weather:2"  # index 0 is taken by then: the next free one from the call's position


@pytest.fixture(scope="module")
def kimi_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    build_tokenizer(root / "tokenizer", BUILT_VOCAB, TOKENIZERS["kimi_k2"])
    overrides, model_type = VARIANTS["kimi"]
    return make_checkpoint(root / "kimi-tiny", overrides, model_type, tokenizer=root / "tokenizer")


@pytest.fixture(scope="module")
def server(kimi_model_dir):
    with start_agent_server(kimi_model_dir, MODEL) as srv:
        assert srv.llm.engine.runner.model_config.model_type == "kimi_k2"
        assert srv.llm.engine.runner.kv.spec.is_latent
        prompts: list[list[int]] = []
        generate = srv.llm.generate

        def recording(prompt_ids, *args, **kw):
            prompts.append(list(prompt_ids))
            return generate(prompt_ids, *args, **kw)

        srv.llm.generate = recording
        srv.prompts = prompts
        yield srv
        srv.scripts.queue.clear()


def last_prompt(server) -> str:
    return server.llm.tokenizer.decode(server.prompts[-1])


def test_parsers_picked_from_the_checkpoint(server):
    assert server.llm.engine.runner.model_config.model_type == "kimi_k2"
    from edgemoe.server.parsers import resolve_parsers

    cfg = resolve_parsers(None, None, "kimi_k2", server.llm.tokenizer)
    assert (cfg.tool, cfg.reasoning) == ("kimi_k2", "none")


def test_chat_three_turns(server):
    client, tok = server.openai(), server.llm.tokenizer
    server.scripts.push(PARALLEL, SINGLE, ANSWER)
    messages = [{"role": "user", "content": "Weather and time in Paris, then Lyon's weather."}]
    r1 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    msg = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and msg.content == "Checking both."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        (IDS[0], "get_weather", {"city": "Paris"}), (IDS[1], "get_time", {"timezone": "Europe/Paris"})]
    messages += [msg.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": out}
                 for c, out in zip(msg.tool_calls, ["18 C", "14:05"])]

    with client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS) as stream:
        final = stream.get_final_completion()
    (c2,) = final.choices[0].message.tool_calls
    assert (c2.id, c2.function.name, json.loads(c2.function.arguments)) == (
        SECOND, "get_weather", {"city": "Lyon", "unit": "celsius"})
    messages += [{"role": "assistant", "content": None, "tool_calls": [c2.model_dump()]},
                 {"role": "tool", "tool_call_id": c2.id, "content": "20 C"}]

    r3 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r3.choices[0].message.content == ANSWER and r3.choices[0].finish_reason == "stop"
    # The server rendered the conversation with the template, ids as the API gave them
    text, ids = render_chat(tok, chat_messages_for_template(messages), tools=TOOLS)
    assert r3.usage.prompt_tokens == len(ids) and server.prompts[-1] == ids
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>")
    past = SB + call(IDS[0], '{"city": "Paris"}') + call(IDS[1], '{"timezone": "Europe/Paris"}') + SE
    assert f"<|im_assistant|>assistant<|im_middle|>Checking both.{past}<|im_end|>" in text
    assert f"<|im_system|>tool<|im_middle|>## Return of {IDS[0]}\n    18 C<|im_end|>" in text
    assert f"## Return of {IDS[1]}\n    14:05<|im_end|>" in text and f"## Return of {SECOND}\n    20 C" in text
    assert r3.usage.prompt_tokens_details.cached_tokens >= 32  # earlier turns' latent pages, reused


def test_chat_history_with_foreign_ids(server):
    client = server.openai()
    server.scripts.push(ANSWER)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_abc", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_abc", "content": "18 C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == ANSWER
    text = last_prompt(server)
    assert "call_abc" not in text and f"{CB}{IDS[0]}{AB}" in text and f"## Return of {IDS[0]}\n    18 C" in text


def test_anthropic_multi_turn(server):
    client = server.anthropic()
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    server.scripts.push(PARALLEL, SINGLE, ANSWER)
    kw = dict(model=MODEL, max_tokens=200, system="You are a travel agent.", tools=tools)
    messages = [{"role": "user", "content": "Weather and time in Paris, then Lyon's weather."}]
    first = client.messages.create(messages=messages, **kw)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and first.content[0].text == "Checking both."
    assert [(u.id, u.name, u.input) for u in uses] == [
        (IDS[0], "get_weather", {"city": "Paris"}), (IDS[1], "get_time", {"timezone": "Europe/Paris"})]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C"},
                                              {"type": "tool_result", "tool_use_id": uses[1].id, "content": "14:05"}]}]
    with client.messages.stream(messages=messages, **kw) as stream:
        second = stream.get_final_message()
    (use,) = [b for b in second.content if b.type == "tool_use"]
    assert (use.id, use.name, use.input) == (SECOND, "get_weather", {"city": "Lyon", "unit": "celsius"})
    text = last_prompt(server)
    assert text.startswith("<|im_system|>tool_declare") and "You are a travel agent.<|im_end|>" in text
    assert f"{CB}{IDS[0]}{AB}" in text and f"## Return of {IDS[0]}\n    18 C" in text
    assert f"## Return of {IDS[1]}\n    14:05" in text
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "20 C"}]}]
    third = client.messages.create(messages=messages, **kw)
    assert third.stop_reason == "end_turn" and third.content[-1].text == ANSWER
    assert f"{CB}{SECOND}{AB}" in last_prompt(server) and f"## Return of {SECOND}\n    20 C" in last_prompt(server)
    assert third.usage.cache_read_input_tokens >= 16


def test_responses_multi_turn(server):
    client = server.openai()
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    server.scripts.push(PARALLEL, ANSWER)
    question = "Weather and time in Paris?"
    with client.responses.stream(model=MODEL, input=question, tools=tools) as stream:
        events = [e.type for e in stream]
        r1 = stream.get_final_response()
    assert "response.function_call_arguments.delta" in events
    calls = [o for o in r1.output if o.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        (IDS[0], "get_weather", {"city": "Paris"}), (IDS[1], "get_time", {"timezone": "Europe/Paris"})]
    history = [{"role": "user", "content": question}, *[o.model_dump(exclude_none=True) for o in r1.output]]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": out}
                for c, out in zip(calls, ["18 C", "14:05"])]
    r2 = client.responses.create(model=MODEL, input=history, tools=tools)
    assert r2.output_text == ANSWER
    text = last_prompt(server)
    assert f"Checking both.{SB}{CB}{IDS[0]}{AB}" in text and f"## Return of {IDS[1]}\n    14:05" in text


def test_forced_and_strict_calls_are_constrained(server):
    """The random-weight model writes Kimi's call markup under a forced ``tool_choice``; a strict tool's
    call (recorded with an argument its schema forbids) follows ``parameters``."""
    client = server.openai()
    messages = [{"role": "user", "content": "Time in Tokyo?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60, temperature=1.0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=0)
    (c,) = r.choices[0].message.tool_calls
    assert (c.id, c.function.name, r.choices[0].finish_reason) == ("functions.get_time:0", "get_time", "tool_calls")
    assert "timezone" in json.loads(c.function.arguments)
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True, "parameters": {
        **TOOLS[0]["function"]["parameters"], "additionalProperties": False}}}]
    server.scripts.push("I will check." + SB + call("functions.get_weather:0", '{"town": "Paris"}') + SE)
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=strict, max_tokens=60, temperature=0)
    (c,) = r.choices[0].message.tool_calls
    args = json.loads(c.function.arguments)
    assert r.choices[0].message.content == "I will check." and c.function.name == "get_weather"
    assert "city" in args and set(args) <= {"city", "unit"}


# ---------------------------------------------------------------- Kimi-K2-Thinking

THINK1 = "<think>Paris first.</think>" + SB + call("functions.get_weather:0", '{"city": "Paris"}') + SE
THINK2 = "<think>18 C, so mild.</think>Mild: 18 °C."


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-thinking")
    build_tokenizer(root / "tokenizer", BUILT_VOCAB, TOKENIZERS["kimi_k2_thinking"])
    overrides, model_type = VARIANTS["kimi"]
    model = make_checkpoint(root / "kimi-thinking-tiny", overrides, model_type, tokenizer=root / "tokenizer")
    with start_agent_server(model, MODEL) as srv:
        yield srv
        srv.scripts.queue.clear()


def test_thinking_reasoning_and_tool_calls_across_turns(thinking_server):
    server = thinking_server
    client, tok = server.openai(), server.llm.tokenizer
    server.scripts.push(THINK1, THINK2)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS) as stream:
        first = stream.get_final_completion()
    msg = first.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Paris first." and not msg.content
    assert [(c.id, c.function.name) for c in msg.tool_calls] == [(IDS[0], "get_weather")]
    messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": IDS[0], "content": "18 C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "Mild: 18 °C."
    assert second.choices[0].message.model_extra["reasoning_content"] == "18 C, so mild."
    # Kimi-K2-Thinking's template keeps the reasoning of the turn still in progress (a tool-call turn after
    # the last plain answer), and renders the call and its result by id
    text, ids = render_chat(tok, chat_messages_for_template(messages), tools=TOOLS)
    assert server.llm.tokenizer.decode(ids) == text and second.usage.prompt_tokens == len(ids)
    assert (f"<|im_assistant|>assistant<|im_middle|><think>Paris first.</think>{SB}{CB}{IDS[0]}{AB}"
            in text) and f"## Return of {IDS[0]}\n18 C<|im_end|>" in text


# ---------------------------------------------------------------- --trust-remote-code


def _with_remote_code(src, dst):
    """A copy of the checkpoint whose tokenizer_config.json names a tokenizer class of its own (as Kimi-K2's
    release names ``tokenization_kimi.TikTokenTokenizer``), with that code: a fast tokenizer subclass."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "EdgemoeTestTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_edgemoe_test.EdgemoeTestTokenizer"]}
    path.write_text(json.dumps(cfg))
    (dst / "tokenization_edgemoe_test.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass EdgemoeTestTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    return dst


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "1"]])
def test_custom_tokenizer_code_is_refused_without_the_flag(kimi_model_dir, tmp_path, capsys, command):
    from edgemoe.cli import main

    model = _with_remote_code(kimi_model_dir, tmp_path / "remote")
    assert main([command[0], str(model), *command[1:], "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"edgemoe: error: {model}: ")
    assert "tokenization_edgemoe_test.EdgemoeTestTokenizer" in err[0] and "pass --trust-remote-code" in err[0]


def test_trust_remote_code_loads_the_checkpoints_tokenizer(kimi_model_dir, tmp_path, monkeypatch):
    import sys

    import transformers.dynamic_module_utils as dynamic

    from edgemoe.config import EngineConfig
    from edgemoe.engine.model_runner import ModelRunner
    from edgemoe.engine.tokenizer import RemoteCodeError, load_tokenizer

    model = _with_remote_code(kimi_model_dir, tmp_path / "remote")
    with pytest.raises(RemoteCodeError, match="pass --trust-remote-code"):  # before any weight is read
        ModelRunner(model, EngineConfig(device="cpu"), progress=False)
    # transformers copies the code into its modules cache and imports it from there: keep both in tmp_path
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    tok = load_tokenizer(model, trust_remote_code=True)
    assert type(tok).__name__ == "EdgemoeTestTokenizer"
    assert tok.convert_tokens_to_ids(SB) == load_tokenizer(kimi_model_dir).convert_tokens_to_ids(SB)
