"""Random-weight test checkpoints in the exact Hugging Face layout (``edgemoe make-model``).

:func:`make_model` instantiates the ``transformers`` class of an architecture (``Qwen3MoeForCausalLM``
for ``qwen3_moe``) from a preset geometry, seeds its random init and calls ``save_pretrained``, so
the tensor names, shapes and config keys are those that ``transformers`` reads and writes for real
releases. ``transformers`` 5 keeps experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``) but saves the per-expert release layout
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``. :func:`write_config_only` writes
config.json + generation_config.json + tokenizer files without weights, for dummy-weight loading of
full-size geometries (e.g. ``qwen3-30b-a3b``).

This module is generic; what it knows about an architecture (its ``transformers`` classes, presets
and parameter count) comes from :data:`edgemoe.synth.archs.ARCHS`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgemoe.synth.archs import ARCHS, SynthArch, param_count
from edgemoe.synth.tokenizer import BUILT_VOCAB, TOKENIZERS, build_tokenizer, copy_tokenizer, token_ids
from edgemoe.weights.dtypes import WEIGHT_DTYPES, parse_dtype

if TYPE_CHECKING:  # transformers takes ~2 s to import; import it only where it is used
    import transformers

__all__ = ["QUANT_LAYOUTS", "config_for", "make_model", "quantize_checkpoint", "write_config_only"]

QUANT_LAYOUTS = {"fp8": "fp8_block", "mxfp4": "mxfp4", "nvfp4-modelopt": "nvfp4_modelopt",
                 "nvfp4-ct": "nvfp4_compressed_tensors"}
"""``make-model --quant`` name -> :class:`~edgemoe.quant.scheme.QuantMethod` value of the released layout written."""

# fp32 init then cast (so bf16 and fp32 checkpoints of one seed agree up to rounding) while the fp32
# model stays under this; above it the model is built directly in the target dtype.
_FP32_INIT_MAX_BYTES = 8 << 30


def _arch(arch: str, preset: str) -> SynthArch:
    """The :class:`~edgemoe.synth.archs.SynthArch` of ``arch``, which must have ``preset``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choices: {sorted(ARCHS)}")
    if preset not in ARCHS[arch].presets:
        raise ValueError(f"unknown preset {preset!r} for arch {arch!r}; choices: {sorted(ARCHS[arch].presets)}")
    return ARCHS[arch]


def _check_dtype(dtype: str) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choices: {list(WEIGHT_DTYPES)}")


def config_for(arch: str, preset: str, overrides: dict | None = None) -> transformers.PretrainedConfig:
    """The Hugging Face config of a preset geometry.

    Args:
        arch: a key of :data:`~edgemoe.synth.archs.ARCHS`, e.g. ``"qwen3_moe"``.
        preset: one of that architecture's presets, e.g. ``"tiny"``, ``"small"`` or ``"qwen3-30b-a3b"``.
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

    spec = _arch(arch, preset)
    cfg_cls, model_cls = spec.classes()
    kwargs: dict[str, Any] = copy.deepcopy(spec.presets[preset])
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


def _check_out(out_dir: Path, overwrite: bool) -> None:
    """Make ``out_dir`` ready to write: absent or empty, or (``overwrite``) a model directory whose old
    files are removed first, so a smaller model leaves no stale shard or index behind.

    Raises:
        FileExistsError: ``out_dir`` is a file, or a non-empty directory without ``overwrite``, or with
            ``overwrite`` a non-empty directory that holds no ``config.json`` (not a model directory).
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass --overwrite to replace the model in it)")
    if not (out_dir / "config.json").is_file():
        raise FileExistsError(f"{out_dir} is not a model directory (no config.json): --overwrite only replaces one")
    shutil.rmtree(out_dir)


def _prepare(out_dir: Path, arch: str, preset: str, tokenizer: str | Path | None, overrides: dict | None,
             overwrite: bool):
    """Check ``out_dir`` (:func:`_check_out`), write the tokenizer into it and return (config, tokenizer ids)."""
    spec = _arch(arch, preset)
    _check_out(out_dir, overwrite)
    out_dir.mkdir(parents=True, exist_ok=True)
    flavour = TOKENIZERS[spec.tokenizer]
    if tokenizer is not None:
        tok = copy_tokenizer(tokenizer, out_dir)
    else:
        tok = build_tokenizer(out_dir, BUILT_VOCAB, flavour)
    ids = token_ids(tok, flavour)
    vocab = _round_up(len(tok))
    if preset in spec.fixed_vocab:
        vocab = max(vocab, spec.presets[preset]["vocab_size"])
    merged = {"vocab_size": vocab, **ids, **(overrides or {})}
    if merged["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size {merged['vocab_size']} < len(tokenizer) {len(tok)}")
    return config_for(arch, preset, merged), ids


def _write_generation_config(out_dir: Path, ids: dict[str, Any], config) -> None:
    """generation_config.json: the tokenizer's eos list (Qwen3: [<|im_end|>, <|endoftext|>]) and pad, bos null."""
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
    overwrite: bool = False,
    quant: str | None = None,
) -> Path:
    """Build a random-weight checkpoint of a preset geometry in the Hugging Face layout.

    Writes into ``out_dir`` (created if missing): ``model.safetensors`` (or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when larger than
    ``max_shard_size``), ``config.json`` (with eos/pad ids and, besides transformers 5's keys, the
    release spellings ``num_experts``/``rope_theta``), ``generation_config.json``
    (the tokenizer flavour's eos list, e.g. ``[<|im_end|>, <|endoftext|>]``, and pad, bos null) and the
    tokenizer files.
    Experts are saved per expert: ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``.

    Weights come from the model class's own init (normal, std ``initializer_range``; RMSNorm
    weights 1) after ``torch.manual_seed(seed)``: the same seed gives identical tensors. tiny/small
    raise ``initializer_range`` (0.2/0.1) so the router softmax is not flat and greedy decoding does
    not loop at once (see ``_INIT_NOTE`` in :mod:`edgemoe.synth.archs`). Models whose fp32 size is at most 8 GiB
    are initialized in fp32 and cast (so bf16 and fp32 checkpoints of one seed agree up to
    rounding); larger ones are built in ``dtype`` directly. ``qwen3-30b-a3b`` is ~61 GB in bf16
    and needs as much RAM; prefer ``write_config_only``.

    Args:
        out_dir: output directory.
        arch: a key of :data:`~edgemoe.synth.archs.ARCHS` (``"qwen3_moe"``, ``"qwen3_5_moe"``, ``"glm4_moe"``).
        preset: one of that architecture's presets.
        tokenizer: a directory whose tokenizer files are copied; None builds one in the architecture's
            flavour (``build_tokenizer``).
            ``vocab_size`` becomes ``len(tokenizer)`` rounded up to a multiple of 64 (at least
            151936 for ``qwen3-30b-a3b``).
        seed: torch RNG seed of the init.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: the saved tensor dtype.
        overrides: HF config kwargs applied last (see ``config_for``).
        max_shard_size: ``save_pretrained`` shard size, e.g. ``"2GB"``.
        overwrite: replace the model in a non-empty ``out_dir`` (refused otherwise).
        quant: ``None`` (float weights), or a released quantized layout written from the float weights
            (:func:`quantize_checkpoint`): ``"fp8"``, ``"mxfp4"``, ``"nvfp4-modelopt"``, ``"nvfp4-ct"``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown arch, preset, dtype or quant (the message lists the choices), an invalid
            override, a ``vocab_size`` override below ``len(tokenizer)``, or a geometry the quantized
            layout cannot hold (e.g. MXFP4 needs ``H`` and ``I`` multiples of 32).
        FileNotFoundError: ``tokenizer`` holds no tokenizer.json/tokenizer_config.json.
        FileExistsError: ``out_dir`` is not empty and ``overwrite`` is not set (or it holds no model).
    """
    import torch
    from transformers.utils import logging as hf_logging

    _check_dtype(dtype)
    if quant is not None and quant not in QUANT_LAYOUTS:
        raise ValueError(f"unknown quant {quant!r}; choices: {list(QUANT_LAYOUTS)}")
    out = Path(out_dir)
    config, ids = _prepare(out, arch, preset, tokenizer, overrides, overwrite)
    _, model_cls = ARCHS[arch].classes()
    target = parse_dtype(dtype)
    n_params = param_count(config)
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
    if quant is not None:
        quantize_checkpoint(out, quant, max_shard_size=max_shard_size)
    _fix_mode(out)
    return out


def quantize_checkpoint(model_dir: str | Path, quant: str, max_shard_size: str = "2GB") -> None:
    """Rewrite the float checkpoint in ``model_dir`` in a quantized release layout, in place.

    The tensors and ``quantization_config`` are the releases' (:mod:`edgemoe.quant.quantize`, round to
    nearest): ``fp8`` — FP8 e4m3 ``weight`` + bfloat16 ``weight_scale_inv`` per 128x128 block on every
    linear but the router, embeddings and LM head (as Qwen3's FP8 releases); ``nvfp4-modelopt`` — ModelOpt
    NVFP4 (``weight`` / ``weight_scale`` / ``weight_scale_2`` / ``input_scale``, ``hf_quant_config.json``
    beside ``config.json``); ``nvfp4-ct`` — compressed-tensors ``nvfp4-pack-quantized`` (``weight_packed``
    / ``weight_scale`` / ``weight_global_scale``); ``mxfp4`` — the routed experts alone in gpt-oss's fused
    layout (``mlp.experts.{gate_up,down}_proj_{blocks,scales}``, gate/up rows interleaved).

    Raises:
        ValueError: an unknown ``quant``, or weights the layout cannot hold.
    """
    import torch
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    from edgemoe.quant.quantize import quantize_state_dict, release_scheme
    from edgemoe.quant.scheme import QuantMethod

    if quant not in QUANT_LAYOUTS:
        raise ValueError(f"unknown quant {quant!r}; choices: {list(QUANT_LAYOUTS)}")
    method = QuantMethod(QUANT_LAYOUTS[quant])
    scheme = release_scheme(method)
    d = Path(model_dir)
    shards = sorted(d.glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    for f in shards:
        sd.update(load_file(str(f)))
    linears = [k.removesuffix(".weight") for k, v in sd.items()
               if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k]
    q = quantize_state_dict(sd, scheme, linears, scale_dtype=torch.bfloat16)
    for f in shards:
        f.unlink()
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    save_torch_state_dict(q, str(d), max_shard_size=max_shard_size, metadata={"format": "pt"})
    _write_quantization_config(d, quant)


def _write_quantization_config(d: Path, quant: str) -> None:
    """``config.json``'s ``quantization_config`` of a released layout (and ModelOpt's ``hf_quant_config.json``)."""
    from edgemoe.quant.quantize import hf_quant_config, quantization_config, release_scheme
    from edgemoe.quant.scheme import QuantMethod

    method = QuantMethod(QUANT_LAYOUTS[quant])
    scheme = release_scheme(method)
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = quantization_config(scheme)
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    if method is QuantMethod.NVFP4_MODELOPT:
        (d / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(scheme), indent=2) + "\n")


def _fix_mode(out_dir: Path) -> None:
    """safetensors (save_file) writes files 0600; give the shards the mode the umask allows."""
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
    overwrite: bool = False,
    quant: str | None = None,
) -> Path:
    """Write config.json, generation_config.json and tokenizer files, without weights.

    Same files and rules as ``make_model`` minus the safetensors: for engines that load a geometry
    with dummy weights (e.g. full-size ``qwen3-30b-a3b`` benchmarks without a 61 GB download).
    ``dtype`` is only recorded in config.json (``dtype``). ``quant`` (see :func:`make_model`) records the
    layout's ``quantization_config`` (and ModelOpt's ``hf_quant_config.json``), so dummy weights take that
    expert format.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown arch, preset or dtype (the message lists the choices), or invalid overrides.
        FileNotFoundError: ``tokenizer`` holds no tokenizer.json/tokenizer_config.json.
        FileExistsError: as for ``make_model`` (``overwrite``).
    """
    _check_dtype(dtype)
    if quant is not None and quant not in QUANT_LAYOUTS:
        raise ValueError(f"unknown quant {quant!r}; choices: {list(QUANT_LAYOUTS)}")
    out = Path(out_dir)
    config, ids = _prepare(out, arch, preset, tokenizer, overrides, overwrite)
    config.dtype = dtype
    config.save_pretrained(str(out))
    _write_generation_config(out, ids, config)
    _add_legacy_keys(out, config)
    if quant is not None:
        _write_quantization_config(out, quant)
    return out
