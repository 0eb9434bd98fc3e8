"""Bad input and bad clients at the HTTP edge: every failure is a clear 4xx naming the field (never a 500),
streams end with an error event and their terminator, bodies are bounded in size and time, half-sent
requests are dropped, and other clients are served meanwhile. A real uvicorn server on 127.0.0.1 over
the tiny model with the built-in tokenizer; real ``openai`` / ``anthropic`` SDKs and raw sockets."""

from __future__ import annotations

import json
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest

from edgemoe.config import EngineConfig
from edgemoe.engine.async_engine import AsyncLLM

from conftest import running_server

MESSAGES = [{"role": "user", "content": "Hello there."}]
LIMITS = {"max_request_bytes": 1 << 20, "max_messages": 64, "header_timeout_s": 1.0, "body_timeout_s": 1.0}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), EngineConfig(device="cpu", max_model_len=1024), progress=False)
    assert llm.wait_ready(120)
    try:
        with running_server(llm, "tiny", **LIMITS) as base:
            yield base, llm
    finally:
        llm.shutdown()


def _post(base: str, path: str, raw: str | bytes, **kw) -> httpx.Response:
    return httpx.post(base + path, content=raw, headers={"content-type": "application/json"}, timeout=60, **kw)


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _anthropic(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)


def _sse(r: httpx.Response) -> list[str]:
    return [line for line in r.iter_lines() if line]


# ---------------------------------------------------------------- lone surrogates


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions",
     '{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi \\ud800"}]}'),
    ("/v1/chat/completions", ('{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "a\\udc00b"}]}], "stop": ["\\ud83d"]}')),
    ("/v1/completions", '{"model": "tiny", "max_tokens": 3, "prompt": "x \\ud800 y"}'),
    ("/v1/messages", ('{"model": "tiny", "max_tokens": 3, "system": "s\\udfff", '
                      '"messages": [{"role": "user", "content": "hi \\ud800"}]}')),
    ("/v1/messages/count_tokens", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/responses", '{"model": "tiny", "max_output_tokens": 3, "input": "hi \\ud800", "instructions": "\\udbff"}'),
])
def test_lone_surrogates_in_text_are_replaced(server, path, body):
    base, _ = server
    r = _post(base, path, body)
    assert r.status_code == 200, r.text
    if path == "/v1/messages/count_tokens":
        fixed = json.loads(body.replace("\\ud800", "\\ufffd"))
        ok = _post(base, path, json.dumps(fixed)).json()
        assert r.json() == ok  # the same prompt as with U+FFFD in place of the surrogate


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_lone_surrogate_in_model_is_404_and_streams_are_whole(server, path):
    base, _ = server
    field = "input" if path == "/v1/responses" else "messages"
    body = {"model": "ti\ud800ny", "max_tokens": 3, "max_output_tokens": 3,
            field: MESSAGES if field == "messages" else "hi"}
    r = _post(base, path, json.dumps(body))  # json.dumps writes the lone surrogate as \ud800
    assert r.status_code == 404 and "ti\ufffdny" in r.text
    body["model"] = "tiny"
    body[field] = [{"role": "user", "content": "a\ud800"}] if field == "messages" else "a\ud800"
    with httpx.stream("POST", base + path, content=json.dumps({**body, "stream": True}),
                      headers={"content-type": "application/json"}, timeout=60) as r:
        lines = _sse(r)
        assert r.status_code == 200
    assert not any(line == "event: error" or '"error":{' in line.replace(" ", "") for line in lines)
    last = {"/v1/chat/completions": "data: [DONE]", "/v1/messages": "event: message_stop",
            "/v1/responses": "event: response.incomplete"}[path]
    assert last in lines[-2:]


# ---------------------------------------------------------------- seeds, template kwargs, message count


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_outside_64_bits_is_400(server, seed):
    base, _ = server
    c = _openai(base)
    for kw in ({}, {"stream": True}):
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, seed=seed, **kw)
        assert info.value.param == "seed"
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, seed=seed)
    assert info.value.param == "seed"
    r = _post(base, "/v1/responses", json.dumps({"model": "tiny", "input": "hi", "seed": seed, "stream": True}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    # The extremes a 64-bit generator takes are fine.
    for ok in (2**64 - 1, -(2**63)):
        r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, seed=ok, temperature=1.0)
        assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("seed", [True, 1.5, "3"], ids=["bool", "float", "string"])
def test_a_seed_that_is_not_an_integer_is_400(server, seed):
    """JSON true, 1.5 or "3" is not a seed (pydantic's lax mode took true as seed 1): a 400 naming ``seed``."""
    base, _ = server
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/responses", {"input": "hi"})):
        r = _post(base, path, json.dumps({"model": "tiny", "max_tokens" if "chat" in path else "max_output_tokens": 2,
                                          "seed": seed, **body}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", (path, r.text)


def test_stop_token_ids_outside_the_vocabulary_are_400(server):
    """A stop token id past the vocabulary could never stop anything: a 400 naming ``stop_token_ids``."""
    base, llm = server
    vocab = llm.model_config.vocab_size
    c = _openai(base)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"stop_token_ids": [vocab]})
    assert info.value.param == "stop_token_ids" and f"[0, {vocab})" in info.value.message
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                  extra_body={"stop_token_ids": [vocab - 1]})
    assert r.choices


def test_an_empty_anthropic_content_list_is_400(server):
    """An empty content list (Anthropic's API refuses one but in a final assistant message) was dropped from the
    conversation; alone it gave a 400 about an empty conversation. Now a 400 naming ``messages[i].content``."""
    base, _ = server
    a = _anthropic(base)
    for messages in ([{"role": "user", "content": []}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []},
                      {"role": "user", "content": "again"}]):
        with pytest.raises(anthropic.BadRequestError) as info:
            a.messages.create(model="tiny", messages=messages, max_tokens=2)
        bad = next(i for i, m in enumerate(messages) if m["content"] == [])
        assert f"messages[{bad}].content" in info.value.message
    r = a.messages.create(model="tiny", max_tokens=2,
                          messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}])
    assert r.content is not None


def test_huge_top_k_and_max_tokens_are_400(server):
    base, _ = server
    for field, value in (("top_k", 2**40), ("max_tokens", 2**70)):
        r = _post(base, "/v1/chat/completions", json.dumps({"model": "tiny", "messages": MESSAGES, field: value}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_anthropic_max_tokens_below_one_is_400_without_an_or_none(server):
    """``/v1/messages`` requires ``max_tokens``: a value below 1 is refused naming the field, without the OpenAI
    routes' "or None"."""
    base, _ = server
    for value in (-1, 0):
        r = _post(base, "/v1/messages", json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": value}))
        assert r.status_code == 400 and "max_tokens" in r.text and "None" not in r.text, r.text


def test_a_prompt_counted_whole_says_so(server):
    """A prompt just long enough for the piecewise count to cover all of it before passing the limit says it was
    counted whole, not "in its first N of M characters" with N > M."""
    base, _ = server
    text = "word " * 2000  # 10000 characters and the template's: counted piecewise (over 8 per token of the 1023
    with pytest.raises(openai.BadRequestError) as info:  # limit), in one piece (64 Ki characters) that is all of it
        _openai(base).chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2)
    msg = info.value.message
    assert info.value.code == "context_length_exceeded" and "counted in pieces, all " in msg and "first" not in msg, msg


@pytest.mark.parametrize("key", ["tools", "messages", "tokenize", "add_generation_prompt", "conversation", "documents",
                                 "namespace", "raise_exception"])  # the template's functions (a 500, or no checks)
def test_reserved_chat_template_kwargs_are_400(server, key):
    base, _ = server
    with pytest.raises(openai.BadRequestError) as info:
        _openai(base).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                              extra_body={"chat_template_kwargs": {key: True}})
    assert info.value.param == "chat_template_kwargs" and f"chat_template_kwargs.{key}" in info.value.message
    # A template variable is fine.
    r = _openai(base).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices


def test_a_template_that_fails_on_a_requests_values_is_400(server, monkeypatch):
    """Any exception the chat template raises on the request's values (here a TypeError: arithmetic on a
    string given in chat_template_kwargs) is a 400 naming the template, not a 500."""
    base, llm = server
    template = llm.tokenizer.chat_template
    monkeypatch.setattr(llm.tokenizer, "chat_template",
                        template + "{%- if depth is defined %}{{ depth + 1 }}{% endif %}")
    c = _openai(base)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                  extra_body={"chat_template_kwargs": {"depth": "deep"}})
    assert info.value.param == "messages" and "the chat template failed: TypeError" in info.value.message
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                  extra_body={"chat_template_kwargs": {"depth": 1}})
    assert r.choices


def test_too_many_messages_is_400(server):
    base, _ = server
    many = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 40  # 80 > 64
    with pytest.raises(openai.BadRequestError) as info:
        _openai(base).chat.completions.create(model="tiny", messages=many, max_tokens=2)
    assert info.value.param == "messages" and "at most 64" in info.value.message
    with pytest.raises(anthropic.BadRequestError) as info:
        _anthropic(base).messages.create(model="tiny", messages=many, max_tokens=2)
    assert "at most 64" in info.value.message
    r = _post(base, "/v1/responses", json.dumps({"model": "tiny", "input": many}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_too_many_items_are_refused_before_validation(server, monkeypatch):
    """The item count is checked on the parsed JSON, before pydantic validates every item (seconds for
    100k messages, during which the process's other threads wait on the GIL)."""
    base, _ = server
    from edgemoe.server import common

    calls = []
    real = common.valid_unicode
    monkeypatch.setattr(common, "valid_unicode", lambda value: calls.append(1) or real(value))
    many = [{"role": "user", "content": "hi"}] * 65  # > 64
    for path, body in (("/v1/chat/completions", {"messages": many}), ("/v1/messages", {"messages": many}),
                       ("/v1/messages/count_tokens", {"messages": many}), ("/v1/responses", {"input": many})):
        r = _post(base, path, json.dumps({"model": "tiny", "max_tokens": 2, **body}))
        assert r.status_code == 400 and "at most 64" in r.text, r.text
    assert not calls  # no request model was validated
    r = _post(base, "/v1/chat/completions", json.dumps({"model": "tiny", "max_tokens": 2, "messages": many[:64]}))
    assert r.status_code == 200 and calls


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "Hello there."}),
    ("/v1/messages", {"messages": MESSAGES}),
    ("/v1/messages/count_tokens", {"messages": MESSAGES}),
    ("/v1/responses", {"input": "Hello there."}),
])
def test_bodies_are_parsed_off_the_event_loop(server, monkeypatch, path, body):
    """Validating a body and tokenizing a completion prompt run on worker threads: /health answers while
    they take their time (slowed down here to 0.8 s each by sleeping, which releases the GIL as
    tokenizers' encode does)."""
    base, llm = server
    from edgemoe.server import common

    real_valid, real_encode = common.valid_unicode, llm.tokenizer.encode

    def slow(real):
        def call(*args, **kwargs):
            time.sleep(0.8)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(common, "valid_unicode", slow(real_valid))
    monkeypatch.setattr(llm.tokenizer, "encode", slow(real_encode))
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(base, stop, latencies))
    poller.start()
    try:
        time.sleep(0.1)
        r = _post(base, path, json.dumps({"model": "tiny", "max_tokens": 2, "max_output_tokens": 2, **body}))
        assert r.status_code == 200, r.text
    finally:
        stop.set()
        poller.join()
    assert latencies and max(latencies) < 0.4, max(latencies)


def test_a_prompt_far_over_the_limit_is_refused_before_it_is_tokenized_whole(server, monkeypatch):
    """A prompt text hundreds of times the context (megabytes of tool schemas took 10 s and 1 GB to
    tokenize, only to be refused) is counted piece by piece and refused once the count passes the limit."""
    base, llm = server
    lengths = []
    real = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text, **kw: lengths.append(len(text)) or real(text, **kw))
    text = "word " * 190_000  # 950k characters; the limit is 1023 tokens
    with pytest.raises(openai.BadRequestError) as info:
        _openai(base).chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2)
    assert info.value.code == "context_length_exceeded" and "at most 1023 are accepted" in info.value.message
    assert max(lengths) <= 2 * (1 << 16) and sum(lengths) < len(text) // 4, lengths
    lengths.clear()
    with pytest.raises(anthropic.BadRequestError) as ainfo:
        _anthropic(base).messages.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2)
    n = int(ainfo.value.message.split("prompt is too long: ")[1].split(" ")[0])
    assert f"prompt is too long: {n} tokens > 1023 maximum" in ainfo.value.message and n > 1023
    lengths.clear()
    with pytest.raises(openai.BadRequestError) as info:
        _openai(base).completions.create(model="tiny", prompt=text, max_tokens=2)
    assert info.value.code == "context_length_exceeded" and max(lengths) <= 2 * (1 << 16)
    # Counting tokens is not limited by the context: the whole text is counted.
    n = _anthropic(base).messages.count_tokens(model="tiny", messages=[{"role": "user", "content": text}]).input_tokens
    assert n > 100_000
    # Under the limit, the count changes nothing: the prompt is tokenized whole, as before.
    lengths.clear()
    r = _openai(base).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert r.choices and len(lengths) == 1


# ---------------------------------------------------------------- options that cannot be honoured


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("/v1/messages", {"messages": MESSAGES, "tool_choice": {"type": "any"}}),
    ("/v1/messages", {"messages": MESSAGES, "tool_choice": {"type": "tool", "name": "f"}}),
    ("/v1/responses", {"input": "hi", "tool_choice": "required"}),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "f"}}),
])
def test_a_tool_choice_that_forces_a_call_without_tools_is_400(server, path, body):
    """``required`` / ``any`` or a named function with no tools offered cannot be honoured: a 400 naming
    ``tool_choice``, not a text answer."""
    base, _ = server
    for stream in (False, True):
        r = _post(base, path, json.dumps({"model": "tiny", "max_tokens": 8, "max_output_tokens": 8, **body,
                                          "stream": stream}))
        assert r.status_code == 400 and "tool_choice" in r.text, r.text
        if path != "/v1/messages":
            assert r.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("path, field, value, harmless", [
    ("/v1/chat/completions", "logit_bias", {"5": 100}, {}),
    ("/v1/chat/completions", "top_logprobs", 3, 0),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {"type": "object"}}], []),
    ("/v1/chat/completions", "function_call", {"name": "f"}, "auto"),
    ("/v1/chat/completions", "modalities", ["text", "audio"], ["text"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}, None),
    ("/v1/completions", "logit_bias", {"5": 100}, None),
    ("/v1/completions", "best_of", 3, 1),
    ("/v1/completions", "suffix", "return x", None),
    ("/v1/responses", "top_logprobs", 5, 0),
    ("/v1/responses", "conversation", "conv_123", None),
    ("/v1/responses", "prompt", {"id": "pmpt_123"}, None),
    ("/v1/responses", "background", True, False),
    ("/v1/messages", "mcp_servers", [{"type": "url", "url": "https://example.com/sse", "name": "x"}], []),
])
def test_options_this_server_cannot_honour_are_400(server, path, field, value, harmless):
    """An option that would change the answer and that the server does not implement is a 400 naming it,
    never silently ignored; its neutral value (what SDKs send by default) is accepted."""
    base, _ = server
    body = {"model": "tiny", "max_tokens": 2, "max_output_tokens": 2}
    body |= {"/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}.get(path, {"messages": MESSAGES})
    for stream in (False, True):
        r = _post(base, path, json.dumps({**body, field: value, "stream": stream}))
        assert r.status_code == 400 and field in r.text and "not supported" in r.text, r.text
        if path != "/v1/messages":
            assert r.json()["error"]["param"] == field
    r = _post(base, path, json.dumps({**body, field: harmless}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_penalties_change_the_answer_and_bad_ones_are_400(server, path):
    """``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty`` are applied (the engine's tests check
    the arithmetic): a large one changes a greedy answer that repeats tokens, a neutral one leaves it as it was, and
    one out of range is a 400 naming it."""
    base, _ = server
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0}
    body |= {"prompt": "one one one one"} if path == "/v1/completions" else {"messages": MESSAGES}

    def text(**kw):
        r = _post(base, path, json.dumps({**body, **kw}))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice.get("text", (choice.get("message") or {}).get("content"))

    plain = text()
    assert text(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1) == plain
    changed = [text(**{name: value}) != plain for name, value in
               (("frequency_penalty", 2), ("presence_penalty", 2), ("repetition_penalty", 3.0))]
    assert any(changed), plain
    for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
        r = _post(base, path, json.dumps({**body, name: value}))
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_an_anthropic_client_tool_without_input_schema_is_400(server):
    """A client tool (no ``type``, or ``custom``) needs an ``input_schema``: without one it is a 400 naming it, not
    dropped from the tools the model is offered; typed server tools stay accepted (and not offered)."""
    base, _ = server
    body = {"model": "tiny", "max_tokens": 2, "messages": MESSAGES}
    for tool in ({"name": "get_weather"}, {"type": "custom", "name": "get_weather", "description": "x"}):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = _post(base, path, json.dumps({**body, "tools": [{"name": "ok", "input_schema": {"type": "object"}},
                                                                tool]}))
            assert r.status_code == 400 and "tools[1].input_schema" in r.text, r.text
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    r = _post(base, "/v1/messages", json.dumps({**body, "tools": [server_tool]}))
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- stop strings


def test_stop_lists_are_bounded(server):
    """Every stop string is looked for after every token on the engine thread (500k of them made a
    request beside it 8x slower): more than MAX_STOPS is a 400 naming the field."""
    from edgemoe.engine.sampling import MAX_STOPS

    base, _ = server
    c = _openai(base)
    stops = [f"s{i}" for i in range(MAX_STOPS + 1)]
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stop=stops)
    assert info.value.param == "stop" and f"at most {MAX_STOPS}" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                  extra_body={"stop_token_ids": list(range(MAX_STOPS + 1))})
    assert info.value.param == "stop_token_ids"
    with pytest.raises(anthropic.BadRequestError) as info:
        _anthropic(base).messages.create(model="tiny", messages=MESSAGES, max_tokens=2, stop_sequences=stops)
    assert "stop_sequences: at most" in info.value.message
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stop=stops[:MAX_STOPS])
    assert r.choices


# ---------------------------------------------------------------- a failure mid-stream


@pytest.mark.parametrize("path, last", [
    ("/v1/chat/completions", "data: [DONE]"),
    ("/v1/completions", "data: [DONE]"),
    ("/v1/messages", None),
    ("/v1/responses", None),
])
def test_failure_mid_stream_is_an_error_event_then_the_end(server, monkeypatch, path, last):
    """Any exception after a stream started (here: in the output parser, or the detokenized text
    for text completions) ends it with the API's error event, never a dropped connection."""
    base, llm = server
    from edgemoe.server import serving as serving_module

    real = serving_module.Serving.events

    async def exploding(gen, parser):
        async for events, out in real(gen, parser):
            yield events, out
            raise RuntimeError("parser exploded")

    monkeypatch.setattr(serving_module.Serving, "events", staticmethod(exploding))
    if path == "/v1/completions":
        real_generate = llm.generate

        async def failing(*a, **kw):
            async for out in real_generate(*a, **kw):
                yield out
                raise ValueError("detokenizer exploded")

        monkeypatch.setattr(llm, "generate", failing)
    body = {"model": "tiny", "max_tokens": 50, "stream": True, "ignore_eos": True}
    body |= {"/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}.get(path, {"messages": MESSAGES})
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = _sse(r)
    text = "\n".join(lines)
    assert "exploded" in text
    if last is not None:
        assert lines[-1] == last and '"error"' in lines[-2]
    elif path == "/v1/messages":
        assert lines[-2] == "event: error" and '"api_error"' in lines[-1]
    else:
        assert lines[-2] == "event: response.failed" and '"status":"failed"' in lines[-1].replace(" ", "")
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while llm.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.num_unfinished == 0  # the aborted request freed its pages
    assert llm.call_in_engine_thread(lambda e: e.runner.kv_free_tokens() == e.runner.kv_capacity_tokens, 30)


# ---------------------------------------------------------------- body size and read timeouts


def _health_latencies(base: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=10) as http:
        while not stop.is_set():
            t = time.monotonic()
            assert http.get(base + "/health").status_code == 200
            out.append(time.monotonic() - t)
            time.sleep(0.02)


def test_body_over_the_limit_is_413_at_once(server):
    base, _ = server
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (10 << 20)}]}).encode()
    for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
        start = time.monotonic()
        r = _post(base, path, big)
        assert r.status_code == 413 and time.monotonic() - start < 2
        if shape == "openai":
            assert r.json()["error"]["code"] == "request_too_large"
            assert "--max-request-bytes" in r.json()["error"]["message"]
        else:
            assert r.json()["error"]["type"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as info:
        _openai(base).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * (2 << 20)}])
    assert info.value.status_code == 413

    # Without Content-Length (chunked), the body is cut off as soon as it passes the limit.
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(64):
            yield b"z" * (64 << 10)
        yield b'"}]}'

    r = httpx.post(base + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413


def test_slow_and_half_sent_requests_are_dropped_while_others_are_served(server):
    """A body that trickles in gets a 408; connections that stop mid-headers or mid-body are closed;
    /health answers throughout."""
    base, _ = server
    host, port = base.removeprefix("http://").split(":")
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(base, stop, latencies))
    poller.start()
    try:
        def trickle():
            yield b'{"model": "tiny", "messages": ['
            for _ in range(30):
                time.sleep(0.1)
                yield b'{"role": "user", "content": "slow"},'
            yield b'{"role": "user", "content": "end"}]}'

        start = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", content=trickle(), headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 408 and "--body-timeout-s" in r.json()["error"]["message"]
        assert time.monotonic() - start < 2.5

        half = []
        for i in range(60):
            s = socket.create_connection((host, int(port)))
            if i % 2:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            else:
                s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"model\":")
            half.append(s)
        time.sleep(2.5)
        for s in half:
            s.settimeout(2)
            data = b""
            while chunk := s.recv(65536):  # the server closed it (a 408 first for a half-sent body)
                data += chunk
            assert data == b"" or data.startswith(b"HTTP/1.1 408"), data[:100]
            s.close()
    finally:
        stop.set()
        poller.join()
    assert latencies and max(latencies) < 0.5, max(latencies)
