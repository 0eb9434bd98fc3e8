"""LLMEngine / LLM / CLI mechanics on a tiny random-weight model (CPU).

Random weights produce gibberish: these tests check stopping, batching, preemption, admission,
fault isolation and bookkeeping, comparing greedy outputs between configurations.
"""

from __future__ import annotations

import json

import pytest

from edgemoe import LLM, SamplingParams
from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.llm_engine import IncrementalDetokenizer, LLMEngine, PromptTooLongError

from conftest import run_requests

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(model_dir, **options) -> LLMEngine:
    options.setdefault("device", "cpu")
    return LLMEngine.from_model_dir(str(model_dir), EngineConfig(**options), progress=False)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    texts = [f"Request {i}: tell me about the number {i * 7} and " + "why " * i for i in range(10)]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def alone(engine, prompts) -> list[list[int]]:
    """Greedy 24-token outputs of each prompt run by itself."""
    return [run_requests(engine, [p], SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0].token_ids for p in prompts]


def test_max_tokens_gives_length(engine, prompts):
    out = run_requests(engine, [prompts[0]], SamplingParams(max_tokens=7, **GREEDY))[0]
    c = out.outputs[0]
    assert out.finished and c.finish_reason == "length" and len(c.token_ids) == 7
    assert out.usage == {"prompt_tokens": len(prompts[0]), "completion_tokens": 7, "total_tokens": len(prompts[0]) + 7}
    assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time and m.ttft > 0


def test_stop_string_truncates_output(engine, prompts):
    full = run_requests(engine, [prompts[1]], SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0].text
    # A stop string from the middle of the greedy text (avoid replacement characters).
    start = next(i for i in range(8, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    stop = full[start : start + 3]
    out = run_requests(engine, [prompts[1]], SamplingParams(max_tokens=40, stop=["never-there", stop], **GREEDY))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]
    assert stop not in c.text


def test_streamed_deltas_hold_back_stop_prefixes(engine, prompts):
    full = run_requests(engine, [prompts[1]], SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0].text
    stop = full[20:24]
    rid = engine.add_request(None, prompts[1], SamplingParams(max_tokens=40, stop=stop, **GREEDY))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.outputs[0].delta_text)
            assert stop not in "".join(deltas)
            final = out
    assert "".join(deltas) == final.outputs[0].text == full[: full.index(stop)]


def test_eos_and_stop_token_ids(tiny_model_dir, engine, prompts, alone):
    toks = alone[2]
    target = toks[5]
    cut = toks.index(target) + 1
    # stop_token_ids: the stop token is kept in token_ids but not in the text.
    out = run_requests(engine, [prompts[2]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[target]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == target and c.token_ids == toks[:cut]
    assert c.text == engine.tokenizer.decode(toks[: cut - 1], skip_special_tokens=True)
    # EOS: an engine whose runner reports that token as EOS stops there unless ignore_eos.
    runner = engine.runner
    saved = runner.eos_token_ids
    runner.eos_token_ids = [target]
    try:
        eos_engine = LLMEngine(runner)
        out = run_requests(eos_engine, [prompts[2]], SamplingParams(max_tokens=24, temperature=0))[0]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
        assert out.outputs[0].token_ids == toks[:cut]
        out = run_requests(eos_engine, [prompts[2]], SamplingParams(max_tokens=24, **GREEDY))[0]
        assert out.outputs[0].token_ids == toks and out.outputs[0].finish_reason == "length"
    finally:
        runner.eos_token_ids = saved


def test_concurrent_requests_match_single(engine, prompts, alone):
    assert engine.scheduler.max_num_seqs >= 8
    outs = run_requests(engine, prompts, SamplingParams(max_tokens=24, **GREEDY))  # 10 requests, 8 in flight at once
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert engine.runner.kv_free_tokens() == engine.runner.kv_capacity_tokens


def test_chunked_prefill_and_preemption_match_single(tiny_model_dir, prompts, alone):
    # 256 KV tokens cannot hold 8 requests of ~20-50 + 24 tokens: requests get preempted and recomputed;
    # 16-token prefill chunks split every prompt.
    small = make_engine(tiny_model_dir, prefill_chunk_tokens=16, kv_cache_tokens=256, max_model_len=512)
    outs = run_requests(small, prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert small.metrics.preemptions._value.get() > 0
    assert small.runner.kv_free_tokens() == small.runner.kv_capacity_tokens
    # A prompt longer than the KV cache is rejected at once (never queued forever).
    with pytest.raises(PromptTooLongError, match="KV cache holds 256 tokens"):
        small.add_request(None, [5] * 300, SamplingParams())
    assert not small.has_unfinished_requests()


def test_prompt_too_long_rejected_and_max_tokens_clamped(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=64)
    with pytest.raises(PromptTooLongError, match="maximum context length is 64") as info:
        eng.add_request("too-long", [5] * 64, SamplingParams())
    assert isinstance(info.value, ValueError) and info.value.prompt_len == 64 and info.value.limit == 63
    assert not eng.has_unfinished_requests()
    out = run_requests(eng, [[5] * 60], SamplingParams(max_tokens=100, **GREEDY))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    out = run_requests(eng, [[5] * 63], SamplingParams(max_tokens=None, **GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request(None, [], SamplingParams())


def test_fault_isolation(engine, prompts, alone, monkeypatch):
    """A runner that raises whenever one sequence is in the batch fails only that request."""
    runner = engine.runner
    real = runner.execute
    bad_prompt = prompts[3]
    bad_seqs: set[int] = set()
    calls = {"batches_failed": 0}

    def flaky(inputs, phase):
        for inp in inputs:
            if phase is Phase.PREFILL and inp.token_ids == bad_prompt[inp.start_pos:]:  # after any cached prefix
                bad_seqs.add(inp.seq_id)
        # Fail in decode, after the bad request has produced a few tokens.
        if phase is Phase.DECODE and any(i.seq_id in bad_seqs and i.start_pos >= len(bad_prompt) + 3 for i in inputs):
            calls["batches_failed"] += 1
            raise RuntimeError("injected fault")
        return real(inputs, phase)

    monkeypatch.setattr(runner, "execute", flaky)
    outs = run_requests(engine, prompts[:8], SamplingParams(max_tokens=24, **GREEDY))
    monkeypatch.undo()
    assert calls["batches_failed"] >= 2  # the batch, then the sequence alone
    for i, out in enumerate(outs):
        if i == 3:
            assert out.outputs[0].finish_reason == "error" and "injected fault" in out.error
            assert len(out.outputs[0].token_ids) == 4
        else:
            assert out.error is None and out.outputs[0].token_ids == alone[i]
    assert runner.kv_free_tokens() == runner.kv_capacity_tokens
    assert engine.metrics.requests.labels(finish_reason="error")._value.get() >= 1


def test_raising_logits_processor_fails_only_its_request(engine, prompts, alone):
    """A request whose logits processor raises (at its third token) fails alone; the others go on."""

    def broken(output_ids, logits, max_tokens):
        if len(output_ids) == 2:
            raise RuntimeError("processor fault")
        return logits

    params = [SamplingParams(max_tokens=24, **GREEDY)] * 4
    params[1] = SamplingParams(max_tokens=24, logits_processors=[broken], **GREEDY)
    outs = run_requests(engine, prompts[:4], params)
    assert outs[1].outputs[0].finish_reason == "error" and "processor fault" in outs[1].error
    assert outs[1].outputs[0].token_ids == alone[1][:2]
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == [alone[0], *alone[2:4]]
    assert engine.runner.kv_free_tokens() == engine.runner.kv_capacity_tokens


def test_abort_frees_kv(engine, prompts):
    runner = engine.runner
    a = engine.add_request("a", prompts[0], SamplingParams(max_tokens=1000, **GREEDY))
    b = engine.add_request("b", prompts[1], SamplingParams(max_tokens=1000, **GREEDY))
    for _ in range(5):
        engine.step()
    assert engine.num_running == 2 and runner.kv_free_tokens() < runner.kv_capacity_tokens
    out = engine.abort(a)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.num_running == 1
    assert engine.abort(a) is None and engine.abort("unknown") is None
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("b", prompts[1], SamplingParams())
    engine.abort(b)
    assert not engine.has_unfinished_requests() and engine.num_running == 0
    assert runner.kv_free_tokens() == runner.kv_capacity_tokens
    # Aborting a request still in the queue works too.
    engine.add_request("c", prompts[2], SamplingParams())
    assert engine.num_waiting == 1
    engine.abort("c")
    assert engine.num_waiting == 0 and not engine.has_unfinished_requests()


def test_seeded_sampling_is_reproducible(engine, prompts):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    one = run_requests(engine, [prompts[4]], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = run_requests(engine, [prompts[5], prompts[4], prompts[6]], [noise, seeded, noise])[1].outputs[0].token_ids
    assert one == batched
    other = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    assert run_requests(engine, [prompts[4]], other)[0].outputs[0].token_ids != one


def test_incremental_detokenizer_never_emits_broken_utf8(engine):
    tok = engine.tokenizer
    text = "héllo wörld 日本語 — ok <think>x</think> done"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [det.step(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert pieces.count("") > 0  # multi-byte characters span several byte-level tokens


def test_llm_front(tiny_model_dir, alone, prompts):
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(str(tiny_model_dir), no_such_option=1)
    llm = LLM(str(tiny_model_dir), device="cpu", progress=False)
    params = SamplingParams(max_tokens=24, **GREEDY)
    by_ids = llm.generate(prompts[:3], params)
    assert [o.outputs[0].token_ids for o in by_ids] == alone[:3]
    assert llm.generate(prompts[0], params)[0].outputs[0].token_ids == alone[0]
    text = llm.tokenizer.decode(prompts[1])
    by_text = llm.generate([text], params)
    assert by_text[0].prompt == text and by_text[0].outputs[0].token_ids == alone[1]
    assert llm.generate(text, params)[0].outputs[0].token_ids == alone[1]

    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0),
                   chat_template_kwargs={"enable_thinking": False})
    expected = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
    assert out[0].prompt == expected and out[0].prompt.endswith("<think>\n\n</think>\n\n")
    assert out[0].prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]])
    assert len(two) == 2 and all(o.finished for o in two)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [params])


# ---------------------------------------------------------------- CLI


def test_cli_errors_are_one_line(tmp_path, capsys):
    from edgemoe.cli import main

    assert main(["generate", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tmp_path), "--expert-policy", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--expert-policy" in err
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_serve_refuses_a_busy_port_before_loading(tiny_model_dir, capsys, monkeypatch):
    """A port another process listens on is an error at once, not after the weights load."""
    import socket

    import edgemoe.server.app as app
    from edgemoe.cli import main

    monkeypatch.setattr(app, "serve", lambda *a, **k: pytest.fail("serve() reached with a busy port"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tiny_model_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.strip().count("\n") == 0


def test_cli_generate_json_and_make_model(tmp_path, capsys):
    from edgemoe.cli import main

    out_dir = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out_dir), "--dtype", "float32"]) == 0
    assert (out_dir / "config.json").exists() and capsys.readouterr().out.strip() == str(out_dir)
    args = ["generate", str(out_dir), "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos", "--device", "cpu"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"
    assert result["ttft_s"] > 0 and result["total_s"] >= result["ttft_s"] and result["decode_tokens_per_s"] > 0
    assert main(args) == 0
    assert capsys.readouterr().out.rstrip("\n") == result["text"]
    assert main([*args, "--chat", "--chat-template-kwargs", '{"enable_thinking": false}']) == 0


def test_failed_prefix_attach_frees_what_it_took_and_computes_from_the_start(engine, prompts, alone, monkeypatch):
    """Attaching a cached prefix that raises after taking pages (a checkpoint restore failing part-way) leaks
    nothing: the request computes its prompt from the start, with its usual output."""
    runner = engine.runner
    p = prompts[5]
    run_requests(engine, [p], SamplingParams(max_tokens=4, **GREEDY))  # its prefix is cached now
    real = runner.prefix.attach
    failed = []

    def attach_then_fail(seq_id, token_ids):
        start = real(seq_id, token_ids)
        if start and not failed:
            failed.append((seq_id, len(runner.kv.pages_of(seq_id))))
            raise RuntimeError("injected attach fault")
        return start

    monkeypatch.setattr(runner.prefix, "attach", attach_then_fail)
    out = run_requests(engine, [p], SamplingParams(max_tokens=24, **GREEDY))[0]
    monkeypatch.undo()
    assert failed and failed[0][1] > 0  # it had taken cached pages before raising
    assert out.error is None and out.outputs[0].token_ids == alone[5]
    assert runner.kv.pages_of(failed[0][0]) == []
    assert runner.kv_free_tokens() == runner.kv_capacity_tokens
