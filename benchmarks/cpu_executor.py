"""CPU expert executor benchmark: DRAM read bandwidth vs B_H of the native and torch executors.

For each thread count, on this machine:

- **read**: a plain multithreaded read (the native extension's sum-reduce kernel, on the native
  executor's own pinned threads) over the whole rotation pool, several GB: the ceiling;
- **B_H native / torch**: expert-weight bytes per second each executor consumes computing rotating
  Qwen3-30B-A3B experts (H=2048, I=768, bf16: 9.44 MB each) through its ``run`` call, for batch 1 and
  batch 8 (every token of the batch routed to every expert computed: the most arithmetic per byte a
  batch of 8 can ask for; real batch-8 decode puts 1-2 tokens on most experts) and for 1 or more
  experts per call (a decode step's CPU set of one MoE layer is one call).

Weights rotate in random order over ``--rotate-gb`` (default 4 GB, > 13x the H200 host's 300 MiB
L3), so they come from DRAM. Prints a table; writes JSON to ``--out`` (a file or a folder).

    python benchmarks/cpu_executor.py --out docs/benchmarks/cpu_executor.json
    python benchmarks/cpu_executor.py --threads 1,6,16 --seconds 2 --out /tmp/cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.experts import native  # noqa: E402
from edgemoe.experts.bandwidth import measure_cpu  # noqa: E402
from edgemoe.experts.cpu_executor import TorchCpuExecutor  # noqa: E402
from edgemoe.experts.pool import HostExpertPool  # noqa: E402

QWEN3_30B_A3B = (2048, 768)  # hidden, moe_intermediate_size


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ncores = len(native.physical_core_cpus())
    default_threads = sorted({t for t in (1, 2, 4, 6, 8, 12, 16, 24, 32) if t <= ncores} | {ncores})
    ap.add_argument("--threads", default=",".join(map(str, default_threads)),
                    help=f"thread counts (default: {','.join(map(str, default_threads))}; {ncores} physical cores here)")
    ap.add_argument("--batch", default="1,8", help="tokens routed to every expert computed (default 1,8)")
    ap.add_argument("--experts-per-call", default="1,4", help="experts per run() call (default 1,4)")
    ap.add_argument("--rotate-gb", type=float, default=4.0, help="size of the rotating expert pool, GB (default 4)")
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per measurement (default 1)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--isa", default=None, help=f"cap the native ISA ({', '.join(native.ISA_LEVELS)})")
    ap.add_argument("--executors", default="native,torch", help="which executors (default native,torch)")
    ap.add_argument("--out", default=None, help="JSON output file, or a folder for cpu_executor.json")
    args = ap.parse_args(argv)

    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    epcs = [int(e) for e in args.experts_per_call.split(",")]
    kinds = args.executors.split(",")
    dtype = getattr(torch, args.dtype)
    H, I = QWEN3_30B_A3B
    row = 3 * H * I * torch.empty((), dtype=dtype).element_size()
    n_ids = max(8, int(args.rotate_gb * 1e9) // row)

    t0 = time.perf_counter()
    try:
        native.load_extension()
    except native.NativeUnavailable as e:
        sys.exit(f"cpu_executor benchmark: {e}")
    b = native.build()
    build = {"seconds": b.seconds, "cached": b.cached, "dir": b.dir, "builder": b.builder}
    print(f"native extension: {'cached' if build.get('cached') else 'compiled'} in {time.perf_counter() - t0:.1f} s "
          f"({build.get('dir')})", flush=True)
    pool = HostExpertPool.dense(n_ids, H, I, dtype)
    t0 = time.perf_counter()
    pool.fill_random(seed=0)
    print(f"pool: {n_ids} experts x {row / 1e6:.2f} MB = {pool.nbytes / 1e9:.2f} GB ({args.dtype}), "
          f"filled in {time.perf_counter() - t0:.1f} s; L3 {(_l3_bytes() or 0) / 2**20:.0f} MiB", flush=True)

    torch_threads0 = torch.get_num_threads()
    rows = []
    hdr = f"{'thr':>3} {'batch':>5} {'exp/call':>8} {'read GB/s':>9} {'native GB/s':>11} {'torch GB/s':>10} " \
          f"{'native/read':>11} {'torch/read':>10} {'native/torch':>12}"
    print(hdr)
    print("-" * len(hdr))
    for t in threads:
        ex = native.NativeCpuExecutor(pool, t, isa=args.isa)
        torch.set_num_threads(t)
        te = TorchCpuExecutor(pool) if "torch" in kinds else None
        read = read_bandwidth(ex, pool, args.seconds)
        for b in batches:
            for epc in epcs:
                res = {"threads": t, "batch": b, "experts_per_call": epc, "read_gbps": read,
                       "native_isa": ex.isa, "pinned": ex.pinned}
                for kind, e in (("native", ex if "native" in kinds else None), ("torch", te)):
                    if e is None:
                        continue
                    measure_cpu(pool, e, 0.1, tokens=b, experts_per_call=epc)  # warm-up
                    res[f"{kind}_gbps"] = measure_cpu(pool, e, args.seconds, tokens=b, experts_per_call=epc)
                rows.append(res)
                nat, tor = res.get("native_gbps"), res.get("torch_gbps")
                f = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
                print(f"{t:>3} {b:>5} {epc:>8} {read:>9.2f} {f(nat):>11} {f(tor):>10} "
                      f"{f(nat and nat / read):>11} {f(tor and tor / read):>10} {f(nat and tor and nat / tor):>12}",
                      flush=True)
        del ex, te
        gc.collect()
    torch.set_num_threads(torch_threads0)

    result = {
        "benchmark": "cpu_executor",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpu": _cpu_model(), "physical_cores": ncores,
                    "logical_cpus": os.cpu_count(), "l3_bytes": _l3_bytes(), "torch": torch.__version__},
        "isa": native.isa_report(),
        "build": build,
        "expert": {"hidden": H, "intermediate": I, "dtype": args.dtype, "row_bytes": row,
                   "rotated_bytes": pool.nbytes, "experts": n_ids},
        "seconds_each": args.seconds,
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
