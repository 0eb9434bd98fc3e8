"""Random-weight test checkpoints in the exact Hugging Face layout.

`make_model` instantiates the ``transformers`` class of an architecture (``Qwen3MoeForCausalLM`` for
``qwen3_moe``) from a preset geometry, seeds its random init and calls ``save_pretrained``, so the
tensor names, shapes and config keys are those that ``transformers`` reads and writes for real
releases. ``transformers`` 5 keeps experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``) but saves the per-expert release layout
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``.

The tokenizer is either copied from a directory (e.g. a real Qwen3 tokenizer) or built here: a small
byte-level BPE trained in well under a second on the built-in text ``_CORPUS``, with Qwen3's special
and added tokens and a Qwen3-compatible chat template (``CHAT_TEMPLATE``).

``write_config_only`` writes config.json + generation_config.json + tokenizer files without weights,
for dummy-weight loading of full-size geometries (e.g. ``qwen3-30b-a3b``).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers takes ~2 s to import; import it only where it is used
    import transformers

__all__ = [
    "ADDED_TOKENS",
    "ARCHS",
    "BUILT_VOCAB",
    "CHAT_TEMPLATE",
    "PRESETS",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "config_for",
    "make_model",
    "write_config_only",
]

# arch -> (config class name, model class name) in `transformers`
ARCHS: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}

# The hybrid layer pattern of Qwen3.5/3.6-MoE: three gated DeltaNet layers, then one full-attention layer.
_QWEN3_5_LAYER_TYPES_40 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10

# arch -> preset -> HF config kwargs. `vocab_size` of tiny/small is nominal: make_model sets it
# from the tokenizer (len rounded up to a multiple of 64).
PRESETS: dict[str, dict[str, dict]] = {
    "qwen3_moe": {
        # 0.85 M params (1.7 MB in bf16); builds and saves in well under a second.
        "tiny": dict(
            vocab_size=1024,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # deliberately != hidden_size / num_attention_heads
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=64,
            intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[1],  # one dense-MLP layer so that path is exercised
            norm_topk_prob=True,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            initializer_range=0.2,  # see _INIT_NOTE
        ),
        # 25.6 M params (51 MB in bf16).
        "small": dict(
            vocab_size=1024,
            hidden_size=256,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,  # != 256 / 8
            num_experts=32,
            num_experts_per_tok=8,
            moe_intermediate_size=128,
            intermediate_size=512,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            initializer_range=0.1,  # 0.2 * sqrt(64 / 256): same router sharpness as tiny
        ),
        # Qwen/Qwen3-30B-A3B config.json geometry (30.5 B params, ~61 GB in bf16).
        "qwen3-30b-a3b": dict(
            vocab_size=151936,
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            initializer_range=0.02,
            bos_token_id=None,
            eos_token_id=[151645, 151643],  # <|im_end|>, <|endoftext|> of the Qwen3 tokenizer
            pad_token_id=151643,
        ),
    },
    "qwen3_5_moe": {
        # Hybrid in miniature: 2 gated DeltaNet + 2 gated full-attention layers (both orders), GQA-style
        # 2 q/k heads for 4 value heads in the DeltaNet as in the real model, partial rotary.
        "qwen3.5-moe-tiny": dict(
            vocab_size=1024,
            hidden_size=64,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,  # the GPU kernels miscompute at 16 x 16 (tests/gpu/test_gated_delta_gpu.py)
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            attn_output_gate=True,
            initializer_range=0.2,  # see _INIT_NOTE
        ),
        # Qwen/Qwen3.6-35B-A3B (same text geometry as Qwen/Qwen3.5-35B-A3B): text_config of the released
        # config.json, i.e. transformers' Qwen3_5MoeTextConfig defaults (documented there as the
        # Qwen3.5-35B-A3B checkpoint) plus the released max_position_embeddings 262144, rope theta 1e7,
        # mRoPE sections [11, 11, 10] and eos 248044. 256 routed experts x 40 layers = 64.4 GB in bf16.
        "qwen3.6-35b-a3b": dict(
            vocab_size=248320,
            hidden_size=2048,
            num_hidden_layers=40,
            layer_types=_QWEN3_5_LAYER_TYPES_40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            attn_output_gate=True,
            initializer_range=0.02,
            bos_token_id=None,
            eos_token_id=248044,
            pad_token_id=None,
        ),
    },
}

# _INIT_NOTE: with HF's default std 0.02, tiny's router softmax is nearly flat (entropy 0.996 of
# log E, top-4 of 16 carry 30% of the mass) and greedy decoding falls into 2-token loops. std 0.2
# (tiny) / 0.1 (small) gives trained-like routing (top-k mass ~0.77, entropy ~0.67-0.72 of log E)
# and greedy continuations with ~15-25 distinct tokens in 48 (measured over 3 seeds x 3 prompts).

# Presets whose vocab_size is a floor set by a real tokenizer (kept even if the tokenizer is smaller).
_FIXED_VOCAB = {("qwen3_moe", "qwen3-30b-a3b"), ("qwen3_5_moe", "qwen3.6-35b-a3b")}

_DTYPES = ("bfloat16", "float16", "float32")

# fp32 init then cast (so bf16 and fp32 checkpoints of one seed agree up to rounding) while the fp32
# model stays under this; above it the model is built directly in the target dtype.
_FP32_INIT_MAX_BYTES = 8 << 30

# len() of the tokenizer make_model builds when none is given.
BUILT_VOCAB = 1024

# Files a tokenizer directory may hold; copied when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # special: skipped by decode
ADDED_TOKENS = (  # not special, like Qwen3: they survive skip_special_tokens decoding
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# Qwen2/Qwen3 pre-tokenizer split: contractions, letters with one leading non-letter, single
# digits, punctuation runs, newlines, spaces.
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A Qwen3-compatible chat template (ChatML turns, <think> reasoning blocks, Hermes-style tool calls).
# Rendered output matches Qwen3's template except for the prose of the tools preamble; content may
# also be None or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = r"""
{%- macro as_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set leading_system = messages | length > 0 and messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if leading_system %}
        {{- as_text(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nThese functions are available to help with the user request. Their signatures are listed inside <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif leading_system %}
    {{- '<|im_start|>system\n' + as_text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{#- The last real user query: assistant turns after it keep their <think> block. #}
{%- set state = namespace(last_query=messages | length - 1, searching=true) %}
{%- for idx in range(messages | length - 1, -1, -1) %}
    {%- if state.searching and messages[idx].role == 'user' %}
        {%- set text = as_text(messages[idx].content) %}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
            {%- set state.searching = false %}
            {%- set state.last_query = idx %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = as_text(message.content) %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > state.last_query and (loop.last or reasoning) %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()

# Training text for the built-in tokenizer: plain English, chat, JSON tool calls and code.
_CORPUS = r"""
The engine keeps every expert of a mixture-of-experts model in host memory and moves only the
experts that the router picks into a small cache on the GPU. When a token arrives, the router
scores all experts, keeps the top-k, and the layer adds their outputs weighted by the softmax of
those scores. Most tokens reuse experts that were used a moment ago, so the cache hit rate is high
and the link between host and device is rarely the bottleneck. A miss costs a transfer; while it
is in flight the CPU can compute the same expert itself, and the faster of the two wins.

Good morning! Could you tell me what the weather will be like in Paris tomorrow? I would like to
walk along the river in the afternoon, then have dinner with two friends near the old market.
Sure. Tomorrow should be mild and mostly sunny, with a light wind from the west and a high of
nineteen degrees. Take a thin jacket for the evening, since it cools down quickly after sunset.

Questions people often ask: How do I reset my password? Why is the build failing on Windows but
not on Linux? Where are the logs stored? What does this error mean, and how can I fix it? Which
version should I install? Is there a faster way to do this? Can you explain it step by step?

I think the answer is forty-two, but let me check the numbers once more: 6 * 7 = 42, 12 + 30 = 42,
and 84 / 2 = 42. The year 2024 had 366 days; 3.14159 is close to pi; 1,000,000 is one million.
First, read the file. Second, parse each line. Third, count the words and print the totals.

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 2}}
{"name": "search_web", "arguments": {"query": "best hiking trails near Lyon", "limit": 5}}
{"type": "function", "function": {"name": "read_file", "description": "Read a text file.",
 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
{"temperature": 18.5, "condition": "partly cloudy", "humidity": 0.62, "wind_kph": 11}

def fibonacci(n: int) -> list[int]:
    "Return the first n Fibonacci numbers."
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class ExpertCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots: dict[tuple[int, int], int] = {}
        self.hits = 0
        self.misses = 0

    def lookup(self, layer: int, expert: int) -> int | None:
        slot = self.slots.get((layer, expert))
        if slot is None:
            self.misses += 1
        else:
            self.hits += 1
        return slot


import torch

x = torch.randn(4, 64, dtype=torch.float32)
logits = x @ weight.T
probs = torch.softmax(logits, dim=-1)
topk_weights, topk_ids = torch.topk(probs, k=8, dim=-1)
print(f"hit rate: {cache.hits / max(1, cache.hits + cache.misses):.3f}")

for (int i = 0; i < n; ++i) {
    sum += a[i] * b[i];
}
return sum;

$ pip install -e ".[test]"
$ python -m pytest tests -q
$ git status && git diff --stat

Once upon a time, a small robot lived in a library. Every night it read a new book and every
morning it told the children what it had learned: about stars and rivers, about kings and
bakers, about numbers that never end. The children asked many questions, and the robot always
answered, "Let me think about that," before it spoke.

Dear team, the release is ready for review. Please run the tests, check the benchmark results,
and report any regression in latency or throughput before Friday. Thank you for your help!
""".strip()


# --------------------------------------------------------------------------------------------------
# Configs


def _check_arch_preset(arch: str, preset: str) -> None:
    if arch not in PRESETS:
        raise ValueError(f"unknown arch {arch!r}; choices: {sorted(PRESETS)}")
    if preset not in PRESETS[arch]:
        raise ValueError(f"unknown preset {preset!r} for arch {arch!r}; choices: {sorted(PRESETS[arch])}")


def _classes(arch: str) -> tuple[type, type]:
    import transformers

    cfg_name, model_name = ARCHS[arch]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def config_for(arch: str, preset: str, overrides: dict | None = None) -> "transformers.PretrainedConfig":
    """The Hugging Face config of a preset geometry.

    Args:
        arch: HF ``model_type`` (a key of ``PRESETS``), e.g. ``"qwen3_moe"``.
        preset: a key of ``PRESETS[arch]``: ``"tiny"``, ``"small"`` or ``"qwen3-30b-a3b"``.
        overrides: HF config kwargs applied on top of the preset (e.g. ``{"num_hidden_layers": 2}``).
            A legacy ``rope_theta`` is folded into ``rope_parameters``. Keys the config class does
            not declare are kept as extra attributes, as ``transformers`` does.

    Returns:
        An instance of the arch's config class (``Qwen3MoeConfig``) with ``architectures`` set to
        ``[<ForCausalLM class name>]``. For tiny/small, ``vocab_size`` is the nominal preset value and
        eos/pad ids are unset; ``make_model`` fills them from the tokenizer.

    Raises:
        ValueError: unknown arch or preset (the message lists the choices), or an override the config
            class rejects (a field of the wrong type or an invalid value).
    """
    from huggingface_hub.errors import StrictDataclassError

    _check_arch_preset(arch, preset)
    cfg_cls, model_cls = _classes(arch)
    kwargs: dict[str, Any] = copy.deepcopy(PRESETS[arch][preset])
    for key, value in (overrides or {}).items():
        if key == "rope_theta":
            rope = kwargs.get("rope_parameters") or {"rope_type": "default"}
            kwargs["rope_parameters"] = {**rope, "rope_theta": float(value)}
        else:
            kwargs[key] = copy.deepcopy(value)
    kwargs["architectures"] = [model_cls.__name__]
    try:
        return cfg_cls(**kwargs)
    except (TypeError, ValueError, StrictDataclassError) as e:  # e.g. a field of the wrong type
        raise ValueError(f"invalid config for {arch}/{preset} with overrides {overrides}: {e}") from e


def _round_up(n: int, multiple: int = 64) -> int:
    return int(math.ceil(n / multiple) * multiple)


# --------------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(out_dir: str | Path | None, vocab_size: int) -> "transformers.PreTrainedTokenizerFast":
    """Train a small byte-level BPE tokenizer with Qwen3's special tokens and chat template.

    The BPE (Qwen2 pre-tokenizer regex, NFC, byte-level decoding) is trained on the built-in text
    ``_CORPUS`` (deterministic, well under a second). Ids: the 256 byte symbols and the learned
    merges first, then the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and the
    non-special added tokens ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
    ``</tool_response>``, ``<think>``, ``</think>``, in that order, as in Qwen3's vocabulary.
    eos is ``<|im_end|>``, pad ``<|endoftext|>``, no bos; the chat template is ``CHAT_TEMPLATE``.

    Args:
        out_dir: where ``save_pretrained`` writes tokenizer.json, tokenizer_config.json and
            chat_template.jinja (created if missing); None: do not save.
        vocab_size: target ``len(tokenizer)`` including the 9 special/added tokens. The corpus
            supports 1,146 (``make_model`` uses ``BUILT_VOCAB`` = 1024); a larger target gives a
            1,146-token tokenizer.

    Returns:
        The tokenizer (``len(tok) <= vocab_size``).

    Raises:
        ValueError: ``vocab_size`` too small to hold the 256 byte symbols and the 9 added tokens.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    from transformers import PreTrainedTokenizerFast

    n_added = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    if vocab_size < 256 + n_added:
        raise ValueError(f"vocab_size {vocab_size} < {256 + n_added} (256 bytes + {n_added} added tokens)")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        add_bos_token=False,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=131072,
        chat_template=CHAT_TEMPLATE,
    )
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(str(out))
        # transformers 5 records its own class name ("TokenizersBackend"); the portable name loads
        # the same tokenizer.json in transformers 4 and 5.
        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return hf


def _copy_tokenizer(src: str | Path, out_dir: Path) -> "transformers.PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    src = Path(src)
    if not (src / "tokenizer.json").is_file() and not (src / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {src}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(src / name, out_dir / name)
    return AutoTokenizer.from_pretrained(str(out_dir))


def _token_ids(tok: "transformers.PreTrainedTokenizerBase") -> dict[str, Any]:
    """eos (list: <|im_end|>, <|endoftext|>) and pad ids; falls back to the tokenizer's own eos/pad."""

    def tid(t: str) -> int | None:
        i = tok.convert_tokens_to_ids(t)
        return i if isinstance(i, int) and i != tok.unk_token_id and tok.convert_ids_to_tokens(i) == t else None

    im_end, eot = tid("<|im_end|>"), tid("<|endoftext|>")
    eos = [i for i in (im_end, eot) if i is not None] or ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    pad = eot if eot is not None else (tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else None))
    return {"eos_token_id": eos or None, "pad_token_id": pad, "bos_token_id": None}


def _prepare(out_dir: Path, arch: str, preset: str, tokenizer: str | Path | None, overrides: dict | None):
    """Write the tokenizer into out_dir and return (config, tokenizer ids)."""
    _check_arch_preset(arch, preset)
    out_dir.mkdir(parents=True, exist_ok=True)
    nominal = PRESETS[arch][preset]["vocab_size"]
    tok = _copy_tokenizer(tokenizer, out_dir) if tokenizer is not None else build_tokenizer(out_dir, BUILT_VOCAB)
    ids = _token_ids(tok)
    vocab = _round_up(len(tok))
    if (arch, preset) in _FIXED_VOCAB:
        vocab = max(vocab, nominal)
    merged = {"vocab_size": vocab, **ids, **(overrides or {})}
    if merged["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size {merged['vocab_size']} < len(tokenizer) {len(tok)}")
    return config_for(arch, preset, merged), ids


def _write_generation_config(out_dir: Path, ids: dict[str, Any], config) -> None:
    """generation_config.json: eos [<|im_end|>, <|endoftext|>], pad <|endoftext|>, bos null."""
    gen = {
        "bos_token_id": None,
        "eos_token_id": ids["eos_token_id"] if ids["eos_token_id"] is not None else config.eos_token_id,
        "pad_token_id": ids["pad_token_id"] if ids["pad_token_id"] is not None else config.pad_token_id,
        "transformers_version": getattr(config, "transformers_version", None) or _tf_version(),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def _add_legacy_keys(out_dir: Path, config) -> None:
    """Add the key spellings of real releases next to transformers 5's (it reads both):
    ``num_experts`` (saved as ``num_local_experts``) and ``rope_theta`` (saved inside
    ``rope_parameters``). ``torch_dtype`` is not added: transformers 5 warns that it is deprecated
    (it saves ``dtype``)."""
    path = out_dir / "config.json"
    d = json.loads(path.read_text())
    if "num_local_experts" in d and "num_experts" not in d:
        d["num_experts"] = d["num_local_experts"]
    rope = d.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in d:
        d["rope_theta"] = rope["rope_theta"]
    path.write_text(json.dumps(dict(sorted(d.items())), indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# Checkpoints


def make_model(
    out_dir: str | Path,
    arch: str = "qwen3_moe",
    preset: str = "tiny",
    *,
    tokenizer: str | Path | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    overrides: dict | None = None,
    max_shard_size: str = "2GB",
) -> Path:
    """Build a random-weight checkpoint of a preset geometry in the Hugging Face layout.

    Writes into ``out_dir`` (created if missing): ``model.safetensors`` (or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when larger than
    ``max_shard_size``), ``config.json`` (with eos/pad ids and, besides transformers 5's keys, the
    release spellings ``num_experts``/``rope_theta``), ``generation_config.json``
    (eos ``[<|im_end|>, <|endoftext|>]``, pad ``<|endoftext|>``, bos null) and the tokenizer files.
    Experts are saved per expert: ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``.

    Weights come from the model class's own init (normal, std ``initializer_range``; RMSNorm
    weights 1) after ``torch.manual_seed(seed)``: the same seed gives identical tensors. tiny/small
    raise ``initializer_range`` (0.2/0.1) so the router softmax is not flat and greedy decoding does
    not loop at once (see ``_INIT_NOTE`` in the source). Models whose fp32 size is at most 8 GiB
    are initialized in fp32 and cast (so bf16 and fp32 checkpoints of one seed agree up to
    rounding); larger ones are built in ``dtype`` directly. ``qwen3-30b-a3b`` is ~61 GB in bf16
    and needs as much RAM; prefer ``write_config_only``.

    Args:
        out_dir: output directory.
        arch: a key of ``PRESETS`` (``"qwen3_moe"``).
        preset: a key of ``PRESETS[arch]``.
        tokenizer: a directory whose tokenizer files are copied; None builds one (``build_tokenizer``).
            ``vocab_size`` becomes ``len(tokenizer)`` rounded up to a multiple of 64 (at least
            151936 for ``qwen3-30b-a3b``).
        seed: torch RNG seed of the init.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: the saved tensor dtype.
        overrides: HF config kwargs applied last (see ``config_for``).
        max_shard_size: ``save_pretrained`` shard size, e.g. ``"2GB"``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown arch, preset or dtype (the message lists the choices), an invalid
            override, or a ``vocab_size`` override below ``len(tokenizer)``.
        FileNotFoundError: ``tokenizer`` holds no tokenizer.json/tokenizer_config.json.
    """
    import torch
    from transformers.utils import logging as hf_logging

    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choices: {list(_DTYPES)}")
    _check_arch_preset(arch, preset)
    out = Path(out_dir)
    config, ids = _prepare(out, arch, preset, tokenizer, overrides)
    _, model_cls = _classes(arch)
    target = getattr(torch, dtype)
    n_params = _param_count(config)
    init_dtype = torch.float32 if n_params * 4 <= _FP32_INIT_MAX_BYTES else target

    torch.manual_seed(seed)
    prev_default = torch.get_default_dtype()
    torch.set_default_dtype(init_dtype)
    try:
        model = model_cls(config)
    finally:
        torch.set_default_dtype(prev_default)
    model = model.to(target).eval()
    model.config.dtype = target

    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), max_shard_size=max_shard_size)
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    _write_generation_config(out, ids, model.config)
    _add_legacy_keys(out, model.config)
    _fix_mode(out)
    return out


def _fix_mode(out_dir: Path) -> None:
    """safetensors (save_file) writes files 0600; give the shards the mode the umask allows."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    for f in out_dir.glob("*.safetensors"):
        os.chmod(f, 0o666 & ~umask)


def write_config_only(
    out_dir: str | Path,
    arch: str = "qwen3_moe",
    preset: str = "qwen3-30b-a3b",
    tokenizer: str | Path | None = None,
    *,
    dtype: str = "bfloat16",
    overrides: dict | None = None,
) -> Path:
    """Write config.json, generation_config.json and tokenizer files, without weights.

    Same files and rules as ``make_model`` minus the safetensors: for engines that load a geometry
    with dummy weights (e.g. full-size ``qwen3-30b-a3b`` benchmarks without a 61 GB download).
    ``dtype`` is only recorded in config.json (``dtype``).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown arch, preset or dtype (the message lists the choices), or invalid overrides.
        FileNotFoundError: ``tokenizer`` holds no tokenizer.json/tokenizer_config.json.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choices: {list(_DTYPES)}")
    _check_arch_preset(arch, preset)
    out = Path(out_dir)
    config, ids = _prepare(out, arch, preset, tokenizer, overrides)
    config.dtype = dtype
    config.save_pretrained(str(out))
    _write_generation_config(out, ids, config)
    _add_legacy_keys(out, config)
    return out


def _param_count(config) -> int:
    """Parameter count of a Qwen3-MoE-style config (embeddings + lm_head + layers)."""
    if config.model_type == "qwen3_5_moe_text":
        return _param_count_qwen3_5(config)
    h, v, n_layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 2 * hd
    dense = 3 * h * config.intermediate_size
    e = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    moe = e * 3 * h * config.moe_intermediate_size + e * h
    step = getattr(config, "decoder_sparse_step", 1) or 1
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    total = v * h * (1 if config.tie_word_embeddings else 2) + h
    for i in range(n_layers):
        sparse = e > 0 and i not in mlp_only and (i + 1) % step == 0
        total += attn + 2 * h + (moe if sparse else dense)
    return total


def _param_count_qwen3_5(config) -> int:
    """Parameter count of a Qwen3.5-MoE text config (embeddings + lm_head + hybrid layers)."""
    h, v = config.hidden_size, config.vocab_size
    kd = config.linear_num_key_heads * config.linear_key_head_dim
    vd = config.linear_num_value_heads * config.linear_value_head_dim
    hv = config.linear_num_value_heads
    conv = 2 * kd + vd
    linear = h * conv + h * vd + 2 * h * hv + conv * config.linear_conv_kernel_dim + 2 * hv \
        + config.linear_value_head_dim + vd * h
    hq, hk, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    full = h * hq * d * 2 + 2 * h * hk * d + hq * d * h + 2 * d
    e = config.num_experts
    moe = e * 3 * h * config.moe_intermediate_size + e * h + 3 * h * config.shared_expert_intermediate_size + h
    total = v * h * (1 if config.tie_word_embeddings else 2) + h
    for kind in config.layer_types:
        total += (linear if kind == "linear_attention" else full) + moe + 2 * h
    return total
