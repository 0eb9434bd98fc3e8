"""gpt_oss (gpt-oss-20b / gpt-oss-120b) against transformers, on CPU.

Parity: prefill + decode logits and greedy tokens of tiny random-weight checkpoints match transformers'
``GptOssForCausalLM`` (float32, and bfloat16 within bf16 noise) in every execution mode (all experts resident,
each policy with a cache smaller than a layer, streamed prefill, CPU-only; the CPU misses on the torch-ops and
on the native CPU executor; float and MXFP4 experts), with a sliding window (4) shorter than the prompt, tied
and untied embeddings, nonzero expert and router biases and a SwiGLU clamp that bites. Also: attention with
sinks and windows (prefill, chunked prefill after a prefix, eager decode, the Triton paged decode kernel, in
the interpreter on CPU hosts) against transformers' ``eager_attention_forward`` with its own masks; the
experts against ``GptOssExperts``; the config normalization and its errors; the released geometries
(config-only, dummy weights); broken checkpoints; the native CPU executor and the Triton kernels (float and
MXFP4 rows) chosen for these experts; the engine (chunked prefill, batching, preemption, prefix cache, fault
isolation); make-model's Harmony tokenizer and the released chat template.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run in the interpreter on CPU hosts

import pytest
from safetensors.torch import load_file, save_file

from edgemoe.config import EngineConfig, ExpertActivation
from edgemoe.core import ForwardBatch, Phase, SeqSlice
from edgemoe.engine.llm import render_chat
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts import native
from edgemoe.experts.pool import HostExpertPool
from edgemoe.kvcache.pool import KVSpec, PagedKVPool
from edgemoe.layers.attention import paged_attention
from edgemoe.models import load_config, model_class
from edgemoe.synth import config_for, make_model, param_count, write_config_only
from edgemoe.weights.index import CheckpointError

from conftest import check_engine_preemption_prefix_cache_and_faults, greedy_decode, reference_greedy

PROMPT = [3, 17, 92, 5, 41, 8, 77, 23, 64, 11, 9, 30]  # 12 tokens: three windows of the tiny preset's 4
DECODE_STEPS = 6
TOL = dict(rtol=1e-4, atol=1e-4)
# bfloat16: logits of magnitude ~6 differ by up to ~0.3 after 4 layers (transformers' eager attention rounds its
# scores and softmax to bf16, SDPA does not); a top-2 gap moves by at most ~0.16, so a greedy choice whose
# reference margin exceeds BF16_GAP must be the same.
BF16_ATOL = 0.35
BF16_GAP = 0.25

# (preset, dtype): untied, tied, and the untied model in bfloat16
VARIANTS = {"tiny": ("tiny", "float32"), "tied": ("tiny-tied", "float32"), "bf16": ("tiny", "bfloat16")}

# (policy, slots, cpu executor): resident, each policy with a cache smaller than one layer's 16 experts,
# two staging regions of E slots (streamed prefill), CPU-only with the executor chosen automatically (native
# where it builds); every policy that computes misses on the CPU once more with the native executor
MODES = [
    ("fill-all", 10_000, "torch"),
    ("fill-all", 5, "torch"),
    ("fill-all", 32, "torch"),
    ("qstar", 5, "torch"),
    ("auto", 5, "torch"),
    ("adaptive", 5, "torch"),
    ("cpu-all", 5, "torch"),
    ("static", 5, "torch"),
    ("qstar", 0, "auto"),
    ("qstar", 5, "native"),
    ("adaptive", 5, "native"),
    ("cpu-all", 5, "native"),
    ("static", 5, "native"),
]


def _expected_executor(executor: str) -> str:
    """The kind of CPU executor (``native`` or ``torch``) a runner built with ``cpu_executor=executor`` must have:
    the native one where it builds (it computes gpt-oss's experts), else the torch fallback."""
    return "torch" if executor == "torch" or not native.available() else "native"


def _engine_config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", expert_policy="qstar", expert_cache_slots=5,
                bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, cpu_executor="torch")
    return EngineConfig(**{**base, **kw})


def _randomize_biases(path, seed: int = 1) -> None:
    """transformers initializes the experts' biases to zeros; give them values (std 0.2) that matter."""
    f = path / "model.safetensors"
    sd = load_file(f)
    g = torch.Generator().manual_seed(seed)
    for k in sd:
        if k.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            sd[k] = (torch.randn(sd[k].shape, generator=g) * 0.2).to(sd[k].dtype)
    save_file(sd, f, metadata={"format": "pt"})


def _make(out, preset="tiny", dtype="float32", overrides=None, seed=7):
    make_model(out, "gpt_oss", preset, seed=seed, dtype=dtype, overrides=overrides)
    _randomize_biases(out)
    return out


def _load_reference(path, dtype=torch.float32):
    """transformers' ``GptOssForCausalLM`` of ``path`` with the checkpoint's clamped-SwiGLU constants: releases
    before 5.24 hard-code ``alpha`` 1.702 and ``limit`` 7.0 (the released values) and ignore ``swiglu_alpha`` /
    ``swiglu_limit`` in config.json, which the tiny configs set to make the clamps bite."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    kw = {}
    quant = json.loads((Path(path) / "config.json").read_text()).get("quantization_config", {})
    if quant.get("quant_method") == "mxfp4":
        # dequantized into ``dtype`` at load, as on a CPU-only machine: with a CUDA device present and no
        # ``kernels`` package some releases otherwise keep the experts MXFP4 or dequantize them to bf16
        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    # .to(dtype): releases before 5.24 dequantize MXFP4 experts into bf16 parameters whatever ``dtype`` says
    # (exact values: e2m1 times a power of two is a bf16 number), so the experts would compute in bf16
    model = GptOssForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(dtype).eval()
    for layer in model.model.layers:
        _clamp_constants(layer.mlp.experts, model.config)
    return model


def _clamp_constants(experts, cfg) -> None:
    """transformers' ``GptOssExperts`` with the config's clamped-SwiGLU constants (see ``_load_reference``)."""
    experts.alpha = getattr(cfg, "swiglu_alpha", 1.702)
    experts.limit = getattr(cfg, "swiglu_limit", 7.0)


def _reference(path, dtype=torch.float32, prompt=PROMPT, steps=DECODE_STEPS):
    """Greedy prefill + decode with transformers: (logits [steps+1, V], tokens)."""
    return reference_greedy(_load_reference(path, dtype), prompt, steps)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    preset, dtype = VARIANTS[request.param]
    out = _make(tmp_path_factory.mktemp(f"gptoss-{request.param}") / "m", preset, dtype)
    return out, dtype, _reference(out, getattr(torch, dtype))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = _make(tmp_path_factory.mktemp("gptoss") / "tiny")
    return out, _reference(out)


def _forced_decode(runner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Prefill ``prompt``, then decode ``tokens[:-1]`` whatever the model picks (teacher forcing):
    ``[len(tokens), V]`` logits, each step's comparable with the reference's at the same tokens."""
    out = [runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)[0]]
    for i, t in enumerate(tokens[:-1]):
        out.append(runner.execute([StepInput(0, [t], len(prompt) + i)], Phase.DECODE)[0])
    runner.free(0)
    return torch.stack(out).cpu()


def _check_bf16(runner, ref_logits: torch.Tensor, ref_toks: list[int]) -> None:
    """bf16 parity: teacher-forced logits within ``BF16_ATOL``; greedy tokens identical wherever the reference's
    top-2 margin exceeds ``BF16_GAP`` (most steps), free-running greedy tokens identical up to the first step
    whose margin does not."""
    logits = _forced_decode(runner, PROMPT, ref_toks)
    assert (logits - ref_logits).abs().max() < BF16_ATOL
    top2 = ref_logits.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > BF16_GAP
    assert int(sure.sum()) >= 4
    assert torch.equal(logits.argmax(-1)[sure], torch.tensor(ref_toks)[sure])
    first_unsure = int((~sure).nonzero()[0]) if not sure.all() else len(ref_toks)
    toks = greedy_decode(runner, PROMPT, DECODE_STEPS, free=True)[1]
    assert toks[:first_unsure] == ref_toks[:first_unsure]


# ------------------------------------------------------------------------------------------------ attention


def _eager_reference(q, k, v, sinks, scale, q_pos, k_pos, window):
    """transformers' ``eager_attention_forward`` (sinks joining the softmax) with the mask its
    ``create_causal_mask`` / ``create_sliding_window_causal_mask`` give: key ``j`` is visible to the query at
    position ``p`` when ``j <= p`` and, in a sliding layer, ``j > p - window``."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[0] // k.shape[0]
    module.sinks = sinks
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]  # [1, 1, n, m]
    out, _ = eager_attention_forward(module, q[None], k[None], v[None], mask, scale)
    return out[0]  # [n, Hq, D] (the output comes as [B, n, Hq, D])


@pytest.mark.parametrize("window", [None, 1, 5, 130])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_paged_attention_sinks_and_windows_match_transformers(window, with_sinks):
    """Prefill (a whole prompt, a chunk after a cached prefix, a long windowed chunk split into query blocks)
    and eager decode over the paged pool, against transformers' eager attention on the gathered keys."""
    g = torch.Generator().manual_seed(3 + (window or 0))
    Hq, Hk, D, ps = 4, 2, 32, 16
    sinks = torch.randn(Hq, generator=g) * 2 if with_sinks else None
    # (prefix already cached, new tokens): a prompt, a chunk after a prefix, decode, a chunk over query blocks
    cases = [(0, 37), (21, 11), (50, 1), (3, 1100)]
    pool = PagedKVPool(KVSpec.heads(1, Hk, D), 200, ps, torch.float32, torch.device("cpu"))
    seqs, qs, ks, vs, slots, q_start = [], [], [], [], [], 0
    for sid, (prefix, n) in enumerate(cases):
        total = prefix + n
        pool.allocate(sid, total)
        k = torch.randn(total, Hk, D, generator=g)
        v = torch.randn(total, Hk, D, generator=g)
        pool.k[0].index_copy_(0, pool.slots(sid, 0, total), k)
        pool.v[0].index_copy_(0, pool.slots(sid, 0, total), v)
        qs.append(torch.randn(n, Hq, D, generator=g))
        ks.append(k)
        vs.append(v)
        seqs.append(SeqSlice(sid, q_start, n, total, pool.page_table(sid)))
        slots.append(pool.slots(sid, prefix, total))
        q_start += n
    q = torch.cat(qs)
    zeros = torch.zeros(q_start, dtype=torch.int64)
    batch = ForwardBatch(Phase.PREFILL, zeros, zeros, torch.cat(slots), seqs,
                         torch.zeros(len(cases), dtype=torch.int64))
    out = paged_attention(q, pool, 0, batch, D ** -0.5, sinks, window)
    for s, (prefix, n), qq, k, v in zip(seqs, cases, qs, ks, vs):
        ref = _eager_reference(qq.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                               sinks if sinks is not None else torch.full((Hq,), float("-inf")),
                               D ** -0.5, torch.arange(prefix, prefix + n), torch.arange(prefix + n), window)
        torch.testing.assert_close(out[s.q_start:s.q_start + n], ref, rtol=1e-5, atol=1e-5)


DECODE_KERNEL_CASES = [(torch.float32, 0, 64), (torch.float32, 5, 64), (torch.float32, 128, 64),
                       (torch.bfloat16, 100, 128), (torch.float32, 300, 256)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (interpreter) variant; tests/gpu covers CUDA")
@pytest.mark.parametrize("dtype,window,part", DECODE_KERNEL_CASES)
@pytest.mark.parametrize("with_sinks", [True, False])
def test_triton_decode_kernel_sinks_and_window_match_the_torch_path(dtype, window, part, with_sinks):
    check_decode_kernel(dtype, window, part, with_sinks, "cpu")


def check_decode_kernel(dtype: torch.dtype, window: int, part: int, with_sinks: bool, device: str) -> None:
    """The paged decode kernel on ``device`` with sinks and a window (partitions and blocks before the window
    skipped) against the eager decode path (:func:`paged_attention`, float32 on the CPU), on contexts across
    pages and partitions, a padding row (context 0) included."""
    pytest.importorskip("triton")
    from edgemoe.kernels.decode_attention import make_decode_scratch, paged_decode_attention

    g = torch.Generator().manual_seed(window + part)
    Hq, Hk, D, ps = 8, 2, 64, 16
    lens = [1, 0, 130, 77, part, part + 1, 3 * part + 5]
    pool = PagedKVPool(KVSpec.heads(1, Hk, D), 128, ps, dtype, torch.device("cpu"))
    for sid, n in enumerate(lens):
        pool.allocate(sid, n)
        if n:
            pool.k[0].index_copy_(0, pool.slots(sid, 0, n), torch.randn(n, Hk, D, generator=g).to(dtype))
            pool.v[0].index_copy_(0, pool.slots(sid, 0, n), torch.randn(n, Hk, D, generator=g).to(dtype))
    sinks = (torch.randn(Hq, generator=g) * 2).to(dtype) if with_sinks else None
    q = torch.randn(len(lens), Hq, D, generator=g).to(dtype)
    max_pages = -(-max(lens) // ps)
    tables = torch.zeros(len(lens), max_pages, dtype=torch.int32)
    for sid in range(len(lens)):
        pages = pool.pages_of(sid)
        tables[sid, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    scratch = make_decode_scratch(len(lens), Hq, D, max_pages * ps, device, partition_size=part)
    out = torch.full_like(q, float("nan"), device=device)
    paged_decode_attention(q.to(device), pool.k[0].to(device), pool.v[0].to(device), tables.to(device),
                           torch.tensor(lens, dtype=torch.int32, device=device), D ** -0.5, out, scratch, ps,
                           sinks=None if sinks is None else sinks.to(device), window=window)
    out = out.cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    live = [i for i, n in enumerate(lens) if n]
    seqs = [SeqSlice(sid, j, 1, lens[sid], pool.page_table(sid)) for j, sid in enumerate(live)]
    batch = ForwardBatch(Phase.DECODE, torch.zeros(len(live), dtype=torch.int64),
                         torch.zeros(len(live), dtype=torch.int64), torch.zeros(len(live), dtype=torch.int64), seqs,
                         torch.arange(len(live)))
    ref = paged_attention(q[live].float(), pool_f32(pool), 0, batch, D ** -0.5,
                          None if sinks is None else sinks.float(), window or None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[live].float(), ref, rtol=tol, atol=tol)


def pool_f32(pool: PagedKVPool) -> PagedKVPool:
    """The pool with its planes in float32 (the reference computes in float32)."""
    if pool.k.dtype == torch.float32:
        return pool
    f32 = PagedKVPool(pool.spec, pool.k.shape[1] // pool.page_size, pool.page_size, torch.float32, pool.k.device)
    f32.k.copy_(pool.k.float())
    f32.v.copy_(pool.v.float())
    return f32


def test_decode_kernel_rejects_bad_sinks_and_window():
    pytest.importorskip("triton")
    from edgemoe.kernels.decode_attention import make_decode_scratch, paged_decode_attention

    q, kv = torch.zeros(1, 4, 16), torch.zeros(16, 2, 16)
    args = (q, kv, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.25,
            torch.empty_like(q), make_decode_scratch(1, 4, 16, 16, "cpu", partition_size=64), 16)
    with pytest.raises(ValueError, match=r"sinks must be a contiguous \[4\] tensor"):
        paged_decode_attention(*args, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="window must be >= 0"):
        paged_decode_attention(*args, window=-1)


# ------------------------------------------------------------------------------------------------ experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_math_and_loader_layout_match_gpt_oss_experts(tmp_path, dtype):
    """One MoE layer through our router + the shared expert math over the pool the loader filled (gate/up
    de-interleaved, transposition undone, biases in their banks) equals transformers' ``GptOssMLP``."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from edgemoe.experts.compute import run_experts_torch

    path = _make(tmp_path / "m", dtype="float32")
    runner = ModelRunner(path, _engine_config(dtype=str(dtype).removeprefix("torch."), expert_cache_slots=0),
                         progress=False)
    cfg = runner.model_config
    hf = GptOssMLP(cfg.hf_config()).to(dtype)
    _clamp_constants(hf.experts, cfg.hf_config())
    sd = load_file(path / "model.safetensors")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(sd[f"model.layers.2.mlp.{name}"])
    x = (torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    ref, _ = hf(x[None])
    block = runner.model.model.layers[2].mlp
    ids, w = block.route(x)
    ref_scores, ref_ids = hf.router(x)[1:]
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_scores)
    out = torch.zeros(9, cfg.hidden_size)
    flat = ids + 2 * cfg.num_experts
    work = [(int(f), *(flat == f).nonzero(as_tuple=True)) for f in flat.unique()]
    run_experts_torch(runner.pool, x, [(f, t, w[t, j]) for f, t, j in work], out)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref[0].float(), **tol)


def test_swiglu_clamp_bites_in_the_tiny_preset(tmp_path):
    """The tiny preset's limit (1.0) changes the logits: the clamp is exercised by the parity tests."""
    path = _make(tmp_path / "m")
    loose = tmp_path / "loose"
    shutil.copytree(path, loose)
    cfg = json.loads((loose / "config.json").read_text())
    (loose / "config.json").write_text(json.dumps({**cfg, "swiglu_limit": 1e4}))
    clamped, loose_logits = _reference(path, steps=0)[0], _reference(loose, steps=0)[0]
    assert (clamped - loose_logits).abs().max() > 0.1
    assert load_config(path).expert_activation == ExpertActivation("swiglu_oai", 1.702, 1.0, bias=True)


# ------------------------------------------------------------------------------------------------ config

RELEASED_20B = {  # openai/gpt-oss-20b config.json (transformers 4.55 spellings, MXFP4 quantization_config)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_released_config_normalizes():
    c = load_config(RELEASED_20B)
    assert (c.architecture, c.model_type, c.torch_dtype) == ("GptOssForCausalLM", "gpt_oss", "bfloat16")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2880, 24, 64, 8, 64)
    assert (c.num_experts, c.top_k, c.moe_intermediate_size, c.moe_layers) == (32, 4, 2880, tuple(range(24)))
    assert c.sliding_window == 128 and c.layer_types == ("sliding_attention", "full_attention") * 12
    assert [c.is_sliding_attention(i) for i in range(4)] == [True, False, True, False]
    assert c.expert_activation == ExpertActivation("swiglu_oai", 1.702, 7.0, bias=True)
    assert c.expert_numel() == 3 * 2880 * 2880 + 3 * 2880
    rope = c.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"], rope["truncate"]) == ("yarn", 32.0, 150000, False)
    assert c.hf_config().rope_parameters["original_max_position_embeddings"] == 4096
    assert c.eos_token_ids == (200002,) and c.pad_token_id == 199999 and c.attention_bias
    with torch.device("meta"):
        model = model_class(c.architecture)(c)
    names = dict(model.named_parameters())
    assert names["model.layers.0.self_attn.sinks"].shape == (64,) and "model.layers.3.mlp.router.bias" in names
    assert [a.window for a in model.attention_layers()[:3]] == [128, None, 128]
    # transformers' defaults where the config is silent: alternating layers, window 128, YaRN x32 over 150000
    bare = {k: RELEASED_20B[k] for k in ("architectures", "model_type", "hidden_size", "intermediate_size",
                                         "num_hidden_layers", "num_attention_heads", "num_local_experts", "vocab_size")}
    d = load_config(bare)
    assert d.layer_types == c.layer_types and d.sliding_window == 128 and d.top_k == 4 and d.num_kv_heads == 8
    assert d.rope_parameters == {**c.rope_parameters, "rope_theta": 150000.0}


@pytest.mark.parametrize("edit,match", [
    ({"layer_types": ["sliding_attention"] * 23}, "layer_types must list 24 entries"),
    ({"layer_types": ["chunked_attention"] * 24}, "layer_types must list 24 entries of sliding_attention"),
    ({"sliding_window": None}, "sliding_window None must be a positive integer"),
    ({"sliding_window": 0}, "sliding_window 0 must be a positive integer"),
    ({"num_experts_per_tok": 33}, r"num_experts_per_tok 33 must be in \[1, num_local_experts = 32\]"),
    ({"num_local_experts": None}, "missing required field 'num_local_experts'"),
    ({"intermediate_size": None}, "missing required field 'intermediate_size'"),
])
def test_bad_config_names_the_field(edit, match):
    with pytest.raises(ValueError, match=match):
        load_config({**RELEASED_20B, **edit})


@pytest.mark.parametrize("preset,layers,experts,total", [("gpt-oss-20b", 24, 32, 20.91e9),
                                                          ("gpt-oss-120b", 36, 128, 116.83e9)])
def test_released_geometries_config_only(tmp_path, preset, layers, experts, total):
    out = write_config_only(tmp_path / preset, "gpt_oss", preset)
    cfg = load_config(out)
    assert (cfg.num_layers, cfg.num_experts, cfg.vocab_size, cfg.sliding_window) == (layers, experts, 201088, 128)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * (layers // 2)
    assert cfg.rope_parameters["factor"] == 32.0 and cfg.expert_activation.limit == 7.0
    assert len(cfg.eos_token_ids) == 3  # <|return|>, <|endoftext|>, <|call|> of the tokenizer written beside
    # the model card's totals (20.91 B and 116.83 B parameters)
    assert abs(param_count(config_for("gpt_oss", preset)) - total) / total < 0.001


def test_cli_config_only_for_dummy_weight_benchmarks(tmp_path, capsys):
    """``edgemoe make-model --arch gpt_oss --preset gpt-oss-120b --config-only``: config, generation config and
    the Harmony tokenizer, no weights."""
    from edgemoe.cli import main

    out = tmp_path / "120b"
    assert main(["make-model", "--arch", "gpt_oss", "--preset", "gpt-oss-120b", "--out", str(out),
                 "--config-only"]) == 0
    assert not list(out.glob("*.safetensors"))
    cfg = load_config(out)
    assert (cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size) == (36, 128, 2880, 2880)
    assert "<|channel|>" in (out / "tokenizer_config.json").read_text() + (out / "tokenizer.json").read_text()


@pytest.mark.parametrize("quant", [None, "mxfp4"])
def test_config_only_serves_dummy_weights(tmp_path, quant):
    """``make-model --config-only [--quant mxfp4]`` + ``--load-format dummy`` (the benchmark path: bf16 or the
    releases' MXFP4 rows), at a reduced depth and width."""
    small = {"hidden_size": 128, "num_hidden_layers": 2, "num_local_experts": 16, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 64, "vocab_size": 1024,
             "layer_types": ["sliding_attention", "full_attention"]}
    out = write_config_only(tmp_path / "c", "gpt_oss", "gpt-oss-120b", overrides=small, quant=quant)
    runner = ModelRunner(out, _engine_config(load_format="dummy", dtype="bfloat16"), progress=False)
    assert runner.pool.format.value == (quant or "bf16")
    b13, b2 = runner.pool.view("b13"), runner.pool.view("b2")  # the rows' bias sections
    assert b13.abs().sum() > 0 and b2.shape == (32, 128) and not torch.equal(b2[0], b2[1])
    logits, _ = greedy_decode(runner, PROMPT, 2)
    assert logits.shape == (3, 1024) and torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("policy,slots,executor", MODES, ids=[f"{p}-{s}-{e}" for p, s, e in MODES])
def test_logits_and_greedy_tokens_match_transformers(checkpoint, policy, slots, executor):
    path, dtype, (ref_logits, ref_toks) = checkpoint
    runner = ModelRunner(path, _engine_config(dtype=dtype, expert_policy=policy, expert_cache_slots=slots,
                                              cpu_executor=executor), progress=False)
    assert runner.experts.cpu_executor.name.split("-")[0] == _expected_executor(executor)
    if dtype == "float32":
        logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
        assert toks == ref_toks
        torch.testing.assert_close(logits, ref_logits, **TOL)
    else:
        _check_bf16(runner, ref_logits, ref_toks)
    runner.experts.cache.check_invariants()
    st = runner.experts.stats()
    assert st["decode"]["misses"] == st["decode"]["fills"] + st["decode"]["cpu"]
    if slots == 0 or policy == "cpu-all":
        assert st["decode"]["fills"] == 0
    if policy == "qstar" and slots:
        assert st["decode"]["fills"] > 0 and st["decode"]["cpu"] > 0  # both branches exercised
    if executor != "torch":
        assert st["decode"]["cpu"] > 0  # the native executor computed misses
    if policy == "static":
        assert st["decode"]["fills"] == 0 and st["prefill"]["fills"] == 0
    if slots == 32:  # T·k = 48 >= 2E: the prefill streamed whole layers through two staging regions
        assert st["prefill"]["fills"] >= 16


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """The tiny preset in gpt-oss's released MXFP4 layout (``make-model --quant mxfp4``: experts as
    ``gate_up_proj_blocks`` / ``_scales`` (E8M0, bias 127) / ``_bias`` and ``down_proj_*``), and transformers'
    greedy reference on it (its MXFP4 integration dequantizes the experts on the CPU)."""
    out = tmp_path_factory.mktemp("gptoss-mxfp4") / "m"
    make_model(out, "gpt_oss", "tiny", seed=7, dtype="float32", quant="mxfp4")
    _randomize_biases(out)
    return out, _reference(out)


MXFP4_MODES = [("fill-all", 10_000, "torch"), ("qstar", 5, "torch"), ("fill-all", 32, "torch"),
               ("static", 5, "torch"), ("qstar", 0, "auto"), ("qstar", 5, "native"), ("cpu-all", 5, "native"),
               ("static", 5, "native")]


@pytest.mark.parametrize("policy,slots,executor", MXFP4_MODES, ids=[f"{p}-{s}-{e}" for p, s, e in MXFP4_MODES])
def test_mxfp4_release_layout_matches_transformers(mxfp4, policy, slots, executor):
    """The experts stay MXFP4 in host memory and in the cache (packed rows with their float32 bias sections) and
    compute dequantized, as transformers' ``integrations/mxfp4.py`` dequantizes them: identical greedy tokens and
    logits within float32 noise in every mode."""
    path, (ref_logits, ref_toks) = mxfp4
    sd = load_file(path / "model.safetensors")
    prefix = "model.layers.0.mlp.experts"
    blocks, scales = sd[f"{prefix}.gate_up_proj_blocks"], sd[f"{prefix}.down_proj_scales"]
    assert blocks.dtype == torch.uint8 and blocks.shape == (16, 64, 2, 16) and scales.shape == (16, 64, 1)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in sd
    runner = ModelRunner(path, _engine_config(expert_policy=policy, expert_cache_slots=slots, cpu_executor=executor),
                         progress=False)
    pool = runner.pool
    assert pool.format.value == "mxfp4" and pool.layout.has_bias and pool.compute_dtype == torch.float32
    assert runner.experts.cpu_executor.name.split("-")[0] == _expected_executor(executor)
    logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)
    st = runner.experts.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if policy == "qstar" and slots:
        assert st["fills"] > 0 and st["cpu"] > 0
    if executor != "torch":
        assert st["cpu"] > 0


@pytest.fixture(scope="module")
def mxfp4_bf16(tmp_path_factory):
    """The MXFP4 release layout of a bfloat16 model: rows dequantized into bfloat16 (the released checkpoints'
    compute dtype), and transformers' bf16 greedy reference on it."""
    out = tmp_path_factory.mktemp("gptoss-mxfp4-bf16") / "m"
    make_model(out, "gpt_oss", "tiny", seed=7, dtype="bfloat16", quant="mxfp4")
    _randomize_biases(out)
    return out, _reference(out, torch.bfloat16)


MXFP4_BF16_MODES = [("fill-all", 10_000, "torch"), ("qstar", 5, "native"), ("cpu-all", 5, "native"),
                    ("qstar", 0, "auto")]


@pytest.mark.parametrize("policy,slots,executor", MXFP4_BF16_MODES,
                         ids=[f"{p}-{s}-{e}" for p, s, e in MXFP4_BF16_MODES])
def test_mxfp4_bf16_matches_transformers(mxfp4_bf16, policy, slots, executor):
    """MXFP4 rows computing in bfloat16 (the native kernels round each dequantized weight to bf16, as the torch
    path's ``.to(bfloat16)``) within bf16 noise of transformers, on the torch-ops and the native executor."""
    path, (ref_logits, ref_toks) = mxfp4_bf16
    runner = ModelRunner(path, _engine_config(dtype="bfloat16", expert_policy=policy, expert_cache_slots=slots,
                                              cpu_executor=executor), progress=False)
    assert runner.pool.format.value == "mxfp4" and runner.pool.compute_dtype == torch.bfloat16
    assert runner.experts.cpu_executor.name.split("-")[0] == _expected_executor(executor)
    _check_bf16(runner, ref_logits, ref_toks)
    st = runner.experts.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if executor != "torch":
        assert st["cpu"] > 0


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.pop("model.layers.1.mlp.experts.gate_up_proj_bias"),
     r"missing 32 routed-expert tensor\(s\), first: MoE layer ordinal 1 expert 0 gate_proj\.bias"),
    (lambda sd: sd.__setitem__("model.layers.2.mlp.experts.gate_up_proj_bias", torch.zeros(16, 60)),
     r"tensor model\.layers\.2\.mlp\.experts\.gate_up_proj_bias has shape \(16, 60\), expected \(16, 64\)"),
    (lambda sd: sd.__setitem__("model.layers.0.mlp.experts.down_proj_scales",
                               torch.zeros(16, 64, 2, dtype=torch.uint8)),
     r"tensor model\.layers\.0\.mlp\.experts\.down_proj_scales has shape \[16, 64, 2\], expected \[16, 64, 1\]"),
], ids=["missing-bias", "bias-shape", "scales-shape"])
def test_broken_mxfp4_checkpoint_names_the_tensor(mxfp4, tmp_path, edit, match):
    d = tmp_path / "ckpt"
    shutil.copytree(mxfp4[0], d)
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
        ModelRunner(d, _engine_config(), progress=False)


def test_the_kernels_read_quantized_rows_of_these_experts():
    """The Triton kernels read float and quantized rows of gpt-oss's experts (clamped SwiGLU, slot biases): only
    an FP8 block they do not tile is refused, whatever the experts."""
    from edgemoe.experts.compute import kernel_reason
    from edgemoe.quant.layout import ExpertLayout
    from edgemoe.quant.weights import WeightFormat

    for fmt in (WeightFormat.BF16, WeightFormat.MXFP4, WeightFormat.NVFP4, WeightFormat.FP8_BLOCK):
        assert kernel_reason(ExpertLayout.build(fmt, 64, 32, has_bias=True)) is None, fmt
    assert "power of two" in kernel_reason(ExpertLayout.build(WeightFormat.FP8_BLOCK, 64, 32, has_bias=True,
                                                              block_size=(128, 96)))


def test_mxfp4_rows_dequantize_as_transformers(mxfp4):
    """Every expert row of the pool, dequantized, equals transformers' dequantized ``GptOssExperts`` weights
    (gate/up de-interleaved, transposed to edgemoe's ``[2I, H]`` / ``[H, I]``) and biases, bit for bit."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    path = mxfp4[0]
    # dequantized at load (releases from 5.25 otherwise fetch MXFP4 kernels from the Hub when Triton and the
    # ``kernels`` package are installed, even on a CPU-only machine)
    ref = GptOssForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    pool = ModelRunner(path, _engine_config(expert_cache_slots=0), progress=False).pool
    E = 16
    w13, w2 = pool.layout.dequant_rows(pool.bank, range(pool.num_ids))
    b13, b2 = pool.layout.bias_rows(pool.bank, range(pool.num_ids))
    for layer, block in enumerate(ref.model.layers):
        ex, rows = block.mlp.experts, slice(layer * E, (layer + 1) * E)
        gu, gub = ex.gate_up_proj.data, ex.gate_up_proj_bias.data  # [E, H, 2I] interleaved, [E, 2I]
        assert torch.equal(w13[rows], torch.cat((gu[..., ::2], gu[..., 1::2]), dim=-1).transpose(1, 2))
        assert torch.equal(w2[rows], ex.down_proj.data.transpose(1, 2))
        assert torch.equal(b13[rows], torch.cat((gub[:, ::2], gub[:, 1::2]), dim=-1))
        assert torch.equal(b2[rows], ex.down_proj_bias.data)


def test_variant_geometry(checkpoint):
    """Each variant is what it claims: the parity above covers these code paths."""
    path, dtype, _ = checkpoint
    cfg = load_config(path)
    names = dict(ModelRunner(path, _engine_config(dtype=dtype), progress=False).model.named_parameters())
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings)
    assert cfg.sliding_window == 4 < len(PROMPT) and cfg.torch_dtype == dtype
    sd = load_file(path / "model.safetensors")
    for name in ("mlp.experts.down_proj_bias", "mlp.experts.gate_up_proj_bias", "mlp.router.bias", "self_attn.sinks"):
        assert sd[f"model.layers.1.{name}"].float().abs().min() > 0, name  # nonzero: the parity depends on them
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] > 1 and cfg.top_k == 4


def test_batched_and_chunked_match_alone(tiny):
    """Chunked prefill (chunks shorter and longer than the window) and two sequences in one batch."""
    path, (ref_logits, ref_toks) = tiny
    runner = ModelRunner(path, _engine_config(), progress=False)
    chunked, toks = greedy_decode(runner, PROMPT, 3, seq_id=1, chunk_ends=[1, 3, 9], free=True)
    assert toks == ref_toks[:4]
    torch.testing.assert_close(chunked, ref_logits[:4], **TOL)
    a, b = PROMPT, PROMPT[::-1][:7]
    both = runner.execute([StepInput(1, a, 0), StepInput(2, b, 0)], Phase.PREFILL)
    alone_b = greedy_decode(runner, b, 0, seq_id=3, free=True)[0]
    torch.testing.assert_close(both[0], ref_logits[0], **TOL)
    torch.testing.assert_close(both[1], alone_b[0], **TOL)


def test_long_prompt_matches_transformers(tmp_path):
    """A prompt of 1,100 tokens: sliding layers compute their queries in blocks (1,024 per SDPA call)."""
    path = _make(tmp_path / "m")
    prompt = [(i * 37 + 11) % 1000 + 3 for i in range(1100)]
    ref_logits, ref_toks = _reference(path, prompt=prompt, steps=1)
    logits, toks = greedy_decode(ModelRunner(path, _engine_config(), progress=False), prompt, 1)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=2e-4)


# ------------------------------------------------------------------------------------------------ kernels refused


def test_cpu_executor_is_native_for_these_experts(tiny, caplog):
    if not native.available():
        pytest.skip(f"native CPU extension unavailable: {native.build().error}")
    with caplog.at_level(logging.WARNING, logger="edgemoe.experts.cpu_executor"):
        runner = ModelRunner(tiny[0], _engine_config(cpu_executor="native"), progress=False)
    assert runner.experts.cpu_executor.name.startswith("native-")
    assert not [r for r in caplog.records if r.name == "edgemoe.experts.cpu_executor"]  # no fallback warning


def test_grouped_kernels_take_these_experts(monkeypatch):
    """Where the grouped Triton kernels run, ``run_sorted_experts`` hands them swiglu_oai / biased experts, float
    and MXFP4 slots, with the clamp's constants and the slots' bias sections."""
    from edgemoe.experts import compute
    from edgemoe.quant.layout import ExpertLayout
    from edgemoe.quant.weights import WeightFormat

    calls = []

    class Grouped:
        def grouped_swiglu(self, *args, **kw):
            calls.append(("float", kw))

        def grouped_swiglu_quant(self, *args, **kw):
            calls.append(("quant", kw))

    monkeypatch.setattr(compute, "kernel_module", lambda name, device: Grouped())
    x, ids = torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.int64)
    act = ExpertActivation("swiglu_oai", 1.5, 3.0, bias=True)
    for pool in (HostExpertPool.dense(1, 32, 32, torch.float32, act),
                 HostExpertPool(1, ExpertLayout.build(WeightFormat.MXFP4, 32, 32, has_bias=True), torch.float32, act)):
        compute.run_sorted_experts(x, ids, torch.ones(2, 1), torch.zeros(1, dtype=torch.int64), pool.layout, pool.bank,
                                   torch.zeros(2, 1, 32), act=act)
    assert [kind for kind, _ in calls] == ["float", "quant"]
    for _, kw in calls:
        assert kw["swiglu_oai"] == (1.5, 3.0)
        assert kw["biases"][0].shape == (1, 64) and kw["biases"][1].shape == (1, 32)


# ------------------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.pop("model.layers.2.mlp.experts.gate_up_proj_bias"),
     r"missing 32 routed-expert tensor\(s\), first: MoE layer ordinal 2 expert 0 gate_proj\.bias"),
    (lambda sd: sd.__setitem__("model.layers.1.mlp.experts.down_proj_bias", torch.zeros(16, 32)),
     r"tensor model\.layers\.1\.mlp\.experts\.down_proj_bias has shape \(16, 32\), expected \(16, 64\)"),
    (lambda sd: sd.__setitem__("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(16, 64, 60)),
     r"tensor model\.layers\.0\.mlp\.experts\.gate_up_proj has shape \(16, 64, 60\), expected \(16, 64, 64\)"),
    (lambda sd: sd.__setitem__("model.layers.3.mlp.experts.down_proj", torch.zeros(16, 64, 32)),
     r"tensor model\.layers\.3\.mlp\.experts\.down_proj has shape \(16, 64, 32\), expected \(16, 32, 64\)"),
    (lambda sd: sd.pop("model.layers.1.self_attn.sinks"),
     r"missing tensor\(s\) \['model\.layers\.1\.self_attn\.sinks'\]"),
    (lambda sd: sd.pop("model.layers.0.mlp.router.bias"),
     r"missing tensor\(s\) \['model\.layers\.0\.mlp\.router\.bias'\]"),
], ids=["missing-bias", "bias-shape", "gate-up-shape", "down-untransposed", "missing-sinks", "missing-router-bias"])
def test_broken_checkpoint_names_the_tensor(tiny, tmp_path, edit, match):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny[0], d)
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
        ModelRunner(d, _engine_config(), progress=False)


def test_expert_biases_refused_where_the_experts_have_none(tiny_model_dir, tmp_path):
    d = tmp_path / "qwen"
    shutil.copytree(tiny_model_dir, d)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.mlp.experts.down_proj_bias"] = torch.zeros(8, 64)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"down_proj_bias: routed-expert biases, but Qwen3MoeForCausalLM's "
                                              "experts have none"):
        ModelRunner(d, _engine_config(), progress=False)


def test_ftw_round_trip_keeps_the_biases(tiny, tmp_path):
    """``edgemoe convert`` writes the experts' rows with their bias sections; serving the FTW directory gives the
    Hugging Face directory's logits."""
    from edgemoe.weights.ftw import convert

    path, (ref_logits, ref_toks) = tiny
    out = convert(path, tmp_path / "ftw", progress=False)
    runner = ModelRunner(out, _engine_config(), progress=False)
    assert runner.weights_format == "FTW" and runner.pool.layout.has_bias
    logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)


# ------------------------------------------------------------------------------------------------ engine


def test_engine_preemption_prefix_cache_and_fault_isolation(tiny, monkeypatch):
    # no expert-cache slots the tight KV cache could borrow instead
    check_engine_preemption_prefix_cache_and_faults(tiny[0], _engine_config, monkeypatch, expert_cache_slots=0)


# ------------------------------------------------------------------------------------------------ make-model


def test_make_model_harmony_tokenizer_and_template(tiny):
    from transformers import AutoTokenizer

    from edgemoe.synth.tokenizer import TOKENIZERS

    path = tiny[0]
    spec = TOKENIZERS["gpt_oss"]
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    assert cfg["eos_token_id"] == gen["eos_token_id"] == eos and cfg["pad_token_id"] == eos[1]
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["vocab_size"] >= len(tok)
    assert set(spec.special_tokens) <= set(tok.all_special_tokens)
    ids = [tok.convert_tokens_to_ids(t) for t in spec.special_tokens]
    assert ids == sorted(ids)  # o200k_harmony's order
    for t in spec.special_tokens:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "description": "The city."}},
                                                   "required": ["city"]}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "thinking": "Need a tool.",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "18 C"}]
    text, ids = render_chat(tok, messages, tools=tools, chat_template_kwargs={"reasoning_effort": "high"})
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                           "Knowledge cutoff: 2024-06\nCurrent date: ")
    assert "\n\nReasoning: high\n\n# Valid channels: analysis, commentary, final. Channel must be included for " \
           "every message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>" in text
    assert text.endswith(
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n"
        "// Weather in a city.\ntype get_weather = (_: {\n// The city.\ncity: string,\n}) => any;\n\n"
        "} // namespace functions<|end|><|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need a tool.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C"<|end|><|start|>assistant')
    assert tok.decode(ids) == text
    assert "Reasoning: medium" in render_chat(tok, messages[:2])[0]  # the template's default


def test_cli_make_model_and_generate(tmp_path, capsys):
    from edgemoe.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--arch", "gpt_oss", "--preset", "tiny", "--out", str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt_oss"
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "Hello there", "--chat", "--max-tokens", "5", "--ignore-eos",
                 "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
