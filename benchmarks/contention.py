"""Contention benchmark: decode while another process takes PCIe or DRAM bandwidth, then gives it back.

The miss policies split a decode step's cache misses between host-to-GPU fills (PCIe) and the CPU
executor (DRAM) from bandwidths measured at start-up. On a personal machine other programs take both
links at times: a game or a second model streaming textures or weights to the GPU, a build or a browser
reading memory. This measures how each policy's decode rate follows such a change and comes back after it.

Protocol (CUDA; dummy weights of ``--preset``'s geometry, uniform routing by default: no locality, so the
CPU branch and the fills both carry misses, the regime where the split matters). Per hog and policy:
``--batch`` random prompts are prefilled and decoded for ``--before-s`` seconds undisturbed, then a second
process starts its load for ``--during-s`` seconds and stops, then ``--after-s`` more seconds. Hogs:

- ``pcie``: a CUDA process copying a pinned host buffer (``--pcie-mb``) to the GPU in a loop (the
  copy engine, the direction of the fills);
- ``dram``: a CPU process copying a ``--dram-mb`` buffer in ``--dram-threads`` threads (torch's own
  parallel copy), pinned to the cores the engine leaves free (neither the executor's pinned cores nor
  core 0, where the Python and driver threads run), so it takes memory bandwidth, not cores; when the
  executor holds every core but core 0 there are none, and the load runs on the executor's cores (it
  then takes cores as well: ``dram_shares_cores`` in the results).

Recorded (``contention.json``, ``contention.md``): tokens/s before, in the load's first second, for the
rest of the load, in the first second after it and for the rest; the hog's own bandwidth; tokens/s in
``--bin-s`` bins; and for ``auto`` the balance controller's CPU cost level (``AutoPolicy.cpu_level``)
at each step, with the time from the load's start (and stop) until the rate is within 10 % of its
steady value for that phase.

    python benchmarks/contention.py --budget 2 --cpu-threads 6 --out results/     # ~4 minutes on an H200
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import add_model_args, model_dir, route_from_trace, route_uniformly

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts.bandwidth import bandwidths_from_profile, measure
from edgemoe.experts.native import physical_core_cpus
from edgemoe.experts.policy import AutoPolicy

# The load processes: print "ready" once set up, start on a "go" line, stop on "stop", then print "done GB/s".
HOG_PRELUDE = r"""
import os, sys, threading, time, torch
stop = threading.Event()
def wait_stop():
    sys.stdin.readline()
    stop.set()
"""
HOGS = {
    "pcie": HOG_PRELUDE + r"""
n = int(float(sys.argv[1]))
src = torch.empty(n, dtype=torch.uint8).pin_memory()
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
dst.copy_(src); torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=wait_stop, daemon=True).start()
moved, t0 = 0, time.perf_counter()
while not stop.is_set():
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize(); moved += n
print(f"done {moved / (time.perf_counter() - t0) / 1e9:.2f}", flush=True)
""",
    "dram": HOG_PRELUDE + r"""
n, threads, cpus = int(float(sys.argv[1])), int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")]
os.sched_setaffinity(0, cpus)
torch.set_num_threads(threads)
a = torch.ones(n // 4, dtype=torch.float32); b = torch.empty_like(a); b.copy_(a)
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=wait_stop, daemon=True).start()
moved, t0 = 0, time.perf_counter()
while not stop.is_set():
    b.copy_(a); moved += 2 * n  # read + write
print(f"done {moved / (time.perf_counter() - t0) / 1e9:.2f}", flush=True)
""",
}


class Hog:
    """A load process of :data:`HOGS` (started at construction, set up before it returns)."""

    def __init__(self, kind: str, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-c", HOGS[kind], *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"the {kind} load process did not start (said {line!r})")

    def send(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Tell the load to stop (returns at once: the decode loop goes on while the process winds down)."""
        self.send("stop")

    def result(self) -> float:
        """After :meth:`stop`: wait for the process; the load's bandwidth (GB/s) while it ran."""
        out = self.proc.stdout.readline().split()
        self.proc.wait(timeout=30)
        return float(out[1]) if len(out) == 2 and out[0] == "done" else float("nan")


def settle_time(rate_bins: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Seconds from ``start`` until every later bin up to ``end`` is within 10 % of the phase's steady rate
    (the mean of its second half); ``None`` without bins."""
    bins = [(c, r) for c, r in rate_bins if start <= c < end]
    if len(bins) < 2:
        return None
    tail = bins[len(bins) // 2:]
    steady = sum(r for _, r in tail) / len(tail)
    for i, (c, _) in enumerate(bins):
        if all(abs(r - steady) <= 0.1 * steady for _, r in bins[i:]):
            return c - start
    return end - start


def run_contended(runner: ModelRunner, slots: int, policy: str, hog: Hog | None, a: argparse.Namespace,
                  prompts: list[list[int]], feed: list[int]) -> dict:
    """One decode run of ``a.before_s + a.during_s + a.after_s`` seconds with ``hog``'s load in the middle."""
    runner.set_expert_cache(slots, policy)
    B = len(prompts)
    toks = []
    for i, p in enumerate(prompts):
        toks.append(int(runner.execute([StepInput(i, p, 0)], Phase.PREFILL)[0].argmax()))
    pos = len(prompts[0])
    limit = runner.max_model_len - 8
    step = 0

    def decode_step() -> None:
        nonlocal pos, step
        ids = [feed[(step * B + i) % len(feed)] for i in range(B)]
        logits = runner.execute([StepInput(i, [t], pos) for i, t in enumerate(ids)], Phase.DECODE)
        toks[:] = logits.argmax(dim=-1).tolist()
        pos, step = pos + 1, step + 1

    for _ in range(a.warmup):
        decode_step()
    pol = runner.experts.policy
    auto = pol if isinstance(pol, AutoPolicy) else None
    t_on, t_off, t_end = a.before_s, a.before_s + a.during_s, a.before_s + a.during_s + a.after_s
    times, levels, marks = [], [], {}
    t0 = time.perf_counter()
    phase = 0
    while (now := time.perf_counter() - t0) < t_end and pos < limit:
        if phase == 0 and now >= t_on:
            marks["on"], phase = now, 1
            if hog is not None:
                hog.send("go")
        elif phase == 1 and now >= t_off:
            marks["off"], phase = now, 2
            if hog is not None:
                hog.stop()
        decode_step()
        times.append(time.perf_counter() - t0)
        levels.append(auto.cpu_level if auto is not None else None)
    if phase == 1:
        marks["off"] = times[-1]
        if hog is not None:
            hog.stop()
    marks["hog_gbps"] = hog.result() if hog is not None and phase >= 1 else None
    for i in range(B):
        runner.free(i)
    on, off = marks.get("on", t_on), marks.get("off", t_off)

    def rate(lo: float, hi: float) -> float | None:
        n = sum(1 for t in times if lo <= t < hi)
        return B * n / (hi - lo) if n and hi > lo else None

    edges = [i * a.bin_s for i in range(int(times[-1] / a.bin_s) + 1)]
    bins = [(e + a.bin_s / 2, rate(e, e + a.bin_s)) for e in edges]
    bins = [(c, r) for c, r in bins if r is not None]
    end = times[-1]
    return {
        "policy": policy, "slots": slots, "batch": B, "steps": len(times), "hog_gbps": marks.get("hog_gbps"),
        "before": rate(0.0, on), "during_first_s": rate(on, min(on + 1.0, off)), "during_rest": rate(on + 1.0, off),
        "after_first_s": rate(off, min(off + 1.0, end)), "after_rest": rate(off + 1.0, end),
        "settle_on_s": settle_time(bins, on, off), "settle_off_s": settle_time(bins, off, end),
        "on_s": on, "off_s": off, "bins": bins,
        "levels": None if auto is None else [(round(t, 3), lv) for t, lv in zip(times, levels)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--budget", type=float, default=2.0, help="expert-cache budget in GB")
    ap.add_argument("--policies", default="auto,qstar,fill-all,cpu-all")
    ap.add_argument("--hogs", default="pcie,dram", help="loads to start mid-run: pcie, dram, none (undisturbed)")
    ap.add_argument("--cpu-threads", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--before-s", type=float, default=4.0)
    ap.add_argument("--during-s", type=float, default=6.0)
    ap.add_argument("--after-s", type=float, default=5.0)
    ap.add_argument("--bin-s", type=float, default=0.25, help="width of the tokens/s bins (seconds)")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--pcie-mb", type=float, default=256.0, help="pcie load: bytes per copy (MB)")
    ap.add_argument("--dram-mb", type=float, default=1024.0, help="dram load: buffer copied (MB)")
    ap.add_argument("--dram-threads", type=int, default=0, help="dram load threads (0: every free core)")
    ap.add_argument("--routing", default="uniform", choices=["uniform", "trace"])
    ap.add_argument("--trace", default="", help="--routing trace: routing trace files, comma-separated")
    ap.add_argument("--profile-seconds", type=float, default=0.5)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the fills and the pcie load)")
    model = model_dir(a)
    cfg = EngineConfig(device=a.device, dtype=a.dtype, load_format=a.load_format, expert_cache_slots=0,
                       expert_policy="cpu-all", cpu_threads=a.cpu_threads, max_model_len=4096,
                       max_num_seqs=a.batch, kv_cache_tokens=a.batch * 4096)
    runner = ModelRunner(model, cfg)
    if a.routing == "uniform":
        route_uniformly(runner, seed=1)
    else:
        route_from_trace(runner, [p for p in a.trace.split(",") if p], a.prompt_len)
    print(runner.summary(), flush=True)
    pool, ex = runner.pool, runner.experts.cpu_executor
    prof = measure(pool, pool.layout, runner.device, ex, a.profile_seconds, int(2e9))
    runner.experts.bandwidths = bandwidths_from_profile(prof, "measured by benchmarks/contention.py")
    print(f"CPU executor {ex.name} x {ex.threads} threads; profile {prof}", flush=True)
    plan = getattr(ex, "plan", None)  # the native executor's pinning (the torch executor pins nothing)
    busy = set(plan.cpus if plan is not None else ()) | {0}
    free = [c for c in physical_core_cpus() if c not in busy]
    shares_cores = not free  # the executor holds every core but core 0: the DRAM load then takes cores too
    if shares_cores:
        free = [c for c in physical_core_cpus() if c != 0]
    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    feed = torch.randint(0, vocab, (8192,), generator=g).tolist()
    slots = int(a.budget * 1e9 // pool.row_bytes)
    hog_args = {"pcie": [str(a.pcie_mb * 1e6)],
                "dram": [str(a.dram_mb * 1e6), str(a.dram_threads or max(1, len(free))), ",".join(map(str, free))]}
    results = []
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
            "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(),
                        "torch": torch.__version__},
            "preset": a.preset, "budget_gb": a.budget, "slots": slots, "threads": ex.threads,
            "executor_cpus": sorted(busy - {0}), "dram_cpus": free, "dram_shares_cores": shares_cores,
            "profile": prof, "routing": a.routing,
            "decode_path": runner.experts.decode_path}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> str:
        (out / "contention.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))

        def f(v, d=1):
            return "-" if v is None else f"{v:.{d}f}"

        lines = ["| load | policy | load GB/s | before | load, 1st s | load, rest | after, 1st s | after, rest "
                 "| settle on (s) | settle off (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            lines.append(f"| {r['hog']} | {r['policy']} | {f(r['hog_gbps'])} | {f(r['before'])} | "
                         f"{f(r['during_first_s'])} | {f(r['during_rest'])} | {f(r['after_first_s'])} | "
                         f"{f(r['after_rest'])} | {f(r['settle_on_s'], 2)} | {f(r['settle_off_s'], 2)} |")
        table = "\n".join(lines)
        (out / "contention.md").write_text(table + "\n")
        return table

    for kind in [h for h in a.hogs.split(",") if h]:
        for pol in [p for p in a.policies.split(",") if p]:
            hog = None if kind == "none" else Hog(kind, hog_args[kind])
            try:
                r = run_contended(runner, slots, pol, hog, a, prompts, feed)
            finally:
                if hog is not None and hog.proc.poll() is None:
                    hog.proc.kill()
            r["hog"] = kind
            results.append(r)
            print({k: v for k, v in r.items() if k not in ("bins", "levels")}, flush=True)
            save()
    print(save())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
