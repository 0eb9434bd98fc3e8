"""CPU expert executor benchmark: DRAM read bandwidth vs B_H of the native and torch executors.

For each thread count, on this machine:

- **read**: a plain multithreaded read (the native extension's sum-reduce kernel, on the native
  executor's own pinned threads) over the whole rotation pool, several GB: the ceiling. Measured before each
  format's rows at each thread count and after the last; a row's ``read`` is the best of all of them at its
  thread count (as STREAM reports the best of its repetitions: on a shared host one read can come out at half
  the machine's rate, and a ceiling taken from it would flatter every ratio);
- **B_H native / torch**: expert-weight bytes per second each executor consumes computing rotating
  experts of ``--shape`` (default Qwen3-30B-A3B's, H=2048, I=768) through its ``run`` call, for batch 1 and
  batch 8 (every token of the batch routed to every expert computed: the most arithmetic per byte a
  batch of 8 can ask for; real batch-8 decode puts 1-2 tokens on most experts) and for 1 or more
  experts per call (a decode step's CPU set of one MoE layer is one call).
- **formats** (``--format``): bf16 rows (9.44 MB an expert), fp32, and the quantized rows at their packed
  size, computing in bf16 as a quantized release does: fp8 (FP8 block-128, 4.72 MB), mxfp4 (2.51 MB),
  nvfp4 (2.66 MB). B_H is always GB/s of *packed* row bytes (scales and padding included), so
  ``native/read`` is the fraction of the DRAM read bandwidth a format's kernels reach.

With ``--trace N`` each native row also records N of its calls (the executor's call trace: a clock read on the
caller and on each pool thread at the points below) and prints where a call's time goes, medians in µs:
``prep`` (the call's entry to its dispatch: checks, the activation's conversion, the work split), ``wake`` (the
dispatch to the last thread's start), ``phase 1`` (the dispatch to the last thread's end of its gate/up chunks),
``barrier`` (the mean wait there), ``phase 2`` (the barrier's first exit to the last thread's end of its down
chunks),
``join`` (that end to the call's return), ``busy`` (a thread's mean time in chunks over the call's time), the
split behind a call's fixed cost on a host with many cores.

Weights rotate in random order over ``--rotate-gb`` (default 4 GB, > 13x the H200 host's 300 MiB
L3), so they come from DRAM. Prints a table; writes JSON to ``--out`` (a file or a folder).

    python benchmarks/cpu_executor.py --out docs/benchmarks/cpu_executor.json
    python benchmarks/cpu_executor.py --threads 1,6,16 --seconds 2 --out /tmp/cpu.json
    python benchmarks/cpu_executor.py --format bf16,fp8,mxfp4,nvfp4 --threads 6,15 --batch 1 --executors native
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.experts import native
from edgemoe.experts.bandwidth import measure_cpu
from edgemoe.experts.cpu_executor import TorchCpuExecutor
from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat

FORMATS = {"bf16": WeightFormat.BF16, "fp32": WeightFormat.FP32, "fp8": WeightFormat.FP8_BLOCK,
           "mxfp4": WeightFormat.MXFP4, "nvfp4": WeightFormat.NVFP4}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _l3_bytes() -> int | None:
    try:
        for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (idx / "level").read_text().strip() == "3":
                size = (idx / "size").read_text().strip()
                return int(size[:-1]) * {"K": 1024, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
    except (OSError, ValueError, KeyError):
        pass
    return None


def read_bandwidth(ex: native.NativeCpuExecutor, pool: HostExpertPool, seconds: float) -> float:
    """GB/s of a parallel sum over the pool's byte bank (its bytes read as float32), whole passes."""
    views = [pool.bank.view(-1).view(torch.float32)]  # the rows as float32: a byte stream
    nbytes = sum(v.numel() * 4 for v in views)
    for v in views:  # warm-up pass
        ex.sum_f32(v)
    moved, t0 = 0, time.perf_counter()
    while True:
        for v in views:
            ex.sum_f32(v)
        moved += nbytes
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return moved / dt / 1e9


def call_breakdown(records: torch.Tensor) -> dict[str, float]:
    """Where the traced calls' time went (``NativeCpuExecutor.traced``: ``[calls, 3 + 4 * threads]`` int64 ns):
    medians over the calls, in µs, of ``total`` (entry to return), ``prep`` (entry to dispatch), ``wake`` (dispatch
    to the last thread's start), ``phase1`` (dispatch to the last thread's end of phase 1), ``barrier`` (the
    threads' mean wait between their phase-1 end and the barrier's exit), ``phase2`` (the barrier's first exit to
    the last thread's end of phase 2), ``join`` (that end to the return), and ``busy`` (the threads' mean time in
    chunks over the call's total; a fraction). Threads that did not run a call (0 stamps) are left out of it.

    Raises:
        ValueError: no call recorded.
    """
    if records.numel() == 0:
        raise ValueError("no call was traced")
    entry, dispatch, ret = (records[:, i].double() for i in range(3))
    th = records[:, 3:].view(records.shape[0], -1, 4).double()  # [calls, threads, 4]
    ran = th[:, :, 0] > 0
    small = torch.tensor(float("-inf"), dtype=torch.float64)

    def last(col: int) -> torch.Tensor:
        return torch.where(ran, th[:, :, col], small).amax(1)

    def first(col: int) -> torch.Tensor:
        return torch.where(ran, th[:, :, col], -small).amin(1)

    def mean(v: torch.Tensor) -> torch.Tensor:
        return torch.where(ran, v, 0.0).sum(1) / ran.sum(1)

    busy = (th[:, :, 1] - th[:, :, 0]) + (th[:, :, 3] - th[:, :, 2])
    parts = {"total": ret - entry, "prep": dispatch - entry, "wake": last(0) - dispatch,
             "phase1": last(1) - dispatch, "barrier": mean(th[:, :, 2] - th[:, :, 1]),
             "phase2": last(3) - first(2), "join": ret - last(3)}
    out = {k: float(v.median()) / 1e3 for k, v in parts.items()}
    out["busy"] = float((mean(busy) / (ret - entry)).median())
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ncores = len(native.physical_core_cpus())
    default_threads = sorted({t for t in (1, 2, 4, 6, 8, 12, 16, 24, 32) if t <= ncores} | {ncores})
    ap.add_argument("--threads", default=",".join(map(str, default_threads)),
                    help=f"thread counts (default: {','.join(map(str, default_threads))}; {ncores} physical cores "
                         "here)")
    ap.add_argument("--batch", default="1,8", help="tokens routed to every expert computed (default 1,8)")
    ap.add_argument("--experts-per-call", default="1,4", help="experts per run() call (default 1,4)")
    ap.add_argument("--rotate-gb", type=float, default=4.0, help="size of the rotating expert pool, GB (default 4)")
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per measurement (default 1)")
    ap.add_argument("--format", default="bf16",
                    help=f"expert row formats, comma-separated ({', '.join(FORMATS)}; default bf16); quantized rows "
                         "compute in bf16")
    ap.add_argument("--shape", default="2048,768",
                    help="expert shape hidden,moe_intermediate (default Qwen3-30B-A3B's 2048,768; gpt-oss: 2880,2880; "
                         "Qwen3.6-35B-A3B: 2048,512)")
    ap.add_argument("--isa", default=None, help=f"cap the native ISA ({', '.join(native.ISA_LEVELS)})")
    ap.add_argument("--min-chunk-kb", type=int, default=None,
                    help="the native executor's floor on a chunk's weights, KiB (default its own, "
                         f"{native.DEFAULT_MIN_CHUNK_BYTES // 1024}; 0: four chunks per thread whatever their size)")
    ap.add_argument("--executors", default="native,torch", help="which executors (default native,torch)")
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="trace N calls of each native row and print where a call's time goes (default 0: off)")
    ap.add_argument("--out", default=None, help="JSON output file, or a folder for cpu_executor.json")
    args = ap.parse_args(argv)

    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    epcs = [int(e) for e in args.experts_per_call.split(",")]
    kinds = args.executors.split(",")
    formats = args.format.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        sys.exit(f"cpu_executor benchmark: unknown --format {unknown}; choose from {list(FORMATS)}")
    try:
        H, I = (int(v) for v in args.shape.split(","))
    except ValueError:
        sys.exit(f"cpu_executor benchmark: --shape takes hidden,moe_intermediate, got {args.shape!r}")

    t0 = time.perf_counter()
    try:
        native.load_extension()
    except native.NativeUnavailable as e:
        sys.exit(f"cpu_executor benchmark: {e}")
    b = native.build()
    build = {"seconds": b.seconds, "cached": b.cached, "dir": b.dir, "builder": b.builder,
             "cflags": native.cflags()}
    print(f"native extension: {'cached' if build.get('cached') else 'compiled'} in {time.perf_counter() - t0:.1f} s "
          f"({build.get('dir')})", flush=True)

    min_chunk = native.DEFAULT_MIN_CHUNK_BYTES if args.min_chunk_kb is None else 1024 * args.min_chunk_kb
    torch_threads0 = torch.get_num_threads()
    rows, experts, reads = [], {}, {}
    hdr = f"{'format':>6} {'thr':>3} {'batch':>5} {'exp/call':>8} {'read GB/s':>9} {'native GB/s':>11} " \
          f"{'torch GB/s':>10} {'native/read':>11} {'torch/read':>10} {'native/torch':>12}"
    for name in formats:
        lay = ExpertLayout.build(FORMATS[name], H, I)
        n_ids = max(8, int(args.rotate_gb * 1e9) // lay.row_bytes)
        pool = HostExpertPool(n_ids, lay, None if lay.format.dense else torch.bfloat16)
        t0 = time.perf_counter()
        pool.fill_random(seed=0)
        experts[name] = {"row_bytes": lay.row_bytes, "rotated_bytes": pool.nbytes, "experts": n_ids,
                         "compute_dtype": str(pool.compute_dtype).replace("torch.", "")}
        print(f"\n{name} pool: {n_ids} experts x {lay.row_bytes / 1e6:.2f} MB = {pool.nbytes / 1e9:.2f} GB "
              f"(computing in {experts[name]['compute_dtype']}), filled in {time.perf_counter() - t0:.1f} s; "
              f"L3 {(_l3_bytes() or 0) / 2**20:.0f} MiB", flush=True)
        print(hdr)
        print("-" * len(hdr))
        for t in threads:
            ex = native.NativeCpuExecutor(pool, t, isa=args.isa, min_chunk_bytes=min_chunk)
            torch.set_num_threads(t)
            te = TorchCpuExecutor(pool) if "torch" in kinds else None
            reads.setdefault(t, []).append(read_bandwidth(ex, pool, args.seconds))
            read = max(reads[t])
            for b in batches:
                for epc in epcs:
                    res = {"format": name, "threads": t, "batch": b, "experts_per_call": epc, "read_gbps": read,
                           "native_isa": ex.isa, "pinned": ex.pinned}
                    for kind, e in (("native", ex if "native" in kinds else None), ("torch", te)):
                        if e is None:
                            continue
                        measure_cpu(pool, e, 0.1, tokens=b, experts_per_call=epc)  # warm-up
                        res[f"{kind}_gbps"] = measure_cpu(pool, e, args.seconds, tokens=b, experts_per_call=epc)
                        if kind == "native" and args.trace > 0:  # apart from the rate's own measurement
                            e.trace_calls(args.trace)
                            measure_cpu(pool, e, 0.1, tokens=b, experts_per_call=epc)
                            res["native_trace_us"] = call_breakdown(e.traced())
                            e.trace_calls(0)
                    rows.append(res)
                    nat, tor = res.get("native_gbps"), res.get("torch_gbps")
                    f = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
                    print(f"{name:>6} {t:>3} {b:>5} {epc:>8} {read:>9.2f} {f(nat):>11} {f(tor):>10} "
                          f"{f(nat and nat / read):>11} {f(tor and tor / read):>10} "
                          f"{f(nat and tor and nat / tor):>12}", flush=True)
                    if "native_trace_us" in res:
                        tr = res["native_trace_us"]
                        print("       trace (µs, medians): " + ", ".join(
                            f"{k} {v:.2f}" if k == "busy" else f"{k} {v:.1f}" for k, v in tr.items()), flush=True)
            if name == formats[-1]:  # the last pool: one more read after its rows
                reads[t].append(read_bandwidth(ex, pool, args.seconds))
            del ex, te
            gc.collect()
        del pool
        gc.collect()
    torch.set_num_threads(torch_threads0)
    for r in rows:  # every row against the best read at its thread count
        r["read_gbps"] = max(reads[r["threads"]])
    print("\nread GB/s per thread count, each measurement (the best is every row's ceiling): "
          + "; ".join(f"{t}: " + ", ".join(f"{v:.1f}" for v in vs) for t, vs in reads.items()))
    print(f"{'format':>6} {'thr':>3} {'batch':>5} {'exp/call':>8} {'best read':>9} {'native/read':>11}")
    for r in rows:
        if r.get("native_gbps"):
            print(f"{r['format']:>6} {r['threads']:>3} {r['batch']:>5} {r['experts_per_call']:>8} "
                  f"{r['read_gbps']:>9.2f} {r['native_gbps'] / r['read_gbps']:>11.2f}")

    result = {
        "benchmark": "cpu_executor",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpu": _cpu_model(), "physical_cores": ncores,
                    "logical_cpus": os.cpu_count(), "l3_bytes": _l3_bytes(), "torch": torch.__version__},
        "isa": native.isa_report(),
        "build": build,
        "expert": {"hidden": H, "intermediate": I, "formats": experts},
        "seconds_each": args.seconds,
        "min_chunk_bytes": min_chunk,
        "reads_gbps": {str(t): vs for t, vs in reads.items()},
        "rows": rows,
    }
    if args.out:
        out = Path(args.out)
        if out.is_dir() or not out.suffix:
            out.mkdir(parents=True, exist_ok=True)
            out = out / "cpu_executor.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
