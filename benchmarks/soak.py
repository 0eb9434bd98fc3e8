"""Soak: concurrent multi-turn tool-calling agent sessions over the three APIs against a real server,
for a fixed duration, with a KV-cache audit and a resident-memory ceiling. Loopback only.

The server (the product's ``build_app`` under uvicorn, with its transport limits) runs in this process
on 127.0.0.1; ``--sessions`` client threads (default 8) each hold one conversation through a real SDK:
session ``i`` speaks OpenAI chat completions, Anthropic Messages or OpenAI Responses (``i % 3``),
streams every other turn, and offers two tools. Even turns force a tool call (``tool_choice``
``required`` / ``any``: the grammar engine makes even a random-weight model write a well-formed call,
whose arguments must parse and name a tool); the session then sends the call and a tool result back
(the next turn continues from it). Odd turns are ``auto`` (free text). After ``--turns-per-conversation``
turns a session starts a new conversation, so prompts stay within the context.

Checked, each a failure (exit status 1) when it does not hold:

- zero errors: every request answers 200 with the shape its API defines;
- KV audit after the run (engine idle): no sequence holds a page or a prefix-tree reference, every
  page is either free or held by the prefix tree, none in two places, and the free-page count equals
  the one before the run (unreferenced cached pages count as free, as the allocator sees them);
- resident memory: the peak RSS of this process after the first ``--warmup-s`` seconds stays under the
  RSS at the end of warm-up plus ``--rss-growth-mb``.

Writes ``soak.json`` under ``--out`` (counts, latencies, RSS, the audit) and prints a summary.

    python benchmarks/soak.py --duration-s 600 --out /tmp/soak           # the 10-minute record (CPU)
    python benchmarks/soak.py --duration-s 20 --out /tmp/soak            # the CPU test suite's run

Without ``--model`` it builds the tiny random-weight checkpoint (built-in tokenizer) in a temporary
directory; ``--device cuda`` runs the same on the GPU host.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.config import EngineConfig
from edgemoe.engine.async_engine import AsyncLLM
from edgemoe.server.app import build_app
from edgemoe.server.config import ServerConfig
from edgemoe.server.transport import uvicorn_config

APIS = ("chat", "messages", "responses")
TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]}},
    {"name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
]
QUESTIONS = ["What's the weather in Paris?", "Open README.md and summarize it.", "Is it raining in Oslo?",
             "Which tests cover the parser?", "Read setup.cfg, then tell me the version."]


def rss_mb() -> float:
    """Resident memory of this process (MB), from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import resource

    return pages * resource.getpagesize() / 1e6


def kv_audit(engine) -> dict:
    """The KV pool of an idle engine: page accounting (run on the engine thread)."""
    runner = engine.runner
    kv = runner.kv
    tree = kv.prefix_cache
    nodes = tree._nodes() if tree is not None else []
    owned = [p for seq, table in kv._pages.items() for p in table[kv._borrowed.get(seq, 0):]]
    cached = [p for n in nodes for p in n.pages]
    every = kv._free + owned + cached
    return {
        "free_pages": kv.free_pages,
        "pages": kv.num_pages,
        "sequences_holding_pages": len(kv._pages) - runner._scratch_pages,
        "owned_pages": len(owned) - runner._scratch_pages,
        "cached_pages": len(cached),
        "referenced_tree_nodes": sum(n.ref > 0 for n in nodes),
        "pages_in_two_places": len(every) - len(set(every)),
        "pages_lost": kv.num_pages - len(set(every)),
        "free_tokens_equal_capacity": runner.kv_free_tokens() == runner.kv_capacity_tokens,
    }


@contextmanager
def serving(model: str, engine_config: EngineConfig, server_config: ServerConfig):
    import uvicorn

    llm = AsyncLLM(model, engine_config, progress=False)
    try:
        assert llm.wait_ready(600), "the model did not load"
        server = uvicorn.Server(uvicorn_config(build_app(llm, server_config), server_config, log_level="warning",
                                               lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        try:
            yield llm, f"http://{server_config.host}:{server.servers[0].sockets[0].getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(30)
    finally:
        llm.shutdown()


class Session:
    """One agent conversation after another, over one API, until the deadline."""

    def __init__(self, index: int, base: str, model: str, args, stats: dict, lock: threading.Lock):
        import anthropic
        import openai

        self.index, self.api, self.model, self.args = index, APIS[index % 3], model, args
        self.rng = random.Random(index)
        self.openai = openai.OpenAI(base_url=base + "/v1", api_key="soak", max_retries=0, timeout=300)
        self.anthropic = anthropic.Anthropic(base_url=base, api_key="soak", max_retries=0, timeout=300)
        self.stats, self.lock = stats, lock

    def record(self, key: str, value=1) -> None:
        with self.lock:
            if isinstance(value, float):
                self.stats.setdefault(key, []).append(value)
            else:
                self.stats[key] = self.stats.get(key, 0) + value

    def run(self, deadline: float) -> None:
        turn = 0
        history: list = []
        while time.monotonic() < deadline:
            if turn % self.args.turns_per_conversation == 0:
                history = []
            if not history or self._last_is_answer(history):
                self._user(history, self.rng.choice(QUESTIONS))
            forced, stream = turn % 2 == 0, (turn // 2 + self.index) % 2 == 0
            start = time.monotonic()
            try:
                call = getattr(self, f"_{self.api}")(history, forced, stream)
                if forced and call is None:
                    raise AssertionError("a forced turn returned no tool call")
                self.record(f"requests_{self.api}")
                self.record("tool_calls" if call else "answers")
                self.record("latency_s", time.monotonic() - start)
            except Exception as exc:
                self.record("errors")
                with self.lock:
                    self.stats.setdefault("error_messages", []).append(f"{self.api} turn {turn}: {exc!r}"[:300])
                history = []
            turn += 1

    # ------------------------------------------------------------ conversation state per API

    def _last_is_answer(self, history: list) -> bool:
        last = history[-1]
        if self.api == "messages":
            return last["role"] == "assistant"
        if self.api == "chat":
            return last["role"] == "assistant" and not last.get("tool_calls")
        return last.get("type") == "message" and last.get("role") == "assistant"

    def _user(self, history: list, text: str) -> None:
        history.append({"role": "user", "content": text})

    def _result(self, name: str, args: dict) -> str:
        return json.dumps({"tool": name, "ok": True, "echo": args, "lines": self.rng.randint(1, 400)})

    @staticmethod
    def _check(name: str, arguments: str) -> dict:
        args = json.loads(arguments)
        tool = next(t for t in TOOLS if t["name"] == name)
        missing = set(tool["parameters"]["required"]) - set(args)
        if not isinstance(args, dict) or missing:
            raise AssertionError(f"{name} arguments {arguments!r} miss {missing}")
        return args

    def _chat(self, history: list, forced: bool, stream: bool):
        kw = {"model": self.model, "messages": history, "max_tokens": self.args.max_tokens, "temperature": 1.0,
              "tools": [{"type": "function", "function": t} for t in TOOLS],
              "tool_choice": "required" if forced else "auto"}
        content, calls = "", {}
        if stream:  # assembled from the deltas (the SDK's stream helper refuses a finish_reason "length")
            for chunk in self.openai.chat.completions.create(stream=True, **kw):
                delta = chunk.choices[0].delta if chunk.choices else None
                content += (delta.content or "") if delta else ""
                for tc in (delta.tool_calls or []) if delta else []:
                    c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
        else:
            msg = self.openai.chat.completions.create(**kw).choices[0].message
            content = msg.content or ""
            calls = {i: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for i, c in enumerate(msg.tool_calls or [])}
        if not calls:
            history.append({"role": "assistant", "content": content})
            return None
        call = calls[min(calls)]
        args = self._check(call["name"], call["arguments"])
        history.append({"role": "assistant", "content": content or None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]})
        history.append({"role": "tool", "tool_call_id": call["id"], "content": self._result(call["name"], args)})
        return call

    def _messages(self, history: list, forced: bool, stream: bool):
        kw = {"model": self.model, "max_tokens": self.args.max_tokens, "messages": history,
              "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                        for t in TOOLS], "tool_choice": {"type": "any" if forced else "auto"}}
        if stream:
            with self.anthropic.messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = self.anthropic.messages.create(**kw)
        uses = [b for b in msg.content if b.type == "tool_use"]
        content = [b.model_dump(exclude_none=True) for b in msg.content if b.type in ("text", "tool_use")]
        if not uses:
            history.append({"role": "assistant", "content": content or [{"type": "text", "text": "."}]})
            return None
        use = uses[0]
        self._check(use.name, json.dumps(use.input))
        history.append({"role": "assistant", "content": content})
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": self._result(use.name, use.input)}]})
        return use

    def _responses(self, history: list, forced: bool, stream: bool):
        kw = {"model": self.model, "input": history, "max_output_tokens": self.args.max_tokens, "temperature": 1.0,
              "tools": [{"type": "function", **t} for t in TOOLS], "tool_choice": "required" if forced else "auto"}
        if stream:  # the final response.completed / response.incomplete event
            r = None
            for event in self.openai.responses.create(stream=True, **kw):
                if event.type in ("response.completed", "response.incomplete"):
                    r = event.response
                elif event.type in ("error", "response.failed"):
                    raise AssertionError(f"stream failed: {event}")
            if r is None:
                raise AssertionError("the stream ended without its final response")
        else:
            r = self.openai.responses.create(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        if not calls:
            history.append({"type": "message", "role": "assistant", "content": r.output_text or "."})
            return None
        call = calls[0]
        args = self._check(call.name, call.arguments)
        history.append({"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments})
        history.append({"type": "function_call_output", "call_id": call.call_id,
                        "output": self._result(call.name, args)})
        return call


def run(args) -> dict:
    model = args.model
    tmp = None
    if model is None:
        from edgemoe.synth import make_model

        tmp = tempfile.TemporaryDirectory(prefix="edgemoe-soak-")
        model = str(make_model(Path(tmp.name) / "tiny", "qwen3_moe", "tiny", dtype="float32"))
    engine_config = EngineConfig(device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.sessions,
                                 kv_cache_tokens=args.kv_cache_tokens)
    server_config = ServerConfig(host="127.0.0.1", port=0, served_model_name=("soak",))
    stats: dict = {}
    lock = threading.Lock()
    try:
        with serving(model, engine_config, server_config) as (llm, base):
            before = llm.call_in_engine_thread(kv_audit, 60)
            start = time.monotonic()
            deadline = start + args.duration_s
            sessions = [Session(i, base, "soak", args, stats, lock) for i in range(args.sessions)]
            threads = [threading.Thread(target=s.run, args=(deadline,)) for s in sessions]
            for t in threads:
                t.start()
            rss_warm, rss_peak = None, 0.0
            while any(t.is_alive() for t in threads):
                time.sleep(0.5)
                now = rss_mb()
                if rss_warm is None and time.monotonic() - start >= args.warmup_s:
                    rss_warm = now
                if rss_warm is not None:
                    rss_peak = max(rss_peak, now)
            for t in threads:
                t.join()
            elapsed = time.monotonic() - start
            idle_deadline = time.monotonic() + 30
            while llm.num_unfinished and time.monotonic() < idle_deadline:
                time.sleep(0.05)
            after = llm.call_in_engine_thread(kv_audit, 60)
            rss_warm = rss_warm if rss_warm is not None else rss_mb()
    finally:
        if tmp is not None:
            tmp.cleanup()
    latencies = sorted(stats.get("latency_s", []))
    requests = {api: stats.get(f"requests_{api}", 0) for api in APIS}
    audit_ok = (after["free_pages"] == before["free_pages"] and after["sequences_holding_pages"] == 0
                and after["owned_pages"] == 0 and after["referenced_tree_nodes"] == 0
                and after["pages_in_two_places"] == 0 and after["pages_lost"] == 0
                and after["free_tokens_equal_capacity"])
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), device {args.device}",
        "command": "python benchmarks/soak.py " + " ".join(args.argv),
        "duration_s": round(elapsed, 1),
        "sessions": args.sessions,
        "requests": requests,
        "requests_total": sum(requests.values()),
        "tool_calls": stats.get("tool_calls", 0),
        "answers": stats.get("answers", 0),
        "errors": stats.get("errors", 0),
        "error_messages": stats.get("error_messages", [])[:20],
        "latency_s": {"p50": round(statistics.median(latencies), 3) if latencies else None,
                      "p95": round(latencies[int(0.95 * (len(latencies) - 1))], 3) if latencies else None,
                      "max": round(latencies[-1], 3) if latencies else None},
        "rss_mb": {"warm": round(rss_warm, 1), "peak": round(rss_peak, 1),
                   "ceiling": round(rss_warm + args.rss_growth_mb, 1)},
        "kv_before": before,
        "kv_after": after,
        "kv_audit_ok": audit_ok,
    }
    result["ok"] = (result["errors"] == 0 and audit_ok and rss_peak <= rss_warm + args.rss_growth_mb
                    and all(requests.values()))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: build the tiny one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--duration-s", type=float, default=600.0, help="how long the sessions run (default 600)")
    ap.add_argument("--sessions", type=int, default=8, help="concurrent sessions (default 8)")
    ap.add_argument("--turns-per-conversation", type=int, default=8, help="turns before a session starts over")
    ap.add_argument("--max-tokens", type=int, default=64, help="output cap per turn")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-tokens", type=int, default=None, help="KV capacity (default: max-model-len)")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="RSS baseline after this long (default 10%% of the run)")
    ap.add_argument("--rss-growth-mb", type=float, default=512.0, help="allowed RSS growth after warm-up (MB)")
    ap.add_argument("--out", default=None, help="directory for soak.json")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.warmup_s is None:
        args.warmup_s = 0.1 * args.duration_s
    result = run(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"soak: {result['duration_s']} s, {result['sessions']} sessions, requests {result['requests']} "
          f"({result['tool_calls']} tool calls, {result['answers']} answers), errors {result['errors']}, "
          f"latency p50 {result['latency_s']['p50']} s p95 {result['latency_s']['p95']} s, "
          f"RSS warm {result['rss_mb']['warm']} MB peak {result['rss_mb']['peak']} MB, "
          f"KV audit {'ok' if result['kv_audit_ok'] else 'FAILED'}: {result['kv_after']}")
    for line in result["error_messages"]:
        print("  error:", line)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
