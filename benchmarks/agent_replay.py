"""Agentic replay benchmark: prefix reuse and TTFT per turn of multi-turn agent sessions on a hybrid
(gated DeltaNet) model, with recurrent-state checkpoints at anchors, at intervals only, or none.

A hybrid model resumes a cached prefix only from a saved recurrent state. Agent
harnesses edit their context between turns, so what matters is whether a checkpoint survives just
before each edit. Three sessions, shaped like the paper's agentic workloads:

- ``w2``: a coding agent, 3 turns (model calls): read a file, run the tests, answer; the harness
  truncates old tool outputs (every tool output but the latest keeps only its head).
- ``w4``: an email/calendar agent, 13 turns over 5 user requests with a ~24.5k-token system prompt;
  the harness strips the thinking blocks of assistant turns before the latest user request.
- ``cut``: a log-analysis agent, 3 turns (fetch a long log, fetch metrics, answer); the harness cuts
  old tool outputs in the middle of their block (keeps 55 %: no anchor near the cut).

Each turn renders the harness's message list with the model's chat template and generates the
scripted assistant reply (thinking, then a tool call or an answer): the reply's tokens, as the
template renders them, are forced through a logits processor (``max_tokens`` = their count), so every
mode sees the same prompts and the next turn's prompt extends what the model produced. Content is
synthetic (seeded random words). Modes: ``anchors`` (checkpoints after ``</think>``,
``</tool_call>``, ``</tool_response>``, ``<|im_end|>`` and every ``--interval`` tokens),
``interval`` (``--no-anchor-checkpoints``: every ``--interval`` tokens only), ``none``
(``--state-checkpoints 0``: a hybrid model reuses nothing). Each mode starts with an empty prefix
cache and no checkpoints; the model is loaded once.

Per turn: prompt tokens, the prefix it shares with what earlier turns computed (the most any cache
could reuse), tokens reused (``cached_tokens``), tokens re-prefilled, TTFT; and the reuse the mode's
checkpoint positions allow (``bound``: the deepest anchor or interval position within the shared
prefix), which an uncontended checkpoint store reaches exactly. Writes ``agent_replay.json`` and
``agent_replay.md`` under ``--out``.

    python benchmarks/agent_replay.py --out results/          # GPU host: Qwen3.6-35B-A3B geometry, dummy weights
    python benchmarks/agent_replay.py --preset qwen3.5-moe-tiny --device cpu --dtype float32 \\
        --cpu-executor torch --scale 0.01 --reply-scale 0.1 --interval 32 --out /tmp/agent   # CPU smoke (CI)

Replies are decoded (forced), which costs run time but no TTFT: ``--reply-scale`` (default 0.5) sets
their length. Dummy weights route unlike a trained model, so TTFT is this engine's prefill cost under
that routing; the reuse counts do not depend on the weights.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.engine.llm import LLM, render_chat
from edgemoe.engine.sampling import SamplingParams
from edgemoe.kvcache.state_checkpoints import anchor_token_ids, checkpoint_positions

SESSIONS = ("w2", "w4", "cut")
MODES = ("anchors", "interval", "none")

_WORDS = """
the a of to and in is that for it as with on by this be are from at or an was not but all can have
which will one more when they their there if so about what up out into time only new some could
these two may then first any like other than now also most over such after where much through
cache expert layer token router prefill decode memory bandwidth device host transfer slot page
meeting calendar invoice email project review deadline budget team client report schedule draft
follow reply attach note summary travel flight hotel agenda quarterly update status launch plan
function value error test build module import return class file path line branch commit merge
request response server latency queue retry timeout config option default parameter result
""".split()

_INSTRUCTIONS = ("Answer precisely. Prefer calling a tool over guessing. Keep private data private. "
                 "Summarize long outputs before acting on them.")


class Synth:
    """Seeded synthetic text of about a given length in tokens of ``tokenizer``."""

    def __init__(self, tokenizer, seed: int):
        self.rng = random.Random(seed)
        self.tokenizer = tokenizer

    def _sized(self, n_tokens: float, render) -> str:
        """``render(n_words)``, with the word count corrected once so the text has ~``n_tokens`` tokens."""
        n_words = max(1, round(n_tokens / 2))
        for _ in range(2):
            out = render(n_words)
            have = len(self.tokenizer.encode(out, add_special_tokens=False))
            if abs(have - n_tokens) <= 0.02 * n_tokens:
                break
            n_words = max(1, round(n_words * n_tokens / have))
        return out

    def _words(self, n: int) -> list[str]:
        return [self.rng.choice(_WORDS) for _ in range(n)]

    def text(self, n_tokens: float) -> str:
        """Sentences of random words."""
        def render(n: int) -> str:
            words = self._words(n)
            return " ".join(" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, n, 12))

        return self._sized(n_tokens, render)

    def lines(self, n_tokens: float, prefix: str) -> str:
        """Numbered lines of random words (a file listing, a log)."""
        def render(n: int) -> str:
            words = self._words(n)
            return "\n".join(f"{prefix}{i // 8 + 1:04d} " + " ".join(words[i:i + 8]) for i in range(0, n, 8))

        return self._sized(n_tokens, render)


def _tool(name: str, description: str, **params: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                        for k, v in params.items()},
                       "required": list(params)}}}


def _reply(reasoning: str, content: str = "", call: tuple[str, dict] | None = None) -> dict:
    msg = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if call is not None:
        msg["tool_calls"] = [{"type": "function", "function": {"name": call[0], "arguments": call[1]}}]
    return msg


# ---------------------------------------------------------------- harness edits of the message list

def truncate_old_tool_outputs(messages: list[dict], keep_chars: int) -> list[dict]:
    """Every tool output but the latest keeps only its first ``keep_chars`` characters (W2's harness)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "tool"), default=-1)
    return [{**m, "content": m["content"][:keep_chars] + "\n[... output truncated ...]"}
            if m["role"] == "tool" and i != last else m for i, m in enumerate(messages)]


def strip_old_thinking(messages: list[dict]) -> list[dict]:
    """Assistant turns before the latest user message lose their thinking block (W4's harness)."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return [{k: v for k, v in m.items() if k != "reasoning_content"}
            if m["role"] == "assistant" and i < last_user else m for i, m in enumerate(messages)]


def cut_old_tool_outputs(messages: list[dict], fraction: float) -> list[dict]:
    """Every tool output but the latest is cut in the middle of its block, keeping its first
    ``fraction`` (the ``cut`` harness: compaction that keeps most of a long output)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "tool"), default=-1)
    return [{**m, "content": m["content"][:int(len(m["content"]) * fraction)] + "\n[... cut ...]"}
            if m["role"] == "tool" and i != last else m for i, m in enumerate(messages)]


@dataclass
class Session:
    """A scripted session: ``steps`` are ``(reply, messages after it)``; turn ``k``'s prompt is
    ``harness(history)`` where history holds the system and first user message, then every earlier
    step's reply and following messages."""

    name: str
    tools: list[dict]
    start: list[dict]
    steps: list[tuple[dict, list[dict]]]
    harness: object


def build_session(name: str, synth: Synth, scale: float, reply_scale: float) -> Session:
    """The ``w2``, ``w4`` or ``cut`` session at ``scale`` (content sizes; 1.0 = the paper's shape) with
    replies at ``reply_scale`` (thinking ~64, answers ~48 tokens at 1.0)."""
    s, r = scale, reply_scale
    think = lambda: synth.text(64 * r)  # noqa: E731
    answer = lambda: synth.text(48 * r)  # noqa: E731
    if name == "w2":
        tools = [_tool("read_file", "Read a file of the repository", path="file path"),
                 _tool("run_tests", "Run the test suite", target="test selector"),
                 _tool("edit_file", "Replace text in a file", path="file path", patch="unified diff")]
        start = [{"role": "system",
                  "content": "You are a coding agent. " + _INSTRUCTIONS + "\n" + synth.text(6000 * s)},
                 {"role": "user", "content": "Fix the failing cache test. " + synth.text(150 * s)}]
        steps = [
            (_reply(think(), call=("read_file", {"path": "edgemoe/experts/cache.py"})),
             [{"role": "tool", "content": synth.lines(4000 * s, "L")}]),
            (_reply(think(), call=("run_tests", {"target": "tests/test_cache.py"})),
             [{"role": "tool", "content": synth.lines(2500 * s, "T")}]),
            (_reply(think(), answer()), []),
        ]
        return Session(name, tools, start, steps, lambda m: truncate_old_tool_outputs(m, max(40, int(600 * s))))
    if name == "w4":
        tools = [_tool("search_email", "Search the mailbox", query="search terms"),
                 _tool("read_email", "Read one email", id="message id"),
                 _tool("list_events", "List calendar events", day="ISO date"),
                 _tool("create_event", "Create a calendar event", title="title", start="ISO time")]
        start = [{"role": "system", "content": "You are an email and calendar assistant. " + _INSTRUCTIONS + "\n"
                  + synth.text(24500 * s)},
                 {"role": "user", "content": synth.text(60 * s) + "?"}]
        steps = []
        calls = [3, 2, 3, 2, 3]  # model calls per user request: 13 turns
        for req, n in enumerate(calls):
            for j in range(n):
                if j < n - 1:
                    tool = tools[(req + j) % len(tools)]["function"]["name"]
                    steps.append((_reply(think(), call=(tool, {"query": f"r{req}.{j}"})),
                                  [{"role": "tool", "content": synth.lines(400 * s, "R")}]))
                else:
                    nxt = [{"role": "user", "content": synth.text(60 * s) + "?"}] if req < len(calls) - 1 else []
                    steps.append((_reply(think(), answer()), nxt))
        return Session(name, tools, start, steps, strip_old_thinking)
    if name == "cut":
        tools = [_tool("fetch_log", "Fetch a service log", service="service name"),
                 _tool("fetch_metrics", "Fetch a service's metrics", service="service name")]
        start = [{"role": "system",
                  "content": "You are an operations agent. " + _INSTRUCTIONS + "\n" + synth.text(3000 * s)},
                 {"role": "user", "content": "Why did the service restart? " + synth.text(80 * s)}]
        steps = [
            (_reply(think(), call=("fetch_log", {"service": "edgemoe"})),
             [{"role": "tool", "content": synth.lines(6000 * s, "2026-11-30T12:00:")}]),
            (_reply(think(), call=("fetch_metrics", {"service": "edgemoe"})),
             [{"role": "tool", "content": synth.lines(300 * s, "M")}]),
            (_reply(think(), answer()), []),
        ]
        return Session(name, tools, start, steps, lambda m: cut_old_tool_outputs(m, 0.55))
    raise ValueError(f"unknown session {name!r}; choose from {SESSIONS}")


def render_turns(session: Session, tokenizer) -> list[tuple[list[int], list[int]]]:
    """Per turn ``(prompt ids, reply ids)``: the reply's tokens as the template renders it after the
    prompt, through its ``<|im_end|>`` (what the model must generate for the next prompt to extend it).

    Raises:
        ValueError: the template does not render the reply as a continuation of the prompt.
    """
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    history, turns = list(session.start), []
    for reply, after in session.steps:
        msgs = session.harness(history)
        _, prompt = render_chat(tokenizer, msgs, tools=session.tools)
        _, full = render_chat(tokenizer, msgs + [reply], tools=session.tools, add_generation_prompt=False)
        if full[:len(prompt)] != prompt or im_end not in full[len(prompt):]:
            raise ValueError(f"session {session.name}: the chat template does not render the reply after the prompt")
        rest = full[len(prompt):]
        turns.append((prompt, rest[:rest.index(im_end) + 1]))
        history += [reply, *after]
    return turns


def forced(script: list[int]):
    """A logits processor that allows only ``script[len(output)]`` (the scripted reply)."""

    def proc(output_ids: list[int], logits: torch.Tensor, max_tokens) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[script[len(output_ids)]] = 0.0
        return out

    return proc


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    diff = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(diff[0]) if len(diff) else n


def run_mode(llm: LLM, turns: list[tuple[list[int], list[int]]], mode: str, slots: int, interval: int) -> list[dict]:
    """Replay ``turns`` under ``mode`` from an empty prefix cache; one record per turn."""
    runner = llm.runner
    tree = runner.kv.prefix_cache
    tree.evict(tree.num_pages)  # idle: every cached page is unreferenced
    runner.set_state_checkpoints(0 if mode == "none" else slots, interval, anchors=mode == "anchors")
    anchors = runner.prefix.anchor_ids if mode == "anchors" else frozenset()
    computed: list[list[int]] = []  # token sequences earlier turns computed (prompt + output but the last)
    records = []
    for k, (prompt, reply) in enumerate(turns):
        params = SamplingParams(max_tokens=len(reply), temperature=0.0, ignore_eos=True,
                                logits_processors=[forced(reply)])
        out = llm.generate([prompt], params)[0]
        if out.error or out.outputs[0].token_ids != reply:
            raise RuntimeError(f"turn {k}: the scripted reply was not generated ({out.error})")
        shared = min(max((_common(prompt, c) for c in computed), default=0), len(prompt) - 1)
        due = [0] + checkpoint_positions(prompt[:shared], 0, anchors, interval if mode != "none" else 0)
        records.append({
            "turn": k + 1, "prompt_tokens": len(prompt), "output_tokens": len(reply), "shared_prefix": shared,
            "bound": due[-1] if mode != "none" else 0,
            "reused": out.cached_tokens, "prefilled": len(prompt) - out.cached_tokens, "ttft_s": out.metrics.ttft,
        })
        computed.append(prompt + reply[:-1])
    return records


def _markdown(results: dict, modes: list[str]) -> str:
    """One table per session: per turn the prompt, the shared prefix, and per mode tokens reused,
    re-prefilled and TTFT; then the totals and the worst TTFT."""
    lines = []
    all_modes = modes
    for name, res in results.items():
        modes = [m for m in all_modes if m in res]  # a run cut short has only some modes
        if not modes:
            continue
        lines += [f"### {name}", "",
                  "| turn | prompt | shared | "
                  + " | ".join(f"{m}: reused | prefilled | TTFT (s)" for m in modes) + " |",
                  "|---|---|---|" + "---|---|---|" * len(modes)]
        for rows in zip(*(res[m]["turns"] for m in modes)):
            cells = " | ".join(f"{r['reused']} | {r['prefilled']} | {r['ttft_s']:.3f}" for r in rows)
            lines.append(f"| {rows[0]['turn']} | {rows[0]['prompt_tokens']} | {rows[0]['shared_prefix']} | {cells} |")
        total = " | ".join(f"**{res[m]['reused']}** | **{res[m]['prefilled']}** | "
                           f"worst **{res[m]['worst_ttft_s']:.3f}**" for m in modes)
        lines += [f"| all | {res[modes[0]]['prompt_tokens']} | | {total} |", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint or config-only directory (default: write --preset's config)")
    ap.add_argument("--preset", default="qwen3.6-35b-a3b", help="qwen3_5_moe preset for the config-only directory")
    ap.add_argument("--tokenizer", help="tokenizer directory for the config-only model (default: the built-in one)")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--expert-cache-gb", type=float, help="expert-cache budget (default: free GPU memory)")
    ap.add_argument("--cpu-threads", type=int)
    ap.add_argument("--cpu-executor", default="auto", choices=["auto", "native", "torch"])
    ap.add_argument("--max-model-len", type=int,
                    help="context length (default: the model's, at most 65536)")
    ap.add_argument("--sessions", default=",".join(SESSIONS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--checkpoints", type=int, default=32, help="state checkpoint slots (anchors and interval modes)")
    ap.add_argument("--interval", type=int, default=2048, help="tokens between interval checkpoints")
    ap.add_argument("--scale", type=float, default=1.0, help="content sizes (system prompts, tool outputs)")
    ap.add_argument("--reply-scale", type=float, default=0.5,
                    help="reply sizes (1.0: thinking ~64, answers ~48 tokens; decoded, so they cost run time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=".", help="folder for agent_replay.json and agent_replay.md")
    a = ap.parse_args(argv)
    sessions, modes = a.sessions.split(","), a.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {MODES}")

    model = a.model
    if model is None:
        from edgemoe.synth import write_config_only

        model = write_config_only(tempfile.mkdtemp(prefix="edgemoe-agent-"), "qwen3_5_moe", a.preset, a.tokenizer)
    from edgemoe.models import load_config

    max_model_len = a.max_model_len or min(65536, load_config(model).context_length())
    t0 = time.perf_counter()
    llm = LLM(str(model), device=a.device, dtype=a.dtype, load_format=a.load_format, expert_cache_gb=a.expert_cache_gb,
              cpu_threads=a.cpu_threads, cpu_executor=a.cpu_executor, max_model_len=max_model_len,
              state_checkpoints=a.checkpoints,
              state_checkpoint_interval=a.interval, progress=False)
    load_s = time.perf_counter() - t0
    runner = llm.runner
    print(runner.summary(), flush=True)
    if runner.state is None:
        raise SystemExit(f"{runner.model_config.architecture} has no recurrent state: nothing to checkpoint")
    # warm-up (kernels compile, cuBLAS, the expert cache), kept out of every mode's measurements
    warm = Synth(llm.tokenizer, a.seed + 1)
    llm.generate([llm.tokenizer.encode(warm.text(512))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    results: dict[str, dict] = {}
    for name in sessions:
        turns = render_turns(build_session(name, Synth(llm.tokenizer, a.seed), a.scale, a.reply_scale), llm.tokenizer)
        results[name] = {}
        for mode in modes:
            t = time.perf_counter()
            rows = run_mode(llm, turns, mode, a.checkpoints, a.interval)
            ck = runner.prefix.checkpoints
            results[name][mode] = {
                "turns": rows,
                "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                "reused": sum(r["reused"] for r in rows),
                "prefilled": sum(r["prefilled"] for r in rows),
                "worst_ttft_s": max(r["ttft_s"] for r in rows),
                "checkpoints_saved": 0 if ck is None else ck.saved,
                "checkpoints_evicted": 0 if ck is None else ck.evicted,
                "wall_s": time.perf_counter() - t,
            }
            r = results[name][mode]
            print(f"{name:4s} {mode:8s} turns {len(rows):2d}  prompt {r['prompt_tokens']:7d}  reused {r['reused']:7d}  "
                  f"prefilled {r['prefilled']:7d}  worst TTFT {r['worst_ttft_s']:.3f} s  ({r['wall_s']:.1f} s)",
                  flush=True)
            _write(a, argv, runner, llm, load_s, results, modes)  # after every run: a timeout keeps what finished
    table = _write(a, argv, runner, llm, load_s, results, modes)
    print(table)
    return 0


def _write(a, argv, runner, llm, load_s, results, modes) -> str:
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "torch": torch.__version__},
        "model": runner.model_config.architecture, "preset": a.preset if a.model is None else a.model,
        "load_s": load_s, "decode_path": runner.experts.decode_path,
        "expert_cache_slots": runner.experts.cache.num_slots,
        "experts_total": runner.pool.num_ids, "checkpoints": a.checkpoints, "interval": a.interval,
        "scale": a.scale, "reply_scale": a.reply_scale,
        "anchor_ids": sorted(anchor_token_ids(llm.tokenizer, runner.eos_token_ids)),
        "page_size": runner.kv.page_size,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agent_replay.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    table = _markdown(results, modes)
    (out / "agent_replay.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
