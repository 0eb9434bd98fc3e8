"""Output parsers (every family), their registry and the JSON-prefix automaton they stream arguments with.

Every parser must give the same result whatever the streaming chunk boundaries: each input is fed
whole, cut at every single character position, and one character at a time. Malformed tool-call
markup must come back as text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from edgemoe.server import json_prefix
from edgemoe.server.parsers import ParsedOutput, ParserConfig, ToolCall, collect, detect_parsers, resolve_parsers
from edgemoe.server.parsers.deepseek_v3 import DeepSeekV3ToolParser
from edgemoe.server.parsers.harmony import HarmonyParser
from edgemoe.server.parsers.qwen3 import Qwen3ToolParser
from edgemoe.server.parsers.qwen3_coder import Qwen3CoderToolParser

TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers"


def _feed(make, pieces: list[str]) -> tuple[ParsedOutput, list]:
    parser = make()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return collect(events, parser.saw_reasoning), events


def parse_all_ways(make, text: str) -> ParsedOutput:
    """Parse ``text`` whole, split at every position, and char by char; all must agree."""
    whole, events = _feed(make, [text])
    for e in events:  # a call's name comes once, on its first event
        if e.kind == "tool_call":
            first = next(x for x in events if x.kind == "tool_call" and x.index == e.index)
            assert (e.name is not None) == (e is first)
    for i in range(1, len(text)):
        assert _feed(make, [text[:i], text[i:]])[0] == whole, f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    assert _feed(make, list(text))[0] == whole
    return whole


def chain(tool_cls, start_in_reasoning=False, tools=None):
    """The server's parser for a Qwen3-style prompt: think reasoning + a tool parser."""
    prompt = "<|im_start|>assistant\n<think>\n" if start_in_reasoning else "<|im_start|>assistant\n"
    reasoning = "think" if tool_cls is not HarmonyParser else "harmony"
    cfg = ParserConfig(tool_cls.name if tool_cls else "none", reasoning)
    return lambda: cfg.build(prompt, tools or [{"type": "function", "function": {"name": "f"}}])


# ---------------------------------------------------------------- Qwen3 (JSON in <tool_call>)


def test_qwen3_tool_calls_with_reasoning():
    text = (
        "<think>\nNeed two calls.\n</think>\n\nChecking both.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5e1, true, null], '
        '"q": "a \\"b\\" \\u00e9"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    out = parse_all_ways(chain(Qwen3ToolParser), text)
    assert out.reasoning == "Need two calls." and out.content == "Checking both."
    assert out.tool_calls == [
        ToolCall(0, "get_weather", '{"city": "Paris", "days": [1, 2.5e1, true, null], "q": "a \\"b\\" \\u00e9"}'),
        ToolCall(1, "get_time", "{}"),
    ]
    assert json.loads(out.tool_calls[0].arguments)["q"] == 'a "b" é'


def test_qwen3_variants_and_text_around_calls():
    # Keys in another order, and arguments as a JSON-encoded string: read whole at </tool_call>.
    out = parse_all_ways(chain(Qwen3ToolParser),
                         '<tool_call>{"arguments": "{\\"a\\": 1}", "name": "f"}</tool_call> done')
    assert out.tool_calls == [ToolCall(0, "f", '{"a": 1}')] and out.content == "done"
    # No closing tag before EOS: the call is still complete.
    out = parse_all_ways(chain(Qwen3ToolParser), 'x<tool_call>\n{"name": "f", "arguments": {"k": "v"}}\n')
    assert out.tool_calls == [ToolCall(0, "f", '{"k": "v"}')] and out.content == "x"
    # A <tool_call> inside the reasoning is reasoning.
    out = parse_all_ways(chain(Qwen3ToolParser), '<think>maybe <tool_call> later</think>Fine.')
    assert out.reasoning == "maybe <tool_call> later" and out.content == "Fine." and not out.tool_calls


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("<tool_call>\nnot json at all\n</tool_call> after", "<tool_call>\nnot json at all\n</tool_call> after", []),
        ('<tool_call>{"name": 5, "arguments": {}}</tool_call>', '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
         []),
        ("answer <tool_call>\n{\"name\": \"f\"", "answer", []),  # cut in the header (max_tokens): markup dropped
        ("a <tool_c", "a <tool_c", []),  # half a tag at the end is text
        ("x <tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1]}</tool_call>", "x]}</tool_call>",
         [ToolCall(0, "f", '{"a": 1')]),  # broke after the call was announced: the rest is text
        ('<tool_call>{"name": "f", "arguments": {"a": 1}, "x": 2}</tool_call>', ', "x": 2}</tool_call>',
         [ToolCall(0, "f", '{"a": 1}')]),  # unexpected tail
        ('<tool_call>{"name": "f", "arguments": {"a": "cut', None, [ToolCall(0, "f", '{"a": "cut')]),  # max_tokens
    ],
)
def test_qwen3_malformed_is_text(text, content, calls):
    out = parse_all_ways(chain(Qwen3ToolParser), text)
    assert out.content == content and out.tool_calls == calls


# ---------------------------------------------------------------- Qwen3-Coder (XML)

CODER_TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
    "cmd": {"type": "string"}, "timeout": {"type": "integer"}, "ratio": {"type": "number"}, "dry": {"type": "boolean"},
    "env": {"type": "object"}, "args": {"type": "array"}}}}}]


def test_qwen3_coder_xml_calls_typed_by_schema():
    text = (
        "Running it.\n<tool_call>\n<function=run>\n<parameter=cmd>\nls -la <dir>\n</parameter>\n"
        "<parameter=timeout>\n30\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=dry>\nfalse\n"
        "</parameter>\n<parameter=env>\n{\"A\": \"1\"}\n</parameter>\n<parameter=args>\n[1, 2]\n</parameter>\n"
        "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run>\n</function>\n</tool_call>"
    )
    out = parse_all_ways(lambda: Qwen3CoderToolParser(CODER_TOOLS), text)
    assert out.content == "Running it."
    assert [c.name for c in out.tool_calls] == ["run", "run"]
    assert json.loads(out.tool_calls[0].arguments) == {
        "cmd": "ls -la <dir>", "timeout": 30, "ratio": 0.5, "dry": False, "env": {"A": "1"}, "args": [1, 2],
        "extra": "42"}
    assert out.tool_calls[1].arguments == "{}"


def test_qwen3_coder_lenient_and_malformed():
    # A missing </parameter> and a <function= without <tool_call>.
    out = parse_all_ways(lambda: Qwen3CoderToolParser(CODER_TOOLS), "<function=run>\n<parameter=cmd>\npwd\n</function>")
    assert out.tool_calls == [ToolCall(0, "run", '{"cmd": "pwd"}')] and out.content is None
    out = parse_all_ways(lambda: Qwen3CoderToolParser(CODER_TOOLS), "<tool_call>\n<oops>\n</tool_call>")
    assert out.content == "<tool_call>\n<oops>\n</tool_call>" and not out.tool_calls
    out = parse_all_ways(lambda: Qwen3CoderToolParser(CODER_TOOLS),
                         "<function=run>\n<parameter=timeout>\nsoon\n</parameter>\nhm")
    assert out.tool_calls == [ToolCall(0, "run", '{"timeout": "soon"}')] and out.content == "\nhm"


# ---------------------------------------------------------------- DeepSeek-V3

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def test_deepseek_v3_calls():
    text = (f"Sure.{B}{CB}function{SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{CE}\n"
            f"{CB}function{SEP}get_time\n```json\n{{}}\n```{CE}{E}")
    out = parse_all_ways(chain(DeepSeekV3ToolParser), text)
    assert out.content == "Sure."
    assert out.tool_calls == [ToolCall(0, "get_weather", '{"city": "Paris"}'), ToolCall(1, "get_time", "{}")]
    # DeepSeek-V3.1 form: name<sep>{args}.
    out = parse_all_ways(chain(DeepSeekV3ToolParser), f"{B}{CB}get_weather{SEP}{{\"city\": \"Rome\"}}{CE}{E}")
    assert out.tool_calls == [ToolCall(0, "get_weather", '{"city": "Rome"}')] and out.content is None
    # Round trip with the history markup the server renders.
    calls = [{"type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}]
    out = parse_all_ways(chain(DeepSeekV3ToolParser), DeepSeekV3ToolParser.history_markup(calls))
    assert out.tool_calls == [ToolCall(0, "f", '{"a": [1]}')]


def test_deepseek_v3_malformed_is_text():
    bad = f"{B}{CB}garbage without sep{CE}{E}"
    out = parse_all_ways(chain(DeepSeekV3ToolParser), bad)
    assert out.content == bad and not out.tool_calls
    out = parse_all_ways(chain(DeepSeekV3ToolParser), f"ok {B}")  # cut after the open tag: markup dropped
    assert out.content == "ok" and not out.tool_calls


# ---------------------------------------------------------------- Harmony (gpt-oss)


def test_harmony_channels_and_calls():
    text = (
        "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    )
    out = parse_all_ways(chain(HarmonyParser), text)
    assert out.reasoning == "User wants weather." and out.content is None
    assert out.tool_calls == [ToolCall(0, "get_weather", '{"city":"Paris"}')]
    text = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me say."
            "<|end|><|start|>assistant<|channel|>final<|message|>It is 4.")
    out = parse_all_ways(chain(HarmonyParser), text)
    assert (out.reasoning, out.content, out.tool_calls) == ("Easy.", "Let me say.It is 4.", [])
    # Recipient in the role part, and a second call.
    text = ('<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{}<|call|>'
            '<|start|>assistant to=functions.b<|channel|>commentary<|message|>{"x": 1}')
    out = parse_all_ways(chain(HarmonyParser), text)
    assert out.tool_calls == [ToolCall(0, "a", "{}"), ToolCall(1, "b", '{"x": 1}')]


def test_harmony_malformed_is_text():
    out = parse_all_ways(chain(HarmonyParser), "no header here")
    assert out.content == "no header here"
    out = parse_all_ways(chain(HarmonyParser), "<|channel|>analysis")  # header cut off: markup dropped
    assert not out.content and out.reasoning is None and not out.tool_calls


# ---------------------------------------------------------------- think


def test_think_only_and_plain():
    make = chain(None)
    out = parse_all_ways(make, "<think>\nHmm.\n</think>\n\nAnswer <think> stays")
    assert (out.reasoning, out.content) == ("Hmm.", "Answer <think> stays")
    out = parse_all_ways(chain(None, start_in_reasoning=True), "Still thinking\n</think>\n\nDone")
    assert (out.reasoning, out.content) == ("Still thinking", "Done")
    out = parse_all_ways(make, "Plain <tool_call>")  # no tool parser: markup is text
    assert out == ParsedOutput(None, "Plain <tool_call>", [])


def test_random_chunkings_of_a_long_transcript():
    text = ("<think>\nplan: " + "step " * 40 + "\n</think>\n\nok " + "".join(
        f'<tool_call>\n{{"name": "t{i}", "arguments": {{"i": {i}, "s": "x{{}}\\n"}}}}\n</tool_call>\n'
        for i in range(5)))
    whole = _feed(chain(Qwen3ToolParser), [text])[0]
    assert [c.name for c in whole.tool_calls] == [f"t{i}" for i in range(5)]
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), 25))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _feed(chain(Qwen3ToolParser), pieces)[0] == whole


# ---------------------------------------------------------------- registry


class _FakeTokenizer:
    def __init__(self, vocab, template=""):
        self._vocab, self.chat_template = {t: i for i, t in enumerate(vocab)}, template

    def get_vocab(self):
        return self._vocab


def test_detection_rules():
    assert detect_parsers("gpt_oss", _FakeTokenizer([]))[:2] == ("harmony", "harmony")
    assert detect_parsers(None, _FakeTokenizer(["<|channel|>", "<|message|>"]))[:2] == ("harmony", "harmony")
    coder = _FakeTokenizer(["<tool_call>", "<think>", "</think>"], "... <function=name>\n<parameter=p> ...")
    assert detect_parsers("qwen3_moe", coder)[:2] == ("qwen3_coder", "think")
    assert detect_parsers("qwen3_moe", _FakeTokenizer(["<tool_call>"]))[:2] == ("qwen3", "none")
    assert detect_parsers("llama", _FakeTokenizer(["a"]))[:2] == ("none", "none")
    cfg = resolve_parsers("hermes", "none", "qwen3_moe", coder)
    assert (cfg.tool, cfg.reasoning) == ("hermes", "none") and "command line" in cfg.why
    with pytest.raises(ValueError, match="--tool-call-parser: unknown parser 'nope'"):
        resolve_parsers("nope", None, None, coder)


@pytest.mark.parametrize("name, expected", [("qwen3", ("qwen3", "think")), ("deepseek_v3", ("deepseek_v3", "none"))])
def test_detection_on_real_tokenizers(name, expected):
    if not (TOKENIZERS / name / "tokenizer.json").exists():
        pytest.skip(f"tokenizer fixture {name} not found")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZERS / name))
    assert detect_parsers("qwen3_moe", tok)[:2] == expected


# ---------------------------------------------------------------- JSON prefix automaton


def _advance(doc: str):
    state = json_prefix.initial()
    for ch in doc:
        state = json_prefix.step(state, ch)
        if state is None:
            return None
    return state


@pytest.mark.parametrize("doc", ['{"a": [1, -2.5e+3, true, false, null, {"b": "\\u00e9\\n"}], "c": {}}', "[]", "0",
                                 '"x"', "-0.5E2"])
def test_json_prefix_accepts_valid_json(doc):
    json.loads(doc)
    for i in range(len(doc)):
        assert _advance(doc[:i]) is not None, doc[:i]  # every prefix stays a JSON prefix
    assert json_prefix.is_complete(_advance(doc))


@pytest.mark.parametrize("doc", ['{"a" 1}', "[1,]", "01", '{"a": tru}', '"\x01"', "{,}", '{"a": 1}}', "1.e5", "nul "])
def test_json_prefix_rejects_invalid_json(doc):
    assert not json_prefix.is_complete(_advance(doc))
