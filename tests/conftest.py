"""Shared pytest fixtures: tiny random-weight checkpoints built once per session."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT.parent / "shared" / "fixtures"  # ../shared beside the checkout (CI lays it there too)
QWEN3_TOKENIZER_DIR = FIXTURES / "tokenizers" / "qwen3"

# Tiny test models gain nothing from intra-op threads, and OpenMP spin-waiting on a busy 2-core CI
# machine made a decode step ~10x slower (measured: 100 steps 12.9 s with 2 threads vs 1.0 s with 1).
torch.set_num_threads(int(os.environ.get("EDGEMOE_TEST_THREADS", "1")))

# Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads the variable when a
# kernel module is imported, which may happen while collecting any test module (through the model code).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter() -> None:
    """Three bugs of Triton 3.6's interpreter (not of compiled kernels), patched for the tests: a loop bound
    passed as a kernel argument fails under numpy >= 2.4 (triton-lang/triton#9171), ``tl.dot``
    multiplies bfloat16 operands as their raw uint16 bit patterns, and a float32 -> bfloat16 cast
    truncates (compiled kernels round to nearest even, as torch does). Also, the interpreter's ``tl.dot`` is
    numpy's float32 ``matmul``, whose BLAS may sum a row's products in an order that depends on the row's
    position in the tile (OpenBLAS's AVX-512 kernels on an AMD Zen 5 do, in groups of six rows), while a compiled
    kernel's order per output element does not: a floating-point ``tl.dot`` here sums in float64 (each product of
    float32 values exact) and rounds once, so a row's result does not depend on the rows beside it."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:
        return
    if getattr(it, "_edgemoe_patched", False):
        return
    orig_patch = it._patch_lang_tensor
    orig_dot, orig_cast = it.InterpreterBuilder.create_dot, it.InterpreterBuilder.cast_impl

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def f32(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            return it.TensorHandle(it._convert_float(h.data, tl.bfloat16, tl.float32, None).view(it.np.float32),
                                   tl.float32)

        a, b = f32(a), f32(b)
        if not (it.np.issubdtype(a.data.dtype, it.np.floating) and it.np.issubdtype(d.data.dtype, it.np.floating)):
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        ab = it.np.matmul(a.data.astype(it.np.float64), b.data.astype(it.np.float64)).astype(d.data.dtype)
        return it.TensorHandle(ab + d.data, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return orig_cast(self, src, dst_type)
        bf16 = torch.from_numpy(it.np.array(src.data, dtype=it.np.float32)).to(torch.bfloat16)  # a copy, 0-d kept
        return it.TensorHandle(bf16.view(torch.int16).numpy().view(it.np.uint16), tl.bfloat16)

    it._patch_lang_tensor, it.InterpreterBuilder.create_dot = patch_lang_tensor, create_dot
    it.InterpreterBuilder.cast_impl = cast_impl
    it._edgemoe_patched = True


# Triton kernels (edgemoe/kernels/) run in Triton's interpreter where there is no CUDA; the switch is read
# when a kernel module is imported, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _patch_triton_interpreter()


def greedy_decode(runner, prompt: list[int], steps: int, *, seq_id: int = 0, chunk_ends: list[int] | None = None,
                  free: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``prompt`` (in chunks ending at ``chunk_ends``, then at its end), then ``steps`` greedy
    decode steps through ``runner.execute``; ``free`` releases the sequence after.

    Returns:
        ``(logits [steps + 1, V] on the CPU, tokens)``: the prompt's last logits, then each step's.
    """
    from edgemoe.core import Phase
    from edgemoe.engine.model_runner import StepInput

    start = 0
    for end in (chunk_ends or []) + [len(prompt)]:
        last = runner.execute([StepInput(seq_id, prompt[start:end], start)], Phase.PREFILL)[0]
        start = end
    logits, toks = [last], [int(last.argmax())]
    for i in range(steps):
        logits.append(runner.execute([StepInput(seq_id, [toks[-1]], len(prompt) + i)], Phase.DECODE)[0])
        toks.append(int(logits[-1].argmax()))
    if free:
        runner.free(seq_id)
    return torch.stack(logits).cpu(), toks


def reference_greedy(ref, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy prefill + decode of ``prompt`` with a ``transformers`` model ``ref`` (the whole sequence recomputed per
    token): ``(logits [steps + 1, V] float32, tokens)``, the counterpart of :func:`greedy_decode`."""
    ids = torch.tensor([prompt])
    logits, toks = [], []
    with torch.no_grad():
        for _ in range(steps + 1):
            out = ref(input_ids=ids).logits[0, -1].float()
            logits.append(out)
            toks.append(int(out.argmax()))
            ids = torch.cat([ids, torch.tensor([[toks[-1]]])], dim=1)
    return torch.stack(logits), toks


def run_requests(engine, prompts: list[list[int]], params=None, *, max_tokens: int = 10) -> list:
    """Add every prompt to ``engine`` at once and step until all finish; the final ``RequestOutput`` of each,
    in prompt order. ``params``: one ``SamplingParams`` for all, a list of one per prompt, or ``None`` for greedy
    decoding of ``max_tokens`` tokens with EOS ignored."""
    from edgemoe import SamplingParams

    if params is None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for _ in range(100_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def run_with_fault(engine, prompts: list[list[int]], bad: int, monkeypatch, *, after: int = 2, **run) -> list:
    """``run_requests`` with the runner raising on every decode batch that holds prompt ``bad``'s sequence
    from its ``after``-th generated token on; returns the outputs and checks that the KV cache is whole
    again after. The caller checks what each request got (``fault_isolated``)."""
    from edgemoe.core import Phase

    runner = engine.runner
    real, bad_prompt, bad_seqs = runner.execute, prompts[bad], set()

    def flaky(inputs, phase):
        for inp in inputs:
            if phase is Phase.PREFILL and inp.token_ids == bad_prompt[inp.start_pos:]:  # after any cached prefix
                bad_seqs.add(inp.seq_id)
        if phase is Phase.DECODE and any(i.seq_id in bad_seqs and i.start_pos >= len(bad_prompt) + after
                                         for i in inputs):
            raise RuntimeError("injected fault")
        return real(inputs, phase)

    with monkeypatch.context() as patch:
        patch.setattr(runner, "execute", flaky)
        outs = run_requests(engine, prompts, **run)
    assert runner.kv_free_tokens() == runner.kv_capacity_tokens
    return outs


def fault_isolated(outs: list, bad: int, alone: list[list[int]]) -> None:
    """Request ``bad`` ended in the injected fault; every other one got the tokens it gets alone."""
    for i, out in enumerate(outs):
        if i == bad:
            assert out.outputs[0].finish_reason == "error" and "injected fault" in out.error
        else:
            assert out.error is None and out.outputs[0].token_ids == alone[i]


def check_engine_preemption_prefix_cache_and_faults(path, engine_config, monkeypatch, **tight) -> None:
    """Six prompts sharing a 40-token system prompt, greedy, against each run alone: (1) with a KV cache of
    144 tokens (``tight``: further options of that engine), preempted and recomputed in 16-token prefill
    chunks; (2) with the prefix cache, the later ones borrowing the system prompt's pages; (3) with a fault
    injected into one request's decode, which fails that request only. ``engine_config(**options)``: the
    test module's ``EngineConfig``."""
    from edgemoe.engine.llm_engine import LLMEngine
    from edgemoe.engine.model_runner import ModelRunner

    def engine(**options):
        return LLMEngine(ModelRunner(path, engine_config(**options), progress=False))

    system = [(i * 37 + 11) % 1000 + 3 for i in range(40)]  # 2.5 pages shared by every prompt
    prompts = [system + [(i * 13 + j * 7) % 1000 + 3 for j in range(3 + 5 * i)] for i in range(6)]
    plain = engine(enable_prefix_caching=False)
    alone = [run_requests(plain, [p])[0].outputs[0].token_ids for p in prompts]

    small = engine(kv_cache_tokens=144, max_model_len=128, prefill_chunk_tokens=16, **tight)
    assert [o.outputs[0].token_ids for o in run_requests(small, prompts)] == alone
    assert small.metrics.preemptions._value.get() > 0

    cached = engine()
    first = run_requests(cached, prompts[:1])[0]
    outs = run_requests(cached, prompts[1:])
    assert first.cached_tokens == 0 and all(o.cached_tokens >= 32 for o in outs)  # the system prompt's pages
    assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in outs] == alone
    fault_isolated(run_with_fault(cached, prompts, 2, monkeypatch), 2, alone)


@pytest.fixture
def load_benchmark(monkeypatch):
    """``load_benchmark(name)``: the module of ``benchmarks/<name>.py``, loaded from its file (the scripts
    put their folders on ``sys.path``; the fixture restores it after the test)."""
    import importlib.util

    monkeypatch.setattr(sys, "path", list(sys.path))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The ``tiny`` qwen3_moe preset with the built-in tokenizer, saved in float32 so batched and
    single-sequence greedy decoding agree exactly (no bf16 rounding ties)."""
    from edgemoe.synth import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "qwen3_moe", "tiny", dtype="float32")


@pytest.fixture(scope="session")
def glm_model_dir(tmp_path_factory) -> Path:
    """The ``tiny`` glm4_moe preset (float32) with the GLM-style tokenizer and chat template make-model builds."""
    from edgemoe.synth import make_model

    return make_model(tmp_path_factory.mktemp("glm") / "glm-tiny", "glm4_moe", "tiny", dtype="float32")


@pytest.fixture(scope="session")
def qwen3_tokenizer_model_dir(tmp_path_factory) -> Path:
    """``tiny`` geometry with the real Qwen3 tokenizer (skipped when the fixture is absent)."""
    if not (QWEN3_TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"Qwen3 tokenizer fixture not found at {QWEN3_TOKENIZER_DIR}")
    from edgemoe.synth import make_model

    return make_model(
        tmp_path_factory.mktemp("tiny_qwen3tok") / "tiny-qwen3tok",
        "qwen3_moe",
        "tiny",
        tokenizer=QWEN3_TOKENIZER_DIR,
        dtype="float32",
    )


# ---------------------------------------------------------------- agent-API fixtures (tests/test_agents_*.py)

DEEPSEEK_V3_TOKENIZER_DIR = FIXTURES / "tokenizers" / "deepseek_v3"


def _tiny_with_tokenizer(tmp_path_factory, tokenizer_dir: Path, name: str, overrides: dict | None = None,
                         arch: str = "qwen3_moe") -> Path:
    if not (tokenizer_dir / "tokenizer.json").exists():
        pytest.skip(f"tokenizer fixture not found at {tokenizer_dir}")
    from edgemoe.synth import make_model

    return make_model(
        tmp_path_factory.mktemp(name) / name, arch, "tiny", tokenizer=tokenizer_dir, dtype="float32",
        overrides=overrides,
    )


@pytest.fixture(scope="session")
def deepseek_tokenizer_model_dir(tmp_path_factory) -> Path:
    """The ``deepseek_v3`` architecture's ``tiny`` geometry with the real DeepSeek-V3 tokenizer and chat
    template (skipped when absent)."""
    return _tiny_with_tokenizer(tmp_path_factory, DEEPSEEK_V3_TOKENIZER_DIR, "tiny-dsv3tok", arch="deepseek_v3")


class ScriptedOutputs:
    """Replays recorded model outputs through the real engine.

    Installed on the engine thread, it wraps ``runner.execute``: the real forward pass still runs
    (KV pages, chunked prefill, batching), then each row whose request drew a script gets logits that
    allow only the script's next token (EOS after the script), so the engine's sampler, stop checks,
    detokenizer and the server's parsers see exactly the recorded token sequence. A request draws the
    next queued script when its first output token is sampled; with an empty queue the model's own
    logits are used.
    """

    def __init__(self, tokenizer, eos_id: int):
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.queue: list[list[int]] = []
        self.by_request: dict[str, list[int]] = {}
        self.lock = __import__("threading").Lock()

    def push(self, *texts: str) -> None:
        """Queue recorded outputs (texts, tokenized as the model would have produced them)."""
        with self.lock:
            self.queue.extend(self.tokenizer.encode(t, add_special_tokens=False) for t in texts)

    def install(self, engine) -> None:
        real = engine.runner.execute

        def execute(inputs, phase):
            logits = real(inputs, phase).clone()  # an inference tensor: not writable outside inference mode
            by_seq = {r.seq_id: r for r in engine.scheduler.running}
            for row, inp in enumerate(inputs):
                req = by_seq.get(inp.seq_id)
                if req is None or inp.start_pos + len(inp.token_ids) != req.num_tokens:
                    continue
                with self.lock:
                    script = self.by_request.get(req.request_id)
                    if script is None and self.queue and not req.output_token_ids:
                        script = self.by_request[req.request_id] = self.queue.pop(0)
                if script is None:
                    continue
                k = len(req.output_token_ids)
                forced = torch.full_like(logits[row], float("-inf"))
                forced[script[k] if k < len(script) else self.eos_id] = 0.0
                logits[row] = forced
            return logits

        engine.runner.execute = execute


class AgentServer:
    """A real uvicorn server on 127.0.0.1 over an AsyncLLM with :class:`ScriptedOutputs` installed."""

    def __init__(self, llm, base: str, scripts: ScriptedOutputs, api_key: str | None):
        self.llm, self.base, self.scripts, self.api_key = llm, base, scripts, api_key

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120)

    def anthropic(self):
        import anthropic

        return anthropic.Anthropic(base_url=self.base, api_key=self.api_key or "unused", max_retries=0, timeout=120)

    def wait_idle(self, timeout: float = 10.0) -> None:
        import time

        start = time.monotonic()
        while self.llm.num_unfinished:
            assert time.monotonic() - start < timeout, f"{self.llm.num_unfinished} requests still in the engine"
            time.sleep(0.02)


@contextlib.contextmanager
def running_server(llm, served_model_name: str | tuple[str, ...] | None = None, *, wrap=None, uds: str | None = None,
                   **server_options) -> Iterator[str]:
    """Serve ``llm`` (an ``AsyncLLM``) with uvicorn on a free 127.0.0.1 port in a thread; yields the base URL.

    ``served_model_name`` (one name or several) and ``server_options`` are :class:`ServerConfig` fields;
    ``wrap(app) -> app``: an ASGI wrapper put around the app (e.g. a recorder of the exchanges);
    ``uds``: also listen on this Unix socket path."""
    import socket
    import threading
    import time

    import uvicorn

    from edgemoe.server.app import build_app
    from edgemoe.server.config import ServerConfig
    from edgemoe.server.transport import uvicorn_config

    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name or ())
    server_config = ServerConfig(served_model_name=names, **server_options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sockets = [sock]
    if uds:
        sockets.append(socket.socket(socket.AF_UNIX))
        sockets[-1].bind(uds)
    app = build_app(llm, server_config)
    config = uvicorn_config(wrap(app) if wrap else app, server_config, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        for s in sockets:
            s.close()


def start_agent_server(model_dir: Path, name: str | tuple[str, ...], *, engine_options: dict | None = None,
                       **server_options):
    """Context manager: load ``model_dir`` (CPU), serve it as ``name`` (and ``server_options``, see
    :func:`running_server`); yields an :class:`AgentServer`."""
    import contextlib

    from edgemoe.config import EngineConfig
    from edgemoe.engine.async_engine import AsyncLLM
    from edgemoe.models import load_config

    @contextlib.contextmanager
    def run():
        default = {"max_model_len": min(4096, load_config(model_dir).context_length())}
        llm = AsyncLLM(str(model_dir), EngineConfig(device="cpu", **(engine_options or default)), progress=False)
        try:
            assert llm.wait_ready(120)
            tok = llm.tokenizer
            eos = sorted(llm.engine.eos_token_ids)[0]
            scripts = ScriptedOutputs(tok, eos)
            llm.call_in_engine_thread(scripts.install, timeout=30)
            with running_server(llm, name, **server_options) as base:
                yield AgentServer(llm, base, scripts, server_options.get("api_key"))
        finally:
            llm.shutdown()

    return run()


@pytest.fixture(scope="session")
def qwen_agent_server(qwen3_tokenizer_model_dir):
    """The tiny model with the real Qwen3 tokenizer/template behind a real server (session-wide)."""
    with start_agent_server(qwen3_tokenizer_model_dir, "qwen3-tiny") as server:
        yield server
