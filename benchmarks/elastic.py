"""Elastic GPU memory benchmark: decode while another process takes 10 GB of the GPU, then gives it back.

Protocol (CUDA only; dummy weights of ``--preset``'s geometry, ``--layers`` deep, so the expert pool is
``layers x experts`` rows; about 19 GB for 16 layers of Qwen3-30B-A3B; ``--policy fill-all``, so a
smaller cache means more host-to-device fills, not different math):

1. Load the engine with an empty expert cache, then start a *ballast* process that holds all of the
   GPU but the expert pool + ``--gpu-headroom-gb`` + ``--spare-gb``, so the expert cache competes for
   memory as on a shared personal GPU. Auto mode (``--gpu-budget auto``) then grows the cache to what
   the device leaves (``POST /admin/memory {"auto": true}`` does the same on a server).
2. Undisturbed run: ``--batch`` greedy requests of ``M`` tokens (``M`` from a calibration run: about
   ``--before-s + --hold-s + --after-s + 10`` seconds of decode).
3. Disturbed run, the same requests: after ``--before-s`` a second process allocates ``--grab-gb`` in
   ``--chunk-gb`` chunks (``torch.empty`` on the GPU, one every ``--chunk-interval-s``; a chunk that
   fails for lack of memory is retried every 50 ms), holds them ``--hold-s``, then frees them.

Recorded (JSON + markdown under ``--out``): failed requests (must be 0), greedy tokens identical to the
undisturbed run (must be true), tokens/s before / during (the grab held) / after (from the release,
and once the cache has grown back), the time to shrink (from the chunk that took the free memory below
the headroom to the engine's first shrink; and the time the grab took to be fully held), the time to
grow back after the release, the expert cache's size, the free memory, the hit rate, and the engine's
resize history.

    python benchmarks/elastic.py --out results/          # ~3 minutes on an H200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.config import EngineConfig
from edgemoe.engine.llm_engine import LLMEngine
from edgemoe.engine.sampling import SamplingParams

GB = 1e9

# A helper process: allocates GB on the GPU in chunks when told, holds them, frees them when told.
# Lines in: "grab" / "free"; lines out: "ready", "chunk T BYTES", "oom T BYTES", "held T BYTES", "freed T".
HOLDER = r"""
import sys, time, torch
total, chunk, interval = int(float(sys.argv[1])), int(float(sys.argv[2])), float(sys.argv[3])
dev = torch.device("cuda")
torch.empty(1, device=dev)
print("ready", flush=True)
held = []
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "grab":
        got = 0
        while got < total:
            n = min(chunk, total - got)
            try:
                held.append(torch.empty(n, dtype=torch.uint8, device=dev))
                got += n
                print(f"chunk {time.time()} {got}", flush=True)
                time.sleep(interval)
            except torch.OutOfMemoryError:
                print(f"oom {time.time()} {got}", flush=True)
                time.sleep(0.05)
        print(f"held {time.time()} {got}", flush=True)
    elif cmd == "free":
        held.clear()
        torch.cuda.empty_cache()
        print(f"freed {time.time()}", flush=True)
"""


class Holder:
    """A :data:`HOLDER` subprocess and its timestamped output lines."""

    def __init__(self, total_bytes: int, chunk_bytes: int, interval_s: float):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(total_bytes), str(chunk_bytes),
                                      str(interval_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.events: list[tuple[str, float, int]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def poll(self) -> list[tuple[str, float, int]]:
        """New events ``(kind, unix time, bytes)`` since the last call."""
        new = []
        while True:
            try:
                parts = self.lines.get_nowait().split()
            except queue.Empty:
                break
            if parts[0] == "ready":
                new.append(("ready", time.time(), 0))
            else:
                new.append((parts[0], float(parts[1]), int(parts[2]) if len(parts) > 2 else 0))
        self.events.extend(new)
        return new

    def wait_for(self, kind: str, timeout_s: float) -> tuple[str, float, int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.poll():
                if ev[0] == kind:
                    return ev
            if self.proc.poll() is not None:
                raise RuntimeError(f"the holder process exited ({self.proc.returncode}) before {kind!r}")
            time.sleep(0.01)
        raise TimeoutError(f"the holder process did not report {kind!r} within {timeout_s} s")

    def close(self) -> None:
        """End the process (its memory goes back to the device)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:  # still retrying a grab
                self.proc.kill()
                self.proc.wait(10)


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, on_step=None) -> tuple[list, list]:
    """Greedy ``max_tokens`` of every prompt, together. Returns (final outputs, per-step records
    ``(unix time, new tokens)``); ``on_step(now)`` runs before each step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    done, steps = {}, []
    while engine.has_unfinished_requests():
        if on_step is not None:
            on_step(time.time())
        new = 0
        for out in engine.step():
            new += len(out.outputs[0].delta_token_ids)
            if out.finished:
                done[out.request_id] = out
        steps.append((time.time(), new))
    return [done[i] for i in ids], steps


def rate(steps: list[tuple[float, int]], t0: float, t1: float) -> float | None:
    """Tokens/s of the steps that ended in ``[t0, t1)``."""
    inside = [(t, n) for t, n in steps if t0 <= t < t1]
    if len(inside) < 2:
        return None
    return sum(n for _, n in inside[1:]) / (inside[-1][0] - inside[0][0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint or config-only directory (default: write --preset's config)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--policy", default="fill-all",
                    help="expert policy (fill-all: every expert runs on the GPU whatever the cache size, so the "
                    "greedy tokens are bit-identical; qstar runs misses on the CPU, which rounds bf16 differently)")
    ap.add_argument("--gpu-headroom-gb", type=float, default=2.0)
    ap.add_argument("--spare-gb", type=float, default=1.0,
                    help="free memory beyond the expert pool and the headroom the ballast leaves")
    ap.add_argument("--grab-gb", type=float, default=10.0)
    ap.add_argument("--chunk-gb", type=float, default=0.5)
    ap.add_argument("--chunk-interval-s", type=float, default=0.05)
    ap.add_argument("--before-s", type=float, default=8.0)
    ap.add_argument("--hold-s", type=float, default=12.0)
    ap.add_argument("--after-s", type=float, default=12.0)
    ap.add_argument("--max-tokens", type=int, help="tokens per request (default: from a calibration run)")
    ap.add_argument("--out", default=".", help="folder for elastic.json and elastic.md")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/elastic.py needs a CUDA device", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model is None:
        from edgemoe.synth import write_config_only

        model = str(write_config_only(tempfile.mkdtemp(prefix="edgemoe-elastic-"), "qwen3_moe", a.preset,
                                      overrides={"num_hidden_layers": a.layers}))
    cfg = EngineConfig(device="cuda", load_format="dummy", expert_cache_slots=0, expert_policy=a.policy,
                       gpu_headroom_gb=a.gpu_headroom_gb, max_num_seqs=a.batch, max_model_len=4096,
                       kv_cache_tokens=a.batch * 4096, enable_prefix_caching=False)
    t0 = time.perf_counter()
    engine = LLMEngine.from_model_dir(model, cfg)
    load_s = time.perf_counter() - t0
    runner, mem = engine.runner, engine.runner.memory
    pool_bytes = runner.pool.num_ids * runner.pool.row_bytes
    print(runner.summary(), flush=True)

    # 1. ballast (and the grabber's CUDA context, started now so it is counted before the cache is sized),
    #    then auto mode fills what is left
    grabber = Holder(int(a.grab_gb * GB), int(a.chunk_gb * GB), a.chunk_interval_s)
    grabber.wait_for("ready", 120)
    free = mem.probe.sample().free_bytes
    ballast_bytes = max(0, int(free - pool_bytes - (a.gpu_headroom_gb + a.spare_gb) * GB
                               - mem.tuning.hysteresis_bytes // 2 - 0.6 * GB))  # 0.6 GB: the ballast's context
    ballast = Holder(ballast_bytes, max(1, ballast_bytes), 0.0)
    ballast.wait_for("ready", 120)
    if ballast_bytes:
        ballast.send("grab")
        ballast.wait_for("held", 120)
    mem.configure(auto=True)
    deadline, last, since = time.monotonic() + 30, -1, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 3 * mem.tuning.grow_hold_s:
        mem.tick()
        if runner.experts.cache.num_slots != last:
            last, since = runner.experts.cache.num_slots, time.monotonic()
        time.sleep(0.05)
    slots = runner.experts.cache.num_slots
    print(f"ballast {ballast_bytes / GB:.1f} GB; expert cache {slots} of {runner.pool.num_ids} slots "
          f"({slots * runner.pool.row_bytes / GB:.1f} GB); free {mem.probe.sample().free_bytes / GB:.1f} GB",
          flush=True)

    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    generate(engine, prompts, 16)  # warm-up: kernels compile, graphs capture
    if a.max_tokens is None:
        t = time.perf_counter()
        generate(engine, prompts, 48)
        per_req = 48 / (time.perf_counter() - t)
        max_tokens = int(min(4096 - a.prompt_len - 1, per_req * (a.before_s + a.hold_s + a.after_s + 10)))
    else:
        max_tokens = a.max_tokens
    print(f"{max_tokens} tokens per request", flush=True)

    # 2. undisturbed
    ref, ref_steps = generate(engine, prompts, max_tokens)

    # 3. disturbed
    start_slots = runner.experts.cache.num_slots
    hist_from = len(mem.history)
    stats_before = runner.expert_stats()
    marks: dict[str, float] = {}
    samples: list[tuple[float, int, int]] = []  # (time, free bytes, expert slots)

    def on_step(now: float) -> None:
        if mem.last_sample is not None and (not samples or samples[-1][0] < now - 0.1):
            samples.append((now, mem.last_sample.free_bytes, runner.experts.cache.num_slots))
        for kind, t, _ in grabber.poll():
            marks.setdefault(kind, t)  # the first of each kind: "chunk", "oom", "held", "freed"
        if "start" not in marks:
            marks["start"] = now
        elif "grab" not in marks and now - marks["start"] >= a.before_s:
            marks["grab"] = now
            grabber.send("grab")
        elif "held" in marks and "free" not in marks and now - marks["held"] >= a.hold_s:
            marks["free"] = now
            grabber.send("free")

    outs, steps = generate(engine, prompts, max_tokens, on_step)
    for kind, t, _ in grabber.poll():
        marks.setdefault(kind, t)
    grabber.close()
    ballast.close()
    history = list(mem.history)[hist_from:]
    stats_after = runner.expert_stats()

    failed = [o.request_id for o in outs if o.error is not None or o.outputs[0].finish_reason != "length"]
    identical = [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    shrinks = [h for h in history if h["reason"] == "pressure"]
    grows = [h for h in history if h["reason"] == "returned" and h["time"] >= marks.get("freed", math.inf)]
    regrown = grows[-1]["time"] if grows else None
    end = steps[-1][0]
    ph = {
        "before": rate(steps, marks["start"], marks.get("grab", end)),
        "during": rate(steps, marks["held"], marks.get("free", end)) if "held" in marks else None,
        "after": rate(steps, marks["freed"], end) if "freed" in marks else None,
        "after_regrown": rate(steps, regrown, end) if regrown is not None else None,
        "undisturbed": rate(ref_steps, ref_steps[0][0], ref_steps[-1][0] + 1e-9),
    }

    # the first chunk that took the free memory below the headroom (free before the grab - bytes held)
    free_at_grab = next((fr for t, fr, _ in reversed(samples) if t <= marks.get("grab", 0)), None)
    first_low = next((t for kind, t, held in grabber.events if kind == "chunk" and free_at_grab is not None
                      and free_at_grab - held < mem.headroom_bytes), None)
    pressure_to_shrink = next((h["time"] - first_low for h in shrinks if h["time"] >= first_low),
                              None) if first_low is not None else None

    def hits(s0: dict, s1: dict) -> float | None:
        d0, d1 = s0["decode"], s1["decode"]
        h, m = d1["hits"] - d0["hits"], d1["misses"] - d0["misses"]
        return h / (h + m) if h + m else None

    result = {
        "failed_requests": len(failed),
        "greedy_identical": identical,
        "tokens_per_request": max_tokens,
        "batch": a.batch,
        "tokens_per_s": ph,
        "grab_gb": a.grab_gb,
        "grab_held_s": marks["held"] - marks["grab"] if "held" in marks and "grab" in marks else None,
        "pressure_to_shrink_s": pressure_to_shrink,
        "refused_chunk_to_shrink_s": next((h["time"] - marks["oom"] for h in shrinks if h["time"] >= marks["oom"]),
                                          None) if "oom" in marks else None,
        "grab_start_to_first_shrink_s": shrinks[0]["time"] - marks["grab"] if shrinks and "grab" in marks else None,
        "release_to_regrown_s": regrown - marks["freed"] if regrown is not None and "freed" in marks else None,
        "expert_slots": {"start": start_slots, "min": min((s for _, _, s in samples), default=None),
                         "end": runner.experts.cache.num_slots, "total": runner.pool.num_ids},
        "expert_row_bytes": runner.pool.row_bytes,
        "min_free_gb": min((f for _, f, _ in samples), default=0) / GB,
        "decode_hit_rate_disturbed": hits(stats_before, stats_after),
        "resizes": history,
        "marks": marks,
        "grabber_events": grabber.events,
        "samples": samples,
    }
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "model": f"{a.preset}, {a.layers} layers, dummy weights",
        "expert_pool_gb": pool_bytes / GB,
        "ballast_gb": ballast_bytes / GB,
        "load_s": load_s,
        "probe": mem.probe.source,
        "args": vars(a),
    }
    (out / "elastic.json").write_text(json.dumps({"meta": meta, "result": result}, indent=2))

    def f(v, spec=".1f"):
        return "n/a" if v is None else format(v, spec)

    md = [
        f"# Elastic GPU memory: {meta['gpu']}, {meta['model']}",
        "",
        f"Expert pool {pool_bytes / GB:.1f} GB; batch {a.batch} x {max_tokens} greedy tokens; a second process "
        f"takes {a.grab_gb:g} GB in {a.chunk_gb:g} GB chunks after {a.before_s:g} s, holds {a.hold_s:g} s; "
        f"headroom {a.gpu_headroom_gb:g} GB; probe {meta['probe']}.",
        "",
        "| | value |",
        "|---|---|",
        f"| failed requests | {len(failed)} |",
        f"| greedy tokens identical to the undisturbed run | {identical} |",
        f"| tokens/s undisturbed | {f(ph['undisturbed'])} |",
        f"| tokens/s before | {f(ph['before'])} |",
        f"| tokens/s during (grab held) | {f(ph['during'])} |",
        f"| tokens/s after the release | {f(ph['after'])} |",
        f"| tokens/s once grown back | {f(ph['after_regrown'])} |",
        f"| grab fully held after (s) | {f(result['grab_held_s'], '.2f')} |",
        f"| free below the headroom to the first shrink (s) | {f(result['pressure_to_shrink_s'], '.2f')} |",
        f"| first refused chunk to the next shrink (s) | {f(result['refused_chunk_to_shrink_s'], '.2f')} |",
        f"| release to grown back (s) | {f(result['release_to_regrown_s'], '.2f')} |",
        f"| expert slots start / min / end (of {runner.pool.num_ids}) | {start_slots} / "
        f"{result['expert_slots']['min']} / {result['expert_slots']['end']} |",
        f"| min free memory sampled (GB) | {result['min_free_gb']:.2f} |",
        f"| resizes (pressure / returned) | {len(shrinks)} / "
        f"{sum(h['reason'] == 'returned' for h in history)} |",
    ]
    (out / "elastic.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if not failed and identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
