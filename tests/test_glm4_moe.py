"""glm4_moe (GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air) against transformers, on CPU.

Parity: prefill + decode logits and greedy tokens of tiny random-weight checkpoints match
``transformers``' ``Glm4MoeForCausalLM`` (float32) in every execution mode (all experts resident, each
policy with a cache smaller than a layer, streamed prefill, CPU-only, and the device decode path with
the Triton kernels in the interpreter), for the variants releases use (n_group > 1 and 1, several
shared experts, first-k dense > 1, tied and untied embeddings, with and without q/k norm). Also: the
router against transformers' GLM and DeepSeek-V3 routers, the config normalization and its errors,
the released geometries (config-only, dummy weights), skipped MTP layers, float32 router parameters
in bf16 models and FTW conversions, the engine (chunked prefill, preemption, prefix cache, fault
isolation) and make-model's GLM tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe.config import EngineConfig, GroupLimitedRoutingConfig
from edgemoe.core import Phase
from edgemoe.engine.llm import render_chat
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.layers.router import GroupLimitedSigmoidRouter
from edgemoe.models import load_config, model_class
from edgemoe.synth import config_for, make_model, param_count, write_config_only
from edgemoe.weights.index import CheckpointError

from conftest import check_engine_preemption_prefix_cache_and_faults, greedy_decode, reference_greedy

PROMPT = [3, 17, 92, 5, 41, 8, 77, 23, 64, 11, 9, 30]
DECODE_STEPS = 6
TOL = dict(rtol=1e-4, atol=1e-4)

# Overrides of the tiny preset (n_group 4 / topk_group 2, 2 shared experts, one dense layer, q/k norm,
# q/k/v bias, untied embeddings, scaling 2.5).
VARIANTS = {
    "tiny": {},
    # the releases' routing: one group, one shared expert; GLM-4.5-Air: no q/k norm, scaling 1.0
    "air-like": {"n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                 "use_qk_norm": False},
    "dense-2-tied": {"first_k_dense_replace": 2, "tie_word_embeddings": True, "attention_bias": False},
    "no-norm-topk": {"norm_topk_prob": False, "n_group": 2, "topk_group": 1, "n_shared_experts": 3},
}

# (policy, slots, cpu executor): resident, each policy with a cache smaller than one layer's 16 experts,
# two staging regions of E slots (streamed prefill), CPU-only on the native executor
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
]


def _engine_config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", expert_policy="qstar", expert_cache_slots=5,
                bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, cpu_executor="torch")
    return EngineConfig(**{**base, **kw})


def _randomize_correction_bias(path, seed: int = 1) -> None:
    """transformers initializes ``e_score_correction_bias`` to zeros; give it values that change the routing."""
    f = path / "model.safetensors"
    sd = load_file(f)
    g = torch.Generator().manual_seed(seed)
    for k in sd:
        if k.endswith("e_score_correction_bias"):
            sd[k] = (torch.rand(sd[k].shape, generator=g) * 0.5).to(sd[k].dtype)
    save_file(sd, f, metadata={"format": "pt"})


def _make(out, overrides=None, dtype="float32", seed=7):
    make_model(out, "glm4_moe", "tiny", seed=seed, dtype=dtype, overrides=overrides)
    _randomize_correction_bias(out)
    return out


def _reference(path, prompt=PROMPT, steps=DECODE_STEPS):
    """Greedy prefill + decode with transformers: (logits [steps+1, V], tokens)."""
    from transformers import Glm4MoeForCausalLM

    return reference_greedy(Glm4MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), prompt, steps)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    out = _make(tmp_path_factory.mktemp(f"glm-{request.param}") / "m", VARIANTS[request.param])
    return out, _reference(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = _make(tmp_path_factory.mktemp("glm") / "tiny")
    return out, _reference(out)


# ------------------------------------------------------------------------------------------------ router


@pytest.mark.parametrize("E,G,TG,K,norm,scale", [(16, 4, 2, 4, True, 2.5), (16, 1, 1, 4, True, 1.0),
                                                  (32, 8, 3, 6, False, 2.5), (8, 2, 1, 2, True, 16.0)])
def test_router_matches_transformers_glm_and_deepseek_v3(E, G, TG, K, norm, scale):
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    H, T = 48, 64
    kw = dict(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=G, topk_group=TG,
              norm_topk_prob=norm, routed_scaling_factor=scale)
    g = torch.Generator().manual_seed(E + G + K)
    weight, bias = torch.randn(E, H, generator=g) * 0.3, torch.rand(E, generator=g) * 0.5
    x = torch.randn(T, H, generator=g)
    routing = GroupLimitedRoutingConfig(G, TG, scale)
    cfg = load_config(config_for("glm4_moe", "tiny", {**kw, "num_attention_heads": 4, "head_dim": 12}).to_dict())
    assert cfg.group_routing == routing
    ours = GroupLimitedSigmoidRouter(cfg)
    with torch.no_grad():
        ours.weight.copy_(weight), ours.e_score_correction_bias.copy_(bias)
    ids, w = ours(x)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (T, K)
    for ref in (Glm4MoeTopkRouter(Glm4MoeConfig(**kw)), DeepseekV3TopkRouter(DeepseekV3Config(**kw))):
        with torch.no_grad():
            ref.weight.copy_(weight), ref.e_score_correction_bias.copy_(bias)
        out = ref(x)
        ref_w, ref_ids = out[-2], out[-1]  # (router_logits, weights, ids)
        o, r = ids.sort(dim=-1), ref_ids.sort(dim=-1)
        assert torch.equal(o.values, r.values)
        torch.testing.assert_close(w.gather(1, o.indices), ref_w.gather(1, r.indices), rtol=1e-6, atol=1e-6)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.full((T,), scale), rtol=1e-5, atol=1e-5)
    # the experts of a token lie in at most topk_group groups, and that changes the choice
    assert ((ids // (E // G)).sort(-1).values.diff(dim=-1) != 0).sum(-1).max() < TG
    if TG < G:
        plain = torch.topk(torch.sigmoid(x @ weight.T) + bias, K, dim=-1)[1].sort(-1).values
        assert not torch.equal(plain, ids.sort(-1).values)


def test_router_bias_selects_but_does_not_weigh():
    cfg = load_config(config_for("glm4_moe", "tiny", {"n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                                                      "routed_scaling_factor": 1.0}).to_dict())
    router = GroupLimitedSigmoidRouter(cfg)
    x = torch.randn(5, cfg.hidden_size)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[[3, 7, 11, 13]] = 10.0  # always chosen ...
    ids, w = router(x)
    assert (ids.sort(-1).values == torch.tensor([3, 7, 11, 13])).all()
    torch.testing.assert_close(w, torch.sigmoid(x @ router.weight.T).gather(1, ids))  # ... weighted without it


# ------------------------------------------------------------------------------------------------ config

RELEASED_AIR = {  # zai-org/GLM-4.5-Air config.json (transformers 4.54 spellings)
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
}


def test_released_config_normalizes():
    c = load_config(RELEASED_AIR)
    assert (c.architecture, c.model_type, c.torch_dtype) == ("Glm4MoeForCausalLM", "glm4_moe", "bfloat16")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (4096, 46, 96, 8, 128)
    assert c.moe_layers == tuple(range(1, 46)) and c.intermediate_size == 10944
    assert (c.num_experts, c.top_k, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (128, 8, 1408, 1408)
    assert c.group_routing == GroupLimitedRoutingConfig(1, 1, 1.0) and c.norm_topk_prob
    assert c.partial_rotary_factor == 0.5 and c.rope_parameters["rope_theta"] == 1e6 and not c.qk_norm
    assert c.attention_bias and not c.tie_word_embeddings and c.num_mtp_layers == 1
    assert c.eos_token_ids == (151329, 151336, 151338) and c.pad_token_id == 151329
    assert c.hf_config().rope_parameters["partial_rotary_factor"] == 0.5
    with torch.device("meta"):
        model = model_class(c.architecture)(c)
    assert model.skipped_prefixes == ("model.layers.46.",)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in dict(model.named_parameters())
    assert "model.layers.0.mlp.gate_proj.weight" in dict(model.named_parameters())  # the dense layer
    assert "model.layers.1.self_attn.q_norm.weight" not in dict(model.named_parameters())
    # transformers-5 spellings
    c5 = load_config({**RELEASED_AIR, "num_local_experts": 128, "num_mtp_layers": 2, "n_routed_experts": None,
                      "num_nextn_predict_layers": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                                            "partial_rotary_factor": 0.25}})
    assert c5.num_experts == 128 and c5.num_mtp_layers == 2 and c5.partial_rotary_factor == 0.25
    assert c5.rope_parameters["rope_theta"] == 5e5


def test_missing_fields_take_transformers_defaults():
    """A config with only the required fields normalizes to what transformers' ``Glm4MoeConfig`` builds
    (8 KV heads, not one per query head; one shared expert; one dense layer; half rotary)."""
    from transformers import Glm4MoeConfig

    raw = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=16, n_routed_experts=16,
               num_experts_per_tok=8, moe_intermediate_size=64, intermediate_size=512)
    c, ref = load_config({"model_type": "glm4_moe", **raw}), Glm4MoeConfig(**raw)
    assert c.num_kv_heads == ref.num_key_value_heads == 8 and c.head_dim == 256 // 16
    assert c.moe_layers == tuple(range(ref.first_k_dense_replace, 4)) and c.intermediate_size == ref.intermediate_size
    assert c.shared_expert_intermediate_size == ref.n_shared_experts * ref.moe_intermediate_size
    assert c.group_routing == GroupLimitedRoutingConfig(ref.n_group, ref.topk_group, ref.routed_scaling_factor)
    assert (c.attention_bias, c.qk_norm, c.norm_topk_prob) == (ref.attention_bias, ref.use_qk_norm, ref.norm_topk_prob)
    assert c.rope_parameters == ref.rope_parameters and c.num_mtp_layers == ref.num_nextn_predict_layers
    assert (c.rms_norm_eps, c.max_position_embeddings) == (ref.rms_norm_eps, ref.max_position_embeddings)


@pytest.mark.parametrize("edit,match", [
    ({"n_group": 3}, "n_group 3 must divide n_routed_experts 128"),
    ({"n_group": 8, "topk_group": 9}, r"topk_group 9 must be in \[1, n_group = 8\]"),
    ({"n_group": 64, "topk_group": 2}, "topk_group 2 groups of 2 experts hold fewer than num_experts_per_tok 8"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"first_k_dense_replace": 47}, r"first_k_dense_replace 47 must be in \[0, num_hidden_layers = 46\]"),
    ({"moe_intermediate_size": None}, "missing required field 'moe_intermediate_size'"),
    ({"n_routed_experts": None}, "missing required field 'n_routed_experts'"),
])
def test_bad_config_names_the_field(edit, match):
    with pytest.raises(ValueError, match=match):
        load_config({**RELEASED_AIR, **edit})


@pytest.mark.parametrize("preset,layers,experts,total", [
    ("glm-4.5", 92, 160, 352.8e9), ("glm-4.5-air", 46, 128, 106.9e9), ("glm-4.7", 92, 160, 352.8e9)])
def test_released_geometries_config_only(tmp_path, preset, layers, experts, total):
    out = write_config_only(tmp_path / preset, "glm4_moe", preset)
    cfg = load_config(out)
    assert (cfg.num_layers, cfg.num_experts, cfg.vocab_size, cfg.num_mtp_layers) == (layers, experts, 151552, 1)
    assert cfg.max_position_embeddings == (202752 if preset == "glm-4.7" else 131072)
    assert cfg.qk_norm == (preset != "glm-4.5-air")
    assert len(cfg.eos_token_ids) == 3  # <|endoftext|>, <|user|>, <|observation|> of the tokenizer written beside
    # parameters without the MTP layer (the releases' "355B" / "106B" count it)
    assert abs(param_count(config_for("glm4_moe", preset)) - total) / total < 0.002
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    routed = cfg.num_moe_layers * cfg.num_experts * cfg.expert_numel()
    assert sum(p.numel() for p in model.parameters()) + routed == param_count(config_for("glm4_moe", preset))


def test_config_only_serves_dummy_weights(tmp_path):
    """``make-model --config-only`` + ``--load-format dummy`` (the benchmark path), at a reduced depth and width."""
    small = {"hidden_size": 128, "num_hidden_layers": 4, "n_routed_experts": 16, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 256, "moe_intermediate_size": 64, "vocab_size": 1024}
    out = write_config_only(tmp_path / "c", "glm4_moe", "glm-4.5", overrides=small)
    runner = ModelRunner(out, _engine_config(load_format="dummy", dtype="bfloat16"), progress=False)
    gate = runner.model.model.layers[3].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    logits, _ = greedy_decode(runner, PROMPT, 2)
    assert logits.shape == (3, 1024) and torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("policy,slots,executor", MODES, ids=[f"{p}-{s}-{e}" for p, s, e in MODES])
def test_logits_and_greedy_tokens_match_transformers(checkpoint, policy, slots, executor):
    path, (ref_logits, ref_toks) = checkpoint
    runner = ModelRunner(path, _engine_config(expert_policy=policy, expert_cache_slots=slots, cpu_executor=executor),
                         progress=False)
    logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)
    runner.experts.cache.check_invariants()
    st = runner.experts.stats()
    assert st["decode"]["misses"] == st["decode"]["fills"] + st["decode"]["cpu"]
    if slots == 0 or policy == "cpu-all":
        assert st["decode"]["fills"] == 0
    if policy == "qstar" and slots:
        assert st["decode"]["fills"] > 0 and st["decode"]["cpu"] > 0  # both branches exercised
    if policy == "static":
        assert st["decode"]["fills"] == 0 and st["prefill"]["fills"] == 0
    if slots == 32:  # T·k = 48 >= 2E: the prefill streamed whole layers through two staging regions
        assert st["prefill"]["fills"] >= 16


def test_variant_geometry(checkpoint):
    """Each variant is what it claims: the parity above covers these code paths."""
    path, _ = checkpoint
    cfg = load_config(path)
    runner = ModelRunner(path, _engine_config(), progress=False)
    names = dict(runner.model.named_parameters())
    first = cfg.moe_layers[0]
    assert all(f"model.layers.{i}.mlp.gate_proj.weight" in names for i in range(first))
    assert (f"model.layers.{first}.self_attn.q_norm.weight" in names) == cfg.qk_norm
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings)
    assert (f"model.layers.{first}.self_attn.q_proj.bias" in names) == cfg.attention_bias
    assert f"model.layers.{first}.self_attn.o_proj.bias" not in names
    shared = names[f"model.layers.{first}.mlp.shared_experts.gate_proj.weight"]
    assert shared.shape[0] == cfg.moe_intermediate_size * cfg.raw["n_shared_experts"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels in the interpreter")
@pytest.mark.parametrize("policy,slots,executor", [("qstar", 5, "torch"), ("fill-all", 5, "torch"),
                                                   ("cpu-all", 6, "auto")])
def test_device_decode_path_matches_transformers(tiny, policy, slots, executor):
    """The decode step with its control on the device (``DeviceDecode``: route_control, fills, expert GEMVs,
    CPU branch; Triton kernels in the interpreter): the GLM router runs first and its float32, scaled
    weights are what route_control and the expert kernels compute with."""
    pytest.importorskip("triton")
    from edgemoe.experts.device_decode import DeviceDecode

    path, (ref_logits, ref_toks) = tiny
    runner = ModelRunner(path, _engine_config(expert_policy=policy, expert_cache_slots=slots, cpu_executor=executor),
                         progress=False)
    rt, cfg = runner.experts, runner.model_config
    dd = rt.hybrid.device_decode = DeviceDecode(rt.pool, rt.cache, rt.policy, rt.cpu_executor, cfg.num_experts,
                                                cfg.top_k, max_tokens=4)
    seen = []
    forward = dd.forward

    def spy(moe_layer, x, ids, weights):
        seen.append(weights.dtype)
        return forward(moe_layer, x, ids, weights)

    dd.forward = spy
    steps = 3  # the interpreter is slow
    try:
        logits, toks = greedy_decode(runner, PROMPT, steps)
    finally:
        dd.close()
    assert seen == [torch.float32] * (steps * cfg.num_moe_layers)
    assert toks == ref_toks[:steps + 1]
    torch.testing.assert_close(logits, ref_logits[:steps + 1], **TOL)
    rt.cache.check_invariants()


def test_batched_and_chunked_match_alone(tiny):
    path, (ref_logits, ref_toks) = tiny
    runner = ModelRunner(path, _engine_config(), progress=False)
    chunked, toks = greedy_decode(runner, PROMPT, 3, seq_id=1, chunk_ends=[1, 5], free=True)
    assert toks == ref_toks[:4]
    torch.testing.assert_close(chunked, ref_logits[:4], **TOL)
    from edgemoe.engine.model_runner import StepInput

    a, b = PROMPT, PROMPT[::-1][:7]
    both = runner.execute([StepInput(1, a, 0), StepInput(2, b, 0)], Phase.PREFILL)
    alone_b = greedy_decode(runner, b, 0, seq_id=3, free=True)[0]
    torch.testing.assert_close(both[0], ref_logits[0], **TOL)
    torch.testing.assert_close(both[1], alone_b[0], **TOL)


# ------------------------------------------------------------------------------------------------ checkpoints


def _with_mtp_layer(src, dst, num_layers: int):
    """A copy of ``src`` with the MTP layer a release stores after the decoder (``model.layers.{num_layers}``)."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    H, p = 64, f"model.layers.{num_layers}."
    sd.update({p + "eh_proj.weight": torch.randn(H, 2 * H), p + "enorm.weight": torch.ones(H),
               p + "hnorm.weight": torch.ones(H), p + "shared_head.norm.weight": torch.ones(H),
               p + "self_attn.q_proj.weight": torch.randn(128, H),
               p + "mlp.gate.e_score_correction_bias": torch.zeros(16),
               p + "mlp.experts.0.gate_proj.weight": torch.randn(32, H)})
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_mtp_layers_are_skipped(tiny, tmp_path):
    from edgemoe.weights.ftw import convert

    path, (ref_logits, ref_toks) = tiny
    mtp = _with_mtp_layer(path, tmp_path / "mtp", num_layers=4)
    logits, toks = greedy_decode(ModelRunner(mtp, _engine_config(), progress=False), PROMPT, 2)
    assert toks == ref_toks[:3]
    torch.testing.assert_close(logits, ref_logits[:3], **TOL)
    ftw = convert(mtp, tmp_path / "ftw", progress=False)
    assert not any(n.startswith("model.layers.4.") for n in load_file(ftw / "non_expert.safetensors"))
    logits, toks = greedy_decode(ModelRunner(ftw, _engine_config(), progress=False), PROMPT, 2)
    assert toks == ref_toks[:3]
    # a config that declares no MTP layer: the same tensors are unexpected
    cfg = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.4\."):
        ModelRunner(mtp, _engine_config(), progress=False)


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.pop("model.layers.2.mlp.gate.e_score_correction_bias"),
     r"missing tensor\(s\) \['model\.layers\.2\.mlp\.gate\.e_score_correction_bias'\]"),
    (lambda sd: sd.__setitem__("model.layers.1.mlp.gate.e_score_correction_bias", torch.zeros(8)),
     r"tensor model\.layers\.1\.mlp\.gate\.e_score_correction_bias has shape \(8,\), expected \(16,\)"),
    (lambda sd: sd.pop("model.layers.3.mlp.shared_experts.down_proj.weight"),
     r"model\.layers\.3\.mlp\.shared_experts\.down_proj\.weight"),
    (lambda sd: sd.__setitem__("model.layers.0.mlp.experts.0.up_proj.weight", torch.zeros(32, 64)),
     r"model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight: layer 0 is not a MoE layer"),
    (lambda sd: sd.__setitem__("model.layers.1.self_attn.o_proj.bias", torch.zeros(64)),
     r"unexpected tensor model\.layers\.1\.self_attn\.o_proj\.bias"),
], ids=["missing-bias", "bias-shape", "missing-shared", "expert-in-dense-layer", "o-proj-bias"])
def test_broken_checkpoint_names_the_tensor(tiny, tmp_path, edit, match):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny[0], d)
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
        ModelRunner(d, _engine_config(), progress=False)


def test_router_stays_float32_in_bfloat16(tmp_path):
    """A bf16 checkpoint with the release's float32 correction bias: the bf16 engine keeps the router's
    weight and bias in float32 (bit-exact), also through an FTW conversion cast to bf16, and routes as
    transformers' router on the same hidden states."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from edgemoe.weights.ftw import convert

    out = tmp_path / "bf16"
    make_model(out, "glm4_moe", "tiny", seed=3, dtype="bfloat16")
    sd = load_file(out / "model.safetensors")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    bias = 0.3 + torch.arange(16, dtype=torch.float32) * 1e-4  # steps bf16 cannot tell apart
    sd[name] = bias
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    ftw = convert(out, tmp_path / "ftw", progress=False, dtype="bfloat16")
    assert load_file(ftw / "non_expert.safetensors")[name].dtype == torch.float32
    for src in (out, ftw):
        runner = ModelRunner(src, _engine_config(dtype="bfloat16"), progress=False)
        params = dict(runner.model.named_parameters())
        assert params[name].dtype == torch.float32 and torch.equal(params[name], bias)
        assert params["model.layers.2.mlp.gate.weight"].dtype == torch.float32
        assert params["model.layers.2.mlp.shared_experts.up_proj.weight"].dtype == torch.bfloat16
        assert torch.isfinite(greedy_decode(runner, PROMPT, 1)[0]).all()
    gate = runner.model.model.layers[2].mlp.gate
    ref = Glm4MoeTopkRouter(runner.model_config.hf_config())
    with torch.no_grad():
        ref.weight.copy_(gate.weight), ref.e_score_correction_bias.copy_(gate.e_score_correction_bias)
    x = torch.randn(32, 64).to(torch.bfloat16)
    ids, w = gate(x)
    _, ref_w, ref_ids = ref(x)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(w.sort(-1).values, ref_w.sort(-1).values, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ engine


def test_engine_preemption_prefix_cache_and_fault_isolation(tiny, monkeypatch):
    # the floor at the expert cache's size keeps the tight KV cache from borrowing expert slots instead
    check_engine_preemption_prefix_cache_and_faults(tiny[0], _engine_config, monkeypatch, min_expert_cache_slots=5)


# ------------------------------------------------------------------------------------------------ make-model


def test_make_model_glm_tokenizer_and_template(glm_model_dir):
    from transformers import AutoTokenizer

    from edgemoe.synth.tokenizer import TOKENIZERS

    spec = TOKENIZERS["glm4_moe"]
    tok = AutoTokenizer.from_pretrained(str(glm_model_dir))
    cfg = json.loads((glm_model_dir / "config.json").read_text())
    gen = json.loads((glm_model_dir / "generation_config.json").read_text())
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert cfg["eos_token_id"] == gen["eos_token_id"] == eos and cfg["pad_token_id"] == eos[0]
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["vocab_size"] >= len(tok)
    assert set(spec.special_tokens) <= set(tok.all_special_tokens)
    assert not set(spec.added_tokens) & set(tok.all_special_tokens)  # markup survives skip_special_tokens
    for t in spec.special_tokens + spec.added_tokens:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "Need a tool.",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "content": "18 C"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text, ids = render_chat(tok, messages, tools=tools)
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n") and '"name": "get_weather"' in text
    assert text.endswith(
        "<|system|>\nBe brief.<|user|>\nWeather?<|assistant|>\n<think>Need a tool.</think>\nChecking.\n<tool_call>"
        "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>2</arg_value>\n</tool_call><|observation|>\n<tool_response>\n18 C\n</tool_response><|assistant|>")
    assert tok.decode(ids) == text
    off = render_chat(tok, messages[:2], chat_template_kwargs={"enable_thinking": False})[0]
    assert off.endswith("<|user|>\nWeather?/nothink<|assistant|>\n<think></think>")


def test_cli_make_model_and_generate(tmp_path, capsys):
    from edgemoe.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--arch", "glm4_moe", "--preset", "tiny", "--out", str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "glm4_moe"
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "Hello there", "--chat", "--max-tokens", "5", "--ignore-eos",
                 "--device", "cpu", "--cpu-executor", "torch", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
