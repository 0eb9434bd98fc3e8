"""The tokenizer of a generated checkpoint: a small Qwen3-style byte-level BPE, or a copy of a real one.

The built tokenizer has Qwen3's special and added tokens and a Qwen3-compatible chat template
(ChatML turns, ``<think>`` reasoning blocks, Hermes-style tool calls; rendered output matches Qwen3's
template except for the prose of the tools preamble; content may also be ``None`` or a list of
``{"type": "text", "text": ...}`` parts). The template (``data/chat_template.jinja``) and the BPE's
training text (``data/corpus.txt``: plain English, chat, JSON tool calls and code) are package data.
"""

from __future__ import annotations

import json
import shutil
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
    "TOKENIZER_FILES",
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

_DATA = files("edgemoe.synth") / "data"
CHAT_TEMPLATE = (_DATA / "chat_template.jinja").read_text(encoding="utf-8").strip()
CORPUS = (_DATA / "corpus.txt").read_text(encoding="utf-8").strip()


def build_tokenizer(out_dir: str | Path | None, vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer with Qwen3's special tokens and chat template.

    The BPE (Qwen2 pre-tokenizer regex, NFC, byte-level decoding) is trained on the built-in text
    ``CORPUS`` (deterministic, well under a second). Ids: the 256 byte symbols and the learned
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
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
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


def token_ids(tok: transformers.PreTrainedTokenizerBase) -> dict[str, Any]:
    """eos (list: <|im_end|>, <|endoftext|>) and pad ids; falls back to the tokenizer's own eos/pad."""

    def tid(t: str) -> int | None:
        i = tok.convert_tokens_to_ids(t)
        return i if isinstance(i, int) and i != tok.unk_token_id and tok.convert_ids_to_tokens(i) == t else None

    im_end, eot = tid("<|im_end|>"), tid("<|endoftext|>")
    eos = [i for i in (im_end, eot) if i is not None] or ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    pad = eot if eot is not None else (tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else None))
    return {"eos_token_id": eos or None, "pad_token_id": pad, "bos_token_id": None}
