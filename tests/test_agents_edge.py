"""What real agent clients send that a plain chat does not: Claude Code's system turns inside
``messages``, documents and images, Codex's namespace tools, a literal ``<think>`` in the conversation,
and the overflow error Anthropic clients parse. Real Qwen3 tokenizer and template, real SDKs, recorded
outputs replayed through the engine where the model's words matter (``ScriptedOutputs``)."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest
from test_agents_openai import MODEL, TOOLS, TURN1, TURN3

from edgemoe.engine.llm import render_chat
from edgemoe.server.common import DOCUMENT_NOTE, IMAGE_NOTE


@pytest.fixture
def server(qwen_agent_server):
    yield qwen_agent_server
    qwen_agent_server.scripts.queue.clear()
    qwen_agent_server.wait_idle()


def test_a_literal_think_tag_earlier_in_the_conversation_is_not_reasoning(server):
    client = server.openai()
    messages = [{"role": "user", "content": "What does <think> do in your output?"},
                {"role": "assistant", "content": "It opens my reasoning: <think>"},
                {"role": "user", "content": "And then?"}]
    server.scripts.push("Then </think> closes it.")
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    msg = r.choices[0].message
    assert msg.content == "Then </think> closes it." and not (msg.model_extra or {}).get("reasoning_content")
    # A forced tool call after such a conversation is a tool call, not reasoning holding its markup.
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
    assert not (r.choices[0].message.model_extra or {}).get("reasoning_content")


def test_claude_code_system_turns_inside_messages(server):
    """Claude Code sends ``{"role": "system"}`` turns inside ``messages``: leading ones join ``system``,
    later ones stay where they are."""
    client, tok = server.anthropic(), server.llm.tokenizer
    messages = [
        {"role": "system", "content": "Follow the repository's style."},
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": "Which file?"},
        {"role": "system", "content": [{"type": "text", "text": "The user prefers short answers."}]},
        {"role": "user", "content": "main.py"},
    ]
    server.scripts.push(TURN3)
    msg = client.messages.create(model=MODEL, max_tokens=200, system="You are Claude Code.", messages=messages)
    assert msg.stop_reason == "end_turn" and msg.content[-1].text.startswith("In Paris")
    count = client.messages.count_tokens(model=MODEL, system="You are Claude Code.", messages=messages).input_tokens
    expected = [
        {"role": "system", "content": "You are Claude Code.\n\nFollow the repository's style."},
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": "Which file?"},
        {"role": "system", "content": "The user prefers short answers."},
        {"role": "user", "content": "main.py"},
    ]
    text, ids = render_chat(tok, expected)
    assert count == len(ids) == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert text.index("Which file?") < text.index("The user prefers short answers.") < text.index("main.py")


def test_documents_and_images_become_text(server):
    client, tok = server.anthropic(), server.llm.tokenizer
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Line one.\nLine two."},
           "title": "notes.txt"}
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    blocks = [doc, pdf, image, {"type": "text", "text": "Summarize."}]
    count = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": blocks}]).input_tokens
    text = f"notes.txt\n\nLine one.\nLine two.\n\n{DOCUMENT_NOTE}\n\n{IMAGE_NOTE}\n\nSummarize."
    assert count == len(render_chat(tok, [{"role": "user", "content": text}])[1])
    # OpenAI chat image_url parts: the same note (it was a 400).
    parts = [{"type": "text", "text": "What is this? "},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    server.scripts.push(TURN3)
    r = server.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                                temperature=0)
    assert r.usage.prompt_tokens == len(
        render_chat(tok, [{"role": "user", "content": "What is this? " + IMAGE_NOTE}])[1])


def test_context_overflow_uses_the_wording_anthropic_clients_parse(server):
    client = server.anthropic()
    limit = server.llm.max_model_len - 1
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "word " * 5000}])
    m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", info.value.body["error"]["message"])
    assert m and int(m.group(1)) > int(m.group(2)) == limit
    with pytest.raises(anthropic.BadRequestError):  # count_tokens is not limited; messages are
        client.messages.create(model=MODEL, max_tokens=10, system="word " * 5000,
                               messages=[{"role": "user", "content": "hi"}])
    # The OpenAI APIs keep their own wording and code.
    r = httpx.post(server.base + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]})
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_responses_namespace_tools_are_flattened_and_unservable_tools_rejected(server):
    client = server.openai()
    namespace = {"type": "namespace", "name": "collaboration", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.",
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}},
        {"type": "function", "name": "wait_agent", "parameters": {"type": "object", "properties": {}}},
    ]}
    tools = [{"type": "function", **TOOLS[0]["function"]}, namespace]
    r = client.responses.create(model=MODEL, input="Delegate this.", tools=tools,
                                tool_choice={"type": "function", "name": "spawn_agent"}, max_output_tokens=60,
                                temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "spawn_agent" and "message" in json.loads(call.arguments)
    assert call.to_dict()["namespace"] == "collaboration"
    # The model saw every function, the namespaced ones by their own names.
    server.scripts.push(TURN1)
    history = [{"role": "user", "content": "Delegate this."},
               {"type": "function_call", "call_id": call.call_id, "name": "spawn_agent", "namespace": "collaboration",
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "agent a1 started"}]
    r2 = client.responses.create(model=MODEL, input=history, tools=tools, temperature=0)
    assert [o.type for o in r2.output][-1] == "function_call" and "namespace" not in r2.output[-1].to_dict()
    for bad, kind in (({"type": "custom", "name": "apply_patch", "description": "Patch."}, "custom"),
                      ({"type": "web_search"}, "web_search")):
        rr = httpx.post(server.base + "/v1/responses", json={"model": MODEL, "input": "x", "tools": [tools[0], bad]})
        assert rr.status_code == 400 and rr.json()["error"]["param"] == "tools"
        assert rr.json()["error"]["message"].startswith(f"tools[1]: tools of type '{kind}'")
    rr = httpx.post(server.base + "/v1/responses", json={"model": MODEL, "input": "x", "tools": [
        {**namespace, "tools": [{"type": "custom", "name": "x"}]}]})
    assert rr.status_code == 400
    assert rr.json()["error"]["message"].startswith("tools[0].tools[0]: tools of type 'custom'")


def test_a_long_prompt_that_fits_is_counted_then_tokenized_whole(server):
    """A text over 8 characters per token of the limit (here runs of indentation, 128 characters a token
    in Qwen3's vocabulary) is counted in pieces first; when it fits, its tokens are those of the whole
    text, and the request is served."""
    from edgemoe.server.config import ServerConfig
    from edgemoe.server.serving import COUNT_FIRST_CHARS_PER_TOKEN, Serving

    llm = server.llm
    text = "".join(f"def f{i}():\n" + " " * 250 + "return 1\n" for i in range(300))
    assert len(text) > COUNT_FIRST_CHARS_PER_TOKEN * llm.prompt_limit
    serving = Serving(llm, ServerConfig())
    whole = llm.tokenizer.encode(text, add_special_tokens=False)
    assert serving.encode_prompt(text, "messages") == whole and len(whole) < llm.prompt_limit
    r = server.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                max_tokens=2)
    assert r.usage.prompt_tokens > len(whole)
