"""Broken checkpoints: every fault is one exception whose message is one line naming the file (and the tensor).

Through the weights entry points the runner calls (``load_checkpoint``, ``load_ftw``), the checkpoint
index and ``load_config``; the HF and FTW directories are real ones written by ``make_model`` and
``convert``, then damaged.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe.models import load_config, model_class
from edgemoe.synth import make_model
from edgemoe.weights.ftw import (
    MANIFEST,
    FTWChecksumError,
    FTWConfigError,
    FTWError,
    FTWTruncatedError,
    convert,
    load_ftw,
)
from edgemoe.weights.index import CheckpointError, CheckpointIndex, read_safetensors_header
from edgemoe.weights.loader import load_checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sharded") / "tiny"
    make_model(d, "qwen3_moe", "tiny", seed=1, dtype="float32", max_shard_size="300KB")
    assert len(list(d.glob("*.safetensors"))) > 1
    return d


@pytest.fixture(scope="module")
def ftw_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return convert(tiny_model_dir, tmp_path_factory.mktemp("ftw") / "tiny.ftw", progress=False)


def _copy(src: Path, tmp_path: Path) -> Path:
    d = tmp_path / src.name
    shutil.copytree(src, d)
    return d


def _one_line(exc: pytest.ExceptionInfo, *names: str | Path) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for name in names:
        assert str(name) in msg, (name, msg)
    return msg


def _load_hf(d: Path) -> None:
    cfg = load_config(d)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    load_checkpoint(model, d, cfg, torch.float32, torch.device("cpu"), progress=False)


def _load_ftw(d: Path) -> None:
    cfg = load_config(d)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    load_ftw(model, d, torch.float32, torch.device("cpu"), cfg, progress=False)


def _flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x01]))


# ------------------------------------------------------------------------------- Hugging Face directories


def test_intact_checkpoints_load(tiny_model_dir, sharded):
    _load_hf(tiny_model_dir)
    _load_hf(sharded)


def test_truncated_safetensors_names_file_and_tensor(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)
    f = d / "model.safetensors"
    last = max(read_safetensors_header(f).values(), key=lambda t: t.end)
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated") as e:
        _load_hf(d)
    _one_line(e, f, f"tensor {last.name}")


def test_safetensors_cut_inside_its_header(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)
    f = d / "model.safetensors"
    os.truncate(f, 20)
    with pytest.raises(CheckpointError, match="its safetensors header alone needs") as e:
        _load_hf(d)
    _one_line(e, f)


def test_truncated_shard(sharded, tmp_path):
    d = _copy(sharded, tmp_path)
    shard = min(d.glob("*.safetensors"))
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(CheckpointError, match="truncated") as e:
        _load_hf(d)
    _one_line(e, shard)


def test_missing_shard_named_by_the_index(sharded, tmp_path):
    d = _copy(sharded, tmp_path)
    shard = max(d.glob("*.safetensors"))
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing shard") as e:
        _load_hf(d)
    _one_line(e, shard, "model.safetensors.index.json maps tensor")


def test_missing_shard_without_an_index(sharded, tmp_path):
    d = _copy(sharded, tmp_path)
    (d / "model.safetensors.index.json").unlink()
    max(d.glob("*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"missing (tensor|\d+ routed-expert tensor)") as e:
        _load_hf(d)
    _one_line(e, d)


def test_tensor_in_two_shards(sharded, tmp_path):
    d = _copy(sharded, tmp_path)
    first, second = sorted(d.glob("*.safetensors"))[:2]
    a, b = load_file(first), load_file(second)
    name = next(iter(a))
    b[name] = a[name]
    save_file(b, second)
    with pytest.raises(CheckpointError, match="a tensor in two shards") as e:
        CheckpointIndex.open(d)
    _one_line(e, second, f"tensor {name}", first.name)


def test_index_mapping_a_tensor_to_the_wrong_shard(sharded, tmp_path):
    d = _copy(sharded, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == files[0])
    index["weight_map"][name] = files[1]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="maps to this file") as e:
        _load_hf(d)
    _one_line(e, d / files[1], f"tensor {name}")


def test_index_that_is_not_json(sharded, tmp_path):
    d = _copy(sharded, tmp_path)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="not a valid safetensors index") as e:
        _load_hf(d)
    _one_line(e, d / "model.safetensors.index.json")


def test_expert_tensor_of_a_dense_layer(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)  # the tiny preset's layer 1 is a dense-MLP layer
    sd = load_file(d / "model.safetensors")
    sd["model.layers.1.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 64)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="layer 1 is not a MoE layer") as e:
        _load_hf(d)
    _one_line(e, d / "model.safetensors", "model.layers.1.mlp.experts.0.down_proj.weight")


def test_expert_given_twice_fused_and_per_expert(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    cfg = load_config(d)
    sd["model.layers.2.mlp.experts.down_proj"] = torch.zeros(cfg.num_experts, 64, 64)  # also per expert
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj is also given by") as e:
        _load_hf(d)
    _one_line(e, d / "model.safetensors")


def test_config_json_that_is_not_json(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)
    (d / "config.json").write_text('{"model_type": "qwen3_moe",\n "hidden_size": 64,,\n}')
    with pytest.raises(ValueError, match="not valid JSON") as e:
        load_config(d)
    _one_line(e, d / "config.json")
    with pytest.raises(ValueError, match="not valid JSON") as e:
        convert(d, tmp_path / "out.ftw", progress=False)
    _one_line(e, d / "config.json")
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object") as e:
        load_config(d)
    _one_line(e, d / "config.json")


@pytest.mark.parametrize("field, value, expected", [
    ("num_hidden_layers", "two", "num_hidden_layers must be a positive integer, got 'two'"),
    ("hidden_size", -4, "hidden_size must be a positive integer, got -4"),
    ("vocab_size", 1.5, "vocab_size must be a positive integer, got 1.5"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),
    ("decoder_sparse_step", 0, "decoder_sparse_step must be a positive integer, got 0"),  # was taken as 1
    ("num_experts", [1], "num_experts must be an integer >= 0, got [1]"),
    ("rope_theta", "x", "rope_theta must be a positive number, got 'x'"),
    ("rope_scaling", "yarn", "rope_scaling must be an object, got 'yarn'"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
    ("eos_token_id", "</s>", "eos_token_id must be a token id or a list of them, got '</s>'"),
    ("architectures", "Qwen3MoeForCausalLM", "architectures must be a list of names"),
])
def test_config_json_field_of_the_wrong_type(tiny_model_dir, tmp_path, field, value, expected):
    """A field of the wrong type is named with the file (it failed deep inside, e.g. "invalid literal for
    int() with base 10: 'two'", or loaded a wrong model: "false" is true)."""
    d = _copy(tiny_model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError) as e:
        load_config(d)
    assert _one_line(e, d / "config.json").endswith(expected) or expected in str(e.value)


def test_config_json_architecture_not_served_with_a_served_model_type(tiny_model_dir, tmp_path):
    """``architectures[0]`` decides the model class; a served ``model_type`` beside an unknown architecture passed
    ``load_config`` and failed later, in ``model_class``, without naming the file."""
    d = _copy(tiny_model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooMoeForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture FooMoeForCausalLM") as e:
        load_config(d)
    _one_line(e, d / "config.json", "model_type qwen3_moe")
    with pytest.raises(ValueError, match="unsupported architecture FooMoeForCausalLM") as e:
        convert(d, tmp_path / "out.ftw", progress=False)
    _one_line(e, d / "config.json")


def test_config_json_values_inconsistent_or_unusable(tiny_model_dir, tmp_path, monkeypatch):
    """A RoPE number that is a string and more experts per token than experts (both loaded: the first
    failed deep in the rotary embedding without naming the file, the second served and failed every
    request), and any conversion a family's ``config_from_hf`` fails on: one line naming the file."""
    d = _copy(tiny_model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    for edit, expected in (({"rope_parameters": {"rope_type": "yarn", "factor": "big"}},
                            "rope_parameters.factor must be a number, got 'big'"),
                           ({"num_experts_per_tok": 100}, "num_experts_per_tok (100) must be in [1, 16]")):
        (d / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ValueError) as e:
            load_config(d)
        assert expected in _one_line(e, d / "config.json")
    (d / "config.json").write_text(json.dumps(cfg))
    cls = model_class(cfg["architectures"][0])

    def failing(raw, where):
        return int([])

    monkeypatch.setattr(cls, "config_from_hf", staticmethod(failing))
    with pytest.raises(ValueError, match="a field has a value this model family cannot use") as e:
        load_config(d)
    _one_line(e, d / "config.json")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints in each released quantized layout."""
    root = tmp_path_factory.mktemp("quantized")
    return {q: make_model(root / q, "gpt_oss" if q == "mxfp4" else "qwen3_moe", "tiny", seed=1, quant=q)
            for q in ("fp8", "nvfp4-modelopt", "nvfp4-ct", "mxfp4")}


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full(t.shape, float("nan")).to(t.dtype)


_EXPERT = "model.layers.2.mlp.experts.3.gate_proj"
_ATTN = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("quant, name, edit, match", [
    ("fp8", f"{_EXPERT}.weight_scale_inv", _nan_like, "NaN or infinite"),
    ("fp8", f"{_ATTN}.weight_scale_inv", lambda t: torch.full_like(t, float("inf")), "NaN or infinite"),
    ("nvfp4-modelopt", f"{_EXPERT}.weight_scale_2", _nan_like, "NaN or infinite"),
    ("nvfp4-modelopt", f"{_EXPERT}.weight_scale", _nan_like, "NaN or infinite"),
    ("nvfp4-ct", f"{_EXPERT}.weight_global_scale", torch.zeros_like, "is 0"),
    ("nvfp4-ct", f"{_ATTN}.weight_global_scale", torch.zeros_like, "is 0"),
    ("mxfp4", "model.layers.0.mlp.experts.down_proj_scales", lambda t: t.index_fill(0, torch.tensor([5]), 255),
     "NaN or infinite"),
], ids=["fp8-expert", "fp8-attention", "modelopt-scale-2", "modelopt-block-scale", "ct-global-expert",
        "ct-global-attention", "mxfp4-e8m0"])
def test_non_finite_scale(quantized, tmp_path, quant, name, edit, match):
    """A scale that is NaN or infinite (or a global scale of 0, whose reciprocal is) made every output NaN:
    the model loaded and converted, and served garbage."""
    d = _copy(quantized[quant], tmp_path)
    f = d / "model.safetensors"
    sd = load_file(f)
    sd[name] = edit(sd[name])
    save_file(sd, f)
    with pytest.raises(CheckpointError, match=match) as e:
        _load_hf(d)
    _one_line(e, f, f"tensor {name}")
    with pytest.raises(CheckpointError, match=match) as e:
        convert(d, tmp_path / "out.ftw", progress=False)
    _one_line(e, f, f"tensor {name}")


@pytest.mark.parametrize("name, value", [("model.norm.weight", math.nan), ("model.embed_tokens.weight", math.inf),
                                         ("model.layers.0.self_attn.o_proj.weight", -math.inf)],
                         ids=["norm-nan", "embedding-inf", "attention-minus-inf"])
def test_non_finite_float_weight(tiny_model_dir, tmp_path, name, value):
    """A NaN or infinite non-expert float weight made every output NaN, silently: the load and the convert refuse it,
    naming the file, the tensor and how many values."""
    d = _copy(tiny_model_dir, tmp_path)
    f = next(p for p in sorted(d.glob("*.safetensors")) if name in load_file(p))
    sd = load_file(f)
    sd[name] = sd[name].clone().index_fill_(0, torch.tensor([1]), value)
    save_file(sd, f)
    n = sd[name][1].numel()
    with pytest.raises(CheckpointError, match=f"holds {n} NaN or infinite value") as e:
        _load_hf(d)
    _one_line(e, f, f"tensor {name}")
    with pytest.raises(CheckpointError, match="NaN or infinite") as e:
        convert(d, tmp_path / "out.ftw", progress=False)
    _one_line(e, f, f"tensor {name}")


def test_config_json_dtype_not_a_weight_dtype(quantized, tmp_path):
    """``--dtype auto`` (and convert of quantized experts without --dtype) take config.json's dtype; one that
    is not a weight dtype failed with "unsupported dtype 'float77'; choose one of [...]", no file named."""
    from edgemoe.config import EngineConfig
    from edgemoe.engine.model_runner import ModelRunner

    d = _copy(quantized["fp8"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": "float77"}))
    with pytest.raises(ValueError, match="dtype 'float77' is not a weight dtype") as e:
        ModelRunner(d, EngineConfig(device="cpu", expert_policy="cpu-all"), progress=False)
    assert "--dtype" in _one_line(e, d / "config.json")
    with pytest.raises(ValueError, match="dtype 'float77' is not a weight dtype") as e:
        convert(d, tmp_path / "out.ftw", progress=False)
    _one_line(e, d / "config.json")


@pytest.mark.parametrize("text, expected", [
    ("[1]", "not a JSON object"),
    (json.dumps({"eos_token_id": "</s>"}), "eos_token_id must be a token id or a list of them, got '</s>'"),
    (json.dumps({"eos_token_id": [1, "x"]}), "eos_token_id must be a token id or a list of them"),
    (json.dumps({"temperature": "hot"}), "temperature must be a finite number >= 0, got 'hot'"),
    (json.dumps({"top_p": [1]}), "top_p must be in (0, 1], got [1]"),
    (json.dumps({"top_k": 2.5}), "top_k must be an integer (<= 0 disables it), got 2.5"),
], ids=["list", "eos-name", "eos-list", "temperature", "top-p", "top-k"])
def test_generation_config_json_of_the_wrong_shape(tiny_model_dir, tmp_path, text, expected):
    """A generation_config.json that is a list failed with an AttributeError traceback; an eos_token_id that is
    not an id with "invalid literal for int()", no file named; a temperature / top_p / top_k of the wrong type
    loaded, and the server then failed every request that set none (they are its sampling defaults)."""
    from edgemoe.config import EngineConfig
    from edgemoe.engine.model_runner import ModelRunner

    d = _copy(tiny_model_dir, tmp_path)
    (d / "generation_config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        ModelRunner(d, EngineConfig(device="cpu", dtype="float32", expert_policy="cpu-all"), progress=False)
    assert expected in _one_line(e, d / "generation_config.json")


@pytest.mark.parametrize("name, text, named, expected", [
    ("tokenizer.json", "{", "tokenizer.json", "not valid JSON"),
    ("tokenizer_config.json", '{"model_max_length": ', "tokenizer_config.json", "not valid JSON"),
    ("tokenizer.json", "{}", "", "cannot load the tokenizer (KeyError"),
    ("tokenizer.json", None, "", "cannot load the tokenizer ("),
    ("chat_template.jinja", "{% if %}", "chat_template.jinja", "the chat template does not compile"),
], ids=["tokenizer-json", "tokenizer-config-json", "tokenizer-json-empty", "tokenizer-json-missing", "template"])
def test_tokenizer_files_that_do_not_load(tiny_model_dir, tmp_path, name, text, named, expected):
    """Tokenizer files transformers fails on: a JSONDecodeError without the file, a KeyError traceback, a
    message of several lines; a chat template that does not compile loaded, and every chat request failed."""
    from edgemoe.engine.tokenizer import load_tokenizer

    d = _copy(tiny_model_dir, tmp_path)
    if text is None:
        (d / name).unlink()
    else:
        (d / name).write_text(text)
    with pytest.raises(ValueError, match=re.escape(expected)) as e:
        load_tokenizer(d)
    assert _one_line(e, d / named).startswith(f"{d / named}: ")


# ------------------------------------------------------------------------------- FTW directories


def test_intact_ftw_loads(ftw_dir):
    _load_ftw(ftw_dir)


@pytest.mark.parametrize("where", [0.1, 0.5, 0.99])
def test_flipped_bit_in_the_bank(ftw_dir, tmp_path, where):
    d = _copy(ftw_dir, tmp_path)
    bank = d / "experts.bin"
    _flip_bit(bank, int(bank.stat().st_size * where))
    with pytest.raises(FTWChecksumError, match="checksum mismatch") as e:
        _load_ftw(d)
    _one_line(e, bank, "MoE layers")


def test_flipped_bit_in_the_non_expert_file(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    _flip_bit(d / "non_expert.safetensors", 4000)
    with pytest.raises(FTWChecksumError, match="checksum mismatch") as e:
        _load_ftw(d)
    _one_line(e, d / "non_expert.safetensors")


@pytest.mark.parametrize("name,what", [("experts.bin", "expert bank file is missing"),
                                       ("non_expert.safetensors", "non-expert weights file is missing")])
def test_missing_ftw_file(ftw_dir, tmp_path, name, what):
    d = _copy(ftw_dir, tmp_path)
    (d / name).unlink()
    with pytest.raises(FTWTruncatedError, match=what) as e:
        _load_ftw(d)
    _one_line(e, d / name)


def test_ftw_directory_without_its_manifest(ftw_dir, tmp_path):
    """Without ftw.json a directory is not taken for FTW, so it was loaded as a Hugging Face directory whose one
    safetensors file is non_expert.safetensors: "missing 144 routed-expert tensor(s)", naming no FTW file."""
    d = _copy(ftw_dir, tmp_path)
    (d / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="an FTW expert bank without its manifest") as e:
        _load_hf(d)
    _one_line(e, d / MANIFEST, "experts.bin", "edgemoe convert")
    with pytest.raises(CheckpointError, match="an FTW expert bank without its manifest") as e:
        convert(d, tmp_path / "out.ftw", progress=False)
    _one_line(e, d / MANIFEST)


def _edit_manifest(d: Path, edit) -> None:
    man = json.loads((d / MANIFEST).read_text())
    edit(man)
    (d / MANIFEST).write_text(json.dumps(man))


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["bank"].pop("row_bytes"), r"manifest field bank\.row_bytes: Field required"),
    (lambda m: m["bank"].update(rows="0"), r"manifest field bank\.rows: Input should be a valid integer"),
    (lambda m: m["layout"].update(format="int8"), r"manifest field layout: invalid expert layout description"),
    (lambda m: m["layout"]["sections"][1].update(offset=8), r"manifest field layout: expert layout description .* "
                                                            "does not match"),
    (lambda m: m.pop("bank"), r"manifest field bank: Field required"),
    (lambda m: m.update(tensors=3), r"manifest field tensors: Extra inputs are not permitted"),
    (lambda m: m["experts"].update(num_experts=-1), r"manifest field experts\.num_experts: Input should be greater"),
    (lambda m: m["non_expert"]["checksum"].update(algorithm="md5"),
     r"manifest field non_expert\.checksum\.algorithm: Input should be 'crc32'"),
], ids=["field-missing", "wrong-type", "layout-format", "layout-offsets", "bank-missing", "unknown-key", "negative",
        "checksum-algorithm"])
def test_manifest_that_does_not_follow_the_schema(ftw_dir, tmp_path, edit, match):
    d = _copy(ftw_dir, tmp_path)
    _edit_manifest(d, edit)
    with pytest.raises(FTWError, match=match) as e:
        _load_ftw(d)
    _one_line(e, d / MANIFEST)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["bank"]["checksum"]["chunks"].append(0), r"bank: inconsistent row_bytes/chunking .* checksums for"),
    (lambda m: m["bank"].update(row_bytes=100), r"bank experts\.bin has 48 rows of 100 bytes, "
                                                r"config\.json and the layout imply 48 rows of 49152"),
    (lambda m: m["non_expert"]["checksum"]["chunks"].append(0), r"non_expert: inconsistent chunking \(chunk_bytes"),
], ids=["extra-checksum", "row-bytes", "non-expert-chunks"])
def test_manifest_inconsistent_with_itself(ftw_dir, tmp_path, edit, match):
    d = _copy(ftw_dir, tmp_path)
    _edit_manifest(d, edit)
    with pytest.raises(FTWError, match=match) as e:
        _load_ftw(d)
    _one_line(e, d / MANIFEST)


def test_manifest_disagreeing_with_the_files(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    _edit_manifest(d, lambda m: m["non_expert"].update(nbytes=m["non_expert"]["nbytes"] + 4096))
    with pytest.raises(FTWTruncatedError, match="manifest says") as e:
        _load_ftw(d)
    _one_line(e, d / "non_expert.safetensors")


def test_manifest_disagreeing_with_config_json(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 32
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FTWConfigError, match=r"moe_intermediate_size 32 in config\.json, 64 in the banks") as e:
        _load_ftw(d)
    _one_line(e, d / "config.json", d / MANIFEST)


def test_ftw_config_json_that_is_not_json(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    (d / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON") as e:
        load_config(d)
    _one_line(e, d / "config.json")
