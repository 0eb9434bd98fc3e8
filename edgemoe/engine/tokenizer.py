"""Loading a checkpoint's tokenizer, and the opt-in its custom code needs.

Most checkpoints ship a ``tokenizer.json`` that ``transformers`` reads with its own classes. Some
ship Python code instead, named by ``auto_map`` in ``tokenizer_config.json``: Kimi-K2's tiktoken
tokenizer (``tokenization_kimi.TikTokenTokenizer`` beside ``tiktoken.model``) is one. Importing that
code runs it, so it is done only when asked for (``EngineConfig.trust_remote_code``, the
``--trust-remote-code`` flag; off by default, as in ``transformers`` and vLLM); without it such a
checkpoint is refused before anything is loaded, with one line that says what to pass.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RemoteCodeError", "check_remote_code", "load_tokenizer", "remote_tokenizer_class"]


class RemoteCodeError(ValueError):
    """The checkpoint's tokenizer is custom code and ``trust_remote_code`` is off."""


def remote_tokenizer_class(model_dir: str | Path) -> str | None:
    """The custom tokenizer class ``tokenizer_config.json`` names in ``auto_map`` (e.g.
    ``tokenization_kimi.TikTokenTokenizer``), or ``None`` when there is none (or no readable
    ``tokenizer_config.json``: ``transformers`` reports that itself when it loads)."""
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    auto_map = cfg.get("auto_map") if isinstance(cfg, dict) else None
    if isinstance(auto_map, dict):
        entry = auto_map.get("AutoTokenizer")
    elif isinstance(auto_map, (list, tuple)):  # the older form: [slow class, fast class]
        entry = auto_map
    else:
        return None
    names = [entry] if isinstance(entry, str) else [e for e in entry or () if isinstance(e, str)]
    return names[0] if names else None


def check_remote_code(model_dir: str | Path, trust_remote_code: bool) -> None:
    """Refuse a checkpoint whose tokenizer is custom code unless ``trust_remote_code``.

    Raises:
        RemoteCodeError: ``auto_map`` in ``tokenizer_config.json`` names a tokenizer class and
            ``trust_remote_code`` is off; the one-line message names the directory, the class and the
            flag to pass.
    """
    if trust_remote_code:
        return
    cls = remote_tokenizer_class(model_dir)
    if cls is not None:
        raise RemoteCodeError(
            f"{model_dir}: the tokenizer is custom Python code shipped with the checkpoint ({cls}, named by "
            "auto_map in tokenizer_config.json); pass --trust-remote-code (trust_remote_code=True) to run it")


_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """The checkpoint's ``transformers`` tokenizer (its own code with ``trust_remote_code``), its chat
    template compiled.

    Raises:
        RemoteCodeError: see :func:`check_remote_code`.
        ValueError: the directory has no usable tokenizer. Without tokenizer files, transformers builds an
            empty one from ``config.json``'s model type, which turns every prompt into nothing; it is
            refused here, naming the directory. Tokenizer files transformers fails on (a tokenizer JSON file
            that is not valid JSON is named), and a chat template that does not compile (every chat request
            would fail), are one line too.
    """
    check_remote_code(model_dir, trust_remote_code)
    from transformers import AutoTokenizer

    d = Path(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers' errors name no file, and some span several lines
        for name in _JSON_FILES:
            try:
                json.loads((d / name).read_bytes())
            except FileNotFoundError:
                continue
            except (OSError, UnicodeDecodeError, ValueError) as bad:
                raise ValueError(f"{d / name}: not valid JSON ({bad})") from exc
        raise ValueError(f"{model_dir}: cannot load the tokenizer ({_one_line(exc)})") from exc
    if len(tokenizer) < 2 or not tokenizer.encode("Hello, world.", add_special_tokens=False):
        raise ValueError(
            f"{model_dir}: no usable tokenizer ({len(tokenizer)} token(s), text encodes to nothing); "
            "copy the model's tokenizer files (tokenizer.json, or tokenizer.model / vocab.json + merges.txt, "
            "with tokenizer_config.json) into the directory")
    _check_chat_template(tokenizer, d)
    return tokenizer


def _check_chat_template(tokenizer: Any, model_dir: Path) -> None:
    """Compile the tokenizer's chat template(s) as ``apply_chat_template`` does.

    Raises:
        ValueError: a template that does not compile (its file named: ``chat_template.jinja`` when the
            directory has one, else ``tokenizer_config.json``).
    """
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: the first chat request reports the error
        return
    templates = tokenizer.chat_template
    for template in (templates.values() if isinstance(templates, dict) else [templates]):
        if not isinstance(template, str):
            continue
        try:
            _compile_jinja_template(template)
        except Exception as exc:  # jinja2.TemplateSyntaxError, or an error of transformers' own checks
            jinja = model_dir / "chat_template.jinja"
            where = jinja if jinja.is_file() else model_dir / "tokenizer_config.json"
            raise ValueError(f"{where}: the chat template does not compile ({_one_line(exc)})") from None
