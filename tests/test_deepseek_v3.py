"""deepseek_v3 (DeepSeek-V3 / Kimi-K2: multi-head latent attention, sigmoid group-limited routing) against
transformers, on CPU.

Parity: prefill + decode logits and greedy tokens of tiny random-weight checkpoints match transformers'
``DeepseekV3ForCausalLM`` (fp32) in every execution mode (all experts resident, each policy with a cache
smaller than one layer's experts, streamed prefill, CPU-only), for three release variants: DeepSeek-V3
(q LoRA, YaRN with mscale, 4 groups of which 2 chosen, 2 shared experts, an MTP layer in the checkpoint),
Kimi-K2 (``model_type`` ``kimi_k2``, one group, saved rotary buffers, no MTP) and a V2-Lite-style
attention (no q LoRA, tied embeddings, 2 dense layers, plain RoPE, attention bias). Every checkpoint's
``e_score_correction_bias`` is random, so expert choice and expert weights come from different scores.
Also: the router and the two attention forms against each other and the reference, the latent KV pool,
the device-path decode batch, chunked prefill, batching, the prefix cache over latent pages, preemption,
fault isolation, float32 router parameters at bf16, strict loading, FTW, the presets and the CLI.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe.config import EngineConfig
from edgemoe.core import DecodeMeta, ForwardBatch, Phase, SeqSlice
from edgemoe.engine.llm_engine import LLMEngine
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.kvcache.pool import KVSpec, PagedKVPool
from edgemoe.layers.mla import LatentAttention
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models import load_config, model_class
from edgemoe.synth import config_for, make_model, param_count, write_config_only
from edgemoe.weights.index import CheckpointError

from conftest import fault_isolated, greedy_decode, reference_greedy, run_requests, run_with_fault

ARCH = "deepseek_v3"
PROMPT = [(i * 37 + 11) % 1000 + 3 for i in range(24)]  # T·k = 96 >= 2E = 32: a fill-all-32 prefill streams
DECODE_STEPS = 5
TOL = dict(rtol=1e-4, atol=1e-4)
BIAS_STD = 0.1  # e_score_correction_bias of the test checkpoints (transformers initializes it to 0)

VARIANTS = {
    "v3": ({}, None),
    "kimi": ({"n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.827,
              "num_nextn_predict_layers": 0,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "original_max_position_embeddings": 64}}, "kimi_k2"),
    "lite-tied": ({"q_lora_rank": None, "tie_word_embeddings": True, "first_k_dense_replace": 2,
                   "norm_topk_prob": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                   "rope_interleave": False, "attention_bias": True}, None),
}
# (policy, slots): resident; fill-all / qstar / auto (the default) / adaptive / cpu-all / static with fewer slots
# than one layer's 16 experts; fill-all with 2E slots (streamed prefill); CPU-only
MODES = [("fill-all", 10_000), ("fill-all", 5), ("fill-all", 32), ("qstar", 5), ("auto", 5), ("adaptive", 5),
         ("cpu-all", 5), ("static", 5), ("qstar", 0)]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


def _engine_config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", expert_policy="qstar", expert_cache_slots=6, bandwidth_pcie_gbps=10.0,
                bandwidth_cpu_gbps=25.0)
    return EngineConfig(**{**base, **kw})


def _release_layout(out, model_type: str | None, seed: int) -> None:
    """Make a transformers-saved tiny checkpoint look like a release: a random ``e_score_correction_bias``
    (float32), the multi-token-prediction layer ``model.layers.{N}`` when the config has one, Kimi-K2's
    saved rotary ``inv_freq`` buffers and ``model_type``."""
    cfg = json.loads((out / "config.json").read_text())
    sd = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name in sd:
        if name.endswith("e_score_correction_bias"):
            sd[name] = torch.randn(sd[name].shape, generator=g) * BIAS_STD
    N, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    if cfg["num_nextn_predict_layers"]:
        mtp = f"model.layers.{N}."
        sd.update({mtp + "eh_proj.weight": torch.randn(H, 2 * H), mtp + "enorm.weight": torch.ones(H),
                   mtp + "hnorm.weight": torch.ones(H), mtp + "shared_head.norm.weight": torch.ones(H),
                   mtp + "self_attn.kv_b_proj.weight": torch.randn(7, 5),
                   mtp + "mlp.experts.3.gate_proj.weight": torch.randn(cfg["moe_intermediate_size"], H),
                   mtp + "mlp.gate.e_score_correction_bias": torch.zeros(cfg["n_routed_experts"])})
    if model_type == "kimi_k2":
        for i in range(N):
            sd[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(cfg["qk_rope_head_dim"] // 2)
        cfg["model_type"] = "kimi_k2"
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})


def make_checkpoint(out, overrides: dict | None = None, model_type: str | None = None, seed: int = 7,
                    dtype: str = "float32", **kw):
    """The tiny preset (plus ``overrides``) in the release layout (see :func:`_release_layout`)."""
    make_model(out, ARCH, "tiny", seed=seed, dtype=dtype, overrides=overrides, **kw)
    _release_layout(out, model_type, seed)
    return out


def _hf_model(path, dtype=torch.float32):
    """transformers' model of the checkpoint; a ``kimi_k2`` config is given as the ``DeepseekV3Config`` it is
    (transformers 5 maps per-expert tensors onto its fused experts by model type)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    raw = json.loads((path / "config.json").read_text())
    config = DeepseekV3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    return DeepseekV3ForCausalLM.from_pretrained(path, config=config, dtype=dtype).eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    overrides, model_type = VARIANTS[request.param]
    out = make_checkpoint(tmp_path_factory.mktemp(f"dsv3-{request.param}") / "m", overrides, model_type)
    return out, reference_greedy(_hf_model(out), PROMPT, DECODE_STEPS)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    out = make_checkpoint(tmp_path_factory.mktemp("dsv3") / "m")
    return out, reference_greedy(_hf_model(out), PROMPT, DECODE_STEPS)


@pytest.fixture(scope="module")
def runner(v3):
    """All experts resident (fill-all): results do not depend on the expert cache's history."""
    return ModelRunner(v3[0], _engine_config(expert_policy="fill-all", expert_cache_slots=10_000, cpu_executor="torch"),
                       progress=False)


# ------------------------------------------------------------------------------------------------ config


def test_config_normalizes_the_release_fields(v3, tmp_path):
    cfg = load_config(v3[0])
    mla, g = cfg.latent_attention, cfg.group_routing
    assert (cfg.architecture, cfg.model_type) == ("DeepseekV3ForCausalLM", "deepseek_v3")
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        48, 32, 32, 16, 24)
    assert mla.latent_dim == 48 and mla.rope_interleave and cfg.head_dim == 16
    # YaRN: the softmax scale carries mscale(factor, mscale_all_dim)^2, exactly as the reference's
    hf = _hf_model(v3[0])
    assert math.isclose(mla.softmax_scale, hf.model.layers[0].self_attn.scaling, rel_tol=1e-12)
    assert math.isclose(mla.softmax_scale, 48 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2, rel_tol=1e-12)
    assert (g.n_group, g.topk_group, g.routed_scaling_factor) == (4, 2, 2.5)
    assert cfg.moe_layers == (1, 2, 3) and cfg.intermediate_size == 128 and cfg.shared_expert_intermediate_size == 64
    assert cfg.num_mtp_layers == 1 and cfg.norm_topk_prob and not cfg.tie_word_embeddings
    raw = json.loads((v3[0] / "config.json").read_text())
    # the releases' spellings: rope_scaling with "type", n_routed_experts; Kimi-K2's model_type; null q LoRA
    legacy = {**{k: v for k, v in raw.items() if k != "rope_parameters"}, "model_type": "kimi_k2", "rope_theta": 1e4,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                               "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
              "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "q_lora_rank": None}
    k = load_config(legacy)
    assert k.model_type == "kimi_k2" and k.latent_attention.q_lora_rank is None
    assert k.rope_parameters["rope_type"] == "yarn" and k.latent_attention.softmax_scale == mla.softmax_scale
    assert type(k.hf_config()).__name__ == "DeepseekV3Config"
    plain = load_config({**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.latent_attention.softmax_scale == 48 ** -0.5  # no mscale without a scaled rope type
    for field, value, match in [("scoring_func", "softmax", "scoring_func 'softmax'"),
                                ("topk_method", "greedy", "topk_method 'greedy'"),
                                ("moe_layer_freq", 2, "moe_layer_freq 2"),
                                ("num_key_value_heads", 2, "num_key_value_heads 2"),
                                ("n_group", 3, "n_group 3"), ("topk_group", 5, "topk_group 5"),
                                ("hidden_act", "gelu", "hidden_act 'gelu'")]:
        with pytest.raises(ValueError, match=match):
            load_config({**raw, field: value})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        load_config({k: v for k, v in raw.items() if k != "moe_intermediate_size"})


def test_full_presets_and_kv_bytes_per_token(tmp_path):
    """The released geometries (config-only) and what one token costs in the latent KV cache."""
    v3 = load_config(write_config_only(tmp_path / "v3", ARCH, "deepseek-v3"))
    kimi = load_config(write_config_only(tmp_path / "k2", ARCH, "kimi-k2"))
    assert (v3.num_layers, v3.num_heads, v3.num_experts, v3.top_k, v3.moe_layers[0]) == (61, 128, 256, 8, 3)
    assert (v3.group_routing.n_group, v3.group_routing.topk_group, v3.num_mtp_layers) == (8, 4, 1)
    assert (kimi.num_heads, kimi.num_experts, kimi.moe_layers[0], kimi.group_routing.n_group) == (64, 384, 1, 1)
    assert kimi.rope_parameters["rope_theta"] == 50000.0 and kimi.group_routing.routed_scaling_factor == 2.827
    for name, cfg, params in (("deepseek-v3", v3, 671.03e9), ("kimi-k2", kimi, 1026.41e9)):
        assert abs(model_class(cfg.architecture).param_count(cfg) - params) < 0.01e9
        assert param_count(config_for(ARCH, name)) == model_class(cfg.architecture).param_count(cfg)
        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg)
        spec = model.kv_spec()
        assert spec == KVSpec.latent(61, 576, 512)
        # 61 layers x (512 + 64) bf16 values = 70,272 bytes per token ...
        assert spec.bytes_per_token(torch.bfloat16) == 61 * 576 * 2 == 70272
    # ... against the per-head keys (192) and values (128) the attention computes with: 4,997,120 bytes per
    # token for DeepSeek-V3's 128 heads (71x), 2,498,560 for Kimi-K2's 64; and a GQA cache of 8 KV heads of
    # 128 over the same 61 layers: 249,856 (3.6x)
    assert [61 * c.num_heads * (192 + 128) * 2 for c in (v3, kimi)] == [4997120, 2498560]
    assert KVSpec.heads(61, 8, 128).bytes_per_token(torch.bfloat16) == 249856


def test_latent_kv_pool_layout():
    pool = PagedKVPool(KVSpec.latent(3, 48, 32), 4, 16, torch.float32, torch.device("cpu"), prefix_caching=True)
    assert pool.k is None and pool.v is None and pool.latent.shape == (3, 64, 48) and pool.planes == (pool.latent,)
    assert pool.bytes_per_token == 3 * 48 * 4 and pool.nbytes == 64 * 3 * 48 * 4
    gqa = PagedKVPool(KVSpec.heads(2, 2, 8), 4, 16, torch.bfloat16, torch.device("cpu"))
    assert gqa.latent is None and gqa.k.shape == gqa.v.shape == (2, 64, 2, 8) and gqa.planes == (gqa.k, gqa.v)
    assert gqa.bytes_per_token == 2 * 2 * 2 * 8 * 2
    for bad in (dict(num_layers=1), dict(num_layers=1, num_kv_heads=2, head_dim=4, latent_dim=8),
                dict(num_layers=1, num_kv_heads=2), dict(num_layers=1, latent_dim=8), dict(num_layers=1, latent_dim=8,
                                                                                        value_dim=9)):
        with pytest.raises(ValueError, match="KV spec"):
            KVSpec(**bad)


# ------------------------------------------------------------------------------------------------ router


# ------------------------------------------------------------------------------------------------ attention


def _mla_layer(cfg, pool: PagedKVPool) -> LatentAttention:
    torch.manual_seed(0)
    layer = LatentAttention(cfg, 0, RotaryEmbedding(cfg, interleaved=cfg.latent_attention.rope_interleave)).double()
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer.kv = pool
    return layer


def _batch(phase: Phase, seqs: list[tuple[int, int, torch.Tensor]], pool: PagedKVPool, positions: list[int],
           decode: DecodeMeta | None = None) -> ForwardBatch:
    """``seqs``: (q_len, kv_len, page table) per sequence; new tokens are each sequence's last ``q_len``."""
    slices, slots, q = [], [], 0
    for i, (q_len, kv_len, table) in enumerate(seqs):
        slices.append(SeqSlice(i, q, q_len, kv_len, table))
        pos = torch.arange(kv_len - q_len, kv_len)
        slots.append(table[pos // pool.page_size] * pool.page_size + pos % pool.page_size)
        q += q_len
    T = q
    return ForwardBatch(phase, torch.zeros(T, dtype=torch.long), torch.tensor(positions), torch.cat(slots), slices,
                        torch.arange(T), decode=decode)


def test_absorbed_decode_equals_naive_form(v3):
    """The same new token attended in the absorbed (decode) and the naive (prefill) form, float64."""
    cfg = load_config(v3[0])
    mla = cfg.latent_attention
    pool = PagedKVPool(KVSpec.latent(1, mla.latent_dim, mla.kv_lora_rank), 8, 4, torch.float64, torch.device("cpu"))
    layer = _mla_layer(cfg, pool)
    tables = [torch.tensor([5, 2, 7]), torch.tensor([0, 3])]
    lens = [11, 6]
    torch.manual_seed(1)
    for (table, n) in zip(tables, lens):  # fill each sequence's earlier rows through a prefill
        x = torch.randn(n - 1, cfg.hidden_size, dtype=torch.float64)
        layer(x, _batch(Phase.PREFILL, [(n - 1, n - 1, table)], pool, list(range(n - 1))))
    x = torch.randn(2, cfg.hidden_size, dtype=torch.float64)
    seqs = [(1, n, t) for t, n in zip(tables, lens)]
    pos = [n - 1 for n in lens]
    decode = layer(x, _batch(Phase.DECODE, seqs, pool, pos))
    naive = layer(x, _batch(Phase.PREFILL, seqs, pool, pos))
    torch.testing.assert_close(decode, naive, rtol=1e-12, atol=1e-12)
    # the device path's decode batch (block tables, device lengths, a padding row) gives the same rows
    tables_2d = torch.tensor([[5, 2, 7], [0, 3, 0], [1, 0, 0]], dtype=torch.int32)
    meta = DecodeMeta(tables_2d, torch.tensor(lens + [1], dtype=torch.int32), torch.tensor([True, True, False]), None)
    b = _batch(Phase.DECODE, seqs + [(1, 1, torch.tensor([1]))], pool, pos + [0], decode=meta)
    b.seqs = b.seqs[:2]  # as DecodeInputs.load: the padding row has no sequence
    padded = layer(torch.cat([x, torch.randn(1, cfg.hidden_size, dtype=torch.float64)]), b)
    torch.testing.assert_close(padded[:2], decode, rtol=1e-12, atol=1e-12)


def test_device_decode_kernel_path_matches_torch(v3, monkeypatch):
    """The device path's latent attention through the Triton kernel (on the CPU in Triton's interpreter)
    equals the torch path: contexts over several partitions and pages, a padding row."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":  # on CUDA: tests/gpu/test_deepseek_v3_gpu.py
        pytest.skip("Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1)")
    import edgemoe.layers.mla as mla_mod
    from edgemoe.kernels import decode_attention

    cfg = load_config(v3[0])
    mla = cfg.latent_attention
    pool = PagedKVPool(KVSpec.latent(1, mla.latent_dim, mla.kv_lora_rank), 64, 4, torch.float32, torch.device("cpu"))
    layer = _mla_layer(cfg, pool).float()
    pool.latent.normal_()
    g = torch.Generator().manual_seed(2)
    lens = [150, 70, 1]  # two sequences over 3 and 2 partitions of 64 rows; a padding row
    tables = torch.stack([torch.randperm(64, generator=g)[:40] for _ in lens]).to(torch.int32)
    scratch = decode_attention.make_decode_scratch(3, cfg.num_heads, mla.kv_lora_rank, 160, "cpu", partition_size=64)
    meta = DecodeMeta(tables, torch.tensor(lens, dtype=torch.int32), torch.tensor([True, True, False]), scratch)
    seqs = [(1, n, t.long()) for n, t in zip(lens, tables)]
    x = torch.randn(3, cfg.hidden_size, generator=g)
    torch_path = layer(x, _batch(Phase.DECODE, seqs, pool, [n - 1 for n in lens], decode=meta))
    calls = []
    monkeypatch.setattr(mla_mod, "kernel_module", lambda name, device: calls.append(name) or decode_attention)
    kernel_path = layer(x, _batch(Phase.DECODE, seqs, pool, [n - 1 for n in lens], decode=meta))
    assert calls == ["decode_attention"]
    torch.testing.assert_close(kernel_path, torch_path, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy,slots", MODES, ids=[f"{p}-{s}" for p, s in MODES])
def test_logits_and_greedy_tokens_match_transformers(checkpoint, policy, slots, device):
    path, (ref_logits, ref_toks) = checkpoint
    runner = ModelRunner(path, _engine_config(expert_policy=policy, expert_cache_slots=slots, device=device),
                         progress=False)
    streamer, streamed = runner.experts.hybrid.prefill, []
    forward = streamer.forward
    streamer.forward = lambda layer, *a: streamed.append(layer) or forward(layer, *a)
    logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS, free=True)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)
    runner.experts.cache.check_invariants()
    st = runner.experts.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if slots >= 32 and policy == "fill-all":  # T·k >= 2E routes and room for two staging regions of E slots
        assert streamed == list(range(runner.model_config.num_moe_layers))
    else:
        assert streamed == []
    if slots == 0 or policy == "cpu-all":
        assert st["fills"] == 0
    if policy == "qstar" and slots:
        assert st["fills"] > 0 and st["cpu"] > 0  # both branches exercised
    if policy == "static":
        assert st["fills"] == 0 and runner.experts.stats()["prefill"]["fills"] == 0
    assert runner.kv_free_tokens() == runner.kv_capacity_tokens


def test_chunked_prefill_and_batched_decode_match_alone(runner, v3):
    whole, whole_toks = greedy_decode(runner, PROMPT, 3, seq_id=1, free=True)
    chunked, chunked_toks = greedy_decode(runner, PROMPT, 3, seq_id=2, chunk_ends=[5, 6, 17], free=True)
    assert chunked_toks == whole_toks == v3[1][1][:4]
    torch.testing.assert_close(chunked, whole, **TOL)
    a, b = PROMPT[:19], PROMPT[3:][::-1]
    alone = [greedy_decode(runner, p, 3, seq_id=9, free=True) for p in (a, b)]
    first = runner.execute([StepInput(1, a, 0), StepInput(2, b, 0)], Phase.PREFILL)
    logits, toks = [[first[0]], [first[1]]], [[int(first[0].argmax())], [int(first[1].argmax())]]
    for i in range(3):  # sequences of different lengths in one decode batch (masked latent rows)
        out = runner.execute([StepInput(1, [toks[0][-1]], len(a) + i), StepInput(2, [toks[1][-1]], len(b) + i)],
                             Phase.DECODE)
        for j in range(2):
            logits[j].append(out[j])
            toks[j].append(int(out[j].argmax()))
    runner.free(1), runner.free(2)
    for j in range(2):
        assert toks[j] == alone[j][1]
        torch.testing.assert_close(torch.stack(logits[j]), alone[j][0], **TOL)


# ------------------------------------------------------------------------------------------------ engine


def test_prefix_cache_shares_latent_pages(v3):
    """A prompt extending a cached one borrows its latent pages through the radix tree and computes only
    the rest: same logits as a full prefill, same greedy tokens, at runner and engine level."""
    engine = LLMEngine(ModelRunner(v3[0], _engine_config(expert_policy="fill-all", expert_cache_slots=10_000),
                                   progress=False))
    runner, ps = engine.runner, engine.runner.page_size
    system = PROMPT + PROMPT[::-1]  # 48 tokens: 3 pages
    a, b = system + [5, 6, 7], system + [9, 8, 7, 6, 5]
    runner.execute([StepInput(1, a, 0)], Phase.PREFILL)
    runner.cache_prefix(1, a)
    runner.free(1)
    n = runner.attach_prefix(2, b)
    assert n == 3 * ps and runner.kv.pages_of(2)[:3] == runner.kv.prefix_cache.match_prefix(a).pages[:3]
    cached = runner.execute([StepInput(2, b[n:], n)], Phase.PREFILL)
    full = runner.execute([StepInput(3, b, 0)], Phase.PREFILL)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
    tok = int(full.argmax())
    torch.testing.assert_close(runner.execute([StepInput(2, [tok], len(b))], Phase.DECODE),
                               runner.execute([StepInput(3, [tok], len(b))], Phase.DECODE), rtol=0, atol=1e-5)
    runner.free(2), runner.free(3)
    plain = LLMEngine(ModelRunner(v3[0], _engine_config(expert_policy="fill-all", expert_cache_slots=10_000,
                                                        enable_prefix_caching=False), progress=False))
    prompts = [system + [i + 3, 2 * i + 5] for i in range(4)]
    want = [o.outputs[0].token_ids for o in run_requests(plain, prompts)]
    outs = run_requests(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.cached_tokens == 3 * ps for o in outs)
    assert runner.kv_free_tokens() == runner.kv_capacity_tokens


def test_preemption_matches_alone(v3):
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(0, 24, 4)]
    alone_engine = LLMEngine(ModelRunner(v3[0], _engine_config(max_model_len=256), progress=False))
    alone = [run_requests(alone_engine, [p], max_tokens=30)[0].outputs[0].token_ids for p in prompts]
    # 6 pages for six 54-token sequences of 4 pages each: preemption and recompute; 16-token prefill chunks
    tight = LLMEngine(ModelRunner(v3[0], _engine_config(kv_cache_tokens=96, max_model_len=256, prefill_chunk_tokens=16),
                                  progress=False))
    assert [o.outputs[0].token_ids for o in run_requests(tight, prompts, max_tokens=30)] == alone
    assert tight.metrics.preemptions._value.get() > 0
    assert tight.runner.kv_free_tokens() == tight.runner.kv_capacity_tokens


def test_fault_isolation(v3, monkeypatch):
    """A failing step fails only the request it was injected for; the others finish as they would alone."""
    engine = LLMEngine(ModelRunner(v3[0], _engine_config(), progress=False))
    prompts = [PROMPT[i:] for i in range(4)]
    alone = [run_requests(engine, [p])[0].outputs[0].token_ids for p in prompts]
    fault_isolated(run_with_fault(engine, prompts, 2, monkeypatch), 2, alone)


# ------------------------------------------------------------------------------------------------ weights


def test_bf16_keeps_the_router_float32(tmp_path):
    """At bf16 the router weight and correction bias stay float32 (as transformers keeps them), loaded from
    safetensors, from FTW (converted to bf16) and with dummy weights; the bf16 model tracks the fp32 one."""
    from edgemoe.weights.ftw import convert

    fp32 = make_checkpoint(tmp_path / "fp32")
    bias = load_file(fp32 / "model.safetensors")["model.layers.2.mlp.gate.e_score_correction_bias"]
    ftw = convert(fp32, tmp_path / "ftw", dtype="bfloat16", progress=False)
    assert load_file(ftw / "non_expert.safetensors")["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == \
        torch.float32
    ref_logits, ref_toks = greedy_decode(ModelRunner(fp32, _engine_config(), progress=False), PROMPT, 3)
    for src, fmt in ((fp32, "auto"), (ftw, "auto"), (fp32, "dummy")):
        runner = ModelRunner(src, _engine_config(dtype="bfloat16", load_format=fmt), progress=False)
        params = dict(runner.model.named_parameters())
        gate = runner.model.model.layers[2].mlp.gate
        assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
        assert params["model.layers.2.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
        assert runner.kv.latent.dtype == torch.bfloat16
        logits, _ = greedy_decode(runner, PROMPT, 3)
        assert torch.isfinite(logits).all()
        if fmt != "dummy":
            assert torch.equal(gate.e_score_correction_bias, bias)  # exact: no bf16 round trip
            assert int(logits[0].argmax()) == ref_toks[0]
            torch.testing.assert_close(logits[0], ref_logits[0], rtol=0, atol=0.25)  # bf16 rounding only


def _variant(src, tmp_path, edit, config_edit=None):
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors")
    if config_edit is not None:
        cfg = json.loads((d / "config.json").read_text())
        config_edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("edit,config_edit,match", [
    (lambda sd: None, lambda c: c.update(num_nextn_predict_layers=0),
     r"unexpected tensor model\.layers\.4\."),  # an MTP layer the config does not declare
    (lambda sd: sd.pop("model.layers.1.self_attn.kv_b_proj.weight"), None,
     r"missing tensor\(s\) \['model\.layers\.1\.self_attn\.kv_b_proj\.weight'\]"),
    (lambda sd: sd.pop("model.layers.3.mlp.gate.e_score_correction_bias"), None,
     r"model\.layers\.3\.mlp\.gate\.e_score_correction_bias"),
    (lambda sd: sd.__setitem__("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", torch.zeros(40, 64)), None,
     r"kv_a_proj_with_mqa\.weight has shape \(40, 64\), expected \(48, 64\)"),
    (lambda sd: sd.__setitem__("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(32, 64)), None,
     r"layer 0 is not a MoE layer"),  # first_k_dense_replace = 1
    (lambda sd: sd.pop("model.layers.2.mlp.experts.11.up_proj.weight"), None, r"MoE layer ordinal 1 expert 11 up_proj"),
], ids=["undeclared-mtp", "missing", "missing-bias", "shape", "dense-layer-expert", "missing-expert"])
def test_broken_checkpoint_names_the_tensor(v3, tmp_path, edit, config_edit, match):
    with pytest.raises(CheckpointError, match=match):
        ModelRunner(_variant(v3[0], tmp_path, edit, config_edit), _engine_config(), progress=False)


def test_ftw_convert_skips_mtp_and_serves_identically(v3, tmp_path):
    from edgemoe.weights.ftw import convert

    path, (ref_logits, ref_toks) = v3
    ftw = convert(path, tmp_path / "ftw", progress=False)
    assert not any(n.startswith("model.layers.4.") for n in load_file(ftw / "non_expert.safetensors"))
    logits, toks = greedy_decode(ModelRunner(ftw, _engine_config(), progress=False), PROMPT, 2)
    assert toks == ref_toks[:3]
    torch.testing.assert_close(logits, ref_logits[:3], **TOL)


def test_preset_is_the_transformers_layout(v3):
    saved = load_file(v3[0] / "model.safetensors")
    cfg = json.loads((v3[0] / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert saved["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (32 + 16, 64)
    assert saved["model.layers.1.self_attn.kv_b_proj.weight"].shape == (4 * (32 + 24), 32)
    assert saved["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (2 * 32, 64)
    assert saved["model.layers.3.mlp.experts.15.down_proj.weight"].shape == (64, 32)
    assert "model.layers.0.mlp.gate_proj.weight" in saved and "model.layers.0.mlp.gate.weight" not in saved
    hf = config_for(ARCH, "tiny", {"vocab_size": cfg["vocab_size"]})
    main = {k: v for k, v in saved.items() if not k.startswith("model.layers.4.")}
    assert sum(v.numel() for v in main.values()) == param_count(hf)


def test_config_only_preset_serves_dummy_weights(tmp_path):
    """``make-model --config-only`` + ``--load-format dummy`` of the DeepSeek-V3 preset at a reduced size."""
    small = {"hidden_size": 128, "num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 16,
             "n_group": 4, "topk_group": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024,
             "intermediate_size": 256, "moe_intermediate_size": 64}
    out = write_config_only(tmp_path / "c", ARCH, "deepseek-v3", overrides=small)
    runner = ModelRunner(out, _engine_config(load_format="dummy", dtype="bfloat16"), progress=False)
    assert runner.kv.spec == KVSpec.latent(4, 576, 512) and runner.model_config.latent_attention.q_lora_rank == 1536
    assert "(4 layers x one latent row of 576)" in runner.summary()
    logits, _ = greedy_decode(runner, PROMPT[:20], 2)
    assert logits.shape == (3, 1024) and torch.isfinite(logits).all()


def test_cli_make_model_and_generate(tmp_path, capsys):
    from edgemoe.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--arch", ARCH, "--preset", "tiny", "--out", str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "Hello there", "--max-tokens", "5", "--ignore-eos",
                 "--device", "cpu", "--cpu-executor", "torch", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"


def test_decode_benchmark_cpu_smoke(tmp_path, load_benchmark):
    """``benchmarks/decode.py --arch deepseek_v3 --layers N`` (the GPU host's reduced-depth DeepSeek-V3 run)
    on the tiny preset: it serves, routes uniformly through the float32 router and reports the KV layout."""
    bench = load_benchmark("decode")
    assert bench.main(["--arch", ARCH, "--preset", "tiny", "--layers", "3", "--device", "cpu", "--budgets", "0.0001",
                       "--policies", "qstar", "--tokens", "3", "--warmup", "1", "--profile-seconds", "0.1",
                       "--out", str(tmp_path)]) == 0
    meta = json.loads((tmp_path / "decode.json").read_text())["meta"]
    assert meta["model"] == "DeepseekV3ForCausalLM" and meta["kv_layout"] == "3 layers x one latent row of 48"
    assert meta["kv_bytes_per_token"] == 3 * 48 * 2  # bf16
