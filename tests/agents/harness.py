"""Drive real coding-agent CLIs (Claude Code, Codex, opencode, aider, llm) against a real edgemoe server.

The server is the tiny random-weight Qwen3-MoE checkpoint of ``make_model`` (its own tokenizer and
Qwen3-style chat template with tool calls), served by uvicorn on 127.0.0.1. Model outputs are
scripted per request (:class:`TurnScripts`): the real forward pass runs, then the logits are forced
to a text chosen from the request's rendered prompt, so the engine's sampler, stop handling and
detokenizer and the server's tool-call parser see exactly the native ``<tool_call>`` markup a Qwen3
model writes, naming the client's real tools.

Every HTTP exchange is recorded by :class:`Recorder` (an ASGI wrapper around the app): method, path,
request headers and JSON body, response status and body (streamed bodies joined, long ones cut), so a
failing test prints what the client sent and what the server answered; all of them are written to
the test's temp dir (``exchanges.json``), and ``EDGEMOE_AGENT_DUMP=DIR`` saves each session's API
requests, sanitized, as ``DIR/<name>.json`` (the files of ``tests/data/agent_requests/``).

Clients are run as subprocesses with a private ``HOME`` (and XDG dirs) under the test's temp dir,
telemetry, update checks and other network features switched off by their documented settings, and
a bounded wall time. Where a client is found: ``$EDGEMOE_AGENT_CLIENTS`` (default ``.agent-clients/``
at the repository root, filled by ``scripts/install_agent_clients.sh``), then ``PATH``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import ScriptedOutputs, running_server

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_DIR = Path(os.environ.get("EDGEMOE_AGENT_CLIENTS", ROOT / ".agent-clients"))
MODEL = "edgemoe-tiny"
# Client prompts are long (Claude Code's and Codex's system prompts and tool schemas are 30-50 kB of
# text, 15-25k tokens of the tiny model's own BPE), so the checkpoint gets a long context and a
# thinner geometry than the ``tiny`` preset: 2 layers (both MoE) of 2 query heads over 1 KV head of
# 16 dims, which makes a 15k-token prefill on 2 CPU cores ~11 s instead of ~34 s.
MAX_MODEL_LEN = 131072
GEOMETRY = {"max_position_embeddings": MAX_MODEL_LEN, "num_hidden_layers": 2, "mlp_only_layers": [],
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}

# Where each CLI lives inside the install folder.
_CLIENT_PATHS = {
    "claude": "npm/node_modules/.bin/claude",
    "codex": "npm/node_modules/.bin/codex",
    "opencode": "npm/node_modules/.bin/opencode",
    "aider": "aider/bin/aider",
    "llm": "llm/bin/llm",
}


def find_client(name: str) -> str:
    """Path of the client executable ``name``; skips the test when it is not installed."""
    candidate = CLIENTS_DIR / _CLIENT_PATHS[name]
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (run scripts/install_agent_clients.sh, or put it on PATH)")
    return found


def tool_call(name: str, arguments: dict) -> str:
    """The Qwen3 (Hermes) markup of one tool call, as the model writes it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def tool_results(prompt: str) -> int:
    """How many tool results the rendered (Qwen3 template) prompt holds: the turn of an agent loop."""
    return prompt.count("<tool_response>")


@dataclass
class EngineRequest:
    """What the engine was asked: the rendered prompt, its length in tokens and the output cap
    (``max_tokens`` after the engine clamped it to the room left in the context)."""

    prompt: str
    prompt_tokens: int
    max_tokens: int


def offered_tools(prompt: str) -> list[str]:
    """Names of the tools the rendered prompt offers the model (one JSON object per line inside
    ``<tools></tools>``, as Qwen3's template writes them)."""
    if "\n<tools>" not in prompt:
        return []
    block = prompt.split("\n<tools>", 1)[1].split("\n</tools>", 1)[0]
    tools = [json.loads(line) for line in block.splitlines() if line.strip()]
    return [t.get("function", t)["name"] for t in tools]


class TurnScripts(ScriptedOutputs):
    """:class:`ScriptedOutputs` whose script is chosen from each request's rendered prompt.

    ``rule(prompt_text) -> str | None`` gives the output text of a request (``None``: the model's
    own logits), so the client's side requests (titles, summaries, probes) and the turns of its
    agent loop get the right output whatever order they arrive in. A rule that raises fails the
    request loudly (the exception is kept in ``errors``).
    """

    def __init__(self, tokenizer, eos_id: int):
        super().__init__(tokenizer, eos_id)
        self.rule: Callable[[str], str | None] = lambda prompt: None
        self.seen: list[EngineRequest] = []
        self.errors: list[Exception] = []

    def install(self, engine) -> None:
        real = engine.runner.execute

        def execute(inputs, phase):
            logits = real(inputs, phase).clone()  # [B, V]
            by_seq = {r.seq_id: r for r in engine.scheduler.running}
            for row, inp in enumerate(inputs):
                req = by_seq.get(inp.seq_id)
                if req is None or inp.start_pos + len(inp.token_ids) != req.num_tokens:
                    continue
                with self.lock:
                    if req.request_id not in self.by_request and not req.output_token_ids:
                        prompt = self.tokenizer.decode(req.prompt_token_ids)
                        self.seen.append(EngineRequest(prompt, len(req.prompt_token_ids), req.params.max_tokens))
                        try:
                            text = self.rule(prompt)
                        except Exception as exc:
                            self.errors.append(exc)
                            text = None
                        self.by_request[req.request_id] = (
                            None if text is None else self.tokenizer.encode(text, add_special_tokens=False)
                        )
                    script = self.by_request.get(req.request_id)
                if script is None:
                    continue
                k = len(req.output_token_ids)
                forced = torch.full_like(logits[row], float("-inf"))  # [V]
                forced[script[k] if k < len(script) else self.eos_id] = 0.0
                logits[row] = forced
            return logits

        engine.runner.execute = execute


@dataclass
class Exchange:
    """One HTTP request the server received and what it answered."""

    method: str
    path: str
    headers: dict[str, str]
    body: object  # the parsed JSON body, else its text (``None`` when empty)
    status: int | None = None
    response: str = ""
    start: float = 0.0  # time.monotonic() at arrival
    seconds: float | None = None  # until the response's last byte

    def brief(self, limit: int = 1500) -> str:
        text = self.response if len(self.response) <= limit else self.response[:limit] + " ..."
        return f"{self.method} {self.path} -> {self.status} ({self.seconds or 0:.1f} s): {text}"


# Request headers worth keeping (client identity and API options); credentials are never stored.
_KEPT_HEADERS = ("user-agent", "content-type", "accept", "anthropic-version", "anthropic-beta", "openai-beta",
                 "x-stainless-lang", "x-stainless-package-version", "originator", "version", "x-app")
_RESPONSE_LIMIT = 20000


class Recorder:
    """An ASGI wrapper that records every HTTP exchange (:class:`Exchange`) of the app it wraps."""

    def __init__(self):
        self.app = None
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()

    def wrap(self, app):
        """Record the exchanges of ``app``; returns the wrapped ASGI app."""
        self.app = app
        return self

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        ex = Exchange(scope["method"], scope["path"], {k: headers[k] for k in _KEPT_HEADERS if k in headers}, None,
                      start=time.monotonic())
        with self.lock:
            self.exchanges.append(ex)
        chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    raw = b"".join(chunks).decode("utf-8", "replace")
                    try:
                        ex.body = json.loads(raw) if raw else None
                    except json.JSONDecodeError:
                        ex.body = raw
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                ex.status = message["status"]
            elif message["type"] == "http.response.body":
                if len(ex.response) < _RESPONSE_LIMIT:
                    ex.response += message.get("body", b"").decode("utf-8", "replace")
                if not message.get("more_body"):
                    ex.seconds = time.monotonic() - ex.start
            await send(message)

        await self.app(scope, recording_receive, recording_send)

    def api_calls(self, path: str | None = None) -> list[Exchange]:
        """The recorded exchanges on ``/v1/`` routes (or on ``path`` only)."""
        return [e for e in self.exchanges if (e.path == path if path else e.path.startswith("/v1/"))]

    def report(self) -> str:
        """One line per exchange (status and the start of the answer), for assertion messages."""
        return "\n".join(e.brief() for e in self.exchanges) or "(the server received no request)"


@dataclass
class AgentRun:
    """A finished client run."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (f"$ {' '.join(self.args)}\nexit status {self.returncode}\n--- stdout\n{self.stdout[-6000:]}\n"
                f"--- stderr\n{self.stderr[-6000:]}")


@dataclass
class AgentServer:
    """The tiny model behind a real server, with per-request scripts and a request recorder."""

    base: str
    scripts: TurnScripts
    recorder: Recorder
    home: Path
    workdir: Path
    uds: str

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment for a client: private HOME/XDG dirs, no proxies, loopback only."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "XDG_DATA_HOME": str(self.home / ".local/share"),
            "XDG_STATE_HOME": str(self.home / ".local/state"),
            "TMPDIR": str(self.home / "tmp"),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        for d in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "TMPDIR"):
            Path(env[d]).mkdir(parents=True, exist_ok=True)
        env.update(extra)
        return env

    def run(self, args: list[str], env: dict[str, str], timeout: float = 240) -> AgentRun:
        """Run a client in :attr:`workdir` (stdin empty), inside a loopback-only network namespace when
        this machine allows one (:func:`netns_available`); a run past ``timeout`` seconds is killed and
        fails the test."""
        command = args
        if netns_available():
            port = self.base.rsplit(":", 1)[1]
            command = ["unshare", "--net", "--map-root-user", sys.executable, str(Path(__file__).with_name(
                "loopback_only.py")), "--port", port, "--uds", self.uds, "--", *args]
        proc = subprocess.Popen(command, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{Path(args[0]).name} ran past {timeout} s\n{self.explain(AgentRun(args, -9, out, err))}")
        return AgentRun(args, proc.returncode, out, err)

    def explain(self, run: AgentRun | None = None) -> str:
        """What the client printed and what the server saw, for assertion messages."""
        errors = "".join(f"\nscript rule error: {e!r}" for e in self.scripts.errors)
        return f"{run or ''}\n--- server exchanges\n{self.recorder.report()}{errors}"

    def assert_ok(self, run: AgentRun, final_text: str) -> None:
        """The run exited 0, printed ``final_text`` and every API call the server answered was a 2xx."""
        failures = [e for e in self.recorder.api_calls() if e.status is None or e.status >= 400]
        assert not failures, "the server rejected requests:\n" + "\n".join(
            f"{e.brief(4000)}\nrequest body: {json.dumps(e.body)[:4000]}" for e in failures) + self.explain(run)
        assert not self.scripts.errors, self.explain(run)
        assert run.returncode == 0, self.explain(run)
        assert final_text in run.stdout, self.explain(run)


@functools.cache
def netns_available() -> bool:
    """Whether ``unshare --net --map-root-user`` works here (user namespaces allowed), so clients can be
    confined to loopback; elsewhere they run in the host's network namespace."""
    try:
        probe = subprocess.run(["unshare", "--net", "--map-root-user", "true"], check=False, capture_output=True)
    except FileNotFoundError:
        return False
    return probe.returncode == 0


def model_dir(tmp_path_factory) -> Path:
    """A random-weight ``tiny`` qwen3_moe checkpoint of :data:`GEOMETRY`, with ``make_model``'s own
    tokenizer and Qwen3-style chat template (tool calls in ``<tool_call>`` markup)."""
    from edgemoe.synth import make_model

    return make_model(tmp_path_factory.mktemp("agent-model") / MODEL, "qwen3_moe", "tiny", dtype="float32",
                      overrides=GEOMETRY)


@contextlib.contextmanager
def serve(model: Path, tmp_path: Path) -> Iterator[AgentServer]:
    """Load ``model`` on the CPU and serve it on 127.0.0.1 as :data:`MODEL`, recording every exchange.

    On exit the exchanges are written to ``tmp_path/exchanges.json``.
    """
    from edgemoe.config import EngineConfig
    from edgemoe.engine.async_engine import AsyncLLM

    if not netns_available():
        warnings.warn("clients run in the host's network namespace: 'unshare --net --map-root-user' is not "
                      "available here, so nothing confines them to loopback", stacklevel=3)
    llm = AsyncLLM(str(model), EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN), progress=False)
    recorder = Recorder()
    try:
        assert llm.wait_ready(120)
        scripts = TurnScripts(llm.tokenizer, min(llm.engine.eos_token_ids))
        llm.call_in_engine_thread(scripts.install, timeout=30)
        home, workdir = tmp_path / "home", tmp_path / "work"
        home.mkdir()
        workdir.mkdir()
        with tempfile.TemporaryDirectory(prefix="edgemoe-agent-") as sockets:  # short: a socket path has <= 107 bytes
            uds = os.path.join(sockets, "server.sock")
            with running_server(llm, MODEL, wrap=recorder.wrap, uds=uds) as base:
                yield AgentServer(base, scripts, recorder, home, workdir, uds)
    finally:
        (tmp_path / "exchanges.json").write_text(json.dumps([e.__dict__ for e in recorder.exchanges], indent=1))
        llm.shutdown()


_UUID = "00000000-0000-0000-0000-000000000000"
_ID_PATTERNS = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), _UUID),
    (re.compile(r"\b[0-9a-f]{64}\b"), "0" * 64),
]
_SAVED_STRING_LIMIT = 1000
# a tool result in a request body: Messages, Responses, Chat Completions
_TOOL_RESULT_MARKERS = ('"type": "tool_result"', '"type": "function_call_output"', '"role": "tool"')


def sanitized(value, replacements: dict[str, str]):
    """``value`` (JSON data) with machine paths, ports and ids replaced and strings longer than
    1000 characters cut (the cut is marked), for saving a client's requests in the repository."""
    if isinstance(value, dict):
        return {k: sanitized(v, replacements) for k, v in value.items()}
    if isinstance(value, list):
        return [sanitized(v, replacements) for v in value]
    if not isinstance(value, str):
        return value
    for old, new in replacements.items():
        value = value.replace(old, new)
    for pattern, new in _ID_PATTERNS:
        value = pattern.sub(new, value)
    if len(value) > _SAVED_STRING_LIMIT:
        value = value[:_SAVED_STRING_LIMIT] + f"...[{len(value) - _SAVED_STRING_LIMIT} more characters cut]"
    return value


def save_requests(server: AgentServer, name: str, client: str, env: dict[str, str]) -> None:
    """With ``$EDGEMOE_AGENT_DUMP`` set, write the first API requests of this session, up to the
    first that carries a tool result, sanitized (:func:`sanitized`), to
    ``$EDGEMOE_AGENT_DUMP/<name>.json`` (how ``tests/data/agent_requests/`` is made), with the client's
    ``--version``."""
    out = os.environ.get("EDGEMOE_AGENT_DUMP")
    if not out:
        return
    version = subprocess.run([client, "--version"], env=env, cwd=server.workdir, capture_output=True, text=True,
                             timeout=60, check=False).stdout.strip()
    replacements = {str(server.workdir): "/work/project", str(server.home): "/home/user",
                    server.base: "http://127.0.0.1:8000"}
    requests = []
    for e in server.recorder.api_calls():
        requests.append({"method": e.method, "path": e.path, "headers": e.headers, "body": e.body, "status": e.status,
                         **({"response": e.response} if e.status != 200 else {})})
        if any(marker in json.dumps(e.body) for marker in _TOOL_RESULT_MARKERS):
            break
    Path(out).mkdir(parents=True, exist_ok=True)
    doc = {"client": version.splitlines()[-1] if version else Path(client).name,
           "requests": sanitized(requests, replacements)}
    (Path(out) / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
