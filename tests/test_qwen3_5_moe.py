"""qwen3_5_moe (hybrid gated DeltaNet + gated attention MoE, text only) against transformers, on CPU.

Parity: prefill + decode logits and greedy tokens of tiny random-weight checkpoints match
``transformers``' ``Qwen3_5MoeForCausalLM`` / ``Qwen3_5MoeForConditionalGeneration`` (fp32) under every
expert policy. Also: the torch gated delta rule against transformers' functions, chunked prefill,
batching, the engine with preemption and few state slots, both checkpoint layouts (per-expert
``model.layers`` and the released fused ``model.language_model`` layout with vision tower and MTP head),
strict-loading errors, FTW conversion, state snapshot/restore, the presets and the CLI.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe import SamplingParams
from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.llm_engine import LLMEngine
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.kvcache.state import RecurrentStatePool, StateSlotsFullError, StateSpec
from edgemoe.layers.gated_deltanet import chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_torch
from edgemoe.models import load_config
from edgemoe.synth import config_for, make_model, param_count, write_config_only
from edgemoe.weights.index import CheckpointError

from conftest import greedy_decode, reference_greedy, run_requests

PRESET = "qwen3.5-moe-tiny"
PROMPT = [(i * 37 + 11) % 1000 + 3 for i in range(80)]  # > one 64-token chunk of the delta rule
DECODE_STEPS = 5
TOL = dict(rtol=2e-4, atol=2e-4)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=16, patch_size=4)

# (policy, slots): fill-all with every expert cached (resident), the four policies with a cache smaller
# than one layer's 16 experts, and CPU-only expert execution
MODES = [("fill-all", 10_000), ("fill-all", 5), ("qstar", 5), ("cpu-all", 5), ("static", 5), ("qstar", 0)]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]  # cuda: the GPU gated-delta path


def _engine_config(**kw) -> EngineConfig:
    # torch CPU executor: the model is under test here (the native one has its own tests and costs
    # ~15 s to load per process)
    base = dict(device="cpu", dtype="float32", expert_policy="qstar", expert_cache_slots=6,
                bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, cpu_executor="torch")
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset (ForCausalLM layout, per-expert tensors) and its transformers reference outputs."""
    from transformers import Qwen3_5MoeForCausalLM

    out = make_model(tmp_path_factory.mktemp("q35") / "tiny", "qwen3_5_moe", PRESET, seed=7, dtype="float32")
    ref = Qwen3_5MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return out, reference_greedy(ref, PROMPT, DECODE_STEPS)


@pytest.fixture(scope="module")
def runner(tiny):
    """All experts resident (fill-all): results do not depend on the expert cache's history."""
    return ModelRunner(tiny[0], _engine_config(expert_policy="fill-all", expert_cache_slots=10_000), progress=False)


@pytest.fixture(scope="module")
def conditional(tiny, tmp_path_factory):
    """The released layout: ``Qwen3_5MoeForConditionalGeneration`` config (``text_config``), tensors under
    ``model.language_model.``, fused experts, a vision tower and an MTP head; with its reference outputs."""
    from transformers import AutoConfig, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    out = tmp_path_factory.mktemp("q35") / "cg"
    out.mkdir()
    text = AutoConfig.from_pretrained(tiny[0]).to_dict()
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=VISION, architectures=["Qwen3_5MoeForConditionalGeneration"])
    torch.manual_seed(3)
    model = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    H = cfg.text_config.hidden_size
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in tensors  # fused, as released
    assert any(k.startswith("model.visual.") for k in tensors)
    tensors.update({"mtp.fc.weight": torch.randn(H, 2 * H), "mtp.norm.weight": torch.zeros(H),
                    "mtp.layers.0.mlp.experts.gate_up_proj": torch.randn(16, 64, H)})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg.save_pretrained(out)
    for f in tiny[0].iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copyfile(f, out / f.name)
    ref = Qwen3_5MoeForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    return out, reference_greedy(ref, PROMPT, DECODE_STEPS)


# ------------------------------------------------------------------------------------------------ config


def test_config_normalizes_both_layouts(tiny, conditional):
    a, b = load_config(tiny[0]), load_config(conditional[0])
    assert (a.architecture, a.model_type) == ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")
    assert (b.architecture, b.model_type) == ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")
    for c in (a, b):
        assert c.layer_types == ("linear_attention", "full_attention", "linear_attention", "full_attention")
        la = c.linear_attention
        assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim,
                la.conv_kernel) == (2, 4, 32, 32, 4)
        assert (c.num_heads, c.num_kv_heads, c.head_dim, c.partial_rotary_factor) == (4, 2, 32, 0.25)
        assert c.attn_output_gate and c.shared_expert_intermediate_size == 64 and c.norm_topk_prob
        assert c.moe_layers == (0, 1, 2, 3) and c.intermediate_size == 0 and c.num_experts == 16 and c.top_k == 4
        assert c.hf_config().model_type == "qwen3_5_moe_text"
    with pytest.raises(ValueError, match="layer_types"):
        load_config({**json.loads((tiny[0] / "config.json").read_text()), "layer_types": ["full_attention"]})
    # without layer_types, every full_attention_interval-th layer is full attention (the reference's rule)
    raw = json.loads((tiny[0] / "config.json").read_text())
    raw.pop("layer_types")
    c = load_config({**raw, "num_hidden_layers": 8, "full_attention_interval": 4})
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [3, 7]


def test_35b_preset_geometry(tmp_path):
    out = write_config_only(tmp_path / "c", "qwen3_5_moe", "qwen3.6-35b-a3b")
    cfg = load_config(out)
    assert cfg.vocab_size == 248320 and cfg.hidden_size == 2048 and cfg.num_layers == 40
    assert cfg.layer_types.count("full_attention") == 10 and cfg.layer_types[3::4] == ("full_attention",) * 10
    assert (cfg.num_experts, cfg.top_k) == (256, 8)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (512, 512)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.partial_rotary_factor) == (16, 2, 256, 0.25)
    la = cfg.linear_attention
    assert (la.num_key_heads, la.num_value_heads) == (16, 32)
    assert (la.key_head_dim, la.value_head_dim) == (128, 128)
    assert cfg.rope_parameters["rope_theta"] == 1e7 and cfg.max_position_embeddings == 262144
    assert abs(cfg.num_moe_layers * cfg.num_experts * cfg.expert_numel() * 2 / 1e9 - 64.4) < 0.05  # bf16 experts
    from edgemoe.models import model_class

    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    hf = config_for("qwen3_5_moe", "qwen3.6-35b-a3b")
    routed = cfg.num_moe_layers * cfg.num_experts * cfg.expert_numel()
    assert sum(p.numel() for p in model.parameters()) + routed == param_count(hf)
    assert 34.5e9 < param_count(hf) < 34.8e9  # the text model of the "35B" release
    assert model.state_spec() == StateSpec(num_layers=30, conv_dim=8192, conv_width=3, num_heads=32,
                                           k_head_dim=128, v_head_dim=128)
    assert len(model.attention_layers()) == 10


def test_35b_preset_config_only_serves_dummy_weights(tmp_path):
    """``make-model --config-only`` + ``--load-format dummy`` (the speed-run path), at a reduced depth/width."""
    small = {"hidden_size": 128, "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
             "num_experts": 8, "vocab_size": 1024}
    out = write_config_only(tmp_path / "c", "qwen3_5_moe", "qwen3.6-35b-a3b", overrides=small)
    runner = ModelRunner(out, _engine_config(load_format="dummy", dtype="bfloat16"), progress=False)
    assert runner.state.spec.conv_width == 3 and runner.state.recurrent.dtype == torch.float32
    logits, _ = greedy_decode(runner, PROMPT[:20], 2)
    assert logits.shape == (3, 1024) and torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------------ delta rule


@pytest.mark.parametrize("l2norm", [True, False])
def test_delta_rule_matches_transformers(l2norm):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    torch.manual_seed(0)
    B, T, Hk, Hv, Dk, Dv = 2, 150, 2, 4, 16, 8  # T not a multiple of the 64-token chunk; GQA-style heads
    q, k = torch.randn(B, T, Hk, Dk), torch.randn(B, T, Hk, Dk)
    v = torch.randn(B, T, Hv, Dv)
    g, beta = -2 * torch.rand(B, T, Hv), torch.rand(B, T, Hv)
    s0 = torch.randn(B, Hv, Dk, Dv)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    # the references get q/k repeated to the value heads: transformers 5.17's do not repeat them (5.24's do)
    q_rep, k_rep = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    ref_o, ref_s = torch_chunk_gated_delta_rule(q_rep, k_rep, v, g, beta, **kw)
    o, s = chunk_gated_delta_rule_torch(q, k, v, g, beta, **kw)
    scale = ref_o.abs().max()
    torch.testing.assert_close(o / scale, ref_o / scale, rtol=0, atol=1e-5)
    torch.testing.assert_close(s / ref_s.abs().max(), ref_s / ref_s.abs().max(), rtol=0, atol=1e-5)
    # the recurrent form from the same state, and a prefill split in two chunks from the carried state
    r_o, r_s = recurrent_gated_delta_rule_torch(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7], **kw)
    ref_r_o, ref_r_s = torch_recurrent_gated_delta_rule(q_rep[:, :7], k_rep[:, :7], v[:, :7], g[:, :7], beta[:, :7],
                                                        **kw)
    torch.testing.assert_close(r_o, ref_r_o, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(r_s, ref_r_s, rtol=1e-5, atol=1e-5 * ref_s.abs().max())
    o1, s1 = chunk_gated_delta_rule_torch(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], **kw)
    o2, s2 = chunk_gated_delta_rule_torch(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:],
                                          initial_state=s1, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    torch.testing.assert_close(torch.cat([o1, o2], 1) / scale, o / scale, rtol=0, atol=1e-5)
    torch.testing.assert_close(s2 / s.abs().max(), s / s.abs().max(), rtol=0, atol=1e-5)


def test_padded_device_decode_batch_runs_as_one_decode(tiny, monkeypatch):
    """A device-path decode batch (``batch.decode`` set) padded to a captured batch size has more rows than
    sequences; the padding rows carry a scratch state slot in ``batch.state_slots``. The layer runs all rows
    as one decode (a per-sequence loop would bake slot numbers into the captured CUDA graph), and the real
    rows equal an unpadded decode of the same sequences."""
    import edgemoe.layers.gated_deltanet as gdn
    from edgemoe.core import DecodeMeta, ForwardBatch, SeqSlice

    cfg = load_config(tiny[0])
    torch.manual_seed(0)
    layer = gdn.GatedDeltaNet(cfg, 0).float()
    spec = StateSpec(num_layers=1, conv_dim=layer.conv_dim, conv_width=layer.kernel - 1,
                     num_heads=layer.num_v_heads, k_head_dim=layer.head_k_dim, v_head_dim=layer.head_v_dim)
    layer.state = pool = RecurrentStatePool(spec, 5, torch.float32, torch.device("cpu"))
    pool.conv.normal_()
    pool.recurrent.normal_(std=0.1)
    start = (pool.conv.clone(), pool.recurrent.clone())
    slots, scratch = [3, 0, 1], 4
    x = torch.randn(len(slots) + 1, cfg.hidden_size)  # three sequences and one padding row

    def batch(rows: int, padded: bool) -> ForwardBatch:
        seqs = [SeqSlice(i, i, 1, 10, None, s) for i, s in enumerate(slots)]
        state_slots = torch.tensor((slots + [scratch])[:rows])
        meta = DecodeMeta(None, None, torch.arange(rows) < len(slots), None) if padded else None
        return ForwardBatch(Phase.DECODE, torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                            torch.zeros(rows, dtype=torch.long), seqs, torch.arange(len(slots)), decode=meta,
                            state_slots=state_slots)

    calls, rule = [], gdn.gated_delta_rule

    def spy(q, *args, decode):
        calls.append((q.shape[0], decode))
        return rule(q, *args, decode=decode)

    monkeypatch.setattr(gdn, "gated_delta_rule", spy)
    padded = layer(x, batch(4, padded=True))
    assert calls == [(4, True)]
    after = (pool.conv[:, slots].clone(), pool.recurrent[:, slots].clone())
    pool.conv.copy_(start[0]), pool.recurrent.copy_(start[1])
    plain = layer(x[:3], batch(3, padded=False))
    torch.testing.assert_close(padded[:3], plain, rtol=1e-6, atol=1e-6)
    # the conv window holds in_proj outputs: a 4-row GEMM may round differently from a 3-row one
    torch.testing.assert_close(after[0], pool.conv[:, slots], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(after[1], pool.recurrent[:, slots], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(padded[3]).all()


def test_state_pool_slots():
    spec = StateSpec(num_layers=2, conv_dim=6, conv_width=3, num_heads=2, k_head_dim=4, v_head_dim=5)
    pool = RecurrentStatePool(spec, 2, torch.float32, torch.device("cpu"))
    assert pool.nbytes == 2 * spec.bytes_per_slot(torch.float32) == 2 * 2 * (6 * 3 * 4 + 2 * 4 * 5 * 4)
    a, b = pool.allocate(10), pool.allocate(11)
    assert {a, b} == {0, 1} and pool.free_slots == 0 and not pool.can_hold(12) and pool.can_hold(10)
    with pytest.raises(StateSlotsFullError, match="all 2 are in use"):
        pool.allocate(12)
    pool.recurrent[:, a] = 1.0
    snap = pool.snapshot(10)
    pool.free(10)
    assert pool.restore(12, snap) == a and torch.equal(pool.recurrent[:, a], snap.recurrent)
    assert pool.allocate(12) == a and not pool.recurrent[:, a].any()  # a first chunk zeroes the state
    with pytest.raises(ValueError, match="does not fit"):
        pool.restore(12, type(snap)(snap.conv[:1], snap.recurrent))


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy,slots", MODES, ids=[f"{p}-{s}" for p, s in MODES])
def test_logits_and_greedy_tokens_match_transformers(tiny, policy, slots, device):
    path, (ref_logits, ref_toks) = tiny
    runner = ModelRunner(path, _engine_config(expert_policy=policy, expert_cache_slots=slots, device=device),
                         progress=False)
    free_at_start = runner.state.free_slots  # on CUDA the padding rows' scratch slot is reserved at start-up
    logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)
    runner.experts.cache.check_invariants()
    st = runner.experts.stats()["decode"]
    assert st["misses"] == st["fills"] + st["cpu"]
    if slots == 0 or policy == "cpu-all":
        assert st["fills"] == 0
    if policy == "qstar" and slots:
        assert st["fills"] > 0 and st["cpu"] > 0
    if policy == "static":
        assert st["fills"] == 0 and runner.experts.stats()["prefill"]["fills"] == 0
    runner.free(0)
    assert runner.state.free_slots == free_at_start


@pytest.mark.parametrize("device", DEVICES)
def test_conditional_generation_layout_matches_transformers(conditional, device):
    """Fused experts under ``model.language_model.``; ``model.visual.*`` and ``mtp.*`` skipped."""
    path, (ref_logits, ref_toks) = conditional
    runner = ModelRunner(path, _engine_config(device=device), progress=False)
    assert runner.model.decoder_prefix == "model.language_model."
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in dict(runner.model.named_parameters())
    logits, toks = greedy_decode(runner, PROMPT, DECODE_STEPS)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_real_head_geometry_matches_transformers(tmp_path, device):
    """The 35B preset's head geometry (Dk = Dv = 128, 16/32 DeltaNet heads, head_dim 256) at a small width."""
    from transformers import Qwen3_5MoeForCausalLM

    small = {"hidden_size": 256, "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
             "num_experts": 8, "vocab_size": 1024, "initializer_range": 0.05}
    out = make_model(tmp_path / "m", "qwen3_5_moe", "qwen3.6-35b-a3b", seed=1, dtype="float32", overrides=small)
    ref_logits, ref_toks = reference_greedy(Qwen3_5MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval(),
                                      PROMPT[:70], 2)
    logits, toks = greedy_decode(ModelRunner(out, _engine_config(device=device), progress=False), PROMPT[:70], 2)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_gated_delta_kernels_match_torch_path(tiny, monkeypatch, device):
    """The model with its gated delta rule on the Triton kernels (``edgemoe.kernels.gated_delta``; on the
    CPU in Triton's interpreter) equals the model on the torch functions, at the tiny geometry (Dk = Dv =
    16, q/k repeated from 2 to 4 heads): a prefill over two 64-token chunks, then decode steps. Covers the
    dispatch in ``gated_delta_rule`` (layouts, strides, state handling, flags), which the CUDA parity
    tests otherwise reach only on a GPU."""
    pytest.importorskip("triton")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1, set where there is no CUDA)")
    import edgemoe.layers.gated_deltanet as gdn
    from edgemoe.kernels import gated_delta

    calls = {"chunk": 0, "recurrent": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    kernels = type("CountedKernels", (), dict(
        MAX_HEAD_DIM=gated_delta.MAX_HEAD_DIM,
        chunk_gated_delta_rule=staticmethod(counted("chunk", gated_delta.chunk_gated_delta_rule)),
        fused_recurrent_gated_delta_rule=staticmethod(counted("recurrent",
                                                              gated_delta.fused_recurrent_gated_delta_rule)),
    ))

    def run(dispatch):  # a runner each: CUDA graphs captured under one dispatch would replay it under the other
        monkeypatch.setattr(gdn, "kernel_module", dispatch)
        cfg = _engine_config(expert_policy="fill-all", expert_cache_slots=10_000, device=device)
        runner = ModelRunner(tiny[0], cfg, progress=False)
        # the prompt in one prefill, and in three (later chunks start from the carried state)
        return (greedy_decode(runner, PROMPT, DECODE_STEPS, seq_id=1),
                greedy_decode(runner, PROMPT, 2, seq_id=2, chunk_ends=[5, 70]))

    reference = run(lambda name, device: None)
    assert calls == {"chunk": 0, "recurrent": 0}
    for (logits, toks), (ref_logits, ref_toks) in zip(run(lambda name, device: kernels), reference, strict=True):
        assert toks == ref_toks
        torch.testing.assert_close(logits, ref_logits, **TOL)
    assert calls["chunk"] == 2 * 4 and calls["recurrent"] >= 2  # two linear layers; CUDA graphs replay decode


def test_chunked_prefill_equals_one_shot(runner, tiny):
    whole, whole_toks = greedy_decode(runner, PROMPT, 3, seq_id=1)
    chunked, chunked_toks = greedy_decode(runner, PROMPT, 3, seq_id=2, chunk_ends=[5, 6, 70])  # 1-token chunk included
    runner.free(1), runner.free(2)
    assert chunked_toks == whole_toks
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)  # other chunk boundaries: fp32 rounding
    torch.testing.assert_close(whole, tiny[1][0][:4], **TOL)


def test_concurrent_sequences_match_alone(runner):
    """Two sequences of different lengths prefilled in one batch and decoded together."""
    a, b = PROMPT[:33], PROMPT[40:][::-1]
    alone = []
    for p in (a, b):
        alone.append(greedy_decode(runner, p, 3, seq_id=9))
        runner.free(9)
    first = runner.execute([StepInput(1, a, 0), StepInput(2, b, 0)], Phase.PREFILL)
    logits = [[first[0]], [first[1]]]
    toks = [[int(first[0].argmax())], [int(first[1].argmax())]]
    for i in range(3):
        out = runner.execute([StepInput(1, [toks[0][-1]], len(a) + i), StepInput(2, [toks[1][-1]], len(b) + i)],
                             Phase.DECODE)
        for j in range(2):
            logits[j].append(out[j])
            toks[j].append(int(out[j].argmax()))
    runner.free(1), runner.free(2)
    for j in range(2):
        assert toks[j] == alone[j][1]
        torch.testing.assert_close(torch.stack(logits[j]), alone[j][0], rtol=1e-4, atol=1e-4)  # batched GEMMs


def test_snapshot_restore_continues_bit_identically(runner):
    runner.execute([StepInput(1, PROMPT[:50], 0)], Phase.PREFILL)
    snap = runner.snapshot_state(1)
    steps = [StepInput(1, [t], 50 + i) for i, t in enumerate(PROMPT[50:56])]
    first = torch.cat([runner.execute([s], Phase.DECODE) for s in steps])
    runner.restore_state(1, snap)  # rewind the recurrent state; the KV of positions >= 50 is rewritten
    again = torch.cat([runner.execute([s], Phase.DECODE) for s in steps])
    assert torch.equal(first, again)
    runner.restore_state(1, runner.snapshot_state(1))  # restoring the current state changes nothing
    runner.free(1)
    with pytest.raises(ValueError, match="without a recurrent state"):
        runner.execute([StepInput(1, [5], 50)], Phase.DECODE)  # a cached-KV resume needs a restored state
    runner.free(1)


# ------------------------------------------------------------------------------------------------ engine


def _tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run_requests(engine, prompts, max_tokens=12)]


def test_engine_preemption_and_few_state_slots_match_alone(tiny):
    path = tiny[0]
    prompts = [PROMPT[i: i + 9 + 7 * i] for i in range(7)]
    base = dict(kv_cache_tokens=512, max_model_len=256)
    alone_engine = LLMEngine(ModelRunner(path, _engine_config(**base), progress=False))
    alone = [_tokens(alone_engine, [p])[0] for p in prompts]
    # 160 KV tokens hold ~3 of these sequences: preemption + recompute; 16-token prefill chunks; the floor at
    # the cache's size keeps the KV cache from borrowing expert slots instead
    tight = LLMEngine(ModelRunner(path, _engine_config(kv_cache_tokens=160, max_model_len=256, prefill_chunk_tokens=16,
                                                       min_expert_cache_slots=6), progress=False))
    assert _tokens(tight, prompts) == alone
    assert tight.metrics.preemptions._value.get() > 0
    assert tight.runner.state.free_slots == tight.runner.state.num_slots
    # the engine admits 6 at once but the runner has state slots for 2: admission waits for a free slot
    few = LLMEngine(ModelRunner(path, _engine_config(max_num_seqs=2, **base), progress=False))
    few.scheduler.max_num_seqs = 6
    held, execute = [], few.runner.execute

    def counting(inputs, phase):
        out = execute(inputs, phase)
        held.append(few.runner.state.num_slots - few.runner.state.free_slots)
        return out

    few.runner.execute = counting
    assert _tokens(few, prompts) == alone
    assert max(held) == 2
    assert few.runner.state.free_slots == 2 and few.runner.kv_free_tokens() == few.runner.kv_capacity_tokens


def test_state_slots_full_is_kv_pressure(tiny):
    runner = ModelRunner(tiny[0], _engine_config(max_num_seqs=1), progress=False)
    runner.execute([StepInput(1, PROMPT[:4], 0)], Phase.PREFILL)
    assert not runner.can_allocate(2, 4) and runner.can_allocate(1, 8)
    with pytest.raises(StateSlotsFullError):
        runner.execute([StepInput(2, PROMPT[:4], 0)], Phase.PREFILL)
    assert runner.kv.pages_needed(2, 4) == 1  # nothing was allocated for the refused sequence


def test_failed_step_drops_partly_updated_states(tiny, monkeypatch):
    runner = ModelRunner(tiny[0], _engine_config(), progress=False)
    runner.execute([StepInput(1, PROMPT[:6], 0), StepInput(2, PROMPT[:9], 0)], Phase.PREFILL)
    full_attention = runner.model.attention_layers()[1]  # after the first DeltaNet layers updated their states
    monkeypatch.setattr(full_attention, "forward", lambda x, batch: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.execute([StepInput(1, [5], 6), StepInput(2, [5], 9)], Phase.DECODE)
    monkeypatch.undo()
    assert runner.state.free_slots == runner.state.num_slots
    with pytest.raises(ValueError, match="without a recurrent state"):
        runner.execute([StepInput(1, [5], 6)], Phase.DECODE)
    assert runner.execute([StepInput(1, PROMPT[:7], 0)], Phase.PREFILL).shape[0] == 1  # a restart works


# ------------------------------------------------------------------------------------------------ checkpoints


def _variant(src, tmp_path, edit):
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors")
    return d


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.pop("model.layers.2.linear_attn.A_log"),
     r"missing tensor\(s\) \['model\.layers\.2\.linear_attn\.A_log'\]"),
    (lambda sd: sd.__setitem__("model.layers.0.linear_attn.conv1d.weight", torch.zeros(128, 1, 3)),
     r"model\.safetensors: tensor model\.layers\.0\.linear_attn\.conv1d\.weight has shape \(128, 1, 3\), "
     r"expected \(256, 1, 4\)"),
    (lambda sd: sd.__setitem__("model.layers.1.linear_attn.A_log", torch.zeros(4)),
     r"unexpected tensor model\.layers\.1\.linear_attn\.A_log"),  # layer 1 is full attention
    (lambda sd: sd.__setitem__("model.language_model.norm.weight", torch.zeros(64)),
     r"unexpected tensor model\.language_model\.norm\.weight"),  # the other layout's prefix
    (lambda sd: sd.pop("model.layers.3.mlp.experts.7.down_proj.weight"), r"MoE layer ordinal 3 expert 7 down_proj"),
    (lambda sd: sd.pop("model.layers.3.mlp.shared_expert_gate.weight"),
     r"model\.layers\.3\.mlp\.shared_expert_gate\.weight"),
], ids=["missing", "shape", "wrong-layer-kind", "wrong-prefix", "missing-expert", "missing-shared-gate"])
def test_broken_checkpoint_names_the_tensor(tiny, tmp_path, edit, match):
    d = _variant(tiny[0], tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        ModelRunner(d, _engine_config(), progress=False)


def test_skipped_prefixes_only(tiny, tmp_path):
    """A vision or MTP tensor is skipped in either layout; nothing else is."""
    d = _variant(tiny[0], tmp_path, lambda sd: sd.update({"model.visual.pos_embed.weight": torch.zeros(3),
                                                        "mtp.fc.weight": torch.zeros(2)}))
    r = ModelRunner(d, _engine_config(), progress=False)
    assert r.execute([StepInput(0, PROMPT[:8], 0)], Phase.PREFILL).shape == (1, r.model_config.vocab_size)


def test_ftw_convert_skips_vision_and_serves_identically(conditional, tmp_path):
    from edgemoe.weights.ftw import convert

    path, (ref_logits, ref_toks) = conditional
    ftw = convert(path, tmp_path / "ftw", progress=False)
    names = load_file(ftw / "non_expert.safetensors")
    assert not any(n.startswith(("model.visual.", "mtp.")) for n in names)
    logits, toks = greedy_decode(ModelRunner(ftw, _engine_config(), progress=False), PROMPT, 2)
    assert toks == ref_toks[:3]
    torch.testing.assert_close(logits, ref_logits[:3], **TOL)


def test_preset_is_the_transformers_layout(tiny):
    """make_model writes what transformers' Qwen3_5MoeForCausalLM saves: names, shapes, counts."""
    saved = load_file(tiny[0] / "model.safetensors")
    cfg = json.loads((tiny[0] / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["model_type"] == "qwen3_5_moe_text"
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in saved
    assert "model.layers.1.self_attn.q_proj.weight" in saved and "model.layers.1.linear_attn.A_log" not in saved
    assert saved["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 32 * 2, 64)  # query + gate
    assert saved["model.layers.0.mlp.experts.15.gate_proj.weight"].shape == (32, 64)
    hf = config_for("qwen3_5_moe", PRESET, {"vocab_size": cfg["vocab_size"]})
    assert sum(v.numel() for v in saved.values()) == param_count(hf)


def test_cli_make_model_and_generate(tmp_path, capsys):
    from edgemoe.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--preset", PRESET, "--out", str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "Hello there", "--max-tokens", "5", "--ignore-eos",
                 "--device", "cpu", "--cpu-executor", "torch", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"


def test_failed_decode_batch_recomputes_hybrid_sequences_instead_of_failing_them(tiny):
    """A batch failure drops the recurrent states it half-advanced; fault isolation must then
    recompute those sequences (preempt) rather than re-run them without a state, and give the same
    tokens as an undisturbed run."""
    def run(inject: bool):
        eng = LLMEngine(ModelRunner(tiny[0], _engine_config(expert_policy="fill-all", expert_cache_slots=10_000),
                                    progress=False))
        real, injected = eng.runner.model.forward, []

        def forward(batch):
            out = real(batch)  # every layer advanced its states ...
            if inject and batch.phase is Phase.DECODE and len(batch.seqs) == 2 and not injected:
                injected.append(1)
                raise RuntimeError("injected failure after the layers ran")  # ... then the step fails
            return out

        eng.runner.model.forward = forward
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        ids = [eng.add_request(None, list(range(3 + i, 13 + i)), params) for i in range(2)]
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = (o.outputs[0].finish_reason, list(o.outputs[0].token_ids))
        assert not inject or injected
        return [done[i] for i in ids]

    disturbed = run(inject=True)
    assert [r[0] for r in disturbed] == ["length", "length"]
    assert disturbed == run(inject=False)
