"""A coding-agent request with a 30k-token system prompt, end to end (Anthropic SDK, streaming).

Prefill of 30k tokens is quadratic in attention; the engine's attention (GQA through SDPA's math
kernel on CPU) took 147 s for the 4-layer, 4-head tiny model on the 2-core CI machine, so this test
uses a 1-layer, 1-head variant of it (measured: ~12 s for the 30k-token prefill). The point is the
path: template, tokenizer, admission against ``max_model_len``/KV capacity, chunked prefill (four
8192-token chunks), parsing, streaming.
"""

from __future__ import annotations

import re
import time

import pytest
from test_agents_openai import TURN1

from conftest import QWEN3_TOKENIZER_DIR, start_agent_server

MODEL = "qwen3-long"
TARGET_TOKENS = 30_000


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    if not (QWEN3_TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"Qwen3 tokenizer fixture not found at {QWEN3_TOKENIZER_DIR}")
    from edgemoe.synth import make_model

    overrides = {"max_position_embeddings": 40960, "num_hidden_layers": 1, "num_attention_heads": 1,
                 "num_key_value_heads": 1, "mlp_only_layers": []}
    return make_model(tmp_path_factory.mktemp("long") / "long", "qwen3_moe", "tiny",
                      tokenizer=QWEN3_TOKENIZER_DIR, dtype="float32", overrides=overrides)


def _system_prompt(tok) -> str:
    """An agent-style system prompt (rules and tool documentation) of at least TARGET_TOKENS tokens."""

    def rule(i: int) -> str:
        return (
            f"\n## Rule {i}\nWhen editing file src/module_{i}.py, run `pytest tests/test_module_{i}.py -q` afterwards, "
            f"keep functions under {40 + i % 17} lines, and never commit secrets (API keys, tokens, passwords). "
            f"Tool `bash_{i % 7}` runs a shell command with a {30 + i % 90}s timeout; prefer `rg` over `grep`.\n"
        )

    head = "You are an autonomous coding agent working in a git repository. Follow the rules below.\n"
    per_rule = len(tok.encode("".join(rule(i) for i in range(100)))) / 100
    text = head + "".join(rule(i) for i in range(int(TARGET_TOKENS / per_rule) + 20))
    assert len(tok.encode(text)) >= TARGET_TOKENS
    return text


def test_30k_token_system_prompt_round_trip(long_model_dir):
    engine = {"max_model_len": 32768, "kv_cache_tokens": 32768}
    with start_agent_server(long_model_dir, MODEL, engine_options=engine) as srv:
        system = _system_prompt(srv.llm.tokenizer)
        client = srv.anthropic()
        tools = [{"name": "get_weather",
                  "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
        messages = [{"role": "user", "content": "What's the weather in Paris?"}]
        counted = client.messages.count_tokens(model=MODEL, system=system, messages=messages, tools=tools).input_tokens
        assert TARGET_TOKENS <= counted < 32768
        srv.scripts.push(TURN1)
        start = time.monotonic()
        with client.messages.stream(model=MODEL, max_tokens=200, system=system, messages=messages,
                                    tools=tools) as stream:
            final = stream.get_final_message()
        elapsed = time.monotonic() - start
        print(f"\n30k-token system prompt: {counted} prompt tokens, request took {elapsed:.1f} s")
        assert final.usage.input_tokens == counted
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[2].input == {"city": "Paris", "unit": "celsius"} and final.stop_reason == "tool_use"
        # A prompt over the limit is refused at once, in Anthropic's error shape.
        import anthropic

        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=MODEL, max_tokens=10, system=system + system, messages=messages)
        # Anthropic's wording, which Claude Code parses: the largest prompt accepted is max_model_len - 1.
        assert re.fullmatch(r"prompt is too long: \d+ tokens > 32767 maximum", info.value.body["error"]["message"])
