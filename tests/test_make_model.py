"""Tests of edgemoe.synth: random-weight checkpoints in the Hugging Face layout."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from edgemoe.synth import (
    ADDED_TOKENS,
    BUILT_VOCAB,
    PRESETS,
    SPECIAL_TOKENS,
    build_tokenizer,
    config_for,
    make_model,
    param_count,
    write_config_only,
)

QWEN3_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers" / "qwen3"
needs_qwen3 = pytest.mark.skipif(
    not (QWEN3_TOKENIZER / "tokenizer.json").is_file(),
    reason=f"Qwen3 tokenizer fixture not found at {QWEN3_TOKENIZER}",
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
        ],
    },
    {"role": "tool", "content": '{"temp": 18}'},
    {"role": "tool", "content": '{"temp": 21}'},
]


def _read_safetensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                assert k not in out, f"{k} in two shards"
                out[k] = sf.get_tensor(k)
    return out


def _per_expert_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers-5 in-memory state dict (fused experts) in the release per-expert layout."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{k[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :inter]  # [I, H]
                out[f"{k[: -len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, inter:]  # [I, H]
        elif k.endswith("mlp.experts.down_proj"):  # [E, H, I]
            for e in range(v.shape[0]):
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e]  # [H, I]
        else:
            out[k] = v
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny"), "qwen3_moe", "tiny", seed=0)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None, BUILT_VOCAB)


# ------------------------------------------------------------------------------------------------
# checkpoint


def test_tiny_files_and_config(tiny: Path):
    names = {p.name for p in tiny.iterdir()}
    expected = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= names
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["dtype"] == "bfloat16"
    geo = PRESETS["qwen3_moe"]["tiny"]
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "mlp_only_layers"):
        assert cfg[k] == geo[k], k
    assert cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg["num_local_experts"] == cfg["num_experts"] == 16
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert cfg["norm_topk_prob"] is True and cfg["tie_word_embeddings"] is False

    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny))
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= len(t)
    im_end, eot = t.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert cfg["eos_token_id"] == [im_end, eot] and cfg["pad_token_id"] == eot
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, eot]
    assert gen["pad_token_id"] == eot
    assert gen["bos_token_id"] is None


def test_tiny_keys_are_per_expert_hf_layout(tiny: Path):
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    config = AutoConfig.from_pretrained(str(tiny))
    torch.manual_seed(0)
    fresh = Qwen3MoeForCausalLM(config).to(torch.bfloat16)  # same seed, same init as make_model
    expected = _per_expert_layout(fresh.state_dict())
    saved = _read_safetensors(tiny)
    assert set(saved) == set(expected)

    n_moe = sum(1 for i in range(config.num_hidden_layers) if i not in config.mlp_only_layers)
    expert_keys = [k for k in saved if ".mlp.experts." in k]
    assert len(expert_keys) == n_moe * config.num_experts * 3
    assert "model.layers.0.mlp.experts.15.gate_proj.weight" in saved
    assert "model.layers.1.mlp.gate_proj.weight" in saved  # the dense layer
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in saved
    assert "lm_head.weight" in saved  # untied

    h, i_moe = config.hidden_size, config.moe_intermediate_size
    assert saved["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (i_moe, h)
    assert saved["model.layers.0.mlp.experts.3.up_proj.weight"].shape == (i_moe, h)
    assert saved["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (h, i_moe)
    assert saved["model.layers.0.mlp.gate.weight"].shape == (config.num_experts, h)
    assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (config.num_attention_heads * config.head_dim, h)
    assert saved["model.layers.0.self_attn.k_proj.weight"].shape == (config.num_key_value_heads * config.head_dim, h)
    assert saved["model.layers.0.self_attn.q_norm.weight"].shape == (config.head_dim,)
    # values: the seed-0 init, split gate | up in that order
    for k, v in expected.items():
        assert saved[k].dtype == torch.bfloat16, k
        assert torch.equal(saved[k], v), k
    assert sum(v.numel() for v in saved.values()) == param_count(config)


def test_tiny_reload_same_logits(tiny: Path):
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    config = AutoConfig.from_pretrained(str(tiny))
    torch.manual_seed(0)
    ref = Qwen3MoeForCausalLM(config).eval()
    for p in ref.parameters():  # cast the weights only: from_pretrained keeps rotary inv_freq fp32
        p.data = p.data.to(torch.bfloat16)
    model = Qwen3MoeForCausalLM.from_pretrained(str(tiny)).eval()
    assert model.dtype == torch.bfloat16
    ids = torch.tensor([[5, 17, 300, 42, 999, 7, 7, 128]])
    with torch.no_grad():
        a = model(ids).logits
        b = ref(ids).logits
    assert a.shape == (1, 8, config.vocab_size)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert a[0, -1].float().std() > 0.1  # not a flat distribution


def test_seed_determinism_and_dtype(tmp_path: Path, tiny: Path):
    a = _read_safetensors(tiny)
    b = _read_safetensors(make_model(tmp_path / "same", seed=0))
    c = _read_safetensors(make_model(tmp_path / "other", seed=1))
    f32 = _read_safetensors(make_model(tmp_path / "f32", seed=0, dtype="float32"))
    assert set(a) == set(b) == set(c) == set(f32)
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert f32[k].dtype == torch.float32
        assert torch.equal(f32[k].to(torch.bfloat16), a[k]), k  # fp32 init, then cast
    differ = [k for k in a if not torch.equal(a[k], c[k])]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in differ
    assert "model.embed_tokens.weight" in differ


def test_sharding_and_overrides(tmp_path: Path):
    out = make_model(
        tmp_path / "sharded",
        preset="tiny",
        max_shard_size="300KB",
        overrides={"num_hidden_layers": 2, "mlp_only_layers": []},
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    saved = _read_safetensors(out)
    assert set(saved) == set(index["weight_map"])
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in saved
    assert not any(k.startswith("model.layers.2.") for k in saved)
    umask = os.umask(0)
    os.umask(umask)
    assert all(s.stat().st_mode & 0o777 == 0o666 & ~umask for s in shards)  # not safetensors' 0600


def test_bad_arguments(tmp_path: Path):
    with pytest.raises(ValueError, match="tiny"):
        config_for("qwen3_moe", "huge")
    with pytest.raises(ValueError, match="qwen3_moe"):
        config_for("llama", "tiny")
    with pytest.raises(ValueError, match="bfloat16"):
        make_model(tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError):
        make_model(tmp_path / "y", preset="nope")
    with pytest.raises(ValueError, match="hidden_size"):
        config_for("qwen3_moe", "tiny", {"hidden_size": "wide"})


def test_config_for_30b_geometry():
    c = config_for("qwen3_moe", "qwen3-30b-a3b")
    assert type(c).__name__ == "Qwen3MoeConfig" and c.model_type == "qwen3_moe"
    assert c.architectures == ["Qwen3MoeForCausalLM"]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2048, 48, 32, 4, 128)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.intermediate_size) == (128, 8, 768, 6144)
    assert c.vocab_size == 151936
    assert c.rope_parameters["rope_theta"] == 1e6
    assert c.max_position_embeddings == 40960
    assert c.norm_topk_prob is True and c.tie_word_embeddings is False
    assert c.rms_norm_eps == 1e-6
    assert c.mlp_only_layers == [] and c.decoder_sparse_step == 1
    assert c.eos_token_id == [151645, 151643] and c.pad_token_id == 151643
    assert 30.4e9 < param_count(c) < 30.6e9  # "30.5B" on the model card
    c2 = config_for("qwen3_moe", "qwen3-30b-a3b", {"num_hidden_layers": 2, "rope_theta": 5e5})
    assert c2.num_hidden_layers == 2 and c2.rope_parameters["rope_theta"] == 5e5
    assert PRESETS["qwen3_moe"]["qwen3-30b-a3b"]["num_hidden_layers"] == 48  # presets not mutated


def test_small_preset_size():
    c = config_for("qwen3_moe", "small")
    assert 10e6 < param_count(c) * 2 < 100e6  # tens of MB in bf16
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.hidden_size) == (32, 8, 128, 256)


# ------------------------------------------------------------------------------------------------
# built tokenizer


def test_built_tokenizer_tokens(tok):
    assert len(tok) == BUILT_VOCAB
    base = BUILT_VOCAB - len(SPECIAL_TOKENS) - len(ADDED_TOKENS)
    for i, t in enumerate(SPECIAL_TOKENS + ADDED_TOKENS):  # Qwen3 order, after the BPE vocabulary
        assert tok.encode(t, add_special_tokens=False) == [base + i], t
        assert tok.convert_ids_to_tokens(base + i) == t
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert set(SPECIAL_TOKENS) <= set(tok.all_special_tokens)
    assert not set(ADDED_TOKENS) & set(tok.all_special_tokens)

    text = "Hello, world! def f(x):\n    return x * 42  # café 日本語 🚀"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges learned
    assert tok.encode("123", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "123"]  # digits split

    mixed = "<think>\nplan\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tok.encode(mixed, add_special_tokens=False)
    assert tok.decode(ids) == mixed
    assert tok.decode(ids, skip_special_tokens=True) == mixed.replace("<|im_end|>", "")


def test_built_tokenizer_deterministic(tok):
    assert build_tokenizer(None, BUILT_VOCAB).get_vocab() == tok.get_vocab()


def test_saved_tokenizer_roundtrip(tmp_path: Path, monkeypatch, tok):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    build_tokenizer(tmp_path, BUILT_VOCAB)
    t = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(t) == len(tok)
    assert t.eos_token == "<|im_end|>" and t.pad_token == "<|endoftext|>"
    s = "<|im_start|>user\nhi there<|im_end|>\n"
    assert t.encode(s) == tok.encode(s)
    rendered = t.apply_chat_template(TOOL_CONV, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(TOOL_CONV, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    ids = t.apply_chat_template(TOOL_CONV, tools=TOOLS, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert t.decode(ids) == rendered


def test_chat_template_render(tok):
    out = tok.apply_chat_template(TOOL_CONV, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert out.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    tools_block = re.search(r"<tools>\n(.*?)\n</tools>", out, re.S).group(1)
    assert [json.loads(line) for line in tools_block.split("\n")] == TOOLS
    assert "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n" in out
    assert (
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
    ) in out
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>\n{"temp": 21}\n'
        "</tool_response><|im_end|>\n"
    ) in out
    assert out.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")

    simple = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(simple, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(simple, tokenize=False, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    no_prompt = tok.apply_chat_template(simple, tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"
    # content None (OpenAI tool-call turns) and content parts
    odd = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {}}]},
    ]
    assert tok.apply_chat_template(odd, tokenize=False) == (  # last turn after the query: <think> block
        '<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n'
        '{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


@needs_qwen3
def test_chat_template_matches_qwen3(tok):
    """Same rendering as the real Qwen3 template, up to the prose of the tools preamble."""
    qwen3 = json.loads((QWEN3_TOKENIZER / "tokenizer_config.json").read_text())["chat_template"]

    def prose_free(s: str) -> str:
        s = re.sub(r"# Tools\n\n.*?<tools>", "<tools>", s, flags=re.S)
        return re.sub(r"</tools>\n\n.*?<tool_call>\n\{\"name\": <function-name>", "</tools>", s, flags=re.S)

    convs = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
         {"role": "user", "content": "q2"}],
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why"}],
        TOOL_CONV,
        TOOL_CONV + [{"role": "assistant", "content": "<think>\nok\n</think>\n\nParis 18, Lyon 21."}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "system", "content": "S2"}],
    ]
    for conv in convs:
        for tools in (None, TOOLS):
            for kw in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
                for gen in (True, False):
                    ours = tok.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=gen, **kw)
                    ref = tok.apply_chat_template(
                        conv, tools=tools, tokenize=False, add_generation_prompt=gen, chat_template=qwen3, **kw)
                    assert prose_free(ours) == prose_free(ref), (conv, tools, kw, gen)


# ------------------------------------------------------------------------------------------------
# copied tokenizer


@needs_qwen3
def test_copied_qwen3_tokenizer(tmp_path: Path):
    from transformers import AutoTokenizer

    out = make_model(tmp_path / "m", preset="tiny", tokenizer=QWEN3_TOKENIZER,
                     overrides={"num_hidden_layers": 1, "mlp_only_layers": []})
    t = AutoTokenizer.from_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] >= len(t) and cfg["vocab_size"] % 64 == 0
    assert cfg["vocab_size"] - len(t) < 64
    assert cfg["eos_token_id"] == [151645, 151643] and cfg["pad_token_id"] == 151643
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == cfg["vocab_size"]
    assert (out / "tokenizer.json").read_bytes() == (QWEN3_TOKENIZER / "tokenizer.json").read_bytes()
    assert "<tools>" in t.apply_chat_template(TOOL_CONV, tools=TOOLS, tokenize=False, add_generation_prompt=True)


@needs_qwen3
def test_write_config_only_30b(tmp_path: Path):
    out = write_config_only(tmp_path / "c", "qwen3_moe", "qwen3-30b-a3b", tokenizer=QWEN3_TOKENIZER)
    assert not list(out.glob("*.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["vocab_size"] == 151936
    assert cfg["num_experts"] == 128 and cfg["head_dim"] == 128 and cfg["rope_theta"] == 1e6
    assert cfg["dtype"] == "bfloat16"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643] and gen["pad_token_id"] == 151643 and gen["bos_token_id"] is None

    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(out))
    assert c.num_experts == 128 and c.rope_parameters["rope_theta"] == 1e6


def test_write_config_only_built_tokenizer(tmp_path: Path):
    out = write_config_only(tmp_path / "c", preset="qwen3-30b-a3b")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 151936  # the real geometry, even with a small tokenizer
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
