"""Decode speed against the CPU executor's thread count, alone and beside competing busy threads.

A pool thread that shares its core with another busy thread loses whole scheduler slices, and every
step waits for its slowest thread: on the H200 host decode with 16 executor threads on 16 cores ran
30 % slower than with 15, the doorbell server, the CUDA driver and the Python thread competing with
the pool. This benchmark sweeps the thread count (``--threads``, default every count from 1 to the
physical cores) in two modes:

- ``executor`` (any machine, no GPU needed): B_H of the native executor, Qwen3-30B-A3B experts
  (9.44 MB bf16) rotating over ``--rotate-gb`` of host memory, ``--experts-per-call`` per step
  (one MoE layer's CPU set), handed over the two ways decode does:
  - ``caller``: the calling thread is worker 0 (CPU-only decode), :meth:`RegisteredStep.bench`;
  - ``doorbell``: the pool's worker 0 is the doorbell server thread and a native thread stands in
    for the GPU, ringing the doorbell, polling the done word every ``--poll-us`` (a sleeping poll:
    the GPU's wait kernel uses no CPU core) and idling ``--gap-us`` between steps (the GPU's own
    work between MoE layers), :meth:`RegisteredStep.bench_served`.
  Each count runs twice: ``planned`` (the engine's rule, :func:`edgemoe.experts.native.plan_threads`:
  no core left for ``caller`` as on a CPU-only machine, ``--alongside`` for ``doorbell``, 1 as on
  CUDA) and ``as asked`` (the count taken as given, ``oversubscribe``). ``--spinners N`` starts N busy-looping processes
  for the whole run: a Python thread spinning in a CUDA stream synchronization, a driver thread,
  another job on the machine.
- ``decode``: the engine's own decode (``benchmarks/decode.py``'s protocol and model options; CUDA
  on the GPU host, or ``--device cpu``) for each count, the executor rebuilt in place
  (:meth:`ModelRunner.set_cpu_threads`) and B_P / B_H measured anew for the q* rule; ``--plans``
  ``planned`` (the engine's cap) and/or ``as-asked`` (the count taken as given).

Prints a table; writes JSON and markdown to ``--out``.

    python benchmarks/thread_scaling.py executor --spinners 1 --out /tmp/ts
    python benchmarks/thread_scaling.py decode --preset qwen3-30b-a3b --budgets 2.42 --policies qstar,cpu-all \\
        --routing uniform --threads 1-16 --out /tmp/ts-decode
"""

from __future__ import annotations

import argparse
import json
import os
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

from edgemoe.experts import native
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

QWEN3_30B_A3B = (2048, 768)  # hidden, moe_intermediate_size


def parse_threads(spec: str | None, cores: int) -> list[int]:
    """``"1-16"``, ``"1,2,4"`` or ``None`` (every count from 1 to ``cores``)."""
    if not spec:
        return list(range(1, cores + 1))
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class Spinners:
    """``n`` busy-looping Python processes for the duration of a ``with`` block."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.2 if self.n else 0)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def executor_sweep(a: argparse.Namespace) -> list[dict]:
    H, I = QWEN3_30B_A3B
    row = 3 * H * I * 2
    pool = HostExpertPool(max(8, int(a.rotate_gb * 1e9) // row), ExpertLayout.build(WeightFormat.BF16, H, I),
                          torch.bfloat16)
    t0 = time.perf_counter()
    pool.fill_random(seed=0)
    print(f"pool: {pool.num_ids} experts x {row / 1e6:.2f} MB = {pool.nbytes / 1e9:.2f} GB, filled in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    order = torch.randperm(pool.num_ids, generator=torch.Generator().manual_seed(1))
    E, T = a.experts_per_call, a.tokens
    rows = []
    with Spinners(a.spinners):
        for n in parse_threads(a.threads, len(native.physical_core_cpus())):
            for how in ("planned", "as asked"):
                for handoff in a.handoffs.split(","):
                    if how == "planned":
                        kw = dict(alongside=a.alongside if handoff == "doorbell" else 0)
                    else:
                        kw = dict(oversubscribe=True)
                    ex = native.NativeCpuExecutor(pool, n, **kw)
                    step = ex.make_step(T, E, E * T, x_dtype=torch.bfloat16)
                    step.x.normal_()
                    try:
                        if handoff == "caller":
                            step.bench(order, T, E, 0.1)  # warm-up
                            waits0 = ex.preempted_waits
                            calls, dt = step.bench(order, T, E, a.seconds)
                            preempted_server = 0
                        else:
                            step.serve(pin_memory=False)
                            step.bench_served(order, T, E, 0.1, a.gap_us, a.poll_us)
                            waits0 = ex.preempted_waits
                            calls, dt = step.bench_served(order, T, E, a.seconds, a.gap_us, a.poll_us)
                            preempted_server = step.preempted
                    finally:
                        server_cpu = step.server_cpu
                        step.close()
                    busy = dt - calls * a.gap_us * 1e-6 if handoff == "doorbell" else dt
                    r = {"threads_asked": n, "plan": how, "threads": ex.threads, "handoff": handoff,
                         "spinners": a.spinners, "pinned": ex.pinned, "server_cpu": server_cpu,
                         "us_per_step": 1e6 * dt / calls, "b_h_gbps": calls * E * row / busy / 1e9,
                         "steps_per_s": calls / dt, "preempted_waits": ex.preempted_waits - waits0,
                         "server_preempted": preempted_server}
                    rows.append(r)
                    print(f"{n:>3} {how:>9} -> {ex.threads:>2} threads {handoff:>8}: {r['b_h_gbps']:6.2f} GB/s "
                          f"{r['us_per_step']:8.1f} us/step  preempted waits {r['preempted_waits']:>5} "
                          f"server {preempted_server:>4}", flush=True)
                del ex
    return rows


def decode_sweep(a: argparse.Namespace) -> tuple[list[dict], dict]:
    from decode import model_dir, route_uniformly, run_one

    from edgemoe.config import EngineConfig
    from edgemoe.engine.model_runner import ModelRunner
    from edgemoe.experts.bandwidth import bandwidths_from_profile, measure

    threads = parse_threads(a.threads, len(native.physical_core_cpus()))
    cfg = EngineConfig(device=a.device, dtype=a.dtype, load_format=a.load_format, expert_cache_slots=0,
                       expert_policy="cpu-all", cpu_threads=threads[0], max_model_len=4096)
    runner = ModelRunner(model_dir(a), cfg)
    if a.routing == "uniform":
        route_uniformly(runner, seed=1)
    print(runner.summary(), flush=True)
    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompt = torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist()
    feed = torch.randint(0, vocab, (a.warmup + a.tokens,), generator=g).tolist()
    row = runner.pool.row_bytes
    rows = []
    with Spinners(a.spinners):
        for n, how in [(n, how) for n in threads for how in a.plans.split(",")]:
            runner.set_cpu_threads(n, oversubscribe=how == "as-asked")
            ex = runner.experts.cpu_executor
            prof = measure(runner.pool, runner.pool.layout, runner.device, ex, a.profile_seconds, 2_000_000_000)
            runner.experts.bandwidths = bandwidths_from_profile(prof, "measured by benchmarks/thread_scaling.py")
            for gb in [float(b) for b in a.budgets.split(",") if b]:
                for pol in [p for p in a.policies.split(",") if p]:
                    r = run_one(runner, int(gb * 1e9 // row), pol, prompt, a.warmup, a.tokens, feed)
                    r.update(threads_asked=n, plan=how, threads=ex.threads, budget_gb=gb, spinners=a.spinners,
                             b_h_gbps=prof["isolated"]["b_h_gbps"], b_p_gbps=prof["isolated"]["b_p_gbps"],
                             decode_path=str(r["decode_path"].value))
                    rows.append(r)
                    print(f"{n:>3} {how:>9} -> {ex.threads:>2} threads {gb:>6} GB {pol:>9}: "
                          f"{r['tokens_per_s']:7.2f} tokens/s (B_H {r['b_h_gbps']:.1f} GB/s, "
                          f"hit rate {r['hit_rate']:.3f}, {r['decode_path']})", flush=True)
    meta = {"summary": runner.summary(), "model": runner.model_config.architecture,
            "preset": a.preset if a.model is None else a.model}
    return rows, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    ex = sub.add_parser("executor", help="B_H of the native executor per thread count (no GPU needed)")
    ex.add_argument("--rotate-gb", type=float, default=4.0, help="rotating expert pool, GB (default 4)")
    ex.add_argument("--experts-per-call", type=int, default=8, help="experts per step (default 8: top-8, batch 1)")
    ex.add_argument("--tokens", type=int, default=1, help="tokens routed to each expert (default 1)")
    ex.add_argument("--gap-us", type=int, default=100, help="device work between two doorbell steps, µs")
    ex.add_argument("--poll-us", type=int, default=50, help="the stand-in device's done-word poll interval, µs")
    ex.add_argument("--alongside", type=int, default=native.ALONGSIDE_CUDA,
                    help="cores the planned doorbell pool leaves to threads beside it (default: as on CUDA)")
    ex.add_argument("--handoffs", default="caller,doorbell", help="caller, doorbell or both (default)")
    ex.add_argument("--seconds", type=float, default=1.0, help="seconds per measurement")
    dec = sub.add_parser("decode", help="the engine's decode per thread count (benchmarks/decode.py options)")
    from decode import add_model_args

    add_model_args(dec)
    dec.add_argument("--budgets", default="2.42", help="expert-cache budgets in GB (default 2.42)")
    dec.add_argument("--policies", default="qstar,cpu-all")
    dec.add_argument("--routing", default="uniform", choices=["uniform", "model"])
    dec.add_argument("--prompt-len", type=int, default=32)
    dec.add_argument("--warmup", type=int, default=8)
    dec.add_argument("--tokens", type=int, default=64)
    dec.add_argument("--profile-seconds", type=float, default=0.5)
    dec.add_argument("--plans", default="planned", help="planned (the engine's cap), as-asked, or both")
    for p in (ex, dec):
        p.add_argument("--threads", help="thread counts, e.g. 1-16 or 1,6,16 (default: 1 to the physical cores)")
        p.add_argument("--spinners", type=int, default=0, help="busy-looping processes beside the run (default 0)")
        p.add_argument("--out", help="folder for thread_scaling.json and thread_scaling.md")
    a = ap.parse_args(argv)

    try:
        native.load_extension()
    except native.NativeUnavailable as e:
        sys.exit(f"thread_scaling: {e}")
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
            "machine": {"platform": platform.platform(), "physical_cores": len(native.physical_core_cpus()),
                        "logical_cpus": os.cpu_count(), "torch": torch.__version__,
                        "load_average": os.getloadavg()}}
    if a.mode == "executor":
        rows = executor_sweep(a)
        lines = ["| threads asked | plan | threads | hand-off | spinners | B_H GB/s | µs/step | preempted waits "
                 "| server preempted |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['threads_asked']} | {r['plan']} | {r['threads']} | {r['handoff']} | {r['spinners']} | "
                  f"{r['b_h_gbps']:.2f} | {r['us_per_step']:.0f} | {r['preempted_waits']} | {r['server_preempted']} |"
                  for r in rows]
    else:
        rows, extra = decode_sweep(a)
        meta.update(extra)
        lines = ["| threads asked | plan | threads | budget (GB) | policy | spinners | tokens/s | ms/token | B_H GB/s "
                 "| hit rate | decode path |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['threads_asked']} | {r['plan']} | {r['threads']} | {r['budget_gb']} | {r['policy']} | "
                  f"{r['spinners']} | {r['tokens_per_s']:.2f} | {r['ms_per_token']:.2f} | {r['b_h_gbps']:.1f} | "
                  f"{r['hit_rate']:.3f} | {r['decode_path']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "thread_scaling.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
        (out / "thread_scaling.md").write_text(table + "\n")
        print(f"wrote {out}/thread_scaling.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
