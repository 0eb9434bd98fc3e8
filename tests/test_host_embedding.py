"""The token embedding in host memory (``token_embedding="host"``) on the CPU: the row-gather kernel in Triton's
interpreter equals ``index_select`` bit for bit, ``HostEmbedding`` equals ``nn.Embedding`` over the same checkpoint,
the table is never allocated on the compute device and the weight accounting leaves it out, and the option is
refused with one line for tied embeddings and for a device that is not a GPU. The CUDA side (pinned table, whole
model on and off, CUDA-graph capture) is ``tests/gpu/test_host_embedding_gpu.py``."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

triton = pytest.importorskip("triton")

from edgemoe.config import EngineConfig  # noqa: E402
from edgemoe.engine.model_runner import ModelRunner, NoGpuError  # noqa: E402
from edgemoe.kernels.embedding import gather_rows  # noqa: E402
from edgemoe.layers.embedding import HostEmbedding  # noqa: E402
from edgemoe.models import load_config, model_class  # noqa: E402
from edgemoe.synth import make_model  # noqa: E402
from edgemoe.weights.loader import load_checkpoint  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _table(V: int, H: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``[V, H]`` of random values; float tables hold a NaN and a negative zero (a copy keeps every bit)."""
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(0, 256, (V, H), generator=g, dtype=dtype).to(DEV)
    t = (torch.randn(V, H, generator=g) * 100).to(dtype)
    t[1, 0], t[2, -1] = float("nan"), -0.0
    return t.to(DEV)


# ---------------------------------------------------------------- the kernel


@pytest.mark.parametrize("ids", [[0], [36], [7], [0, 36, 5, 5, 0, 36, 12], list(range(37))[::-1]],
                         ids=["T1-first", "T1-last", "T1-middle", "repeats-and-ends", "every-row-reversed"])
@pytest.mark.parametrize("dtype,H", [(torch.bfloat16, 256), (torch.float32, 64), (torch.bfloat16, 3),
                                     (torch.float16, 2050), (torch.uint8, 5)],
                         ids=["bf16-int64-words", "fp32", "bf16-int16-words", "fp16-two-blocks", "bytes"])
def test_gather_rows_equals_index_select_bit_for_bit(ids, dtype, H):
    table = _table(37, H, dtype)
    idx = torch.tensor(ids, dtype=torch.int64, device=DEV)
    out = torch.full((len(ids), H), 7, dtype=dtype, device=DEV)
    assert gather_rows(idx, table, out) is out
    want = table.index_select(0, idx)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))  # bit patterns, NaN included


def test_gather_rows_int32_ids_zero_rows_outside_the_table_and_errors():
    table = _table(9, 16, torch.bfloat16)
    out = torch.full((4, 16), 3.0, dtype=torch.bfloat16, device=DEV)
    gather_rows(torch.tensor([8, -1, 9, 0], dtype=torch.int32, device=DEV), table, out)
    assert torch.equal(out[0], table[8]) and torch.equal(out[3], table[0])
    assert not out[1:3].any()  # an id outside [0, V) reads nothing: a zero row
    strided = torch.tensor([[5, 1], [0, 1], [8, 1]], device=DEV)[:, 0]  # a column: stride 2
    gather_rows(strided, table, out[:3])
    assert torch.equal(out[:3], table[[5, 0, 8]])
    empty = torch.empty(0, 16, dtype=torch.bfloat16, device=DEV)
    assert gather_rows(torch.empty(0, dtype=torch.int64, device=DEV), table, empty) is empty
    ids = torch.zeros(4, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="1-D int64 or int32"):
        gather_rows(ids.float(), table, out)
    with pytest.raises(ValueError, match="1-D int64 or int32"):
        gather_rows(ids.view(2, 2), table, out)
    with pytest.raises(ValueError, match="does not fit"):
        gather_rows(ids, table, out.float())
    with pytest.raises(ValueError, match="does not fit"):
        gather_rows(ids[:3], table, out)
    with pytest.raises(ValueError, match="table must be a contiguous 2-D tensor"):
        gather_rows(ids, table.t(), out)


# ---------------------------------------------------------------- the module in a model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("host-embed") / "tiny", "qwen3_moe", "tiny", dtype="bfloat16")


def _loaded(model_dir, host: bool):
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    if host:
        model.keep_embedding_on_host()
    load_checkpoint(model, model_dir, cfg, torch.bfloat16, torch.device("cpu"), progress=False)
    return model


def test_host_embedding_loads_under_the_checkpoint_name_and_equals_nn_embedding(tiny):
    device, host = _loaded(tiny, False), _loaded(tiny, True)
    emb = host.decoder.embed_tokens
    assert isinstance(emb, HostEmbedding) and not emb.pinned
    assert isinstance(device.decoder.embed_tokens, torch.nn.Embedding)
    assert torch.equal(emb.weight, device.decoder.embed_tokens.weight)  # filled by the loader by name
    V = host.config.vocab_size
    for ids in ([V - 1], [0, V - 1, 17, 17, 0]):
        t = torch.tensor(ids)
        assert torch.equal(emb(t), device.decoder.embed_tokens(t))
    t = torch.tensor([[3, V - 1], [0, 3]])  # any shape of ids, as nn.Embedding
    assert torch.equal(emb(t), device.decoder.embed_tokens(t))
    # the rest of the model is untouched: the same parameters in the same order
    assert [n for n, _ in host.named_parameters()] == [n for n, _ in device.named_parameters()]
    with pytest.raises(RuntimeError, match="before the weights are loaded"):
        host.keep_embedding_on_host()


def test_the_table_is_never_allocated_on_the_compute_device_and_is_not_counted_there(tiny):
    """``materialize`` on a stand-in compute device (meta): every parameter goes there but the host table, and
    ``weight_bytes`` moves exactly its ``V x H`` bytes from the device's share to the host's."""
    cfg = load_config(tiny)
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        plain, host = cls(cfg), cls(cfg)
    host.keep_embedding_on_host()
    for m in (plain, host):
        m.materialize(torch.bfloat16, torch.device("meta"))
    table = host.decoder.embed_tokens.weight
    assert table.device.type == "cpu" and table.dtype == torch.bfloat16
    assert all(p.is_meta for n, p in host.named_parameters() if not n.endswith("embed_tokens.weight"))
    table_bytes = cfg.vocab_size * cfg.hidden_size * 2
    on_device, on_host = plain.weight_bytes()
    assert on_host == 0 and on_device == sum(p.numel() * 2 for p in plain.parameters()) + sum(
        b.numel() * b.element_size() for b in plain.buffers())
    assert host.weight_bytes() == (on_device - table_bytes, table_bytes)


def test_laptop_benchmark_counts_the_embedding_once(tiny, load_benchmark):
    """The laptop benchmark's weight figures: the GPU's share drops by the table, and the bytes a decode step reads
    from GPU memory (weights but the embedding) stay the same in both placements (the table was subtracted even
    when it was not on the GPU)."""
    laptop = load_benchmark("laptop")
    device, host = (laptop.weight_figures(_loaded(tiny, h)) for h in (False, True))
    cfg = load_config(tiny)
    table = cfg.vocab_size * cfg.hidden_size * 2
    assert device["embed_bytes"] == table and device["host_embedding_bytes"] == 0
    assert host == {"weights_bytes": device["weights_bytes"] - table, "embed_bytes": 0, "host_embedding_bytes": table}
    assert laptop.token_embedding("auto", "cuda", tied=False) == "host"
    assert laptop.token_embedding("auto", "cuda", tied=True) == laptop.token_embedding("auto", "cpu", False) == "device"
    assert laptop.token_embedding("host", "cpu", tied=False) == "host"  # as given: the engine refuses it


# ---------------------------------------------------------------- the option's refusals


def test_tied_embeddings_are_refused_before_the_weights(tmp_path):
    tied = make_model(tmp_path / "tied", "gpt_oss", "tiny-tied", dtype="float32")
    cfg = load_config(tied)
    assert cfg.tie_word_embeddings
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    with pytest.raises(ValueError, match=r"^token_embedding host: GptOssForCausalLM ties its LM head to the token "
                                         r"embedding \(tie_word_embeddings\)") as e:
        model.keep_embedding_on_host()
    assert "\n" not in str(e.value)
    assert isinstance(model.decoder.embed_tokens, torch.nn.Embedding)  # nothing changed
    with pytest.raises(ValueError, match="ties its LM head"):  # the runner asks before reading a weight
        ModelRunner(tied, EngineConfig(device="cpu", token_embedding="host"), progress=False)


def test_a_device_that_is_not_a_gpu_is_refused_and_the_option_is_validated(tiny):
    with pytest.raises(NoGpuError, match=r"^token_embedding host: the device is cpu, not a GPU") as e:
        ModelRunner(tiny, EngineConfig(device="cpu", token_embedding="host"), progress=False)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="token_embedding 'gpu': choose one of device, host"):
        EngineConfig(token_embedding="gpu")
    assert EngineConfig().token_embedding == "device"


def test_the_cli_flag_and_the_summary_line(tiny):
    from edgemoe.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", str(tiny), "--token-embedding", "host"])
    assert engine_config_from_args(args).token_embedding == "host"
    runner = ModelRunner(tiny, EngineConfig(device="cpu", cpu_executor="torch", max_model_len=256), progress=False)
    line = next(x for x in runner.summary().splitlines() if x.startswith("  weights "))
    assert line.endswith("token embedding: cpu (0.00 GB of those)")
