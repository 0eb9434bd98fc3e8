"""Recurrent-state checkpoints at semantic anchors (hybrid ``qwen3_5_moe`` models; DESIGN.md §4), on CPU.

Store (LRU order, lookup rules, pending slots), checkpoint positions, anchors through the real Qwen3
tokenizer fixture, and the runner/engine: a restore resumes exactly where the checkpoint was taken
(bit-exact copies of the state and the partial-page K/V rows) and the suffix prefill gives the logits
of a full re-prefill; edits of the context reuse up to the last anchor or interval checkpoint before
the edit, a generated anchor is checkpointed, a wrong prefix never restores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgemoe import SamplingParams
from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.llm import render_chat
from edgemoe.engine.llm_engine import LLMEngine
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.kvcache.pool import KVSpec
from edgemoe.kvcache.state import StateSpec
from edgemoe.kvcache.state_checkpoints import (
    ANCHOR_TOKENS,
    StateCheckpointStore,
    anchor_token_ids,
    checkpoint_positions,
)
from edgemoe.synth import make_model

QWEN3_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers" / "qwen3"
PS = 16  # EngineConfig's default page size
SYSTEM = "You are a careful assistant for questions about experts and caches. " * 3


def _config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", expert_policy="fill-all", expert_cache_slots=10_000,
                cpu_executor="torch", bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, state_checkpoint_interval=0)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("ckpt") / "tiny", "qwen3_5_moe", "qwen3.5-moe-tiny", seed=7,
                      dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(ModelRunner(model_dir, _config(**kw), progress=False))


def _generate(engine: LLMEngine, prompt: list[int], max_tokens: int = 3, script: list[int] | None = None):
    """One request, greedy (or forced to ``script``); its finished ``RequestOutput``."""
    procs = []
    if script is not None:
        def force(out_ids, logits, _max):
            forced = torch.full_like(logits, float("-inf"))
            forced[script[len(out_ids)]] = 0.0
            return forced

        procs, max_tokens = [force], len(script)
    rid = engine.add_request(None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                          logits_processors=procs))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = out
    return result


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _anchor_positions(ids: list[int], anchors) -> list[int]:
    return [i + 1 for i, t in enumerate(ids) if t in anchors]


def _tool_turn(tokenizer, output: str):
    """A conversation that ends with a tool response, and the same conversation without that response
    (the block after the assistant's ``</tool_call><|im_end|>``) but with a new user message."""
    call = {"role": "assistant", "content": "I should look it up.",
            "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "slots"}}}]}
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many cache slots are there?"}, call]
    _, a = render_chat(tokenizer, base + [{"role": "tool", "content": output}])
    _, b = render_chat(tokenizer, base + [{"role": "user", "content": "Never mind, just guess."}])
    return a, b


# ------------------------------------------------------------------------------------------------ positions, anchors


def test_checkpoint_positions():
    anchors = {5, 9}
    # anchors at positions 11, 13, 14 -> states after them; multiples of 4 in (10, 15]
    assert checkpoint_positions([1, 5, 2, 9, 5], 10, anchors, 4) == [12, 14, 15]
    assert checkpoint_positions([1, 5, 2, 9, 5], 10, anchors, 0) == [12, 14, 15]
    assert checkpoint_positions([1, 2, 3, 4], 12, anchors, 4) == [16]  # the state at 12 is the step's input
    assert checkpoint_positions([1, 2, 3, 4], 12, set(), 0) == []
    assert checkpoint_positions([9], 40, anchors, 0) == [41]  # a decode step feeding an anchor token
    assert checkpoint_positions([3], 39, anchors, 8) == [40]


def test_anchors_through_the_real_qwen3_tokenizer():
    if not (QWEN3_TOKENIZER / "tokenizer.json").exists():
        pytest.skip(f"Qwen3 tokenizer fixture not found at {QWEN3_TOKENIZER}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    anchors = anchor_token_ids(tok, names=ANCHOR_TOKENS + ("<|no_such_token|>",))
    assert anchors == {tok.convert_tokens_to_ids(t) for t in ANCHOR_TOKENS}
    assert len(anchors) == 4 and anchor_token_ids(tok, extra_ids=[151643]) == anchors | {151643}
    # a rendered agent conversation: one checkpoint right after every anchor string the template wrote
    msgs = [{"role": "system", "content": "You are a tool-using agent."},
            {"role": "user", "content": "What is in the file?"},
            {"role": "assistant", "content": "<think>\nRead it first.\n</think>\n\n",
             "tool_calls": [{"type": "function", "function": {"name": "read", "arguments": {"path": "a.txt"}}}]},
            {"role": "tool", "content": "hello world"},
            {"role": "assistant", "content": "<think>\nIt says hello.\n</think>\n\nIt says hello world."}]
    text, ids = render_chat(tok, msgs)
    positions = checkpoint_positions(ids, 0, anchors, 0)
    assert [tok.convert_ids_to_tokens(ids[p - 1]) for p in positions] == [
        t for t in _tokens_in_order(text) if t in ANCHOR_TOKENS]
    assert sum(text.count(t) for t in ANCHOR_TOKENS) == len(positions) >= 8 and text.count("</think>") == 2


def _tokens_in_order(text: str) -> list[str]:
    """The anchor strings of ``text`` in order of appearance."""
    found = sorted((i, t) for t in ANCHOR_TOKENS for i in range(len(text)) if text.startswith(t, i))
    return [t for _, t in found]


# ------------------------------------------------------------------------------------------------ the store


def _store(slots: int) -> StateCheckpointStore:
    spec = StateSpec(num_layers=2, conv_dim=6, conv_width=3, num_heads=2, k_head_dim=4, v_head_dim=4)
    return StateCheckpointStore(spec, slots, torch.float32, kv_spec=KVSpec.heads(2, 1, 8), page_size=4,
                                kv_dtype=torch.float32, device=torch.device("cpu"))


def _take(store: StateCheckpointStore, tokens: list[int]) -> int:
    slot = store.reserve(tokens)
    store.save_layer(slot, 0, torch.full((6, 3), float(len(tokens))), torch.full((2, 4, 4), float(len(tokens))))
    store.commit(slot)
    return slot


def test_store_evicts_least_recently_used():
    store = _store(3)
    a, b, c = [1, 2, 3], [1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7, 7]
    slots = {len(t): _take(store, t) for t in (a, b, c)}
    assert sorted(store.positions()) == [3, 5, 7] and store.slots_used == 3
    assert store.find(a + [9, 9], max_tokens=4, kv_tokens=0) == (slots[3], 3)  # a restore refreshes a
    _take(store, [4] * 9)  # evicts b, the least recently used
    assert sorted(store.positions()) == [3, 7, 9] and store.evicted == 1
    assert store.reserve(c) is None  # already held: refreshed, not taken twice
    _take(store, [5] * 11)  # evicts a (c was refreshed after it)
    assert sorted(store.positions()) == [7, 9, 11]
    # pending slots are never evicted: with every slot pending, nothing more is reserved
    pending = [store.reserve([8] * n) for n in (2, 3, 4)]
    assert None not in pending and store.reserve([8] * 5) is None and store.positions() == []
    store.discard(pending[0])
    assert store.reserve([8] * 5) == pending[0]
    assert store.saved == 5


def test_store_find_rules():
    store = _store(4)
    prefix = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for n in (2, 6, 9):
        _take(store, prefix[:n])
    assert store.find(prefix + [0], 10, 10).num_tokens == 9  # the deepest
    assert store.find(prefix, 8, 10).num_tokens == 6  # at most max_tokens
    assert store.find(prefix, 10, 7).num_tokens == 6  # 9 // 4 * 4 = 8 > 7 cached tokens: pages missing
    assert store.find(prefix, 10, 3).num_tokens == 2  # no whole page needed below one page
    wrong = prefix[:5] + [8] + prefix[6:]
    assert store.find(wrong, 10, 10).num_tokens == 2  # a wrong token at 5: neither 6 nor 9 matches
    assert store.find([0] + prefix[1:], 10, 10) is None
    slot = store.reserve(prefix[:7])
    assert store.find(prefix, 10, 10).num_tokens == 9 and store.find(prefix, 7, 10).num_tokens == 6  # pending
    store.commit(slot)
    assert store.find(prefix, 7, 10) == (slot, 7)
    # snapshot views give what save_layer wrote (layer 0 only)
    snap = store.snapshot(store.find(prefix, 10, 10).slot)
    assert torch.equal(snap.conv[0], torch.full((6, 3), 9.0))
    assert torch.equal(snap.recurrent[0], torch.full((2, 4, 4), 9.0))
    assert not snap.conv[1].any() and not snap.recurrent[1].any()


# ------------------------------------------------------------------------------------------------ runner


def test_restore_continues_exactly_and_matches_full_prefill(model_dir, tokenizer):
    runner = ModelRunner(model_dir, _config(state_checkpoint_interval=20), progress=False)
    a, b = _tool_turn(tokenizer, "There are " + "many " * 30 + "slots.")
    runner.execute([StepInput(1, a, 0)], Phase.PREFILL)
    store = runner.prefix.checkpoints
    due = checkpoint_positions(a, 0, runner.prefix.anchor_ids, 20)
    assert sorted(store.positions()) == due and len(due) > 4
    runner.cache_prefix(1, a)
    k_rows = {p: runner.kv.k[:, runner.kv.slots(1, p - p % PS, p)].clone() for p in due}
    runner.free(1)

    shared = _common(a, b)
    p = max(q for q in due if q <= shared)
    assert p % PS and p > PS  # borrowed pages and a partial page
    assert runner.attach_prefix(2, b) == p
    # the restore is a bit-exact copy of the checkpoint: state and the partial page's K/V rows
    slot, ck = runner.state.slot(2), store.find(b, p, p).slot
    assert torch.equal(runner.state.conv[:, slot], store.conv[:, ck])
    assert torch.equal(runner.state.recurrent[:, slot], store.recurrent[:, ck])
    assert torch.equal(runner.kv.k[:, runner.kv.slots(2, p - p % PS, p)], k_rows[p])
    cached = runner.execute([StepInput(2, b[p:], p)], Phase.PREFILL)  # [1, V]
    full = runner.execute([StepInput(3, b, 0)], Phase.PREFILL)  # [1, V]: the same splits of the delta rule
    # not bit-identical: the suffix step runs fewer rows through the same GEMMs (expert blocks of other
    # sizes; one-row blocks take a GEMV path), which rounds differently in float32
    assert (cached - full).abs().max() <= 1e-5 * full.abs().max()
    tok = int(full.argmax())
    assert int(cached.argmax()) == tok
    d_cached = runner.execute([StepInput(2, [tok], len(b))], Phase.DECODE)
    d_full = runner.execute([StepInput(3, [tok], len(b))], Phase.DECODE)
    assert (d_cached - d_full).abs().max() <= 1e-5 * d_full.abs().max()
    runner.free(2), runner.free(3)

    # a checkpoint at the end of a step is the state the sequence continues from, bit for bit
    store.clear()
    runner.execute([StepInput(4, b[:p], 0)], Phase.PREFILL)
    end = store.find(b, p, p)
    snap = runner.snapshot_state(4)
    assert torch.equal(snap.conv, store.conv[:, end.slot]) and torch.equal(snap.recurrent, store.recurrent[:, end.slot])
    runner.free(4)


def test_only_the_deepest_checkpoints_of_a_step_are_taken(model_dir, tokenizer):
    runner = ModelRunner(model_dir, _config(state_checkpoints=2, state_checkpoint_interval=8), progress=False)
    a, _ = _tool_turn(tokenizer, "result")
    runner.execute([StepInput(1, a, 0)], Phase.PREFILL)
    assert sorted(runner.prefix.checkpoints.positions()) == checkpoint_positions(a, 0, runner.prefix.anchor_ids, 8)[-2:]
    assert runner.prefix.checkpoints.evicted == 0
    runner.free(1)


def test_failed_step_discards_its_checkpoints(model_dir, tokenizer, monkeypatch):
    runner = ModelRunner(model_dir, _config(), progress=False)
    a, _ = _tool_turn(tokenizer, "result")
    monkeypatch.setattr(runner.model.attention_layers()[1], "forward", lambda x, batch: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.execute([StepInput(1, a, 0)], Phase.PREFILL)
    monkeypatch.undo()
    assert runner.prefix.checkpoints._entries == [None] * runner.prefix.checkpoints.num_slots
    assert runner.prefix.checkpoints.saved == 0
    runner.execute([StepInput(1, a, 0)], Phase.PREFILL)
    assert len(runner.prefix.checkpoints.positions()) == len(_anchor_positions(a, runner.prefix.anchor_ids))


def test_kv_only_models_and_no_prefix_cache_keep_no_checkpoints(model_dir, tiny_model_dir):
    kv_only = ModelRunner(tiny_model_dir, EngineConfig(device="cpu", cpu_executor="torch"), progress=False)
    assert kv_only.state is None and kv_only.prefix.checkpoints is None and "checkpoints" not in kv_only.summary()
    no_cache = ModelRunner(model_dir, _config(enable_prefix_caching=False), progress=False)
    assert no_cache.prefix.checkpoints is None and "checkpoints  off" in no_cache.summary()
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(state_checkpoints=-1)


def test_cli_flags(tmp_path):
    from edgemoe.cli import build_parser, engine_config_from_args

    parse = build_parser().parse_args
    cfg = engine_config_from_args(parse(["serve", str(tmp_path)]))
    assert (cfg.state_checkpoints, cfg.state_checkpoint_interval, cfg.anchor_checkpoints) == (32, 2048, True)
    cfg = engine_config_from_args(parse(["serve", str(tmp_path), "--state-checkpoints", "4",
                                         "--state-checkpoint-interval", "0", "--no-anchor-checkpoints"]))
    assert (cfg.state_checkpoints, cfg.state_checkpoint_interval, cfg.anchor_checkpoints) == (4, 0, False)


# ------------------------------------------------------------------------------------------------ engine


def test_edit_removing_the_block_after_the_last_anchor_reuses_everything_before_it(model_dir, tokenizer):
    engine, plain = _engine(model_dir), _engine(model_dir, state_checkpoints=0)
    a, b = _tool_turn(tokenizer, "There are " + "many " * 40 + "slots.")
    assert _generate(engine, a).cached_tokens == 0
    # b drops the tool response: it shares a up to "<|im_start|>user\n" after the call's </tool_call><|im_end|>
    shared = _common(a, b)
    expected = max(_anchor_positions(a[:shared], engine.runner.prefix.anchor_ids))
    assert tokenizer.convert_ids_to_tokens(a[expected - 2:expected]) == ["</tool_call>", "<|im_end|>"]
    assert tokenizer.decode(a[expected:shared]) == "\n<|im_start|>user\n"
    out = _generate(engine, b)
    assert out.cached_tokens == expected
    assert out.outputs[0].token_ids == _generate(plain, b).outputs[0].token_ids
    text = engine.metrics.render().decode()
    assert "edgemoe_state_checkpoint_restores_total 1.0" in text
    assert f"edgemoe_state_checkpoint_reused_tokens_total {float(expected)}" in text
    assert f"edgemoe_prefix_cache_hit_tokens_total {float(expected)}" in text
    # without checkpoints a hybrid model reuses nothing, though the KV pages are cached
    assert _generate(plain, b).cached_tokens == 0 and plain.runner.kv.cached_pages > 0


def test_mid_block_cut_reuses_up_to_the_last_interval_checkpoint(model_dir, tokenizer):
    log = "\n".join(f"line {i}: expert {i % 7} filled slot {i * 3}" for i in range(40))
    a, _ = _tool_turn(tokenizer, log)
    cut, _ = _tool_turn(tokenizer, log[:len(log) // 2] + "\n[... cut ...]")
    shared = _common(a, cut)
    reuse = {}
    for name, kw in {"anchors": dict(), "interval": dict(state_checkpoint_interval=24, anchor_checkpoints=False),
                     "both": dict(state_checkpoint_interval=24)}.items():
        engine = _engine(model_dir, **kw)
        _generate(engine, a)
        reuse[name] = _generate(engine, cut).cached_tokens
    last_anchor = max(_anchor_positions(a[:shared], engine.runner.prefix.anchor_ids))
    assert reuse["anchors"] == last_anchor  # the <|im_end|> before the tool response
    assert reuse["interval"] == shared // 24 * 24 > last_anchor + 24  # most of the block's head is kept
    assert reuse["both"] == reuse["interval"]


def test_generated_anchor_is_checkpointed(model_dir, tokenizer):
    engine = _engine(model_dir)
    _, prompt = render_chat(tokenizer, [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": "Look up the slots."}])
    reply = tokenizer.encode('<think>\nLook it up.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": '
                             '{"q": "slots"}}\n</tool_call><|im_end|>', add_special_tokens=False)
    out = _generate(engine, prompt, script=reply)
    assert out.outputs[0].token_ids == reply
    # the next turn: prompt + reply + the tool response; the state after the generated </tool_call>
    # (fed back at the last decode step) is the deepest checkpoint
    close = tokenizer.convert_tokens_to_ids("</tool_call>")
    after = len(prompt) + reply.index(close) + 1
    assert after in engine.runner.prefix.checkpoints.positions()
    nxt = prompt + reply + tokenizer.encode("\n<|im_start|>user\n<tool_response>\n12 slots\n</tool_response>"
                                            "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert _generate(engine, nxt).cached_tokens == after


def test_wrong_prefix_never_restores(model_dir, tokenizer):
    engine = _engine(model_dir, state_checkpoint_interval=16)
    a, _ = _tool_turn(tokenizer, "result " * 20)
    _generate(engine, a)
    changed = list(a)
    changed[20] = (changed[20] + 1) % 1000  # one token of the system prompt differs
    out = _generate(engine, changed)
    assert out.cached_tokens == 16  # only the checkpoint before the change
    changed[3] = (changed[3] + 1) % 1000
    assert _generate(engine, changed).cached_tokens == 0
    # KV pages gone (evicted), checkpoints kept: a checkpoint past the first page cannot be used
    tree = engine.runner.kv.prefix_cache
    tree.evict(tree.num_pages)
    assert engine.runner.prefix.checkpoints.slots_used > 0 and _generate(engine, a).cached_tokens == 0


def test_restore_into_a_kv_cache_that_grew(model_dir, tokenizer):
    # 64 KV tokens: the first request's prefill borrows pages from the expert cache, which resizes the KV pool
    # inside the step (inference mode); restoring a checkpoint into the grown pool between steps writes its
    # partial page there, and must not fail the step
    engine = _engine(model_dir, kv_cache_tokens=64, state_checkpoint_interval=20)
    a, b = _tool_turn(tokenizer, "There are " + "many " * 30 + "slots.")
    _generate(engine, a)
    assert engine.runner.memory.borrowed_pages > 0
    out = _generate(engine, b)
    assert out.cached_tokens % PS and out.cached_tokens > PS  # borrowed pages and a restored partial page
    assert out.outputs[0].token_ids == _generate(_engine(model_dir, state_checkpoints=0), b).outputs[0].token_ids


def test_fault_in_a_restored_sequence_fails_it_alone(model_dir, monkeypatch):
    # A step that fails drops the recurrent states it half-advanced, so its sequences are recomputed; when
    # they all resume from checkpoints (past position 0) they used to be batched together again, fail again
    # and be preempted again, forever. The failing request must end in an error, the others as alone.
    engine = _engine(model_dir, state_checkpoint_interval=16)
    prompts = [[(i * 37 + 11 * k) % 900 + 20 for i in range(n)] for k, n in ((1, 30), (2, 40), (3, 25))]
    bad = prompts[1]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for p in prompts:  # checkpoints at 16 and 32 tokens, and the KV pages under them
        engine.add_request(None, p, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    layer = engine.runner.model.attention_layers()[-1]
    real = layer.forward

    def forward(x, batch):
        seqs = {r.seq_id for r in engine.scheduler.running if r.prompt_token_ids == bad}
        if any(s.seq_id in seqs and s.kv_len > len(bad) + 3 for s in batch.seqs):
            raise RuntimeError("injected fault")
        return real(x, batch)

    monkeypatch.setattr(layer, "forward", forward)
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished_requests()
    monkeypatch.undo()
    outs = [done[i].outputs[0] for i in ids]
    assert outs[1].finish_reason == "error" and "injected fault" in done[ids[1]].error
    plain = _engine(model_dir, state_checkpoints=0)
    for i in (0, 2):
        assert outs[i].finish_reason == "length"
        assert outs[i].token_ids == _generate(plain, prompts[i], max_tokens=12).outputs[0].token_ids
    assert engine.runner.state.free_slots == engine.runner.state.num_slots
