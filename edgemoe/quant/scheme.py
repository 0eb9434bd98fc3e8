"""Which quantization a Hugging Face checkpoint declares, read from ``config.json`` / ``hf_quant_config.json``.

Released conventions recognised (the ``quantization_config`` object of ``config.json`` unless noted):

FP8 e4m3 with block scales (DeepSeek-V3, the Qwen3 ``*-FP8`` releases)::

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "modules_to_not_convert": [...]}          # optional; MiniMax spells it "ignored_layers"

  ``scale_fmt`` ("float", or "ue8m0" for power-of-two scales) is accepted; per-tensor FP8 (no
  ``weight_block_size``) and FP4-packed experts (``expert_dtype: "fp4"``) are refused. Patterns of
  ``modules_to_not_convert`` follow ``transformers``' ``should_convert_module``: a pattern matches a module
  name as a regular expression anchored at the start and ending at a module boundary, or as a plain suffix.

MXFP4 as gpt-oss ships it::

    {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                         "model.embed_tokens", "lm_head"]}

  Only the fused routed experts are quantized (``mlp.experts.{gate_up,down}_proj_{blocks,scales}``); the
  patterns follow the same ``transformers`` rules.

NVFP4 from NVIDIA ModelOpt, in either of its two spellings:

- ``hf_quant_config.json``: ``{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": "NVFP4",
  "group_size": 16, "kv_cache_quant_algo": ..., "exclude_modules": [...]}}``
- ``config.json``: ``{"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": [...], "group_size": 16 |
  "config_groups": {"group_0": {"weights": {"group_size": 16, ...}, ...}}, "producer": {...}}``

  Exclusion patterns are shell wildcards (``fnmatch``: ``*`` crosses dots), as vLLM's ModelOpt loader
  matches them. When both files exist their ``quant_algo`` must agree and the exclusions are merged.

NVFP4 from compressed-tensors (llm-compressor, e.g. the RedHatAI ``*-NVFP4`` releases)::

    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                       "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                   "symmetric": true, "dynamic": false, ...}, "input_activations": {...}}},
     "ignore": ["lm_head", "re:.*mlp.gate$"]}

  Every config group must be NVFP4 (mixed schemes are refused). ``ignore`` entries follow compressed-tensors'
  ``match_name``: ``re:PATTERN`` is a regular expression matched at the start of the name, anything else
  must equal the module name.

Any other ``quant_method`` (GPTQ, AWQ, bitsandbytes, ...) is a :class:`QuantConfigError` naming the file
and the value. A checkpoint without ``quantization_config`` (and without ``hf_quant_config.json``) is
unquantized (:attr:`QuantMethod.NONE`).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

__all__ = [
    "FP8_DEFAULT_BLOCK",
    "MXFP4_GROUP",
    "NVFP4_GROUP",
    "PatternSyntax",
    "QuantConfigError",
    "QuantMethod",
    "QuantScheme",
    "detect_scheme",
    "scheme_from_config",
]

FP8_DEFAULT_BLOCK = (128, 128)
MXFP4_GROUP = 32
NVFP4_GROUP = 16


class QuantConfigError(ValueError):
    """A quantization config that edgemoe cannot load; the message names the file and the field."""


class QuantMethod(enum.Enum):
    """The weight quantization a checkpoint declares."""

    NONE = "none"
    FP8_BLOCK = "fp8_block"
    MXFP4 = "mxfp4"
    NVFP4_MODELOPT = "nvfp4_modelopt"
    NVFP4_CT = "nvfp4_compressed_tensors"


class PatternSyntax(enum.Enum):
    """How a scheme's exclusion patterns are matched against module names."""

    TRANSFORMERS = "transformers"  # anchored regex ending at a module boundary, or a suffix
    FNMATCH = "fnmatch"  # shell wildcards over the whole name
    COMPRESSED_TENSORS = "compressed-tensors"  # "re:" regex matched at the start, else the exact name


_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's declared weight quantization.

    Attributes:
        method: the scheme.
        block_size: FP8 ``(rows, cols)`` of one scale block (``(128, 128)`` in every release); ``None``
            otherwise.
        group_size: elements per scale along the input dimension for FP4 formats (MXFP4 32, NVFP4 16).
        scale_fmt: FP8 only, ``"float"`` or ``"ue8m0"`` (scales are powers of two).
        ignore: the exclusion patterns, verbatim, in ``pattern_syntax``.
        pattern_syntax: how ``ignore`` is matched (:meth:`excludes`).
        source: the file(s) the scheme was read from, for error messages.
    """

    method: QuantMethod
    block_size: tuple[int, int] | None = None
    group_size: int | None = None
    scale_fmt: str = "float"
    ignore: tuple[str, ...] = ()
    pattern_syntax: PatternSyntax = PatternSyntax.TRANSFORMERS
    source: str = ""

    @property
    def quantized(self) -> bool:
        return self.method is not QuantMethod.NONE

    def excludes(self, module: str) -> bool:
        """Whether the config lists ``module`` (e.g. ``model.layers.0.mlp.gate``) as left unquantized."""
        return self.excluded_by(module) is not None

    def excluded_by(self, module: str) -> str | None:
        """The first exclusion pattern matching ``module``, or ``None``."""
        for pat in self.ignore:
            if self.pattern_syntax is PatternSyntax.TRANSFORMERS:
                if re.match(rf"(?:{pat}){_BOUNDARY}", module) or module.endswith(pat):
                    return pat
            elif self.pattern_syntax is PatternSyntax.FNMATCH:
                if fnmatchcase(module, pat):
                    return pat
            elif pat.startswith("re:"):
                if re.match(pat[3:], module):
                    return pat
            elif pat == module:
                return pat
        return None


def _fail(source: str, msg: str) -> QuantConfigError:
    return QuantConfigError(f"{source}: {msg}")


def _pattern_list(value: Any, source: str, field: str, syntax: PatternSyntax) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise _fail(source, f"{field} must be a list of strings, got {value!r}")
    for p in value:
        regex = p if syntax is PatternSyntax.TRANSFORMERS else p[3:] if p.startswith("re:") else None
        if regex is not None and syntax is not PatternSyntax.FNMATCH:
            try:
                re.compile(regex)
            except re.error as e:
                raise _fail(source, f"{field}: pattern {p!r} is not a valid regular expression ({e})") from None
    return tuple(value)


def _fp8(cfg: Mapping[str, Any], source: str) -> QuantScheme:
    fmt = cfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _fail(source, f"quantization_config.fmt = {fmt!r}: only float8 e4m3 weights are supported")
    block = cfg.get("weight_block_size")
    if block is None:
        raise _fail(source, "quantization_config.weight_block_size is missing: per-tensor FP8 is not supported "
                            "(only block-scaled FP8, e.g. [128, 128])")
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _fail(source, f"quantization_config.weight_block_size = {block!r}: expected two positive integers")
    if cfg.get("expert_dtype", "fp8") != "fp8":
        raise _fail(source, f"quantization_config.expert_dtype = {cfg['expert_dtype']!r}: FP4-packed experts in an "
                            "FP8 checkpoint are not supported")
    scale_fmt = cfg.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "float32", "ue8m0"):
        raise _fail(source, f"quantization_config.scale_fmt = {scale_fmt!r}: expected 'float' or 'ue8m0'")
    ignore = cfg.get("modules_to_not_convert")
    if ignore is None:
        ignore = cfg.get("ignored_layers")
    return QuantScheme(QuantMethod.FP8_BLOCK, block_size=(block[0], block[1]),
                       scale_fmt="ue8m0" if scale_fmt == "ue8m0" else "float",
                       ignore=_pattern_list(ignore, source, "quantization_config.modules_to_not_convert",
                                            PatternSyntax.TRANSFORMERS),
                       pattern_syntax=PatternSyntax.TRANSFORMERS, source=source)


def _mxfp4(cfg: Mapping[str, Any], source: str) -> QuantScheme:
    return QuantScheme(QuantMethod.MXFP4, group_size=MXFP4_GROUP,
                       ignore=_pattern_list(cfg.get("modules_to_not_convert"), source,
                                            "quantization_config.modules_to_not_convert", PatternSyntax.TRANSFORMERS),
                       pattern_syntax=PatternSyntax.TRANSFORMERS, source=source)


def _group_size(value: Any, source: str, field: str) -> int:
    if value is None:
        return NVFP4_GROUP
    if not isinstance(value, int) or isinstance(value, bool) or value != NVFP4_GROUP:
        raise _fail(source, f"{field} = {value!r}: NVFP4 uses groups of {NVFP4_GROUP}")
    return value


def _modelopt(cfg: Mapping[str, Any], source: str, nested: bool) -> tuple[str, int, tuple[str, ...]]:
    """(quant_algo, group_size, exclusions) of a ModelOpt config in either spelling."""
    q = cfg["quantization"] if nested else cfg
    where = "quantization" if nested else "quantization_config"
    if not isinstance(q, Mapping):
        raise _fail(source, f"{where} must be an object")
    algo = str(q.get("quant_algo") or "").upper()
    if not algo:
        raise _fail(source, f"{where}.quant_algo is missing")
    if nested:
        group = _group_size(q.get("group_size"), source, f"{where}.group_size")
        ignore = _pattern_list(q.get("exclude_modules"), source, f"{where}.exclude_modules", PatternSyntax.FNMATCH)
    else:
        group_raw = q.get("group_size")
        for name, grp in (q.get("config_groups") or {}).items():
            w = (grp or {}).get("weights") or {}
            if group_raw is None and "group_size" in w:
                group_raw = w["group_size"]
                _group_size(group_raw, source, f"{where}.config_groups.{name}.weights.group_size")
        group = _group_size(group_raw, source, f"{where}.group_size")
        ignore = _pattern_list(q.get("ignore", q.get("exclude_modules")), source, f"{where}.ignore",
                               PatternSyntax.FNMATCH)
    return algo, group, ignore


def _compressed_tensors(cfg: Mapping[str, Any], source: str) -> QuantScheme:
    groups = cfg.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _fail(source, "quantization_config.config_groups is missing or empty")
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise _fail(source, f"quantization_config.quantization_status = {status!r}: only compressed checkpoints "
                            "(packed weights on disk) are supported")
    top_format = cfg.get("format")
    for name, grp in groups.items():
        field = f"quantization_config.config_groups.{name}"
        if not isinstance(grp, Mapping):
            raise _fail(source, f"{field} must be an object")
        fmt = grp.get("format") or top_format
        w = grp.get("weights") or {}
        is_nvfp4 = (w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == NVFP4_GROUP
                    and w.get("strategy", "tensor_group") == "tensor_group" and w.get("symmetric", True))
        if fmt != "nvfp4-pack-quantized" or not is_nvfp4:
            raise _fail(source, f"{field}: format {fmt!r} with weights {dict(w)!r} is not supported; only "
                                "'nvfp4-pack-quantized' (4-bit float, tensor_group, group_size 16, symmetric) is")
    return QuantScheme(QuantMethod.NVFP4_CT, group_size=NVFP4_GROUP,
                       ignore=_pattern_list(cfg.get("ignore"), source, "quantization_config.ignore",
                                            PatternSyntax.COMPRESSED_TENSORS),
                       pattern_syntax=PatternSyntax.COMPRESSED_TENSORS, source=source)


def scheme_from_config(quantization_config: Mapping[str, Any] | None, source: str = "config.json",
                       hf_quant_config: Mapping[str, Any] | None = None,
                       hf_quant_source: str = "hf_quant_config.json") -> QuantScheme:
    """Parse a ``quantization_config`` object (and/or a ModelOpt ``hf_quant_config.json`` object).

    Args:
        quantization_config: ``config.json``'s ``quantization_config`` (``None`` when absent).
        source: where it came from, for messages.
        hf_quant_config: the parsed ``hf_quant_config.json`` (``None`` when absent).
        hf_quant_source: its path, for messages.

    Returns:
        The :class:`QuantScheme`; :attr:`QuantMethod.NONE` when neither object is given.

    Raises:
        QuantConfigError: an unsupported method or algorithm, a malformed field, or the two files disagree.
    """
    modelopt: tuple[str, int, tuple[str, ...], str] | None = None
    if hf_quant_config is not None:
        if not isinstance(hf_quant_config.get("quantization"), Mapping):
            raise _fail(hf_quant_source, "no 'quantization' object")
        algo, group, ignore = _modelopt(hf_quant_config, hf_quant_source, nested=True)
        modelopt = (algo, group, ignore, hf_quant_source)
    if quantization_config is None:
        if modelopt is None:
            return QuantScheme(QuantMethod.NONE, source=source)
        cfg_method = "modelopt"
        quantization_config = {}
    else:
        if not isinstance(quantization_config, Mapping):
            raise _fail(source, "quantization_config must be an object")
        cfg_method = str(quantization_config.get("quant_method", "")).lower()
        if modelopt is not None and not cfg_method.startswith("modelopt"):
            raise _fail(source, f"quantization_config.quant_method = {cfg_method!r}, but {hf_quant_source} declares a "
                                "ModelOpt quantization")
    if cfg_method == "fp8":
        return _fp8(quantization_config, source)
    if cfg_method == "mxfp4":
        return _mxfp4(quantization_config, source)
    if cfg_method == "compressed-tensors":
        return _compressed_tensors(quantization_config, source)
    if cfg_method.startswith("modelopt"):
        if quantization_config:
            nested = isinstance(quantization_config.get("quantization"), Mapping)
            algo, group, ignore = _modelopt(quantization_config, source, nested=nested)
            if modelopt is not None:
                if modelopt[0] != algo:
                    raise _fail(source, f"quant_algo {algo!r} disagrees with {hf_quant_source} ({modelopt[0]!r})")
                ignore = tuple(dict.fromkeys(ignore + modelopt[2]))
            where = source if modelopt is None else f"{source} + {hf_quant_source}"
        else:
            assert modelopt is not None
            algo, group, ignore, where = modelopt
        if algo != "NVFP4":
            raise _fail(where, f"ModelOpt quant_algo {algo!r} is not supported (only 'NVFP4')")
        return QuantScheme(QuantMethod.NVFP4_MODELOPT, group_size=group, ignore=ignore,
                           pattern_syntax=PatternSyntax.FNMATCH, source=where)
    raise _fail(source, f"quantization_config.quant_method = {cfg_method!r} is not supported; supported: 'fp8' "
                        "(block-scaled), 'mxfp4', 'modelopt' (NVFP4), 'compressed-tensors' (nvfp4-pack-quantized)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QuantConfigError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise QuantConfigError(f"{path}: expected a JSON object")
    return data


def detect_scheme(model_dir: str | Path) -> QuantScheme:
    """The quantization declared by the checkpoint in ``model_dir``.

    Reads ``config.json``'s ``quantization_config`` (top level, or the ``text_config``'s for a
    conditional-generation config that keeps it there) and ``hf_quant_config.json`` when present.

    Raises:
        QuantConfigError: as :func:`scheme_from_config`, or ``config.json`` is missing or not JSON.
    """
    d = Path(model_dir)
    cfg_path = d / "config.json"
    cfg = _read_json(cfg_path)
    qcfg = cfg.get("quantization_config")
    if qcfg is None and isinstance(cfg.get("text_config"), dict):
        qcfg = cfg["text_config"].get("quantization_config")
    hf_path = d / "hf_quant_config.json"
    hf = _read_json(hf_path) if hf_path.exists() else None
    return scheme_from_config(qcfg, str(cfg_path), hf, str(hf_path))
