"""Per-token cost of structured output (the llguidance grammar) on the decode path.

Two measurements, each for three grammars of the server (``json_object``: any JSON object; ``schema``:
a Pydantic model's JSON schema with nested objects, an enum and an array; ``tool_call``: a Qwen3
forced tool call whose arguments follow a schema):

- ``processor``: the logits processor alone, per call (advance the matcher over the new token,
  compute the token mask, mask the ``[V]`` logits row, the closing policy's rollouts included),
  driven by random logits and sampled tokens, ``--tokens`` tokens per grammar;
- ``decode``: the engine's decode step with and without the processor, ``--batch`` requests decoding
  together (``LLMEngine.step`` wall time of the steps that decode the whole batch: prefill steps and
  the tail where constrained requests already ended are left out), on a random-weight checkpoint of
  the tiny geometry with the real tokenizer (so the LM head and the mask have the real vocabulary width).

The overhead is ``decode`` with the grammar minus without, per step. Writes ``structured_output.json``
and ``structured_output.md`` under ``--out``.

    python benchmarks/structured_output.py --tokenizer ../shared/fixtures/tokenizers/qwen3 --out /tmp/so   # CPU
    python benchmarks/structured_output.py --tokenizer ../shared/fixtures/tokenizers/qwen3 --device cuda \\
        --out $OUT/structured_output                                                                    # GPU host
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.config import EngineConfig
from edgemoe.engine.llm import render_chat
from edgemoe.engine.llm_engine import LLMEngine
from edgemoe.engine.sampling import SamplingParams
from edgemoe.server.parsers.qwen3 import Qwen3ToolParser
from edgemoe.server.structured import Grammar, GrammarLogitsProcessor, GrammarVocab

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
TOOL_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}


def grammars(vocab: GrammarVocab) -> dict[str, Grammar]:
    prefix, suffix = Qwen3ToolParser.forced_call("get_weather")
    return {
        "json_object": Grammar.json_schema(None, "response_format"),
        "schema": Grammar.json_schema(SCHEMA, "response_format"),
        "tool_call": Grammar.tool_calls([vocab.call(prefix, TOOL_PARAMETERS, suffix)]),
    }


def time_processor(vocab: GrammarVocab, grammar: Grammar, tokens: int, vocab_size: int, seed: int) -> dict:
    """Per-call times of the processor over outputs of up to ``tokens`` tokens (new outputs until done)."""
    gen = torch.Generator().manual_seed(seed)
    times, outputs = [], 0
    while len(times) < tokens:
        proc, out = GrammarLogitsProcessor(grammar, vocab), []
        budget = min(256, tokens - len(times) + 16)
        for _ in range(budget):
            logits = torch.randn(vocab_size, generator=gen)
            t = time.perf_counter()
            logits = proc(out, logits, budget)
            times.append(time.perf_counter() - t)
            tok = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
            out.append(tok)
            if tok in vocab.eos:
                break
        outputs += 1
    return {"calls": len(times), "outputs": outputs, "mean_ms": 1e3 * statistics.fmean(times),
            "p50_ms": 1e3 * statistics.median(times), "p95_ms": 1e3 * sorted(times)[int(0.95 * (len(times) - 1))]}


def time_decode(engine: LLMEngine, prompt: list[int], batch: int, tokens: int, make_proc) -> dict:
    """Mean wall time of the decode steps of ``batch`` requests generating ``tokens`` tokens each."""
    for i in range(batch):
        procs = [make_proc()] if make_proc is not None else []
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt,
                           SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=make_proc is None,
                                          logits_processors=procs))
    steps = []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = len(running) == batch and all(r.prefill_done for r in running)  # a decode step of the whole batch
        t = time.perf_counter()
        engine.step()
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        if full:
            steps.append(time.perf_counter() - t)
    return {"steps": len(steps), "mean_step_ms": 1e3 * statistics.fmean(steps) if steps else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the built-in tiny tokenizer)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=400, help="processor calls per grammar")
    ap.add_argument("--decode-tokens", type=int, default=96, help="tokens per request in the decode runs")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="decode batch sizes")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the tiny model gains nothing from more, and OpenMP "
                         "spin-waiting on a busy machine distorts small ops)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from edgemoe.synth import make_model

    with tempfile.TemporaryDirectory(prefix="edgemoe-so-") as tmp:
        model = make_model(Path(tmp) / "tiny", "qwen3_moe", "tiny", dtype="float32",
                           tokenizer=Path(args.tokenizer) if args.tokenizer else None)
        engine = LLMEngine.from_model_dir(str(model), EngineConfig(device=args.device, max_model_len=2048),
                                          progress=False)
        tok = engine.tokenizer
        vocab_size = int(engine.runner.model_config.vocab_size)
        t = time.perf_counter()
        vocab = GrammarVocab(tok, vocab_size, engine.eos_token_ids)
        vocab_s = time.perf_counter() - t
        gs = grammars(vocab)
        processor = {name: time_processor(vocab, g, args.tokens, vocab_size, seed=1) for name, g in gs.items()}
        _, prompt = render_chat(tok, [{"role": "user", "content": "Describe a person as JSON."}])
        decode = {}
        for batch in args.batch:
            time_decode(engine, prompt, batch, 8, None)  # warm-up
            row = {"none": time_decode(engine, prompt, batch, args.decode_tokens, None)}
            for name, g in gs.items():
                row[name] = time_decode(engine, prompt, batch, args.decode_tokens,
                                        lambda g=g: GrammarLogitsProcessor(g, vocab))
            decode[batch] = row
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch "
                   f"threads, device {args.device}"
                   + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""),
        "command": "python benchmarks/structured_output.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "vocab_size": vocab_size,
        "vocab_build_s": vocab_s,
        "processor": processor,
        "decode": decode,
    }
    lines = [f"Vocabulary {vocab_size} tokens (grammar vocabulary built in {vocab_s:.1f} s, once per tokenizer).", "",
             "| grammar | processor mean ms/token | p50 | p95 |", "|---|---|---|---|"]
    lines += [f"| {n} | {p['mean_ms']:.3f} | {p['p50_ms']:.3f} | {p['p95_ms']:.3f} |" for n, p in processor.items()]
    lines += ["", "| batch | grammar | decode step ms | overhead ms/step |", "|---|---|---|---|"]
    for batch, row in decode.items():
        base = row["none"]["mean_step_ms"]
        for name, r in row.items():
            over = "" if name == "none" else f"{r['mean_step_ms'] - base:+.2f}"
            lines.append(f"| {batch} | {name} | {r['mean_step_ms']:.2f} | {over} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "structured_output.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "structured_output.md").write_text(
            f"{result['date']}, {result['machine']}\n\n`{result['command']}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
