"""The tokenizer of a generated checkpoint: a small byte-level BPE in a model family's own markup, or a
copy of a real one.

The built tokenizer has a family's special and added tokens and chat template
(:class:`TokenizerSpec`, by name in :data:`TOKENIZERS`; a model declares its flavour in
``synth_tokenizer``):

- ``qwen3``: Qwen3's tokens and a Qwen3-compatible chat template (ChatML turns, ``<think>``
  reasoning blocks, Hermes-style tool calls; rendered output matches Qwen3's template except for the
  prose of the tools preamble; content may also be ``None`` or a list of ``{"type": "text", "text":
  ...}`` parts), ``data/chat_template.jinja``;
- ``glm4_moe``: GLM-4.5's role tokens (``[gMASK]<sop>``, ``<|system|>``, ``<|user|>``,
  ``<|assistant|>``, ``<|observation|>``), its reasoning and tool-call markup (``<think>``,
  ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``, ``<tool_response>``)
  and the chat template released with GLM-4.5 (``zai-org/GLM-4.5`` ``chat_template.jinja``, the
  version embedded in the GLM-4.5-Air conversions), ``data/glm4_moe_chat_template.jinja``;
- ``gpt_oss``: the Harmony format's special tokens of gpt-oss's ``o200k_harmony`` vocabulary, in its
  id order (``<|startoftext|>``, ``<|endoftext|>``, ``<|return|>``, ``<|constrain|>``, ``<|channel|>``,
  ``<|start|>``, ``<|end|>``, ``<|message|>``, ``<|call|>``, ``<|endofprompt|>``; the reserved ids between
  them are left out), eos ``<|return|>``, ``<|endoftext|>``, ``<|call|>`` (the releases'
  ``generation_config.json``), and the chat template released with gpt-oss (``openai/gpt-oss-20b``
  ``chat_template.jinja``, the revision that ends tool calls with ``<|call|>`` and keeps a tool call's
  analysis until a final answer; ``reasoning_effort`` low / medium / high), ``data/gpt_oss_chat_template.jinja``;
- ``kimi_k2``: Kimi-K2's special tokens (``[BOS]``, ``[EOS]``, ``<|im_end|>``, ``<|im_user|>``,
  ``<|im_assistant|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``[EOT]``, ``<|im_system|>``,
  ``<|im_middle|>``, ``[UNK]``, ``[PAD]``) and its tool-call tokens, which the release does not mark special
  (``<|tool_calls_section_begin|>``, ``<|tool_calls_section_end|>``, ``<|tool_call_begin|>``,
  ``<|tool_call_argument_begin|>``, ``<|tool_call_end|>``), eos ``<|im_end|>`` (the release's
  ``generation_config.json``) then ``[EOS]``, and the chat template released with Kimi-K2-Instruct-0905
  (past tool calls rendered by their id, tool results as ``## Return of ID``; the file as vendored with
  the release's tokenizer files in alibaba/rtp-llm's test data), ``data/kimi_k2_chat_template.jinja``.
  The release's tokenizer itself is tiktoken code (``tokenization_kimi.py``, loaded with
  ``--trust-remote-code``); this one is a plain fast tokenizer with the same markup, for test checkpoints
  (``make_model(..., tokenizer=DIR)`` after :func:`build_tokenizer`);
- ``kimi_k2_thinking``: the same tokens plus ``<think>`` / ``</think>`` (not special), and the chat
  template released with Kimi-K2-Thinking (past turns' reasoning dropped, the current turn's kept as
  ``<think>...</think>``; the file as llama.cpp keeps it, ``moonshotai-Kimi-K2-Thinking.jinja``),
  ``data/kimi_k2_thinking_chat_template.jinja``.

The templates and the BPE's training text (``data/corpus.txt``: plain English, chat, JSON tool calls
and code) are package data.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers takes ~2 s to import; import it only where it is used
    import transformers

__all__ = [
    "ADDED_TOKENS",
    "BUILT_VOCAB",
    "CHAT_TEMPLATE",
    "CORPUS",
    "SPECIAL_TOKENS",
    "TOKENIZERS",
    "TOKENIZER_FILES",
    "TokenizerSpec",
    "build_tokenizer",
    "copy_tokenizer",
    "token_ids",
]

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

# Qwen2/Qwen3 pre-tokenizer split: contractions, letters with one leading non-letter, single
# digits, punctuation runs, newlines, spaces.
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DATA = files("edgemoe.synth") / "data"
CORPUS = (_DATA / "corpus.txt").read_text(encoding="utf-8").strip()


@dataclass(frozen=True)
class TokenizerSpec:
    """A family's tokens and chat template for :func:`build_tokenizer`.

    Attributes:
        special_tokens: special added tokens (dropped by ``skip_special_tokens`` decoding), in id order.
        added_tokens: non-special added tokens (they survive ``skip_special_tokens``), in id order after
            the special ones.
        eos_tokens: the ``eos_token_id`` list of config.json / generation_config.json, in order; the
            first is the tokenizer's ``eos_token``.
        pad_token: the padding token.
        template_file: the chat template, a file of ``edgemoe/synth/data``.
        bos_token: the tokenizer's ``bos_token`` (never added to encodings), or ``None``.
    """

    special_tokens: tuple[str, ...]
    added_tokens: tuple[str, ...]
    eos_tokens: tuple[str, ...]
    pad_token: str
    template_file: str
    bos_token: str | None = None

    @property
    def chat_template(self) -> str:
        return (_DATA / self.template_file).read_text(encoding="utf-8").strip()


_KIMI_SPECIAL = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                 "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>", "[UNK]", "[PAD]")
_KIMI_TOOLS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>")

TOKENIZERS: dict[str, TokenizerSpec] = {
    "qwen3": TokenizerSpec(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
        pad_token="<|endoftext|>",
        template_file="chat_template.jinja",
    ),
    # GLM-4.5's vocabulary order; its eos_token_id is [<|endoftext|>, <|user|>, <|observation|>]
    "glm4_moe": TokenizerSpec(
        special_tokens=("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                        "<|assistant|>", "<|observation|>"),
        added_tokens=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                      "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"),
        eos_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
        pad_token="<|endoftext|>",
        template_file="glm4_moe_chat_template.jinja",
    ),
    # gpt-oss's o200k_harmony order (ids 199998, 199999, 200002, 200003, 200005-200008, 200012, 200018)
    "gpt_oss": TokenizerSpec(
        special_tokens=("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                        "<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|endofprompt|>"),
        added_tokens=(),
        eos_tokens=("<|return|>", "<|endoftext|>", "<|call|>"),
        pad_token="<|endoftext|>",
        template_file="gpt_oss_chat_template.jinja",
        bos_token="<|startoftext|>",
    ),
    # Kimi-K2's order (ids 163584-163588, 163590, 163591, 163593-163599, 163601; [UNK], [PAD] 163838-9)
    "kimi_k2": TokenizerSpec(
        special_tokens=_KIMI_SPECIAL,
        added_tokens=_KIMI_TOOLS,
        eos_tokens=("<|im_end|>", "[EOS]"),
        pad_token="[PAD]",
        template_file="kimi_k2_chat_template.jinja",
        bos_token="[BOS]",
    ),
    "kimi_k2_thinking": TokenizerSpec(
        special_tokens=_KIMI_SPECIAL,
        added_tokens=(*_KIMI_TOOLS, "<think>", "</think>"),
        eos_tokens=("<|im_end|>", "[EOS]"),
        pad_token="[PAD]",
        template_file="kimi_k2_thinking_chat_template.jinja",
        bos_token="[BOS]",
    ),
}

SPECIAL_TOKENS = TOKENIZERS["qwen3"].special_tokens  # special: skipped by decode
ADDED_TOKENS = TOKENIZERS["qwen3"].added_tokens  # not special, like Qwen3: they survive skip_special_tokens decoding
CHAT_TEMPLATE = TOKENIZERS["qwen3"].chat_template


def build_tokenizer(out_dir: str | Path | None, vocab_size: int,
                    spec: TokenizerSpec = TOKENIZERS["qwen3"]) -> transformers.PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer with a family's special tokens and chat template.

    The BPE (Qwen2 pre-tokenizer regex, NFC, byte-level decoding) is trained on the built-in text
    ``CORPUS`` (deterministic, well under a second). Ids: the 256 byte symbols and the learned
    merges first, then ``spec.special_tokens`` and the non-special ``spec.added_tokens``, in that order
    (Qwen3's: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, then ``<tool_call>``,
    ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``, as in
    Qwen3's vocabulary). eos is ``spec.eos_tokens[0]`` (Qwen3: ``<|im_end|>``), pad
    ``spec.pad_token``, bos ``spec.bos_token`` (never added to encodings); the chat template is
    ``spec.chat_template``.

    Args:
        out_dir: where ``save_pretrained`` writes tokenizer.json, tokenizer_config.json and
            chat_template.jinja (created if missing); None: do not save.
        vocab_size: target ``len(tokenizer)`` including the special/added tokens. The corpus
            supports 1,137 byte and merge tokens (``make_model`` uses ``BUILT_VOCAB`` = 1024); a larger
            target gives a tokenizer of 1,137 plus the added tokens.
        spec: the family's tokens and template (default Qwen3's).

    Returns:
        The tokenizer (``len(tok) <= vocab_size``).

    Raises:
        ValueError: ``vocab_size`` too small to hold the 256 byte symbols and the added tokens.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    n_added = len(spec.special_tokens) + len(spec.added_tokens)
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
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added_tokens])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos_token,
        eos_token=spec.eos_tokens[0],
        pad_token=spec.pad_token,
        unk_token=None,
        additional_special_tokens=list(spec.special_tokens[1:]),
        add_bos_token=False,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=131072,
        chat_template=spec.chat_template,
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


def copy_tokenizer(src: str | Path, out_dir: Path) -> transformers.PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    src = Path(src)
    if not (src / "tokenizer.json").is_file() and not (src / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {src}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(src / name, out_dir / name)
    return AutoTokenizer.from_pretrained(str(out_dir))


def token_ids(tok: transformers.PreTrainedTokenizerBase, spec: TokenizerSpec = TOKENIZERS["qwen3"]) -> dict[str, Any]:
    """eos (the list of ``spec.eos_tokens`` the tokenizer has; Qwen3: ``<|im_end|>``, ``<|endoftext|>``) and
    pad ids; falls back to the tokenizer's own eos/pad (a copied tokenizer of another family)."""

    def tid(t: str) -> int | None:
        i = tok.convert_tokens_to_ids(t)
        return i if isinstance(i, int) and i != tok.unk_token_id and tok.convert_ids_to_tokens(i) == t else None

    eos = [i for i in map(tid, spec.eos_tokens) if i is not None]
    eos = eos or ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    pad = tid(spec.pad_token)
    if pad is None:
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else None)
    return {"eos_token_id": eos or None, "pad_token_id": pad, "bos_token_id": None}
